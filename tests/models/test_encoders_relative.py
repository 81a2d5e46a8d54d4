"""Encoders with relative positions: T5 encoder and DeBERTa-v2 against Hugging Face
transformers, Jina BERT v2 against a padded reference written here, all on the same random
weights.

Jina BERT v2's code lives in its checkpoints' repositories (remote code). The reference below
follows the published definitions: jinaai/jina-bert-implementation `modeling_bert.py` (read as
vendored in veya2ztn/sci-bert-finetune, models/jinabert/modeling_bert.py: JinaBertEmbeddings,
JinaBertSelfAttention, JinaBertGLUMLP, the encoder's `rebuild_alibi_tensor`) and, for the
qk-post-norm layout of jina-embeddings-v2-base-code, the JinaBert port proposed to transformers
(`layer_norm_q` / `layer_norm_k`, `up_gated_layer` / `down_layer`, `layer_norm_1` /
`layer_norm_2`), whose layer order a candle (Rust) port of jina-embeddings-v2-base-code also
follows. The qk-post-norm repository itself was not found to read: that layout is checked
against those two readings of it, not against Jina's own file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

import vecpool
from tests.conftest import make_st_folder
from tests.helpers import (
    REORDERED_RTOL,
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
)
from vecpool.models.loading.loader import model_class

LENGTHS = [5, 17, 3, 30, 11]
VOCAB = 99


def _prompt_embeds_bit_exact(engine: vecpool.Engine) -> None:
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=4)
    as_ids = engine_hidden(engine, prompts)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    as_embeds = engine_hidden(engine, embeds)
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    for a, b, c in zip(as_ids, as_embeds, mixed, strict=True):
        assert np.abs(a - b).max() == 0.0
        assert np.abs(a - c).max() == 0.0


def _batch_invariant(engine: vecpool.Engine) -> None:
    # Alone, a prompt runs in a padded layout of another length and matmuls of other shapes.
    prompts = random_prompts(engine.model.vocab_size, [7, 2, 25, 13, 4, 19], seed=5)
    together = engine_hidden(engine, prompts)
    for prompt, rows in zip(prompts, together, strict=True):
        assert_rel_close(engine_hidden(engine, [prompt])[0], rows, rtol=REORDERED_RTOL)


# ---- T5 encoder ------------------------------------------------------------------------


def _t5_config(**overrides: Any) -> transformers.T5Config:
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        # Few buckets and a short max distance: the longer prompts reach the log buckets.
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        initializer_factor=2.0,
    )
    kwargs.update(overrides)
    return transformers.T5Config(**kwargs)


@pytest.fixture(scope="module", params=["relu", "gated-gelu"])
def t5(request, tmp_path_factory) -> tuple[vecpool.Engine, Any]:
    torch.manual_seed(0)
    hf = transformers.T5EncoderModel(_t5_config(feed_forward_proj=request.param)).eval()
    folder = save_hf_model(hf, tmp_path_factory.mktemp("t5"))
    return vecpool.Engine(folder, device="cpu"), hf


def test_t5_hidden_states_match_transformers(t5) -> None:
    engine, hf = t5
    prompts = random_prompts(VOCAB, LENGTHS)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))
    assert engine.defaults.pooler == "MEAN"  # no CLS token in T5


def test_t5_prompt_embeds_bit_exact(t5) -> None:
    _prompt_embeds_bit_exact(t5[0])


def test_t5_batch_invariance(t5) -> None:
    _batch_invariant(t5[0])


@pytest.mark.parametrize(
    "cls",
    [transformers.T5Model, transformers.T5ForConditionalGeneration, transformers.MT5EncoderModel],
)
def test_t5_encoder_decoder_and_mt5_folders(cls: Any, tmp_path: Path) -> None:
    """The encoder of a whole T5 folder (decoder and LM head left unused), and mT5's encoder."""
    torch.manual_seed(1)
    config = _t5_config(feed_forward_proj="gated-gelu")
    if cls is transformers.MT5EncoderModel:
        config = transformers.MT5Config(**config.to_dict())
    hf = cls(config).eval()
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    prompts = random_prompts(VOCAB, [9, 21], seed=2)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        with torch.no_grad():
            ref = hf.encoder(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert_rel_close(hidden, ref.numpy())


def test_t5_sentence_transformers_folder(tmp_path: Path, default_model_dir: Path) -> None:
    """A sentence-t5 style folder (mean pooling, Dense, Normalize) with the MiniLM tokenizer:
    the engine gives what sentence-transformers gives."""
    from sentence_transformers import SentenceTransformer

    folder = make_st_folder(
        tmp_path / "st5",
        default_model_dir,
        pooling="pooling_mode_mean_tokens",
        dense_out=24,
        normalize=True,
    )
    torch.manual_seed(3)
    t5 = transformers.T5EncoderModel(_t5_config(vocab_size=30522, feed_forward_proj="gated-gelu"))
    save_hf_model(t5.eval(), folder, architectures=["T5EncoderModel"])
    texts = ["a tiny test sentence", "another, somewhat longer sentence about relative buckets"]
    engine = vecpool.Engine(folder, device="cpu")
    ours = engine.embed(texts)
    st = SentenceTransformer(str(folder), device="cpu")
    assert type(st[0].auto_model).__name__ == "T5EncoderModel"
    theirs = st.encode(texts, convert_to_numpy=True)
    assert ours.shape == theirs.shape == (2, 24)
    assert_rel_close(ours, theirs)


def test_t5_unknown_feed_forward_raises() -> None:
    hf = json.loads(_t5_config().to_json_string())
    hf["feed_forward_proj"] = "swiglu-relu"
    with pytest.raises(vecpool.ConfigError, match="feed_forward_proj"), torch.device("meta"):
        model_class("T5EncoderModel").from_hf_config(hf)


# ---- DeBERTa-v2 / v3 -------------------------------------------------------------------

DEBERTA_VARIANTS: dict[str, dict[str, Any]] = {
    # v3: log buckets, shared attention keys, normed relative embeddings, no absolute positions
    "v3": dict(
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=64,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        type_vocab_size=0,
    ),
    # v2: separate position projections, short relative span, absolute positions, token types
    # and a factorized embedding (embed_proj); pos_att_type as older configs write it
    "v2": dict(
        relative_attention=True,
        pos_att_type="c2p|p2c",
        max_relative_positions=6,
        position_biased_input=True,
        type_vocab_size=2,
        embedding_size=24,
    ),
    # no relative attention: absolute positions only, logits still scaled for both terms
    "absolute": dict(relative_attention=False, pos_att_type=["c2p", "p2c"], type_vocab_size=2),
}


def _deberta_config(variant: str, **overrides: Any) -> transformers.DebertaV2Config:
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        initializer_range=0.2,  # large enough weights that the relative terms matter
        num_labels=3,
        **DEBERTA_VARIANTS[variant],
    )
    kwargs.update(overrides)
    return transformers.DebertaV2Config(**kwargs)


def _deberta(cls: Any, variant: str, folder: Path) -> tuple[vecpool.Engine, Any]:
    torch.manual_seed(5)
    hf = cls(_deberta_config(variant)).eval()
    return vecpool.Engine(save_hf_model(hf, folder), device="cpu"), hf


@pytest.fixture(scope="module", params=list(DEBERTA_VARIANTS))
def deberta(request, tmp_path_factory) -> tuple[vecpool.Engine, Any]:
    return _deberta(transformers.DebertaV2Model, request.param, tmp_path_factory.mktemp("deb"))


def test_deberta_hidden_states_match_transformers(deberta) -> None:
    engine, hf = deberta
    prompts = random_prompts(VOCAB, LENGTHS)
    for prompt, hidden in zip(prompts, engine_hidden(engine, prompts), strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt))


def test_deberta_prompt_embeds_bit_exact(deberta) -> None:
    _prompt_embeds_bit_exact(deberta[0])


def test_deberta_batch_invariance(deberta) -> None:
    _batch_invariant(deberta[0])


@pytest.mark.parametrize("variant", list(DEBERTA_VARIANTS))
def test_deberta_sequence_classification(variant: str, tmp_path: Path) -> None:
    engine, hf = _deberta(transformers.DebertaV2ForSequenceClassification, variant, tmp_path)
    prompts = random_prompts(VOCAB, LENGTHS, seed=6)
    ours = engine.classify(prompts, use_activation=False)
    with torch.no_grad():
        ref = np.stack([hf(input_ids=torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert ours.shape == (len(prompts), 3)
    assert_rel_close(ours, ref)


def test_deberta_token_classification(tmp_path: Path) -> None:
    engine, hf = _deberta(transformers.DebertaV2ForTokenClassification, "v3", tmp_path)
    prompts = random_prompts(VOCAB, LENGTHS, seed=7)
    ours = engine.encode(prompts, task="token_classify", use_activation=False)
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
        assert_rel_close(logits, ref)


@pytest.mark.parametrize("legacy", [True, False], ids=["cls_predictions", "lm_predictions"])
def test_deberta_masked_lm_sparse(legacy: bool, tmp_path: Path) -> None:
    """DebertaV2ForMaskedLM, either head layout: vocabulary logits per token, and SPLADE
    (max over positions of log(1 + relu(logits))) through the engine."""
    torch.manual_seed(11)
    hf = transformers.DebertaV2ForMaskedLM(_deberta_config("v3", legacy=legacy)).eval()
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    prompts = random_prompts(VOCAB, LENGTHS, seed=12)
    hidden = engine_hidden(engine, prompts)
    sparse = engine.encode(prompts, task="sparse")
    for prompt, rows, vector in zip(prompts, hidden, sparse, strict=True):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt])).logits[0]
            ours = engine.model.compute_logits(torch.from_numpy(rows))
        assert_rel_close(ours.numpy(), logits.numpy())
        assert_rel_close(vector, torch.log1p(torch.relu(logits)).max(dim=0).values.numpy())


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"conv_kernel_size": 3}, "conv_kernel_size"),
        ({"pos_att_type": ["p2p", "c2p"]}, "pos_att_type"),
        ({"hidden_act": "swiglu_oai"}, "swiglu_oai"),
    ],
)
def test_deberta_unsupported_config_raises(change: dict[str, Any], named: str) -> None:
    hf = json.loads(_deberta_config("v3").to_json_string())
    hf.update(change)
    with pytest.raises(vecpool.ConfigError, match=named), torch.device("meta"):
        model_class("DebertaV2Model").from_hf_config(hf)


# ---- Jina BERT v2: the reference -------------------------------------------------------


def _ref_alibi_slopes(n: int) -> list[float]:
    # The published `_get_alibi_head_slopes`.
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _ref_alibi_slopes(2 * closest)[0::2][: n - closest]


def _layer_norm(n: int) -> nn.LayerNorm:
    return nn.LayerNorm(n, eps=1e-12)


class _RefSelfAttention(nn.Module):
    def __init__(self, h: int, qk_norm: bool):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        if qk_norm:
            self.layer_norm_q, self.layer_norm_k = _layer_norm(h), _layer_norm(h)


class _RefDenseNorm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(h, h), _layer_norm(h)


class _RefAttention(nn.Module):
    def __init__(self, h: int, qk_norm: bool):
        super().__init__()
        self.self = _RefSelfAttention(h, qk_norm)
        self.output = _RefDenseNorm(h)


class _RefLayer(nn.Module):
    def __init__(self, h: int, inter: int, qk_norm: bool):
        super().__init__()
        self.attention = _RefAttention(h, qk_norm)
        self.mlp = nn.Module()
        if qk_norm:
            self.mlp.up_gated_layer = nn.Linear(h, 2 * inter, bias=False)
            self.mlp.down_layer = nn.Linear(inter, h)
            self.layer_norm_1, self.layer_norm_2 = _layer_norm(h), _layer_norm(h)
        else:
            self.mlp.gated_layers = nn.Linear(h, 2 * inter, bias=False)
            self.mlp.wo = nn.Linear(inter, h)
            self.mlp.layernorm = _layer_norm(h)


class RefJinaBert(nn.Module):
    """Jina BERT v2 as published, run padded with an attention mask."""

    def __init__(self, vocab: int, h: int, heads: int, inter: int, layers: int, qk_norm: bool):
        super().__init__()
        self.heads, self.inter, self.qk_norm = heads, inter, qk_norm
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(vocab, h)
        self.embeddings.token_type_embeddings = nn.Embedding(2, h)
        self.embeddings.LayerNorm = _layer_norm(h)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_RefLayer(h, inter, qk_norm) for _ in range(layers))
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(h, h)
        with torch.no_grad():  # norms that are not the identity
            for name, p in self.named_parameters():
                if "norm" in name.lower():
                    p.add_(torch.randn_like(p) * 0.2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [B, L] each
        b, n = ids.shape
        emb = self.embeddings
        x = emb.LayerNorm(
            emb.word_embeddings(ids) + emb.token_type_embeddings(torch.zeros_like(ids))
        )
        extended = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        pos = torch.arange(n)
        distance = (pos[None, :] - pos[:, None]).abs()
        slopes = torch.tensor(_ref_alibi_slopes(self.heads)) * -1
        alibi = (slopes[:, None, None] * distance)[None]  # [1, H, L, L]

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, -1).permute(0, 2, 1, 3)

        for layer in self.encoder.layer:
            sa = layer.attention.self
            q, k = sa.query(x), sa.key(x)
            if self.qk_norm:
                q, k = sa.layer_norm_q(q), sa.layer_norm_k(k)
            q, k, v = split(q), split(k), split(sa.value(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + extended
            ctx = torch.softmax(scores + alibi, dim=-1) @ v
            ctx = ctx.permute(0, 2, 1, 3).reshape(b, n, -1)
            out = layer.attention.output
            a = out.LayerNorm(out.dense(ctx) + x)
            if self.qk_norm:
                h = layer.layer_norm_1(x + a)
                gated = layer.mlp.up_gated_layer(h)
                up, gate = gated[..., : self.inter], gated[..., self.inter :]
                x = layer.layer_norm_2(h + layer.mlp.down_layer(up * nn.functional.gelu(gate)))
            else:
                gated = layer.mlp.gated_layers(a)
                gate, up = gated[..., : self.inter], gated[..., self.inter :]
                x = layer.mlp.layernorm(layer.mlp.wo(nn.functional.gelu(gate) * up) + a)
        return x

    @torch.no_grad()
    def hidden(self, prompts: list[list[int]]) -> list[np.ndarray]:
        """Per prompt, its rows of one padded batch."""
        n = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (n - len(p)) for p in prompts])
        mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in prompts])
        out = self(ids, mask)
        return [out[i, : len(p)].numpy() for i, p in enumerate(prompts)]


JINA_SHAPE = dict(vocab=VOCAB, h=48, heads=6, inter=40, layers=2)  # 6 heads: not a power of 2


def _jina_config(architecture: str, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "architectures": [architecture],
        "model_type": "bert",
        "auto_map": {"AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"},
        "vocab_size": VOCAB,
        "hidden_size": JINA_SHAPE["h"],
        "num_hidden_layers": JINA_SHAPE["layers"],
        "num_attention_heads": JINA_SHAPE["heads"],
        "intermediate_size": JINA_SHAPE["inter"],
        "max_position_embeddings": 64,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "position_embedding_type": "alibi",
        "feed_forward_type": "geglu",
        "hidden_act": "gelu",
    }
    cfg.update(overrides)
    return cfg


def _save_jina(ref: nn.Module, folder: Path, config: dict[str, Any], **extra: torch.Tensor) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    prefix = "bert." if extra else ""
    tensors = {prefix + k: v.contiguous() for k, v in ref.state_dict().items()}
    tensors.update(extra)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _ref_jina(qk_norm: bool) -> RefJinaBert:
    torch.manual_seed(8)
    return RefJinaBert(**JINA_SHAPE, qk_norm=qk_norm).eval()  # type: ignore[arg-type]


JINA_LAYOUTS = [("base-en", False, "JinaBertForMaskedLM"), ("base-code", True, "JinaBertModel")]


@pytest.fixture(scope="module", params=JINA_LAYOUTS, ids=[x[0] for x in JINA_LAYOUTS])
def jina(request, tmp_path_factory) -> tuple[vecpool.Engine, RefJinaBert]:
    _, qk_norm, architecture = request.param
    ref = _ref_jina(qk_norm)
    folder = _save_jina(ref, tmp_path_factory.mktemp("jina"), _jina_config(architecture))
    return vecpool.Engine(folder, device="cpu"), ref


def test_jina_hidden_states_match_reference(jina) -> None:
    engine, ref = jina
    assert engine.model.config.qk_post_norm == ref.qk_norm
    prompts = random_prompts(VOCAB, LENGTHS)
    ours = engine_hidden(engine, prompts)
    for hidden, expected in zip(ours, ref.hidden(prompts), strict=True):
        assert_rel_close(hidden, expected)
    assert engine.defaults.pooler == "MEAN"


def test_jina_prompt_embeds_bit_exact(jina) -> None:
    _prompt_embeds_bit_exact(jina[0])


def test_jina_batch_invariance(jina) -> None:
    _batch_invariant(jina[0])


@pytest.mark.parametrize("qk_norm", [False, True], ids=["base-en", "base-code"])
def test_jina_sequence_classification(qk_norm: bool, tmp_path: Path) -> None:
    """JinaBertForSequenceClassification (jina-reranker-v1): BERT's pooler and classifier
    over the CLS row, the base model's tensors under `bert.`."""
    ref = _ref_jina(qk_norm)
    gen = torch.Generator().manual_seed(9)
    head = {
        "classifier.weight": torch.randn(1, JINA_SHAPE["h"], generator=gen),
        "classifier.bias": torch.randn(1, generator=gen),
    }
    config = _jina_config("JinaBertForSequenceClassification", num_labels=1)
    engine = vecpool.Engine(_save_jina(ref, tmp_path, config, **head), device="cpu")
    prompts = random_prompts(VOCAB, LENGTHS, seed=10)
    ours = engine.classify(prompts, use_activation=False)
    with torch.no_grad():
        cls_rows = torch.stack([torch.from_numpy(h[0]) for h in ref.hidden(prompts)])
        pooled = torch.tanh(ref.pooler.dense(cls_rows))
        expected = pooled @ head["classifier.weight"].T + head["classifier.bias"]
    assert ours.shape == (len(prompts), 1)
    assert_rel_close(ours, expected.numpy())


@pytest.mark.parametrize(
    ("architecture", "change", "named"),
    [
        ("BertModel", {}, "JinaBertModel"),  # alibi under BERT's name points to the Jina class
        ("JinaBertModel", {"feed_forward_type": "original"}, "feed_forward_type"),
        ("JinaBertModel", {"position_embedding_type": "absolute"}, "position_embedding_type"),
    ],
)
def test_jina_unsupported_config_raises(architecture: str, change: dict, named: str) -> None:
    hf = _jina_config(architecture, **change)
    with pytest.raises(vecpool.ConfigError, match=named), torch.device("meta"):
        model_class(architecture).from_hf_config(hf)
