"""An image as it travels from the input stage to the engine: patch rows, like token ids.

The model-free side (`vecpool.inputs.media`, `vecpool.inputs.image_processing`) decodes an image
and preprocesses it as the checkpoint's Hugging Face image processor does, then cuts it into the
patch rows the model's patch embedding reads. The engine sees only these arrays: the float32
rows, or (what the processor makes) their 8-bit codes and the table that turns the codes into
the rows, which the engine looks up on its device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


@dataclass(frozen=True, eq=False)
class PixelTable:
    """What turns an image's 8-bit codes into its float32 patch rows: a table lookup (the
    processor's rescale and normalize folded into it) and a copy over frames, exact by
    construction. One table serves every image of a processor.

    Code column j of a row holds an 8-bit value of channel `channels[j]`; its float is
    `values[channels[j], code]`. With `frames` over 1 the columns are the three channels'
    blocks in order, and a float row repeats each channel's block `frames` times, laid out
    (channel, frame, block), as Qwen2-VL's Conv3d patch embedding reads them."""

    values: np.ndarray  # [3, 256] float32: channel c's 8-bit value v becomes values[c, v]
    channels: np.ndarray  # [code_dim] uint8: the channel of each code column
    frames: int = 1  # times a float row repeats each channel's block of columns
    # The table's contents as bytes: equal tables are one key (the device copies are cached
    # by it; tables read from the wire are new objects).
    key: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        values, channels = self.values, self.channels
        if values.shape != (3, 256) or values.dtype != np.float32:
            raise ValueError(
                f"a pixel table of {values.dtype} {values.shape}, not float32 (3, 256)"
            )
        if channels.ndim != 1 or channels.dtype != np.uint8 or (channels > 2).any():
            raise ValueError("a pixel table's channels must be a 1-D uint8 array of 0, 1 and 2")
        if self.frames < 1:
            raise ValueError(f"a pixel table of {self.frames} frames")
        if self.frames > 1 and not np.array_equal(
            channels, np.repeat(np.arange(3, dtype=np.uint8), channels.shape[0] // 3)
        ):
            raise ValueError("a pixel table with frames needs its columns in channel blocks")
        key = values.tobytes() + channels.tobytes() + self.frames.to_bytes(4, "little")
        object.__setattr__(self, "key", key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PixelTable) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def code_dim(self) -> int:
        """Codes of one row."""
        return int(self.channels.shape[0])

    @property
    def patch_dim(self) -> int:
        """Values of one float row: the codes' columns, frames included."""
        return self.code_dim * self.frames

    def rows(self, codes: np.ndarray) -> np.ndarray:
        """`[n, code_dim]` uint8 codes -> `[n, patch_dim]` float32 rows."""
        offsets = self.channels.astype(np.intp) * 256  # [code_dim]
        floats = np.take(self.values.reshape(-1), codes + offsets)  # [n, code_dim]
        if self.frames == 1:
            return floats
        n, block = floats.shape[0], self.code_dim // 3
        expanded = np.broadcast_to(floats.reshape(n, 3, 1, block), (n, 3, self.frames, block))
        return np.ascontiguousarray(expanded).reshape(n, self.patch_dim)


@dataclass(frozen=True, eq=False)
class ImagePixels:
    """One preprocessed image: its patches, one row each, in the order the model reads them.

    It holds either the float32 rows themselves (`table` None: precomputed rows, or a
    processor that pads after normalizing) or the compact form: the rows' 8-bit codes, without
    the frame copies, and the `table` that turns them into the rows. The compact form is 4
    bytes per value smaller (4 x `frames`), and the model runner does its lookup on the device."""

    # [num_patches, patch_dim] float32 rows; each laid out as the model's patch embedding
    # reads it (see the processor that made it). With `table`: [num_patches, code_dim] uint8.
    data: np.ndarray
    grid: tuple[int, int]  # (rows, columns) of patches; rows * columns == num_patches
    table: PixelTable | None = None  # None: `data` is the float rows
    num_patches: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rows, cols = self.grid
        if self.data.ndim != 2 or self.data.shape[0] != rows * cols:
            raise ValueError(
                f"patches of shape {tuple(self.data.shape)} do not fill a {rows}x{cols} grid"
            )
        if self.table is not None and (
            self.data.dtype != np.uint8 or self.data.shape[1] != self.table.code_dim
        ):
            raise ValueError(
                f"codes of {self.data.dtype} {tuple(self.data.shape)}, but the table reads "
                f"uint8 rows of {self.table.code_dim}"
            )
        object.__setattr__(self, "num_patches", int(self.data.shape[0]))

    @property
    def codes(self) -> np.ndarray | None:
        """`[num_patches, code_dim]` uint8: the compact form's codes; None: float rows."""
        return None if self.table is None else self.data

    @property
    def patch_dim(self) -> int:
        """Values of one float row, frames included."""
        return int(self.data.shape[1]) if self.table is None else self.table.patch_dim

    @cached_property
    def patches(self) -> np.ndarray:
        """`[num_patches, patch_dim]` float32: the rows, looked up once from the codes (and
        kept) for the compact form."""
        return self.data if self.table is None else self.table.rows(self.data)


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
