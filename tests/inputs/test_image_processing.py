"""vecpool.inputs.image_processing against transformers' PIL image processors
(`CLIPImageProcessorPil`, `SiglipImageProcessorPil`, `Siglip2ImageProcessorPil`) loaded from the
same folder: pixel values within 1e-6 on generated images of odd sizes and every mode, for each
processor and each setting its config can carry.

The tolerance: both sides take the same Pillow calls and the same float32 operations, so the
values agree to the bit today; 1e-6 (a few float32 steps at the values' magnitude, about 2)
leaves room for a numpy that rounds an operation differently, and is still far below one 8-bit
step (1/255/std, about 0.008)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from vecpool.errors import ConfigError, InputError
from vecpool.inputs.image_processing import load_image_processor
from vecpool.inputs.image_processor import MAX_RESIZED_PIXELS

ATOL = 1e-6
SIZES = [(1, 1), (7, 301), (301, 7), (640, 480), (33, 17)]  # (width, height)
MODES = ["RGB", "RGBA", "LA", "L", "P", "P+transparency", "CMYK", "I;16", "1"]

REFERENCE = {
    "clip": transformers.CLIPImageProcessorPil,
    "siglip": transformers.SiglipImageProcessorPil,
    "siglip2": transformers.Siglip2ImageProcessorPil,
}


def make_image(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width)).astype(np.uint16))
    if mode == "1":
        return Image.fromarray(rgba[..., 0] > 127)
    if mode == "CMYK":
        return Image.frombytes("CMYK", (width, height), rgba.tobytes())
    if mode == "P+transparency":
        image = Image.fromarray(rgba[..., :3]).convert("P")
        image.info["transparency"] = int(np.asarray(image)[0, 0])
        return image
    image = Image.fromarray(rgba, "RGBA")
    return image if mode == "RGBA" else image.convert(mode)


def model_folder(
    tmp_path: Path, settings: dict[str, Any], patch_size: int | None, name: str = "model"
) -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    vision = {} if patch_size is None else {"patch_size": patch_size}
    (folder / "config.json").write_text(json.dumps({"vision_config": vision}))
    return folder


def patchify(pixel_values: np.ndarray, patch: int) -> np.ndarray:
    """[3, H, W] -> [rows * cols, 3 * patch * patch]: patches row-major, each (c, y, x); the
    pixels past the last whole patch dropped (as a stride-`patch` convolution drops them)."""
    channels, height, width = pixel_values.shape
    rows, cols = height // patch, width // patch
    cut = pixel_values[:, : rows * patch, : cols * patch]
    cut = cut.reshape(channels, rows, patch, cols, patch).transpose(1, 3, 0, 2, 4)
    return cut.reshape(rows * cols, channels * patch * patch)


def check_equal(
    folder: Path, kind: str, patch: int, image: Image.Image, **reference_options: Any
) -> None:
    """The processor read from `folder` on `image` against transformers' on the same folder."""
    ours = load_image_processor(folder)
    assert ours is not None
    pixels = ours(image)
    reference = REFERENCE[kind].from_pretrained(folder)(
        image, return_tensors="np", **reference_options
    )
    if kind == "siglip2":
        real = int(reference["pixel_attention_mask"][0].sum())
        expected = reference["pixel_values"][0][:real]  # the unpadded patches
        assert pixels.grid == tuple(int(n) for n in reference["spatial_shapes"][0])
    else:
        values = reference["pixel_values"][0]
        expected = patchify(values, patch)
        assert pixels.grid == (values.shape[1] // patch, values.shape[2] // patch)
    assert pixels.patches.dtype == np.float32 and pixels.patches.flags.c_contiguous
    assert pixels.patches.shape == expected.shape
    np.testing.assert_allclose(pixels.patches, expected, rtol=0, atol=ATOL)


# The processors as checkpoints configure them (each key as their hub folders write it).
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], int]] = {
    # openai/clip-vit-*: the legacy feature extractor form (ints for sizes)
    "clip-legacy": (
        "clip",
        {
            "feature_extractor_type": "CLIPFeatureExtractor",
            "crop_size": 224,
            "do_center_crop": True,
            "do_normalize": True,
            "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "resample": 3,
            "size": 224,
        },
        32,
    ),
    # the class's defaults alone (shortest edge 224, bicubic, center crop 224)
    "clip-defaults": ("clip", {"image_processor_type": "CLIPImageProcessor"}, 14),
    "siglip": (
        "siglip",
        {
            "image_processor_type": "SiglipImageProcessor",
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "resample": 2,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": 224, "width": 224},
        },
        16,
    ),
    "siglip2": (
        "siglip2",
        {
            "image_processor_type": "Siglip2ImageProcessor",
            "do_convert_rgb": None,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "max_num_patches": 256,
            "patch_size": 16,
            "resample": 2,
            "rescale_factor": 0.00392156862745098,
        },
        16,
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_equal_to_transformers(tmp_path: Path, checkpoint: str, mode: str) -> None:
    kind, settings, patch = CHECKPOINTS[checkpoint]
    folder = model_folder(tmp_path, settings, patch)
    # SigLIP2's processor does not convert to RGB (do_convert_rgb unset): it fails on other
    # modes (or hands 1 or 4 channels on); we convert them, as it does when told to.
    options = {"do_convert_rgb": True} if kind == "siglip2" and mode != "RGB" else {}
    for seed, (width, height) in enumerate(SIZES):
        check_equal(folder, kind, patch, make_image(mode, width, height, seed), **options)


# Every setting the processors honour, each against transformers on images of four shapes.
CLIP_VARIANTS: list[dict[str, Any]] = [
    {"do_center_crop": False},  # a grid of the resized image's own shape
    {"do_rescale": False},
    {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False},
    {"image_mean": 0.4, "image_std": 0.2},  # scalars, for every channel
    {"rescale_factor": 1 / 127.5, "image_mean": [1.0, 1.0, 1.0], "image_std": [1.0, 1, 1]},
    {"size": {"height": 100, "width": 60}, "crop_size": {"height": 56, "width": 42}},
    {"size": {"shortest_edge": 64, "longest_edge": 80}, "do_center_crop": False},
    {"size": {"max_height": 70, "max_width": 50}, "do_center_crop": False},
    {"size": [96, 64], "crop_size": [64, 48]},  # [height, width]
    {"size": 84, "default_to_square": True, "crop_size": 84},
    {"size": 32, "crop_size": {"height": 48, "width": 40}},  # a crop larger: zero-padded
    {"size": 64, "crop_size": {"height": 33, "width": 47}},  # odd crops
    {"do_resize": False, "crop_size": 56},  # cropped (or padded) from the image's own size
    {"do_pad": True, "pad_size": {"height": 240, "width": 230}},  # zeros after normalizing
    {"use_square_size": True},  # transformers' CLIP for Kosmos-2: a 224 square
    {"do_convert_rgb": False},
    *({"resample": filter_} for filter_ in (0, 1, 2, 4, 5)),
]


@pytest.mark.parametrize("variant", range(len(CLIP_VARIANTS)))
def test_clip_settings(tmp_path: Path, variant: int) -> None:
    settings = {"image_processor_type": "CLIPImageProcessor", **CLIP_VARIANTS[variant]}
    folder = model_folder(tmp_path, settings, 14)
    for seed, (mode, width, height) in enumerate(
        [("RGB", 640, 480), ("RGBA", 150, 301), ("L", 1, 1), ("P", 33, 17)]
    ):
        # Not converted to RGB, transformers' processor fails on other modes (the mean has 3
        # values, the image 1 or 4 channels); we convert them, as it does when told to.
        unconverted = settings.get("do_convert_rgb") is False and mode != "RGB"
        options = {"do_convert_rgb": True} if unconverted else {}
        check_equal(folder, "clip", 14, make_image(mode, width, height, seed), **options)


SIGLIP_VARIANTS: list[dict[str, Any]] = [
    {},  # the class's defaults: 224 square, bicubic
    {"size": {"height": 64, "width": 96}, "resample": 3},
    {"size": 80},  # an int: the shortest edge (the class does not default to squares)
    {"do_center_crop": True, "crop_size": 48, "size": {"height": 64, "width": 64}},
    {"do_resize": False},
]


@pytest.mark.parametrize("variant", range(len(SIGLIP_VARIANTS)))
def test_siglip_settings(tmp_path: Path, variant: int) -> None:
    settings = {"image_processor_type": "SiglipImageProcessor", **SIGLIP_VARIANTS[variant]}
    folder = model_folder(tmp_path, settings, 16)
    for seed, (mode, width, height) in enumerate(
        [("RGB", 640, 480), ("RGBA", 17, 301), ("L", 16, 16), ("CMYK", 33, 17)]
    ):
        check_equal(folder, "siglip", 16, make_image(mode, width, height, seed))


SIGLIP2_VARIANTS: list[tuple[dict[str, Any], int]] = [
    ({}, 16),  # the class's defaults: 256 patches of 16, bilinear
    ({"max_num_patches": 64, "patch_size": 14, "resample": 3}, 14),
    ({"max_num_patches": 1024, "image_mean": 0.3, "image_std": 0.6}, 16),
    ({"do_rescale": False, "do_normalize": False, "max_num_patches": 16}, 16),
]


@pytest.mark.parametrize("variant", range(len(SIGLIP2_VARIANTS)))
def test_siglip2_settings(tmp_path: Path, variant: int) -> None:
    extra, patch = SIGLIP2_VARIANTS[variant]
    folder = model_folder(
        tmp_path, {"image_processor_type": "Siglip2ImageProcessor", **extra}, patch
    )
    for seed, (width, height) in enumerate([(640, 480), (7, 301), (301, 7), (1, 1), (33, 17)]):
        check_equal(folder, "siglip2", patch, make_image("RGB", width, height, seed))


def test_siglip2_without_resizing(tmp_path: Path) -> None:
    settings = {"image_processor_type": "Siglip2ImageProcessor", "do_resize": False}
    folder = model_folder(tmp_path, settings, 16)
    check_equal(folder, "siglip2", 16, make_image("RGB", 48, 32))
    processor = load_image_processor(folder)
    assert processor is not None
    with pytest.raises(InputError, match=r"50x32 pixels does not divide into 16x16 patches"):
        processor(make_image("RGB", 50, 32))


def test_rows_are_the_convolutions_input(tmp_path: Path) -> None:
    """CLIP / SigLIP rows times the flattened Conv2d weight are the Conv2d patch embedding of
    the processor's pixel values (in float64: only the order of the sums differs, ~1e-15)."""
    patch = 14
    folder = model_folder(
        tmp_path, {"image_processor_type": "CLIPImageProcessor", "do_center_crop": False}, patch
    )
    processor = load_image_processor(folder)
    assert processor is not None
    image = make_image("RGB", 640, 480)
    pixels = processor(image)
    values = transformers.CLIPImageProcessorPil.from_pretrained(folder)(image, return_tensors="np")
    conv = torch.nn.Conv2d(3, 8, patch, stride=patch, dtype=torch.float64)
    with torch.no_grad():
        expected = conv(torch.from_numpy(values["pixel_values"]).double())  # [1, 8, rows, cols]
        rows = torch.from_numpy(pixels.patches).double()
        got = rows @ conv.weight.view(8, -1).T + conv.bias
    assert pixels.grid == tuple(expected.shape[2:]) == (16, 21)  # 224 x 298: 4 columns dropped
    torch.testing.assert_close(got, expected[0].flatten(1).T, rtol=0, atol=1e-12)


# --- reading the settings ---------------------------------------------------------------------


def test_no_settings_no_processor(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_image_processor(tmp_path) is None


def test_the_nested_settings_come_first(tmp_path: Path) -> None:
    """transformers reads processor_config.json's "image_processor" before
    preprocessor_config.json."""
    folder = model_folder(tmp_path, {"image_processor_type": "CLIPImageProcessor"}, 16)
    nested = {"image_processor_type": "CLIPImageProcessor", "size": 64, "crop_size": 64}
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": nested}))
    check_equal(folder, "clip", 16, make_image("RGB", 90, 70))
    processor = load_image_processor(folder)
    assert processor is not None and processor(make_image("RGB", 90, 70)).grid == (4, 4)


def test_a_sentence_transformers_clip_subfolder(tmp_path: Path) -> None:
    folder = model_folder(
        tmp_path, {"image_processor_type": "CLIPImageProcessor"}, 32, name="st/0_CLIPModel"
    )
    assert load_image_processor(tmp_path / "st") is None  # the caller passes the subfolder
    check_equal(folder, "clip", 32, make_image("RGB", 50, 40))


@pytest.mark.parametrize(
    ("settings", "model", "kind", "patch"),
    [
        ({"image_processor_type": "CLIPImageProcessorFast"}, {}, "clip", 32),  # the default
        ({"image_processor_type": "SiglipImageProcessorPil"}, {"patch_size": 14}, "siglip", 14),
        ({}, {"model_type": "siglip", "vision_config": {}}, "siglip", 16),
        ({}, {"model_type": "siglip2", "vision_config": {}}, "siglip2", 16),
        ({}, {"model_type": "clip_vision_model", "patch_size": 16}, "clip", 16),
    ],
)
def test_types_and_patch_sizes(
    tmp_path: Path, settings: dict[str, Any], model: dict[str, Any], kind: str, patch: int
) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    (tmp_path / "config.json").write_text(json.dumps(model))
    processor = load_image_processor(tmp_path)
    assert processor is not None
    assert (processor.kind, processor.patch_size) == (kind, patch)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"image_processor_type": "ViTImageProcessor"}, "'ViTImageProcessor' is not supported"),
        ({}, "names no image_processor_type"),
        ({"image_processor_type": "CLIPImageProcessor", "resample": 7}, "resample must be one"),
        ({"image_processor_type": "CLIPImageProcessor", "do_resize": "yes"}, "do_resize must be"),
        ({"image_processor_type": "CLIPImageProcessor", "size": {"longest_edge": 9}}, "not a form"),
        ({"image_processor_type": "CLIPImageProcessor", "size": {"w": 9}}, "size has keys"),
        ({"image_processor_type": "CLIPImageProcessor", "size": "big"}, "size must be an int"),
        ({"image_processor_type": "CLIPImageProcessor", "size": 0}, "size.shortest_edge must"),
        ({"image_processor_type": "CLIPImageProcessor", "crop_size": {"shortest_edge": 9}}, "crop"),
        ({"image_processor_type": "CLIPImageProcessor", "image_mean": [0.5, 0.5]}, "image_mean"),
        ({"image_processor_type": "CLIPImageProcessor", "image_std": 0}, "image_std 0 has a zero"),
        ({"image_processor_type": "CLIPImageProcessor", "rescale_factor": "x"}, "rescale_factor"),
        ({"image_processor_type": "SiglipImageProcessor", "do_center_crop": True}, "crop_size"),
        ({"image_processor_type": "Siglip2ImageProcessor", "patch_size": 14}, "differs"),
        ({"image_processor_type": "Siglip2ImageProcessor", "max_num_patches": 0}, "max_num_"),
    ],
)
def test_settings_refused(tmp_path: Path, settings: dict[str, Any], message: str) -> None:
    folder = model_folder(tmp_path, settings, 16)
    with pytest.raises(ConfigError, match=message):
        load_image_processor(folder)


def test_unreadable_files(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"preprocessor_config.json cannot be read as JSON"):
        load_image_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"must hold a JSON object"):
        load_image_processor(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_processor_type": "CLIPImageProcessor"}'
    )
    with pytest.raises(ConfigError, match=r"no config.json"):
        load_image_processor(tmp_path)


# --- images the processor refuses -------------------------------------------------------------


def test_extreme_aspect_ratios_are_refused(tmp_path: Path) -> None:
    clip = load_image_processor(
        model_folder(tmp_path, {"image_processor_type": "CLIPImageProcessor"}, 14)
    )
    assert clip is not None
    # 1 x 200,000 pixels to a shortest edge of 224: 224 x 44,800,000 before the crop
    width = MAX_RESIZED_PIXELS // 224 * 2
    with pytest.raises(
        InputError, match=r"would be resized to 224x\d+ .* aspect ratio is too extreme"
    ):
        clip(Image.new("L", (1, width)))
    boxed = load_image_processor(
        model_folder(
            tmp_path,
            {
                "image_processor_type": "CLIPImageProcessor",
                "size": {"max_height": 50, "max_width": 50},
            },
            14,
            name="boxed",
        )
    )
    assert boxed is not None
    with pytest.raises(InputError, match=r"would be resized to 50x0"):
        boxed(Image.new("RGB", (300, 1)))


def test_images_smaller_than_a_patch(tmp_path: Path) -> None:
    settings = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": False,
        "do_center_crop": False,
    }
    processor = load_image_processor(model_folder(tmp_path, settings, 14))
    assert processor is not None
    with pytest.raises(InputError, match=r"smaller than one 14x14 patch"):
        processor(make_image("RGB", 13, 100))
    assert processor(make_image("RGB", 14, 29)).grid == (2, 1)
