"""Windowed embedding: an input longer than the model's limit embedded as the token-weighted
mean of overlapping windows.

An approximation, offered for the embed task only: no token of one window attends to a token
of another, so the result is not what a model with a longer limit would give. Each window of an
over-long input is at most `max_model_len` tokens (a text's special tokens around a slice of its
own tokens), a slice sharing `overlap` tokens with the one before; window `w`, holding `n_w` of
the input's own tokens, is embedded without normalization to `e_w`, and the input's embedding is

    e = sum_w n_w e_w / sum_w n_w

then truncated to `dimensions` and L2-normalized as any embedding is. An input within the
limit is embedded as usual.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vecpool.calls.context import CallContext, as_input_list, instruction, make_requests
from vecpool.calls.options import EmbedOptions
from vecpool.calls.outputs import PoolingOutput, PreparedCall, PromptRequest, output_data
from vecpool.inputs import TextOptions
from vecpool.tasks import PoolingParams


def combine_windows(
    vectors: np.ndarray,  # [num_windows, dim] float32: the windows' embeddings, not normalized
    weights: np.ndarray,  # [num_windows]: each window's count of the input's own tokens
    dimensions: int | None,
    normalize: bool,
) -> np.ndarray:  # [dimensions or dim] float32
    """The embedding of a windowed input, as the module's docstring defines it."""
    mean = (weights.astype(np.float64)[:, None] * vectors).sum(axis=0) / float(weights.sum())
    if dimensions is not None:
        mean = mean[:dimensions]
    if normalize:
        mean = mean / max(float(np.linalg.norm(mean)), 1e-12)
    return mean.astype(np.float32)


def prepare_embed_windowed(
    ctx: CallContext, inputs: Any, options: EmbedOptions | None = None, **keywords: Any
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.embed(..., windowed=True)` and its result, `[n, dim]` float32:
    inputs within the model's limit as `embed` gives them, longer ones windowed (windows of
    the model's length sharing `info.embed_window_overlap` tokens; normalized as the call
    says, else as the model does)."""
    o = EmbedOptions.build(options, keywords)
    dimensions, normalize = o.dimensions, o.normalize
    params = PoolingParams(task="embed", dimensions=dimensions, normalize=normalize)
    text = TextOptions(
        o.truncate_prompt_tokens,
        o.truncation_side,
        instruction(ctx, o.prompt_name, o.prompt),
        o.add_special_tokens,
    )
    # The call's parameters, as any embed call's.
    make_requests(ctx, [], params, text, o.matryoshka_only)
    raw = PoolingParams(task="embed", normalize=False)  # a window's embedding, to be combined
    requests: list[PromptRequest] = []
    weights: list[np.ndarray | None] = []  # per input: its windows' weights; None: not windowed
    items = as_input_list(inputs)
    for index, windows in enumerate(ctx.inputs.windows(items, text, ctx.info.embed_window_overlap)):
        if len(windows) == 1:
            requests.append(PromptRequest(index, windows[0][0], params))
            weights.append(None)
        else:
            requests.extend(PromptRequest(index, window, raw) for window, _ in windows)
            weights.append(np.array([n for _, n in windows]))
    normalize_windowed = ctx.info.embed_normalize if normalize is None else normalize

    def finish(outputs: list[PoolingOutput]) -> np.ndarray:
        data = output_data(outputs)
        vectors, at = [], 0
        for w in weights:
            if w is None:
                vectors.append(data[at])
                at += 1
            else:
                parts = np.stack(data[at : at + len(w)])
                vectors.append(combine_windows(parts, w, dimensions, normalize_windowed))
                at += len(w)
        if not vectors:
            return np.zeros((0, ctx.info.embed_dim(dimensions)), dtype=np.float32)
        return np.stack(vectors)

    return PreparedCall(requests, finish)
