"""The offline API of the scoring tasks: classify, score, rerank, embed_sparse.

Each call is three steps: build requests (`prepare_*`, which validates and tokenizes), run them,
post-process their outputs with the pure functions of `vecpool.scoring`. The blocking methods
do all three; an async front calls `prepare_*`, submits `call.requests` itself and passes the
outputs to `call.finish`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from vecpool import scoring
from vecpool.api.outputs import PoolingOutput, PreparedCall, T, output_data
from vecpool.config import LLMRerankerConfig
from vecpool.errors import InputError
from vecpool.inputs import InputProcessor, TextOptions, TextTokenizer, TruncationSide
from vecpool.models.folder import LateInteractionSpec
from vecpool.tasks import PoolingParams

if TYPE_CHECKING:
    from vecpool.engine.request import Request


class TaskCalls:
    """Mixed into `Engine`: the calls of the classify, score and sparse tasks."""

    if TYPE_CHECKING:
        tokenizer: TextTokenizer | None
        inputs: InputProcessor
        num_labels: int
        score_mode: str
        llm_reranker: LLMRerankerConfig | None
        late_interaction: LateInteractionSpec | None

        def make_requests(
            self, inputs: Any, params: PoolingParams, options: TextOptions | None = None
        ) -> list[Request]: ...

        def run(
            self, call: PreparedCall[T], *, show_progress: bool | None = None, desc: str = ""
        ) -> T: ...

    # ---- classify ----------------------------------------------------------------------

    def classify(
        self,
        inputs: Any,
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        show_progress: bool | None = None,
    ) -> np.ndarray:
        """`[n, num_labels]` float32 class scores per input (probabilities by the model's
        activation; raw logits with `use_activation=False`). Inputs may be texts, token ids,
        prompt embeds or `{"text": ..., "text_pair": ...}` pairs."""
        call = self.prepare_classify(
            inputs,
            use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        return self.run(call, show_progress=show_progress, desc="classify")

    def prepare_classify(
        self,
        inputs: Any,
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[np.ndarray]:
        params = PoolingParams(task="classify", use_activation=use_activation)
        requests = self.make_requests(
            inputs, params, TextOptions(truncate_prompt_tokens, truncation_side)
        )
        num_labels = self.num_labels

        def finish(outputs: list[PoolingOutput]) -> np.ndarray:
            data = output_data(outputs)
            return np.stack(data) if data else np.zeros((0, num_labels), dtype=np.float32)

        return PreparedCall(requests, finish)

    # ---- score and rerank --------------------------------------------------------------

    def score(
        self,
        a: Any,
        b: Any,
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        show_progress: bool | None = None,
    ) -> np.ndarray:
        """Relevance of `b` to `a`: one input against one or a list (1 -> 1, 1 -> N), or two
        lists of one length pairwise (N -> N). `[num_pairs]` float32 (a cross-encoder with
        several labels: `[num_pairs, num_labels]`).

        How depends on the model (`Engine.score_mode`): a cross-encoder reads each pair as one
        input, an LLM reranker reads its prompt template, a late-interaction model compares
        token vectors (MaxSim), an embedding model compares embeddings (cosine).
        """
        call = self.prepare_score(
            a,
            b,
            use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        return self.run(call, show_progress=show_progress, desc="score")

    def prepare_score(
        self,
        a: Any,
        b: Any,
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[np.ndarray]:
        lefts, rights = scoring.pair_up(a, b)
        options = TextOptions(truncate_prompt_tokens, truncation_side)
        if not rights:
            return PreparedCall([], lambda _: np.zeros(0, dtype=np.float32))
        if self.score_mode in ("cross_encoder", "llm"):
            pairs = scoring.text_pairs(lefts, rights)
            inputs: list[Any] = pairs
            if self.score_mode == "llm":
                assert self.llm_reranker is not None
                inputs = [self.llm_reranker.format(p["text"], p["text_pair"]) for p in pairs]
                if truncate_prompt_tokens is not None:  # cut the documents, never the template
                    limit = self.inputs.truncation_length(truncate_prompt_tokens)
                    inputs = self._fit_reranker_prompts(pairs, inputs, limit, truncation_side)
                    options = TextOptions()
            params = PoolingParams(task="score", use_activation=use_activation)
            return PreparedCall(self.make_requests(inputs, params, options), _pair_scores)
        if use_activation is not None:
            raise InputError(
                f"use_activation applies to cross-encoder and LLM scores, not to "
                f"{self.score_mode} scoring",
                field="use_activation",
            )
        late = self.score_mode == "late_interaction"
        task = "token_embed" if late else "embed"
        # A late-interaction folder writes the first side as queries, the second as documents.
        spec = self.late_interaction if late else None
        left_params = PoolingParams(task=task, input_type="query" if spec else None)
        right_params = PoolingParams(task=task, input_type="document" if spec else None)
        left_requests = self.make_requests(lefts, left_params, options)
        right_requests = self.make_requests(rights, right_params, options)
        mean = spec is not None and spec.mean_maxsim
        num_lefts = len(left_requests)

        def finish(outputs: list[PoolingOutput]) -> np.ndarray:
            _raise_first(outputs[:num_lefts], "text_1")
            _raise_first(outputs[num_lefts:], "text_2")
            left, right = output_data(outputs[:num_lefts]), output_data(outputs[num_lefts:])
            if late and num_lefts == 1:  # the query's vectors once, against every document
                return scoring.maxsim(left[0], right, mean=mean)
            if late:
                return np.array(
                    [
                        scoring.maxsim(q, [d], mean=mean)[0]
                        for q, d in zip(left, right, strict=True)
                    ],
                    dtype=np.float32,
                )
            return scoring.cosine(np.stack(left), np.stack(right))

        return PreparedCall(left_requests + right_requests, finish)

    def _fit_reranker_prompts(
        self,
        pairs: list[dict[str, str]],
        prompts: list[str],
        limit: int,
        side: TruncationSide,
    ) -> list[str]:
        """The reranker prompts, each document cut (at a token boundary of its own) so that the
        whole prompt takes at most `limit` tokens; the template and query stay whole."""
        tokenizer, config = self.tokenizer, self.llm_reranker
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
                over = (
                    len(tokenizer.encode_plain(fitted[i]).ids)
                    + tokenizer.num_special_tokens
                    - limit
                )
                if over <= 0:
                    break
                keep -= over
        return fitted

    def rerank(
        self,
        query: Any,
        documents: Sequence[Any],
        top_n: int | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        show_progress: bool | None = None,
    ) -> list[tuple[int, float]]:
        """`(document index, score)` pairs, best first, the first `top_n` of them; scores as
        `score(query, documents)` gives them."""
        call = self.prepare_rerank(
            query,
            documents,
            top_n,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        return self.run(call, show_progress=show_progress, desc="rerank")

    def prepare_rerank(
        self,
        query: Any,
        documents: Sequence[Any],
        top_n: int | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[list[tuple[int, float]]]:
        if isinstance(documents, str) or not isinstance(documents, Sequence):
            raise InputError("documents must be a list", field="documents")
        if top_n is not None and (
            isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0
        ):
            raise InputError(f"top_n must be a non-negative integer, got {top_n!r}", field="top_n")
        if len(scoring.as_input_list(query)) != 1:
            raise InputError("rerank takes one query", field="query")
        scores = self.prepare_score(
            query,
            list(documents),
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        if self.num_labels > 1 and self.score_mode == "cross_encoder":
            raise InputError(
                f"this cross-encoder has {self.num_labels} labels; rerank needs one score per "
                "document"
            )

        def finish(outputs: list[PoolingOutput]) -> list[tuple[int, float]]:
            return scoring.rank(scores.finish(outputs), top_n)

        return PreparedCall(scores.requests, finish)

    # ---- sparse ------------------------------------------------------------------------

    @overload
    def embed_sparse(
        self,
        inputs: Any,
        *,
        top_k: int | None = ...,
        threshold: float = ...,
        return_tokens: Literal[False] = ...,
        exclude_special_tokens: bool = ...,
        truncate_prompt_tokens: int | None = ...,
        truncation_side: TruncationSide = ...,
        show_progress: bool | None = ...,
    ) -> list[dict[int, float]]: ...

    @overload
    def embed_sparse(
        self,
        inputs: Any,
        *,
        top_k: int | None = ...,
        threshold: float = ...,
        return_tokens: Literal[True],
        exclude_special_tokens: bool = ...,
        truncate_prompt_tokens: int | None = ...,
        truncation_side: TruncationSide = ...,
        show_progress: bool | None = ...,
    ) -> list[dict[str, float]]: ...

    def embed_sparse(
        self,
        inputs: Any,
        *,
        top_k: int | None = None,
        threshold: float = 0.0,
        return_tokens: bool = False,
        exclude_special_tokens: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        show_progress: bool | None = None,
    ) -> list[dict[int, float]] | list[dict[str, float]]:
        """SPLADE vectors `{token_id: weight}` per input, heaviest first: weights above
        `threshold`, the `top_k` largest if given; keyed by token strings with
        `return_tokens=True`. Every token is pooled (as sentence-transformers' SpladePooling);
        `exclude_special_tokens=True` leaves the tokenizer's special tokens out, and then needs
        token ids (texts or id lists, not prompt embeds)."""
        call = self.prepare_embed_sparse(
            inputs,
            top_k=top_k,
            threshold=threshold,
            return_tokens=return_tokens,
            exclude_special_tokens=exclude_special_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )
        return self.run(call, show_progress=show_progress, desc="sparse")

    def prepare_embed_sparse(
        self,
        inputs: Any,
        *,
        top_k: int | None = None,
        threshold: float = 0.0,
        return_tokens: bool = False,
        exclude_special_tokens: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[list[dict[int, float]] | list[dict[str, float]]]:
        if top_k is not None and top_k < 0:
            raise InputError(f"top_k must be non-negative, got {top_k}", field="top_k")
        tokenizer = self.tokenizer
        if return_tokens and tokenizer is None:
            raise InputError(
                "return_tokens needs the model's tokenizer, and the folder has none",
                field="return_tokens",
            )
        requests = self.make_requests(
            inputs,
            PoolingParams(task="sparse", exclude_special_tokens=exclude_special_tokens),
            TextOptions(truncate_prompt_tokens, truncation_side),
        )

        def finish(outputs: list[PoolingOutput]) -> list[dict[int, float]] | list[dict[str, float]]:
            vectors = [scoring.sparse_vector(w, top_k, threshold) for w in output_data(outputs)]
            if not return_tokens:
                return vectors
            assert tokenizer is not None
            return [scoring.sparse_tokens(v, tokenizer.id_to_token) for v in vectors]

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
