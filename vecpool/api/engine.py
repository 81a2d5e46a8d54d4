"""`Engine`: the offline face of vecpool, the task facade over the parts `build.py` builds."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from vecpool import calls
from vecpool.api.args import DEFAULT_MODEL_PACKAGE, EngineArgs
from vecpool.api.build import EngineParts, default_model_path
from vecpool.api.outputs import PoolingOutput, PreparedCall, outcome
from vecpool.api.running import PIPELINE_IMAGE_WEIGHT, EngineRunner
from vecpool.calls import SparseResult, postprocess
from vecpool.calls import windowed as windowed_embed
from vecpool.calls.info import EngineInfo
from vecpool.calls.options import (
    ClassifyOptions,
    EmbedOptions,
    EncodeOptions,
    RerankOptions,
    ScoreOptions,
    SparseOptions,
)
from vecpool.config import LLMRerankerConfig
from vecpool.errors import InputError
from vecpool.inputs.input_forms import holds_images
from vecpool.inputs.prompts import TruncationSide

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "Engine",
    "PoolingOutput",
    "PreparedCall",
    "default_model_path",
    "outcome",
]

logger = logging.getLogger(__name__)


class Engine(EngineRunner):
    """Loads a pooling model and serves its tasks over flat, unpadded batches: `embed`,
    `encode` (per-token tasks), `classify`, `score`, `rerank`, `embed_sparse`.

    Each call is prepared by the functions of `vecpool.calls` over the engine's
    `CallContext` (`prepare_*`: validate and tokenize), run (`run`), and finished by the
    prepared call. `info()` describes what the engine serves.

    Thread-safe: several threads may call it at once; their inputs share engine steps.

    `llm_reranker` makes a causal-LM checkpoint a reranker (prompt template and yes/no tokens,
    e.g. `LLMRerankerConfig.qwen3()`); `score_mode` overrides how `score` / `rerank` compare
    inputs (one of `SCORE_MODES`; by default from the model: an LLM reranker when configured,
    else a cross-encoder's classifier, else MaxSim for a ColBERT model, else cosine of
    embeddings). `compile` compiles the layer stack with `torch.compile` (default: on CUDA,
    for hidden sizes from 768; the first batches then take longer while it compiles).
    `cuda_graphs` replays steps of up to 8192 tokens (for models under 1024 wide, up to the
    step budget, at most 32,768) from CUDA graphs (default: on CUDA where
    the varlen attention kernel runs; common step shapes are recorded at start, others once,
    on first use).
    `data_parallel_size` above 1 is refused: an Engine is one engine in this process (see
    `EngineArgs.replicas` for how `vecpool serve` and `vecpool embed` place several).
    `batch_invariant` makes every input's output the same to the bit whatever else shares its
    step or call (fixed-shape matrix products and attention; see `vecpool.models.layers.invariant`).
    `model_impl` "auto" runs the folder's native vecpool class, else (slower, prompts whole,
    neither compiled nor graphed) the `transformers` class its config names; "vecpool" refuses
    an architecture with no native class; "transformers" always takes the fallback.
    `quantization` quantizes the linear projections of the model's layers once loaded, weights
    per output channel and activations per token: "fp8" on CUDA of compute capability 8.9 or
    higher, "int8" on the CPU (see `vecpool.models.quant.linear`); a checkpoint stored in FP8 runs in
    FP8 without it.
    `enable_prefix_caching` (causal models; refused for others): prompts that start with the
    same token ids compute them once, keeping their keys and values in a cache of
    `prefix_cache_tokens` positions (default 8192, at least `max_model_len`), least recently
    used evicted (see `vecpool.engine.prefix_cache`).
    `gpu_memory_fraction` caps the share of its CUDA device's memory the process's allocator
    may take (`torch.cuda.set_per_process_memory_fraction`): past it, an allocation fails
    instead of taking memory another engine on the device counts on.
    `tasks` names tasks to serve that the model was not made for, which are refused otherwise
    (an `InputError` naming the task and this option): "embed" or "token_embed" on a
    classifier or cross-encoder (its base model's hidden states, pooled as the folder says),
    "token_classify" on a sequence classifier (its classification head on every token's
    hidden state). `chat_template` (a file, or the Jinja text) renders vLLM's `messages` for
    a folder without a chat template, or in place of its own (the HTTP server's chat input).
    `max_num_batched_patches` bounds the patch rows a step's vision tower runs (default: the
    token budget); an image over it runs in a step whose tower runs no other image.
    Once built, and after a call that compiled, an engine moves the process's live objects out
    of the collector's full passes (`gc.freeze`; see `vecpool.api.heap` for what that costs).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        enable_prompt_embeds: bool = True,
        llm_reranker: LLMRerankerConfig | None = None,
        score_mode: str | None = None,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        max_input_chars: int | None = None,
        max_cached_tokens: int | None = None,
        windowed_embed: bool = False,
        embed_window_overlap: int | None = None,
        data_parallel_size: int = 1,
        model_impl: str = "auto",
        quantization: str | None = None,
        enable_prefix_caching: bool = False,
        prefix_cache_tokens: int | None = None,
        batch_invariant: bool = False,
        gpu_memory_fraction: float | None = None,
        tokenizer_processes: int | None = None,
        allowed_local_media_path: str | Path | None = None,
        allowed_media_domains: tuple[str, ...] = (),
        max_image_bytes: int | None = None,
        tasks: tuple[str, ...] = (),
        chat_template: str | Path | None = None,
        max_num_batched_patches: int | None = None,
    ):
        # The keywords are `EngineArgs`' fields, in its order and with its defaults (a test
        # holds them so): they become one, checked there.
        options = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__(EngineArgs(**options))

    @classmethod
    def from_args(cls, args: EngineArgs) -> Engine:
        """An engine built from `args` (e.g. `EngineArgs.from_cli_args(...)`)."""
        engine = cls.__new__(cls)
        EngineParts.__init__(engine, args)
        return engine

    # ---- what the engine serves ------------------------------------------------------

    def info(self) -> EngineInfo:
        """The model, its limits and the tasks it serves, as frozen, picklable values."""
        return self._info

    # ---- embed and per-token tasks -----------------------------------------------------

    def embed(
        self,
        inputs: Any,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        prompt_name: str | None = None,
        prompt: str | None = None,
        precision: str = "float32",
        ranges: np.ndarray | None = None,
        show_progress: bool | None = None,
        windowed: bool | None = None,
    ) -> np.ndarray:
        """One vector per input: `[n, dim]` float32, in input order.

        Inputs may be strings, token-id lists, `{"prompt_embeds": tensor}` dicts, or a mix.
        A failed input raises an `InputError` (a `ValueError`) naming its index.
        `windowed=True` (default: the engine's `windowed_embed`) embeds an input longer than
        the model's limit as the token-weighted mean of overlapping windows, an approximation
        (`vecpool.calls.windowed`).

        `precision` "int8", "uint8", "binary" or "ubinary": the vectors quantized as
        sentence-transformers' `quantize_embeddings` does (`vecpool.calls.postprocess.quantize`);
        int8 / uint8 use `ranges` (`[2, dim]`: each dimension's minimum and maximum) when
        given, else the minimum and maximum of this call's vectors.
        """
        options = EmbedOptions.of(locals())
        dim = self._info.embed_dim(dimensions)
        checked_ranges = calls.check_quantization(precision, ranges, dim)
        if windowed if windowed is not None else self.args.windowed_embed:
            call = windowed_embed.prepare_embed_windowed(self.context, inputs, options)
            vectors = self.run(call, show_progress=show_progress, desc="embed")
        else:
            vectors = self._encode_rows(inputs, options.encode(), show_progress, dim)
        if precision == "float32":
            return vectors
        return postprocess.quantize(vectors, precision, checked_ranges)

    def encode(
        self,
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
        show_progress: bool | None = None,
    ) -> list[np.ndarray]:
        """The raw output of `task` per input, in input order (per-token tasks: `[n_i, dim]`;
        token_classify: `[n_i, num_labels]`, or only the `step_tag_id` positions).

        `input_type` ("query" or "document", token_embed of a late-interaction model): write the
        inputs as that side of the model, as its configuration says (ColBERT's [Q] / [D] marker
        after the first token, the query's [MASK] expansion, the side's length limit and
        prompt; the skiplist left out of documents). None (the default): the inputs as given.
        """
        return self._encode(inputs, EncodeOptions.of(locals()), show_progress)

    def _encode(
        self, inputs: Any, options: EncodeOptions, show_progress: bool | None
    ) -> list[np.ndarray]:
        results: list[np.ndarray] = []
        self._encode_items(
            calls.as_input_list(inputs), options, show_progress, lambda _, out: results.extend(out)
        )
        return results

    def _encode_rows(
        self, inputs: Any, options: EncodeOptions, show_progress: bool | None, dim: int
    ) -> np.ndarray:
        """`_encode` of one vector per input, as `[n, dim]` float32 rows. A large call's rows
        are stacked chunk by chunk into the result as the chunks finish, while the device runs
        later ones, rather than all after the last step."""
        items = calls.as_input_list(inputs)
        rows: list[np.ndarray] = []  # made once outputs come: preparing checks the options first

        def stack(start: int, out: list[np.ndarray]) -> None:
            if not out:
                return
            if not rows:
                rows.append(np.empty((len(items), dim), dtype=np.float32))
            np.stack(out, out=rows[0][start : start + len(out)])

        self._encode_items(items, options, show_progress, stack)
        return rows[0] if rows else np.zeros((0, dim), dtype=np.float32)

    def _encode_items(
        self,
        items: list[Any],
        options: EncodeOptions,
        show_progress: bool | None,
        take: Callable[[int, list[np.ndarray]], object],  # (first input, outputs in order)
    ) -> None:
        """Run `items`: in one call, or chunk by chunk when large (`run_in_chunks`); their
        outputs go to `take`, at once or a chunk at a time."""

        def prepare(start: int, stop: int) -> PreparedCall[list[np.ndarray]]:
            return calls.prepare_encode(self.context, calls.InputList(items[start:stop]), options)

        weights = None  # each input one text, unless the model reads images
        if self.context.inputs.images is not None:
            weights = np.fromiter(
                (PIPELINE_IMAGE_WEIGHT if holds_images(item) else 1 for item in items),
                np.int64,
                len(items),
            )
        self.run_in_chunks(len(items), prepare, take, show_progress, options.task, weights)

    def prepare_encode(
        self,
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
        """The requests of `encode`, not yet run, and how their outputs become its result."""
        return calls.prepare_encode(self.context, inputs, EncodeOptions.of(locals()))

    # ---- classify, score, rerank ---------------------------------------------------------

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
        call = calls.prepare_classify(self.context, inputs, ClassifyOptions.of(locals()))
        return self.run(call, show_progress=show_progress, desc="classify")

    def prepare_classify(
        self,
        inputs: Any,
        *,
        use_activation: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[np.ndarray]:
        return calls.prepare_classify(self.context, inputs, ClassifyOptions.of(locals()))

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
        call = calls.prepare_score(self.context, a, b, ScoreOptions.of(locals()))
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
        return calls.prepare_score(self.context, a, b, ScoreOptions.of(locals()))

    def rerank(
        self,
        query: Any,
        documents: Sequence[Any],
        top_n: int | None = None,
        *,
        use_activation: bool | None = None,
        max_tokens_per_doc: int | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
        show_progress: bool | None = None,
    ) -> list[tuple[int, float]]:
        """`(document index, score)` pairs, best first, the first `top_n` of them (None or 0:
        every document); scores as `score(query, documents)` gives them.
        `max_tokens_per_doc`: each document cut to that many of its own tokens first."""
        call = calls.prepare_rerank(
            self.context, query, documents, None, RerankOptions.of(locals())
        )
        return self.run(call, show_progress=show_progress, desc="rerank")

    def prepare_rerank(
        self,
        query: Any,
        documents: Sequence[Any],
        top_n: int | None = None,
        *,
        use_activation: bool | None = None,
        max_tokens_per_doc: int | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[list[tuple[int, float]]]:
        return calls.prepare_rerank(
            self.context, query, documents, None, RerankOptions.of(locals())
        )

    # ---- sparse --------------------------------------------------------------------------

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
    ) -> SparseResult:
        """SPLADE vectors `{token_id: weight}` per input, heaviest first: weights above
        `threshold`, the `top_k` largest if given; keyed by token strings with
        `return_tokens=True`. Every token is pooled (as sentence-transformers' SpladePooling);
        `exclude_special_tokens=True` leaves the tokenizer's special tokens out, and then needs
        token ids (texts or id lists, not prompt embeds)."""
        call = calls.prepare_embed_sparse(self.context, inputs, SparseOptions.of(locals()))
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
    ) -> PreparedCall[SparseResult]:
        return calls.prepare_embed_sparse(self.context, inputs, SparseOptions.of(locals()))

    # ---- large calls ---------------------------------------------------------------------

    # ---- tokens --------------------------------------------------------------------------

    def embed_tokens(self, token_ids: Sequence[int] | torch.Tensor | np.ndarray) -> torch.Tensor:
        """`[n, hidden]` (CPU, model dtype): the model's own input embeddings of `token_ids`,
        however many (a lookup: the model's length limit applies where they are used).

        Passing these as `{"prompt_embeds": ...}` gives exactly what the ids give.
        """
        ids = self.inputs.vocabulary_ids(token_ids)
        return self.model_runner.embed_tokens(torch.from_numpy(ids)).cpu()

    def image_rows(self, images: Any) -> list[dict[str, Any]]:
        """Each image's rows as a vision-language model's vision tower gives them (run on the
        image alone), in the form an input takes back in the image's place:
        `{"image_embeds": [num_tokens, hidden] tensor (CPU, model dtype), "image_grid_thw":
        [1, rows, columns]}` (the patch grid before merging). `images`: one image or a list,
        in any form an image input takes (a PIL image, bytes, a path, `{"image": ...}`).

        Sent back in place of the image (`{"text": ..., "image": rows}`, an `image_embeds`
        part; the engine must take prompt embeds), they give what the image gives, bit for bit.
        `InputError` naming the image that cannot be read, or for a model that is not a
        vision-language model."""
        reader = self.inputs.images
        if reader is None or reader.vision is None:
            raise InputError(
                f"image_rows needs a vision-language model (Qwen2-VL); {self.info().architecture}"
                " does not put images into prompts",
                field="images",
            )
        items = [
            item["image"] if isinstance(item, dict) and set(item) == {"image"} else item
            for item in calls.as_input_list(images)
        ]
        out = []
        for read in reader.read_many(list(enumerate(items))):
            if isinstance(read, InputError):
                raise read
            rows = self.model_runner.image_rows(read)
            out.append({"image_embeds": rows, "image_grid_thw": [1, *read.grid]})
        return out

    def tokenize(
        self,
        text: str,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """The token ids a text input becomes (special tokens and instruction included),
        however long: counting tokens is one of its uses."""
        return calls.tokenize(
            self.context,
            text,
            prompt_name=prompt_name,
            prompt=prompt,
            add_special_tokens=add_special_tokens,
        )

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of vocabulary ids (special tokens skipped unless `skip_special_tokens` is
        false); `InputError` for an id outside the vocabulary."""
        return calls.detokenize(self.context, token_ids, skip_special_tokens=skip_special_tokens)
