"""The torch-free wire formats of the API processes, against torch itself: bfloat16 / FP8
rounding and bytes (`server/floats.py`), reading `torch.save` data (`server/torch_save.py`),
and writing JSON answers (`routes/common.py`).
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

import numpy as np
import pytest
import torch

from vecpool.config import SEQUENCE_METHODS
from vecpool.errors import InputError
from vecpool.inputs.prompts import InputLimits, InputProcessor, TextOptions
from vecpool.server.floats import FORMATS, format_bytes, round_to_format
from vecpool.server.torch_save import SavedTensor, TorchSaveError, read_torch_save

TORCH_TYPES = {
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def _values() -> np.ndarray:
    """Every binade the formats have, their edges, ties, overflow and non-finite values."""
    rng = np.random.default_rng(0)
    scales = [1e-9, 1e-5, 1e-3, 1.0, 30.0, 400.0, 5e4, 1e6, 1e38]
    spread = [rng.standard_normal(20_000) * s for s in scales]
    edges = [0.0, -0.0, 448, 464, 465, 480, 57344, 61439, 61440, 2.0**-10, 1.5 * 2.0**-9]
    edges += [3.3e38, float.fromhex("0x1.fep127"), float.fromhex("0x1.ff8p127")]
    edges += [float("inf"), -float("inf"), float("nan")]
    with np.errstate(over="ignore"):  # the largest scale overflows float32: inf, on purpose
        return np.concatenate([*spread, np.array(edges)]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rounding_and_bytes_match_torch(name: str) -> None:
    values = _values()
    expected = torch.from_numpy(values).to(TORCH_TYPES[name])
    np.testing.assert_array_equal(round_to_format(values, FORMATS[name]), expected.float().numpy())
    raw = expected.view(torch.uint8 if name != "bfloat16" else torch.int16).numpy()
    finite = np.isfinite(values)  # NaN's bit pattern is the format's choice
    width = 2 if name == "bfloat16" else 1
    got = np.frombuffer(format_bytes(values[finite], FORMATS[name]), dtype=f"<u{width}")
    np.testing.assert_array_equal(got, raw[finite].view(f"<u{width}"))


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_torch_save_reads_tensors_and_refuses_the_rest() -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int64):
        for saved in (tensor.to(dtype), tensor.to(dtype)[1:3, ::2], tensor.to(dtype).t()):
            got = read_torch_save(_saved(saved))
            assert isinstance(got, SavedTensor)
            assert got.dtype == str(dtype).removeprefix("torch.")
            widened = saved.float() if dtype == torch.bfloat16 else saved
            np.testing.assert_array_equal(got.array, widened.numpy())
    assert read_torch_save(_saved({"a": 1})) == {"a": 1}
    with pytest.raises(TorchSaveError, match="not a zip"):
        read_torch_save(b"hello")
    # A pickle naming anything but a plain tensor's parts is refused, never called. (Written
    # by hand: pickling a live function records whatever object that name holds now, which
    # another library may have replaced.)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("archive/data.pkl", b"cos\nsystem\n.")  # GLOBAL os.system, STOP
    with pytest.raises(TorchSaveError, match=r"unsupported global os\.system"):
        read_torch_save(buf.getvalue())
    raw = _saved(tensor)
    with pytest.raises(TorchSaveError):
        read_torch_save(raw[: len(raw) // 2])


def _deflated(raw: bytes) -> bytes:
    """`torch.save` data with its files compressed (torch stores them uncompressed)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as source, zipfile.ZipFile(out, "w") as archive:
        for info in source.infolist():
            archive.writestr(info.filename, source.read(info), zipfile.ZIP_DEFLATED)
    return out.getvalue()


def test_torch_save_never_holds_more_than_its_bytes_carry() -> None:
    """What the data declares (shapes, strides, sizes) never sizes what is built: an expanded
    view, a compressed file, or one storage's views rebuilt again and again are refused
    before their values are copied, however many rows they declare."""
    row = torch.arange(384, dtype=torch.float32)
    raw = _saved(row.expand(1_000_000, 384))  # 384 values stored, zero strides
    assert len(raw) < 4_000
    with pytest.raises(TorchSaveError, match=r"holds 384000000 values, more than its storage"):
        read_torch_save(raw)
    # A compressed file of 64 MB of zeros, in an archive of about 70 KB.
    raw = _deflated(_saved(torch.zeros(4096, 4096)))
    assert len(raw) < 200_000
    with pytest.raises(
        TorchSaveError, match=r"unpacks to 67108864 bytes, more than \d+, 4 times the archive"
    ):
        read_torch_save(raw)
    # 512 overlapping views of one 512 x 16 storage: 512 x 256 x 16 values from 68 KB.
    table = torch.zeros(512, 16)
    raw = _saved([table[i:] for i in range(512)])
    assert len(raw) < 100_000
    with pytest.raises(TorchSaveError, match="4 times the archive's size"):
        read_torch_save(raw)
    # What torch writes for real tensors still reads: a view of part of a storage, views
    # sharing one storage (read once), an empty tensor, and the same data compressed when
    # it fits the archive's size (random values do not compress).
    views = read_torch_save(_saved([table[:4], table[4:8, ::2], table[:0]]))
    assert [v.array.shape for v in views] == [(4, 16), (4, 8), (0, 16)]
    values = torch.randn(64, 384)
    got = read_torch_save(_deflated(_saved(values)))
    assert isinstance(got, SavedTensor)
    np.testing.assert_array_equal(got.array, values.numpy())


def test_the_pooling_methods_named_in_config_are_those_implemented() -> None:
    from vecpool.pooling.methods import METHODS

    assert tuple(METHODS) == SEQUENCE_METHODS


@pytest.mark.parametrize("model_dtype", ["float16", "bfloat16", "float32"])
def test_prompt_embeds_refused_exactly_where_the_model_dtype_overflows(model_dtype: str) -> None:
    """The input stage (no torch) refuses embeds that the engine's rounding to the model dtype
    would turn to inf, and only those: checked against torch's rounding at the boundary."""
    target = getattr(torch, model_dtype)
    limit = {"float16": 65520.0, "bfloat16": float.fromhex("0x1.ffp127")}.get(
        model_dtype, float.fromhex("0x1.ffffffp127")
    )
    candidates = [np.nextafter(limit, 0.0), limit, np.nextafter(limit, np.inf)]
    processor = InputProcessor(InputLimits(10, 2, 8, model_dtype, True), None)
    for value in candidates:
        embeds = np.array([[0.5, value]], dtype=np.float64)
        finite = bool(torch.isfinite(torch.from_numpy(embeds).to(target)).all())
        if finite:
            processor.process([{"prompt_embeds": embeds}], TextOptions())
        else:
            with pytest.raises(InputError, match="not finite in the model dtype"):
                processor.process([{"prompt_embeds": embeds}], TextOptions())


def test_json_floats_are_the_vectors_values_and_an_overflow_is_refused() -> None:
    """Responses are written by msgspec (`routes.common.dumps`): every float reads back as the
    very value (float32, and rounded to float16 / bfloat16) the standard library's JSON gives;
    a value that overflows the asked embed_dtype is refused by name, as JSON has no infinity."""
    import json

    from vecpool.server.codec import encode_array
    from vecpool.server.routes.common import dumps

    rng = np.random.default_rng(7)
    vector = (rng.standard_normal(1024) * 10.0 ** rng.integers(-8, 5, 1024)).astype(np.float32)
    vector[:4] = [0.0, -0.0, np.float32(1e-45), np.float32(1e38)]  # zeros, subnormal, large
    for dtype in ("float32", "float16", "bfloat16"):
        values = encode_array(
            vector if dtype != "float16" else vector.clip(-6e4, 6e4), "float", dtype
        )
        body = {"data": [{"embedding": values, "index": 0}], "usage": {"prompt_tokens": 3}}
        assert json.loads(dumps(body)) == json.loads(json.dumps(body, allow_nan=False))
        assert json.loads(dumps(values)) == values  # each float exactly
    with pytest.raises(InputError, match=r"^embed_dtype: a value of this output overflows float16"):
        encode_array(np.array([1.0, 7e4], dtype=np.float32), "float", "float16")


def _floats_in(value: Any) -> int:
    """How many floats a JSON-ready value holds (a `msgspec.Raw` holds encoded bytes: none)."""
    if isinstance(value, float):
        return 1
    if isinstance(value, list):
        return sum(_floats_in(v) for v in value)
    if isinstance(value, dict):
        return sum(_floats_in(v) for v in value.values())
    return 0


def test_a_large_answer_is_the_same_bytes_and_leaves_the_event_loop_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`render_vectors` encodes a large vector alone (msgspec.Raw) and copies it in: the
    answer is byte for byte that of one encoding, and no encoding holds more than one
    vector's values. An encoding holds the interpreter throughout (an event loop beside the
    rendering thread waits it out: 0.6 s for 190 MB in one, 0.12 s a vector at a time, on two
    cores); the loop runs between two encodings."""
    import json

    import msgspec

    from vecpool.server.protocol import PoolingParamsBody
    from vecpool.server.routes import common
    from vecpool.server.routes.common import Timings, dumps, render_vectors

    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal((256, 384)).astype(np.float32) for _ in range(24)]
    vectors.append(rng.standard_normal(8).astype(np.float32))  # a small one, encoded inline
    body = PoolingParamsBody()
    timings = Timings(num_inputs=len(vectors), prompt_tokens=9)
    encoded: list[int] = []  # the floats each encoding of the rendering held

    class Recorded:
        def encode(self, value: Any) -> bytes:
            encoded.append(_floats_in(value))
            return msgspec.json.encode(value)

    monkeypatch.setattr(common, "_JSON", Recorded())
    response = render_vectors(
        vectors, body, timings, prefix="p", item_object="pooling", key="data", model="m"
    )
    monkeypatch.undo()
    # One encoding per large vector, each of its values alone, then the answer around them
    # (holding the small vector's 8).
    assert encoded == [256 * 384] * 24 + [8]
    got = json.loads(bytes(response.body))
    assert [np.asarray(d["data"], np.float32).tobytes() for d in got["data"]] == [
        v.tobytes() for v in vectors
    ]
    whole = [{"object": "pooling", "index": i, "data": v.tolist()} for i, v in enumerate(vectors)]
    assert dumps({"data": got["data"]}) == dumps({"data": whole})
