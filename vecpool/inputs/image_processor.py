"""A checkpoint's image preprocessing (`ImageProcessor`) applied to an image: conversion to RGB,
resizing, cropping, padding, the value table, the cut into patch rows. What it is built from is
`image_processing`'s reading of the folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from PIL import Image

from vecpool.errors import InputError
from vecpool.inputs.pixels import ImagePixels, PixelTable

# An image is resized whole before a center crop takes the middle: with a shortest-edge size,
# one of extreme aspect ratio (1 x 100,000 pixels) would be resized to billions of pixels.
# Resized images over this many pixels are refused.
MAX_RESIZED_PIXELS = 1 << 25


@dataclass(frozen=True, eq=False)
class ImageProcessor:
    """A checkpoint's image preprocessing; `__call__` turns a PIL image into patch rows.

    The image travels in the compact form (`ImagePixels.table` set): its 8-bit codes, laid
    out as the float rows are without the frame copies, and the table that makes the rows; a
    processor that pads after normalizing hands over the float rows themselves.

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
    resize: bool  # whether the image is resized (to `size`; SigLIP2, Qwen2-VL: their own way)
    resample: int  # PIL's filter number
    values: np.ndarray  # [3, 256] float32: channel c's 8-bit value v becomes values[c, v]
    # The size, a transformers size dict (empty for SigLIP2 and Qwen2-VL).
    size: dict[str, int] = field(default_factory=dict)
    crop: tuple[int, int] | None = None  # (height, width) of the center crop; None: none
    pad: tuple[int, int] | None = None  # (height, width) padded to with zeros after normalizing
    max_num_patches: int = 0  # SigLIP2's patch budget (0 for the others)
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

    @cached_property
    def table(self) -> PixelTable:
        """What turns this processor's codes into its float rows (see the class docstring for
        the rows' layouts: the channel is a row's last axis for SigLIP2, its first elsewhere)."""
        channel = np.arange(3, dtype=np.uint8)
        per_channel = self.patch_size**2
        channels = (
            np.tile(channel, per_channel)
            if self.kind == "siglip2"
            else np.repeat(channel, per_channel)
        )
        return PixelTable(self.values, channels, self.temporal_patch_size)

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
        # [height, width, 3]: the codes; floats where the processor pads with zeros after
        # normalizing (a zero is no code's value)
        plane = pixels if self.pad is None else _pad(self._lookup(pixels), *self.pad)
        p = self.patch_size
        rows, cols = plane.shape[0] // p, plane.shape[1] // p
        if rows == 0 or cols == 0:
            raise InputError(
                f"the processed image of {plane.shape[1]}x{plane.shape[0]} pixels is smaller "
                f"than one {p}x{p} patch"
            )
        patches = plane[: rows * p, : cols * p].reshape(rows, p, cols, p, 3)
        patches = patches.transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3 * p * p)
        table = None if self.pad is not None else self.table
        return ImagePixels(np.ascontiguousarray(patches), (rows, cols), table)

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
        rows, cols = rgb.height // p, rgb.width // p
        patches = np.asarray(rgb).reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        return ImagePixels(
            np.ascontiguousarray(patches.reshape(rows * cols, p * p * 3)), (rows, cols), self.table
        )

    def _qwen2_vl(self, rgb: Image.Image) -> ImagePixels:
        p, m = self.patch_size, self.merge_size
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
        codes = np.asarray(rgb)  # [height, width, 3] uint8
        rows, cols = rgb.height // p, rgb.width // p
        # (block row, y in block, y in patch, block column, x in block, x in patch, channel)
        blocks = codes.reshape(rows // m, m, p, cols // m, m, p, 3)
        # -> (block row, block column, y in block, x in block, channel, y in patch, x in patch);
        # the table repeats each channel's block over the `temporal_patch_size` frames.
        blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5).reshape(rows * cols, 3 * p * p)
        return ImagePixels(np.ascontiguousarray(blocks), (rows, cols), self.table)

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
