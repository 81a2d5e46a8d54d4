"""Image preprocessing equal to the checkpoint's Hugging Face image processor, in Pillow and
numpy: CLIP, SigLIP, SigLIP2 (NaFlex) and Qwen2-VL (Qwen2.5-VL's too).

`load_image_processor(folder)` reads the folder's processor settings (what the Hugging Face
processor reads: `processor_config.json`'s "image_processor", else `preprocessor_config.json`)
and the model's patch size (`config.json`), and returns an `ImageProcessor`; calling it on a
`PIL.Image.Image` gives the `ImagePixels` the model's patch embedding reads.

Every step is the one transformers' PIL processors (`CLIPImageProcessorPil`,
`SiglipImageProcessorPil`, `Siglip2ImageProcessorPil`) take, with the same Pillow calls and the
same float operations (`Qwen2VLImageProcessorPil` likewise), so the values agree with theirs
(tests hold them to 1e-6): conversion
to RGB (transparency composited onto white), resizing by Pillow with the configured filter,
center cropping (zero padding where the crop is larger), rescaling (float64 product, rounded
to float32) and normalization (in float32). Rescaling and normalization act on each 8-bit
value of each channel alone, so they are done once per processor, as a table of 3 x 256
values, and an image only looks its values up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vecpool.errors import ConfigError, InputError
from vecpool.inputs.pixels import ImagePixels

# The image processor types read, by the name a config gives (a "Fast" or "Pil" suffix aside).
KINDS = {
    "CLIPImageProcessor": "clip",
    "CLIPFeatureExtractor": "clip",
    "SiglipImageProcessor": "siglip",
    "Siglip2ImageProcessor": "siglip2",
    "Qwen2VLImageProcessor": "qwen2_vl",  # Qwen2.5-VL's processor too
}
_MODEL_TYPES = {
    name: kind for kind in ("clip", "siglip", "siglip2") for name in (kind, f"{kind}_vision_model")
}
_MODEL_TYPES.update({"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl"})
# The vision configs' default patch sizes (CLIPVisionConfig, SiglipVisionConfig, ...).
_PATCH_DEFAULTS = {"clip": 32, "siglip": 16, "siglip2": 16, "qwen2_vl": 14}

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)

# Each Hugging Face class's defaults (transformers 5.25), taken where the config leaves a
# setting out or null.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "default_to_square": False,
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
    },
    "siglip": {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "default_to_square": False,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _HALF,
        "image_std": _HALF,
    },
    "siglip2": {
        "do_resize": True,
        "default_to_square": True,
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _HALF,
        "image_std": _HALF,
        "patch_size": 16,
        "max_num_patches": 256,
    },
    "qwen2_vl": {
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},  # pixel counts
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    },
}

# The size dictionaries transformers accepts, and the filters of PIL's numbering.
_SIZE_FORMS = (
    frozenset({"height", "width"}),
    frozenset({"shortest_edge"}),
    frozenset({"shortest_edge", "longest_edge"}),
    frozenset({"longest_edge"}),
    frozenset({"max_height", "max_width"}),
    frozenset({"min_pixels", "max_pixels"}),
)
_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

# An image is resized whole before a center crop takes the middle: with a shortest-edge size,
# one of extreme aspect ratio (1 x 100,000 pixels) would be resized to billions of pixels.
# Resized images over this many pixels are refused.
MAX_RESIZED_PIXELS = 1 << 25


@dataclass(frozen=True, eq=False)
class ImageProcessor:
    """A checkpoint's image preprocessing; `__call__` turns a PIL image into patch rows.

    Layout of `ImagePixels.patches` (float32, `[num_patches, 3 * patch_size**2]`):

    - CLIP and SigLIP (`kind` "clip", "siglip"): patches in row-major (y, x) order over the
      `grid` (rows, columns) = (height // patch_size, width // patch_size) of the processed
      image, each row laid out (channel, y in patch, x in patch). So `rows @
      conv.weight.view(out, -1).T + conv.bias` equals the model's `Conv2d(3, out, patch_size,
      stride=patch_size)` patch embedding, flattened row-major; pixels past the last whole
      patch are dropped, as that convolution drops them.
    - SigLIP2 (`kind` "siglip2"): the Hugging Face processor's own layout, patches in
      row-major order, each row laid out (y in patch, x in patch, channel), as its model's
      linear patch embedding reads them; `grid` is the processor's `spatial_shapes` entry.
      Only the image's own patches: none of the padding up to `max_num_patches`.
    - Qwen2-VL (`kind` "qwen2_vl"): the image resized to multiples of `patch_size *
      merge_size` holding between `min_pixels` and `max_pixels` pixels (`smart_resize`), its
      `grid` (rows, columns) of patches ordered by merge block: block after block in row-major
      order, the `merge_size**2` patches of a block in row-major order within it. Each row is
      laid out (channel, frame, y in patch, x in patch), the picture repeated over the
      `temporal_patch_size` frames, as the model's Conv3d patch embedding reads it; `patch_dim`
      is `3 * temporal_patch_size * patch_size**2`.
    """

    kind: str  # "clip" | "siglip" | "siglip2" | "qwen2_vl"
    patch_size: int
    convert_rgb: bool  # composite transparency onto white, as the processor does
    resize: bool  # whether the image is resized (to `size`; SigLIP2: by `max_num_patches`)
    size: dict[str, int]  # the size, a transformers size dict (empty for SigLIP2)
    resample: int  # PIL's filter number
    crop: tuple[int, int] | None  # (height, width) of the center crop; None: none
    pad: tuple[int, int] | None  # (height, width) padded to with zeros after normalizing
    max_num_patches: int  # SigLIP2's patch budget (0 for the others)
    values: np.ndarray  # [3, 256] float32: channel c's 8-bit value v becomes values[c, v]
    # Qwen2-VL: patches merged into one row of the language model per `merge_size**2`, frames
    # per patch, and the pixel counts the resized image keeps between (1 and 0 for the others).
    merge_size: int = 1
    temporal_patch_size: int = 1
    min_pixels: int = 0
    max_pixels: int = 0

    @property
    def patch_dim(self) -> int:
        """Values of one patch row."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def __call__(self, image: Image.Image) -> ImagePixels:
        """`image` preprocessed and cut into patch rows (see the class docstring)."""
        rgb = _to_rgb(image, self.convert_rgb)
        if self.kind == "siglip2":
            return self._naflex(rgb)
        if self.kind == "qwen2_vl":
            return self._qwen2_vl(rgb)
        if self.resize:
            rgb = _resized(rgb, self._target_size(rgb.height, rgb.width), self.resample)
        pixels = np.asarray(rgb)  # [height, width, 3] uint8
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        floats = self._lookup(pixels)
        if self.pad is not None:
            floats = _pad(floats, *self.pad)
        p = self.patch_size
        rows, cols = floats.shape[0] // p, floats.shape[1] // p
        if rows == 0 or cols == 0:
            raise InputError(
                f"the processed image of {floats.shape[1]}x{floats.shape[0]} pixels is smaller "
                f"than one {p}x{p} patch"
            )
        patches = floats[: rows * p, : cols * p].reshape(rows, p, cols, p, 3)
        patches = patches.transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
        return ImagePixels(np.ascontiguousarray(patches), (rows, cols))

    def _naflex(self, rgb: Image.Image) -> ImagePixels:
        p = self.patch_size
        if self.resize:
            target = _naflex_size(rgb.height, rgb.width, p, self.max_num_patches)
            rgb = _resized(rgb, target, self.resample)
        elif rgb.height % p or rgb.width % p:
            raise InputError(
                f"an image of {rgb.width}x{rgb.height} pixels does not divide into {p}x{p} "
                "patches, and the model's processor does not resize (do_resize is false)"
            )
        floats = self._lookup(np.asarray(rgb))
        rows, cols = rgb.height // p, rgb.width // p
        patches = floats.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        return ImagePixels(
            np.ascontiguousarray(patches.reshape(rows * cols, p * p * 3)), (rows, cols)
        )

    def _qwen2_vl(self, rgb: Image.Image) -> ImagePixels:
        p, m, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        factor = p * m
        if self.resize:
            target = smart_resize(rgb.height, rgb.width, factor, self.min_pixels, self.max_pixels)
            rgb = _resized(rgb, target, self.resample)
        elif rgb.height % factor or rgb.width % factor:
            raise InputError(
                f"an image of {rgb.width}x{rgb.height} pixels does not divide into blocks of "
                f"{factor}x{factor} pixels, and the model's processor does not resize (do_resize "
                "is false)"
            )
        floats = self._lookup(np.asarray(rgb))  # [height, width, 3]
        rows, cols = rgb.height // p, rgb.width // p
        # (block row, y in block, y in patch, block column, x in block, x in patch, channel)
        blocks = floats.reshape(rows // m, m, p, cols // m, m, p, 3)
        # -> (block row, block column, y in block, x in block, channel, y in patch, x in patch)
        blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5).reshape(rows * cols, 3, 1, p * p)
        patches = np.broadcast_to(blocks, (rows * cols, 3, frames, p * p))
        return ImagePixels(
            np.ascontiguousarray(patches).reshape(rows * cols, 3 * frames * p * p), (rows, cols)
        )

    def _lookup(self, pixels: np.ndarray) -> np.ndarray:
        """[height, width, 3] uint8 -> [height, width, 3] float32, rescaled and normalized."""
        out = np.empty(pixels.shape, dtype=np.float32)
        for c in range(3):
            np.take(self.values[c], pixels[..., c], out=out[..., c])
        return out

    def _target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resized to: the rules of transformers' PIL backend."""
        size = self.size
        shortest, longest = size.get("shortest_edge"), size.get("longest_edge")
        if shortest and longest:
            return _size_with_aspect_ratio(height, width, shortest, longest)
        if shortest:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = shortest, int(shortest * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        if size.get("max_height") and size.get("max_width"):
            scale = min(size["max_height"] / height, size["max_width"] / width)
            return int(height * scale), int(width * scale)
        return size["height"], size["width"]


def load_image_processor(folder: Path) -> ImageProcessor | None:
    """The image processor of the model in `folder` (for a sentence-transformers CLIP folder,
    its `0_CLIPModel/` subfolder); None when the folder has no image processor settings.

    Raises `ConfigError` for a processor type other than CLIP, SigLIP or SigLIP2, or settings
    the processor cannot run with (naming the file and the setting)."""
    folder = Path(folder)
    found = _processor_settings(folder)
    if found is None:
        return None
    settings, source = found
    model = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if isinstance(model.get("vlm_config"), dict):  # a retrieval model (ColQwen2, ColPali)
        model = model["vlm_config"]
    kind = _kind(settings, model, source)
    return _build(kind, settings, model, source, folder)


def _processor_settings(folder: Path) -> tuple[dict[str, Any], str] | None:
    """The settings Hugging Face reads, in its order: `processor_config.json`'s nested
    "image_processor", else `preprocessor_config.json`."""
    nested = folder / "processor_config.json"
    if nested.is_file():
        processor = _read_json(nested)
        if isinstance(processor.get("image_processor"), dict):
            return processor["image_processor"], f"{nested} (image_processor)"
    flat = folder / "preprocessor_config.json"
    if flat.is_file():
        return _read_json(flat), str(flat)
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _kind(settings: dict[str, Any], model: dict[str, Any], source: str) -> str:
    name = settings.get("image_processor_type") or settings.get("feature_extractor_type")
    if name is None:  # as transformers' auto class: the model's type decides
        model_type = str(model.get("model_type", ""))
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        raise ConfigError(f"{source} names no image_processor_type, and config.json no model_type")
    base = str(name)
    for suffix in ("Fast", "Pil"):
        base = base.removesuffix(suffix)
    if base not in KINDS:
        raise ConfigError(
            f"{source}: image processor {name!r} is not supported (supported: "
            f"{', '.join(sorted(KINDS))})"
        )
    return KINDS[base]


def _build(
    kind: str, settings: dict[str, Any], model: dict[str, Any], source: str, folder: Path
) -> ImageProcessor:
    defaults = _DEFAULTS[kind]

    def get(key: str) -> Any:
        value = settings.get(key)
        return defaults.get(key) if value is None else value

    flags = {
        key: _flag(get(key), key, source)
        for key in ("do_convert_rgb", "do_resize", "do_center_crop", "do_rescale", "do_normalize")
    }
    if kind not in ("siglip2", "qwen2_vl"):
        flags["do_pad"] = _flag(get("do_pad"), "do_pad", source)
    square = _flag(get("default_to_square"), "default_to_square", source)
    resample = get("resample")
    if isinstance(resample, bool) or resample not in _FILTERS:
        raise ConfigError(
            f"{source}: resample must be one of PIL's filter numbers {sorted(_FILTERS)}, "
            f"got {resample!r}"
        )
    values = _value_table(flags["do_rescale"], get("rescale_factor"), flags["do_normalize"],
                          get("image_mean"), get("image_std"), source)  # fmt: skip
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{folder} has image processor settings but no config.json")
    vision = model.get("vision_config")
    if not isinstance(vision, dict):  # a vision model's own config
        vision = model
    # A config saved as a difference from its class's defaults may leave the default out.
    model_patch = vision.get("patch_size", _PATCH_DEFAULTS[kind])
    if kind == "qwen2_vl":
        return _qwen2_vl(get, flags, resample, values, vision, source, str(config_path))
    if kind == "siglip2":
        patch_size = _positive(get("patch_size"), "patch_size", source)
        if model_patch != patch_size:
            raise ConfigError(
                f"{source}: patch_size {patch_size} differs from the model's {model_patch} "
                f"({folder / 'config.json'})"
            )
        return ImageProcessor(
            kind=kind,
            patch_size=patch_size,
            convert_rgb=flags["do_convert_rgb"],
            resize=flags["do_resize"],
            size={},
            resample=resample,
            crop=None,
            pad=None,
            max_num_patches=_positive(get("max_num_patches"), "max_num_patches", source),
            values=values,
        )
    patch_size = _positive(model_patch, "vision_config.patch_size", str(config_path))
    size = get("size")
    if kind == "clip" and settings.get("use_square_size"):
        # transformers' CLIP (for Kosmos-2): a square of the class's own shortest edge
        size = {"height": 224, "width": 224}
    resize: dict[str, int] = {}
    if flags["do_resize"]:
        if size is None:
            raise ConfigError(f"{source}: do_resize is true but no size is given")
        resize = _size_dict(size, square, "size", source)
        if not (
            resize.get("shortest_edge")
            or (resize.get("max_height") and resize.get("max_width"))
            or (resize.get("height") and resize.get("width"))
        ):
            raise ConfigError(
                f"{source}: size {resize} is not a form the processor resizes to (height and "
                "width, shortest_edge with or without longest_edge, max_height and max_width)"
            )
    crop = None
    if flags["do_center_crop"]:
        crop_size = get("crop_size")
        if crop_size is None:
            raise ConfigError(f"{source}: do_center_crop is true but no crop_size is given")
        crop = _height_width(_size_dict(crop_size, True, "crop_size", source), "crop_size", source)
    pad = None
    if flags["do_pad"] and get("pad_size") is not None:
        pad = _height_width(
            _size_dict(get("pad_size"), True, "pad_size", source), "pad_size", source
        )
    return ImageProcessor(
        kind=kind,
        patch_size=patch_size,
        convert_rgb=flags["do_convert_rgb"],
        resize=flags["do_resize"],
        size=resize,
        resample=resample,
        crop=crop,
        pad=pad,
        max_num_patches=0,
        values=values,
    )


def _qwen2_vl(
    get: Any,  # the setting of a key: the config's, else the class default
    flags: dict[str, bool],
    resample: int,
    values: np.ndarray,
    vision: dict[str, Any],  # the model's vision_config
    source: str,
    config_path: str,
) -> ImageProcessor:
    """Qwen2-VL's processor: its patch, frame and merge sizes, which must be the model's, and
    the pixel counts it resizes between (`min_pixels` / `max_pixels` where the config gives
    them, as transformers lets them override `size`)."""
    sizes = {}
    for key, model_key, default in (
        ("patch_size", "patch_size", 14),
        ("temporal_patch_size", "temporal_patch_size", 2),
        ("merge_size", "spatial_merge_size", 2),
    ):
        sizes[key] = _positive(get(key), key, source)
        model_value = vision.get(model_key, default)
        if model_value != sizes[key]:
            raise ConfigError(
                f"{source}: {key} {sizes[key]} differs from the model's vision_config."
                f"{model_key} {model_value} ({config_path})"
            )
    size = get("size")
    size = dict(size) if isinstance(size, dict) else {}
    low = get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    high = get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    min_pixels = _positive(low, "min_pixels (size.shortest_edge)", source)
    max_pixels = _positive(high, "max_pixels (size.longest_edge)", source)
    if min_pixels > max_pixels:
        raise ConfigError(f"{source}: min_pixels {min_pixels} is over max_pixels {max_pixels}")
    return ImageProcessor(
        kind="qwen2_vl",
        patch_size=sizes["patch_size"],
        convert_rgb=flags["do_convert_rgb"],
        resize=flags["do_resize"],
        size={},
        resample=resample,
        crop=None,
        pad=None,
        max_num_patches=0,
        values=values,
        merge_size=sizes["merge_size"],
        temporal_patch_size=sizes["temporal_patch_size"],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def _flag(value: Any, key: str, source: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _positive(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _size_dict(value: Any, default_to_square: bool, key: str, source: str) -> dict[str, int]:
    """A size setting in transformers' dictionary form (an int: a square, or the shortest edge
    where the processor does not default to squares; a pair: height and width)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    elif isinstance(value, list | tuple) and len(value) == 2:
        size = {"height": value[0], "width": value[1]}
    elif isinstance(value, dict):
        size = dict(value)
        if frozenset(size) not in _SIZE_FORMS:
            raise ConfigError(
                f"{source}: {key} has keys {sorted(size)}, not one of the forms "
                f"{[sorted(form) for form in _SIZE_FORMS]}"
            )
    else:
        raise ConfigError(
            f"{source}: {key} must be an int, a [height, width] pair or a dict, got {value!r}"
        )
    for name, number in size.items():
        _positive(number, f"{key}.{name}", source)
    return size


def _height_width(size: dict[str, int], key: str, source: str) -> tuple[int, int]:
    if "height" not in size or "width" not in size:
        raise ConfigError(f"{source}: {key} must give height and width, got {size}")
    return size["height"], size["width"]


def _value_table(
    do_rescale: bool, factor: Any, do_normalize: bool, mean: Any, std: Any, source: str
) -> np.ndarray:
    """[3, 256] float32: each channel's 8-bit values rescaled and normalized by the float
    operations of transformers' `rescale` and `normalize`, in their order."""
    values: np.ndarray = np.arange(256, dtype=np.uint8)
    if do_rescale:
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ConfigError(f"{source}: rescale_factor must be a number, got {factor!r}")
        values = (values.astype(np.float64) * factor).astype(np.float32)
    else:
        values = values.astype(np.float32)
    table = np.repeat(values[None, :], 3, axis=0)
    if do_normalize:
        means = _per_channel(mean, "image_mean", source)
        stds = _per_channel(std, "image_std", source)
        if not np.all(stds != 0):
            raise ConfigError(f"{source}: image_std {std!r} has a zero")
        table = (table - means[:, None]) / stds[:, None]
    return np.ascontiguousarray(table, dtype=np.float32)


def _per_channel(value: Any, key: str, source: str) -> np.ndarray:
    numbers = list(value) if isinstance(value, list | tuple) else [value] * 3
    if len(numbers) != 3 or not all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in numbers
    ):
        raise ConfigError(f"{source}: {key} must be a number or 3 numbers, got {value!r}")
    return np.array(numbers, dtype=np.float32)


def _to_rgb(image: Image.Image, convert: bool) -> Image.Image:
    """An RGB image as the processor makes it: transformers' `convert_to_rgb` (transparency,
    from an alpha band or the `transparency` info, composited onto white), or an RGB image
    left as it is where the processor does not convert. An image of another mode is converted
    even then: the processor would hand the model 1 or 4 channels (or fail on the mean)."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if image.mode == "RGB" and (not convert or not has_alpha):
        return image
    try:
        if has_alpha:
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
        return image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise InputError(
            f"an image of mode {image.mode} cannot be converted to RGB ({exc})"
        ) from None


def _resized(image: Image.Image, size: tuple[int, int], resample: int) -> Image.Image:
    height, width = size
    if height < 1 or width < 1:
        raise InputError(
            f"an image of {image.width}x{image.height} pixels would be resized to "
            f"{width}x{height}: its aspect ratio is too extreme"
        )
    if height * width > MAX_RESIZED_PIXELS:
        raise InputError(
            f"an image of {image.width}x{image.height} pixels would be resized to "
            f"{width}x{height} ({height * width:,} pixels, over {MAX_RESIZED_PIXELS:,}) before "
            "cropping: its aspect ratio is too extreme"
        )
    if (width, height) == image.size:
        return image  # Pillow's resize to the same size is a copy
    return image.resize((width, height), resample=Image.Resampling(resample))


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    """transformers' `get_size_with_aspect_ratio`: the shortest edge to `size`, unless the
    longest would pass `max_size`."""
    small, large = float(min(height, width)), float(max(height, width))
    scaled_short = float(size)
    if large / small * size > max_size:
        scaled_short = max_size * small / large
        size = round(scaled_short)
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return int(scaled_short * height / width), size
    return size, int(scaled_short * width / height)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: (height, width) as multiples of `factor`, the
    aspect ratio kept as closely as may be, scaled into [`min_pixels`, `max_pixels`] pixels.
    `InputError` for an aspect ratio over 200, which the processor refuses too."""
    if max(height, width) / min(height, width) > 200:
        raise InputError(
            f"an image of {width}x{height} pixels has an aspect ratio over 200, which the "
            "model's processor refuses"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _naflex_size(height: int, width: int, patch: int, max_patches: int) -> tuple[int, int]:
    """transformers' `get_image_size_for_max_num_patches`: the largest scale (found by a
    bisection to 1e-5) whose patch-multiple size holds at most `max_patches` patches."""

    def scaled(scale: float, size: int) -> int:
        return int(max(patch, math.ceil(size * scale / patch) * patch))

    low, high = 1e-6, 100.0
    while high - low >= 1e-5:
        scale = (low + high) / 2
        if (scaled(scale, height) / patch) * (scaled(scale, width) / patch) <= max_patches:
            low = scale
        else:
            high = scale
    return scaled(low, height), scaled(low, width)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' `center_crop` on [height, width, 3]: the middle, zero-padded (before
    rescaling, so black) where the image is smaller than the crop."""
    h, w = pixels.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    bottom, right = top + height, left + width
    if top >= 0 and left >= 0 and bottom <= h and right <= w:
        return pixels[top:bottom, left:right]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[top_pad : top_pad + h, left_pad : left_pad + w] = pixels
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[max(0, top) : min(new_h, bottom), max(0, left) : min(new_w, right)]


def _pad(floats: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' `pad` to (height, width): zeros below and to the right."""
    h, w = floats.shape[:2]
    if h > height or w > width:
        raise InputError(
            f"the processed image of {w}x{h} pixels is larger than the pad size {width}x{height}"
        )
    if (h, w) == (height, width):
        return floats
    return np.pad(floats, ((0, height - h), (0, width - w), (0, 0)))
