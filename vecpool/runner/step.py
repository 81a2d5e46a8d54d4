"""What one engine step runs: the contract between the engine and the runners.

The engine decides which requests run and how many of their tokens; the runners see only
plain data — each chunk's prompt, parameters and task declaration, never the engine's
`Request` — so that the runner layer does not reach back into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from vecpool.inputs.prompts import Prompt
from vecpool.tasks import PoolingParams, TaskSpec


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """The rows of the model runner's block pool (shared-prefix caching) that one scheduled
    chunk reads and writes, in blocks of `vecpool.engine.prefix_cache.BLOCK_SIZE` tokens."""

    prefix_tokens: int  # prompt positions [0, prefix_tokens) are read from the pool
    prefix_slots: tuple[int, ...]  # their blocks' slots, in order
    write_from: int  # prompt position of the first block the chunk writes
    write_slots: tuple[int, ...]  # the slots of the blocks it writes, in order


@dataclass(slots=True)  # not frozen: one is built per sequence per step, and frozen init is slow
class ScheduledChunk:
    """`num_tokens` tokens of one prompt, from position `start`, run in this step: the whole
    prompt, or one chunk of a longer one."""

    request_id: str  # the engine's id of the request, for state that outlives a step
    prompt: Prompt
    params: PoolingParams
    task: TaskSpec
    start: int  # first prompt position run in this step
    num_tokens: int
    blocks: ChunkBlocks | None = None  # shared-prefix caching: the pool rows it reads, writes

    @property
    def patches(self) -> int:
        """Patch rows the vision tower runs for this chunk: its images that begin in it."""
        return self.prompt.patches_in(self.start, self.start + self.num_tokens)

    @property
    def ends_prompt(self) -> bool:
        """Whether the chunk runs its prompt to the end (a whole prompt does)."""
        return self.start + self.num_tokens == self.prompt.num_tokens


@dataclass(frozen=True)
class StepInput:
    """Every chunk of one step, in batch order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_batched_patches(self) -> int:
        """Patch rows the step's vision tower runs (`Prompt.patches_in` of each chunk)."""
        return sum(c.patches for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @cached_property  # asked of every step twice, as the next step and as the current one
    def independent(self) -> bool:
        """Whether every chunk is a whole prompt that reads no cached prefix: nothing of the
        step depends on another step's pooling, nor leaves state for one."""
        return all(c.start == 0 and c.blocks is None and c.ends_prompt for c in self.chunks)
