"""Image preprocessing equal to the checkpoint's Hugging Face image processor, in Pillow and
numpy: CLIP, SigLIP, SigLIP2 (NaFlex) and Qwen2-VL (Qwen2.5-VL's too).

`load_image_processor(folder)` reads the folder's processor settings (what the Hugging Face
processor reads: `processor_config.json`'s "image_processor", else `preprocessor_config.json`)
and the model's patch size (`config.json`), checks them, and returns an `ImageProcessor`
(`image_processor`); calling it on a `PIL.Image.Image` gives the `ImagePixels` the model's
patch embedding reads.

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
from pathlib import Path
from typing import Any

import numpy as np

from vecpool.errors import ConfigError
from vecpool.inputs.image_processor import ImageProcessor

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
    # What every kind's processor is built of.
    common: dict[str, Any] = dict(
        kind=kind,
        convert_rgb=flags["do_convert_rgb"],
        resize=flags["do_resize"],
        resample=resample,
        values=values,
    )
    if kind == "qwen2_vl":
        return _qwen2_vl(get, common, vision, source, str(config_path))
    if kind == "siglip2":
        patch_size = _positive(get("patch_size"), "patch_size", source)
        if model_patch != patch_size:
            raise ConfigError(
                f"{source}: patch_size {patch_size} differs from the model's {model_patch} "
                f"({folder / 'config.json'})"
            )
        max_num_patches = _positive(get("max_num_patches"), "max_num_patches", source)
        return ImageProcessor(patch_size=patch_size, max_num_patches=max_num_patches, **common)
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
    return ImageProcessor(patch_size=patch_size, size=resize, crop=crop, pad=pad, **common)


def _qwen2_vl(
    get: Any,  # the setting of a key: the config's, else the class default
    common: dict[str, Any],  # the fields every kind's processor reads alike
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
        patch_size=sizes["patch_size"],
        merge_size=sizes["merge_size"],
        temporal_patch_size=sizes["temporal_patch_size"],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        **common,
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
