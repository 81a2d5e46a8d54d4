"""vecpool.inputs.media: every form an image may come in, and every hostile one refused with an
InputError that names the reason (URLs: test_media_fetch.py).

A call that could hang (a FIFO) runs under `within`, a hang guard: it fails the test if the call
has not returned after a few seconds. Nothing else about time is asserted."""

from __future__ import annotations

import base64
import io
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.inputs.media_data import (
    HANG_GUARD_S,
    PNG,
    RGB,
    SVG,
    encoded,
    noise,
    pixels,
    png_header,
    within,
)
from vecpool.errors import ConfigError, InputError
from vecpool.inputs.media import MediaPolicy, load_image

# --- forms ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "options", "mode"),
    [
        ("PNG", {}, "RGB"),
        ("WEBP", {"lossless": True}, "RGB"),
        ("BMP", {}, "RGB"),
        ("TIFF", {}, "RGB"),
        ("PNG", {}, "RGBA"),
        ("TIFF", {}, "CMYK"),
        ("PNG", {}, "L"),
        ("PNG", {}, "LA"),
        ("PNG", {}, "I;16"),
        ("PNG", {}, "1"),
    ],
)
def test_lossless_bytes_decode_to_their_pixels(
    fmt: str, options: dict[str, Any], mode: str
) -> None:
    source = Image.fromarray(noise(37, 23, 4), "RGBA").convert(mode)
    if mode == "I;16":
        source = Image.fromarray(noise(37, 23, 2).view(np.uint16)[..., 0])
    image = load_image(encoded(source, fmt, **options), MediaPolicy())
    assert image.format == fmt
    assert image.mode == source.mode  # converted by the image processor, not here
    np.testing.assert_array_equal(pixels(image), pixels(source))


def test_jpeg_decodes_as_pillow_does() -> None:
    data = encoded(RGB, "JPEG", quality=90)
    image = load_image(data, MediaPolicy())
    assert (image.format, image.mode, image.size) == ("JPEG", "RGB", RGB.size)
    np.testing.assert_array_equal(pixels(image), pixels(Image.open(io.BytesIO(data))))


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.fromarray(np.full((8, 9, 3), value, np.uint8)) for value in (10, 200)]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    image = load_image(data, MediaPolicy())
    assert image.format == "GIF"
    np.testing.assert_array_equal(pixels(image.convert("RGB")), pixels(frames[0]))


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_byte_forms(kind: Callable[[bytes], Any]) -> None:
    np.testing.assert_array_equal(pixels(load_image(kind(PNG), MediaPolicy())), pixels(RGB))


@pytest.mark.parametrize(
    "text",
    [
        "data:image/png;base64," + base64.b64encode(PNG).decode(),
        "DATA:image/png;BASE64," + base64.encodebytes(PNG).decode(),  # wrapped lines
        "data:;base64," + base64.b64encode(PNG).decode(),
        "data:image/png," + "".join(f"%{b:02X}" for b in PNG),  # percent-encoded
        base64.b64encode(PNG).decode(),  # bare
        "  " + base64.b64encode(PNG).decode() + "\n",  # surrounding whitespace aside
        base64.b64encode(PNG).decode().rstrip("="),  # bare, padding left out
        base64.urlsafe_b64encode(PNG).decode(),  # the URL-safe alphabet
    ],
)
def test_string_forms(text: str) -> None:
    np.testing.assert_array_equal(pixels(load_image(text, MediaPolicy())), pixels(RGB))


def test_a_pil_image_is_taken_as_it_is() -> None:
    image = Image.fromarray(noise(5, 4))
    assert load_image(image, MediaPolicy()) is image


def upright_jpeg() -> tuple[bytes, np.ndarray]:
    """A 40x20 JPEG whose EXIF says to turn it (orientation 6: 90 degrees clockwise), and the
    pixels Pillow decodes, turned."""
    source = np.zeros((20, 40, 3), np.uint8)
    source[:, :20] = (255, 0, 0)  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encoded(Image.fromarray(source), "JPEG", exif=exif.tobytes(), quality=95)
    decoded = Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_270)
    return data, pixels(decoded)


def test_exif_orientation_is_applied() -> None:
    data, expected = upright_jpeg()
    image = load_image(data, MediaPolicy())
    assert image.size == (20, 40)
    np.testing.assert_array_equal(pixels(image), expected)
    assert image.getexif().get(0x0112, 1) == 1
    # the red half is on top now (orientation 6: the left edge turned to the top)
    assert pixels(image)[:20, :, 0].mean() > 200 > pixels(image)[20:, :, 0].mean() + 100


def test_exif_orientation_of_a_given_image_leaves_the_callers_image() -> None:
    data, expected = upright_jpeg()
    given = Image.open(io.BytesIO(data))
    image = load_image(given, MediaPolicy())
    np.testing.assert_array_equal(pixels(image), expected)
    assert given.size == (40, 20)


def test_corrupt_exif_data_leaves_the_image_as_it_is() -> None:
    broken = b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff\x01\x12\x00\x03"  # cut short
    data = encoded(RGB, "JPEG", exif=broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = load_image(data, MediaPolicy())
    assert not caught
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Pillow's own, on the reference's decoding)
        expected = pixels(Image.open(io.BytesIO(data)))
    np.testing.assert_array_equal(pixels(image), expected)


def test_concurrent_loads_leave_the_warning_filters_as_they_were() -> None:
    """Warning filters are process state; loads in threads (the CLI reads images on a pool)
    silence Pillow's warnings one at a time, so the filters end as they began."""
    data = encoded(RGB, "JPEG", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff")
    before = list(warnings.filters)

    def loads() -> None:
        for _ in range(30):
            load_image(data, MediaPolicy())

    threads = [threading.Thread(target=loads) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    assert not any(thread.is_alive() for thread in threads)
    assert warnings.filters == before


# --- local files ------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return root


def test_local_forms(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=media_dir)
    target = media_dir / "sub" / "cat.png"
    for source in (
        target,
        str(target),
        "sub/cat.png",  # relative to the allowed folder
        "sub/../sub/cat.png",
        target.as_uri(),
        "file://localhost" + target.as_posix(),
    ):
        np.testing.assert_array_equal(pixels(load_image(source, policy)), pixels(RGB))


def test_local_paths_refused_without_a_folder(media_dir: Path) -> None:
    for source in (media_dir / "sub" / "cat.png", "sub/cat.png", (media_dir / "x").as_uri()):
        with pytest.raises(
            InputError, match=r"local image paths are refused.*--allowed-local-media-path"
        ):
            load_image(source, MediaPolicy())


def test_escapes_from_the_folder_are_refused(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=media_dir)
    (media_dir / "link.png").symlink_to(media_dir.parent / "secret.png")
    (media_dir / "dirlink").symlink_to(media_dir.parent)
    for source in (
        "../secret.png",
        "sub/../../secret.png",
        str(media_dir.parent / "secret.png"),
        (media_dir.parent / "secret.png").as_uri(),
        "link.png",  # a symlink out
        "dirlink/secret.png",
        "/etc/passwd",
        "../missing.png",  # refused as outside, whether or not it exists
    ):
        with pytest.raises(InputError, match=r"outside the allowed --allowed-local-media-path"):
            load_image(source, policy)


def test_local_failures(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=media_dir, max_image_bytes=len(PNG) - 1)
    with pytest.raises(InputError, match=r"no image file 'sub/missing.png'"):
        load_image("sub/missing.png", policy)
    with pytest.raises(InputError, match=r"'sub' is not a regular file"):
        load_image("sub", policy)
    with pytest.raises(InputError, match=rf"{len(PNG):,} bytes, over the limit"):
        load_image("sub/cat.png", policy)
    with pytest.raises(InputError, match=r"names host 'example.com'"):
        load_image("file://example.com/sub/cat.png", policy)
    (media_dir / "notes.txt").write_text("not an image at all")
    with pytest.raises(InputError, match=r"not an image in a supported format"):
        load_image("notes.txt", policy)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="the platform has no FIFOs")
def test_a_fifo_is_refused_without_waiting_for_a_writer(media_dir: Path) -> None:
    os.mkfifo(media_dir / "pipe")
    policy = MediaPolicy(allowed_local_media_path=media_dir)
    with pytest.raises(InputError, match=r"'pipe' is not a regular file"):
        within(load_image, "pipe", policy)


# --- hostile payloads -------------------------------------------------------------------------


def test_empty_corrupt_and_non_images() -> None:
    policy = MediaPolicy()
    with pytest.raises(InputError, match=r"empty"):
        load_image(b"", policy)
    with pytest.raises(InputError, match=r"not an image in a supported format"):
        load_image(b"hello, this is text and not an image", policy)
    with pytest.raises(InputError, match=r"not an image in a supported format"):
        load_image(b"%PDF-1.7\n" + bytes(200), policy)
    with pytest.raises(InputError, match=r"a corrupt PNG"):
        load_image(PNG[:8] + bytes(range(256)) * 4, policy)  # the signature, then garbage
    big = encoded(Image.fromarray(noise(256, 256)), "PNG")
    with pytest.raises(InputError, match=r"a corrupt or truncated PNG"):
        load_image(big[:200] + bytes(range(256)) * 2 + big[712:], policy)  # garbled data
    with pytest.raises(InputError, match=r"corrupt or truncated PNG"):
        load_image(big[: len(big) // 2], policy)
    jpeg = encoded(Image.fromarray(noise(256, 256)), "JPEG")
    with pytest.raises(InputError, match=r"corrupt or truncated JPEG"):
        load_image(jpeg[: len(jpeg) // 2], policy)
    with pytest.raises(InputError, match=r"an image must be a PIL image, encoded bytes.*got int"):
        load_image(12345, policy)


def test_formats_outside_the_list_are_refused() -> None:
    for fmt in ("PPM", "ICO", "TGA"):
        with pytest.raises(InputError, match=r"not an image in a supported format"):
            load_image(encoded(RGB, fmt), MediaPolicy())


def test_svg_is_refused_in_every_form() -> None:
    policy = MediaPolicy()
    for source in (
        SVG,
        b"\xef\xbb\xbf  " + SVG,
        b"<svg xmlns='http://www.w3.org/2000/svg'/>",
        "data:image/svg+xml;base64," + base64.b64encode(SVG).decode(),
        "data:image/svg+xml;utf8," + SVG.decode(),
        "data:;base64," + base64.b64encode(SVG).decode(),
        base64.b64encode(SVG).decode(),
    ):
        with pytest.raises(InputError, match=r"SVG"):
            load_image(source, policy)


def test_a_bomb_is_refused_from_its_header() -> None:
    with pytest.raises(
        InputError, match=r"12000x8000 = 96,000,000 pixels, over the limit of 67,108,864"
    ):
        load_image(png_header(12000, 8000), MediaPolicy())
    # past twice Pillow's own limit, Pillow refuses first: told as the policy's refusal
    with pytest.raises(InputError, match=r"600,000,000 pixels, over the limit of 67,108,864"):
        load_image(png_header(30000, 20000), MediaPolicy())
    small = MediaPolicy(max_image_pixels=100)
    with pytest.raises(InputError, match=r"37x23 = 851 pixels, over the limit of 100 pixels"):
        load_image(PNG, small)
    with pytest.raises(InputError, match=r"37x23 = 851 pixels"):
        load_image(RGB, small)  # a given image is held to the cap too


def test_pillows_own_bomb_guard_never_escapes() -> None:
    # Between Pillow's limit and twice it, Pillow warns; above, it raises its own error.
    limit = Image.MAX_IMAGE_PIXELS
    assert limit is not None
    side = int((1.5 * limit) ** 0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InputError, match=r"over the limit of 67,108,864 pixels"):
            load_image(png_header(side, side), MediaPolicy())
        # a cap above Pillow's: its error (at open, before any pixel is allocated) is named
        with pytest.raises(InputError, match=r"900,000,000 pixels, over Pillow's own limit"):
            load_image(png_header(30000, 30000), MediaPolicy(max_image_pixels=10**10))
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]


def test_byte_cap() -> None:
    policy = MediaPolicy(max_image_bytes=len(PNG) - 1)
    with pytest.raises(
        InputError, match=rf"{len(PNG):,} bytes, over the limit of {len(PNG) - 1:,}"
    ):
        load_image(PNG, policy)
    text = base64.b64encode(PNG).decode()
    with pytest.raises(InputError, match=r"over the limit"):
        load_image(text, policy)
    with pytest.raises(InputError, match=r"over the limit"):
        load_image("data:image/png;base64," + text, policy)
    # a huge base64 string is refused by its length, before it is decoded
    with pytest.raises(InputError, match=r"over the limit of 20,971,520 bytes"):
        load_image("data:image/png;base64," + "A" * (30 << 20), MediaPolicy())


def test_invalid_base64_and_data_uris() -> None:
    policy = MediaPolicy()
    with pytest.raises(InputError, match=r"not valid base64"):
        load_image("data:image/png;base64,iVBORw0KGgo$$$$", policy)
    with pytest.raises(InputError, match=r"without a ','"):
        load_image("data:image/png;base64", policy)
    with pytest.raises(InputError, match=r"holds 'text/plain', not an image"):
        load_image("data:text/plain;base64,aGVsbG8=", policy)
    with pytest.raises(InputError, match=r"scheme 'ftp' are not fetched"):
        load_image("ftp://example.com/cat.png", policy)
    # a string that is neither (base64 of a non-image reads as a path, refused)
    with pytest.raises(InputError, match=r"local image paths are refused"):
        load_image(base64.b64encode(b"just some words, no image").decode(), policy)


def test_policy_validation(tmp_path: Path) -> None:
    policy = MediaPolicy(
        allowed_media_domains=("Images.Example.COM.", "cdn.example.org"),
        allowed_local_media_path=tmp_path / "." / "",
    )
    assert policy.allowed_media_domains == ("images.example.com", "cdn.example.org")
    assert policy.allowed_local_media_path == tmp_path.resolve()
    bad: list[dict[str, Any]] = [
        {"max_image_bytes": 0},
        {"max_image_pixels": -1},
        {"read_timeout": 0},
        {"max_redirects": -1},
        {"max_redirects": 1.5},
        {"allowed_media_domains": "example.com"},
        {"allowed_media_domains": ("https://example.com",)},
        {"allowed_media_domains": ("example.com:8080",)},
        {"allowed_media_domains": ("",)},
        {"allowed_local_media_path": tmp_path / "missing"},
    ]
    for options in bad:
        with pytest.raises(ConfigError):
            MediaPolicy(**options)
