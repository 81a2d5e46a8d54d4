"""Loading an image a user gave, safely: from a PIL image, encoded bytes, a data: URI, bare
base64, an http(s) URL or a local file, into a decoded `PIL.Image.Image`.

Everything a request can point at is held to a `MediaPolicy`: local files only under one
folder, URLs only to named hosts (every redirect's target checked again), a cap on the encoded
bytes (enforced while a body streams in), a cap on the pixels (read from the header, before
anything is decoded), timeouts and a deadline on every fetch. Only raster formats are decoded
(PNG, JPEG, WebP, GIF's first frame, BMP, TIFF); SVG is refused. Every failure is an
`InputError` saying why; its caller names the input. The policy and its words are
`media_policy`'s; fetching a URL is `media_fetch`'s.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import os
import re
import stat
import threading
import urllib.parse
import warnings
from collections.abc import Iterator
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from vecpool.errors import InputError
from vecpool.inputs.media_fetch import fetch, host_of
from vecpool.inputs.media_policy import FORMAT_NAMES, FORMATS, MediaPolicy, describe

_ORIENTATION = 0x0112  # the EXIF tag


def load_image(source: Any, policy: MediaPolicy, *, deadline: float | None = None) -> Image.Image:
    """The image `source` names, decoded, its EXIF orientation applied.

    `source` may be a `PIL.Image.Image`; encoded bytes (bytes, bytearray, memoryview); a
    `data:image/...;base64,` URI; bare base64 of an encoded image; an http(s) URL; a local path
    (str or `os.PathLike`, relative ones taken from `policy.allowed_local_media_path`) or a
    file:// URL. `deadline` (a `time.monotonic()` value) bounds a fetch besides the policy's
    timeouts. The mode is the file's own (RGBA, P, L, CMYK, ...): the image processor converts
    it as the model's own processor does. Raises `InputError` naming the reason for anything
    that is not an image the policy allows."""
    if isinstance(source, Image.Image):
        return _given_image(source, policy)
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_image(bytes(source), policy, what="the bytes")
    if isinstance(source, os.PathLike):
        return _read_path(os.fspath(source), policy)
    if isinstance(source, str):
        return _load_string(source, policy, deadline)
    raise InputError(
        "an image must be a PIL image, encoded bytes, a URL, a data: URI, base64 or a path, "
        f"got {type(source).__name__}"
    )


def decode_image(data: bytes, policy: MediaPolicy, *, what: str = "the image") -> Image.Image:
    """`data`, an encoded image, decoded under the policy's byte and pixel caps (`what` names
    where the bytes came from, in an error)."""
    if not data:
        raise InputError(f"{what}: empty, no image data")
    if len(data) > policy.max_image_bytes:
        raise InputError(
            f"{what}: {len(data):,} bytes, over the limit of {policy.max_image_bytes:,} bytes"
        )
    if _is_svg(data):
        raise InputError(f"{what}: an SVG image, which is not a raster format; send {FORMAT_NAMES}")
    with _quiet():
        try:
            image = Image.open(io.BytesIO(data), formats=FORMATS)
        except UnidentifiedImageError:
            kind = _sniff(data)
            if kind is not None:
                raise InputError(f"{what}: a corrupt {kind} (its header cannot be read)") from None
            raise InputError(
                f"{what}: not an image in a supported format ({FORMAT_NAMES})"
            ) from None
        except Image.DecompressionBombError as exc:
            raise InputError(f"{what}: {_too_many_pixels(exc, policy)}") from None
        except Exception as exc:  # a plugin's header parser on corrupt data: any error
            raise InputError(f"{what}: a corrupt image ({describe(exc)})") from None
    _check_pixels(image, policy, what)
    kind = image.format or "image"
    try:
        image.load()  # the decoding itself, outside the lock (Pillow lets other threads run)
    except Image.DecompressionBombError as exc:
        raise InputError(f"{what}: {_too_many_pixels(exc, policy)}") from None
    except MemoryError:
        raise InputError(f"{what}: not enough memory to decode this {kind}") from None
    except Exception as exc:  # truncated data, a broken stream, a bad table: any error
        raise InputError(f"{what}: a corrupt or truncated {kind} ({describe(exc)})") from None
    if _orientation(image) != 1:
        ImageOps.exif_transpose(image, in_place=True)
    return image


_QUIET = threading.Lock()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Pillow's warnings silenced: its decompression-bomb guard (a process-wide limit) warns
    on sizes the policy's cap decides, and it warns of corrupt metadata (EXIF) in images that
    decode well; what matters is an error, each an InputError. Warning filters are process
    state, saved and restored by `warnings.catch_warnings`: one such block runs at a time, so
    that two threads' blocks cannot interleave and leave the filters changed. (Only header
    reading runs in it, ~0.1 ms; the decoding runs outside.)"""
    with _QUIET, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation of `image` (1, upright, where its EXIF data cannot be read: the
    pixels are fine, the tag is lost). Read once; `ImageOps.exif_transpose` reads it again
    from Pillow's cache."""
    try:
        with _quiet():
            value = image.getexif().get(_ORIENTATION, 1)
    except Exception:
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _given_image(image: Image.Image, policy: MediaPolicy) -> Image.Image:
    """A PIL image given as it is: held to the pixel cap, loaded (a lazily opened file is
    read here, its errors named) and turned upright (a copy; the caller's image is left as it
    is)."""
    _check_pixels(image, policy, "the image")
    try:
        image.load()
    except Exception as exc:
        raise InputError(f"the image cannot be read ({describe(exc)})") from None
    return ImageOps.exif_transpose(image) if _orientation(image) != 1 else image


def _check_pixels(image: Image.Image, policy: MediaPolicy, what: str) -> None:
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise InputError(
            f"{what}: {width}x{height} = {width * height:,} pixels, over the limit of "
            f"{policy.max_image_pixels:,} pixels"
        )
    if width < 1 or height < 1:
        raise InputError(f"{what}: an image of {width}x{height} pixels has no pixels")


def _too_many_pixels(exc: Image.DecompressionBombError, policy: MediaPolicy) -> str:
    """Pillow's refusal (at twice its own limit, before the policy's cap is looked at) told
    as the policy's."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    if found is None:
        return f"too many pixels ({exc})"
    pixels = int(found.group(1))
    if pixels > policy.max_image_pixels:
        return f"{pixels:,} pixels, over the limit of {policy.max_image_pixels:,} pixels"
    return f"{pixels:,} pixels, over Pillow's own limit (PIL.Image.MAX_IMAGE_PIXELS, doubled)"


def _sniff(data: bytes) -> str | None:
    """The format `data` says it is by its first bytes (None: none of the decoded ones)."""
    for magic, kind in _MAGIC.items():
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return None


def _is_svg(data: bytes) -> bool:
    """Whether `data` is SVG (XML text naming an svg element; no raster format starts '<')."""
    return data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"<") and (
        b"<svg" in data[: 1 << 16].lower()
    )


# --- strings: data: URIs, URLs, base64, paths -------------------------------------------------

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_BASE64 = re.compile(r"[A-Za-z0-9+/_\-\s]+={0,2}\s*")
# What an encoded image begins with: a string of base64 is taken as an image when its bytes
# begin so (a path, which base64's alphabet can also spell, does not decode to these).
_MAGIC = {
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF87a": "GIF",
    b"GIF89a": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}


def _load_string(text: str, policy: MediaPolicy, deadline: float | None) -> Image.Image:
    text = text.strip()
    scheme = _SCHEME.match(text)
    name = scheme.group(1).lower() if scheme else ""
    if name == "data":
        return decode_image(_data_uri(text, policy), policy, what="the data: URI")
    if name in ("http", "https"):
        body = fetch(text, policy, deadline)
        return decode_image(body, policy, what=f"the image at {host_of(text)}")
    if name == "file":
        return _read_path(_file_url_path(text), policy)
    if scheme and text[scheme.end() : scheme.end() + 2] == "//":
        raise InputError(f"URLs of scheme {name!r} are not fetched (http, https, data, file are)")
    data = _bare_base64(text, policy)
    if data is not None:
        return decode_image(data, policy, what="the base64 image")
    return _read_path(text, policy)


def _data_uri(text: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = text[5:].partition(",")
    if not comma:
        raise InputError("a data: URI without a ',' before its data")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if media_type.startswith("image/svg"):
        raise InputError(f"the data: URI is an SVG image, not a raster format; send {FORMAT_NAMES}")
    if (
        media_type
        and not media_type.startswith("image/")
        and media_type != "application/octet-stream"
    ):
        raise InputError(f"the data: URI holds {media_type!r}, not an image")
    if "base64" in params[1:]:
        return _b64decode(payload, policy, "the data: URI")
    if len(payload) > 3 * policy.max_image_bytes:  # percent-encoded: at most 3 chars a byte
        raise InputError(f"the data: URI is over the limit of {policy.max_image_bytes:,} bytes")
    return urllib.parse.unquote_to_bytes(payload)


def _b64decode(payload: str, policy: MediaPolicy, what: str) -> bytes:
    if len(payload) > 3 * policy.max_image_bytes:  # (4 characters a 3 bytes, and line breaks)
        raise InputError(f"{what}: over the limit of {policy.max_image_bytes:,} bytes")
    clean = "".join(payload.split())
    if len(clean) // 4 * 3 > policy.max_image_bytes + 2:
        raise InputError(
            f"{what}: about {len(clean) // 4 * 3:,} bytes, over the limit of "
            f"{policy.max_image_bytes:,} bytes"
        )
    if "-" in clean or "_" in clean:  # the URL-safe alphabet
        clean = clean.replace("-", "+").replace("_", "/")
    clean += "=" * (-len(clean) % 4)
    try:
        return base64.b64decode(clean, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{what}: not valid base64") from None


def _bare_base64(text: str, policy: MediaPolicy) -> bytes | None:
    """The bytes `text` encodes when it is base64 of an image (or of SVG, which the decoder
    refuses by name); None when it is something else (a path)."""
    if len(text) < 16 or _BASE64.fullmatch(text) is None:
        return None
    head = "".join(text[:128].split())
    try:
        start = _b64decode(head[: len(head) // 4 * 4], policy, "base64")
    except InputError:
        return None
    if _sniff(start) is None and not start.lstrip().startswith(b"<"):
        return None
    return _b64decode(text, policy, "the base64 image")


# --- local files ------------------------------------------------------------------------------


def _file_url_path(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InputError(f"a file: URL names host {parts.netloc!r}; only local files are read")
    if parts.query or parts.fragment:
        raise InputError("a file: URL with a query or fragment")
    return urllib.parse.unquote(parts.path)


def _read_path(path: str, policy: MediaPolicy) -> Image.Image:
    root = policy.allowed_local_media_path
    shown = _short(path)
    if root is None:
        raise InputError(
            f"local image paths are refused ({shown}): no --allowed-local-media-path is set; "
            "send the image's bytes, base64 or a data: URI"
        )
    if "\x00" in path:
        raise InputError(f"the path {shown} holds a NUL character")
    # Resolved (symlinks followed, '..' applied) before the containment check, so that neither
    # escapes the folder; a path outside it is refused whether or not it exists.
    try:
        resolved = (root / path).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise InputError(f"the path {shown} cannot be resolved ({describe(exc)})") from None
    if not resolved.is_relative_to(root):
        raise InputError(f"the path {shown} is outside the allowed --allowed-local-media-path")
    # O_NONBLOCK: a FIFO opens without waiting for a writer (and is refused below);
    # O_NOFOLLOW: the resolved name must not have become a symlink since.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(resolved, flags)
    except FileNotFoundError:
        raise InputError(f"no image file {shown} under --allowed-local-media-path") from None
    except OSError as exc:
        raise InputError(f"the image file {shown} cannot be opened ({describe(exc)})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{shown} is not a regular file")
        if info.st_size > policy.max_image_bytes:
            raise InputError(
                f"the image file {shown}: {info.st_size:,} bytes, over the limit of "
                f"{policy.max_image_bytes:,} bytes"
            )
        with open(fd, "rb", closefd=False) as file:
            data = file.read(policy.max_image_bytes + 1)
    finally:
        os.close(fd)
    return decode_image(data, policy, what=f"the image file {shown}")


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
