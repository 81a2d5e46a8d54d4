"""The pooling runner: turns a step's hidden states into finished per-request outputs.

It reads each request's task declaration where it is used: a request whose task needs token
ids but whose prompt came as embeddings fails here, alone, and the rest of the step goes on.
The step's requests are grouped by the head their task declares; each head runs once on its
group (see `vecpool.pooling.heads`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vecpool.errors import RequestFailedError
from vecpool.pooling.heads import HeadBatch, TaskHead
from vecpool.runner.batch import FlatBatch
from vecpool.runner.step import StepInput
from vecpool.tasks import Head


@dataclass(frozen=True)
class PooledResult:
    """The outcome of one scheduled sequence, in batch order."""

    output: np.ndarray | None  # [dim] or [num_selected_tokens, dim] float32
    error: RequestFailedError | None


class PoolingRunner:
    """Turns one step's hidden states into each sequence's finished output (or error), by
    the head its task declares; a request that cannot be served here fails alone."""

    def __init__(self, heads: dict[Head, TaskHead], device: torch.device):
        self.heads = heads  # by the head a task declares; only those the model has
        self.device = device

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor, batch: FlatBatch, step: StepInput) -> list[PooledResult]:
        chunks = step.chunks
        results: list[PooledResult | None] = [None] * len(chunks)
        groups: dict[Head, list[int]] = {}
        for i, (chunk, has_ids) in enumerate(zip(chunks, batch.has_token_ids, strict=True)):
            if not has_ids and chunk.task.needs_token_ids(chunk.params):
                results[i] = PooledResult(
                    None,
                    RequestFailedError(
                        f"{chunk.task.token_ids_reason(chunk.params)} (e.g. to match "
                        "step_tag_id, to leave out special tokens or to write a late-interaction "
                        "query or document), but the input came as prompt embeds",
                        field="prompt_embeds",
                    ),
                )
            else:  # its head exists: the api layer refuses a task the model has no head for
                groups.setdefault(chunk.task.head, []).append(i)
        for head, seqs in groups.items():
            head_batch = HeadBatch(
                hidden=hidden,
                meta=batch.pooling,
                seqs=torch.tensor(seqs, dtype=torch.int64).to(self.device, non_blocking=True),
                params=[chunks[i].params for i in seqs],
            )
            for i, output in zip(seqs, self.heads[head](head_batch), strict=True):
                results[i] = PooledResult(output, None)
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]
