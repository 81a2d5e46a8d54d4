"""Pure post-processing of a call's outputs: MaxSim, cosine, ranking, sparse vectors.

They take and return plain values (lists, numpy arrays), so the offline API and any async front
share them: prepare a call (`vecpool.calls`), run its requests however, finish it here.
Parameters were checked when the call was prepared; these functions trust them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from vecpool.errors import InputError


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
    """`(index, score)` pairs, best first (ties in input order): the first `top_n` of them, or
    all of them when `top_n` is None or 0."""
    if scores.ndim != 1:
        raise InputError(
            f"ranking needs one score per document, got scores of shape {list(scores.shape)} "
            "(a classifier with several labels cannot rerank)"
        )
    order = np.argsort(-scores, kind="stable")
    if top_n:
        order = order[:top_n]
    return [(int(i), float(scores[i])) for i in order]


def sparse_vector(
    weights: np.ndarray, top_k: int | None = None, threshold: float = 0.0
) -> dict[int, float]:
    """`{token_id: weight}` of a `[vocab]` SPLADE vector: weights above `threshold`, the
    `top_k` (>= 0) largest if given, heaviest first."""
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


# ---- quantized embeddings -----------------------------------------------------------------

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def quantization_ranges(
    embeddings: np.ndarray, calibration_embeddings: np.ndarray | None = None
) -> np.ndarray:
    """`[2, dim]`: the per-dimension minimum and maximum of `calibration_embeddings`, or of
    `embeddings` themselves (which takes more than one vector)."""
    data = embeddings if calibration_embeddings is None else calibration_embeddings
    if data.ndim != 2 or (data.shape[0] < 2 and calibration_embeddings is None):
        raise InputError(
            "int8 / uint8 ranges cannot be computed from a single embedding; pass ranges "
            "([2, dim]: per-dimension minimum and maximum) or calibration embeddings",
            field="ranges",
        )
    return np.vstack((data.min(axis=0), data.max(axis=0)))


def quantize(
    embeddings: np.ndarray,
    precision: str,
    ranges: np.ndarray | None = None,
    calibration_embeddings: np.ndarray | None = None,
) -> np.ndarray:
    """`[n, dim]` float embeddings at a lower `precision`, as sentence-transformers'
    `quantize_embeddings` defines them:

    - `int8` / `uint8`: each dimension's range (`ranges[0]` to `ranges[1]`; else the minimum
      and maximum of `calibration_embeddings`, else of `embeddings`) cut into 256 buckets,
      `floor((x - min) / ((max - min) / 255))` clipped to [0, 255]; int8 is that minus 128.
    - `binary` / `ubinary`: one bit per dimension (1 where `x > 0`), packed eight to a byte,
      first dimension in the high bit: `[n, ceil(dim / 8)]`; binary is the byte minus 128.
    - `float32`: the embeddings as float32.
    """
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision in ("int8", "uint8"):
        if ranges is None:
            ranges = quantization_ranges(embeddings, calibration_embeddings)
        ranges = np.asarray(ranges, dtype=np.float32)
        starts = ranges[0]
        steps = (ranges[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        if precision == "uint8":
            return buckets.astype(np.uint8)
        return (buckets - 128).astype(np.int8)
    bits = np.packbits(embeddings > 0, axis=-1)
    if precision == "ubinary":
        return bits
    return (bits.astype(np.int16) - 128).astype(np.int8)


def unit_ranges(dim: int) -> np.ndarray:
    """`[2, dim]` ranges of -1 to 1: where every component of a unit vector lies."""
    return np.vstack((np.full(dim, -1.0, np.float32), np.full(dim, 1.0, np.float32)))
