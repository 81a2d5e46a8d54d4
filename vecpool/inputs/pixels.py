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
