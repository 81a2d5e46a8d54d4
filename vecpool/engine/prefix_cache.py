"""Shared-prefix caching: which leading blocks of a prompt were computed before.

A causal model's keys and values at a position depend only on the tokens up to it, so prompts
that start with the same tokens (an LLM reranker's template and query across the documents of
one call, an embedder's instruction across queries) can share them. The prompt is cut into
blocks of `BLOCK_SIZE` tokens; a block is known by its parent block and its own token ids, so
a block stands for the whole prefix up to its end. The keys, values and per-block hidden-state
sums live in the model runner's block pool, in the slot this table gives each block.

This table is plain CPU Python, driven by the scheduler: `admit` gives a waiting request the
leading blocks already there (they count as computed), `produce` registers the blocks a
scheduled chunk computes (written by that step's forward). Blocks a running request holds are
never evicted; the others go least recently used first.

A request whose prefix is being computed in the step being scheduled either joins that step
(`read_pending`: layer by layer the pool is written before it is read, so it reads blocks the
same forward computes) or waits for the next one. Joining saves a step where attention takes
each sequence at its own length (the varlen kernel); the exact padded fallback pads every
sequence of a step to the longest, so there short readers of a long prefix's blocks are
cheaper one step later, in a step of short sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from vecpool.engine.request import Request
from vecpool.errors import ConfigError
from vecpool.runner.step import ChunkBlocks
from vecpool.tasks import Head

# Tokens per block: small enough that little of a shared prefix is lost to its last partial
# block (at most 15 tokens), large enough that a 400-token prefix is 25 table entries.
BLOCK_SIZE = 16


@dataclass(eq=False, slots=True)
class _Block:
    """One cached block: its slot in the runner's pool and what identifies it."""

    serial: int  # never reused: children name their parent by it
    slot: int  # its rows in the pool: `slot * BLOCK_SIZE` onwards
    key: tuple[int, bytes]  # (parent's serial, 0 for the first; the block's int64 ids' bytes)
    holders: int = 0  # running requests that read or write it


@dataclass(slots=True)
class _Chain:
    """A request's blocks so far, from its first; `cached` of them came from the cache."""

    blocks: list[_Block] = field(default_factory=list)
    cached: int = 0
    broken: bool = False  # a block could not be registered: the request produces no more


_NONE = ChunkBlocks(0, (), 0, ())
_BLOCK_BYTES = 8 * BLOCK_SIZE  # a block's ids as int64 bytes: the table's keys compare these


def _id_bytes(request: Request) -> bytes:
    """The prompt's ids as int64 bytes (slicing bytes is far cheaper than making tuples)."""
    ids = request.prompt.token_ids
    assert ids is not None
    return ids.astype(np.int64, copy=False).tobytes()


class PrefixCache:
    """A bounded table of prompt blocks, least recently used evicted (see the module).

    `heads`: the heads that can start from a cached prefix (those whose pooling needs no row
    of the prefix, only its sum or nothing). Counters: `queried_tokens` (prompt tokens of the
    requests that looked the cache up), `hit_tokens` (of those, the tokens it served)."""

    def __init__(self, num_tokens: int, heads: frozenset[Head], *, read_pending: bool = True):
        self.num_slots = num_tokens // BLOCK_SIZE
        if self.num_slots < 1:
            raise ConfigError(
                f"prefix_cache_tokens={num_tokens} holds no block of {BLOCK_SIZE} tokens"
            )
        self.heads = heads
        self.read_pending = read_pending
        self._pending: set[int] = set()  # serials of the blocks the step being scheduled makes
        self._table: dict[tuple[int, bytes], _Block] = {}
        self._free: OrderedDict[int, _Block] = OrderedDict()  # unheld blocks, oldest first
        self._unused = list(range(self.num_slots - 1, -1, -1))  # slots never given out
        self._serials = 0
        self._chains: dict[str, tuple[Request, _Chain]] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        """Blocks in the table."""
        return len(self._table)

    def may_share(self, request: Request) -> bool:
        """Whether `request` takes part: its prompt came as token ids (a prompt given as
        embeds has no ids to be known by) with no images (whose placeholder ids say nothing
        of the picture), attends to all of them, and its head needs no row of the prefix."""
        prompt = request.prompt
        return (
            prompt.token_ids is not None
            and not prompt.images
            and prompt.num_attended is None
            and request.task.head in self.heads
        )

    def begin_step(self) -> None:
        """A step is being scheduled: let go of the blocks of requests that are done (they may
        be evicted from now on); blocks registered before are computed by then."""
        self._pending.clear()
        self.release_done()

    def admit(self, request: Request) -> bool:
        """At a request's first scheduling: its leading blocks found in the table count as
        computed (at least its last token is left to compute: it pools). Once per request.
        False: some of them are computed by the step being scheduled and `read_pending` is
        off; the request waits for the next step (nothing is recorded)."""
        if request.request_id in self._chains or request.num_scheduled_tokens > 0:
            return True
        chain = _Chain()
        if not self.may_share(request):
            chain.broken = True
            self._chains[request.request_id] = (request, chain)
            return True
        ids = _id_bytes(request)
        n = request.num_prompt_tokens
        parent = 0
        for j in range((n - 1) // BLOCK_SIZE):
            key = (parent, ids[j * _BLOCK_BYTES : (j + 1) * _BLOCK_BYTES])
            block = self._table.get(key)  # a dict compares the ids themselves, not a hash
            if block is None:
                break
            if not self.read_pending and block.serial in self._pending:
                return False
            chain.blocks.append(block)
            parent = block.serial
        for block in chain.blocks:
            self._hold(block)
        self._chains[request.request_id] = (request, chain)
        self.queried_tokens += n
        chain.cached = len(chain.blocks)
        cached_tokens = chain.cached * BLOCK_SIZE
        self.hit_tokens += cached_tokens
        request.num_scheduled_tokens = request.num_computed_tokens = cached_tokens
        return True

    def produce(self, request: Request, start: int, end: int) -> ChunkBlocks:
        """The pool rows the chunk `[start, end)` of `request` reads and writes: the cached
        blocks it started from, and the blocks lying whole inside the chunk that it registers
        now (computed by this step)."""
        entry = self._chains.get(request.request_id)
        if entry is None:
            return _NONE
        chain = entry[1]
        prefix_slots = tuple(b.slot for b in chain.blocks[: chain.cached])
        write_from = len(chain.blocks) * BLOCK_SIZE
        writes: list[int] = []
        if not chain.broken and write_from >= start:
            ids = _id_bytes(request)
            parent = chain.blocks[-1].serial if chain.blocks else 0
            for j in range(write_from // BLOCK_SIZE, end // BLOCK_SIZE):
                key = (parent, ids[j * _BLOCK_BYTES : (j + 1) * _BLOCK_BYTES])
                if key in self._table:  # another request computes or computed it: ours goes
                    chain.broken = True  # uncached (a block has one slot)
                    break
                block = self._new_block(key)
                if block is None:  # every slot is held by running requests
                    chain.broken = True
                    break
                chain.blocks.append(block)
                writes.append(block.slot)
                parent = block.serial
        elif write_from < start:  # a chunk ended inside a block: the rest stays uncached
            chain.broken = True
        return ChunkBlocks(chain.cached * BLOCK_SIZE, prefix_slots, write_from, tuple(writes))

    def release_done(self) -> None:
        """Let go of the blocks of requests that are done: they may be evicted from now on."""
        done = [rid for rid, (request, _) in self._chains.items() if request.is_done]
        for rid in done:
            _, chain = self._chains.pop(rid)
            for block in chain.blocks:
                block.holders -= 1
                if block.holders > 0:
                    continue
                if self._table.get(block.key) is block:
                    self._free[block.serial] = block
                else:  # forgotten: its slot is free at once
                    self._unused.append(block.slot)

    def forget(self, request_ids: list[str]) -> None:
        """Drop from the table the blocks these requests registered but whose step failed:
        their rows in the pool are not to be trusted. (Holders keep their slots until done.)"""
        for rid in request_ids:
            entry = self._chains.get(rid)
            if entry is None:
                continue
            for block in entry[1].blocks[entry[1].cached :]:
                if self._table.get(block.key) is block:
                    del self._table[block.key]
            entry[1].broken = True

    def _hold(self, block: _Block) -> None:
        block.holders += 1
        self._free.pop(block.serial, None)

    def _new_block(self, key: tuple[int, bytes]) -> _Block | None:
        """A block for `key` in a never-used slot, else the least recently used free one's."""
        if self._unused:
            slot = self._unused.pop()
        elif self._free:
            _, old = self._free.popitem(last=False)
            del self._table[old.key]
            slot = old.slot
        else:
            return None
        self._serials += 1
        block = _Block(self._serials, slot, key)
        self._table[key] = block
        self._pending.add(block.serial)
        self._hold(block)
        return block
