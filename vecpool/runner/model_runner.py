"""The model runner: owns the model and device, turns a schedule into hidden states.

Only code common to every model belongs here.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from vecpool.errors import EngineError
from vecpool.inputs.pixels import ImagePixels
from vecpool.models.base import ImageBatch, PoolingModel
from vecpool.models.layers import packed_attention
from vecpool.models.layers.attention import cached_step, varlen_available
from vecpool.models.layers.invariant import InvariantFunctions, make_batch_invariant
from vecpool.models.layers.kv_blocks import BlockPool
from vecpool.models.quant.linear import has_fp8_layers
from vecpool.runner import cpu_choice, fp8_choice
from vecpool.runner.batch import FlatBatch, build_flat_batch, image_batch
from vecpool.runner.compiled import compile_blocks
from vecpool.runner.cpu_linear import can_pack, pack_linears
from vecpool.runner.graphs import StepGraphs, graph_max_tokens
from vecpool.runner.image_rows import KeptImageRows
from vecpool.runner.kv_cache import KVCache
from vecpool.runner.pixel_tables import PixelTables
from vecpool.runner.step import StepInput


class ModelRunner:
    """Owns the model and its device: builds a step's flat batch and runs the forward.

    `prepare` (host work, then non-blocking copies) and `forward` (queued on the device) are
    separate so that the engine can build the next step while the device runs this one.
    A causal model's prompts may run in chunks: their keys and values stay in `kv_cache`
    until the engine releases them (`release`), and so do the rows of an image whose
    placeholder span a chunk boundary splits (`kept_image_rows`), computed once."""

    def __init__(
        self,
        model: PoolingModel,
        device: torch.device,
        dtype: torch.dtype,
        *,
        compile_backend: str | None = None,  # e.g. "inductor": compile the layer stack
        graphs: bool = False,  # replay small steps from CUDA graphs (see graphs.py)
        max_seqs: int = 256,  # sequences one step may hold
        max_model_len: int = 512,
        max_step_tokens: int | None = None,  # the step budget: how large a graphed step can be
        block_pool: BlockPool | None = None,  # shared-prefix caching's blocks (causal models)
        batch_invariant: bool = False,  # every row's result independent of the step's others
    ):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.use_varlen = varlen_available(device, dtype)
        self.batch_invariant = batch_invariant
        # Steps whose sequences are all this short run their attention packed (0: never);
        # batch-invariant engines keep the per-sequence kernel (packed_attention.py).
        self.packed_max_len = (
            packed_attention.max_len(model.is_causal)
            if self.use_varlen and not batch_invariant
            else 0
        )
        # The CPU's linear kernel and attention, per machine and model shape (cpu_choice.py).
        self.cpu_choice = (
            cpu_choice.choose(model, dtype, causal=model.is_causal, max_len=max_model_len)
            if device.type == "cpu"
            and model.step_optimizations
            and not batch_invariant
            and compile_backend is None
            else None
        )
        # Which steps of each FP8 layer multiply in FP8, by row count, measured on the device
        # (fp8_choice.py); before compiling and recording graphs, which fix each step's path.
        if device.type == "cuda" and has_fp8_layers(model):
            with self.on_device(), torch.inference_mode():
                fp8_choice.choose(model, device, max_step_tokens or max_seqs * max_model_len)
        if batch_invariant:  # before compiling: the compiled blocks call the invariant products
            make_batch_invariant(model)
        self.compiled = compile_backend is not None
        if compile_backend is not None:
            compile_blocks(model, backend=compile_backend)
        elif (
            self.cpu_choice is not None
            and self.cpu_choice.linear == "onednn"
            and can_pack(device, dtype)
        ):
            pack_linears(model)  # the CPU's linears on oneDNN, weights prepacked once
        # Bidirectional attention cannot run a prompt in chunks, nor can a model that runs
        # plain forwards only (the transformers fallback): such models keep no cache.
        chunks = model.is_causal and model.step_optimizations
        self.kv_cache: KVCache | None = KVCache() if chunks else None
        self.kept_image_rows = KeptImageRows()
        self.pixel_tables = PixelTables(device, dtype)  # images' value tables, on the device
        self.block_pool = block_pool if chunks else None
        # Without a CUDA device, graphs=True runs the same padded shapes as plain forwards.
        # Its buffers are inference tensors, as every step's are: compiled blocks guard on
        # that, and would otherwise compile once more for each kind of step.
        with torch.inference_mode():
            self.graphs = (
                StepGraphs(
                    model,
                    hidden_size=model.hidden_size,
                    output_size=model.output_size,
                    dtype=dtype,
                    device=device,
                    max_seqs=max_seqs,
                    max_model_len=max_model_len,
                    use_varlen=self.use_varlen,
                    packed_max_len=self.packed_max_len,
                    with_token_types=model.uses_token_type_ids,
                    max_tokens=graph_max_tokens(model.hidden_size, max_step_tokens),
                    capture=device.type == "cuda",
                )
                if graphs
                else None
            )
            if self.graphs is not None and self.graphs.capture:
                with self.on_device():
                    self.graphs.warm_up()

    def on_device(self) -> contextlib.AbstractContextManager[object]:
        """The model's device made the current one while inside: what torch and Triton put on
        the current device (streams, events, graph captures, kernel launches) then lands on the
        model's, wherever the calling thread's current device was (another engine's, or device
        0 in a thread of its own). A no-op off CUDA."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    @torch.inference_mode()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`[n]` ids -> `[n, hidden]`: the model's own input embeddings (model dtype)."""
        return self.model.embed_input_ids(token_ids.to(self.device))

    @torch.inference_mode()
    def image_rows(self, pixels: ImagePixels) -> torch.Tensor:
        """`[num_tokens, hidden]` (CPU, model dtype): a vision-language model's rows for one
        image's placeholder tokens, its vision tower run on the image alone. Sent back as the
        image's precomputed rows (`vecpool.inputs.vision_prompts`), they give what the image
        gives, bit for bit."""
        images = image_batch([pixels], np.zeros(0, dtype=np.int64), self.device)
        with self.on_device():
            self._look_up(images)  # as a step's images are
            return self._vision_rows(images).cpu()

    def prepare(self, step: StepInput) -> FlatBatch:
        """Build the flat batch of a step and copy it to the device."""
        batch = build_flat_batch(
            step,
            self.device,
            use_varlen=self.use_varlen,
            with_token_types=self.model.uses_token_type_ids,
            kv_cache=self.kv_cache,
            block_pool=self.block_pool,
        )
        batch.attn.batch_invariant = self.batch_invariant
        batch.attn.packed = batch.attn.max_seqlen <= self.packed_max_len
        if self.cpu_choice is not None:
            batch.attn.cpu_attention = self.cpu_choice.attention
            batch.attn.cpu_group_cost = self.cpu_choice.group_cost
        vision = batch.image_rows.images if batch.image_rows is not None else None
        for images in (batch.images, vision):
            if images is None:
                continue
            if not self.model.image_patch_dim:
                raise EngineError("a step holds an image, but this model has no image tower")
            self._look_up(images)
        if batch.prompt_embeds is not None:  # image rows given as float32 join in the model dtype
            batch.prompt_embeds = batch.prompt_embeds.to(self.dtype)
        return batch

    def _look_up(self, images: ImageBatch) -> None:
        """`images.pixel_values` made the rows the model reads, in the model dtype: the
        codes looked up on the device (`PixelTables`), or the float32 rows cast."""
        if images.table is None:
            images.pixel_values = images.pixel_values.to(self.dtype)
        else:
            images.pixel_values = self.pixel_tables.rows(images.pixel_values, images.table)
            images.table = None

    def release(self, request_ids: list[str]) -> None:
        """Free the cached keys and values, and the kept image rows, of requests that are
        done."""
        if self.kv_cache is not None:
            self.kv_cache.release(request_ids)
        self.kept_image_rows.release(request_ids)

    @torch.inference_mode()
    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """`[num_tokens, hidden]` final hidden states (queued on the device, not waited for)."""
        kv = batch.attn.kv
        if kv is not None:
            kv.rewind()
        x = self.model.embed_input_ids(batch.input_ids)
        if batch.prompt_embeds is not None:
            assert batch.embeds_rows is not None
            x.index_copy_(0, batch.embeds_rows, batch.prompt_embeds)
        # On the CPU the invariant mode also needs its elementwise functions.
        invariant_cpu = self.batch_invariant and self.device.type == "cpu"
        if batch.image_rows is not None:  # a vision-language model's image rows
            with InvariantFunctions() if invariant_cpu else contextlib.nullcontext():
                self.kept_image_rows.fill(x, batch.image_rows, self._vision_rows)
        hidden = None
        # A step with images runs plain: the image tower beside the text tower, or before the
        # language model; so does one with multimodal rotary positions.
        images = {} if batch.images is None else {"images": batch.images}
        positions = batch.positions if batch.mrope_positions is None else batch.mrope_positions
        plain = images or batch.image_rows is not None or batch.mrope_positions is not None
        if self.graphs is not None and not plain:
            hidden = self.graphs.run(x, batch.positions, batch.attn, batch.token_type_ids)
        if hidden is None:
            with (
                InvariantFunctions() if invariant_cpu else contextlib.nullcontext(),
                cached_step(batch.attn) if kv is not None else contextlib.nullcontext(),
            ):
                hidden = self.model(x, positions, batch.attn, batch.token_type_ids, **images)
        if kv is not None and kv.prefix is not None:  # blocks written, prefixes read
            batch.prefix_sums = kv.prefix.pool.hidden_sums(hidden, kv.prefix)
        if batch.image_rows is not None:
            self.kept_image_rows.finish(batch.image_rows)
        return hidden

    def _vision_rows(self, images: ImageBatch) -> torch.Tensor:
        """`[rows, hidden]`: the rows of `images`' placeholder tokens, image after image."""
        vision_rows = getattr(self.model, "vision_rows", None)
        if vision_rows is None:
            raise EngineError("this model has no vision tower that writes prompt rows")
        rows: torch.Tensor = vision_rows(images, self.use_varlen, self.batch_invariant)
        return rows
