"""The transformers fallback: architectures with no native class (GPT-NeoX, OPT, Falcon, ERNIE)
run through their own transformers class, against transformers run alone per prompt on the
same random weights; selection by `model_impl`; the refusals; the CLI and the server."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import assert_rel_close, engine_hidden, random_prompts, save_hf_model
from tests.tasks.conftest import with_minilm_tokenizer
from vecpool.cli import main
from vecpool.tasks import PoolingParams

LENGTHS = [5, 17, 3, 30, 11]
NUM_LABELS = 3


def _config(arch: str, **overrides: Any) -> Any:
    """A tiny random config of `arch`: 2 layers, hidden 32."""
    common: dict[str, Any] = dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )
    common.update(num_labels=NUM_LABELS, **overrides)
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(
            intermediate_size=37, max_position_embeddings=64, pad_token_id=0, **common
        )
    if arch == "opt":
        return transformers.OPTConfig(
            ffn_dim=37, max_position_embeddings=64, word_embed_proj_dim=32, **common
        )
    if arch == "falcon":
        return transformers.FalconConfig(pad_token_id=0, **common)
    assert arch == "ernie"
    return transformers.ErnieConfig(intermediate_size=37, max_position_embeddings=64, **common)


CLASSES = {
    "gpt_neox": "GPTNeoX",
    "opt": "OPT",
    "falcon": "Falcon",
    "ernie": "Ernie",
}
ARCHS = list(CLASSES)


def _hf(arch: str, head: str, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers `<Family><head>` model of `arch`, in eval mode."""
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[arch] + head)
    return cls(_config(arch, **overrides)).eval()


@pytest.fixture(scope="module", params=ARCHS)
def classifier(request, tmp_path_factory) -> tuple[vecpool.Engine, Any]:
    """(engine, HF model) of a `*ForSequenceClassification` with no native vecpool class,
    asked to embed too (its base model's states, which the tests compare)."""
    hf = _hf(request.param, "ForSequenceClassification")
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return vecpool.Engine(folder, device="cpu", tasks=("embed", "token_embed")), hf


@torch.no_grad()
def _ref_hidden(hf: Any, ids: list[int]) -> np.ndarray:
    """`[n, hidden]`: the class's base model on one unpadded prompt."""
    return hf.base_model(input_ids=torch.tensor([ids]))[0][0].float().numpy()


@torch.no_grad()
def _ref_logits(hf: Any, ids: list[int]) -> np.ndarray:
    """The class's own logits on one unpadded prompt (its head as it runs it)."""
    return hf(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def test_selected_through_transformers(classifier) -> None:
    engine, hf = classifier
    info = engine.info()
    assert info.model_impl == "transformers"
    assert engine.model.is_causal == (
        not isinstance(hf, transformers.ErnieForSequenceClassification)
    )
    assert {"embed", "classify", "token_embed"} <= set(info.tasks)


def test_hidden_states_of_a_mixed_batch_match_transformers(classifier) -> None:
    engine, hf = classifier
    prompts = random_prompts(engine.model.vocab_size, LENGTHS)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, _ref_hidden(hf, prompt), rtol=1e-5)


def test_classify_matches_transformers(classifier) -> None:
    engine, hf = classifier
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=1)
    logits = engine.classify(prompts, use_activation=False)
    for prompt, row in zip(prompts, logits, strict=True):
        assert_rel_close(np.asarray(row), _ref_logits(hf, prompt), rtol=1e-5)


def test_prompt_embeds_bit_exact(classifier) -> None:
    engine, _ = classifier
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=2)
    as_ids = engine_hidden(engine, prompts)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    # The embeds are the class's own get_input_embeddings() lookup: the same forward.
    for a, b in zip(as_ids, mixed, strict=True):
        assert np.abs(a - b).max() == 0.0
    for a, b in zip(as_ids, engine_hidden(engine, embeds), strict=True):
        assert np.abs(a - b).max() == 0.0
    scores = engine.classify([embeds[1], prompts[3]], use_activation=False)
    expected = engine.classify([prompts[1], prompts[3]], use_activation=False)
    assert np.abs(np.stack(scores) - np.stack(expected)).max() == 0.0


def test_classify_and_embed_requests_share_one_step(classifier) -> None:
    """The HF head runs on the pooled rows, so a classify request and an embed request of
    other lengths in one step each get what transformers gives that prompt alone."""
    engine, hf = classifier
    classify, embed = random_prompts(engine.model.vocab_size, [9, 21], seed=3)
    groups = [
        engine.make_requests([classify], PoolingParams(task="classify", use_activation=False)),
        engine.make_requests([embed], PoolingParams(task="embed", normalize=False)),
    ]
    steps = engine.core.num_steps
    requests = [r for g in groups for r in g]
    engine.core.add_requests(requests)
    engine.core.run_until_done(requests)
    assert engine.core.num_steps == steps + 1
    assert all(r.error is None for r in requests)
    assert_rel_close(np.asarray(requests[0].output), _ref_logits(hf, classify))
    row = -1 if engine.model.is_causal else 0  # LAST for decoders, CLS for encoders
    assert_rel_close(np.asarray(requests[1].output), _ref_hidden(hf, embed)[row])


@pytest.mark.parametrize("arch", ["gpt_neox", "falcon", "ernie"])
def test_token_classify_matches_transformers(arch: str, tmp_path: Path) -> None:
    hf = _hf(arch, "ForTokenClassification", seed=4)
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=4)
    out = engine.encode(prompts, task="token_classify", use_activation=False)
    for prompt, rows in zip(prompts, out, strict=True):
        assert_rel_close(rows, _ref_logits(hf, prompt))


def test_masked_lm_sparse_matches_transformers(tmp_path: Path) -> None:
    hf = _hf("ernie", "ForMaskedLM", seed=5)
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    assert "sparse" in engine.info().tasks
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=5)
    # SPLADE's default pooling of a *ForMaskedLM folder: max over tokens of log(1 + relu).
    for prompt, vector in zip(prompts, engine.encode(prompts, task="sparse"), strict=True):
        expected = np.log1p(np.maximum(_ref_logits(hf, prompt), 0)).max(axis=0)
        assert_rel_close(vector, expected)


@pytest.mark.parametrize("arch", ["gpt_neox", "opt"])
def test_causal_lm_logits_match_transformers(arch: str, tmp_path: Path) -> None:
    hf = _hf(arch, "ForCausalLM", seed=6)
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    prompts = random_prompts(engine.model.vocab_size, [7, 12], seed=6)
    vocab_ids = torch.tensor([5, 17, 42])
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        with torch.inference_mode():
            rows = torch.from_numpy(hidden)
            logits = engine.model.compute_logits(rows).numpy()
            picked = engine.model.compute_logits(rows, vocab_ids).numpy()
        expected = _ref_logits(hf, prompt)
        assert_rel_close(logits, expected)
        assert_rel_close(picked, expected[:, vocab_ids.numpy()])


def test_base_model_folder_embeds_like_transformers(tmp_path: Path) -> None:
    """A folder of the base class (AutoModel): hidden states, LAST pooling (causal), no heads."""
    hf = _hf("gpt_neox", "Model", seed=7)
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    assert engine.info().tasks == ("embed", "token_embed")
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=7)
    vectors = engine.embed(prompts)
    for prompt, vector in zip(prompts, vectors, strict=True):
        last = _ref_hidden(hf, prompt)[-1]
        assert_rel_close(vector, last / np.linalg.norm(last))


def test_prompts_run_whole_without_step_optimizations(classifier) -> None:
    """No chunked prefill, CUDA graphs or compile: a prompt over the step budget runs alone."""
    engine, hf = classifier
    folder = engine.info().model_path
    small = vecpool.Engine(folder, device="cpu", max_num_batched_tokens=8, tasks=("token_embed",))
    assert small.scheduler_config.max_cached_tokens == 0
    assert small.model_runner.kv_cache is None
    assert small.model_runner.graphs is None and not small.model_runner.compiled
    prompts = random_prompts(engine.model.vocab_size, [20, 3, 5, 13], seed=8)
    steps = small.core.num_steps
    hidden = engine_hidden(small, prompts)
    assert small.core.num_steps - steps == 3  # 20 alone, 3 + 5 together, 13 alone
    for prompt, rows in zip(prompts, hidden, strict=True):
        assert_rel_close(rows, _ref_hidden(hf, prompt))


# ---- selection: model_impl --------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory) -> Path:
    torch.manual_seed(9)
    hf = transformers.BertForSequenceClassification(
        tiny_bert_config(num_labels=NUM_LABELS, initializer_range=0.2)
    ).eval()
    return save_hf_model(hf, tmp_path_factory.mktemp("bert_cls"))


def test_native_bert_through_transformers_equals_native(bert_classifier: Path, caplog) -> None:
    both = {"device": "cpu", "tasks": ("embed", "token_embed")}  # their states compared too
    native = vecpool.Engine(bert_classifier, **both)
    with caplog.at_level(logging.WARNING, logger="vecpool.models.loading.transformers_fallback"):
        forced = vecpool.Engine(bert_classifier, model_impl="transformers", **both)
    said = [r.getMessage() for r in caplog.records if "through transformers" in r.getMessage()]
    assert said == [
        "running BertForSequenceClassification through transformers: slower; native "
        "families are listed in the README"
    ]
    assert native.info().model_impl == "vecpool"
    assert forced.info().model_impl == "transformers"
    prompts = random_prompts(99, LENGTHS, seed=9)
    for a, b in zip(engine_hidden(forced, prompts), engine_hidden(native, prompts), strict=True):
        assert_rel_close(a, b)
    forced_scores = np.stack(forced.classify(prompts, use_activation=False))
    assert_rel_close(forced_scores, np.stack(native.classify(prompts, use_activation=False)))
    assert_rel_close(forced.embed(prompts), native.embed(prompts))


@pytest.mark.parametrize("option", ["compile", "cuda_graphs"])
def test_compile_and_graphs_are_refused(bert_classifier: Path, option: str) -> None:
    with pytest.raises(vecpool.ConfigError, match="runs through transformers"):
        vecpool.Engine(bert_classifier, device="cpu", model_impl="transformers", **{option: True})


def test_model_impl_vecpool_refuses_a_folder_with_no_native_class(classifier) -> None:
    engine, _ = classifier
    arch = engine.info().architecture
    with pytest.raises(vecpool.ConfigError, match=f"'{arch}' is not supported natively") as exc:
        vecpool.Engine(engine.info().model_path, device="cpu", model_impl="vecpool")
    assert "BertModel" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(vecpool.ConfigError, match="model_impl 'torch' is not one of"):
        vecpool.Engine(engine.info().model_path, device="cpu", model_impl="torch")


# ---- refusals ---------------------------------------------------------------------------


def _edited_copy(source: Path, target: Path, **config: Any) -> Path:
    shutil.copytree(source, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(config)
    (target / "config.json").write_text(json.dumps(cfg))
    return target


def test_remote_code_is_refused(classifier, tmp_path: Path) -> None:
    engine, _ = classifier
    auto_map = {"AutoModel": "modeling_custom.CustomModel"}
    folder = _edited_copy(Path(engine.info().model_path), tmp_path / "m", auto_map=auto_map)
    (folder / "modeling_custom.py").write_text("raise SystemExit('this must never run')\n")
    with pytest.raises(vecpool.ModelLoadError, match="never runs code from a model folder"):
        vecpool.Engine(folder, device="cpu")
    with pytest.raises(vecpool.ModelLoadError, match="never runs code from a model folder"):
        vecpool.Engine(folder, device="cpu", model_impl="transformers")


def test_architecture_unknown_to_transformers_is_refused(classifier, tmp_path: Path) -> None:
    engine, _ = classifier
    name = "NoSuchModelForSequenceClassification"
    folder = _edited_copy(Path(engine.info().model_path), tmp_path / "m", architectures=[name])
    with pytest.raises(vecpool.ConfigError, match=f"'{name}' is not supported") as exc:
        vecpool.Engine(folder, device="cpu")
    message = str(exc.value)
    assert "transformers" in message and "BertModel" in message  # what runs natively


def test_transformers_not_installed_is_refused(classifier, monkeypatch) -> None:
    engine, _ = classifier
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(vecpool.ModelLoadError, match=r"pip install 'vecpool\[hf\]'"):
        vecpool.Engine(engine.info().model_path, device="cpu")


def test_a_head_that_is_not_one_row_is_refused(tmp_path: Path) -> None:
    """XLNet's classifier is a sequence summary and a projection: refused at load."""
    torch.manual_seed(10)
    config = transformers.XLNetConfig(vocab_size=99, d_model=32, n_layer=2, n_head=4, d_inner=37)
    hf = transformers.XLNetForSequenceClassification(config).eval()
    with pytest.raises(vecpool.ConfigError, match="cannot serve its sequence_classifier head"):
        vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")


def test_missing_tensors_are_refused(classifier, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    engine, _ = classifier
    folder = Path(shutil.copytree(engine.info().model_path, tmp_path / "m"))
    state = load_file(str(folder / "model.safetensors"))
    dropped = next(k for k in state if k.endswith("weight") and "layers" not in k)
    del state[dropped]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(vecpool.ModelLoadError, match="missing"):
        vecpool.Engine(folder, device="cpu")


# ---- end to end: the CLI and the server -------------------------------------------------

TEXTS = ["A man is playing a guitar.", "The stock market fell sharply today.", "Hello"]


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory, default_model_dir: Path) -> tuple[Path, Any]:
    """An ERNIE base model on the MiniLM vocabulary and tokenizer (no native class)."""
    hf = _hf("ernie", "Model", seed=11, vocab_size=30522)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("ernie_text"))
    return with_minilm_tokenizer(folder, default_model_dir), hf


def _cls_vectors(hf: Any, folder: Path) -> np.ndarray:
    """The normalized CLS rows transformers gives each of TEXTS alone."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128; the texts are short: no truncation
    rows = [_ref_hidden(hf, tokenizer.encode(text).ids)[0] for text in TEXTS]
    return np.stack([r / np.linalg.norm(r) for r in rows])


def test_cli_embed_end_to_end(text_folder, tmp_path: Path) -> None:
    folder, hf = text_folder
    source = tmp_path / "texts.txt"
    source.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    out = tmp_path / "vectors.npy"
    args = ["embed", str(folder), "-i", str(source), "-o", str(out), "-q"]
    assert main([*args, "--device", "cpu", "--model-impl", "auto"]) == 0
    assert_rel_close(np.load(out), _cls_vectors(hf, folder))
    assert main([*args, "--device", "cpu", "--model-impl", "vecpool"]) == 2  # refused


def test_server_end_to_end(text_folder) -> None:
    from tests.server.asgi import NAME, serving

    folder, hf = text_folder
    engine = vecpool.Engine(folder, device="cpu")

    async def scenario() -> tuple[Any, Any]:
        async with serving(engine) as (client, _):
            embedded = await client.post("/v1/embeddings", json={"model": NAME, "input": TEXTS})
            info = await client.get("/info")
            return embedded, info

    embedded, info = asyncio.run(scenario())
    assert embedded.status_code == 200, embedded.text
    vectors = np.array([d["embedding"] for d in embedded.json()["data"]], dtype=np.float32)
    assert_rel_close(vectors, _cls_vectors(hf, folder))
    assert info.status_code == 200
    assert info.json()["model_impl"] == "transformers"
