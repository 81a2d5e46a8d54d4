"""A vision-language model's image rows in a step, and the rows kept between a prompt's chunks.

A prompt with images may run in chunks, and a chunk boundary may split an image's run of
placeholder tokens. The image's rows are computed once, by the vision tower of the step whose
chunk reaches the span's first token (the scheduler charges the image's patches to that step);
when the span goes on past the chunk, all of its rows are kept here, by (request id, image),
for the chunks that follow, and dropped once the chunk that reaches the span's end has run, or
when the engine releases the request (finished, failed, cancelled). The model runner owns these
rows, as it owns the keys and values of chunked prompts (`vecpool.runner.kv_cache`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from vecpool.errors import EngineError
from vecpool.models.base import ImageBatch

ImageKey = tuple[str, int]  # (request id, the image's index among its prompt's images)


@dataclass
class StepImageRows:
    """The image rows of one step's vision-language prompts: built with the flat batch on the
    host, filled into the input embeddings by the model runner (`KeptImageRows.fill`)."""

    # The images whose tower runs in this step, image after image (`rows` empty: the rows
    # they fill are `fill_rows`, which a chunk may cover in part). None: none runs.
    images: ImageBatch | None = None
    fill_rows: torch.Tensor | None = None  # [num_filled] int64: batch rows the tower fills
    take: torch.Tensor | None = None  # [num_filled] int64: the tower's output row of each
    # Images whose span goes on past this step: (image, its first row of the tower's output,
    # its rows), kept for later chunks.
    keep: list[tuple[ImageKey, int, int]] = field(default_factory=list)
    # Kept rows this step reads, in order: (image, first row, end row) of the image's rows.
    reads: list[tuple[ImageKey, int, int]] = field(default_factory=list)
    read_rows: torch.Tensor | None = None  # [num_read] int64: the batch rows they fill
    done: list[ImageKey] = field(default_factory=list)  # kept rows no later chunk reads


class KeptImageRows:
    """Image rows kept between chunks, by image. Used from the engine's step thread only."""

    def __init__(self) -> None:
        self._rows: dict[ImageKey, torch.Tensor] = {}  # each [num_tokens, hidden]

    def fill(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the step's input embeddings
        step: StepImageRows,
        tower: Callable[[ImageBatch], torch.Tensor],  # images -> [their rows, hidden]
    ) -> None:
        """Write the step's image rows into `x`: the tower's output for the images it runs
        now (keeping those later chunks read), then the rows kept from earlier steps."""
        if step.images is not None:
            assert step.fill_rows is not None and step.take is not None
            rows = tower(step.images)
            for key, first, count in step.keep:
                self._rows[key] = rows[first : first + count].clone()
            x.index_copy_(0, step.fill_rows, rows[step.take].to(x.dtype))
        if step.reads:
            assert step.read_rows is not None
            parts = []
            for key, first, end in step.reads:
                kept = self._rows.get(key)
                if kept is None:
                    raise EngineError(
                        f"image {key[1]} of request {key[0]}: a chunk reads its rows, but no "
                        "earlier step kept them"
                    )
                parts.append(kept[first:end])
            x.index_copy_(0, step.read_rows, torch.cat(parts).to(x.dtype))

    def finish(self, step: StepImageRows) -> None:
        """Drop the rows that no chunk after `step` reads (once its forward has run)."""
        for key in step.done:
            self._rows.pop(key, None)

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop every kept row of these requests."""
        ids = set(request_ids)
        for key in [k for k in self._rows if k[0] in ids]:
            del self._rows[key]

    @property
    def num_entries(self) -> int:
        """Images whose rows are kept."""
        return len(self._rows)

    @property
    def num_bytes(self) -> int:
        """Device memory the kept rows take."""
        return sum(t.numel() * t.element_size() for t in self._rows.values())
