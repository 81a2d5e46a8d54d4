"""Keys and values kept across steps: a chunked prompt's own buffers (`KVBuffers`, and
`ChunkedKV`, how a step's chunks meet them) and the block pool of shared-prefix caching.

Prompts that start with the same tokens share their leading blocks (which block is where is
the engine's `vecpool.engine.prefix_cache`). The pool holds, per layer, the keys and values
(rotary already applied) of `num_slots` blocks of `block_size` positions, and per block the
float32 sum of its final hidden states (what MEAN pooling needs of a prefix it did not run).
A step's `PrefixKV` says which rows its chunks write (blocks they compute) and read (the
cached prefix they start after); layer by layer the writes come first, so a chunk may read a
block that another chunk of the same step computes.

Sequences that read the same cached prefix need not each copy it among their keys: with
`SharedPrefixes`, each sequence attends to the positions after its prefix, the sequences of a
group attend together to their one prefix read from the pool, and the two halves are merged by
their softmax normalizers (log-sum-exp) — attention split over two sets of keys, as
FlashAttention splits it over key blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


class BlockPool:
    """Per layer, one `[num_slots * block_size, num_kv_heads, head_dim]` buffer of keys and
    one of values, allocated at the layer's first write (dtype and device of its keys); and
    `[num_slots, hidden]` float32 hidden-state sums. Owned by the model runner."""

    def __init__(self, num_slots: int, block_size: int):
        self.num_slots = num_slots
        self.block_size = block_size
        self.keys: list[torch.Tensor] = []  # per layer [num_slots * block_size, kv_heads, dim]
        self.values: list[torch.Tensor] = []  # per layer, as `keys`
        self.sums: torch.Tensor | None = None  # [num_slots, hidden] float32

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of layer `index` (allocated shaped as `like`'s rows)."""
        while len(self.keys) <= index:
            shape = (self.num_slots * self.block_size, *like.shape[1:])
            self.keys.append(like.new_empty(shape))
            self.values.append(like.new_empty(shape))
        return self.keys[index], self.values[index]

    def hidden_sums(
        self, hidden: torch.Tensor, prefix: PrefixKV
    ) -> torch.Tensor:  # [num_seqs, hidden] float32
        """Record the hidden-state sums of the blocks this step wrote, and return each
        sequence's cached prefix sum (zero where it has none), its blocks added in order."""
        if self.sums is None:
            self.sums = hidden.new_zeros((self.num_slots, hidden.shape[1]), dtype=torch.float32)
        if prefix.write_slots.numel():
            rows = hidden.index_select(0, prefix.write_rows).float()
            block_sums = rows.view(-1, self.block_size, hidden.shape[1]).sum(1)
            self.sums.index_copy_(0, prefix.write_slots, block_sums)
        if not prefix.read_slots.numel():  # only writers (a shape: no device sync to read)
            return self.sums.new_zeros((prefix.read_blocks.shape[0], hidden.shape[1]))
        per_block = self.sums.index_select(0, prefix.read_slots)  # [num_read_blocks, hidden]
        # `unsafe`: the lengths are the runner's own (they add up, none negative); checking
        # them would read them back from the device, a sync in the middle of the step.
        return torch.segment_reduce(
            per_block, "sum", lengths=prefix.read_blocks, axis=0, initial=0.0, unsafe=True
        )

    @property
    def num_bytes(self) -> int:
        tensors = (*self.keys, *self.values, *(() if self.sums is None else (self.sums,)))
        return sum(t.numel() * t.element_size() for t in tensors)


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """Contiguous `[n, ...]` rows seen as `[n, bytes / 8]` int64 where their bytes allow: a
    copy by row index moves 8 bytes per element instead of 2 (bf16), 4x fewer of them for the
    copying kernel, which is paced by its elements (the same bits land)."""
    flat = rows.view(rows.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 8:
        return flat
    return flat.view(torch.int64)


@dataclass
class SharedPrefixes:
    """One step's sequences that read a cached prefix, in groups reading the same blocks (runs
    of consecutive sequences: a rerank call's documents), and the keys each sequence attends to
    after its prefix. Built by the model runner with the step's batch, for the varlen kernel."""

    q_rows: torch.Tensor  # [num_group_rows] int64: batch rows of the groups' sequences
    cu_q: torch.Tensor  # [num_groups + 1] int32: each group's rows among `q_rows`
    max_q: int
    pool_rows: torch.Tensor  # [num_group_keys] int64: pool rows of each group's prefix
    cu_k: torch.Tensor  # [num_groups + 1] int32: each group's prefix among `pool_rows`
    max_k: int
    # The keys after the prefixes: a sequence's earlier chunks' positions past its cached
    # prefix, then its own rows.
    own_cu_k: torch.Tensor  # [num_seqs + 1] int32
    own_max_k: int
    own_num_keys: int
    own_key_rows: torch.Tensor | None  # [num_tokens] int64; None: the batch rows themselves
    own_key_starts: list[int]  # [num_seqs]: each sequence's first row among them (host)


@dataclass
class PrefixKV:
    """One step's rows of the block pool: built by the model runner with the step's batch."""

    pool: BlockPool
    write_rows: torch.Tensor  # [num_written] int64: batch rows whose keys go to the pool
    write_pool_rows: torch.Tensor  # [num_written] int64: the pool rows they go to
    write_slots: torch.Tensor  # [num_written // block_size] int64: the blocks written
    read_pool_rows: torch.Tensor  # [num_read] int64: pool rows of the cached prefixes
    read_key_rows: torch.Tensor  # [num_read] int64: where they go among the keys
    read_slots: torch.Tensor  # [num_read // block_size] int64: the blocks read, by sequence
    read_blocks: torch.Tensor  # [num_seqs] int64: blocks each sequence reads
    own_key_rows: torch.Tensor  # [num_tokens] int64: where each batch row goes among the keys
    num_keys: int
    prefix_tokens: list[int]  # [num_seqs]: positions each sequence reads from the pool
    key_starts: list[int]  # [num_seqs]: each sequence's first row among the keys (host)
    # Set where the step's attention may read shared prefixes from the pool (`extend_shared`).
    shared: SharedPrefixes | None = None
    # A CUDA graph's padded step: only `extend_shared` can read it (its other rows are empty).
    shared_only: bool = False

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: ChunkedKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ChunkedKV.extend` with a block pool: write this layer's computed blocks, then
        lay out every sequence's keys (and values) as its cached prefix, the positions its
        earlier chunks left in its buffers, then its own rows."""
        pool_k, pool_v = self._write(layer, k, v)
        keys = k.new_empty((self.num_keys, *k.shape[1:]))
        values = v.new_empty((self.num_keys, *v.shape[1:]))
        keys.index_copy_(0, self.own_key_rows, k)
        values.index_copy_(0, self.own_key_rows, v)
        if self.read_pool_rows.numel():
            keys.index_copy_(0, self.read_key_rows, pool_k.index_select(0, self.read_pool_rows))
            values.index_copy_(0, self.read_key_rows, pool_v.index_select(0, self.read_pool_rows))
        self._earlier_chunks(layer, k, v, kv, keys, values, self.key_starts, 0)
        return keys, values

    def extend_shared(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: ChunkedKV
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this layer's computed blocks; return the keys and values after the cached
        prefixes (laid out as `shared.own_cu_k` says) and those of the groups' prefixes (as
        `shared.cu_k` says): each prefix is read once per group, not once per sequence."""
        shared = self.shared
        assert shared is not None
        pool_k, pool_v = self._write(layer, k, v)
        prefix_k = pool_k.index_select(0, shared.pool_rows)
        prefix_v = pool_v.index_select(0, shared.pool_rows)
        if shared.own_key_rows is None:  # whole prompts: their keys are their rows
            self._earlier_chunks(layer, k, v, kv, None, None, shared.own_key_starts, 1)
            return k, v, prefix_k, prefix_v
        keys = k.new_empty((shared.own_num_keys, *k.shape[1:]))
        values = v.new_empty((shared.own_num_keys, *v.shape[1:]))
        keys.index_copy_(0, shared.own_key_rows, k)
        values.index_copy_(0, shared.own_key_rows, v)
        self._earlier_chunks(layer, k, v, kv, keys, values, shared.own_key_starts, 1)
        return keys, values, prefix_k, prefix_v

    def _write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's buffers of `layer`, with the blocks this step computes written."""
        pool_k, pool_v = self.pool.layer(layer, k)
        if self.write_rows.numel():
            for pool, new in ((pool_k, k), (pool_v, v)):
                rows = new.index_select(0, self.write_rows)
                _as_words(pool).index_copy_(0, self.write_pool_rows, _as_words(rows))
        return pool_k, pool_v

    def _earlier_chunks(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: ChunkedKV,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        key_starts: list[int],
        past_prefix: int,  # 1: the keys start after the cached prefix; 0: at position 0
    ) -> None:
        """Keep the rows of chunks that continue in their prompts' buffers, and copy the
        positions earlier chunks left there (after the cached prefix) among the keys."""
        for i, cached_k, cached_v in kv.buffered(layer, k, v):
            start, first = kv.starts[i], self.prefix_tokens[i]
            at = key_starts[i] - past_prefix * first  # the key row of prompt position 0
            if start > first and keys is not None and values is not None:
                keys[at + first : at + start] = cached_k[first:start]
                values[at + first : at + start] = cached_v[first:start]


class KVBuffers:
    """The keys and values a prompt that runs in chunks keeps for its later chunks: per layer,
    one `[capacity, num_kv_heads, head_dim]` buffer of each (rotary already applied), written
    at the prompt's positions. A layer's buffers are allocated at its first write, in the
    dtype and on the device of its keys; the model runner owns them and frees them when the
    request is done."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # prompt positions the buffers hold
        self.keys: list[torch.Tensor] = []  # per layer [capacity, num_kv_heads, head_dim]
        self.values: list[torch.Tensor] = []  # per layer, as `keys`

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of layer `index` (allocated shaped as `like`'s rows)."""
        while len(self.keys) <= index:
            shape = (self.capacity, *like.shape[1:])
            self.keys.append(like.new_empty(shape))
            self.values.append(like.new_empty(shape))
        return self.keys[index], self.values[index]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def free(self) -> None:
        self.keys.clear()
        self.values.clear()


@dataclass
class ChunkedKV:
    """How one step's chunks meet the keys and values of their prompts' earlier chunks.

    A chunk that starts at prompt position `s` attends to its own rows and to the `s` cached
    positions before them; its queries are the last rows of a longer key sequence, so causal
    masks and sliding windows align to the end (FlashAttention's convention when a sequence has
    fewer queries than keys). Layers call `extend` in order; each call reads and writes the
    next layer's buffers. Built by the model runner for a step with chunked prompts.
    """

    buffers: list[KVBuffers | None]  # [num_seqs]: the prompt's buffers when it runs in chunks
    starts: list[int]  # [num_seqs]: prompt positions before the chunk, all cached
    keep: list[bool]  # [num_seqs]: the chunk's keys and values are kept for a later chunk
    cu_seqlens_q: list[int]  # [num_seqs + 1]: the chunks' boundaries in the flat batch (host)
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: boundaries of each sequence's keys
    max_seqlen_k: int  # longest key sequence (cached positions and the chunk's own)
    key_seq_ids: torch.Tensor  # [num_keys] int64: the sequence of each key row
    key_pos: torch.Tensor  # [num_keys] int64: each key row's prompt position
    # Shared-prefix caching: the block pool rows the chunks read and write; None: not in use.
    prefix: PrefixKV | None = None
    _layer: int = field(default=0, repr=False)  # the layer `extend` serves next

    def rewind(self) -> None:
        """Start again from the first layer (a forward pass over the step begins)."""
        self._layer = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this layer's keys and values of chunks that continue, and return the keys and
        values every chunk attends to: `[num_keys, num_kv_heads, head_dim]` each, a sequence's
        cached positions before its own rows, in batch order."""
        layer = self._layer
        self._layer += 1
        if self.prefix is not None:
            return self.prefix.extend(layer, k, v, self)
        k_parts: list[torch.Tensor] = []
        v_parts: list[torch.Tensor] = []
        copied = 0  # rows of `k` / `v` already in the parts
        for i, cached_k, cached_v in self.buffered(layer, k, v):
            start, lo = self.starts[i], self.cu_seqlens_q[i]
            if start:
                k_parts += [k[copied:lo], cached_k[:start]]
                v_parts += [v[copied:lo], cached_v[:start]]
                copied = lo
        if not k_parts:  # no chunk has cached positions: the keys are the rows themselves
            return k, v
        k_parts.append(k[copied:])
        v_parts.append(v[copied:])
        return torch.cat(k_parts), torch.cat(v_parts)

    def buffered(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each chunk with buffers: its index and its layer's key and value buffers, after the
        chunk's own rows are kept there for a later chunk (when it continues)."""
        cu = self.cu_seqlens_q
        for i, buffers in enumerate(self.buffers):
            if buffers is None:
                continue
            start, lo, hi = self.starts[i], cu[i], cu[i + 1]
            cached_k, cached_v = buffers.layer(layer, k)
            if self.keep[i]:
                cached_k[start : start + hi - lo] = k[lo:hi]
                cached_v[start : start + hi - lo] = v[lo:hi]
            yield i, cached_k, cached_v

    def extend_shared(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`extend` for attention split at the cached prefixes (`SharedPrefixes`): the keys and
        values after each sequence's prefix, and those of each group's prefix."""
        layer = self._layer
        self._layer += 1
        assert self.prefix is not None
        return self.prefix.extend_shared(layer, k, v, self)
