"""NomicBERT (`NomicBertModel`, `model_type: nomic_bert`): nomic-embed-text-v1 / v1.5.

The rotary post-norm encoder of `rotary_bert`, under NomicBERT's names: a fused `Wqkv`, a gated
MLP (`fc2(fc11(x) * act(fc12(x)))`: SwiGLU in the published checkpoints), and no biases where
the config turns them off (`qkv_proj_bias`, `mlp_fc1_bias`, `mlp_fc2_bias`). Its config keeps
GPT-2's names (`n_embd`, `n_layer`, `n_head`, `n_inner`, `n_positions`). The published code
lives in the model repositories (remote code); this is written from it and never runs it.

The folder's prompts (`search_query: `, `search_document: `) come from
config_sentence_transformers.json and matryoshka truncation is the `dimensions` option, both
handled outside the model.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vecpool.errors import ConfigError
from vecpool.models.architectures.rotary_bert import (
    RotaryBertConfig,
    RotaryBertModel,
    RotaryBertNames,
    check_settings,
)
from vecpool.models.base import hf_num_labels

# The gated activations, by the activation each applies to the gate (fc12's output).
_GATES = {"swiglu": "silu", "geglu": "gelu", "glu": "sigmoid"}


def nomic_bert_config(hf: dict[str, Any]) -> RotaryBertConfig:
    """The encoder's shape and options from a NomicBERT config.json (GPT2Config's defaults and
    the published NomicBertConfig's, for keys a config omits)."""
    check_settings(
        "NomicBERT",
        {
            "prenorm": (hf.get("prenorm", False), False),
            "causal": (hf.get("causal", False), False),
            "rotary_emb_fraction": (float(hf.get("rotary_emb_fraction", 0.0)), 1.0),
            "rotary_emb_interleaved": (hf.get("rotary_emb_interleaved", False), False),
            "rotary_emb_scale_base": (hf.get("rotary_emb_scale_base"), None),
            "use_rms_norm": (hf.get("use_rms_norm", False), False),
            "parallel_block": (hf.get("parallel_block", False), False),
            "norm_mlp": (hf.get("norm_mlp", False), False),
            "moe_every_n_layers": (int(hf.get("moe_every_n_layers") or 0), 0),
        },
    )
    act = str(hf.get("activation_function", "gelu_new"))
    if act not in _GATES:
        raise ConfigError(
            f"NomicBERT activation_function {act!r} is not supported ({', '.join(_GATES)})"
        )
    hidden, heads = int(hf["n_embd"]), int(hf["n_head"])
    if hidden % heads:
        raise ConfigError(f"n_embd={hidden} is not a multiple of n_head={heads}")
    kv_heads = hf.get("num_heads_kv")
    if kv_heads is not None and int(kv_heads) != heads:
        raise ConfigError(f"NomicBERT num_heads_kv={kv_heads} (grouped queries) is not supported")
    inner = hf.get("n_inner")
    if inner is None:  # the reference's default: 8/3 of the width, up to a multiple of 256
        inner = (int(8 * hidden / 3) + 255) // 256 * 256
    # The vocabulary padded to a multiple of pad_vocab_size_multiple, as the checkpoint is.
    vocab, multiple = int(hf["vocab_size"]), int(hf.get("pad_vocab_size_multiple", 1))
    vocab += -vocab % multiple
    # Dynamic NTK scaling (`rotary_scaling_factor`) changes the rotary base only beyond
    # `max_trained_positions`, by the padded length of the reference's batch: sequences are
    # kept within it, where the reference's rotary is the plain one.
    if hf.get("rotary_scaling_factor"):
        max_positions = int(hf.get("max_trained_positions", 2048))
    else:
        max_positions = int(hf.get("n_positions", 1024))
    qkv_bias = bool(hf.get("qkv_proj_bias", True))
    return RotaryBertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(hf["n_layer"]),
        num_heads=heads,
        intermediate_size=int(inner),
        gate_act=_GATES[act],
        max_positions=max_positions,
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        rope_theta=float(hf.get("rotary_emb_base", 10000.0)),
        num_labels=hf_num_labels(hf),
        qkv_bias=qkv_bias,
        out_bias=qkv_bias,
        up_gate_bias=bool(hf.get("mlp_fc1_bias", True)),
        down_bias=bool(hf.get("mlp_fc2_bias", True)),
    )


class NomicBertModel(RotaryBertModel):
    """`embeddings`, `emb_ln`, `encoder`: the checkpoint of nomic-embed-text. Mean pooling when
    the folder does not say, as nomic-embed-text pools."""

    names = RotaryBertNames(
        embedding_norm="emb_ln",
        layers="encoder.layers",
        attention="attn",
        attention_norm="norm1",
        mlp_norm="norm2",
        qkv="Wqkv",
        out="out_proj",
        up_gate=("fc11", "fc12"),
        down="fc2",
    )
    checkpoint_prefixes = ("bert.",)
    pooling = "MEAN"
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("pooler.*",)

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any]) -> RotaryBertConfig:
        return nomic_bert_config(hf)
