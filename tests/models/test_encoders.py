"""MPNet, DistilBERT, ALBERT and ELECTRA against Hugging Face transformers on the same random
weights: hidden states of a batch mixing lengths, every head (sequence and token
classification, masked-LM logits and SPLADE vectors), prompt embeds, and MPNet as
sentence-transformers loads all-mpnet-base-v2 (bare weights under `MPNetForMaskedLM`).

Hugging Face runs each prompt alone and unpadded, with eager attention; the engine runs them in
one flat batch.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

import vecpool
from tests.helpers import (
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
    write_st_modules,
)

VOCAB = 99
NUM_LABELS = 3
LENGTHS = [5, 17, 3, 40, 11]  # MPNet: distances past the exact buckets (8) into the log bins
SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    initializer_range=0.2,  # weights large enough that a wrong bias or position shows
)


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[..., Any]  # the transformers config class
    options: dict[str, Any]  # its arguments
    prefix: str  # transformers' class-name prefix: MPNet, DistilBert, Albert, Electra

    def hf_model(self, head: str = "Model", **overrides: Any) -> Any:
        """A random transformers `{prefix}{head}` model (eager attention, eval mode)."""
        torch.manual_seed(0)
        cfg = self.config(**{**self.options, **overrides})
        cfg._attn_implementation = "eager"
        cls = getattr(transformers, f"{self.prefix}{head}")
        return cls(cfg).eval()


FAMILIES = [
    # max_position_embeddings: MPNet counts positions from 2, so 66 leaves 64.
    Family(
        "mpnet",
        transformers.MPNetConfig,
        dict(SIZES, max_position_embeddings=66, layer_norm_eps=1e-5),
        "MPNet",
    ),
    Family(
        "distilbert",
        transformers.DistilBertConfig,
        dict(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=37,
            max_position_embeddings=64,
            initializer_range=0.2,
        ),
        "DistilBert",
    ),
    # Three layers over two groups of two inner layers: groups 0, 0, 1 (six layers applied).
    Family(
        "albert",
        transformers.AlbertConfig,
        dict(
            SIZES,
            num_hidden_layers=3,
            num_hidden_groups=2,
            inner_group_num=2,
            embedding_size=16,
            max_position_embeddings=64,
        ),
        "Albert",
    ),
    Family(
        "electra",
        transformers.ElectraConfig,
        dict(SIZES, embedding_size=16, max_position_embeddings=64),
        "Electra",
    ),
]
IDS = [f.name for f in FAMILIES]


def _engine(family: Family, head: str, tmp: Path, **overrides: Any) -> tuple[vecpool.Engine, Any]:
    """(engine, transformers model) for a saved `{prefix}{head}`; the engine runs our class."""
    hf = family.hf_model(head, **overrides)
    engine = vecpool.Engine(save_hf_model(hf, tmp), device="cpu")
    assert type(engine.model).__module__ == f"vecpool.models.architectures.{family.name}"
    return engine, hf


@pytest.fixture(scope="module", params=FAMILIES, ids=IDS)
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    family: Family = request.param
    return _engine(family, "Model", tmp_path_factory.mktemp(family.name))


def test_hidden_states_match_transformers(base: tuple[vecpool.Engine, Any]) -> None:
    engine, hf = base
    prompts = random_prompts(VOCAB, LENGTHS)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))


def test_prompt_embeds_bit_exact_alone_and_mixed(base: tuple[vecpool.Engine, Any]) -> None:
    engine, _ = base
    prompts = random_prompts(VOCAB, LENGTHS, seed=4)
    as_ids = engine_hidden(engine, prompts)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    as_embeds = engine_hidden(engine, embeds)
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    # The embeds are the model's own lookup written into the rows the ids would fill (ALBERT,
    # ELECTRA: zero-padded to the hidden size), so the forward is the same computation.
    for a, b, c in zip(as_ids, as_embeds, mixed, strict=True):
        assert np.abs(a - b).max() == 0.0
        assert np.abs(a - c).max() == 0.0


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_sequence_classification_matches_transformers(family: Family, tmp_path: Path) -> None:
    engine, hf = _engine(family, "ForSequenceClassification", tmp_path, num_labels=NUM_LABELS)
    prompts = random_prompts(VOCAB, LENGTHS, seed=1)
    ours = engine.classify(prompts, use_activation=False)
    with torch.no_grad():
        expected = np.stack([hf(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert ours.shape == (len(prompts), NUM_LABELS)
    assert_rel_close(ours, expected)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_token_classification_matches_transformers(family: Family, tmp_path: Path) -> None:
    engine, hf = _engine(family, "ForTokenClassification", tmp_path, num_labels=NUM_LABELS)
    prompts = random_prompts(VOCAB, LENGTHS, seed=2)
    ours = engine.encode(prompts, task="token_classify", use_activation=False)
    for prompt, rows in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
        assert rows.shape == (len(prompt), NUM_LABELS)
        assert_rel_close(rows, expected)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_masked_lm_logits_and_sparse_match_transformers(family: Family, tmp_path: Path) -> None:
    engine, hf = _engine(family, "ForMaskedLM", tmp_path)
    prompts = random_prompts(VOCAB, LENGTHS, seed=3)
    hidden = engine_hidden(engine, prompts)
    sparse = engine.embed_sparse(prompts)
    for prompt, rows, vector in zip(prompts, hidden, sparse, strict=True):
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True)
            logits = engine.model.compute_logits(torch.from_numpy(rows)).numpy()
        expected = out.logits[0]
        assert_rel_close(rows, out.hidden_states[-1][0].numpy())
        assert_rel_close(logits, expected.numpy())
        # SPLADE over every token: max of log(1 + relu(logits)) per vocabulary entry.
        reference = torch.log1p(torch.relu(expected)).max(dim=0).values.numpy()
        dense = np.zeros(VOCAB, dtype=np.float32)
        dense[list(vector)] = list(vector.values())
        assert_rel_close(dense, reference)


@pytest.mark.parametrize(
    "family", [f for f in FAMILIES if f.name in ("albert", "electra")], ids=lambda f: f.name
)
def test_token_type_ids_reach_the_model(family: Family, tmp_path: Path) -> None:
    from vecpool.engine.request import Request
    from vecpool.inputs.prompts import Prompt
    from vecpool.tasks import TASKS, PoolingParams

    engine, hf = _engine(family, "Model", tmp_path)
    ids = random_prompts(VOCAB, [9], seed=5)[0]
    types = [0] * 4 + [1] * 5
    prompt = Prompt(token_ids=np.asarray(ids), prompt_embeds=None, token_type_ids=np.asarray(types))
    # Below the public API, as a text pair arrives from the tokenizer.
    request = Request(
        "pair", prompt, PoolingParams(task="token_embed", normalize=False), TASKS["token_embed"]
    )
    engine.core.add_requests([request])
    engine.core.run_until_done([request])
    assert request.output is not None
    assert_rel_close(request.output, hf_last_hidden(hf, ids, token_type_ids=torch.tensor([types])))
    assert np.abs(request.output - hf_last_hidden(hf, ids)).max() > 1e-3


def test_electra_without_embedding_projection(tmp_path: Path) -> None:
    # ms-marco-electra-base: embedding_size == hidden_size, no embeddings_project.
    electra = next(f for f in FAMILIES if f.name == "electra")
    engine, hf = _engine(electra, "ForSequenceClassification", tmp_path, embedding_size=32)
    assert engine.model.embeddings_project is None
    prompts = random_prompts(VOCAB, LENGTHS, seed=6)
    with torch.no_grad():
        expected = np.stack([hf(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert_rel_close(engine.classify(prompts, use_activation=False), expected)


def test_electra_discriminator_loads_as_the_encoder(tmp_path: Path) -> None:
    # google/electra-*-discriminator folders name ElectraForPreTraining: the encoder serves
    # them, leaving out the replaced-token-detection head.
    electra = next(f for f in FAMILIES if f.name == "electra")
    hf = electra.hf_model("ForPreTraining")
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    assert type(engine.model).__name__ == "ElectraModel"
    prompts = random_prompts(VOCAB, LENGTHS, seed=8)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))


def test_wider_embeddings_than_hidden_are_refused(tmp_path: Path) -> None:
    electra = next(f for f in FAMILIES if f.name == "electra")
    folder = save_hf_model(electra.hf_model("Model", embedding_size=48), tmp_path)
    with pytest.raises(vecpool.ConfigError, match="embedding_size 48 is larger than hidden_size"):
        vecpool.Engine(folder, device="cpu")


# ---- MPNet as all-mpnet-base-v2 ships: bare weights under MPNetForMaskedLM ----------------

MPNET = FAMILIES[0]


def test_mpnet_bare_weights_under_masked_lm_name_load_as_the_encoder(tmp_path: Path) -> None:
    hf = MPNET.hf_model("Model")
    folder = save_hf_model(hf, tmp_path, architectures=["MPNetForMaskedLM"])
    engine = vecpool.Engine(folder, device="cpu")
    model = engine.model
    assert type(model).__name__ == "MPNetForMaskedLM" and not model.capabilities
    # The tied decoder is the word embedding table itself; the rest of the head is gone.
    assert model.lm_head.decoder.weight is model.embeddings.word_embeddings.weight
    assert {n for n, _ in model.named_parameters() if n.startswith("lm_head")} == set()
    assert "masked-LM head" in engine.info().unavailable_tasks["sparse"]
    with pytest.raises(vecpool.ConfigError, match="only the base model's weights"):
        model.compute_logits(torch.zeros(1, 32))
    prompts = random_prompts(VOCAB, LENGTHS, seed=7)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))


def test_mpnet_masked_lm_head_partly_missing_is_an_error(tmp_path: Path) -> None:
    hf = MPNET.hf_model("ForMaskedLM")
    state = {k.removeprefix("mpnet."): v.contiguous() for k, v in hf.state_dict().items()}
    del state["lm_head.bias"], state["lm_head.decoder.bias"], state["lm_head.decoder.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    config = {**hf.config.to_dict(), "architectures": ["MPNetForMaskedLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(vecpool.ModelLoadError, match=r"lm_head\.bias"):
        vecpool.Engine(tmp_path, device="cpu")


# Pooling per family: MPNet as all-mpnet-base-v2 (mean, under MPNetForMaskedLM with the bare
# model's weights), the others as their common sentence-transformers models.
ST_POOLING = {
    "mpnet": "mean_tokens",
    "distilbert": "mean_tokens",
    "albert": "mean_tokens",
    "electra": "cls_token",
}


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_sentence_transformers_folder(
    family: Family, tmp_path: Path, default_model_dir: Path
) -> None:
    """Pooling and Normalize over each family, as `SentenceTransformer.encode` gives them (the
    MiniLM WordPiece tokenizer stands in for each family's own: a vocabulary of 30522)."""
    from sentence_transformers import SentenceTransformer

    if family.name == "mpnet":
        hf = family.hf_model("Model", vocab_size=30522, max_position_embeddings=130)
        save_hf_model(hf, tmp_path, architectures=["MPNetForMaskedLM"])
    else:
        hf = family.hf_model("Model", vocab_size=30522, max_position_embeddings=128)
        save_hf_model(hf, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    write_st_modules(tmp_path, 32, ST_POOLING[family.name], max_seq_length=128)
    texts = [
        "A man is eating food.",
        "The quick brown fox jumps over the lazy dog near the river bank on a sunny day.",
        "ok",
    ]
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(texts)
    engine = vecpool.Engine(tmp_path, device="cpu")
    assert type(engine.model).__module__ == f"vecpool.models.architectures.{family.name}"
    ours = engine.embed(texts)
    assert np.abs(np.linalg.norm(ours, axis=1) - 1).max() < 1e-6
    assert_rel_close(ours, expected)
