"""Images of `vecpool embed --image-field`: where an image line may point, and reading a
chunk's images on a pool of threads.

Where an image may come from (`ImageField.from_args`):

- data: URIs, base64 and (Parquet) binary bytes are always taken.
- http(s) URLs only to the hosts of `--allowed-media-domains` (none by default).
- Local files only under one folder: the input file's own folder by default (the input is the
  user's, and so are the files beside it), or the folder `--allowed-local-media-path` names
  instead (a parent widens it; another folder replaces it). Nothing outside that folder is
  read: a path is resolved first (`..` applied, symlinks followed), and one that leads out is
  refused. From standard input, no folder is allowed unless the flag names one.
- A relative path is taken from the input file's folder (from standard input: from the
  `--allowed-local-media-path` folder).

Each image is loaded (`vecpool.inputs.media.load_image`) and preprocessed by the engine's input
stage (`Engine.prepare_encode`) whole on one thread of a pool, so that a chunk's images are read
on every core while the engine runs the chunk before it; the texts of a mixed chunk are
tokenized together on the calling thread, as a chunk of texts is.
"""

from __future__ import annotations

import argparse
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vecpool.calls.outputs import PromptRequest
from vecpool.errors import InputError

if TYPE_CHECKING:
    from PIL import Image

    from vecpool.api import Engine
    from vecpool.inputs.media import MediaPolicy

# Lines (rows) per chunk with --image-field unless --chunk-size says otherwise: a CLIP
# ViT-B/16 image is 196 patch rows of 768 floats (0.6 MB), so a chunk of 256 holds about
# 150 MB of pixels, and a run holds about three chunks (read ahead, running, being written).
IMAGE_CHUNK_SIZE = 256

# Strings that are taken as paths without looking: these prefixes are the others' forms.
_NOT_PATHS = ("data:", "http://", "https://", "file:")
# A string base64 could spell (at least 16 characters): taken as a path only where that file
# exists (else the media loader reads it as base64 of an image, or as a path).
_BASE64_LIKE = re.compile(r"[A-Za-z0-9+/=_\-\s]{16,}")


def is_image_item(item: Any) -> bool:
    """Whether a chunk's input is an image (as the readers of `corpus.py` give one)."""
    return isinstance(item, dict) and "image" in item


@dataclass(frozen=True)
class ImageField:
    """How the image field's values are read: under `policy`, relative paths taken from
    `base` (the input file's folder; None: from the policy's folder), `threads` at once in each
    engine process. `input_folder`: the policy's folder is the input file's own (no
    --allowed-local-media-path), as a refusal says."""

    policy: MediaPolicy
    base: Path | None
    threads: int
    input_folder: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace, threads: int) -> ImageField:
        """The field of `vecpool embed`'s options (the media options, --input); a flag's
        mistake (a folder that is not one) raises `ConfigError`."""
        from vecpool.api.args import EngineArgs

        policy = EngineArgs.from_cli_args(args).media_policy()
        base = Path(args.input).absolute().parent if args.input != "-" else None
        input_folder = base is not None and args.allowed_local_media_path is None
        if input_folder:
            policy = replace(policy, allowed_local_media_path=base)
        return cls(policy, base, threads, input_folder)

    def locate(self, value: str) -> str | Path:
        """A string value as the media loader takes it: a path (relative ones joined to
        `base`) as a `Path`, read as nothing but a path; every other form as it is. A string
        base64 could spell (JPEG's begins '/9j/') is a path only where that file exists."""
        text = value.strip()
        if text.lower().startswith(_NOT_PATHS):
            return text
        if os.path.isabs(text):
            path = Path(text)
        elif self.base is not None:
            path = self.base / text
        else:
            return text  # the loader's own rule: base64, else a path in the policy's folder
        if _BASE64_LIKE.fullmatch(text) and not os.path.lexists(path):
            return text
        return path

    def load(self, value: str | bytes) -> Image.Image:
        """The decoded image of one value; `InputError` saying why it cannot be read."""
        from vecpool.inputs.media import load_image

        try:
            return load_image(self.locate(value) if isinstance(value, str) else value, self.policy)
        except InputError as exc:
            if not self.input_folder:
                raise
            # The folder the loader calls --allowed-local-media-path is the input's own here.
            folder = f"the input file's folder {str(self.policy.allowed_local_media_path)!r}"
            reason = exc.reason.replace(
                "the allowed --allowed-local-media-path",
                f"{folder} (--allowed-local-media-path names another)",
            ).replace(" under --allowed-local-media-path", "")
            raise InputError(reason, exc.index, exc.field) from None


class ImageReading:
    """A chunk's images read into requests on a pool of `field.threads` threads (made at the
    first chunk that has images; `close` ends it)."""

    def __init__(self, field: ImageField):
        self.field = field
        self._pool: ThreadPoolExecutor | None = None

    def submit(
        self, engine: Engine, keywords: dict[str, Any], images: list[tuple[int, Any]]
    ) -> list[Future[PromptRequest]]:
        """Each `(index in the chunk, value)` read and preprocessed into the request of an
        `Engine.prepare_encode(..., **keywords)` call, indexed by its place in the chunk; a
        failure is its `InputError` at that index."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.field.threads, thread_name_prefix="vecpool-image")
        return [self._pool.submit(self._read, engine, keywords, i, v) for i, v in images]

    def _read(self, engine: Engine, keywords: dict[str, Any], index: int, value: Any) -> Any:
        try:
            call = engine.prepare_encode([self.field.load(value)], **keywords)
        except InputError as exc:
            raise exc.at(index) from None
        (request,) = call.requests
        return PromptRequest(index, request.prompt, request.params)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
