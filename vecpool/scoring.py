"""Pure functions around scoring: pairing inputs, MaxSim, cosine, ranking, sparse vectors.

They take and return plain values (lists, numpy arrays), so the offline API and an async server
front share them: build requests, run them however, post-process here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from vecpool.errors import InputError


def as_input_list(inputs: Any) -> list[Any]:
    """A single input (text, dict, flat id list or 1-D tensor) becomes a list of one."""
    if isinstance(inputs, str | Mapping):
        return [inputs]
    if isinstance(inputs, torch.Tensor | np.ndarray):
        return [inputs] if inputs.ndim == 1 else list(inputs)
    if isinstance(inputs, Sequence):
        if (
            len(inputs) > 0
            and isinstance(inputs[0], int | np.integer)
            and not isinstance(inputs[0], bool)
        ):
            return [inputs]
        return list(inputs)
    raise InputError(
        f"inputs must be a string, a dict or a list of inputs, got {type(inputs).__name__}"
    )


def pair_up(a: Any, b: Any) -> tuple[list[Any], list[Any]]:
    """The two sides of a score call: one left input against every right one (1 -> 1, 1 -> N),
    or lists of one length paired in order (N -> N). The left list has one item or as many as
    the right; `pair_indices` says which left item each pair uses."""
    lefts, rights = as_input_list(a), as_input_list(b)
    if not lefts:
        raise InputError("the first side of a score call is empty", field="text_1")
    if len(lefts) != 1 and len(lefts) != len(rights):
        raise InputError(
            f"the first side has {len(lefts)} inputs and the second {len(rights)}: give one "
            "first input, or two lists of one length",
            field="text_1",
        )
    return lefts, rights


def pair_indices(num_lefts: int, num_rights: int) -> list[int]:
    """For each pair, the index of its left input (all 0 for one left input)."""
    return [0] * num_rights if num_lefts == 1 else list(range(num_rights))


def text_pairs(lefts: list[Any], rights: list[Any]) -> list[dict[str, str]]:
    """`{"text": left, "text_pair": right}` inputs for a cross-encoder; both must be texts."""
    out = []
    for i, (left, right) in enumerate(
        zip((lefts[j] for j in pair_indices(len(lefts), len(rights))), rights, strict=True)
    ):
        for name, value in (("text_1", left), ("text_2", right)):
            if not isinstance(value, str):
                raise InputError(
                    f"a cross-encoder or LLM reranker scores texts, got {type(value).__name__}",
                    index=i,
                    field=name,
                )
        out.append({"text": left, "text_pair": right})
    return out


def maxsim(query: np.ndarray, documents: Sequence[np.ndarray], *, mean: bool = False) -> np.ndarray:
    """Late-interaction scores `sum_i max_j q_i . d_j` of one query (`[nq, dim]`) against each
    document (`[nd_k, dim]`): `[num_documents]` float32. `mean`: divided by `nq` (MeanMaxSim,
    sentence-transformers' "meanmaxsim")."""
    if not documents:
        return np.zeros(0, dtype=np.float32)
    lengths = [d.shape[0] for d in documents]
    sims = query @ np.concatenate(documents).T  # [nq, total document tokens]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    best = np.maximum.reduceat(sims, starts, axis=1)  # [nq, num_documents]
    scores = best.sum(axis=0)
    if mean:
        scores = scores / max(query.shape[0], 1)
    return scores.astype(np.float32)


def cosine(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of `[n, dim]` arrays (a row may be broadcast): `[n]`."""
    left = left / np.maximum(np.linalg.norm(left, axis=-1, keepdims=True), 1e-12)
    right = right / np.maximum(np.linalg.norm(right, axis=-1, keepdims=True), 1e-12)
    return np.sum(left * right, axis=-1).astype(np.float32)


def rank(scores: np.ndarray, top_n: int | None = None) -> list[tuple[int, float]]:
    """`(index, score)` pairs, best first (ties in input order), the first `top_n` of them
    (`Engine.prepare_rerank` has checked `top_n` before anything ran)."""
    if scores.ndim != 1:
        raise InputError(
            f"ranking needs one score per document, got scores of shape {list(scores.shape)} "
            "(a classifier with several labels cannot rerank)"
        )
    order = np.argsort(-scores, kind="stable")
    if top_n is not None:
        order = order[:top_n]
    return [(int(i), float(scores[i])) for i in order]


def sparse_vector(
    weights: np.ndarray, top_k: int | None = None, threshold: float = 0.0
) -> dict[int, float]:
    """`{token_id: weight}` of a `[vocab]` SPLADE vector: weights above `threshold`, the
    `top_k` largest if given, heaviest first."""
    if top_k is not None and top_k < 0:
        raise InputError(f"top_k must be non-negative, got {top_k}", field="top_k")
    ids = np.flatnonzero(weights > threshold)
    values = weights[ids]
    if top_k is not None and ids.size > top_k:
        keep = np.argpartition(-values, top_k)[:top_k] if top_k else np.zeros(0, dtype=np.int64)
        ids, values = ids[keep], values[keep]
    order = np.lexsort((ids, -values))  # heaviest first, ties by id
    return {int(ids[i]): float(values[i]) for i in order}


def sparse_tokens(
    vector: Mapping[int, float], id_to_token: Callable[[int], str | None]
) -> dict[str, float]:
    """A sparse vector keyed by token strings instead of ids (unknown ids as `"[id]"`)."""
    out: dict[str, float] = {}
    for token_id, weight in vector.items():
        token = id_to_token(token_id)
        out[token if token is not None else f"[{token_id}]"] = weight
    return out
