"""Listwise reranking (jina-reranker-v3): a query and its documents in shared prompts.

A call's pairs are grouped by query. Each group's query and documents are cut to the model's
per-text limits, then packed into prompts as the model's own `rerank` packs them: documents in
order, a prompt closing once it holds `max_docs_per_prompt` documents or once the room left
(the prompt length less twice the query, less the documents so far) is at most
`max_doc_tokens`. Each prompt repeats the query. The engine returns, per prompt, the projected
vectors at its markers (each document's, then the query's: `pooling.heads.ListwiseHead`); a
document's score is the cosine of its vector with the query's. Over several prompts the query
vector is, as in the model's code, the mean of the prompts' query vectors weighted by each
prompt's best `(1 + cosine) / 2`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vecpool.calls import postprocess
from vecpool.calls.context import make_requests
from vecpool.calls.outputs import PoolingOutput, PreparedCall, output_data
from vecpool.errors import EngineError, InputError
from vecpool.tasks import PoolingParams

if TYPE_CHECKING:
    from vecpool.calls.context import CallContext
    from vecpool.config import ListwiseRerankerConfig
    from vecpool.inputs.prompts import TextTokenizer


@dataclass(frozen=True)
class _Block:
    """One prompt of a query group: the pairs (indices into the call) whose documents it holds."""

    group: int
    pairs: list[int]


def prepare_listwise_score(
    ctx: CallContext,
    queries: list[str],  # [num_pairs]: each pair's query
    documents: list[str],  # [num_pairs]
    truncate_prompt_tokens: int | None = None,
) -> PreparedCall[np.ndarray]:
    """The requests of a listwise score call (one per prompt) and its result: `[num_pairs]`
    float32 cosines, in the call's pair order. `truncate_prompt_tokens` bounds each prompt's
    length in place of the model's limit (documents go into more prompts)."""
    config, tokenizer = ctx.info.listwise_reranker, ctx.tokenizer
    assert config is not None, "listwise scoring needs the model's listwise_reranker"
    if tokenizer is None:
        raise InputError("listwise reranking needs the model's tokenizer.json")
    room = ctx.info.max_model_len
    if truncate_prompt_tokens is not None:
        room = ctx.inputs.truncation_length(truncate_prompt_tokens)
    for i, pair in enumerate(zip(queries, documents, strict=True)):
        for side, text in zip(("text_1", "text_2"), pair, strict=True):
            try:
                ctx.inputs.check_text_size(text, i)
            except InputError as exc:
                raise InputError(exc.reason, index=i, field=side) from None
    groups: dict[str, list[int]] = {}  # query -> its pairs, in call order
    for i, query in enumerate(queries):
        groups.setdefault(query, []).append(i)
    cut_queries, cut_docs = [], ["" for _ in documents]
    blocks: list[_Block] = []
    for g, (query, members) in enumerate(groups.items()):
        text, query_len = _cut(tokenizer, query, config.max_query_tokens)
        cut_queries.append(text)
        lengths = []
        for i in members:
            cut_docs[i], n = _cut(tokenizer, documents[i], config.max_doc_tokens)
            lengths.append(n)
        blocks.extend(_Block(g, b) for b in _pack(config, members, lengths, query_len, room))
    fitted = _fit(config, tokenizer, blocks, cut_queries, cut_docs, room)
    requests = make_requests(
        ctx, [{"prompt_token_ids": ids} for _, ids in fitted], PoolingParams(task="score")
    )
    num_pairs = len(queries)

    def finish(outputs: list[PoolingOutput]) -> np.ndarray:
        vectors = output_data(outputs)  # per prompt: [its documents + 1, dim]
        scores = np.zeros(num_pairs, dtype=np.float32)
        for g in range(len(groups)):
            mine = [(b, v) for (b, _), v in zip(fitted, vectors, strict=True) if b.group == g]
            for block, v in mine:
                if v.shape[0] != len(block.pairs) + 1:
                    raise EngineError(
                        f"a listwise prompt of {len(block.pairs)} documents gave "
                        f"{v.shape[0]} marker vectors; the tokenizer does not keep the "
                        "marker tokens whole"
                    )
            pairs = [i for b, _ in mine for i in b.pairs]
            scores[pairs] = combine([v[:-1] for _, v in mine], [v[-1] for _, v in mine])
        return scores

    return PreparedCall(requests, finish)


def combine(docs: list[np.ndarray], queries: list[np.ndarray]) -> np.ndarray:
    """The scores of one query's documents over its prompts: `docs[b]` (`[n_b, dim]`) and
    `queries[b]` (`[dim]`) are prompt b's vectors. One prompt: each document's cosine with
    the query. Several: the cosine with the mean of the query vectors, each weighted by its
    prompt's best `(1 + cosine) / 2` (the model's `rerank`). `[sum n_b]` float32."""
    if len(queries) == 1:
        return postprocess.cosine(docs[0], queries[0][None, :])
    weights = [
        float(((1 + postprocess.cosine(d, q[None, :])) / 2).max())
        for d, q in zip(docs, queries, strict=True)
    ]
    query = np.average(np.stack(queries), axis=0, weights=weights)
    return postprocess.cosine(np.concatenate(docs), query[None, :])


def _cut(tokenizer: TextTokenizer, text: str, max_tokens: int) -> tuple[str, int]:
    """`text` cut to its first `max_tokens` tokens (no special tokens added), and its token
    count after the cut."""
    offsets = tokenizer.encode_plain(text).offsets  # [(start, end)] per token
    if len(offsets) <= max_tokens:
        return text, len(offsets)
    return text[: offsets[max_tokens - 1][1]], max_tokens


def _pack(
    config: ListwiseRerankerConfig,
    pairs: list[int],
    lengths: list[int],
    query_len: int,
    room: int,
) -> list[list[int]]:
    """The model's packing of one query's documents into prompts (see the module doc)."""
    blocks: list[list[int]] = []
    block: list[int] = []
    left = room - 2 * query_len
    for i, n in zip(pairs, lengths, strict=True):
        block.append(i)
        left -= n
        if len(block) >= config.max_docs_per_prompt or left <= config.max_doc_tokens:
            blocks.append(block)
            block, left = [], room - 2 * query_len
    if block:
        blocks.append(block)
    return blocks


def _fit(
    config: ListwiseRerankerConfig,
    tokenizer: TextTokenizer,
    blocks: list[_Block],
    queries: list[str],
    docs: list[str],
    room: int,
) -> list[tuple[_Block, list[int]]]:
    """Each block with its prompt's token ids, a block whose prompt is longer than `room`
    split in two until every prompt fits; `InputError` naming a document that does not fit
    one prompt with its query."""
    fitted: list[tuple[_Block, list[int]]] = []
    pending = blocks
    while pending:
        prompts = [
            config.format(
                config.sanitize(queries[b.group]), [config.sanitize(docs[i]) for i in b.pairs]
            )
            for b in pending
        ]
        encodings = tokenizer.encode_batch(prompts)
        again: list[_Block] = []
        for block, enc in zip(pending, encodings, strict=True):
            if len(enc.ids) <= room:
                fitted.append((block, list(enc.ids)))
            elif len(block.pairs) == 1:
                raise InputError(
                    f"the document and its query take {len(enc.ids)} tokens in the reranker's "
                    f"prompt, more than the {room} tokens a prompt may have; shorten it, or "
                    "pass max_tokens_per_doc",
                    index=block.pairs[0],
                    field="text_2",
                )
            else:
                half = len(block.pairs) // 2
                again += [
                    _Block(block.group, block.pairs[:half]),
                    _Block(block.group, block.pairs[half:]),
                ]
        pending = again
    # In document order within each query (a split block's halves side by side again).
    return sorted(fitted, key=lambda f: (f[0].group, f[0].pairs[0]))
