"""Rotary encoders: ModernBERT against transformers; NomicBERT and GTE ("new") against plain,
padded references written here from their published (remote-code) model definitions.

NomicBERT: nomic-ai's `modeling_hf_nomic_bert.py` as shipped with nomic-embed-text-v1.5
(`NomicBertEmbeddings`, `NomicBertAttention`, `NomciBertGatedMLP`, `NomicBertBlock` with
`prenorm=False`, `NomicBertModel`). GTE: Alibaba-NLP's `new-impl` `modeling.py` (`NewEmbeddings`
with `NTKScalingRotaryEmbedding`, `NewAttention`, `NewGatedMLP`, `NewLayer`, `NewPooler`,
`NewForSequenceClassification`). The references run one padded sequence at a time, each layer
spelled out with plain torch operations, from the same safetensors the engine loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

import vecpool
from tests.helpers import (
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    write_st_modules,
)

# Longer than ModernBERT's local window below (8: 4 positions either side), so it matters.
LENGTHS = [5, 17, 3, 30, 11]


def _modernbert_config(**overrides: Any) -> transformers.ModernBertConfig:
    kwargs: dict[str, Any] = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=40,
        max_position_embeddings=64,
        local_attention=8,
        global_attn_every_n_layers=2,
        global_rope_theta=1000.0,
        local_rope_theta=50.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        num_labels=3,
    )
    kwargs.update(overrides)
    return transformers.ModernBertConfig(**kwargs)


def _randomize(model: Any, seed: int) -> Any:
    """Every parameter random (norm weights and biases too, which init leaves at 1 and 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def _save(model: Any, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


# ---- ModernBERT vs transformers ------------------------------------------------------------


@pytest.fixture(scope="module", params=["cls", "mean"])
def modernbert_cls(request, tmp_path_factory) -> tuple[vecpool.Engine, Any]:
    """A ModernBERT sequence classifier (norms with biases) pooling CLS or MEAN."""
    torch.manual_seed(0)
    cfg = _modernbert_config(classifier_pooling=request.param, norm_bias=True)
    hf = _randomize(transformers.ModernBertForSequenceClassification(cfg), seed=1)
    folder = _save(hf, tmp_path_factory.mktemp(f"modernbert_{request.param}"))
    # Its hidden states are read too: token_embed, which a classifier serves only when asked.
    return vecpool.Engine(folder, device="cpu", tasks=("token_embed",)), hf


def test_modernbert_hidden_states_and_classifier(modernbert_cls) -> None:
    engine, hf = modernbert_cls
    prompts = random_prompts(99, LENGTHS)
    ours = engine_hidden(engine, prompts)
    for prompt, hidden in zip(prompts, ours, strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf.model, prompt))
    logits = engine.classify(prompts, use_activation=False)
    with torch.no_grad():
        ref = np.stack([hf(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert logits.shape == (len(prompts), 3)
    assert_rel_close(logits, ref)


def test_modernbert_local_window_matters(modernbert_cls) -> None:
    # The same checkpoint with every layer global differs on a sequence longer than the window:
    # the windowed layers are not attending to everything.
    engine, hf = modernbert_cls
    prompt = random_prompts(99, [30], seed=2)[0]
    global_cfg = _modernbert_config(global_attn_every_n_layers=1, norm_bias=True)
    everywhere = transformers.ModernBertModel(global_cfg).eval()
    everywhere.load_state_dict(hf.model.state_dict())
    ours = engine_hidden(engine, [prompt])[0]
    assert np.abs(ours - hf_last_hidden(everywhere, prompt)).max() > 1e-3


def test_modernbert_prompt_embeds_bit_exact(modernbert_cls) -> None:
    engine, _ = modernbert_cls
    prompts = random_prompts(99, LENGTHS, seed=4)
    as_ids = engine_hidden(engine, prompts)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    for a, c in zip(as_ids, mixed, strict=True):
        assert np.abs(a - c).max() == 0.0
    classified = engine.classify([embeds[3], prompts[3]], use_activation=False)
    assert np.abs(classified[0] - classified[1]).max() == 0.0


def test_modernbert_masked_lm_and_sparse(tmp_path: Path) -> None:
    torch.manual_seed(5)
    hf = _randomize(transformers.ModernBertForMaskedLM(_modernbert_config()), seed=6)
    engine = vecpool.Engine(_save(hf, tmp_path), device="cpu")
    prompts = random_prompts(99, LENGTHS, seed=7)
    hidden = engine_hidden(engine, prompts)
    sparse = engine.embed_sparse(prompts)
    for prompt, h, vec in zip(prompts, hidden, sparse, strict=True):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0]
            logits = engine.model.compute_logits(torch.from_numpy(h))
        assert_rel_close(logits.numpy(), ref.numpy())
        expected = torch.log1p(torch.relu(ref)).max(dim=0).values.numpy()
        dense = np.zeros(99, dtype=np.float32)
        dense[list(vec)] = list(vec.values())
        assert_rel_close(dense, expected)


def test_modernbert_token_classifier(tmp_path: Path) -> None:
    torch.manual_seed(8)
    hf = transformers.ModernBertForTokenClassification(_modernbert_config())
    engine = vecpool.Engine(_save(_randomize(hf, seed=9), tmp_path), device="cpu")
    prompts = random_prompts(99, LENGTHS, seed=10)
    ours = engine.encode(prompts, task="token_classify", use_activation=False)
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
        assert_rel_close(logits, ref)


def test_modernbert_sentence_transformers_mean_pooling(tmp_path: Path, default_model_dir) -> None:
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(11)
    cfg = _modernbert_config(
        vocab_size=30522,
        pad_token_id=0,
        bos_token_id=101,
        cls_token_id=101,
        eos_token_id=102,
        sep_token_id=102,
        max_position_embeddings=128,
    )
    _save(_randomize(transformers.ModernBertModel(cfg), seed=12), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    write_st_modules(tmp_path, 32, "mean_tokens")
    texts = [
        "a short one",
        "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun",
        "rotary positions and a sliding window of attention over a longer sentence than eight",
    ]
    ours = vecpool.Engine(tmp_path, device="cpu").embed(texts)
    theirs = SentenceTransformer(str(tmp_path), device="cpu").encode(texts)
    assert_rel_close(ours, theirs)


# ---- plain padded references of the remote-code families -----------------------------------


def _random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Random tensors by checkpoint name; norm weights (the 1-d `weight`s) around 1."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen) * 0.3
        + (1.0 if len(shape) == 1 and name.endswith("weight") else 0.0)
        for name, shape in shapes.items()
    }


def _write_folder(
    path: Path, config: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer_from: Path
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, L]` ids padded with 0, and the `[B, L]` bool mask of real tokens."""
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.int64)
    mask = torch.zeros(len(prompts), length, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = True
    return ids, mask


def _rotate(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """`[B, L, H, D]` rotated by position, first and second halves paired (not interleaved)."""
    t = torch.arange(x.shape[1], dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [L, D / 2]
    cos = torch.cat((freqs, freqs), -1).cos()[None, :, None]
    sin = torch.cat((freqs, freqs), -1).sin()[None, :, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked softmax attention of `[B, L, H, D]` tensors -> `[B, L, H * D]`."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return out.reshape(*out.shape[:2], -1)


def _layer_norm(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)


def _unpad(hidden: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    return [h[m].numpy() for h, m in zip(hidden, mask, strict=True)]


# ---- GTE ("new") -------------------------------------------------------------------------

GTE = dict(hidden=32, layers=2, heads=4, inter=40, vocab=30522, theta=500.0, ntk=2.0, eps=1e-12)


def _gte_config(arch: str, type_vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "model_type": "new",
        "auto_map": {"AutoModel": "Alibaba-NLP/new-impl--modeling.NewModel"},
        "vocab_size": GTE["vocab"],
        "hidden_size": GTE["hidden"],
        "num_hidden_layers": GTE["layers"],
        "num_attention_heads": GTE["heads"],
        "intermediate_size": GTE["inter"],
        "hidden_act": "gelu",
        "max_position_embeddings": 64,
        "type_vocab_size": type_vocab_size,
        "layer_norm_eps": GTE["eps"],
        "layer_norm_type": "layer_norm",
        "position_embedding_type": "rope",
        "rope_theta": GTE["theta"],
        "rope_scaling": {"type": "ntk", "factor": GTE["ntk"]},
        "pack_qkv": True,
        "unpad_inputs": True,
        "use_memory_efficient_attention": True,
        "logn_attention_scale": False,
        "id2label": {"0": "LABEL_0"},
    }


def _gte_shapes(type_vocab_size: int, classifier: bool) -> dict[str, tuple[int, ...]]:
    h, i, prefix = GTE["hidden"], GTE["inter"], "new." if classifier else ""
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (GTE["vocab"], h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    if type_vocab_size:
        shapes["embeddings.token_type_embeddings.weight"] = (type_vocab_size, h)
    for n in range(GTE["layers"]):
        p = f"encoder.layer.{n}."
        shapes |= {
            p + "attention.qkv_proj.weight": (3 * h, h),
            p + "attention.qkv_proj.bias": (3 * h,),
            p + "attention.o_proj.weight": (h, h),
            p + "attention.o_proj.bias": (h,),
            p + "mlp.up_gate_proj.weight": (2 * i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "mlp.down_proj.bias": (h,),
            p + "attn_ln.weight": (h,),
            p + "attn_ln.bias": (h,),
            p + "mlp_ln.weight": (h,),
            p + "mlp_ln.bias": (h,),
        }
    shapes = {prefix + k: v for k, v in shapes.items()}
    if classifier:
        shapes |= {
            "new.pooler.dense.weight": (h, h),
            "new.pooler.dense.bias": (h,),
            "classifier.weight": (1, h),
            "classifier.bias": (1,),
        }
    return shapes


def _gte_reference(
    w: dict[str, torch.Tensor], prompts: list[list[int]], types: list[list[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`NewModel` on a padded batch: `[B, L, hidden]` final hidden states and the mask."""
    w = {k.removeprefix("new."): v for k, v in w.items()}
    h, heads, eps = GTE["hidden"], GTE["heads"], GTE["eps"]
    ids, mask = _padded(prompts)
    x = w["embeddings.word_embeddings.weight"][ids]
    if "embeddings.token_type_embeddings.weight" in w:
        type_ids = _padded(types)[0] if types is not None else torch.zeros_like(ids)
        x = x + w["embeddings.token_type_embeddings.weight"][type_ids]
    x = _layer_norm(x, w, "embeddings.LayerNorm", eps)
    # NTKScalingRotaryEmbedding without mixed_b: base theta * factor, then / factor^(2 / dim).
    dim, factor = h // heads, GTE["ntk"]
    inv_freq = 1.0 / ((GTE["theta"] * factor) ** (torch.arange(0, dim, 2).float() / dim))
    inv_freq = inv_freq / factor ** (2 / dim)
    for n in range(GTE["layers"]):
        p = f"encoder.layer.{n}."
        qkv = F.linear(x, w[p + "attention.qkv_proj.weight"], w[p + "attention.qkv_proj.bias"])
        q, k, v = (t.reshape(*x.shape[:2], heads, dim) for t in qkv.split(h, dim=-1))
        context = _attend(_rotate(q, inv_freq), _rotate(k, inv_freq), v, mask)
        out = F.linear(context, w[p + "attention.o_proj.weight"], w[p + "attention.o_proj.bias"])
        x = _layer_norm(x + out, w, p + "attn_ln", eps)
        up, gate = F.linear(x, w[p + "mlp.up_gate_proj.weight"]).split(GTE["inter"], dim=-1)
        down = F.linear(
            F.gelu(gate) * up, w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"]
        )
        x = _layer_norm(x + down, w, p + "mlp_ln", eps)
    return x, mask


def _gte_scores(w: dict[str, torch.Tensor], hidden: torch.Tensor) -> np.ndarray:
    """`NewForSequenceClassification`: the CLS row through the pooler (dense, tanh), classifier."""
    pooled = torch.tanh(
        F.linear(hidden[:, 0], w["new.pooler.dense.weight"], w["new.pooler.dense.bias"])
    )
    return F.linear(pooled, w["classifier.weight"], w["classifier.bias"]).numpy()


@pytest.fixture(scope="module")
def gte(tmp_path_factory, default_model_dir) -> tuple[vecpool.Engine, dict[str, torch.Tensor]]:
    """A GTE reranker folder (`NewForSequenceClassification`, two token types)."""
    weights = _random_weights(_gte_shapes(2, classifier=True), seed=20)
    folder = _write_folder(
        tmp_path_factory.mktemp("gte"),
        _gte_config("NewForSequenceClassification", 2),
        weights,
        default_model_dir,
    )
    # Its hidden states are read too: token_embed, which a reranker serves only when asked.
    return vecpool.Engine(folder, device="cpu", tasks=("token_embed",)), weights


def test_gte_hidden_states_and_classifier(gte) -> None:
    engine, weights = gte
    prompts = random_prompts(GTE["vocab"], LENGTHS, seed=21)
    hidden, mask = _gte_reference(weights, prompts)
    for ours, ref in zip(engine_hidden(engine, prompts), _unpad(hidden, mask), strict=True):
        assert_rel_close(ours, ref)
    assert_rel_close(engine.classify(prompts, use_activation=False), _gte_scores(weights, hidden))


def test_gte_token_types_of_a_pair(gte) -> None:
    engine, weights = gte
    pairs = [("what is a cat", "a cat is a small animal"), ("rotary", "positions by rotation")]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(engine.folder.path))
    encoded = [tokenizer(q, d) for q, d in pairs]
    ids = [e["input_ids"] for e in encoded]
    types = [e["token_type_ids"] for e in encoded]
    assert any(1 in t for t in types)
    hidden, _ = _gte_reference(weights, ids, types)
    ours = engine.classify([{"text": q, "text_pair": d} for q, d in pairs], use_activation=False)
    assert_rel_close(ours, _gte_scores(weights, hidden))
    # Without the second token type the scores differ: the types reach the model.
    assert np.abs(ours - _gte_scores(weights, _gte_reference(weights, ids)[0])).max() > 1e-4


def test_gte_base_model_and_prompt_embeds(tmp_path: Path, default_model_dir) -> None:
    # gte-base-en-v1.5's layout: no token types, no head.
    weights = _random_weights(_gte_shapes(0, classifier=False), seed=22)
    folder = _write_folder(tmp_path, _gte_config("NewModel", 0), weights, default_model_dir)
    engine = vecpool.Engine(folder, device="cpu")
    prompts = random_prompts(GTE["vocab"], LENGTHS, seed=23)
    as_ids = engine_hidden(engine, prompts)
    hidden, mask = _gte_reference(weights, prompts)
    for ours, ref in zip(as_ids, _unpad(hidden, mask), strict=True):
        assert_rel_close(ours, ref)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    for a, b in zip(as_ids, mixed, strict=True):
        assert np.abs(a - b).max() == 0.0


# ---- NomicBERT -----------------------------------------------------------------------------

NOMIC = dict(hidden=32, layers=2, heads=4, inter=48, vocab=30522, padded_vocab=30528, base=1000.0)
NOMIC_EPS = 1e-12


def _nomic_config() -> dict[str, Any]:
    """nomic-embed-text-v1.5's config.json at a tiny size."""
    return {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "auto_map": {
            "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"
        },
        "activation_function": "swiglu",
        "vocab_size": NOMIC["vocab"],
        "pad_vocab_size_multiple": 64,
        "n_embd": NOMIC["hidden"],
        "n_layer": NOMIC["layers"],
        "n_head": NOMIC["heads"],
        "n_inner": NOMIC["inter"],
        "n_positions": 128,
        "max_trained_positions": 2048,
        "layer_norm_epsilon": NOMIC_EPS,
        "prenorm": False,
        "causal": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "rotary_emb_base": NOMIC["base"],
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None,
        "type_vocab_size": 2,
        "use_rms_norm": False,
    }


def _nomic_shapes() -> dict[str, tuple[int, ...]]:
    h, i = NOMIC["hidden"], NOMIC["inter"]
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (NOMIC["padded_vocab"], h),
        "embeddings.token_type_embeddings.weight": (2, h),
        "emb_ln.weight": (h,),
        "emb_ln.bias": (h,),
    }
    for n in range(NOMIC["layers"]):
        p = f"encoder.layers.{n}."
        shapes |= {
            p + "attn.Wqkv.weight": (3 * h, h),
            p + "attn.out_proj.weight": (h, h),
            p + "mlp.fc11.weight": (i, h),
            p + "mlp.fc12.weight": (i, h),
            p + "mlp.fc2.weight": (h, i),
            p + "norm1.weight": (h,),
            p + "norm1.bias": (h,),
            p + "norm2.weight": (h,),
            p + "norm2.bias": (h,),
        }
    return shapes


def _nomic_reference(
    w: dict[str, torch.Tensor], prompts: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`NomicBertModel` (post-norm, SwiGLU, no biases) on a padded batch."""
    heads, dim = NOMIC["heads"], NOMIC["hidden"] // NOMIC["heads"]
    ids, mask = _padded(prompts)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _layer_norm(x, w, "emb_ln", NOMIC_EPS)
    inv_freq = 1.0 / (NOMIC["base"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    for n in range(NOMIC["layers"]):
        p = f"encoder.layers.{n}."
        # Wqkv's rows: "(three h d)".
        q, k, v = (
            F.linear(x, w[p + "attn.Wqkv.weight"]).reshape(*x.shape[:2], 3, heads, dim).unbind(2)
        )
        context = _attend(_rotate(q, inv_freq), _rotate(k, inv_freq), v, mask)
        x = _layer_norm(
            F.linear(context, w[p + "attn.out_proj.weight"]) + x, w, p + "norm1", NOMIC_EPS
        )
        y = F.linear(x, w[p + "mlp.fc11.weight"]) * F.silu(F.linear(x, w[p + "mlp.fc12.weight"]))
        x = _layer_norm(F.linear(y, w[p + "mlp.fc2.weight"]) + x, w, p + "norm2", NOMIC_EPS)
    return x, mask


@pytest.fixture(scope="module")
def nomic(tmp_path_factory, default_model_dir) -> tuple[vecpool.Engine, dict[str, torch.Tensor]]:
    """A nomic-embed-text style folder: mean pooling, Normalize, search prompts."""
    weights = _random_weights(_nomic_shapes(), seed=30)
    folder = _write_folder(
        tmp_path_factory.mktemp("nomic"), _nomic_config(), weights, default_model_dir
    )
    write_st_modules(folder, NOMIC["hidden"], "mean_tokens", max_seq_length=None)
    prompts = {"query": "search_query: ", "document": "search_document: "}
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": prompts, "default_prompt_name": None})
    )
    return vecpool.Engine(folder, device="cpu"), weights


def test_nomic_hidden_states_and_prompt_embeds(nomic) -> None:
    engine, weights = nomic
    assert engine.model.vocab_size == NOMIC["padded_vocab"]
    prompts = random_prompts(NOMIC["vocab"], LENGTHS, seed=31)
    as_ids = engine_hidden(engine, prompts)
    hidden, mask = _nomic_reference(weights, prompts)
    for ours, ref in zip(as_ids, _unpad(hidden, mask), strict=True):
        assert_rel_close(ours, ref)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    for a, b in zip(as_ids, mixed, strict=True):
        assert np.abs(a - b).max() == 0.0


@pytest.mark.parametrize("dimensions", [None, 16])
def test_nomic_search_prompts_and_matryoshka(nomic, dimensions: int | None) -> None:
    engine, weights = nomic
    texts = ["what is the capital of france", "rotary embeddings in a long context encoder"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(engine.folder.path))
    for name, prefix in (("query", "search_query: "), ("document", "search_document: ")):
        ids = [tokenizer(prefix + t)["input_ids"] for t in texts]
        hidden, mask = _nomic_reference(weights, ids)
        mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        expected = F.normalize(mean[:, :dimensions], dim=-1).numpy()
        ours = engine.embed(texts, prompt_name=name, dimensions=dimensions)
        assert ours.shape == expected.shape
        assert_rel_close(ours, expected)


# ---- configurations the native classes do not implement ------------------------------------


@pytest.mark.parametrize(
    ("arch", "config", "named"),
    [
        ("ModernBertModel", {"classifier_pooling": "max"}, "classifier_pooling"),
        ("NewModel", {"logn_attention_scale": True}, "logn_attention_scale"),
        ("NewModel", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ("NewModel", {"layer_norm_type": "rms_norm"}, "layer_norm_type"),
        ("NomicBertModel", {"prenorm": True}, "prenorm"),
        ("NomicBertModel", {"rotary_emb_interleaved": True}, "rotary_emb_interleaved"),
        ("NomicBertModel", {"activation_function": "gelu"}, "activation_function"),
    ],
)
def test_unsupported_config_raises(arch: str, config: dict[str, Any], named: str) -> None:
    from vecpool.errors import ConfigError
    from vecpool.models.loading.loader import model_class

    base = {
        "ModernBertModel": _modernbert_config().to_dict(),
        "NewModel": _gte_config("NewModel", 0),
        "NomicBertModel": _nomic_config(),
    }[arch]
    with pytest.raises(ConfigError, match=named):
        model_class(arch).from_hf_config({**base, **config})
