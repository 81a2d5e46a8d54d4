"""Pooling methods: which rows of a flat batch's hidden states an output reads, by index
arithmetic on its sequence boundaries.

Sequence methods (CLS, MEAN, LAST, MAX, MEAN_SQRT_LEN, WEIGHTED_MEAN) reduce each sequence to
one float32 vector, in parts that merge across the chunks of a prompt run over several steps; `sequence_rows` picks the one row a classifier reads (CLS or LAST);
`token_rows` picks the rows of per-token outputs (ALL, or STEP: the positions holding a tag);
`marked_rows` the positions holding any of a set of marker ids (MARKED: a listwise reranker's).
None of them loops over requests in Python. What is computed from the rows is a head's business
(`vecpool.pooling.heads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vecpool.errors import ConfigError


@dataclass
class PoolingMetadata:
    """The part of a flat batch the pooling methods read. Tensors live on the model's device."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64
    lengths: torch.Tensor  # [num_seqs] int64
    seq_ids: torch.Tensor  # [num_tokens] int64
    input_ids: torch.Tensor  # [num_tokens] int64; 0 on rows that came as prompt embeds
    last_rows: torch.Tensor  # [num_seqs] int64: each sequence's last row (`cu_seqlens[1:] - 1`)
    # [num_seqs] int64: the prompt position each sequence's rows start at (a chunk of a longer
    # prompt); None: every sequence is a whole prompt.
    starts: torch.Tensor | None = None


@dataclass(frozen=True)
class SequenceMethod:
    """A sequence method, split so that a prompt run in chunks pools exactly as it would whole:
    `reduce` a chunk's rows to one float32 vector, `merge` the vectors of a prompt's chunks in
    order, `finish` the merged vector knowing the prompt's length. A whole prompt is one chunk."""

    # (hidden [num_tokens, hidden], meta) -> [num_seqs, hidden] float32, one vector per chunk
    reduce: Callable[[torch.Tensor, PoolingMetadata], torch.Tensor]
    merge: str  # "sum", "max", "first" (the first chunk's vector), "last" (the last chunk's)
    # (merged [k, hidden] float32, prompt lengths [k] int64) -> pooled [k, hidden] float32;
    # None: the merged vector is the pooled one (no lengths to select for it)
    finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def merge_values(how: str, earlier: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """What earlier chunks left (`earlier`) combined with a chunk's values, elementwise."""
    if how == "sum":
        return earlier + chunk
    if how == "max":
        return torch.maximum(earlier, chunk)
    if how == "first":
        return earlier
    if how == "last":
        return chunk
    raise ValueError(f"unknown merge {how!r}")


def _cls(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden[meta.cu_seqlens[:-1]].float()


def _last(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return hidden[meta.last_rows].float()


def _segments(values: torch.Tensor, reduce: str, meta: PoolingMetadata) -> torch.Tensor:
    """`[num_seqs, ...]`: each sequence's rows of `values` reduced, in one fixed order on every
    device (no atomics). `unsafe`: the lengths are the batch's own (none negative, they add up
    to the rows); checking them would read them back from the device, two syncs per step."""
    return torch.segment_reduce(values, reduce, lengths=meta.lengths, axis=0, unsafe=True)


def _sum(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    # Segment sums accumulate in float32 whatever the model dtype.
    return _segments(hidden.float(), "sum", meta)


def _max(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    return _segments(hidden.float(), "max", meta)


def _position_weighted_sum(hidden: torch.Tensor, meta: PoolingMetadata) -> torch.Tensor:
    # sentence-transformers' weighting: the token at prompt position p weighs p + 1.
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    positions = rows - meta.cu_seqlens[meta.seq_ids]
    if meta.starts is not None:
        positions = positions + meta.starts[meta.seq_ids]
    weights = (positions + 1).float()  # [num_tokens]
    return _segments(hidden.float() * weights[:, None], "sum", meta)


def _per_token(merged: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return merged / lengths[:, None].float()


def _per_sqrt_len(merged: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return merged / lengths[:, None].float().sqrt()


def _per_weight(merged: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    n = lengths.float()
    return merged / (n * (n + 1) / 2)[:, None]


# The names are `vecpool.config.SEQUENCE_METHODS` (what options accept), in the same order.
METHODS: dict[str, SequenceMethod] = {
    "CLS": SequenceMethod(_cls, "first"),
    "MEAN": SequenceMethod(_sum, "sum", _per_token),
    "LAST": SequenceMethod(_last, "last"),
    "MAX": SequenceMethod(_max, "max"),
    "MEAN_SQRT_LEN": SequenceMethod(_sum, "sum", _per_sqrt_len),
    "WEIGHTED_MEAN": SequenceMethod(_position_weighted_sum, "sum", _per_weight),
}


def prompt_lengths(meta: PoolingMetadata) -> torch.Tensor:
    """`[num_seqs]` int64: the prompt length up to the end of each sequence's rows (a whole
    prompt's length, or where a chunk ends)."""
    return meta.lengths if meta.starts is None else meta.starts + meta.lengths


def sequence_rows(method: str, meta: PoolingMetadata, seqs: torch.Tensor | None) -> torch.Tensor:
    """`[k]` int64: the row each of the sequences `seqs` (`[k]` batch positions; None: every
    sequence, in order) is read at: its first token (CLS) or its last (LAST)."""
    if method == "CLS":
        starts = meta.cu_seqlens[:-1]
        return starts if seqs is None else starts[seqs]
    if method == "LAST":
        return meta.last_rows if seqs is None else meta.last_rows[seqs]
    raise ConfigError(f"a classifier reads the CLS or LAST row, not {method!r}")


def token_rows(
    meta: PoolingMetadata,
    seqs: torch.Tensor,  # [k] int64: batch positions of the sequences served
    step_tags: list[int | None],  # [k]: STEP token id per sequence, None for ALL
    keep: torch.Tensor | None = None,  # [num_tokens] bool: rows that may be returned at all
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The rows of per-token outputs: every row of an ALL sequence, the rows holding its tag of
    a STEP sequence (and only rows `keep` allows). Returns the `[num_tokens]` bool selection,
    each selected row's index among `seqs` (`[num_selected]`), and each sequence's row count."""
    device = seqs.device
    num_seqs, k = int(meta.lengths.shape[0]), len(step_tags)
    served = torch.zeros(num_seqs, dtype=torch.bool, device=device)
    served[seqs] = True
    tagged = torch.zeros(num_seqs, dtype=torch.bool, device=device)
    tagged[seqs] = on_device(device, [t is not None for t in step_tags], torch.bool)
    tags = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    tags[seqs] = on_device(device, [0 if t is None else t for t in step_tags], torch.int64)
    local = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    local[seqs] = torch.arange(k, device=device)
    seq = meta.seq_ids
    selected = served[seq] & (~tagged[seq] | (meta.input_ids == tags[seq]))
    if keep is not None:
        selected = selected & keep
    row_seq = local[seq[selected]]
    counts = torch.bincount(row_seq, minlength=k).cpu().tolist()
    return selected, row_seq, counts


def marked_rows(
    meta: PoolingMetadata,
    seqs: torch.Tensor,  # [k] int64: batch positions of the sequences served
    marked: torch.Tensor,  # [vocab] bool: the token ids whose positions are read
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """MARKED: the rows of `seqs` holding one of the `marked` token ids, in token order
    (several pooled positions per prompt: a listwise reranker's document and query markers).
    Returns what `token_rows` returns: the `[num_tokens]` bool selection, each selected row's
    index among `seqs`, and each sequence's row count."""
    return token_rows(meta, seqs, [None] * int(seqs.shape[0]), keep=marked[meta.input_ids])


def on_device(device: torch.device, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on `device` (copied without waiting)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
