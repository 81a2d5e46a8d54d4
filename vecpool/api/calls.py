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
    ctx: CallContext,
    inputs: Any,
    params: PoolingParams,
    options: TextOptions | None = None,
    matryoshka_only: bool = False,
) -> list[PromptRequest]:
    """Validate and tokenize `inputs` into requests under `params`; `InputError` on the first
    bad input or parameter. Safe to call from any thread. `matryoshka_only`: `dimensions`
    only for a model whose folder declares matryoshka support (vLLM's and OpenAI's rule)."""
    items = as_input_list(inputs)
    task = get_task(params.task)
    # Parameters belong to the whole call: checked once, before any input is touched.
    task.check_params(params)
    reason = ctx.info.unavailable_tasks.get(task.name)
    if reason is not None:
        served = ", ".join(ctx.info.tasks)
        raise InputError(
            f"Unsupported task: {task.name!r}: this model cannot serve task {task.name!r}: "
            f"{reason}. Supported tasks: {served}",
            field="task",
        )
    _check_dimensions(ctx.info, params, matryoshka_only)
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


def _check_dimensions(info: EngineInfo, params: PoolingParams, matryoshka_only: bool) -> None:
    d = params.dimensions
    if d is None:
        return
    size = info.token_output_dim if params.task == "token_embed" else info.output_dim
    if not 1 <= d <= size:
        raise InputError(
            f"dimensions={d} must be between 1 and the model's output size {size}",
            field="dimensions",
        )
    if matryoshka_only and not info.is_matryoshka:
        raise InputError(
            f'Model "{info.model_name}" does not support matryoshka representation, changing '
            "output dimensions will lead to poor results (its config.json declares neither "
            "is_matryoshka nor matryoshka_dimensions).",
            field="dimensions",
        )
    if info.matryoshka_dimensions is not None and d not in info.matryoshka_dimensions:
        raise InputError(
            f"dimensions={d} is not one of the model's matryoshka dimensions "
            f"{list(info.matryoshka_dimensions)}",
            field="dimensions",
        )


@dataclass(frozen=True)
class TokenizedText:
    """A text as the model's tokenizer writes it: one entry per token, in order."""

    text: str  # the text tokenized: the instruction prompt, if any, then the input
    ids: list[int]
    tokens: list[str]  # the vocabulary entry of each token
    special: list[bool]  # whether each token is a special token ([CLS], [SEP], ...)
    offsets: list[tuple[int, int]]  # (start, end) characters of `text` each token covers


def tokenize(
    ctx: CallContext,
    text: str,
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    add_special_tokens: bool = True,
) -> list[int]:
    """The token ids a text input becomes (special tokens and instruction included), however
    long: counting tokens is one of its uses."""
    return tokenize_text(
        ctx, text, prompt_name=prompt_name, prompt=prompt, add_special_tokens=add_special_tokens
    ).ids


def tokenize_text(
    ctx: CallContext,
    text: str,
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    add_special_tokens: bool = True,
) -> TokenizedText:
    """`tokenize`, with each token's vocabulary entry, whether it is special, and the
    characters it covers. `add_special_tokens=False`: the text's own tokens only."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer.json", field="prompt")
    if not isinstance(text, str) or not text:
        raise InputError("the input is an empty string", field="prompt")
    prefix = instruction(ctx, prompt_name, prompt) or ""
    full = prefix + text
    ctx.inputs.check_text_size(full)
    if add_special_tokens:
        encoding = tokenizer.encode_batch([full])[0]
    else:
        encoding = tokenizer.encode_plain(full)
    return TokenizedText(
        text=full,
        ids=list(encoding.ids),
        tokens=list(encoding.tokens),
        special=[bool(m) for m in encoding.special_tokens_mask],
        offsets=[(int(a), int(b)) for a, b in encoding.offsets],
    )


def detokenize(
    ctx: CallContext, token_ids: Sequence[int], *, skip_special_tokens: bool = True
) -> str:
    """The text of vocabulary ids (special tokens skipped unless `skip_special_tokens=False`)."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer.json", field="tokens")
    ids = ctx.inputs.vocabulary_ids(token_ids, field="tokens")
    return tokenizer.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)


# Which of a model's instruction prompts serves each retrieval role, in order of preference.
_ROLE_PROMPTS = {
    "query": ("query",),
    "document": ("document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


def role_prompt_name(info: EngineInfo, role: str | None) -> str | None:
    """The model's prompt for a retrieval `role` ("query", "document", "classification",
    "clustering"): a prompt of that name ("document" or "passage" for documents) when the
    folder has one, else None (no prompt named; the folder's default prompt applies)."""
    for name in _ROLE_PROMPTS.get(role or "", ()):
        if name in info.prompts:
            return name
    return None


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
    add_special_tokens: bool = True,
    matryoshka_only: bool = False,
) -> PreparedCall[list[np.ndarray]]:
    """The requests of `Engine.encode`, and its result: each input's raw output.
    `add_special_tokens=False`: texts become their own tokens only; `matryoshka_only`: see
    `make_requests`."""
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
    options = TextOptions(truncate_prompt_tokens, truncation_side, prefix, add_special_tokens)
    requests = make_requests(ctx, inputs, params, options, matryoshka_only)
    return PreparedCall(requests, output_data)


def check_quantization(precision: Any, ranges: Any, dim: int) -> np.ndarray | None:
    """The checked `ranges` (`[2, dim]` float32, or None) of a quantized embed call at
    `precision` (one of `postprocess.PRECISIONS`)."""
    if precision not in postprocess.PRECISIONS:
        raise InputError(
            f"precision must be one of {', '.join(postprocess.PRECISIONS)}, got {precision!r}",
            field="precision",
        )
    if ranges is None:
        return None
    if precision not in ("int8", "uint8"):
        raise InputError(
            f"ranges apply to int8 and uint8 precision, not {precision}", field="ranges"
        )
    try:
        array = np.asarray(ranges, dtype=np.float32)
    except (TypeError, ValueError):
        array = None
    if array is None or array.shape != (2, dim) or not np.isfinite(array).all():
        raise InputError(
            f"ranges must be 2 rows (per-dimension minimum, maximum) of {dim} finite numbers",
            field="ranges",
        )
    return array


# ---- classify ---------------------------------------------------------------------------


def prepare_classify(
    ctx: CallContext,
    inputs: Any,
    *,
    use_activation: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
    add_special_tokens: bool = True,
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.classify`, and its result: `[n, num_labels]` float32."""
    params = PoolingParams(task="classify", use_activation=use_activation)
    options = TextOptions(truncate_prompt_tokens, truncation_side, None, add_special_tokens)
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
                    f"a cross-encoder, LLM or listwise reranker scores texts, got "
                    f"{type(value).__name__}",
                    index=i,
                    field=name,
                )
        out.append({"text": left, "text_pair": right})
    return out


def check_one_score(info: EngineInfo) -> None:
    """`InputError` unless the model gives one relevance score per pair: a sequence classifier
    with several labels is not a cross-encoder, and which label is "relevant" is not ours to
    guess."""
    if info.score_mode == "cross_encoder" and info.num_labels > 1:
        labels = ", ".join(info.id2label.get(i, f"LABEL_{i}") for i in range(info.num_labels))
        raise InputError(
            f"this model is a classifier with {info.num_labels} labels ({labels}), not a "
            "cross-encoder: scoring and reranking need one relevance score per pair; classify "
            "the pairs as text pairs to get every label's score"
        )


def prepare_score(
    ctx: CallContext,
    a: Any,
    b: Any,
    *,
    use_activation: bool | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
    one_score: bool = False,
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.score`, and its result: `[num_pairs]` float32 (a cross-encoder
    with several labels: `[num_pairs, num_labels]`, or an `InputError` with `one_score`).

    Errors name the side at fault: `field` "text_1" for the first side, "text_2" for the
    second, with the index of the pair (a pair that is too long as a whole is the first side's
    fault when that side alone leaves no room, else the second's)."""
    info = ctx.info
    if one_score:
        check_one_score(info)
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
        try:
            requests = make_requests(ctx, inputs, params, options)
        except InputError as exc:
            raise _pair_error(ctx, exc, pairs) from None
        return PreparedCall(requests, _pair_scores)
    if use_activation is not None:
        raise InputError(
            f"use_activation applies to cross-encoder and LLM scores, not to "
            f"{info.score_mode} scoring",
            field="use_activation",
        )
    if info.score_mode == "listwise":  # the query and its documents in shared prompts
        from vecpool.api.listwise import prepare_listwise_score  # it imports this module

        pairs = text_pairs(lefts, rights)
        queries, documents = [p["text"] for p in pairs], [p["text_pair"] for p in pairs]
        return prepare_listwise_score(ctx, queries, documents, truncate_prompt_tokens)
    late = info.score_mode == "late_interaction"
    task = "token_embed" if late else "embed"
    # A late-interaction folder writes the first side as queries, the second as documents.
    sides = late and info.late_interaction
    left_params = PoolingParams(task=task, input_type="query" if sides else None)
    right_params = PoolingParams(task=task, input_type="document" if sides else None)
    try:
        left_requests = make_requests(ctx, lefts, left_params, options)
    except InputError as exc:
        raise on_side(exc, "text_1") from None
    try:
        right_requests = make_requests(ctx, rights, right_params, options)
    except InputError as exc:
        raise on_side(exc, "text_2") from None
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


# Fields that name an input itself rather than a part of it or a parameter of the call.
_INPUT_FIELDS = (None, "prompt", "prompt_token_ids")


def on_side(exc: InputError, side: str) -> InputError:
    """An error about the inputs of one side of a score call ("text_1" or "text_2"), its
    field naming that side; errors about a parameter of the call are left as they are."""
    if exc.index is None and exc.field is not None:
        return exc
    field = side if exc.field in _INPUT_FIELDS else f"{side}.{exc.field}"
    return type(exc)(exc.reason, index=exc.index, field=field)


def _pair_error(ctx: CallContext, exc: InputError, pairs: list[dict[str, str]]) -> InputError:
    """An error about pair `exc.index`, its field naming the side at fault."""
    if exc.index is None:
        return exc
    side = {"text": "text_1", "text_pair": "text_2"}.get(exc.field or "")
    if side is None and exc.field in _INPUT_FIELDS:
        side = _side_at_fault(ctx, pairs[exc.index]["text"])
    if side is None:
        return exc
    return type(exc)(exc.reason, index=exc.index, field=side)


def _side_at_fault(ctx: CallContext, query: str) -> str:
    """Which side of a pair that cannot be served as a whole is at fault: the first (the
    query) when it alone is not valid Unicode, or leaves no room for a document (characters
    or tokens); else the second."""
    try:
        query.encode("utf-8")
    except UnicodeEncodeError:
        return "text_1"
    chars = ctx.inputs.limits.max_input_chars
    if chars is not None and len(query) >= chars:
        return "text_1"
    tokenizer, reranker = ctx.tokenizer, ctx.info.llm_reranker
    if tokenizer is None:
        return "text_2"
    if ctx.info.score_mode == "llm" and reranker is not None:
        alone = tokenizer.encode_plain(reranker.format(query, "")).ids
        needed = len(alone) + tokenizer.num_special_tokens
    else:  # the query, the pair's special tokens, and one token of a document
        needed = len(tokenizer.encode_plain(query).ids) + tokenizer.num_pair_special_tokens + 1
    return "text_1" if needed > ctx.info.max_model_len else "text_2"


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
    use_activation: bool | None = None,
    max_tokens_per_doc: int | None = None,
    truncate_prompt_tokens: int | None = None,
    truncation_side: TruncationSide = "right",
) -> PreparedCall[list[tuple[int, float]]]:
    """The requests of `Engine.rerank`, and its result: `(document index, score)` pairs, best
    first, the first `top_n` of them (None or 0: all). `max_tokens_per_doc`: each document is
    cut to that many of its own tokens first (Cohere's rule). Errors about the query carry
    `field="query"`, about a document `field="documents"` and its index."""
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise InputError("documents must be a list", field="documents")
    check_top_n(top_n)
    if len(as_input_list(query)) != 1:
        raise InputError("rerank takes one query", field="query")
    check_one_score(ctx.info)
    docs = list(documents)
    if max_tokens_per_doc is not None:
        docs = cut_documents(ctx, docs, max_tokens_per_doc)
    try:
        scores = prepare_score(
            ctx,
            query,
            docs,
            use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
    except InputError as exc:
        raise _rerank_error(exc) from None

    def finish(outputs: list[PoolingOutput]) -> list[tuple[int, float]]:
        try:
            return postprocess.rank(scores.finish(outputs), top_n)
        except InputError as exc:
            raise _rerank_error(exc) from None

    return PreparedCall(scores.requests, finish)


def _rerank_error(exc: InputError) -> InputError:
    """A score error in rerank's words: text_1 is the query, text_2 the documents."""
    side, _, rest = (exc.field or "").partition(".")
    if side == "text_1":
        return type(exc)(exc.reason, field="query" + (f".{rest}" if rest else ""))
    if side == "text_2":
        return type(exc)(
            exc.reason, index=exc.index, field="documents" + (f".{rest}" if rest else "")
        )
    return exc


def cut_documents(ctx: CallContext, documents: list[Any], max_tokens: Any) -> list[Any]:
    """Each document cut to its first `max_tokens` tokens (its own tokens, special tokens not
    counted): a text at the end of its last kept token, token ids by count."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(
            f"max_tokens_per_doc must be a positive integer, got {max_tokens!r}",
            field="max_tokens_per_doc",
        )
    tokenizer = ctx.tokenizer
    out = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str) and doc:
            if tokenizer is None:
                raise InputError(
                    "cutting documents to max_tokens_per_doc needs the model's tokenizer",
                    field="max_tokens_per_doc",
                )
            try:
                ctx.inputs.check_text_size(doc, i)
            except InputError as exc:
                raise InputError(exc.reason, index=i, field="documents") from None
            offsets = tokenizer.encode_plain(doc).offsets  # [(start, end)] per token
            if len(offsets) > max_tokens:
                doc = doc[: offsets[max_tokens - 1][1]]
        elif isinstance(doc, list) and len(doc) > max_tokens:
            doc = doc[:max_tokens]
        out.append(doc)
    return out


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
    prompt_name: str | None = None,
    prompt: str | None = None,
) -> PreparedCall[SparseResult]:
    """The requests of `Engine.embed_sparse`, and its result: `{token: weight}` per input."""
    check_top_k(top_k)
    # Only a prompt the call names: sparse calls never took the folder's default prompt.
    named = prompt_name is not None or prompt is not None
    named_prompt = instruction(ctx, prompt_name, prompt) if named else None
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
        TextOptions(truncate_prompt_tokens, truncation_side, named_prompt),
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
