"""Image inputs: which inputs are images, and how one becomes patch rows.

An image may come as a `PIL.Image.Image`, encoded bytes, a `pathlib.Path`, a `data:image/...`
URI, or `{"image": value}` where value is any of those, a path or URL string, or bare base64.
A plain string is text unless it is a `data:image/` URI: a path or URL given as a string needs
the `{"image": ...}` wrapper (or a server dialect that says the part is an image).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from vecpool.errors import ConfigError, InputError
from vecpool.inputs.pixels import ImagePixels

if TYPE_CHECKING:
    from vecpool.inputs.image_processor import ImageProcessor
    from vecpool.inputs.media import MediaPolicy
    from vecpool.inputs.vision_prompts import VisionFormat

DATA_IMAGE_PREFIX = "data:image/"


def is_image(item: Any) -> bool:
    """Whether a bare input (not a dict) is an image: a PIL image, encoded bytes or a path."""
    if isinstance(item, bytes | bytearray | memoryview | PurePath):
        return True
    return type(item).__module__.startswith("PIL.")


def image_reader(processor_dir: str | None, policy: MediaPolicy | None) -> ImageReader | None:
    """The reader of a model's image inputs: its folder's image processor (`processor_dir`
    holds preprocessor_config.json) under `policy`; None for a model without an image tower
    (`processor_dir` None)."""
    if processor_dir is None:
        return None
    from vecpool.inputs.image_processing import load_image_processor
    from vecpool.inputs.media import MediaPolicy

    processor = load_image_processor(Path(processor_dir))
    if processor is None:
        raise ConfigError(
            f"the model has an image tower, but {processor_dir} has no preprocessor_config.json "
            "(its image processor's settings)"
        )
    from vecpool.inputs.vision_prompts import is_vision_language, read_vision_format

    vision = None
    # A vision-language model (Qwen2-VL, PaliGemma's SigLIP processor): images go into prompts.
    if processor.kind == "qwen2_vl" or is_vision_language(Path(processor_dir)):
        vision = read_vision_format(Path(processor_dir), processor.merge_size)
    return ImageReader(processor, policy if policy is not None else MediaPolicy(), vision)


class ImageReader:
    """Reads one image input into the patch rows its model runs: loaded under the media policy
    (`vecpool.inputs.media`), preprocessed as the checkpoint's image processor does
    (`vecpool.inputs.image_processing`). Model-free: it runs where texts are tokenized.

    `vision` is set for a vision-language model, whose images sit in prompts at placeholder
    tokens (`vecpool.inputs.vision_prompts`); None for a dual encoder, whose image is an input
    of its own."""

    def __init__(
        self, processor: ImageProcessor, policy: MediaPolicy, vision: VisionFormat | None = None
    ):
        self.processor = processor
        self.policy = policy
        self.vision = vision

    def __call__(self, value: Any, index: int, deadline: float | None = None) -> ImagePixels:
        from vecpool.inputs.media import load_image

        try:
            return self.processor(load_image(value, self.policy, deadline=deadline))
        except InputError as exc:
            raise exc.at(index) from None

    def check(self, patch_dim: int, grid: tuple[int, int] | None, model: str) -> None:
        """`ConfigError` unless the processor's patch rows are what the model reads: rows of
        `patch_dim` values, in `grid` (None: any grid), on a probe picture."""
        from PIL import Image

        pixels = self.processor(Image.new("RGB", (37, 23), (120, 60, 30)))
        width = pixels.patch_dim
        if width != patch_dim or (grid is not None and pixels.grid != grid):
            rows, cols = pixels.grid
            raise ConfigError(
                f"the folder's image processor makes {rows}x{cols} patches of {width} values, "
                f"but {model} takes "
                + (f"{grid[0]}x{grid[1]} patches" if grid is not None else "patches")
                + f" of {patch_dim}: preprocessor_config.json does not match config.json"
            )

    def read_many(
        self, items: list[tuple[int, Any]], deadline: float | None = None
    ) -> list[ImagePixels | InputError]:
        """Each `(index, value)` read, in order, by a pool of threads when there are several
        (Pillow's decoding and resampling and numpy's arithmetic release the GIL); an image
        that cannot be read is its `InputError`, for the caller to raise in input order."""

        def read(item: tuple[int, Any]) -> ImagePixels | InputError:
            try:
                return self(item[1], item[0], deadline)
            except InputError as exc:
                return exc

        if len(items) < _PARALLEL_FROM:
            return [read(item) for item in items]
        return list(_pool().map(read, items))


# Fewer images are read in the calling thread: a pool's hand-off costs more than it saves.
_PARALLEL_FROM = 4
_POOL: list[ThreadPoolExecutor] = []  # made at the first call that needs it, then shared
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            workers = min(16, os.cpu_count() or 1)
            _POOL.append(ThreadPoolExecutor(workers, thread_name_prefix="vecpool-images"))
        return _POOL[0]
