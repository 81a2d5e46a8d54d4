"""Running prepared calls on an engine's core: requests from a call's `PromptRequest`s
(`submit`: prompt embeds rounded to the model dtype), run to their outputs (`run`, `pool`).
`Engine` (engine.py) adds the task methods."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from vecpool import calls
from vecpool.api import heap
from vecpool.api.build import EngineParts
from vecpool.api.outputs import PoolingOutput, PreparedCall, PromptRequest, T, outcome
from vecpool.engine.request import Request
from vecpool.inputs import Prompt, TextOptions
from vecpool.tasks import PoolingParams, get_task

# Calls with at least this many inputs show a progress bar unless told otherwise.
PROGRESS_THRESHOLD = 256


class EngineRunner(EngineParts):
    """An engine's parts, and running prepared calls on them (thread-safe)."""

    def run(self, call: PreparedCall[T], *, show_progress: bool | None = None, desc: str = "") -> T:
        """Run a prepared call to its result; raises the first failed input's error."""
        return call.finish(self._execute(self.submit(call.requests), desc, show_progress))

    def pool(
        self,
        inputs: Any,
        params: PoolingParams,
        options: TextOptions | None = None,
        *,
        show_progress: bool | None = None,
    ) -> list[PoolingOutput]:
        """Run `inputs` under `params`; a failure is reported per input, never raised.

        Invalid inputs (bad shape, unknown parameter, ...) still raise `InputError` before
        anything runs, since nothing of the call can be trusted then.
        """
        requests = self.make_requests(inputs, params, options)
        return self._execute(requests, params.task, show_progress)

    def make_requests(
        self, inputs: Any, params: PoolingParams, options: TextOptions | None = None
    ) -> list[Request]:
        """Validate and tokenize `inputs` into engine requests (not yet queued); `InputError`
        on the first bad input. Safe to call from any thread."""
        return self.submit(calls.make_requests(self.context, inputs, params, options))

    def submit(self, requests: Sequence[PromptRequest]) -> list[Request]:
        """Engine requests for prepared ones (not yet queued: `core.add_requests` does).
        Prompt embeds, checked by the input stage as float arrays, become CPU tensors in the
        model dtype here: the one place they are rounded to it."""
        tasks = {name: get_task(name) for name in {r.params.task for r in requests}}
        return [
            Request(
                request_id=self.core.next_request_id(),
                prompt=r.prompt
                if r.prompt.prompt_embeds is None
                else self._in_model_dtype(r.prompt),
                params=r.params,
                task=tasks[r.params.task],
                user_data=r.index,
            )
            for r in requests
        ]

    def _in_model_dtype(self, prompt: Prompt) -> Prompt:
        embeds = prompt.prompt_embeds
        tensor = embeds if isinstance(embeds, torch.Tensor) else torch.from_numpy(embeds)
        return replace(prompt, prompt_embeds=tensor.to(device="cpu", dtype=self.dtype).contiguous())

    def _execute(
        self, requests: list[Request], desc: str, show_progress: bool | None
    ) -> list[PoolingOutput]:
        self.core.add_requests(requests)
        show = show_progress if show_progress is not None else len(requests) >= PROGRESS_THRESHOLD
        with tqdm(total=len(requests), disable=not show, desc=desc, unit="input") as bar:
            self.core.run_until_done(requests, on_progress=bar.update)
        heap.freeze_if_compiled()  # what compiling made lives as long as the engine
        return [outcome(r) for r in requests]
