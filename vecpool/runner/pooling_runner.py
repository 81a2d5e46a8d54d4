"""The pooling runner: turns a step's hidden states into finished per-request outputs.

It reads each request's task declaration where it is used: a request whose task needs token
ids but whose prompt came as embeddings fails here, alone, and the rest of the step goes on.
The step's requests are grouped by the head their task declares; each head runs once on its
group (see `vecpool.pooling.heads`).

A prompt that runs in chunks over several steps keeps its pooling state here, from its first
chunk to its last: a sequence head's accumulators (`vecpool.pooling.carry`), or a per-token
head's rows so far. A step's updates are committed only once the whole step has pooled.

On CUDA a step can be pooled after the next step's forward was queued (`EngineCore` does so
for steps of whole prompts): `forward_done` marks the end of a step's forward on the device,
and `pool(..., after=event)` then runs on a stream of its own that waits for that mark only,
so that the host's pooling of one step overlaps the device's forward of the next.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from vecpool.errors import EngineError, RequestFailedError
from vecpool.pooling.carry import Carry
from vecpool.pooling.heads import HeadBatch, TaskHead
from vecpool.runner.batch import FlatBatch
from vecpool.runner.step import ScheduledChunk, StepInput
from vecpool.tasks import Head


class PooledResult(NamedTuple):
    """The outcome of one scheduled sequence, in batch order (a tuple: one is made per
    sequence per step)."""

    output: np.ndarray | None  # [dim] or [num_selected_tokens, dim] float32
    error: RequestFailedError | None
    done: bool = True  # False: the prompt continues in a later step (no output yet)


@dataclass
class PromptState:
    """What the earlier chunks of one prompt left for its later ones."""

    carried: dict[str, torch.Tensor] = field(default_factory=dict)  # a sequence head's
    rows: list[np.ndarray] = field(default_factory=list)  # a per-token head's outputs so far


class PoolingRunner:
    """Turns one step's hidden states into each sequence's finished output (or error), by
    the head its task declares; a request that cannot be served here fails alone."""

    def __init__(self, heads: dict[Head, TaskHead], device: torch.device):
        self.heads = heads  # by the head a task declares; only those the model has
        self.device = device
        # Prompts running in chunks, by request id: from their first chunk to their release.
        self._states: dict[str, PromptState] = {}
        self._aranges: dict[int, torch.Tensor] = {}  # `_every`'s, by size
        # Pooling behind the next step's forward (`pool(..., after=...)`); None off CUDA. Of
        # high priority: its few small kernels take the SMs before the forward's next ones.
        self._stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    @property
    def num_states(self) -> int:
        """Prompts whose pooling state is kept between steps."""
        return len(self._states)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget the state of requests that are done."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def forward_done(self) -> torch.cuda.Event | None:
        """A mark, on the device's current stream, of the forward queued so far (None off
        CUDA, where a forward is done when it returns)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def pool(
        self,
        hidden: torch.Tensor,
        batch: FlatBatch,
        step: StepInput,
        *,
        after: torch.cuda.Event | None = None,  # `forward_done` of the step's forward
    ) -> list[PooledResult]:
        """Each sequence's result, in batch order. With `after`, the pooling's kernels wait
        for that mark only, on the runner's own stream: forwards queued since run meanwhile."""
        if after is None or self._stream is None:
            return self._pool(hidden, batch, step)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(after)
            try:
                return self._pool(hidden, batch, step)
            finally:
                # The step's tensors were made on the forward's stream, which may hand their
                # memory out again once they are dropped: nothing here may still read them.
                self._stream.synchronize()

    @torch.inference_mode()
    def _pool(self, hidden: torch.Tensor, batch: FlatBatch, step: StepInput) -> list[PooledResult]:
        chunks = step.chunks
        results: list[PooledResult | None] = [None] * len(chunks)
        earlier: list[PromptState | None] = [None] * len(chunks)
        groups: dict[Head, list[int]] = {}
        continuing = False  # some chunk continues a prompt: states to read and commit
        for i, (chunk, has_ids) in enumerate(zip(chunks, batch.has_token_ids, strict=True)):
            if chunk.start > 0:
                continuing = True
                earlier[i] = self._states.get(chunk.request_id) or self._from_prefix(
                    i, chunk, batch
                )
                if earlier[i] is None:
                    raise EngineError(
                        f"request {chunk.request_id} continues at position {chunk.start} "
                        "without the pooling state of its earlier chunks"
                    )
            head_needs_ids = self.heads[chunk.task.head].needs_token_ids
            if chunk.prompt.image is not None and chunk.task.head is not Head.EMBEDDING:
                results[i] = PooledResult(
                    None,
                    RequestFailedError(
                        f"the {chunk.task.name!r} task does not take images: an image has one "
                        "vector, in the model's shared space (the 'embed' task)",
                        field="image",
                    ),
                )
            elif not has_ids and (head_needs_ids or chunk.task.needs_token_ids(chunk.params)):
                reason = (
                    f"this model's {chunk.task.name!r} head reads its weights at the token ids"
                    if head_needs_ids
                    else f"{chunk.task.token_ids_reason(chunk.params)} (e.g. to match "
                    "step_tag_id, to leave out special tokens or to write a late-interaction "
                    "query or document)"
                )
                form = "an image" if chunk.prompt.image is not None else "prompt embeds"
                results[i] = PooledResult(
                    None,
                    RequestFailedError(
                        f"{reason}, but the input came as {form}",
                        field="image" if chunk.prompt.image is not None else "prompt_embeds",
                    ),
                )
            else:  # its head exists: the api layer refuses a task the model has no head for
                groups.setdefault(chunk.task.head, []).append(i)
        updates: dict[int, PromptState] = {}  # by batch position: prompts that continue
        for head, seqs in groups.items():
            task_head = self.heads[head]
            final = [chunks[i].ends_prompt for i in seqs]
            carry = None
            if not all(final) or any(earlier[i] is not None for i in seqs):
                carry = Carry([_carried(earlier[i]) for i in seqs], final)
            # Positions in increasing order: as many as the step's sequences are all of them.
            every = len(seqs) == len(chunks)
            head_batch = HeadBatch(
                hidden=hidden,
                meta=batch.pooling,
                seqs=self._every(len(seqs))
                if every
                else torch.tensor(seqs, dtype=torch.int64).to(self.device, non_blocking=True),
                params=[chunks[i].params for i in seqs],
                carry=carry,
                every=every,
            )
            outputs = task_head(head_batch)
            if carry is None:  # whole prompts, nothing carried: each output is the answer
                for i, output in zip(seqs, outputs, strict=True):
                    results[i] = PooledResult(output, None)
                continue
            for j, (i, output) in enumerate(zip(seqs, outputs, strict=True)):
                state = earlier[i]
                if task_head.per_token and (state is not None or not final[j]):
                    assert output is not None
                    rows = [*(state.rows if state is not None else []), output]
                    if final[j]:
                        output = np.concatenate(rows)
                    else:
                        updates[i] = PromptState(rows=rows)
                elif not final[j]:
                    assert carry is not None
                    updates[i] = PromptState(carried=carry.updates[j])
                results[i] = PooledResult(output if final[j] else None, None, done=final[j])
        for i, chunk in enumerate(chunks if continuing or updates else ()):  # pooled: commit
            if i in updates:
                self._states[chunk.request_id] = updates[i]
            elif chunk.start > 0:
                self._states.pop(chunk.request_id, None)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _every(self, num_seqs: int) -> torch.Tensor:
        """`[num_seqs]` int64 on the device: 0 .. num_seqs - 1, made once per size (a step's
        usual head serves all its sequences)."""
        seqs = self._aranges.get(num_seqs)
        if seqs is None:
            seqs = torch.arange(num_seqs, device=self.device)
            if self._stream is not None:  # kept for any stream's later steps: made by now
                torch.cuda.current_stream(self.device).synchronize()
            self._aranges[num_seqs] = seqs
        return seqs

    def _from_prefix(self, i: int, chunk: ScheduledChunk, batch: FlatBatch) -> PromptState | None:
        """The state a prompt starts from after its cached prefix (shared-prefix caching): the
        prefix's hidden-state sum under the names its head carries sums by. None: the chunk
        does not start right after a cached prefix."""
        blocks = chunk.blocks
        if blocks is None or blocks.prefix_tokens != chunk.start or batch.prefix_sums is None:
            return None
        names = self.heads[chunk.task.head].prefix_carry
        if names is None:
            raise EngineError(
                f"request {chunk.request_id} starts after a cached prefix, but its "
                f"{chunk.task.head.value!r} head needs the prefix's rows"
            )
        return PromptState(carried={name: batch.prefix_sums[i] for name in names})


def _carried(state: PromptState | None) -> dict[str, torch.Tensor] | None:
    return None if state is None else state.carried
