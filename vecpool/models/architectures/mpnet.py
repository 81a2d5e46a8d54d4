"""MPNet encoders (all-mpnet-base-v2, multi-qa-mpnet): BERT's post-norm layers without token
types, plus a relative position bias that every layer adds to its attention logits.

The bias is one table per step, `[1, heads, max_seqlen, max_seqlen]`, looked up from bucketed
query-key distances and shared by all layers: on CUDA `biased_attention`'s varlen kernel adds
it, elsewhere the exact padded path of `flat_attention`. Absolute positions are counted from
`padding_idx + 1` = 2, as in transformers.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from vecpool.errors import ConfigError, ModelLoadError
from vecpool.models.architectures.bert import (
    BertConfig,
    BertEmbeddings,
    BertLayer,
    RobertaForMaskedLM,
)
from vecpool.models.architectures.encoder import EncoderModel
from vecpool.models.architectures.encoder_heads import (
    HeadSequenceClassifier,
    MaskedLM,
    TokenClassifier,
)
from vecpool.models.base import Capability, PoolingModel
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.encoder_blocks import FusedSelfAttention

# transformers' MPNet fixes the padding index at 1 (whatever pad_token_id says) and always
# buckets distances into 32 buckets up to 128 apart, whatever relative_attention_num_buckets
# says (that only sizes the bias table).
_PADDING_IDX = 1
_NUM_BUCKETS = 32
_MAX_DISTANCE = 128


def mpnet_config(hf: dict[str, Any]) -> BertConfig:
    """The layer sizes of an MPNet `config.json` (BERT's keys), in the BERT layers' config: no
    token types, positions from `padding_idx + 1`."""
    return BertConfig.read(
        hf,
        defaults={"layer_norm_eps": 1e-5},
        type_vocab_size=0,
        position_offset=_PADDING_IDX + 1,
    )


def relative_position_buckets(length: int) -> torch.Tensor:
    """`[length, length]` int64 on the CPU: the bucket of query `i` and key `j`, as MPNet's
    `relative_position_bucket` computes it (half the buckets per direction, exact distances
    below a quarter of them, logarithmic bins up to `_MAX_DISTANCE`)."""
    pos = torch.arange(length, dtype=torch.int64, device="cpu")
    distance = pos[:, None] - pos[None, :]  # [L, L] query - key
    half = _NUM_BUCKETS // 2
    max_exact = half // 2
    direction = (distance < 0).to(torch.int64) * half
    n = distance.abs()
    # The same float32 operations in the same order as transformers, so that the bins agree.
    log_bin = torch.log(n.float() / max_exact) / math.log(_MAX_DISTANCE / max_exact)
    large = (max_exact + (log_bin * (half - max_exact)).to(torch.int64)).clamp(max=half - 1)
    return direction + torch.where(n < max_exact, n, large)


class MPNetSelfAttention(FusedSelfAttention):
    """`q`, `k`, `v` with the step's relative position bias, then `o`."""

    qkv_names = ("q", "k", "v")
    out_name = "o"


class MPNetAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attn = MPNetSelfAttention(c)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata, bias: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.attn(x, attn, bias) + x)


class MPNetEncoder(nn.Module):
    def __init__(self, c: BertConfig, num_buckets: int):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c, MPNetAttention(c)) for _ in range(c.num_layers))
        self.relative_attention_bias = nn.Embedding(num_buckets, c.num_heads)


class MPNetModel(EncoderModel):
    """The bare MPNet encoder; also what an `MPNetForMaskedLM` folder holding only the base
    model's weights loads as (see `MPNetForMaskedLM`)."""

    checkpoint_prefixes = ("mpnet.",)
    unused_checkpoint_keys: ClassVar[tuple[str, ...]] = ("pooler.*", "embeddings.position_ids")

    def __init__(self, c: BertConfig, num_buckets: int):
        super().__init__(c, c.max_position_embeddings - c.position_offset)
        if num_buckets < _NUM_BUCKETS:
            raise ConfigError(
                f"relative_attention_num_buckets is {num_buckets}; MPNet buckets relative "
                f"positions into {_NUM_BUCKETS}, so it needs at least that many"
            )
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.encoder = MPNetEncoder(c, num_buckets)
        # Real values, not parameters: built on the CPU once, copied to the model's device on
        # first use. Every step's bias is a lookup of its top-left corner.
        self._buckets = relative_position_buckets(max(self.max_positions, 1))  # [P, P] int64
        self._device_buckets: torch.Tensor | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> PoolingModel:
        num_buckets = int(hf_get(hf, "relative_attention_num_buckets", default=_NUM_BUCKETS))
        return cls(mpnet_config(hf), num_buckets)

    def layer_inputs(
        self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """The step's relative position bias, `[1, heads, max_seqlen, max_seqlen]` (one lookup)."""
        table = self.encoder.relative_attention_bias.weight  # [num_buckets, heads]
        buckets = self._device_buckets
        if buckets is None or buckets.device != table.device:
            buckets = self._device_buckets = self._buckets.to(table.device)
        length = attn.max_seqlen
        values = nn.functional.embedding(buckets[:length, :length], table)  # [L, L, H]
        return (values.permute(2, 0, 1).contiguous().unsqueeze(0),)  # rows of keys, for the kernel


class MPNetForMaskedLM(MaskedLM, MPNetModel):
    """MPNet with its masked-LM head `lm_head` (dense, gelu, layer_norm, tied decoder).

    all-mpnet-base-v2 names this architecture but ships only the base model's weights (no
    `mpnet.` prefix, no `lm_head`): such a folder loads as the bare encoder, without the
    masked-LM capability. A head that is only partly there is an error.
    """

    # The same layout and gelu as RoBERTa's.
    lm_names = RobertaForMaskedLM.lm_names
    lm_act = RobertaForMaskedLM.lm_act
    tied_weights = RobertaForMaskedLM.tied_weights
    optional_parameters: ClassVar[tuple[str, ...]] = (
        "lm_head.dense.weight",
        "lm_head.dense.bias",
        "lm_head.layer_norm.weight",
        "lm_head.layer_norm.bias",
        "lm_head.bias",
        "lm_head.decoder.bias",
        "lm_head.decoder.weight",
    )

    def __init__(self, c: BertConfig, num_buckets: int):
        super().__init__(c, num_buckets)
        self._dropped: list[str] = []

    def drop_parameter(self, name: str) -> None:
        # The decoder weight, when tied, is already the word embeddings (no memory of its own)
        # and stays; the rest of the head goes, and with it the ties left to check.
        module_name, _, attr = name.rpartition(".")
        delattr(self.get_submodule(module_name), attr)
        self._dropped.append(name)
        self.capabilities = frozenset()
        self.tie_word_embeddings = False

    def post_load(self) -> None:
        if self._dropped:
            loaded = [
                n
                for n in self.optional_parameters
                if n not in self._dropped and n not in self.tied_weights
            ]
            if loaded:
                raise ModelLoadError(
                    f"missing tensors for {type(self).__name__}: {', '.join(self._dropped)} "
                    f"(the checkpoint has the rest of the masked-LM head: {', '.join(loaded)})"
                )
        super().post_load()

    def compute_logits(
        self, rows: torch.Tensor, vocab_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if Capability.MASKED_LM not in self.capabilities:
            raise ConfigError(
                "this MPNetForMaskedLM checkpoint holds only the base model's weights (no "
                "lm_head), so it cannot produce vocabulary logits"
            )
        return super().compute_logits(rows, vocab_ids)


class MPNetForSequenceClassification(HeadSequenceClassifier, MPNetModel):
    """The first (`<s>`) row through `classifier.dense`, tanh, `classifier.out_proj`."""


class MPNetForTokenClassification(TokenClassifier, MPNetModel):
    """`classifier` on every token row."""
