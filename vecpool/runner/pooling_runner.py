"""The pooling runner: turns a step's hidden states into finished per-request outputs.

It reads each request's task declaration where it is used: a request whose task needs token
ids but whose prompt came as embeddings fails here, alone, and the rest of the step goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vecpool.engine.scheduler import SchedulerOutput
from vecpool.errors import RequestFailedError
from vecpool.pooling.heads import DenseStack, truncate_and_normalize
from vecpool.pooling.poolers import pool_sequences, select_tokens
from vecpool.runner.batch import FlatBatch


@dataclass(frozen=True)
class PoolingDefaults:
    """What a request gets when its parameters say nothing."""

    pooler: str  # sequence pooler of the embed task: "CLS" | "MEAN" | "LAST" | "MAX"
    normalize: bool
    output_dim: int  # after the Dense projections


@dataclass(frozen=True)
class PooledResult:
    """The outcome of one scheduled sequence, in batch order."""

    output: np.ndarray | None  # [dim] or [num_selected_tokens, dim] float32
    error: RequestFailedError | None


class PoolingRunner:
    def __init__(self, defaults: PoolingDefaults, dense: DenseStack, device: torch.device):
        self.defaults = defaults
        self.dense = dense.to(device)
        self.device = device

    @torch.inference_mode()
    def pool(
        self, hidden: torch.Tensor, batch: FlatBatch, sched: SchedulerOutput
    ) -> list[PooledResult]:
        requests = [c.request for c in sched.chunks]
        num_seqs = len(requests)
        errors: list[RequestFailedError | None] = [None] * num_seqs
        for i, (req, has_ids) in enumerate(zip(requests, batch.has_token_ids, strict=True)):
            if not has_ids and req.task.needs_token_ids(req.params):
                errors[i] = RequestFailedError(
                    f"task {req.task.name!r} with these parameters needs token ids "
                    "(e.g. to match step_tag_id), but the input came as prompt embeds",
                    field="prompt_embeds",
                )
        ok = [e is None for e in errors]
        per_token = [r.task.per_token and k for r, k in zip(requests, ok, strict=True)]
        per_seq = [not r.task.per_token and k for r, k in zip(requests, ok, strict=True)]
        d = self.defaults
        dims_list = [r.params.dimensions or d.output_dim for r in requests]
        dims = self._tensor(dims_list, torch.int64)
        normalize = self._tensor(
            [d.normalize if r.params.normalize is None else r.params.normalize for r in requests],
            torch.bool,
        )

        seq_out: np.ndarray | None = None
        if any(per_seq):
            pooled = self.dense(pool_sequences(d.pooler, hidden, batch.pooling))  # [num_seqs, dim]
            seq_out = truncate_and_normalize(pooled, dims, normalize).cpu().numpy()

        token_out: list[np.ndarray] = []
        if any(per_token):
            tags = [
                r.params.step_tag_id if r.params.step_tag_id is not None else -1 for r in requests
            ]
            selected = select_tokens(
                batch.pooling, self._tensor(per_token, torch.bool), self._tensor(tags, torch.int64)
            )  # [num_tokens] bool
            rows = hidden[selected].float()  # [num_selected, hidden]
            row_seq = batch.pooling.seq_ids[selected]
            rows = truncate_and_normalize(rows, dims[row_seq], normalize[row_seq])
            counts = torch.bincount(row_seq, minlength=num_seqs)
            token_out = [t.numpy() for t in torch.split(rows.cpu(), counts.cpu().tolist())]

        results = []
        for i in range(num_seqs):
            if errors[i] is not None:
                results.append(PooledResult(None, errors[i]))
            elif per_token[i]:
                results.append(PooledResult(token_out[i][:, : dims_list[i]], None))
            else:
                assert seq_out is not None
                results.append(PooledResult(seq_out[i, : dims_list[i]], None))
        return results

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)
