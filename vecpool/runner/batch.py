"""One flat, unpadded batch: every scheduled token of a step, concatenated."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vecpool.errors import EngineError
from vecpool.inputs.pixels import ImagePixels
from vecpool.models.base import ImageBatch
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.kv_blocks import BlockPool, ChunkedKV, PrefixKV, SharedPrefixes
from vecpool.pooling.methods import PoolingMetadata
from vecpool.runner.image_rows import ImageKey, StepImageRows
from vecpool.runner.kv_cache import KVCache
from vecpool.runner.step import ScheduledChunk, StepInput


@dataclass
class FlatBatch:
    """The tensors of one step. Built by `build_flat_batch`; read by the model and the pooling heads."""

    input_ids: torch.Tensor  # [num_tokens] int64; 0 on rows that take prompt embeds
    positions: torch.Tensor  # [num_tokens] int64: each token's position in its prompt
    token_type_ids: torch.Tensor | None  # [num_tokens] int64, when the model reads them
    embeds_rows: torch.Tensor | None  # [num_embeds_tokens] int64: rows that take prompt embeds
    prompt_embeds: torch.Tensor | None  # [num_embeds_tokens, hidden] in the model dtype
    attn: AttentionMetadata
    pooling: PoolingMetadata
    has_token_ids: list[bool]  # [num_seqs]: False where the prompt came as embeddings or an image
    # A dual encoder's images in the step, one row each, which the model fills; None: none.
    images: ImageBatch | None = None
    # A vision-language model's image rows in the step (the rows of their placeholder tokens
    # this step holds), which the model runner fills; None: no prompt of the step has images.
    image_rows: StepImageRows | None = None
    # Multimodal rotary positions (temporal, height, width), when some prompt of the step has
    # them (a vision-language prompt with images); the other prompts' positions repeated on
    # the three axes. None: `positions` serve.
    mrope_positions: torch.Tensor | None = None  # [3, num_tokens] int64
    # Shared-prefix caching: each sequence's cached prefix's float32 hidden-state sum (zero
    # where it has none). Set by the model runner's forward; None: no sequence reads the pool.
    prefix_sums: torch.Tensor | None = None  # [num_seqs, hidden] float32

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_flat_batch(
    step: StepInput,
    device: torch.device,
    *,
    use_varlen: bool,
    with_token_types: bool,
    kv_cache: KVCache | None = None,
    block_pool: BlockPool | None = None,
) -> FlatBatch:
    """Concatenate the scheduled chunks into flat tensors on `device`. A chunk of a longer
    prompt gets its buffers in `kv_cache` (a model with causal attention; None: every chunk
    must be a whole prompt); chunks that read or write cached prefix blocks, their rows of
    `block_pool`."""
    chunks = step.chunks
    lengths = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
    cu = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_ids = np.repeat(np.arange(len(chunks)), lengths)
    pos_in_seq = np.arange(num_tokens) - np.repeat(cu[:-1], lengths)
    positions = pos_in_seq + np.repeat(starts, lengths)

    ids_parts: list[np.ndarray] = []
    type_parts: list[np.ndarray] = []
    embeds_parts: list[torch.Tensor] = []
    embeds_rows_parts: list[np.ndarray] = []
    # A dual encoder's images: (pixels, batch row) that the model fills from them
    images: list[tuple[ImagePixels, int]] = []
    vision = _ImageRowsPlan()  # a vision-language model's
    mrope = any(c.prompt.mrope_positions is not None for c in chunks)
    key_lengths: np.ndarray | None = None  # [num_seqs]: set when some keys are left out
    # Token types: zeros for the whole step unless some prompt has its own (a text pair).
    own_types = with_token_types and any(c.prompt.token_type_ids is not None for c in chunks)
    for i, (c, offset) in enumerate(zip(chunks, cu[:-1], strict=True)):
        prompt = c.prompt
        end = c.start + c.num_tokens
        if prompt.num_attended is not None:
            if key_lengths is None:
                key_lengths = lengths.copy()
            key_lengths[i] = min(max(prompt.num_attended - c.start, 1), c.num_tokens)
        if prompt.images:  # the images' spans: the tower's rows, kept rows, or rows given
            vision.add(c, int(offset), embeds_parts, embeds_rows_parts)
        if prompt.token_ids is not None:
            ids_parts.append(prompt.token_ids[c.start : end])
        elif prompt.image is not None:  # one row, which the model fills with the image's output
            ids_parts.append(_IMAGE_ROW_ID)
            images.append((prompt.image, int(offset)))
        else:
            assert prompt.prompt_embeds is not None
            ids_parts.append(np.zeros(c.num_tokens, dtype=np.int64))
            embeds_parts.append(prompt.prompt_embeds[c.start : end])
            embeds_rows_parts.append(np.arange(offset, offset + c.num_tokens))
        if own_types:
            types = prompt.token_type_ids
            type_parts.append(
                types[c.start : end]
                if types is not None
                else np.zeros(c.num_tokens, dtype=np.int64)
            )

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    # The attention kernel's int32 boundaries travel as the bytes of int64 words (the copy
    # keeps bytes), and each sequence's last row as its own array: no kernels to make them.
    # The boundaries go first, 16-byte aligned as a graph's own buffer is: Triton compiles a
    # kernel anew for a pointer that is not (the packed attention's first eager step whose row
    # count is a multiple of 16 took ~0.7 s on an H200, found in some later call).
    cu32 = np.zeros(len(cu) + len(cu) % 2, dtype=np.int32)
    cu32[: len(cu)] = cu
    arrays = [cu32.view(np.int64), np.concatenate(ids_parts), cu, seq_ids, starts, positions]
    arrays += [pos_in_seq, lengths, cu[1:] - 1]
    if with_token_types:  # zeros for the whole step unless some prompt has its own
        arrays.append(
            np.concatenate(type_parts) if own_types else np.zeros(num_tokens, dtype=np.int64)
        )
    if embeds_parts:
        arrays.append(np.concatenate(embeds_rows_parts))
    if mrope:
        arrays.append(_mrope_positions(chunks, cu, positions).reshape(-1))
    on_device = upload(arrays, device)
    cu32_words, input_ids, cu_device, seq_ids_device, starts_device = on_device[:5]
    positions_device, pos_device, lengths_device, last_rows = on_device[5:9]
    token_types = on_device[9] if with_token_types else None
    mrope_positions = on_device.pop().view(3, num_tokens) if mrope else None
    embeds_rows = on_device[-1] if embeds_parts else None
    key_rows: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    if key_lengths is not None:
        cu_k = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(key_lengths, out=cu_k[1:])
        rows = (
            np.arange(int(cu_k[-1]))
            - np.repeat(cu_k[:-1], key_lengths)
            + np.repeat(cu[:-1], key_lengths)
        )
        key_rows, cu_seqlens_k = to_device(rows), to_device(cu_k).to(torch.int32)
    kv = _chunked_kv(step, starts, lengths, cu, kv_cache, to_device, block_pool, use_varlen)
    return FlatBatch(
        input_ids=input_ids,
        positions=positions_device,
        token_type_ids=token_types,
        embeds_rows=embeds_rows,
        prompt_embeds=torch.cat(embeds_parts).to(device, non_blocking=True)
        if embeds_parts
        else None,
        attn=AttentionMetadata(
            cu_seqlens=cu32_words.view(torch.int32)[: len(cu)],
            max_seqlen=int(lengths.max()),
            seq_ids=seq_ids_device,
            pos_in_seq=pos_device,
            use_varlen=use_varlen,
            key_rows=key_rows,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=0 if key_lengths is None else int(key_lengths.max()),
            kv=kv,
        ),
        pooling=PoolingMetadata(
            cu_seqlens=cu_device,
            lengths=lengths_device,
            seq_ids=seq_ids_device,
            input_ids=input_ids,
            last_rows=last_rows,
            starts=starts_device,
        ),
        has_token_ids=[c.prompt.token_ids is not None for c in chunks],
        images=image_batch([p for p, _ in images], np.array([r for _, r in images]), device)
        if images
        else None,
        image_rows=vision.build(device) if vision.used else None,
        mrope_positions=mrope_positions,
    )


_IMAGE_ROW_ID = np.zeros(1, dtype=np.int64)


def _mrope_positions(
    chunks: list[ScheduledChunk],
    cu: np.ndarray,  # [num_seqs + 1] int64: the chunks' rows in the batch
    positions: np.ndarray,  # [num_tokens] int64
) -> np.ndarray:  # [3, num_tokens] int64
    """Each chunk's multimodal rotary positions, its plain positions on the three axes where
    its prompt has none."""
    out = np.repeat(positions[None, :], 3, axis=0)
    for c, first, last in zip(chunks, cu[:-1], cu[1:], strict=True):
        own = c.prompt.mrope_positions
        if own is not None:
            out[:, first:last] = own[:, c.start : c.start + c.num_tokens]
    return out


def image_batch(
    pixels: list[ImagePixels],
    rows: np.ndarray,  # [num_rows] int64: the batch rows the model fills from them
    device: torch.device,
) -> ImageBatch:
    """The images, flat: their patch rows concatenated, with where each starts and the batch
    rows it fills. When every image is in the compact form of one table, the rows are their
    uint8 codes and the table (the model runner looks them up on the device); otherwise
    float32 rows for all (the model runner casts them to the model dtype)."""
    counts = np.fromiter((p.num_patches for p in pixels), np.int64, len(pixels))
    table = pixels[0].table
    if table is not None and all(p.table == table for p in pixels[1:]):
        values = _upload_rows([p.data for p in pixels], torch.uint8, device)
    else:
        table = None
        values = _upload_rows([p.patches for p in pixels], torch.float32, device)
    cu_patches, rows_device = upload([_cumsum0(counts), rows.astype(np.int64)], device)
    return ImageBatch(
        pixel_values=values,
        cu_patches=cu_patches.to(torch.int32),
        max_patches=int(counts.max()),
        grids=[p.grid for p in pixels],
        rows=rows_device,
        table=table,
    )


def _upload_rows(
    parts: list[np.ndarray],  # each [n_i, width] of `dtype`
    dtype: torch.dtype,  # the parts' dtype
    device: torch.device,
) -> torch.Tensor:  # [sum n_i, width] on `device`
    """Arrays of rows concatenated on `device`, in one copy that, on CUDA, goes through
    page-locked memory (as `upload`'s): queued behind the running step, not waited for."""
    width = parts[0].shape[1]
    total = sum(p.shape[0] for p in parts)
    host = torch.empty((total, width), dtype=dtype, pin_memory=device.type == "cuda")
    np.concatenate(parts, out=host.numpy())
    return host.to(device, non_blocking=True)


class _ImageRowsPlan:
    """A step's vision-language image rows, gathered chunk by chunk (see
    `vecpool.runner.image_rows`): an image runs through the tower in the chunk that holds its
    first placeholder token; a chunk that holds the rest of its span reads the rows kept."""

    def __init__(self) -> None:
        self.pixels: list[ImagePixels] = []  # the images the tower runs in this step
        self.tower_rows = 0  # rows of the tower's output so far
        self.fill: list[np.ndarray] = []  # batch rows the tower's output fills
        self.take: list[np.ndarray] = []  # the output row of each
        self.keep: list[tuple[ImageKey, int, int]] = []
        self.reads: list[tuple[ImageKey, int, int]] = []
        self.read_rows: list[np.ndarray] = []
        self.done: list[ImageKey] = []

    @property
    def used(self) -> bool:
        return bool(self.pixels or self.reads)

    def add(
        self,
        c: ScheduledChunk,
        offset: int,  # the chunk's first batch row
        embeds_parts: list[torch.Tensor],
        embeds_rows_parts: list[np.ndarray],
    ) -> None:
        """The image rows of chunk `c`: each span it reaches, from where it reaches it."""
        end = c.start + c.num_tokens
        for j, span in enumerate(c.prompt.images):
            lo, hi = max(span.start, c.start), min(span.end, end)
            if lo >= hi:
                continue
            rows = np.arange(offset + lo - c.start, offset + hi - c.start)  # in the batch
            if span.pixels is None:  # rows given with the input: prompt embeds
                assert span.rows is not None
                embeds_parts.append(torch.from_numpy(span.rows[lo - span.start : hi - span.start]))
                embeds_rows_parts.append(rows)
            elif span.start >= c.start:  # its tower run is this step's
                first = self.tower_rows
                self.pixels.append(span.pixels)
                self.tower_rows += span.num_tokens
                self.fill.append(rows)
                self.take.append(np.arange(first, first + hi - lo))
                if hi < span.end:
                    self.keep.append(((c.request_id, j), first, span.num_tokens))
            else:  # computed in an earlier step, kept
                key = (c.request_id, j)
                self.reads.append((key, lo - span.start, hi - span.start))
                self.read_rows.append(rows)
                if hi == span.end:
                    self.done.append(key)

    def build(self, device: torch.device) -> StepImageRows:
        out = StepImageRows(keep=self.keep, reads=self.reads, done=self.done)
        if self.pixels:
            no_rows = np.zeros(0, dtype=np.int64)
            out.images = image_batch(self.pixels, no_rows, device)
            out.fill_rows, out.take = upload(
                [np.concatenate(self.fill), np.concatenate(self.take)], device
            )
        if self.reads:
            (out.read_rows,) = upload([np.concatenate(self.read_rows)], device)
        return out


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays on `device`, in one copy: views of one buffer. On CUDA the copy goes
    through page-locked memory, so that it is queued behind the running step instead of
    waiting for it (the host allocator keeps the pages until the copy has run)."""
    sizes = [a.shape[0] for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    np.concatenate(arrays, out=host.numpy(), casting="same_kind")
    return list(host.to(device, non_blocking=True).split(sizes))


def _chunked_kv(
    step: StepInput,
    starts: np.ndarray,  # [num_seqs] int64
    lengths: np.ndarray,  # [num_seqs] int64
    cu: np.ndarray,  # [num_seqs + 1] int64
    kv_cache: KVCache | None,
    to_device: Callable[[np.ndarray], torch.Tensor],
    block_pool: BlockPool | None = None,
    share_prefixes: bool = False,  # the attention reads a group's prefix once (varlen kernel)
) -> ChunkedKV | None:
    """The cached keys and values the step's chunks read and write; None when every chunk is a
    whole prompt that shares no block. A chunk's keys are its prompt's positions up to its end:
    those of a cached prefix from `block_pool`, the others of earlier chunks from `kv_cache`."""
    if step.independent:  # whole prompts, no cached prefix: a step's usual case, found once
        return None
    ends = starts + lengths
    totals = np.fromiter((c.prompt.num_tokens for c in step.chunks), np.int64, len(step.chunks))
    shares = any(
        c.blocks is not None and (c.blocks.prefix_tokens or c.blocks.write_slots)
        for c in step.chunks
    )
    prefix = np.fromiter(
        (c.blocks.prefix_tokens if c.blocks is not None else 0 for c in step.chunks),
        np.int64,
        len(step.chunks),
    )
    # Buffers hold what a prompt's earlier chunks computed (not its cached prefix), for chunks
    # that continue or follow one.
    chunked = (starts > prefix) | (ends < totals)
    if not chunked.any() and not shares:
        return None
    if shares and block_pool is None:
        raise EngineError("a step reads or writes prefix blocks, but the engine keeps none")
    if kv_cache is None:
        raise EngineError(
            "a step holds part of a prompt, but this model's attention is bidirectional: its "
            "prompts run whole"
        )
    cu_k = np.zeros(len(ends) + 1, dtype=np.int64)
    np.cumsum(ends, out=cu_k[1:])
    key_pos = np.arange(int(cu_k[-1])) - np.repeat(cu_k[:-1], ends)
    prefix_kv = None
    if shares:
        assert block_pool is not None
        prefix_kv = _prefix_kv(step, starts, lengths, cu, cu_k, prefix, block_pool, to_device)
        if share_prefixes and prefix.any():
            prefix_kv.shared = _shared_prefixes(
                step, starts, lengths, cu, prefix, block_pool.block_size, to_device
            )
    return ChunkedKV(
        buffers=[
            kv_cache.buffers(c.request_id, c.prompt.num_tokens) if is_chunked else None
            for c, is_chunked in zip(step.chunks, chunked.tolist(), strict=True)
        ],
        starts=starts.tolist(),
        keep=(ends < totals).tolist(),
        cu_seqlens_q=cu.tolist(),
        cu_seqlens_k=to_device(cu_k).to(torch.int32),
        max_seqlen_k=int(ends.max()),
        key_seq_ids=to_device(np.repeat(np.arange(len(ends)), ends)),
        key_pos=to_device(key_pos),
        prefix=prefix_kv,
    )


def _prefix_kv(
    step: StepInput,
    starts: np.ndarray,  # [num_seqs] int64
    lengths: np.ndarray,  # [num_seqs] int64
    cu: np.ndarray,  # [num_seqs + 1] int64: the chunks' rows in the batch
    cu_k: np.ndarray,  # [num_seqs + 1] int64: their keys' rows
    prefix: np.ndarray,  # [num_seqs] int64: positions read from the pool
    pool: BlockPool,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> PrefixKV:
    """The pool rows the step's chunks write (blocks they compute) and read (their cached
    prefixes), and where each row goes among the keys."""
    size = pool.block_size
    offsets = np.arange(size)
    empty = np.zeros(0, dtype=np.int64)
    read_slots, read_seq, write_slots, write_first = [empty], [empty], [empty], [empty]
    for i, c in enumerate(step.chunks):
        b = c.blocks
        if b is None:
            continue
        if b.prefix_slots:
            read_slots.append(np.asarray(b.prefix_slots, dtype=np.int64))
            read_seq.append(np.full(len(b.prefix_slots), i, dtype=np.int64))
        if b.write_slots:
            first = cu[i] + b.write_from - starts[i]  # batch row of the first block written
            write_slots.append(np.asarray(b.write_slots, dtype=np.int64))
            write_first.append(first + size * np.arange(len(b.write_slots)))
    r_slots, r_seq = np.concatenate(read_slots), np.concatenate(read_seq)
    w_slots, w_first = np.concatenate(write_slots), np.concatenate(write_first)
    # Block j of a sequence's prefix: its keys' rows from cu_k[i] + j * size.
    block_index = np.arange(len(r_seq)) - np.searchsorted(r_seq, r_seq)
    read_key_first = cu_k[:-1][r_seq] + size * block_index
    seq_of_row = np.repeat(np.arange(len(lengths)), lengths)
    own = cu_k[:-1][seq_of_row] + starts[seq_of_row] + np.arange(int(cu[-1])) - cu[:-1][seq_of_row]

    def rows(first: np.ndarray) -> np.ndarray:  # [n] first rows -> [n * size] every row
        return (first[:, None] + offsets[None, :]).reshape(-1)

    return PrefixKV(
        pool=pool,
        write_rows=to_device(rows(w_first)),
        write_pool_rows=to_device(rows(w_slots * size)),
        write_slots=to_device(w_slots),
        read_pool_rows=to_device(rows(r_slots * size)),
        read_key_rows=to_device(rows(read_key_first)),
        read_slots=to_device(r_slots),
        read_blocks=to_device(np.bincount(r_seq, minlength=len(lengths)).astype(np.int64)),
        own_key_rows=to_device(own),
        num_keys=int(cu_k[-1]),
        prefix_tokens=prefix.tolist(),
        key_starts=cu_k[:-1].tolist(),
    )


def _shared_prefixes(
    step: StepInput,
    starts: np.ndarray,  # [num_seqs] int64
    lengths: np.ndarray,  # [num_seqs] int64
    cu: np.ndarray,  # [num_seqs + 1] int64: the chunks' rows in the batch
    prefix: np.ndarray,  # [num_seqs] int64: positions read from the pool
    block_size: int,
    to_device: Callable[[np.ndarray], torch.Tensor],
) -> SharedPrefixes:
    """Group the sequences that read a cached prefix (consecutive ones reading the same blocks
    form one group), and lay out each sequence's keys after its prefix."""
    groups: list[list[int]] = []  # each group's sequences
    group_slots: list[tuple[int, ...]] = []  # the blocks it reads
    for i, c in enumerate(step.chunks):
        read = c.blocks.prefix_slots if c.blocks is not None else ()
        if not read:
            continue
        if groups and groups[-1][-1] == i - 1 and group_slots[-1] == read:
            groups[-1].append(i)
        else:
            groups.append([i])
            group_slots.append(read)
    members = np.fromiter(itertools.chain.from_iterable(groups), np.int64)
    member_lengths = lengths[members]
    member_cu = _cumsum0(member_lengths)
    q_rows = np.repeat(cu[:-1][members] - member_cu[:-1], member_lengths) + np.arange(
        int(member_cu[-1])
    )
    group_q = np.fromiter((lengths[g].sum() for g in groups), np.int64, len(groups))
    group_k = block_size * np.fromiter(map(len, group_slots), np.int64, len(groups))
    slots = np.fromiter(itertools.chain.from_iterable(group_slots), np.int64)
    own_lengths = starts + lengths - prefix
    own_cu = _cumsum0(own_lengths)
    own_key_rows = None
    if (starts > prefix).any():  # positions of earlier chunks come before a chunk's rows
        seq_of_row = np.repeat(np.arange(len(lengths)), lengths)
        own_key_rows = to_device(
            (own_cu[:-1] + starts - prefix - cu[:-1])[seq_of_row] + np.arange(int(cu[-1]))
        )
    return SharedPrefixes(
        q_rows=to_device(q_rows),
        cu_q=to_device(_cumsum0(group_q)).to(torch.int32),
        max_q=int(group_q.max()),
        pool_rows=to_device((slots[:, None] * block_size + np.arange(block_size)).reshape(-1)),
        cu_k=to_device(_cumsum0(group_k)).to(torch.int32),
        max_k=int(group_k.max()),
        own_cu_k=to_device(own_cu).to(torch.int32),
        own_max_k=int(own_lengths.max()),
        own_num_keys=int(own_cu[-1]),
        own_key_rows=own_key_rows,
        own_key_starts=own_cu[:-1].tolist(),
    )


def _cumsum0(counts: np.ndarray) -> np.ndarray:  # [n] -> [n + 1] int64, from 0
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out
