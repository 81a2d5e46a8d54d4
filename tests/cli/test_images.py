"""`vecpool embed --image-field`: images read from a JSONL field or a Parquet column in every
form (relative and absolute paths, data: URIs, base64, http(s) URLs to allowed hosts, bytes,
Hugging Face `{bytes, path}` structs), mixed with texts, equal to transformers'
`get_image_features` / `get_text_features` on the same weights; resumed equal to
uninterrupted; data parallel; a bad image reported by its line; the local-path rule.

Tolerance: 1e-5 of the largest output (`assert_rel_close`), fp32 on the CPU, as the engine's
image tests hold the towers to transformers (other kernel shapes: flat batches, a matrix
product for the patch convolution). The vectors are the CLI's: L2-normalized, as this CLIP
folder's engine does by default, and so are the references.
"""

from __future__ import annotations

import base64
import functools
import http.server
import io
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import vecpool
from tests.cli.corpus_data import embed, vectors_of
from tests.helpers import assert_rel_close
from tests.image_models import (
    CLIP,
    encoded,
    hf_image_features,
    hf_text_features,
    sample_images,
    save_tiny_dual_encoder,
)
from vecpool.cli.output import WorkFolder

TEXTS = ["a photo of a cat", "two red cars on the sea"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[vecpool.Engine, Any, Path]:
    path = tmp_path_factory.mktemp("clip") / "model"
    hf = save_tiny_dual_encoder(path, CLIP)
    engine = vecpool.Engine(path, device="cpu")
    assert engine.defaults.normalize  # the CLI's vectors are unit vectors: see `unit`
    return engine, hf, path


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def image_reference(clip: Any, images: list[Image.Image]) -> np.ndarray:
    _, hf, path = clip
    return unit(hf_image_features(hf, path, images))


def text_reference(clip: Any, texts: list[str]) -> np.ndarray:
    _, hf, path = clip
    return unit(hf_text_features(hf, path, texts))


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP server on 127.0.0.1 serving a folder: (its base URL, the folder)."""
    folder = tmp_path / "www"
    folder.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", folder
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_jsonl_every_image_form_mixed_with_texts(
    clip: Any, tmp_path: Path, served: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    engine = clip[0]
    url, www = served
    images = sample_images(5)
    pngs = [encoded(image) for image in images]
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    (data / "img" / "a.png").write_bytes(pngs[0])
    (data / "img" / "b.png").write_bytes(pngs[1])
    (www / "e.png").write_bytes(pngs[4])
    jpeg = encoded(images[3], "JPEG")
    source = write_jsonl(
        data / "list.jsonl",
        [
            {"image": "img/a.png", "id": "relative"},
            {"text": TEXTS[0], "id": "text"},
            {"image": str(data / "img" / "b.png"), "id": "absolute"},
            {"image": "data:image/png;base64," + b64(pngs[2]), "id": "data-uri"},
            {"image": b64(jpeg), "id": "base64"},
            {"text": TEXTS[1], "id": "text 2"},
            {"image": f"{url}/e.png", "id": "url"},
        ],
    )
    out = tmp_path / "out.parquet"
    args = ["-i", str(source), "-o", str(out), "--image-field", "image", "--id-field", "id"]
    args += ["--chunk-size", "3", "-q"]
    assert embed(engine, *args, "--allowed-media-domains", "127.0.0.1") == 0
    table = pq.read_table(out)
    assert table["index"].to_pylist() == list(range(7))
    assert table["id"].to_pylist()[:3] == ["relative", "text", "absolute"]
    vectors = vectors_of(out)
    decoded_jpeg = Image.open(io.BytesIO(jpeg))
    shown = [images[0], images[1], images[2], decoded_jpeg, images[4]]
    assert_rel_close(vectors[[0, 2, 3, 4, 6]], image_reference(clip, shown))
    assert_rel_close(vectors[[1, 5]], text_reference(clip, TEXTS))
    # Without the host allowed, the URL line is refused, named by its line.
    out.unlink()
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("vecpool: error: line 7: image URLs are refused (127.0.0.1)"), err


@pytest.mark.parametrize("kind", ["binary", "paths", "struct"])
def test_parquet_image_columns(
    clip: Any, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A binary column of encoded images, a string column of paths (relative to the file's
    folder), and Hugging Face datasets' `{bytes, path}` struct (bytes first, else the path);
    a `text` column beside it mixes texts in (one of the two per row; null both: blank)."""
    engine = clip[0]
    images = sample_images(4, seed=1)
    pngs = [encoded(image) for image in images]
    for i, png in enumerate(pngs):
        (tmp_path / f"{i}.png").write_bytes(png)
    column: pa.Array
    if kind == "binary":
        column = pa.array([pngs[0], None, pngs[1], pngs[2], None, pngs[3]], pa.binary())
    elif kind == "paths":
        column = pa.array(["0.png", None, "1.png", str(tmp_path / "2.png"), None, "3.png"])
    else:
        struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        column = pa.array(
            [
                {"bytes": pngs[0], "path": "ignored.png"},
                None,
                {"bytes": None, "path": "1.png"},
                {"bytes": pngs[2], "path": None},
                None,
                {"bytes": pngs[3], "path": "3.png"},
            ],
            struct,
        )
    texts = [None, TEXTS[0], None, None, None, None]  # row 5 holds nothing
    source = tmp_path / "images.parquet"
    pq.write_table(pa.table({"doc": list(range(6)), "picture": column, "text": texts}), source)
    out = tmp_path / "out.npy"
    args = ["-i", str(source), "-o", str(out), "--image-field", "picture", "--chunk-size", "4"]
    assert embed(engine, *args, "-q") == 2
    assert "row 5: blank input (--skip-empty skips these)" in capsys.readouterr().err
    assert embed(engine, *args, "--skip-empty") == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("wrote 5 embeddings") and "(5 inputs (4 images)" in summary
    assert "images/s" in summary
    np.testing.assert_array_equal(np.load(tmp_path / "out.index.npy"), [0, 1, 2, 3, 5])
    vectors = np.load(out)
    assert_rel_close(vectors[[0, 2, 3, 4]], image_reference(clip, images))
    assert_rel_close(vectors[[1]], text_reference(clip, TEXTS[:1]))


def test_a_line_or_row_holding_both_a_text_and_an_image_is_refused(
    clip: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = encoded(sample_images(1)[0])
    source = tmp_path / "both.parquet"
    table = pa.table({"image": pa.array([png, png], pa.binary()), "text": [None, "a cat"]})
    pq.write_table(table, source)
    out = tmp_path / "out.npy"
    args = ["-o", str(out), "--image-field", "image", "-q"]
    assert embed(clip[0], "-i", str(source), *args) == 2
    err = capsys.readouterr().err
    assert err == (
        "vecpool: error: row 2: both 'image' and 'text' hold a value; a row holds one input\n"
    )
    jsonl = write_jsonl(tmp_path / "both.jsonl", [{"image": b64(png), "text": "a cat"}])
    assert embed(clip[0], "-i", str(jsonl), *args) == 2
    err = capsys.readouterr().err
    assert err == (
        "vecpool: error: line 1: both 'image' and 'text' are given; a line holds one input\n"
    )


def test_windowed_texts_beside_images(clip: Any, tmp_path: Path) -> None:
    """With --windowed-embed, a chunk's long texts are windowed and its images are not."""
    _, _, path = clip
    engine = vecpool.Engine(path, device="cpu", windowed_embed=True)
    images = sample_images(2, seed=7)
    long_text = " ".join(["a photo of a cat on the sea"] * 12)  # over 32 positions
    rows = [
        {"image": b64(encoded(images[0]))},
        {"text": long_text},
        {"image": b64(encoded(images[1]))},
    ]
    source = write_jsonl(tmp_path / "list.jsonl", rows)
    out = tmp_path / "out.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "--image-field", "image", "-q") == 0
    vectors = np.load(out)
    assert_rel_close(vectors[[1]], engine.embed([long_text]))
    assert_rel_close(vectors[[0, 2]], image_reference(clip, images))


def interrupt_after(monkeypatch: pytest.MonkeyPatch, parts: int) -> None:
    """Make the run stop like Ctrl-C once `parts` parts are committed."""
    original = WorkFolder.add_part

    def add_part(self: WorkFolder, *args: Any) -> None:
        if len(self.parts) == parts:
            raise KeyboardInterrupt
        original(self, *args)

    monkeypatch.setattr(WorkFolder, "add_part", add_part)


def test_resumed_run_equals_an_uninterrupted_one(
    clip: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = clip[0]
    images = sample_images(5, seed=2)
    rows: list[dict[str, Any]] = []
    for i, image in enumerate(images):
        (tmp_path / f"{i}.png").write_bytes(encoded(image))
        rows += [{"image": f"{i}.png", "n": i}, {"text": TEXTS[i % 2], "n": 10 + i}]
    source = write_jsonl(tmp_path / "list.jsonl", rows)
    args = ["-i", str(source), "--image-field", "image", "--id-field", "n", "--chunk-size", "3"]
    whole = tmp_path / "whole.jsonl"
    assert embed(engine, *args, "-o", str(whole), "-q") == 0

    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        assert embed(engine, *args, "-o", str(out), "-q") == 130
    assert not out.exists()
    assert "6 lines are saved" in capsys.readouterr().err
    seen: list[int] = []
    original = engine.prepare_encode

    def counting(inputs: list[Any], **kwargs: Any) -> Any:
        seen.append(len(inputs))
        return original(inputs, **kwargs)

    monkeypatch.setattr(engine, "prepare_encode", counting)
    assert embed(engine, *args, "-o", str(out)) == 0
    assert "resuming" in capsys.readouterr().err
    # Lines 7..10 only: the texts of a chunk in one call, each image in a call of its own.
    assert sorted(seen) == [1, 1, 1, 1]
    assert [json.loads(line)["n"] for line in out.read_text().splitlines()] == [
        row["n"] for row in rows
    ]
    # The same chunks, each prepared and run alone by the same engine: equal to the bit.
    assert out.read_text() == whole.read_text()
    vectors = np.array([json.loads(line)["embedding"] for line in out.read_text().splitlines()])
    assert_rel_close(vectors[0::2], image_reference(clip, images))


def test_data_parallel_equals_one_process(clip: Any, tmp_path: Path) -> None:
    engine, _, model = clip
    images = sample_images(5, seed=4)
    rows: list[dict[str, Any]] = [
        {"image": "data:image/png;base64," + b64(encoded(image))} for image in images
    ]
    rows.insert(2, {"text": TEXTS[0]})
    source = write_jsonl(tmp_path / "list.jsonl", rows)
    single, parallel = tmp_path / "single.npy", tmp_path / "parallel.npy"
    args = ["-i", str(source), "--image-field", "image", "--chunk-size", "2", "-q"]
    assert embed(engine, *args, "-o", str(single)) == 0
    dp = ["--device", "cpu", "--data-parallel-size", "2", "--image-threads", "1"]
    assert embed(None, str(model), *args, "-o", str(parallel), *dp) == 0
    # The same chunks; the engine processes use fewer threads each: fp32 rounding at most.
    assert np.abs(np.load(parallel) - np.load(single)).max() < 1e-6
    assert_rel_close(np.load(single)[[0, 1, 3, 4, 5]], image_reference(clip, images))


def test_a_bad_image_fails_the_run_naming_its_line_alone(
    clip: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a bad text line does: one line naming the first bad line (3 here; 5 is bad too, and
    read on another thread, maybe first) and why; exit 2; nothing written or kept to resume."""
    engine = clip[0]
    png = encoded(sample_images(1)[0])
    (tmp_path / "good.png").write_bytes(png)
    (tmp_path / "broken.png").write_bytes(png[:60])
    rows: list[dict[str, Any]] = [
        {"image": "good.png"},
        {"text": TEXTS[0]},
        {"image": "broken.png"},
        {"image": "good.png"},
        {"image": "missing.png"},
    ]
    source = write_jsonl(tmp_path / "list.jsonl", rows)
    out = tmp_path / "out.npy"
    args = ["-i", str(source), "-o", str(out), "--image-field", "image", "-q"]
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("vecpool: error: line 3: the image file ") and err.count("\n") == 1
    assert "broken.png" in err and "corrupt or truncated PNG" in err, err
    assert not out.exists() and not out.with_name("out.npy.partial").exists()

    rows[2] = {"image": "good.png"}
    write_jsonl(source, rows)
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("vecpool: error: line 5: no image file ") and "missing.png" in err
    assert "--allowed-local-media-path" not in err and err.count("\n") == 1

    rows[4] = {"image": 7}
    write_jsonl(source, rows)
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert err == (
        "vecpool: error: line 5: 'image' must be a string (a path, URL, data: URI or base64), "
        "got integer\n"
    )


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink"])
def test_a_path_outside_the_input_folder_is_refused(
    clip: Any, tmp_path: Path, escape: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Paths under the input file's folder are read by default; one that leads out of it
    (`..`, an absolute path, a symlink) is refused unless --allowed-local-media-path names a
    folder holding it."""
    engine = clip[0]
    (image,) = sample_images(1, seed=5)
    (tmp_path / "outside.png").write_bytes(encoded(image))
    data = tmp_path / "data"
    data.mkdir()
    (data / "link.png").symlink_to(tmp_path / "outside.png")
    value = {
        "dotdot": "../outside.png",
        "absolute": str(tmp_path / "outside.png"),
        "symlink": "link.png",
    }[escape]
    source = write_jsonl(data / "list.jsonl", [{"text": TEXTS[0]}, {"image": value}])
    out = tmp_path / "out.npy"
    args = ["-i", str(source), "-o", str(out), "--image-field", "image", "-q"]
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("vecpool: error: line 2: the path ") and err.count("\n") == 1
    assert f"is outside the input file's folder {str(data.resolve())!r}" in err, err
    assert not out.exists()
    # Widened to the parent, the same line is read.
    assert embed(engine, *args, "--allowed-local-media-path", str(tmp_path)) == 0
    assert_rel_close(np.load(out)[1:], image_reference(clip, [image]))
    # Set to another folder, the input's own is no longer allowed either.
    other = tmp_path / "other"
    other.mkdir()
    (data / "inside.png").write_bytes(encoded(image))
    write_jsonl(source, [{"image": "inside.png"}])
    assert embed(engine, *args, "--overwrite", "--allowed-local-media-path", str(other)) == 2
    err = capsys.readouterr().err
    assert "line 1: the path " in err and "outside the allowed --allowed-local-media-path" in err


def test_standard_input_reads_local_files_only_under_the_flag(
    clip: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = clip[0]
    (image,) = sample_images(1, seed=6)
    (tmp_path / "a.png").write_bytes(encoded(image))
    lines = (json.dumps({"image": "a.png"}) + "\n").encode()
    out = tmp_path / "out.npy"
    args = ["-i", "-", "--format", "jsonl", "-o", str(out), "--image-field", "image", "-q"]

    def stdin() -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))

    stdin()
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("vecpool: error: line 1: local image paths are refused ('a.png')")
    stdin()
    assert embed(engine, *args, "--allowed-local-media-path", str(tmp_path)) == 0
    assert_rel_close(np.load(out), image_reference(clip, [image]))


def test_options_are_checked_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, jsonl = tmp_path / "list.txt", tmp_path / "list.jsonl"
    text.write_text("a.png\n")
    jsonl.write_text('{"image": "a.png"}\n')
    out = str(tmp_path / "out.npy")
    cases = [
        ([str(text), "--image-field", "image"], "--image-field needs JSONL or Parquet input"),
        ([str(jsonl), "--image-field", "text"], "--image-field and --field name the same"),
        ([str(jsonl), "--image-threads", "2"], "--image-threads needs --image-field"),
        ([str(jsonl), "--image-field", "image", "--image-threads", "0"], "at least 1"),
        (
            [str(jsonl), "--image-field", "image", "--allowed-local-media-path", out],
            "--allowed-local-media-path",
        ),
    ]
    for extra, message in cases:
        assert embed(None, "-o", out, "-i", *extra, "--device", "cpu") == 2
        err = capsys.readouterr().err
        assert err.startswith("vecpool: error: ") and message in err and err.count("\n") == 1, err


def test_a_model_without_an_image_tower_is_refused_before_reading(
    engine: vecpool.Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "list.jsonl", [{"image": "missing.png"}])
    out = tmp_path / "out.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "--image-field", "image") == 2
    err = capsys.readouterr().err
    assert err == (
        "vecpool: error: --image-field: this model has no image tower (it embeds text only; "
        "CLIP and SigLIP models embed images)\n"
    )
    assert not os.path.exists(out)
