"""Images' 8-bit codes turned into patch rows on the device (see `vecpool.inputs.pixels`).

An image in the compact form crosses to the device as its uint8 codes, a quarter (an eighth
with Qwen2-VL's two frames) of its float32 rows; its value table lives on the device, copied
once per table. The lookup there is a gather and a copy, as on the host, from the table cast
to the model dtype: each row equals the host's float32 row cast to that dtype, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from vecpool.inputs.pixels import PixelTable

# Distinct tables kept on the device: an engine's processor has one; tables are never a
# client's (precomputed rows travel as floats), so this bound is never reached in practice.
MAX_TABLES = 16


class PixelTables:
    """The device copies of the value tables (`PixelTable`) an engine has seen, in its model
    dtype. Owned by the model runner; used from the engine's step thread only."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        # table -> ([3 * 256] model dtype values, [code_dim] int32 offsets of each column's
        # channel into them)
        self._tables: dict[PixelTable, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(
        self,
        codes: torch.Tensor,  # [num_patches, code_dim] uint8 on the device
        table: PixelTable,
    ) -> torch.Tensor:  # [num_patches, patch_dim] model dtype
        """The float rows of `codes`, in the model dtype: looked up, frames repeated."""
        values, offsets = self._device_table(table)
        return lookup(codes, values, offsets, table.frames)

    def _device_table(self, table: PixelTable) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._tables.get(table)
        if found is None:
            if len(self._tables) >= MAX_TABLES:
                self._tables.clear()
            values = torch.from_numpy(table.values.reshape(-1)).to(self.device, self.dtype)
            offsets = torch.from_numpy(table.channels.astype(np.int32) * 256).to(self.device)
            found = self._tables[table] = (values, offsets)
        return found


def lookup(
    codes: torch.Tensor,  # [num_patches, code_dim] uint8
    values: torch.Tensor,  # [3 * 256]: channel c's value v at c * 256 + v
    offsets: torch.Tensor,  # [code_dim] int32: each column's channel * 256
    frames: int,  # times each channel's block repeats in a row
) -> torch.Tensor:  # [num_patches, code_dim * frames] in `values`' dtype
    """The rows of `codes`: a gather from `values`, each channel's block of columns repeated
    over `frames`, laid out (channel, frame, block) (`PixelTable`)."""
    n, width = codes.shape
    index = codes.to(torch.int32) + offsets  # [num_patches, code_dim]
    floats = values.index_select(0, index.view(-1)).view(n, width)
    if frames == 1:
        return floats
    block = width // 3
    return floats.view(n, 3, 1, block).expand(n, 3, frames, block).reshape(n, width * frames)
