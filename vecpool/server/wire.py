"""The messages between API-server processes and the engine process, as MessagePack.

An API process sends a `Submit` (one call: its prepared requests) or a `Cancel`; the engine
process answers each API process with `Replies`: every call of it that finished in a step (its
outputs, where its time went) or that the queue refused, and the queue's size. Arrays travel as
raw little-endian bytes with their shape and dtype: no pickle, nothing executable.
"""

from __future__ import annotations

import msgspec
import numpy as np

from vecpool.calls.outputs import PoolingOutput, PromptRequest
from vecpool.errors import EngineError, InputError, RequestFailedError, VecpoolError
from vecpool.inputs.pixels import ImagePixels, ImageSpan, PixelTable
from vecpool.inputs.prompts import Prompt
from vecpool.tasks import PoolingParams

_ERRORS: dict[str, type[VecpoolError]] = {
    "input": InputError,
    "request_failed": RequestFailedError,
    "engine": EngineError,
}


class WireImage(msgspec.Struct, array_like=True):
    """One image's patch rows (`ImagePixels`): float32 little-endian `[rows * cols, width]`,
    or the compact form, uint8 codes `[rows * cols, width]` with their table (`PixelTable`:
    float32 little-endian `[3, 256]` values, uint8 `[width]` channels, frames)."""

    grid: tuple[int, int]
    data: bytes
    values: bytes | None = None  # None: `data` is float rows
    channels: bytes | None = None
    frames: int = 1


class WireSpan(msgspec.Struct, array_like=True):
    """One image of a vision-language prompt (`ImageSpan`): its placeholder run and grid, and
    its patch rows or its precomputed rows (float32 `[num_tokens, hidden]`, little-endian)."""

    start: int
    num_tokens: int
    grid: tuple[int, int]
    pixels: WireImage | None
    rows: bytes | None


class WireRequest(msgspec.Struct, array_like=True):
    """One `PromptRequest`: its prompt's arrays as bytes, its parameters by position in the
    call's `params`."""

    index: int
    params: int
    token_ids: bytes | None  # int64
    token_type_ids: bytes | None  # int64
    embeds: bytes | None  # [num_tokens, hidden] in `embeds_dtype`, little-endian
    embeds_dtype: str | None
    embeds_shape: tuple[int, int] | None
    num_attended: int | None
    image: WireImage | None = None  # an image input's patch rows
    # A vision-language prompt's images, and its [3, num_tokens] int64 M-RoPE positions.
    spans: list[WireSpan] | None = None
    mrope_positions: bytes | None = None


class Submit(msgspec.Struct, tag=True, array_like=True):
    """Run one call's requests; answer with a `CallDone` (or `CallRefused`) of `call_id`."""

    call_id: int
    params: list[PoolingParams]
    requests: list[WireRequest]


class Cancel(msgspec.Struct, tag=True, array_like=True):
    """Drop a call's requests (its client went away); no answer follows."""

    call_id: int


class WireError(msgspec.Struct, array_like=True):
    kind: str  # a key of `_ERRORS`
    reason: str
    field: str | None


class WireOutput(msgspec.Struct, array_like=True):
    index: int
    data: bytes | None  # float32
    shape: tuple[int, ...] | None
    error: WireError | None
    num_prompt_tokens: int


class CallDone(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    outputs: list[WireOutput]
    queue: float  # seconds from arrival to the start of the call's first step
    inference: float  # seconds from that step's start to the call's last output


class CallRefused(msgspec.Struct, tag=True, array_like=True):
    """The queue could not take the call; nothing of it ran."""

    call_id: int
    reason: str


class Replies(msgspec.Struct, array_like=True):
    queued: int  # requests queued or running in the engine, all API processes together
    calls: list[CallDone | CallRefused]
    wait: float = 0.0  # seconds of work queued, at the engine's measured speed


ToEngine = Submit | Cancel
encoder = msgspec.msgpack.Encoder()
to_engine = msgspec.msgpack.Decoder(ToEngine)
replies = msgspec.msgpack.Decoder(Replies)


def _array_bytes(array: np.ndarray | None) -> bytes | None:
    return None if array is None else np.ascontiguousarray(array, dtype="<i8").tobytes()


def _array(data: bytes | None) -> np.ndarray | None:
    return None if data is None else np.frombuffer(data, dtype="<i8")


def submit(call_id: int, requests: list[PromptRequest]) -> Submit:
    """The message of one call's requests."""
    params: list[PoolingParams] = []
    wire = []
    for r in requests:
        if not params or params[-1] != r.params:
            params.append(r.params)
        p = r.prompt
        embeds = None if p.prompt_embeds is None else np.asarray(p.prompt_embeds)
        wire.append(
            WireRequest(
                index=r.index,
                params=len(params) - 1,
                token_ids=_array_bytes(p.token_ids),
                token_type_ids=_array_bytes(p.token_type_ids),
                embeds=None if embeds is None else _float_bytes(embeds),
                embeds_dtype=None if embeds is None else embeds.dtype.name,
                embeds_shape=None if embeds is None else (embeds.shape[0], embeds.shape[1]),
                num_attended=p.num_attended,
                image=None if p.image is None else _wire_image(p.image),
                spans=[_wire_span(span) for span in p.images] if p.images else None,
                mrope_positions=_array_bytes(p.mrope_positions),
            )
        )
    return Submit(call_id, params, wire)


def prompt_requests(message: Submit) -> list[PromptRequest]:
    """The requests of a `Submit`, as the API process prepared them."""
    out = []
    tables: dict[bytes, PixelTable] = {}  # a call's images share their processor's table
    for w in message.requests:
        embeds = None
        if w.embeds is not None:
            assert w.embeds_dtype is not None and w.embeds_shape is not None
            dtype = np.dtype(w.embeds_dtype).newbyteorder("<")
            embeds = np.frombuffer(bytearray(w.embeds), dtype=dtype).reshape(w.embeds_shape)
        image = None if w.image is None else _image(w.image, tables)
        prompt = Prompt(
            token_ids=_array(w.token_ids),
            prompt_embeds=embeds,
            token_type_ids=_array(w.token_type_ids),
            num_attended=w.num_attended,
            image=image,
            images=tuple(_span(span, tables) for span in w.spans or ()),
            mrope_positions=_positions(w.mrope_positions),
        )
        out.append(PromptRequest(w.index, prompt, message.params[w.params]))
    return out


def _positions(data: bytes | None) -> np.ndarray | None:
    """`[3, num_tokens]` int64 M-RoPE positions from their bytes."""
    return None if data is None else np.frombuffer(bytearray(data), dtype="<i8").reshape(3, -1)


def _wire_span(span: ImageSpan) -> WireSpan:
    def f32(array: np.ndarray | None) -> bytes | None:
        return None if array is None else np.ascontiguousarray(array, "<f4").tobytes()

    pixels = None if span.pixels is None else _wire_image(span.pixels)
    return WireSpan(span.start, span.num_tokens, span.grid, pixels, f32(span.rows))


def _span(w: WireSpan, tables: dict[bytes, PixelTable]) -> ImageSpan:
    pixels = None if w.pixels is None else _image(w.pixels, tables)
    rows = None
    if w.rows is not None:
        rows = np.frombuffer(bytearray(w.rows), dtype="<f4").reshape(w.num_tokens, -1)
    return ImageSpan(w.start, w.num_tokens, w.grid, pixels, rows)


def _wire_image(pixels: ImagePixels) -> WireImage:
    table = pixels.table
    if table is None:
        return WireImage(pixels.grid, np.ascontiguousarray(pixels.data, "<f4").tobytes())
    return WireImage(
        pixels.grid,
        np.ascontiguousarray(pixels.data).tobytes(),
        np.ascontiguousarray(table.values, "<f4").tobytes(),
        table.channels.tobytes(),
        table.frames,
    )


def _image(w: WireImage, tables: dict[bytes, PixelTable]) -> ImagePixels:
    """The `ImagePixels` of `w`; its table, when it has one, the same object as an equal one
    in `tables` (which it joins otherwise)."""
    num_patches = w.grid[0] * w.grid[1]
    if w.values is None:
        patches = np.frombuffer(bytearray(w.data), dtype="<f4")
        return ImagePixels(patches.reshape(num_patches, -1), w.grid)
    assert w.channels is not None
    values = np.frombuffer(bytearray(w.values), dtype="<f4").reshape(3, 256)
    channels = np.frombuffer(bytearray(w.channels), dtype=np.uint8)
    read = PixelTable(values.astype(np.float32), channels, w.frames)
    table = tables.setdefault(read.key, read)
    codes = np.frombuffer(bytearray(w.data), dtype=np.uint8)
    return ImagePixels(codes.reshape(num_patches, -1), w.grid, table)


def _float_bytes(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def wire_output(out: PoolingOutput) -> WireOutput:
    data = shape = error = None
    if out.data is not None:
        array = np.ascontiguousarray(out.data, dtype="<f4")
        data, shape = array.tobytes(), tuple(array.shape)
    if out.error is not None:
        kind = "engine"
        if isinstance(out.error, RequestFailedError):
            kind = "request_failed"
        elif isinstance(out.error, InputError):
            kind = "input"
        field = out.error.field if isinstance(out.error, InputError) else None
        reason = out.error.reason if isinstance(out.error, InputError) else str(out.error)
        error = WireError(kind, reason, field)
    return WireOutput(out.index, data, shape, error, out.num_prompt_tokens)


def pooling_output(w: WireOutput) -> PoolingOutput:
    data = None
    if w.data is not None:
        assert w.shape is not None
        data = np.frombuffer(w.data, dtype="<f4").reshape(w.shape)
    error: VecpoolError | None = None
    if w.error is not None:
        cls = _ERRORS[w.error.kind]
        if issubclass(cls, InputError):
            error = cls(w.error.reason, index=w.index, field=w.error.field)
        else:
            error = cls(w.error.reason)
    return PoolingOutput(w.index, data, error, w.num_prompt_tokens)
