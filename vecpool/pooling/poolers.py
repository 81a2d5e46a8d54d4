"""Poolers: index arithmetic on a flat batch's sequence boundaries.

Sequence poolers reduce each sequence to one float32 vector. Token selectors pick the rows
of per-token outputs. None of them loops over requests in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SEQUENCE_POOLERS = ("CLS", "MEAN", "LAST", "MAX", "MEAN_SQRT_LEN", "WEIGHTED_MEAN")


@dataclass
class PoolingMetadata:
    """The part of a flat batch the poolers read. Tensors live on the model's device."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64
    lengths: torch.Tensor  # [num_seqs] int64
    seq_ids: torch.Tensor  # [num_tokens] int64
    input_ids: torch.Tensor  # [num_tokens] int64; 0 on rows that came as prompt embeds


def _cls(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden[meta.cu_seqlens[:-1]].float()


def _last(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden[meta.cu_seqlens[1:] - 1].float()


def _mean(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    # Segment sums accumulate in float32 whatever the model dtype; deterministic on every device.
    sums = torch.segment_reduce(hidden.float(), "sum", lengths=meta.lengths, axis=0)
    return sums / meta.lengths[:, None].float()


def _max(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return torch.segment_reduce(hidden.float(), "max", lengths=meta.lengths, axis=0)


def _mean_sqrt_len(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    sums = torch.segment_reduce(hidden.float(), "sum", lengths=meta.lengths, axis=0)
    return sums / meta.lengths[:, None].float().sqrt()


def _weighted_mean(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    # sentence-transformers' weighting: the i-th token of a sequence weighs i (from 1).
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    weights = (rows - meta.cu_seqlens[meta.seq_ids] + 1).float()  # [num_tokens]
    sums = torch.segment_reduce(hidden.float() * weights[:, None], "sum", lengths=meta.lengths)
    total = meta.lengths.float() * (meta.lengths.float() + 1) / 2
    return sums / total[:, None]


_POOLERS: dict[str, Callable[[torch.Tensor, PoolingMetadata], torch.Tensor]] = {
    "CLS": _cls,
    "MEAN": _mean,
    "LAST": _last,
    "MAX": _max,
    "MEAN_SQRT_LEN": _mean_sqrt_len,
    "WEIGHTED_MEAN": _weighted_mean,
}


def pool_sequences(kind: str, hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    """`[num_seqs, hidden]` float32: every sequence of the batch pooled by `kind`."""
    return _POOLERS[kind](hidden, meta)


def select_tokens(
    meta: PoolingMetadata,
    wanted: torch.Tensor,  # [num_seqs] bool: sequences whose tokens are returned
    step_tag: torch.Tensor,  # [num_seqs] int64: STEP token id per sequence, -1 for ALL
) -> torch.Tensor:  # [num_tokens] bool
    """Rows to return per token: all rows of ALL sequences, tagged rows of STEP sequences."""
    tag = step_tag[meta.seq_ids]
    return wanted[meta.seq_ids] & ((tag < 0) | (meta.input_ids == tag))
