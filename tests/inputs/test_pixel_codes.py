"""Images in the compact form (`ImagePixels` with a `PixelTable`: 8-bit codes and the table that
turns them into rows) give the float32 rows of the plain lookup, bit for bit: on the host
(`ImagePixels.patches`), on the device (`PixelTables`, run here on CPU torch), in a step's
flat batch (compact steps, mixed ones), through the engine's image rows and across the wire.

Bit equality is by construction, not by tolerance: each side gathers the same float32 table
entries and copies them (frames repeated); nothing is computed. The reference rows below are
the lookup written out per kind (every pixel's value looked up, then cut into the kind's rows),
as the processor computed them before the compact form.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from vecpool.inputs.image_processor import ImageProcessor
from vecpool.inputs.pixels import ImagePixels, ImageSpan, PixelTable
from vecpool.inputs.prompts import Prompt
from vecpool.runner.batch import image_batch
from vecpool.runner.pixel_tables import PixelTables
from vecpool.server import wire
from vecpool.tasks import PoolingParams

PATCH, MERGE, FRAMES = 4, 2, 2
KINDS = ["clip", "siglip", "siglip2", "qwen2_vl"]


def processor(kind: str, pad: tuple[int, int] | None = None, seed: int = 0) -> ImageProcessor:
    """A processor of `kind` that keeps the image's size, with a random value table (every
    entry distinct, so a wrong channel or value shows)."""
    values = np.random.default_rng(seed).standard_normal((3, 256)).astype(np.float32)
    qwen = kind == "qwen2_vl"
    return ImageProcessor(
        kind=kind,
        patch_size=PATCH,
        convert_rgb=True,
        resize=False,
        resample=3,
        values=values,
        pad=pad,
        merge_size=MERGE if qwen else 1,
        temporal_patch_size=FRAMES if qwen else 1,
    )


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def reference_rows(proc: ImageProcessor, image: Image.Image) -> np.ndarray:
    """The float32 rows of `image` (already of a size the kind takes as it is), the lookup
    written out: every pixel's value from the table, then cut into the kind's rows."""
    pixels = np.asarray(image)  # [height, width, 3] uint8
    floats = np.stack([proc.values[c][pixels[..., c]] for c in range(3)], axis=-1)
    if proc.pad is not None:
        height, width = proc.pad
        floats = np.pad(
            floats, ((0, height - floats.shape[0]), (0, width - floats.shape[1]), (0, 0))
        )
    p = proc.patch_size
    rows, cols = floats.shape[0] // p, floats.shape[1] // p
    floats = floats[: rows * p, : cols * p]
    if proc.kind == "siglip2":  # (y, x, channel)
        cut = floats.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        return cut.reshape(rows * cols, p * p * 3)
    if proc.kind == "qwen2_vl":  # by merge block; (channel, frame, y, x)
        m = proc.merge_size
        blocks = floats.reshape(rows // m, m, p, cols // m, m, p, 3)
        blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5).reshape(rows * cols, 3, 1, p * p)
        framed = np.repeat(blocks, proc.temporal_patch_size, axis=2)
        return framed.reshape(rows * cols, -1)
    cut = floats.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3)  # (channel, y, x)
    return cut.reshape(rows * cols, 3 * p * p)


def float_form(pixels: ImagePixels) -> ImagePixels:
    """The same image as float rows (as precomputed rows given by a client would be)."""
    return ImagePixels(pixels.patches.copy(), pixels.grid)


@pytest.mark.parametrize("kind", KINDS)
def test_compact_rows_equal_the_lookup(kind: str) -> None:
    proc = processor(kind)
    image = picture(24, 16, seed=1)
    pixels = proc(image)
    assert pixels.table is not None and pixels.codes is not None
    assert pixels.codes.dtype == np.uint8
    assert pixels.codes.shape == (pixels.num_patches, 3 * PATCH * PATCH)  # no frame copies
    assert pixels.patch_dim == proc.patch_dim == pixels.patches.shape[1]
    assert pixels.grid == (16 // PATCH, 24 // PATCH)
    expected = reference_rows(proc, image)
    assert pixels.patches.dtype == np.float32
    np.testing.assert_array_equal(pixels.patches, expected)


def test_a_processor_that_pads_keeps_float_rows() -> None:
    proc = processor("clip", pad=(20, 28))
    image = picture(24, 16, seed=2)
    pixels = proc(image)
    assert pixels.table is None and pixels.codes is None
    assert pixels.grid == (5, 7)
    np.testing.assert_array_equal(pixels.patches, reference_rows(proc, image))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_lookup_equals_the_host_rows(kind: str, dtype: torch.dtype) -> None:
    pixels = processor(kind)(picture(16, 24, seed=3))
    assert pixels.table is not None and pixels.codes is not None
    tables = PixelTables(torch.device("cpu"), dtype)
    rows = tables.rows(torch.from_numpy(pixels.codes), pixels.table)
    assert rows.dtype == dtype and rows.shape == (pixels.num_patches, pixels.patch_dim)
    # The host's float32 rows cast to the model dtype, as the float path casts them.
    assert torch.equal(rows, torch.from_numpy(pixels.patches).to(dtype))


def test_the_device_table_is_copied_once_per_table() -> None:
    proc = processor("qwen2_vl")
    a, b = proc(picture(16, 16, seed=4)), proc(picture(8, 8, seed=5))
    assert a.table is not None and b.table is not None
    # An equal table that is another object (as one read from the wire is) shares the copy.
    twin = PixelTable(a.table.values.copy(), a.table.channels.copy(), a.table.frames)
    tables = PixelTables(torch.device("cpu"), torch.float32)
    first = tables._device_table(a.table)
    assert tables._device_table(b.table) is first and tables._device_table(twin) is first
    other = processor("qwen2_vl", seed=1).table
    assert other != a.table and tables._device_table(other) is not first


def test_a_compact_step_uploads_codes() -> None:
    proc = processor("qwen2_vl")
    pixels = [proc(picture(16, 8, seed=6)), proc(picture(8, 24, seed=7))]
    batch = image_batch(pixels, np.array([3, 9]), torch.device("cpu"))
    assert batch.table == pixels[0].table
    assert batch.pixel_values.dtype == torch.uint8
    codes = np.concatenate([p.data for p in pixels])
    np.testing.assert_array_equal(batch.pixel_values.numpy(), codes)
    np.testing.assert_array_equal(batch.cu_patches.numpy(), [0, 8, 20])
    assert batch.rows.tolist() == [3, 9] and batch.max_patches == 12
    assert batch.table is not None
    rows = PixelTables(torch.device("cpu"), torch.float32).rows(batch.pixel_values, batch.table)
    expected = np.concatenate([p.patches for p in pixels])
    assert torch.equal(rows, torch.from_numpy(expected))


@pytest.mark.parametrize("other", ["float_form", "another_table"])
def test_a_mixed_step_falls_back_to_float_rows(other: str) -> None:
    proc = processor("siglip2")
    compact = proc(picture(12, 8, seed=8))
    second = proc(picture(8, 8, seed=9))
    second = (
        float_form(second)
        if other == "float_form"
        else processor("siglip2", seed=2)(picture(8, 8, seed=9))
    )
    batch = image_batch([compact, second], np.array([0, 1]), torch.device("cpu"))
    assert batch.table is None and batch.pixel_values.dtype == torch.float32
    expected = np.concatenate([compact.patches, second.patches])
    assert torch.equal(batch.pixel_values, torch.from_numpy(expected))


def _round_trip(requests: list[Any]) -> list[Any]:
    message = wire.to_engine.decode(wire.encoder.encode(wire.submit(7, requests)))
    assert isinstance(message, wire.Submit)
    return wire.prompt_requests(message)


def _assert_same_pixels(got: ImagePixels | None, sent: ImagePixels | None) -> None:
    assert got is not None and sent is not None
    assert got.grid == sent.grid and got.table == sent.table
    assert got.data.dtype == sent.data.dtype
    np.testing.assert_array_equal(got.data, sent.data)
    np.testing.assert_array_equal(got.patches, sent.patches)


def test_the_wire_carries_the_compact_form() -> None:
    from vecpool.calls.outputs import PromptRequest

    proc = processor("qwen2_vl")
    compact = proc(picture(16, 24, seed=10))
    floats = float_form(proc(picture(8, 8, seed=11)))
    dual = processor("clip")(picture(12, 12, seed=12))
    ids = np.arange(20, dtype=np.int64)
    spans = (ImageSpan(2, 6, compact.grid, compact), ImageSpan(12, 1, floats.grid, floats))
    sent = [
        PromptRequest(0, Prompt(token_ids=None, prompt_embeds=None, image=dual), PoolingParams()),
        PromptRequest(1, Prompt(token_ids=ids, prompt_embeds=None, images=spans), PoolingParams()),
    ]
    got = _round_trip(sent)
    _assert_same_pixels(got[0].prompt.image, dual)
    got_spans = got[1].prompt.images
    _assert_same_pixels(got_spans[0].pixels, compact)
    _assert_same_pixels(got_spans[1].pixels, floats)
    assert got_spans[1].pixels.table is None
    # Pickled (as Ray moves inputs), the compact form stays compact and equal.
    _assert_same_pixels(pickle.loads(pickle.dumps(compact)), compact)
    # Codes travel, not floats: 1 byte a value instead of 4, and no frame copies (the table,
    # 3 KB, rides along).
    compact_bytes = len(wire.encoder.encode(wire._wire_image(compact)))
    float_bytes = len(wire.encoder.encode(wire._wire_image(float_form(compact))))
    assert compact_bytes < compact.data.nbytes + 4000
    assert float_bytes >= 4 * FRAMES * compact.data.nbytes


def test_engine_image_rows_are_equal_for_both_forms(tmp_path: Path) -> None:
    """A vision-language model's rows of an image in the compact form equal those of its float
    rows, bit for bit: the device lookup hands the tower the same values."""
    import vecpool
    from tests.models.test_qwen2_vl import save_tiny_qwen2_vl
    from vecpool.inputs.image_processing import load_image_processor

    path = tmp_path / "model"
    save_tiny_qwen2_vl(path, False)
    engine = vecpool.Engine(path, device="cpu", normalize=False)
    proc = load_image_processor(path)
    assert proc is not None
    pixels = proc(picture(40, 27, seed=13))
    assert pixels.table is not None
    runner = engine.model_runner
    assert torch.equal(runner.image_rows(pixels), runner.image_rows(float_form(pixels)))


def test_bad_tables_are_refused() -> None:
    values = np.zeros((3, 256), np.float32)
    with pytest.raises(ValueError, match="float32 \\(3, 256\\)"):
        PixelTable(values[:2], np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="0, 1 and 2"):
        PixelTable(values, np.array([0, 3], np.uint8))
    with pytest.raises(ValueError, match="channel blocks"):
        PixelTable(values, np.tile(np.arange(3, dtype=np.uint8), 4), frames=2)
    with pytest.raises(ValueError, match="reads uint8 rows of 6"):
        ImagePixels(np.zeros((2, 6), np.float32), (1, 2), PixelTable(values, np.zeros(6, np.uint8)))
