"""Qwen2, Gemma and Gemma3 beyond the shared decoder tests (tests/models/test_decoders.py runs
every one of those on them): the checkpoints people embed and rerank with.

- a gte-Qwen2-style folder: base tensors under `Qwen2ForCausalLM`, `is_causal: false`;
- Gemma3 configs in the older flat keys (`rope_theta`, `rope_local_base_freq`, `rope_scaling`,
  `sliding_window_pattern`), as EmbeddingGemma and the Gemma3 releases ship them;
- an EmbeddingGemma-like sentence-transformers folder (bidirectional Gemma3, mean pooling, two
  bias-free Dense, Normalize, named prompts, matryoshka dimensions) against
  `SentenceTransformer(folder).encode`;
- bge-reranker-v2-gemma's prompt (`LLMRerankerConfig.bge_gemma()`) against transformers'
  `GemmaForCausalLM` "Yes" logit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer, models, pre_tokenizers, processors

import vecpool
from tests.helpers import (
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
)
from tests.models.test_decoders import ARCHS, COMMON, LENGTHS, VOCAB


def _arch(name: str) -> Any:
    return next(a for a in ARCHS if a.name == name)


def test_gte_qwen2_layout_is_bidirectional(tmp_path: Path) -> None:
    """gte-Qwen2 ships its base model's tensors under `Qwen2ForCausalLM` with `is_causal:
    false`: both ways, and its last token's row is what transformers gives there."""
    arch = _arch("qwen2")
    hf = arch.hf_model()
    folder = save_hf_model(hf, tmp_path, architectures=["Qwen2ForCausalLM"], is_causal=False)
    engine = vecpool.Engine(folder, device="cpu", pooling="LAST")
    assert not engine.model.is_causal
    # Sliding from layer 1 on, |i - j| <= 6 as transformers' bidirectional mask.
    assert engine.model.config.layer_windows == (None, 7, 7)
    reference = type(hf)(arch.hf_config(is_causal=False)).eval()
    reference.load_state_dict(hf.state_dict())
    prompts = random_prompts(VOCAB, LENGTHS, seed=11)
    pooled = engine.embed(prompts, normalize=False)
    hidden = engine_hidden(engine, prompts)
    for prompt, row, rows in zip(prompts, pooled, hidden, strict=True):
        expected = hf_last_hidden(reference, prompt)
        assert_rel_close(row, expected[-1])
        assert_rel_close(rows, expected)
        assert np.abs(rows - hf_last_hidden(hf, prompt)).max() > 1e-3  # not the causal model


def _flat_rope_config(folder: Path, **keys: Any) -> None:
    """Rewrite a saved Gemma3 config.json in the older flat keys, as released folders have."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key, None)
    config.update(keys)
    path.write_text(json.dumps(config))


def test_gemma3_flat_rope_keys(tmp_path: Path) -> None:
    """`rope_theta` (global layers, with `rope_scaling`), `rope_local_base_freq` (sliding
    layers) and `sliding_window_pattern` instead of `layer_types`, as transformers reads them."""
    arch = _arch("gemma3")
    save_hf_model(arch.hf_model(), tmp_path)
    _flat_rope_config(
        tmp_path,
        rope_theta=20000.0,
        rope_local_base_freq=50.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        sliding_window_pattern=2,
    )
    hf = transformers.Gemma3TextModel.from_pretrained(str(tmp_path), attn_implementation="eager")
    hf.eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert hf.config.rope_parameters["full_attention"]["rope_theta"] == 20000.0
    assert hf.config.rope_parameters["sliding_attention"]["rope_theta"] == 50.0
    engine = vecpool.Engine(tmp_path, device="cpu")
    model = engine.model
    assert model.layer_rotary == (0, 1, 0) and len(model.rotaries) == 2
    assert model.config.layer_windows == (6, None, 6)
    prompts = random_prompts(VOCAB, LENGTHS, seed=12)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))


# ---- EmbeddingGemma as a sentence-transformers folder -----------------------------------------

ST_TEXTS = [
    "how do magnets attract iron filings",
    "a cat",
    "the quick brown fox jumps over the lazy dog near the river bank at dawn",
    "python lists are mutable sequences of arbitrary objects",
]
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "Retrieval-query": "task: search result | query: ",
    "Clustering": "task: clustering | query: ",
}


def _dense(folder: Path, in_features: int, out_features: int, seed: int) -> None:
    folder.mkdir()
    config = {
        "in_features": in_features,
        "out_features": out_features,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
    }
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.2
    save_file({"linear.weight": weight}, str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def embedding_gemma(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> tuple[vecpool.Engine, SentenceTransformer]:
    """A tiny bidirectional Gemma3 (window 6, narrowed to 4 either side; two rope bases) on the
    MiniLM tokenizer, laid out as EmbeddingGemma's folder: Transformer, mean Pooling, Dense
    32 -> 64 and 64 -> 32 without bias, Normalize, and its named prompts."""
    dest = tmp_path_factory.mktemp("embedding_gemma")
    arch = _arch("gemma3")
    hf = arch.hf_model(vocab_size=30522, use_bidirectional_attention=True)
    save_hf_model(hf, dest)
    assert json.loads((dest / "config.json").read_text())["sliding_window"] == 6
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, dest / name)
    names = ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    paths = ["", "1_Pooling", "2_Dense", "3_Dense", "4_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{n}"}
        for i, (n, p) in enumerate(zip(names, paths, strict=True))
    ]
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    _dense(dest / "2_Dense", 32, 64, seed=3)
    _dense(dest / "3_Dense", 64, 32, seed=4)
    (dest / "4_Normalize").mkdir()
    (dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    st_config = {"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"}
    (dest / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    engine = vecpool.Engine(dest, device="cpu")
    return engine, SentenceTransformer(str(dest), device="cpu")


def test_embedding_gemma_matches_sentence_transformers(
    embedding_gemma: tuple[vecpool.Engine, SentenceTransformer],
) -> None:
    engine, st = embedding_gemma
    assert not engine.model.is_causal
    assert engine.model.config.layer_windows == (4, None, 4)  # 6 // 2 + 1, exclusive
    assert engine.defaults.pooler == "MEAN"
    assert max(len(engine.tokenize(t)) for t in ST_TEXTS) > 10  # longer than the windows
    ours = engine.embed(ST_TEXTS)
    assert ours.shape == (len(ST_TEXTS), 32)
    assert_rel_close(ours, st.encode(ST_TEXTS), rtol=1e-5)
    for name in ("query", "document", "Clustering"):
        prompted = engine.embed(ST_TEXTS, prompt_name=name)
        assert_rel_close(prompted, st.encode(ST_TEXTS, prompt_name=name), rtol=1e-5)
        assert np.abs(prompted - ours).max() > 1e-3  # the prompt is in the tokens


@pytest.mark.parametrize("dimensions", [16, 8])
def test_embedding_gemma_matryoshka_dimensions(
    embedding_gemma: tuple[vecpool.Engine, SentenceTransformer], dimensions: int
) -> None:
    """`dimensions` keeps the first entries and normalizes them again: sentence-transformers'
    `truncate_dim` with `normalize_embeddings`."""
    engine, st = embedding_gemma
    ours = engine.embed(ST_TEXTS, dimensions=dimensions, prompt_name="query")
    ref = st.encode(
        ST_TEXTS, prompt_name="query", truncate_dim=dimensions, normalize_embeddings=True
    )
    assert ours.shape == ref.shape == (len(ST_TEXTS), dimensions)
    assert_rel_close(ours, ref, rtol=1e-5)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


# ---- bge-reranker-v2-gemma ---------------------------------------------------------------------

QUERY = "what do cats eat"
DOCS = ["cats eat fish and meat", "the stock market fell", "cats sleep a lot", "fish eat algae"]


def _word_tokenizer(path: Path, texts: list[str]) -> Tokenizer:
    """A word-level tokenizer over the words of `texts` that puts <bos> first, as Gemma's."""
    split = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)})
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", *words])}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.save(str(path / "tokenizer.json"))
    return tok


def test_bge_gemma_reranker_matches_transformers(tmp_path: Path) -> None:
    config = vecpool.LLMRerankerConfig.bge_gemma()
    prompts = [config.format(QUERY, d) for d in DOCS]
    # FlagEmbedding's layout: "A: {query}", "B: {passage}", its instruction, newline-separated.
    assert prompts[0] == f"A: {QUERY}\nB: {DOCS[0]}\n{config.instruction}"
    assert config.instruction.endswith("either 'Yes' or 'No'.")
    assert (config.true_token, config.false_token) == ("Yes", None)
    torch.manual_seed(0)
    hf_config = transformers.GemmaConfig(**{**COMMON, "head_dim": 16})
    hf_config._attn_implementation = "eager"
    hf = transformers.GemmaForCausalLM(hf_config).eval()
    save_hf_model(hf, tmp_path)
    tok = _word_tokenizer(tmp_path, prompts)
    engine = vecpool.Engine(tmp_path, device="cpu", llm_reranker=config)
    assert engine.score_mode == "llm"
    yes = tok.token_to_id("Yes")
    expected = []
    for prompt in prompts:
        ids = tok.encode(prompt).ids
        assert ids[0] == tok.token_to_id("<bos>")
        with torch.no_grad():
            expected.append(float(hf(input_ids=torch.tensor([ids])).logits[0, -1, yes]))
    logits = np.array(expected, dtype=np.float32)
    assert_rel_close(engine.score(QUERY, DOCS, use_activation=False), logits)
    assert_rel_close(engine.score(QUERY, DOCS), 1 / (1 + np.exp(-logits)))
    ranked = engine.rerank(QUERY, DOCS, top_n=2)
    assert [i for i, _ in ranked] == list(np.argsort(-logits, kind="stable")[:2])
