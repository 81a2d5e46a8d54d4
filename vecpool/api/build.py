"""Building an engine: from `EngineArgs` to a loaded model, its heads, runners, scheduler,
input stage and `EngineInfo` (`EngineParts`); `Engine` (engine.py) is the task facade over
what this builds."""

from __future__ import annotations

import importlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from vecpool.api import heap
from vecpool.api.args import DEFAULT_MODEL_PACKAGE, EngineArgs
from vecpool.api.device import resolve_device, resolve_dtype
from vecpool.api.late_interaction import side_formats, skiplist_ids
from vecpool.calls import CallContext
from vecpool.calls.chat import check_chat_template, read_chat_template
from vecpool.calls.info import EngineInfo
from vecpool.config import LLMRerankerConfig
from vecpool.engine.core import EngineCore
from vecpool.engine.prefix_cache import BLOCK_SIZE, PrefixCache
from vecpool.engine.scheduler import Scheduler
from vecpool.errors import ConfigError
from vecpool.inputs.images import image_reader
from vecpool.inputs.prompts import InputLimits, InputProcessor, Prompt, TextOptions, TextTokenizer
from vecpool.inputs.tokenizer_pool import TokenizerPool, default_size
from vecpool.models.base import Capability
from vecpool.models.hf import hf_get
from vecpool.models.layers.attention import varlen_available
from vecpool.models.layers.invariant import InvariantHead
from vecpool.models.layers.kv_blocks import BlockPool
from vecpool.models.loading.folder import ModelFolder
from vecpool.models.loading.loader import load_model
from vecpool.models.loading.st import load_dense_stack
from vecpool.models.quant.linear import check_quantization, has_fp8_layers, quantize_model
from vecpool.pooling.build import PoolingDefaults, build_heads
from vecpool.runner.compiled import compile_by_default
from vecpool.runner.cpu_linear import RowwiseHead
from vecpool.runner.model_runner import ModelRunner
from vecpool.runner.pooling_runner import PoolingRunner
from vecpool.runner.step import ScheduledChunk
from vecpool.tasks import TASKS, PoolingParams, get_task

# The engine's probe: a short input any text model embeds (see `EngineParts._probe`).
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


class EngineParts:
    """An engine's parts, built from `EngineArgs`: the model folder and model, the device and
    dtype, the limits and defaults, the runners, the scheduler and engine core, the input stage
    and the `EngineInfo` and `CallContext` that describe them. `Engine` is built on these."""

    def __init__(self, args: EngineArgs):
        self.args = args
        (model, device, dtype, max_model_len) = (
            args.model,
            args.device,
            args.dtype,
            args.max_model_len,
        )
        (pooling, normalize, llm_reranker) = (args.pooling, args.normalize, args.llm_reranker)
        (score_mode, compile, cuda_graphs) = (args.score_mode, args.compile, args.cuda_graphs)
        (data_parallel_size, model_impl) = (args.data_parallel_size, args.model_impl)
        (quantization, batch_invariant) = (args.quantization, args.batch_invariant)
        (enable_prompt_embeds, gpu_memory_fraction) = (
            args.enable_prompt_embeds,
            args.gpu_memory_fraction,
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
            # "cuda" without an index is the current device (torch wants None or an index).
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, self.device.index)
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
        # A dual encoder's rows are in its shared space, of their own width.
        self.output_dim = dense.output_dim(self.model.output_size or self.hidden_size)
        # A ColBERT / multi-vector folder: how queries and documents are written and scored.
        self.late_interaction = self.folder.late_interaction
        late = self.late_interaction
        self.token_output_dim = (
            late.dense[-1].out_features
            if late is not None and late.dense
            else self.model.projection_dim or self.model.output_size or self.hidden_size
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
        if batch_invariant and has_fp8_layers(self.model):
            raise ConfigError(
                f"{self.folder.path.name} is stored in FP8, whose products vecpool does not "
                "make batch-invariant: leave batch_invariant unset"
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
            max_step_tokens=self.scheduler_config.max_num_batched_tokens,
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
                dtype=str(self.dtype).removeprefix("torch."),
                enable_prompt_embeds=enable_prompt_embeds,
                max_input_chars=args.input_char_limit(self.max_model_len),
                pad_to=min(self.model.pad_prompts_to, self.max_model_len)
                if self.model.pad_prompts_to
                else None,
                pad_id=self.model.pad_token_id,
            ),
            self.tokenizer,
            tokenizer_pool=self._tokenizer_pool(args.tokenizer_processes),
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
            images=image_reader(self.image_processor_dir, args.media_policy())
            if self.image_processor_dir is not None
            else None,
        )
        if self.inputs.images is not None:
            self.inputs.images.check(
                self.model.image_patch_dim, self.model.image_grid, self.folder.architecture
            )
        if batch_invariant:  # the heads' products on [num_seqs, hidden] rows too
            heads = {name: InvariantHead(head) for name, head in heads.items()}
        elif self.device.type == "cpu":  # a row's head output wherever it sits in a step
            heads = {name: RowwiseHead(head) for name, head in heads.items()}
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
        heap.freeze()  # start-up's objects (the model, graphs) out of full collections

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

    def _describe(self, args: EngineArgs) -> EngineInfo:
        missing = self.missing_heads
        unavailable = {
            name: missing[spec.head] for name, spec in TASKS.items() if spec.head in missing
        }
        for task in args.tasks:
            if task in unavailable:
                raise ConfigError(
                    f"tasks: {self.folder.architecture} cannot serve {task!r}: {unavailable[task]}"
                )
        opt_in = self._opt_in_tasks(args)
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
            tasks=tuple(sorted(n for n in TASKS if n not in unavailable and n not in opt_in)),
            unavailable_tasks=unavailable,
            opt_in_tasks=opt_in,
            chat_template=check_chat_template(read_chat_template(str(args.chat_template)))
            if args.chat_template is not None
            else None,
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
            image_processor_dir=self.image_processor_dir,
            media_policy=self.inputs.images.policy if self.inputs.images is not None else None,
            pair_template=self.model.pair_template if self.score_mode == "cross_encoder" else None,
            vision_language=self.inputs.images is not None
            and self.inputs.images.vision is not None,
        )

    def _opt_in_tasks(self, args: EngineArgs) -> dict[str, str]:
        """The tasks this model can compute but was not made for, each with why, less those
        `args.tasks` asks for: a classifier's or cross-encoder's base model is not trained to
        embed (vLLM and Infinity refuse it), and a sequence classifier's head is trained on
        one pooled row, not on each token (vLLM serves that only once switched to it). An
        explicit score_mode of "embed" or "late_interaction" asks for the task it scores by."""
        capabilities, arch = self.model.capabilities, self.folder.architecture
        sequence = Capability.SEQUENCE_CLASSIFIER in capabilities
        tokens = Capability.TOKEN_CLASSIFIER in capabilities
        out: dict[str, str] = {}
        if sequence or tokens:
            kind = "a sequence classifier"
            if tokens:
                kind = "a token classifier"
            elif self.num_labels == 1:
                kind = "a cross-encoder"
            why = f"{arch} is {kind}, whose base model's hidden states are not trained as "
            out["embed"] = why + "embeddings"
            out["token_embed"] = why + "token embeddings"
        if sequence and not tokens:
            out["token_classify"] = (
                f"{arch} is a sequence classifier: asked for, its classification head (trained "
                "on one pooled row) is applied to every token's hidden state"
            )
        asked = set(args.tasks)
        scored_by = {"embed": "embed", "late_interaction": "token_embed"}.get(args.score_mode or "")
        if scored_by is not None:
            asked.add(scored_by)
        return {name: why for name, why in out.items() if name not in asked}

    @property
    def image_processor_dir(self) -> str | None:
        """The folder of the model's image processor settings; None without an image tower."""
        if Capability.IMAGE_TOWER not in self.model.capabilities:
            return None
        return str(self.folder.image_processor_dir)

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
            # Cut to the model's limit and past any --max-input-chars: the user's limits are
            # for their inputs (a limit below the sentence's made the engine refuse its own).
            limits = replace(self.inputs.limits, max_input_chars=None)
            unlimited = InputProcessor(limits, self.inputs.tokenizer)
            (prompt,) = unlimited.process([PROBE_TEXT], TextOptions(truncate_prompt_tokens=-1))
        else:
            ids = np.arange(1, 9, dtype=np.int64) % self.model.vocab_size
            prompt = Prompt(token_ids=ids, prompt_embeds=None)
        params = PoolingParams(task="embed")
        return ScheduledChunk("probe", prompt, params, get_task("embed"), 0, prompt.num_tokens)

    def _tokenizer_pool(self, size: int | None) -> TokenizerPool | None:
        """The child processes that tokenize large batches of texts (`size` of them; None: a
        core in four), or None for 0 or a folder without a tokenizer."""
        size = default_size() if size is None else size
        if not size or self.folder.tokenizer_file is None:
            return None
        return TokenizerPool(self.folder.tokenizer_file, size)

    def _special_token_ids(self) -> list[int]:
        """Token ids SPLADE's exclude_special_tokens leaves out: the tokenizer's special tokens,
        else the config's."""
        if self.tokenizer is not None:
            return self.tokenizer.special_token_ids()
        hf = self.folder.hf_config
        keys = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
        return [int(hf[k]) for k in keys if isinstance(hf.get(k), int)]
