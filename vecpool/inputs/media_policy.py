"""What image inputs may reach and cost (`MediaPolicy`), and the words their refusals share:
the formats decoded, a host's name as the allow-list compares it, an exception in brief."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vecpool.errors import ConfigError

# The formats decoded (Pillow's names); anything else is refused before a decoder runs.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
FORMAT_NAMES = "PNG, JPEG, WebP, GIF, BMP or TIFF"


@dataclass(frozen=True)
class MediaPolicy:
    """What image inputs may reach and how much they may cost.

    `allowed_local_media_path`: local files (paths, file:// URLs) only under this folder, which
    must exist (None: no local file may be read). `allowed_media_domains`: http(s) URLs only to
    these hosts, matched exactly, case aside (empty: no URL may be fetched). data: URIs, base64
    and bytes are always taken. `max_image_bytes`: the encoded size an image may have, however
    it comes. `max_image_pixels`: width times height, checked from the header before decoding
    (a decompression bomb is refused unread). A fetch may take `connect_timeout` seconds to
    connect and `read_timeout` seconds to receive its whole response (headers and body, not
    per read: a server dripping bytes is cut off), and follows at most `max_redirects`
    redirects."""

    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if isinstance(self.max_redirects, bool) or not isinstance(self.max_redirects, int):
            raise ConfigError(f"max_redirects must be an int, got {self.max_redirects!r}")
        if self.max_redirects < 0:
            raise ConfigError(f"max_redirects must be 0 or positive, got {self.max_redirects}")
        if isinstance(self.allowed_media_domains, str):
            raise ConfigError(
                "allowed_media_domains must be a sequence of host names, got the string "
                f"{self.allowed_media_domains!r}"
            )
        domains = tuple(host_key(d) for d in self.allowed_media_domains)
        for given, host in zip(self.allowed_media_domains, domains, strict=True):
            if not host or any(c in host for c in "/:@?#* "):
                raise ConfigError(
                    f"allowed_media_domains: {given!r} is not a host name (give hosts such as "
                    "'images.example.com', without scheme, port or path)"
                )
        object.__setattr__(self, "allowed_media_domains", domains)
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise ConfigError(
                    f"allowed_local_media_path {str(self.allowed_local_media_path)!r} is not a "
                    "folder"
                )
            object.__setattr__(self, "allowed_local_media_path", root)


def host_key(host: str) -> str:
    """`host` as `allowed_media_domains` holds it: lower case, no trailing dot."""
    return host.strip().rstrip(".").lower()


def describe(exc: BaseException) -> str:
    """`exc` in a few words for an error message: its type, and its text if it has one."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
