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

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from vecpool.calls.context import CallContext, as_input_list, instruction, make_requests
from vecpool.calls.options import EmbedOptions
from vecpool.calls.outputs import PoolingOutput, PreparedCall, PromptRequest, output_data
from vecpool.errors import InputError
from vecpool.inputs.prompts import InputProcessor, Prompt, TextOptions, input_kind
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


def input_windows(
    processor: InputProcessor, inputs: Sequence[Any], options: TextOptions, overlap: int
) -> list[list[tuple[Prompt, int]]]:
    """Every input as one prompt, or, when it is longer than the model's limit, as windows of
    the limit's length: consecutive slices of its tokens, each sharing `overlap` tokens with
    the one before; a text's special tokens (e.g. [CLS] and [SEP]) surround every slice.
    Returns, per input, `(prompt, number of the input's own tokens in it)` pairs (a whole
    input counts all its tokens). With `truncate_prompt_tokens`, inputs are truncated, not
    split. `InputError` names the first bad input."""
    if options.truncate_prompt_tokens is not None:
        return [[(p, p.num_tokens)] for p in processor.process(inputs, options)]
    max_len = processor.limits.max_model_len
    unlimited = InputProcessor(
        replace(processor.limits, max_model_len=sys.maxsize), processor.tokenizer
    )
    out: list[list[tuple[Prompt, int]]] = []
    for i, (item, prompt) in enumerate(
        zip(inputs, unlimited.process(inputs, options), strict=True)
    ):
        if prompt.num_tokens <= max_len:
            out.append([(prompt, prompt.num_tokens)])
            continue
        kind = input_kind(item, i)
        if kind == "pair":
            raise InputError(
                f"the text pair has {prompt.num_tokens} tokens, more than the model's maximum context length "
                f"of {max_len}; a pair cannot be split into windows, pass "
                "truncate_prompt_tokens (-1 for the limit) to truncate it",
                index=i,
            )
        head = tail = 0
        if kind == "text" and processor.tokenizer is not None and options.add_special_tokens:
            head = processor.tokenizer.num_leading_special_tokens
            tail = processor.tokenizer.num_trailing_special_tokens
        out.append(split_windows(prompt, max_len, overlap, head, tail))
    return out


def split_windows(
    prompt: Prompt, window: int, overlap: int, head: int = 0, tail: int = 0
) -> list[tuple[Prompt, int]]:
    """`prompt` as windows of at most `window` tokens: its first `head` and last `tail` tokens
    around each of consecutive slices of the tokens between them, a slice starting
    `window - head - tail - overlap` tokens after the one before (at least 1) until one reaches
    the end. Returns `(window prompt, slice length)` pairs."""
    size = window - head - tail  # tokens of the input's own per window
    if size < 1:
        raise InputError(
            f"a window of {window} tokens leaves no room besides {head + tail} special tokens"
        )
    n = prompt.num_tokens
    body = n - head - tail
    stride = max(size - overlap, 1)
    starts = [0]
    while starts[-1] + size < body:
        starts.append(starts[-1] + stride)

    def cut(x: Any, start: int, end: int) -> Any:  # the head, x[start:end] of the body, the tail
        return np.concatenate([x[:head], x[head + start : head + end], x[n - tail :]])

    windows = []
    for start in starts:
        end = min(start + size, body)
        windows.append(
            (
                Prompt(
                    token_ids=None
                    if prompt.token_ids is None
                    else cut(prompt.token_ids, start, end),
                    prompt_embeds=None
                    if prompt.prompt_embeds is None
                    else cut(prompt.prompt_embeds, start, end),
                ),
                end - start,
            )
        )
    return windows


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
    for index, windows in enumerate(
        input_windows(ctx.inputs, items, text, ctx.info.embed_window_overlap)
    ):
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
