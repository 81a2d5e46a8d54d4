"""The shared inputs of the benchmarks: model shapes written as random-weight folders, and
the workloads' lengths and texts (fixed seeds).

Texts come from the tokenizer of all-MiniLM-L6-v2 (BERT WordPiece): each input is a run of
whole-word vocabulary entries that tokenize to one token each, so an input of L tokens is
[CLS] + L - 2 words + [SEP], and its id list is the same input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

WORKLOADS = ("queries", "passages")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class Shape:
    """A model shape: a transformers config class and its arguments."""

    config_class: str  # e.g. "Qwen3Config"
    model_class: str  # e.g. "Qwen3Model"
    config: dict[str, Any]
    causal: bool

    @property
    def pooling(self) -> str:
        return "pooling_mode_lasttoken" if self.causal else "pooling_mode_mean_tokens"


_DECODER = dict(max_position_embeddings=32768, rms_norm_eps=1e-6)
# Configs' model_type of the decoder families (causal unless the config says otherwise).
DECODER_TYPES = frozenset(
    {"qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3_text", "gemma3"}
)
SHAPES: dict[str, Shape] = {
    "qwen3-0.6b": Shape(
        "Qwen3Config",
        "Qwen3Model",
        dict(
            vocab_size=151669,
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            tie_word_embeddings=True,
            **_DECODER,
        ),
        causal=True,
    ),
    "mistral-7b": Shape(
        "MistralConfig",
        "MistralModel",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            sliding_window=None,
            tie_word_embeddings=False,
            **_DECODER,
        ),
        causal=True,
    ),
    "bert-base": Shape(
        "BertConfig",
        "BertModel",
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        causal=False,
    ),
    "minilm": Shape(
        "BertConfig",
        "BertModel",
        dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
        causal=False,
    ),
    "mpnet-base": Shape(  # all-mpnet-base-v2
        "MPNetConfig",
        "MPNetModel",
        dict(
            vocab_size=30527,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=514,
        ),
        causal=False,
    ),
    "modernbert-base": Shape(  # gte-modernbert-base, modernbert-embed-base
        "ModernBertConfig",
        "ModernBertModel",
        dict(
            vocab_size=50368,
            hidden_size=768,
            num_hidden_layers=22,
            num_attention_heads=12,
            intermediate_size=1152,
            max_position_embeddings=8192,
            global_attn_every_n_layers=3,
            local_attention=128,
        ),
        causal=False,
    ),
    "qwen2-1.5b": Shape(  # gte-Qwen2-1.5B-instruct, stella_en_1.5B_v5
        "Qwen2Config",
        "Qwen2Model",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            tie_word_embeddings=False,
            **_DECODER,
        ),
        causal=True,
    ),
    "embeddinggemma-300m": Shape(  # bidirectional Gemma3, mean pooling
        "Gemma3TextConfig",
        "Gemma3TextModel",
        dict(
            vocab_size=262144,
            hidden_size=768,
            num_hidden_layers=24,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=1152,
            max_position_embeddings=2048,
            sliding_window=512,
            use_bidirectional_attention=True,
            query_pre_attn_scalar=256,
        ),
        causal=False,
    ),
    # Tiny shapes: the benchmark's own test, in seconds on a CPU.
    "tiny-qwen3": Shape(
        "Qwen3Config",
        "Qwen3Model",
        dict(
            vocab_size=30522,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            tie_word_embeddings=True,
            **_DECODER,
        ),
        causal=True,
    ),
    "tiny-bert": Shape(
        "BertConfig",
        "BertModel",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
        causal=False,
    ),
}


# ---- inputs ---------------------------------------------------------------------------------


def workload_lengths(name: str, n: int, seed: int = 0) -> np.ndarray:
    """`[n]` token counts (special tokens included) of a workload, fixed by `seed`."""
    gen = np.random.default_rng(seed)
    if name == "queries":
        return gen.integers(8, 64, size=n, endpoint=True)
    if name == "passages":
        lengths = np.rint(gen.lognormal(np.log(180.0), 0.6, size=n))
        return np.clip(lengths, 32, 512).astype(np.int64)
    raise ValueError(f"unknown workload {name!r}; known: {WORKLOADS}")


def single_token_words(tokenizer: Any, limit: int = 4000) -> list[str]:
    """Whole lowercase words of the vocabulary that tokenize to exactly one token each."""
    vocab = sorted(
        (i, w) for w, i in tokenizer.get_vocab().items() if re.fullmatch(r"[a-z]{3,12}", w)
    )
    words = [w for _, w in vocab[:limit]]
    encoded = tokenizer.encode_batch(words, add_special_tokens=False)
    return [w for w, e in zip(words, encoded, strict=True) if len(e.ids) == 1]


def make_inputs(
    tokenizer: Any, lengths: np.ndarray, seed: int = 0
) -> tuple[list[str], list[list[int]]]:
    """Texts of `lengths` tokens each (with [CLS] and [SEP]) and their token ids. The
    tokenizer's own padding and truncation (a folder's tokenizer.json may carry them) are
    turned off: the lengths are planned exactly."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    words = np.array(single_token_words(tokenizer))
    gen = np.random.default_rng(seed + 1)
    texts = [" ".join(gen.choice(words, size=int(n) - 2)) for n in lengths]
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    got = np.array([len(i) for i in ids])
    if not np.array_equal(got, lengths):
        raise RuntimeError("texts did not tokenize to the planned lengths")
    return texts, ids


# ---- model folders and FLOPs ----------------------------------------------------------------


def write_folder(shape: Shape, dest: Path, tokenizer_dir: Path, device: str) -> Path:
    """A sentence-transformers folder with random weights of `shape` and the tokenizer files
    of `tokenizer_dir` (weights are drawn on `device`, which is fast for large models)."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, shape.config_class)(**shape.config)
    dtype = torch.bfloat16 if shape.causal else torch.float32
    with torch.device(device):
        model = getattr(transformers, shape.model_class)(cfg).to(dtype)
    model.save_pretrained(str(dest), safe_serialization=True)
    del model
    for name in TOKENIZER_FILES:
        (dest / name).write_bytes((tokenizer_dir / name).read_bytes())
    max_len = 512
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_len, "do_lower_case": False})
    )
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": cfg.hidden_size, shape.pooling: True})
    )
    (dest / "2_Normalize").mkdir()
    return dest


def doc_lengths(n: int, seed: int) -> np.ndarray:
    """`[n]` token counts of rerank documents: U[16, 48], fixed by `seed`."""
    return np.random.default_rng(seed).integers(16, 48, size=n, endpoint=True)
