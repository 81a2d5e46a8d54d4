"""The task calls as plain functions: validate and tokenize a call's inputs into requests, and
say how their outputs become its result.

Every `prepare_*` function takes a `CallContext` (the engine's `EngineInfo` and its input
stage) and returns a `PreparedCall`; nothing here touches the model or the engine loop, so
any front can prepare calls: `Engine` in this process, an API server in another. Each rule
about a call (a parameter's range, a pairing, a task the model cannot serve) is checked here,
once, before anything runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vecpool.api import postprocess
from vecpool.api.info import EngineInfo
from vecpool.api.outputs import PoolingOutput, PreparedCall, PromptRequest, output_data
from vecpool.errors import InputError
from vecpool.inputs import InputProcessor, TextOptions, TextTokenizer, TruncationSide
from vecpool.tasks import PoolingParams, get_task

SparseResult = list[dict[int, float]] | list[dict[str, float]]


@dataclass(frozen=True)
class CallContext:
    """What preparing a call needs: the engine's description and its input stage (the
    tokenizer, the limits, a late-interaction model's side formats)."""

    info: EngineInfo
    inputs: InputProcessor

    @classmethod
    def from_info(cls, info: EngineInfo) -> CallContext:
        """A context built from `info` alone (its tokenizer read from the model folder): what a
        process without the model prepares calls with."""
        tokenizer = TextTokenizer(Path(info.tokenizer_file)) if info.tokenizer_file else None
        return cls(info, InputProcessor(info.input_limits, tokenizer, info.input_sides))

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.inputs.tokenizer


# ---- inputs ----------------------------------------------------------------------------


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


def make_requests(
    ctx: CallContext, inputs: Any, params: PoolingParams, options: TextOptions | None = None
) -> list[PromptRequest]:
    """Validate and tokenize `inputs` into requests under `params`; `InputError` on the first
    bad input or parameter. Safe to call from any thread."""
    items = as_input_list(inputs)
    task = get_task(params.task)
    # Parameters belong to the whole call: checked once, before any input is touched.
    task.check_params(params)
    reason = ctx.info.unavailable_tasks.get(task.name)
    if reason is not None:
        raise InputError(f"this model cannot serve task {task.name!r}: {reason}", field="task")
    _check_dimensions(ctx.info, params)
    prompts = ctx.inputs.process(items, options or TextOptions(), params.input_type)
    return [PromptRequest(index, prompt, params) for index, prompt in enumerate(prompts)]


def instruction(ctx: CallContext, prompt_name: str | None, prompt: str | None) -> str | None:
    """The instruction prefix of text inputs: `prompt`, else the folder's prompt named
    `prompt_name`, else its default prompt, else none."""
    if prompt is not None and prompt_name is not None:
        raise InputError("pass either prompt or prompt_name, not both", field="prompt_name")
    if prompt is not None:
        return prompt
    info = ctx.info
    name = prompt_name if prompt_name is not None else info.default_prompt_name
    if name is None:
        return None
    if name not in info.prompts:
        known = ", ".join(sorted(info.prompts)) or "none"
        raise InputError(
            f"unknown prompt name {name!r}; the model's prompts: {known}", field="prompt_name"
        )
    return info.prompts[name]


def _check_dimensions(info: EngineInfo, params: PoolingParams) -> None:
    d = params.dimensions
    if d is None:
        return
    size = info.token_output_dim if params.task == "token_embed" else info.output_dim
    if not 1 <= d <= size:
        raise InputError(
            f"dimensions={d} must be between 1 and the model's output size {size}",
            field="dimensions",
        )
    if info.matryoshka_dimensions is not None and d not in info.matryoshka_dimensions:
        raise InputError(
            f"dimensions={d} is not one of the model's matryoshka dimensions "
            f"{list(info.matryoshka_dimensions)}",
            field="dimensions",
        )


def tokenize(
    ctx: CallContext, text: str, *, prompt_name: str | None = None, prompt: str | None = None
) -> list[int]:
    """The token ids a text input becomes (special tokens and instruction included), however
    long: counting tokens is one of its uses."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer.json", field="prompt")
    if not isinstance(text, str) or not text:
        raise InputError("the input is an empty string", field="prompt")
    prefix = instruction(ctx, prompt_name, prompt) or ""
    ctx.inputs.check_text_size(prefix + text)
    return list(tokenizer.encode_batch([prefix + text])[0].ids)


def detokenize(ctx: CallContext, token_ids: Sequence[int]) -> str:
    """The text of vocabulary ids (special tokens skipped)."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer.json", field="tokens")
    ids = ctx.inputs.vocabulary_ids(token_ids, field="tokens")
    return tokenizer.decode(ids.tolist())


# ---- embed and per-token tasks ---------------------------------------------------------


def prepare_encode(
    ctx: CallContext,
    inputs: Any,
    *,
    task: str = "token_embed",
    dimensions: int | None = None,
    normalize: bool | None = None,
    step_tag_id: int | None = None,
    use_activation: bool | None = None,
    input_type: str | None = None,
    exclude_special_tokens: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
    prompt_name: str | None = None,
    prompt: str | None = None,
) -> PreparedCall[list[np.ndarray]]:
    """The requests of `Engine.encode`, and its result: each input's raw output."""
    params = PoolingParams(
        task=task,
        dimensions=dimensions,
        normalize=normalize,
        step_tag_id=step_tag_id,
        use_activation=use_activation,
        input_type=input_type,
        exclude_special_tokens=exclude_special_tokens,
    )
    # A side's own prompt, not the folder's default one, unless the call names one.
    by_side = input_type is not None and prompt is None and prompt_name is None
    prefix = None if by_side else instruction(ctx, prompt_name, prompt)
    options = TextOptions(truncate_prompt_tokens, truncation_side, prefix)
    return PreparedCall(make_requests(ctx, inputs, params, options), output_data)


# ---- classify ---------------------------------------------------------------------------


def prepare_classify(
    ctx: CallContext,
    inputs: Any,
    *,
    use_activation: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.classify`, and its result: `[n, num_labels]` float32."""
    params = PoolingParams(task="classify", use_activation=use_activation)
    options = TextOptions(truncate_prompt_tokens, truncation_side)
    requests = make_requests(ctx, inputs, params, options)
    num_labels = ctx.info.num_labels

    def finish(outputs: list[PoolingOutput]) -> np.ndarray:
        data = output_data(outputs)
        return np.stack(data) if data else np.zeros((0, num_labels), dtype=np.float32)

    return PreparedCall(requests, finish)


# ---- score and rerank -------------------------------------------------------------------


def pair_up(a: Any, b: Any) -> tuple[list[Any], list[Any]]:
    """The two sides of a score call: one left input against every right one (1 -> 1, 1 -> N),
    or lists of one length paired in order (N -> N). The left list has one item or as many as
    the right; `pair_indices` says which left item each pair uses. An empty right side makes
    no pairs."""
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


def prepare_score(
    ctx: CallContext,
    a: Any,
    b: Any,
    *,
    use_activation: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.score`, and its result: `[num_pairs]` float32 (a cross-encoder
    with several labels: `[num_pairs, num_labels]`)."""
    info = ctx.info
    lefts, rights = pair_up(a, b)
    options = TextOptions(truncate_prompt_tokens, truncation_side)
    if not rights:
        return PreparedCall([], lambda _: np.zeros(0, dtype=np.float32))
    if info.score_mode in ("cross_encoder", "llm"):
        pairs = text_pairs(lefts, rights)
        inputs: list[Any] = pairs
        reranker = info.llm_reranker
        if info.score_mode == "llm":
            assert reranker is not None
            inputs = [reranker.format(p["text"], p["text_pair"]) for p in pairs]
            if truncate_prompt_tokens is not None:  # cut the documents, never the template
                limit = ctx.inputs.truncation_length(truncate_prompt_tokens)
                inputs = _fit_reranker_prompts(ctx, pairs, inputs, limit, truncation_side)
                options = TextOptions()
        params = PoolingParams(task="score", use_activation=use_activation)
        return PreparedCall(make_requests(ctx, inputs, params, options), _pair_scores)
    if use_activation is not None:
        raise InputError(
            f"use_activation applies to cross-encoder and LLM scores, not to "
            f"{info.score_mode} scoring",
            field="use_activation",
        )
    late = info.score_mode == "late_interaction"
    task = "token_embed" if late else "embed"
    # A late-interaction folder writes the first side as queries, the second as documents.
    sides = late and info.late_interaction
    left_params = PoolingParams(task=task, input_type="query" if sides else None)
    right_params = PoolingParams(task=task, input_type="document" if sides else None)
    left_requests = make_requests(ctx, lefts, left_params, options)
    right_requests = make_requests(ctx, rights, right_params, options)
    mean = sides and info.mean_maxsim
    num_lefts = len(left_requests)

    def finish(outputs: list[PoolingOutput]) -> np.ndarray:
        _raise_first(outputs[:num_lefts], "text_1")
        _raise_first(outputs[num_lefts:], "text_2")
        left, right = output_data(outputs[:num_lefts]), output_data(outputs[num_lefts:])
        if late and num_lefts == 1:  # the query's vectors once, against every document
            return postprocess.maxsim(left[0], right, mean=mean)
        if late:
            return np.array(
                [
                    postprocess.maxsim(q, [d], mean=mean)[0]
                    for q, d in zip(left, right, strict=True)
                ],
                dtype=np.float32,
            )
        return postprocess.cosine(np.stack(left), np.stack(right))

    return PreparedCall(left_requests + right_requests, finish)


def _fit_reranker_prompts(
    ctx: CallContext,
    pairs: list[dict[str, str]],
    prompts: list[str],
    limit: int,
    side: TruncationSide,
) -> list[str]:
    """The reranker prompts, each document cut (at a token boundary of its own) so that the
    whole prompt takes at most `limit` tokens; the template and query stay whole."""
    tokenizer, config = ctx.tokenizer, ctx.info.llm_reranker
    assert tokenizer is not None and config is not None
    lengths = [len(e.ids) for e in tokenizer.encode_batch(prompts)]
    fitted = list(prompts)
    for i, (pair, length) in enumerate(zip(pairs, lengths, strict=True)):
        if length <= limit:
            continue
        query, document = pair["text"], pair["text_pair"]
        offsets = tokenizer.encode_plain(document).offsets  # [(start, end)] per token
        keep = len(offsets) - (length - limit)
        for _ in range(8):  # token boundaries may merge differently inside the prompt
            if keep < 1:
                raise InputError(
                    f"the reranker prompt without its document takes more than {limit} "
                    "tokens; raise truncate_prompt_tokens or shorten the query",
                    index=i,
                    field="truncate_prompt_tokens",
                )
            if side == "right":
                cut = document[: offsets[keep - 1][1]]
            else:
                cut = document[offsets[len(offsets) - keep][0] :]
            fitted[i] = config.format(query, cut)
            over = len(tokenizer.encode_plain(fitted[i]).ids) + tokenizer.num_special_tokens - limit
            if over <= 0:
                break
            keep -= over
    return fitted


def check_top_n(top_n: Any) -> None:
    """`top_n` of a rerank call: None or 0 for every document, else how many to return."""
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0):
        raise InputError(
            f"top_n must be a non-negative integer (0: every document), got {top_n!r}",
            field="top_n",
        )


def prepare_rerank(
    ctx: CallContext,
    query: Any,
    documents: Sequence[Any],
    top_n: int | None = None,
    *,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
) -> PreparedCall[list[tuple[int, float]]]:
    """The requests of `Engine.rerank`, and its result: `(document index, score)` pairs, best
    first, the first `top_n` of them (None or 0: all)."""
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise InputError("documents must be a list", field="documents")
    check_top_n(top_n)
    if len(as_input_list(query)) != 1:
        raise InputError("rerank takes one query", field="query")
    info = ctx.info
    if info.num_labels > 1 and info.score_mode == "cross_encoder":
        raise InputError(
            f"this cross-encoder has {info.num_labels} labels; rerank needs one score per document"
        )
    scores = prepare_score(
        ctx,
        query,
        list(documents),
        truncate_prompt_tokens=truncate_prompt_tokens,
        truncation_side=truncation_side,
    )

    def finish(outputs: list[PoolingOutput]) -> list[tuple[int, float]]:
        return postprocess.rank(scores.finish(outputs), top_n)

    return PreparedCall(scores.requests, finish)


# ---- sparse -----------------------------------------------------------------------------


def check_top_k(top_k: Any) -> None:
    """`top_k` of a sparse call: None for every weight above the threshold, else how many."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise InputError(f"top_k must be a non-negative integer, got {top_k!r}", field="top_k")


def prepare_embed_sparse(
    ctx: CallContext,
    inputs: Any,
    *,
    top_k: int | None = None,
    threshold: float = 0.0,
    return_tokens: bool = False,
    exclude_special_tokens: bool = False,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
) -> PreparedCall[SparseResult]:
    """The requests of `Engine.embed_sparse`, and its result: `{token: weight}` per input."""
    check_top_k(top_k)
    tokenizer = ctx.tokenizer
    if return_tokens and tokenizer is None:
        raise InputError(
            "return_tokens needs the model's tokenizer, and the folder has none",
            field="return_tokens",
        )
    requests = make_requests(
        ctx,
        inputs,
        PoolingParams(task="sparse", exclude_special_tokens=exclude_special_tokens),
        TextOptions(truncate_prompt_tokens, truncation_side),
    )

    def finish(outputs: list[PoolingOutput]) -> SparseResult:
        vectors = [postprocess.sparse_vector(w, top_k, threshold) for w in output_data(outputs)]
        if not return_tokens:
            return vectors
        assert tokenizer is not None
        return [postprocess.sparse_tokens(v, tokenizer.id_to_token) for v in vectors]

    return PreparedCall(requests, finish)


def _pair_scores(outputs: list[PoolingOutput]) -> np.ndarray:
    """`[n]` scores of one-score heads, `[n, num_labels]` of several."""
    scores = np.stack(output_data(outputs))
    return scores[:, 0] if scores.shape[1] == 1 else scores


def _raise_first(outputs: list[PoolingOutput], side: str) -> None:
    for out in outputs:
        if isinstance(out.error, InputError):
            error_type = type(out.error)
            raise error_type(out.error.reason, index=out.index, field=out.error.field or side)
        if out.error is not None:
            raise out.error
