"""An image as it travels from the input stage to the engine: patch rows, like token ids.

The model-free side (`vecpool.inputs.media`, `vecpool.inputs.image_processing`) decodes an image
and preprocesses it as the checkpoint's Hugging Face image processor does, then cuts it into the
patch rows the model's patch embedding reads. The engine sees only these arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ImagePixels:
    """One preprocessed image: its patches, one row each, in the order the model reads them."""

    # [num_patches, patch_dim] float32; patch_dim = channels * patch_size**2, each row laid
    # out as the model's patch embedding reads it (see the processor that made it)
    patches: np.ndarray
    grid: tuple[int, int]  # (rows, columns) of patches; rows * columns == num_patches
    num_patches: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows, cols = self.grid
        if self.patches.ndim != 2 or self.patches.shape[0] != rows * cols:
            raise ValueError(
                f"patches of shape {tuple(self.patches.shape)} do not fill a {rows}x{cols} grid"
            )
        object.__setattr__(self, "num_patches", int(self.patches.shape[0]))


@dataclass(frozen=True)
class ImageSpan:
    """One image of a vision-language prompt: the run of placeholder tokens it fills, and what
    fills them, the image's patch rows (which the model's vision tower turns into the span's
    rows) or those rows themselves, computed before (a client's own tower run)."""

    start: int  # prompt position of its first placeholder token
    num_tokens: int  # placeholder tokens: the grid's patches / merge_size**2
    grid: tuple[int, int]  # (rows, columns) of patches, before merging
    pixels: ImagePixels | None  # the patch rows, for the vision tower; None: `rows` given
    # [num_tokens, hidden] float32: the rows as given, as the input stage checked them (rows of
    # a bfloat16 or float16 tower widened exactly); the model runner rounds them to the model
    # dtype, as it does prompt embeds. None: `pixels` given.
    rows: np.ndarray | None = None

    @property
    def end(self) -> int:
        """Prompt position one past its last placeholder token."""
        return self.start + self.num_tokens
