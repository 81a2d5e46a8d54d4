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
from typing import Any

import numpy as np

from vecpool.calls import postprocess
from vecpool.calls.context import CallContext, as_input_list, instruction, make_requests
from vecpool.calls.info import EngineInfo
from vecpool.calls.listwise import prepare_listwise_score
from vecpool.calls.options import (
    ClassifyOptions,
    EncodeOptions,
    RerankOptions,
    ScoreOptions,
    SparseOptions,
    fields_from,
)
from vecpool.calls.outputs import PoolingOutput, PreparedCall, output_data
from vecpool.calls.pair_prompts import template_error, template_inputs
from vecpool.errors import InputError
from vecpool.inputs.prompts import TextOptions, TruncationSide, is_tensor
from vecpool.inputs.tokenizer import check_unicode
from vecpool.inputs.vision_prompts import is_parts
from vecpool.tasks import PoolingParams

SparseResult = list[dict[int, float]] | list[dict[str, float]]


# ---- embed and per-token tasks ---------------------------------------------------------


def prepare_encode(
    ctx: CallContext,
    inputs: Any,
    options: EncodeOptions | None = None,
    **keywords: Any,
) -> PreparedCall[list[np.ndarray]]:
    """The requests of `Engine.encode`, and its result: each input's raw output.
    `add_special_tokens=False`: texts become their own tokens only; `matryoshka_only`: see
    `make_requests`."""
    o = EncodeOptions.build(options, keywords)
    params = fields_from(PoolingParams, o)  # every parameter, by its name
    # A side's own prompt, not the folder's default one, unless the call names one.
    by_side = o.input_type is not None and o.prompt is None and o.prompt_name is None
    prefix = None if by_side else instruction(ctx, o.prompt_name, o.prompt)
    text = TextOptions(o.truncate_prompt_tokens, o.truncation_side, prefix, o.add_special_tokens)
    requests = make_requests(ctx, inputs, params, text, o.matryoshka_only)
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
    options: ClassifyOptions | None = None,
    **keywords: Any,
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.classify`, and its result: `[n, num_labels]` float32."""
    o = ClassifyOptions.build(options, keywords)
    params = PoolingParams(task="classify", use_activation=o.use_activation)
    text = TextOptions(o.truncate_prompt_tokens, o.truncation_side, None, o.add_special_tokens)
    requests = make_requests(ctx, inputs, params, text)
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
    options: ScoreOptions | None = None,
    **keywords: Any,
) -> PreparedCall[np.ndarray]:
    """The requests of `Engine.score`, and its result: `[num_pairs]` float32 (a cross-encoder
    with several labels: `[num_pairs, num_labels]`, or an `InputError` with `one_score`).

    Errors name the side at fault: `field` "text_1" for the first side, "text_2" for the
    second, with the index of the pair (a pair that is too long as a whole is the first side's
    fault when that side alone leaves no room, else the second's)."""
    o = ScoreOptions.build(options, keywords)
    info = ctx.info
    if o.one_score:
        check_one_score(info)
    lefts, rights = pair_up(a, b)
    text = TextOptions(o.truncate_prompt_tokens, o.truncation_side)
    if not rights:
        return PreparedCall([], lambda _: np.zeros(0, dtype=np.float32))
    if info.score_mode == "cross_encoder" and info.pair_template is not None:
        return _prepare_template_pairs(ctx, lefts, rights, o)
    if info.score_mode in ("cross_encoder", "llm"):
        pairs = text_pairs(lefts, rights)
        inputs: list[Any] = pairs
        reranker = info.llm_reranker
        if info.score_mode == "llm":
            assert reranker is not None
            inputs = [reranker.format(p["text"], p["text_pair"]) for p in pairs]
            if o.truncate_prompt_tokens is not None:  # cut the documents, never the template
                limit = ctx.inputs.truncation_length(o.truncate_prompt_tokens)
                inputs = _fit_reranker_prompts(ctx, pairs, inputs, limit, o.truncation_side)
                text = TextOptions()
        params = PoolingParams(task="score", use_activation=o.use_activation)
        try:
            requests = make_requests(ctx, inputs, params, text)
        except InputError as exc:
            raise _pair_error(ctx, exc, pairs) from None
        return PreparedCall(requests, _pair_scores)
    if o.use_activation is not None:
        raise InputError(
            f"use_activation applies to cross-encoder and LLM scores, not to "
            f"{info.score_mode} scoring",
            field="use_activation",
        )
    if info.score_mode == "listwise":  # the query and its documents in shared prompts
        pairs = text_pairs(lefts, rights)
        queries, documents = [p["text"] for p in pairs], [p["text_pair"] for p in pairs]
        return prepare_listwise_score(ctx, queries, documents, o.truncate_prompt_tokens)
    late = info.score_mode == "late_interaction"
    task = "token_embed" if late else "embed"
    # A late-interaction folder writes the first side as queries, the second as documents.
    sides = late and info.late_interaction
    left_params = PoolingParams(task=task, input_type="query" if sides else None)
    right_params = PoolingParams(task=task, input_type="document" if sides else None)
    try:
        left_requests = make_requests(ctx, lefts, left_params, text)
    except InputError as exc:
        raise on_side(exc, "text_1") from None
    try:
        right_requests = make_requests(ctx, rights, right_params, text)
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


def _prepare_template_pairs(
    ctx: CallContext, lefts: list[Any], rights: list[Any], o: ScoreOptions
) -> PreparedCall[np.ndarray]:
    """The requests of a cross-encoder that writes each pair into its prompt template
    (`pair_prompts`): texts and images on either side."""
    t = o.truncate_prompt_tokens
    limit = ctx.inputs.truncation_length(t) if t is not None else None
    pairing = pair_indices(len(lefts), len(rights))
    inputs, image_sides = template_inputs(ctx, lefts, rights, pairing, limit, o.truncation_side)
    params = PoolingParams(task="score", use_activation=o.use_activation)
    try:  # the template's ids are whole prompts: never cut again (the suffix is last)
        requests = make_requests(ctx, inputs, params, TextOptions())
    except InputError as exc:
        raise template_error(exc, image_sides) from None
    return PreparedCall(requests, _pair_scores)


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


def prepare_rerank(
    ctx: CallContext,
    query: Any,
    documents: Sequence[Any],
    top_n: int | None = None,
    options: RerankOptions | None = None,
    **keywords: Any,
) -> PreparedCall[list[tuple[int, float]]]:
    """The requests of `Engine.rerank`, and its result: `(document index, score)` pairs, best
    first, the first `top_n` of them (None or 0: all). `max_tokens_per_doc`: each document is
    cut to that many of its own tokens first (Cohere's rule). Errors about the query carry
    `field="query"`, about a document `field="documents"` and its index."""
    if top_n is not None:
        keywords = {**keywords, "top_n": top_n}
    o = RerankOptions.build(options, keywords)
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise InputError("documents must be a list", field="documents")
    if len(as_input_list(query)) != 1:
        raise InputError("rerank takes one query", field="query")
    check_one_score(ctx.info)
    docs = list(documents)
    if o.max_tokens_per_doc is not None:
        docs = cut_documents(ctx, docs, o.max_tokens_per_doc)
    try:
        scores = prepare_score(ctx, query, docs, o.score())
    except InputError as exc:
        raise _rerank_error(exc) from None

    def finish(outputs: list[PoolingOutput]) -> list[tuple[int, float]]:
        try:
            return postprocess.rank(scores.finish(outputs), o.top_n)
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
    """Each document cut to its first `max_tokens` tokens: a text at the end of its last
    kept token (its own tokens: special tokens are not counted), token ids and prompt embeds
    by count, as given (special tokens among them count); in any of the input forms (a list of
    text and image parts is left whole: an image is not cut)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InputError(
            f"max_tokens_per_doc must be a positive integer, got {max_tokens!r}",
            field="max_tokens_per_doc",
        )
    return [_cut_document(ctx, doc, i, max_tokens) for i, doc in enumerate(documents)]


def _cut_document(ctx: CallContext, doc: Any, index: int, max_tokens: int) -> Any:
    if isinstance(doc, Mapping) and len(doc) == 1:  # {"prompt" | "prompt_token_ids" | ...: x}
        ((key, value),) = doc.items()
        if key in ("prompt", "prompt_token_ids", "prompt_embeds"):
            return {key: _cut_document(ctx, value, index, max_tokens)}
        return doc  # refused where inputs are read
    if isinstance(doc, str):
        if not doc:
            return doc
        tokenizer = ctx.tokenizer
        if tokenizer is None:
            raise InputError(
                "cutting documents to max_tokens_per_doc needs the model's tokenizer",
                field="max_tokens_per_doc",
            )
        try:
            ctx.inputs.check_text_size(doc, index)
            check_unicode(doc, index)
        except InputError as exc:
            raise InputError(exc.reason, index=index, field="documents") from None
        offsets = tokenizer.encode_plain(doc).offsets  # [(start, end)] per token
        return doc[: offsets[max_tokens - 1][1]] if len(offsets) > max_tokens else doc
    if isinstance(doc, list) and is_parts(doc):  # text and image parts: not cut by count
        return doc
    sized = isinstance(doc, list | tuple) or (
        (isinstance(doc, np.ndarray) or is_tensor(doc)) and doc.ndim >= 1
    )
    return doc[:max_tokens] if sized and len(doc) > max_tokens else doc


# ---- sparse -----------------------------------------------------------------------------


def prepare_embed_sparse(
    ctx: CallContext,
    inputs: Any,
    options: SparseOptions | None = None,
    **keywords: Any,
) -> PreparedCall[SparseResult]:
    """The requests of `Engine.embed_sparse`, and its result: `{token: weight}` per input."""
    o = SparseOptions.build(options, keywords)
    # Only a prompt the call names: sparse calls never took the folder's default prompt.
    named = o.prompt_name is not None or o.prompt is not None
    named_prompt = instruction(ctx, o.prompt_name, o.prompt) if named else None
    tokenizer = ctx.tokenizer
    if o.return_tokens and tokenizer is None:
        raise InputError(
            "return_tokens needs the model's tokenizer, and the folder has none",
            field="return_tokens",
        )
    requests = make_requests(
        ctx,
        inputs,
        PoolingParams(task="sparse", exclude_special_tokens=o.exclude_special_tokens),
        TextOptions(o.truncate_prompt_tokens, o.truncation_side, named_prompt),
    )

    def finish(outputs: list[PoolingOutput]) -> SparseResult:
        vectors = [postprocess.sparse_vector(w, o.top_k, o.threshold) for w in output_data(outputs)]
        if not o.return_tokens:
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
        if isinstance(out.error, InputError):  # its field names the side (`on_side`)
            error = type(out.error)(out.error.reason, index=out.index, field=out.error.field)
            raise on_side(error, side)
        if out.error is not None:
            raise out.error
