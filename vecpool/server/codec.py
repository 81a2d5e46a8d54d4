"""Wire formats: request inputs in (strings, token arrays, base64 prompt embeds, images in each
peer's shape), vectors out.

Prompt embeds arrive as base64 of a `.npy` file (read with `allow_pickle=False`) or of a
`torch.save` tensor (the vLLM client convention; read without torch by `torch_save`, which
knows only what a plain tensor holds). Vectors leave
as float lists, or as bytes (base64, or the raw body of vLLM's `bytes` format) of float32 /
float16 / bfloat16 / fp8 values in the byte order asked for, or of quantized int8 / uint8.

Images come as the peers write them: Jina's `{"image": ...}` item, a content part
`{"type": "image_url", "image_url": {"url": ...}}` (vLLM's messages, score and rerank items;
Cohere's `inputs`), a list of sources (Infinity's `modality: "image"`, Cohere's `images`), or a
`data:image/` URI string anywhere a text goes. Each becomes an `ImageItem` holding its source (a
URL, a data: URI, base64 or a path) as sent: the model's image reader loads it under the media
policy when the call is prepared, off the event loop (`carries_images`).
"""

from __future__ import annotations

import base64
import binascii
import io
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from vecpool.errors import InputError
from vecpool.inputs.images import DATA_IMAGE_PREFIX
from vecpool.server.errors import ApiError
from vecpool.server.floats import FORMATS, format_bytes, round_to_format
from vecpool.server.protocol import INPUT_DOC, EmbedDtype, EncodingFormat, Endianness
from vecpool.server.torch_save import FLOAT_DTYPES, SavedTensor, TorchSaveError, read_torch_save

_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class EncodedEmbeds:
    """A `{"prompt_embeds": "<base64>"}` input, not decoded yet."""

    data: str


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ImageItem:
    """An input the request's shape says is an image, not read yet: its source as sent (a
    URL, a data: URI, base64 or a local path)."""

    source: str


@dataclass(frozen=True)
class PartsItem:
    """An input of text and image parts together, in order (a vision-language model reads
    them as one prompt), its images not read yet."""

    parts: tuple[str | ImageItem, ...]


Item = str | list[int] | dict[str, Any] | EncodedEmbeds | ImageItem | PartsItem

_OBJECT_INPUTS = (
    '{"prompt_embeds": "<base64>"}, {"text": ..., "text_pair": ...} or '
    '{"image": "<URL, data: URI or base64>"} ({"text": ...} beside images, for a model with '
    "an image tower)"
)


def parse_inputs(value: Any, name: str = "input", *, text_objects: bool = False) -> list[Item]:
    """The items of an `input` field, in order; `InputError` naming the first bad one.
    `text_objects`: Jina's `{"text": ...}` items are texts (its multimodal form, beside
    `{"image": ...}` items, for a model with an image tower); else they are refused."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise InputError(f"expected {INPUT_DOC}; got {json_type(value)}", field=name)
    if not value:
        raise InputError("the list is empty", field=name)
    if all(_is_int(v) for v in value):
        return [value]  # one token array
    items: list[Item] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, list):
            bad = [v for v in item if not _is_int(v)]
            if bad:
                raise InputError(
                    f"a token array holds integers only, found {json_type(bad[0])}", index=i
                )
            items.append(item)
        elif isinstance(item, dict) and set(item) == {"text", "text_pair"}:
            items.append(item)  # a text pair (cross-encoders, pair classifiers)
        elif isinstance(item, dict) and set(item) in ({"text"} if text_objects else (), {"image"}):
            ((key, data),) = item.items()
            if not isinstance(data, str):
                raise InputError(f"expected a string, got {json_type(data)}", index=i, field=key)
            items.append(data if key == "text" else ImageItem(data))
        elif isinstance(item, dict):
            if set(item) != {"prompt_embeds"}:
                raise InputError(
                    f"an object input must be {_OBJECT_INPUTS}, got keys {sorted(item)}",
                    index=i,
                )
            data = item["prompt_embeds"]
            if not isinstance(data, str):
                raise InputError(
                    f"expected a base64 string, got {json_type(data)}",
                    index=i,
                    field="prompt_embeds",
                )
            items.append(EncodedEmbeds(data))
        else:
            hint = " (to mix token arrays with other inputs, wrap each in its own list)"
            raise InputError(
                "expected a string, a token array or a prompt_embeds object, got "
                f"{json_type(item)}{hint if _is_int(item) else ''}",
                index=i,
            )
    return items


def decode_inputs(items: list[Item]) -> list[Any]:
    """Engine inputs: prompt embeds decoded to `{"prompt_embeds": tensor}`, an image to
    `{"image": source}` (read by the input stage), the rest as is."""
    return [
        {"prompt_embeds": decode_prompt_embeds(item.data, i)}
        if isinstance(item, EncodedEmbeds)
        else engine_input(item)
        for i, item in enumerate(items)
    ]


def engine_input(item: Any) -> Any:
    """An item as the engine's input stage takes it: an `ImageItem` as `{"image": source}`,
    a `PartsItem` as a list of parts (`vecpool.inputs.vision_prompts`)."""
    if isinstance(item, PartsItem):
        return [
            {"type": "image", "image": part.source}
            if isinstance(part, ImageItem)
            else {"type": "text", "text": part}
            for part in item.parts
        ]
    return {"image": item.source} if isinstance(item, ImageItem) else item


def carries_images(items: Any) -> bool:
    """Whether any of `items` is an image (an `ImageItem`, or a `data:image/` URI string, which
    the input stage reads as one): such a call is prepared off the event loop, whatever its
    size, and its URL fetches end at the request's deadline."""
    return any(
        isinstance(item, ImageItem | PartsItem)
        or (isinstance(item, str) and item.startswith(DATA_IMAGE_PREFIX))
        for item in items
    )


def invalid_input(where: str, message: str) -> ApiError:
    """The 400 for a malformed input: `message` about the input at `where` (its path in the
    body: `input[2]`, `documents[0].content[1]`)."""
    return ApiError(400, f"{where}: {message}", param=where, code="invalid_input")


def image_sources(value: Any, name: str) -> list[ImageItem]:
    """A list of image sources (Infinity's `input` with `modality: "image"`, Cohere's
    `images`): each a string; a 400 naming the first that is not."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise invalid_input(name, "expected a list of image URLs, data: URIs or base64 strings")
    for i, source in enumerate(values):
        if not isinstance(source, str):
            raise invalid_input(
                f"{name}[{i}]",
                f"expected an image URL, data: URI or base64 string, got {json_type(source)}",
            )
    return [ImageItem(source) for source in values]


def content_item(parts: Any, where: str, *, together: bool = False) -> str | ImageItem | PartsItem:
    """One input written as content parts (vLLM's message content and `{"content": [...]}`
    score and rerank items, Cohere's `inputs`): text parts `{"type": "text", "text": ...}`
    are one text, joined by new lines (as vLLM joins them); one image part
    `{"type": "image_url", "image_url": {"url": ...}}` is an image. A dual encoder embeds a
    text or an image, so an image with anything else beside it is a 400 naming `where`;
    `together` (a vision-language model) reads such parts as one `PartsItem`."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not parts:
        raise invalid_input(where, "expected a string or a non-empty list of content parts")
    read = [_content_part(part, f"{where}[{j}]") for j, part in enumerate(parts)]
    images = [j for j, part in enumerate(read) if isinstance(part, ImageItem)]
    if not images:
        return "\n".join(read)  # type: ignore[arg-type]  # text parts only
    if len(read) > 1 and together:
        return PartsItem(tuple(read))
    if len(read) > 1:
        at = f"{where}[{images[0]}]"
        raise invalid_input(
            at,
            f"an image part must be an input's only part: the model embeds a text or "
            f"an image, not several parts together ({len(read)} parts here); send each as "
            "an input of its own",
        )
    return read[0]


def _content_part(part: Any, where: str) -> str | ImageItem:
    if isinstance(part, dict) and part.get("type") == "text":
        text = part.get("text")
        if set(part) != {"type", "text"} or not isinstance(text, str):
            raise invalid_input(where, 'a text part is {"type": "text", "text": "<string>"}')
        return text
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_url":
        image = part.get("image_url") if set(part) == {"type", "image_url"} else None
        if isinstance(image, str):  # the URL alone, as vLLM also takes it
            return ImageItem(image)
        # OpenAI's {"url", "detail"}: "detail" tunes a chat model's tiling, which a dual
        # encoder's fixed-size input has none of; accepted and not used.
        if isinstance(image, dict) and set(image) <= {"url", "detail"}:
            url = image.get("url")
            if isinstance(url, str):
                return ImageItem(url)
        raise invalid_input(
            where,
            'an image part is {"type": "image_url", "image_url": {"url": '
            '"<URL, data: URI or base64>"}}',
        )
    raise invalid_input(
        where,
        'a content part is {"type": "text", "text": ...} or {"type": '
        '"image_url", "image_url": {"url": ...}}, got '
        + (f"type {kind!r}" if isinstance(kind, str) else json_type(part)),
    )


def decode_prompt_embeds(data: str, index: int) -> np.ndarray:
    """A `[num_tokens, hidden]` float array from base64 `.npy` or `torch.save` bytes (a
    bfloat16 tensor widened to float32: exact; the engine rounds every input to its dtype).

    Decoding errors are ours; shape against the model, NaN and length are the engine's checks.
    """

    def fail(reason: str) -> InputError:
        return InputError(reason, index=index, field="prompt_embeds")

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise fail("not valid base64") from None
    if raw.startswith(_NPY_MAGIC):
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as exc:  # numpy raises many types for corrupt files
            raise fail(f"cannot read the .npy data: {exc}") from None
        if not isinstance(array, np.ndarray):
            raise fail(f"the .npy data holds a {type(array).__name__}, not an array")
        if array.dtype.kind != "f":
            raise fail(f"expected a float array, got dtype {array.dtype}")
        if array.ndim != 2:
            raise fail(f"expected a 2-D array [num_tokens, hidden], got shape {list(array.shape)}")
        return array.astype(array.dtype.newbyteorder("="), copy=False)
    try:
        tensor = read_torch_save(raw)
    except TorchSaveError as exc:
        raise fail(f"neither .npy nor torch.save data ({exc})") from None
    if not isinstance(tensor, SavedTensor):
        raise fail(f"the torch.save data holds a {type(tensor).__name__}, not a tensor")
    if tensor.dtype not in FLOAT_DTYPES:
        raise fail(f"expected a dense float tensor, got torch.{tensor.dtype}")
    if tensor.array.ndim != 2:
        raise fail(
            f"expected a 2-D tensor [num_tokens, hidden], got shape {list(tensor.array.shape)}"
        )
    return tensor.array


def encode_array(
    array: np.ndarray,
    encoding: EncodingFormat,
    dtype: EmbedDtype = "float32",
    endianness: Endianness = "native",
) -> Any:
    """A vector (or `[n, dim]` array) as nested lists (floats rounded to `dtype`; quantized
    integers as they are) or as base64 of its bytes (`to_bytes`)."""
    if encoding != "float":
        return base64.b64encode(to_bytes(array, dtype, endianness)).decode("ascii")
    if array.dtype.kind == "f" and dtype != "float32":
        array = round_to(array, dtype)
        if not np.isfinite(array).all():  # JSON has no infinity (the bytes formats do)
            raise InputError(
                f"a value of this output overflows {dtype}, which JSON cannot carry; ask for "
                "embed_dtype float32, or an encoding_format of bytes",
                field="embed_dtype",
            )
    return array.tolist()


def to_bytes(array: np.ndarray, dtype: EmbedDtype, endianness: Endianness = "native") -> bytes:
    """The bytes of `array` in `dtype` (float arrays; a quantized int8 / uint8 array is one
    byte per value as it is), row-major, in the byte order `endianness` ("native": this
    machine's, as vLLM defines it)."""
    if array.dtype.kind in "iu":
        return np.ascontiguousarray(array).tobytes()
    order = "<" if (sys.byteorder if endianness == "native" else endianness) == "little" else ">"
    if dtype in FORMATS:  # bfloat16, fp8: formats numpy lacks
        return format_bytes(np.ascontiguousarray(array, dtype=np.float32), FORMATS[dtype], order)
    float_type = f"{order}f2" if dtype == "float16" else f"{order}f4"
    return np.ascontiguousarray(array, dtype=float_type).tobytes()


def round_to(array: np.ndarray, dtype: EmbedDtype) -> np.ndarray:
    """`array` rounded to `dtype` and back to float32."""
    if dtype in FORMATS:
        return round_to_format(np.asarray(array, dtype=np.float32), FORMATS[dtype])
    if dtype == "float16":
        with np.errstate(over="ignore"):  # past float16's range: inf, which callers check
            return array.astype(np.float16).astype(np.float32)
    return array
