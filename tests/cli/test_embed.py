"""`vecpool embed`: outputs equal `Engine.embed`, bad lines are named, the examples add up."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from vecpool import Engine
from vecpool.cli import main
from vecpool.cli.embed import PARAPHRASES, UNRELATED

TEXTS = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar.",
    "The stock market fell sharply today.",
    "How do I reset my password?",
    "Fresh bread is baked here every morning.",
    "The train to Paris was delayed by an hour.",
    "A kitten naps by the window.",
]
LONG_TEXT = "word " * 400  # ~400 tokens, over the default model's 256-token limit


def embed(engine: Engine, *args: str) -> int:
    """`vecpool embed ARGS` in this process, on the module's engine."""
    return main(["embed", *args], engine=engine)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def test_npy_equals_engine_embed_across_chunks(engine: Engine, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "texts.txt", TEXTS)
    out = tmp_path / "vectors.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "--chunk-size", "3", "-q") == 0
    vectors = np.load(out)
    assert vectors.dtype == np.float32
    assert max_diff(vectors, engine.embed(TEXTS)) < 1e-6


def test_parquet_rows_in_input_order_with_ids(engine: Engine, tmp_path: Path) -> None:
    ids = [f"doc-{i}" for i in range(len(TEXTS))]
    lines = [json.dumps({"id": i, "body": t, "extra": 1}) for i, t in zip(ids, TEXTS, strict=True)]
    source = write_lines(tmp_path / "docs.jsonl", lines)  # JSONL by the suffix
    out = tmp_path / "docs.parquet"
    args = ["-i", str(source), "-o", str(out), "--field", "body", "--id-field", "id"]
    assert embed(engine, *args, "--chunk-size", "3", "-q") == 0
    table = pq.read_table(out)
    assert table.column_names == ["index", "id", "embedding"]
    assert pq.ParquetFile(out).num_row_groups == 3  # one per chunk: 3 + 3 + 1
    assert table["index"].to_pylist() == list(range(len(TEXTS)))
    assert table["id"].to_pylist() == ids
    vectors = np.array(table["embedding"].to_pylist(), dtype=np.float32)
    assert max_diff(vectors, engine.embed(TEXTS)) < 1e-6


def test_jsonl_token_ids_equal_embedding_the_ids(engine: Engine, tmp_path: Path) -> None:
    token_ids = [engine.tokenize(t) for t in TEXTS[:4]]
    lines = [json.dumps({"prompt_token_ids": ids}) for ids in token_ids[:3]]
    lines.append(json.dumps(TEXTS[3]))  # a bare JSON string is a text input
    source = write_lines(tmp_path / "ids.txt", lines)
    out = tmp_path / "ids.npy"
    assert embed(engine, "-i", str(source), "--format", "jsonl", "-o", str(out), "-q") == 0
    expected = engine.embed([{"prompt_token_ids": ids} for ids in token_ids])
    assert max_diff(np.load(out), expected) < 1e-6


def test_dimensions_gives_unit_vectors_of_that_size(engine: Engine, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "texts.txt", TEXTS)
    out = tmp_path / "small.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "--dimensions", "128", "-q") == 0
    vectors = np.load(out)
    assert vectors.shape == (len(TEXTS), 128)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert max_diff(vectors, engine.embed(TEXTS, dimensions=128)) < 1e-6


def test_stdin_input(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = "".join(t + "\n" for t in TEXTS[:3]).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    out = tmp_path / "stdin.npy"
    assert embed(engine, "-i", "-", "-o", str(out), "-q") == 0
    assert max_diff(np.load(out), engine.embed(TEXTS[:3])) < 1e-6


def test_blank_line_fails_naming_it_or_is_skipped(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(tmp_path / "texts.txt", [TEXTS[0], TEXTS[1], "  ", TEXTS[2]])
    out = tmp_path / "out.parquet"
    assert embed(engine, "-i", str(source), "-o", str(out), "-q") == 2
    err = capsys.readouterr().err
    assert "line 3: blank input" in err and "Traceback" not in err
    assert not out.exists()

    assert embed(engine, "-i", str(source), "-o", str(out), "--skip-empty", "-q") == 0
    table = pq.read_table(out)
    assert table["index"].to_pylist() == [0, 1, 3]  # the file's 0-based line numbers
    vectors = np.array(table["embedding"].to_pylist(), dtype=np.float32)
    assert max_diff(vectors, engine.embed(TEXTS[:3])) < 1e-6


def test_long_line_is_truncated_by_default_or_fails_naming_it(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [*TEXTS[:4], LONG_TEXT, TEXTS[4]]  # line 5, in the second chunk of 3
    source = write_lines(tmp_path / "texts.txt", lines)
    out = tmp_path / "out.npy"
    args = ["-i", str(source), "-o", str(out), "--chunk-size", "3", "-q"]
    assert embed(engine, *args, "--no-truncate") == 2
    err = capsys.readouterr().err
    assert "line 5: the input has" in err and "Traceback" not in err
    assert "leave out --no-truncate to truncate it" in err
    assert "truncate_prompt_tokens" not in err  # the API's option, not the command's
    assert not out.exists()

    assert embed(engine, *args) == 0
    expected = engine.embed(lines, truncate_prompt_tokens=-1)
    assert max_diff(np.load(out), expected) < 1e-6


@pytest.mark.parametrize(
    ("lines", "extra", "message"),
    [
        (['{"text": "fine"}', "{not json"], ["--chunk-size", "1"], "line 2: not valid JSON"),
        (['{"text": "fine"}', '{"body": "x"}'], [], "line 2: the object has no 'text' field"),
        (['{"text": "fine"}', '{"text": 7}'], [], "line 2: 'text' must be a string, got integer"),
        (
            ['{"prompt_token_ids": [101, 99999, 102]}'],
            [],
            "line 1 (prompt_token_ids): token id 99999",
        ),
        (
            ['{"text": "a", "id": 1}', '{"text": "b", "id": "2"}'],
            ["--id-field", "id"],
            "line 2: 'id' is a string; earlier ids are integers",
        ),
        (['{"text": "a"}'], ["--dimensions", "1000"], "error: dimensions=1000 must be between"),
    ],
)
def test_bad_input_is_one_line_naming_its_line(
    engine: Engine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    lines: list[str],
    extra: list[str],
    message: str,
) -> None:
    source = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.parquet"
    assert embed(engine, "-i", str(source), "-o", str(out), "-q", *extra) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_bad_model_folder_or_option_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(tmp_path / "texts.txt", TEXTS)
    out = str(tmp_path / "out.npy")
    missing = str(tmp_path / "no-such-model")
    assert main(["embed", missing, "-i", str(source), "-o", out, "-q"]) == 2
    assert main(["embed", "-i", str(source), "-o", out, "--dtype", "float64", "-q"]) == 2
    assert main(["embed", "-i", str(source), "-o", str(tmp_path / "out.csv")]) == 2
    assert main(["embed", "-i", str(tmp_path / "missing.txt"), "-o", out]) == 2
    assert main(["embed", "-i", str(source), "-o", out, "--max-input-chars", "0", "-q"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 5
    assert "model folder" in errors[0] and "no-such-model" in errors[0]
    assert "dtype 'float64' is not supported" in errors[1]
    assert "must end in .npy, .parquet or .jsonl" in errors[2]
    assert "cannot read" in errors[3]
    # The engine's checks name its fields; the command names its flags.
    assert errors[4] == "vecpool: error: --max-input-chars must be positive, got 0"


def test_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "embed" in capsys.readouterr().out
    assert main(["embed", "--help"]) == 0
    help_text = capsys.readouterr().out
    for option in ("--input", "--output", "--chunk-size", "--dimensions", "--no-truncate"):
        assert option in help_text
    assert main([]) == 2


def test_examples_show_paraphrases_above_unrelated(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    assert embed(engine) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(-?\d\.\d\d)\s+(.+?)\s+\| (.+)$", out, flags=re.MULTILINE)
    printed = {(a, b): float(score) for score, a, b in rows}
    assert set(printed) == set(PARAPHRASES) | set(UNRELATED)
    sentences = sorted({s for pair in printed for s in pair})
    unit = dict(zip(sentences, engine.embed(sentences), strict=True))  # the model normalizes
    for (a, b), score in printed.items():
        assert abs(score - float(unit[a] @ unit[b])) <= 0.005
    assert min(printed[p] for p in PARAPHRASES) > max(printed[u] for u in UNRELATED)
    assert "384 dimensions, normalized" in out


def test_console_entry_runs_the_examples() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vecpool", "embed"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "cosine  paraphrases" in result.stdout
    assert "every paraphrase pair beats every unrelated one" in result.stdout


def test_serve_is_a_subcommand(capsys) -> None:
    assert main(["serve", "--help"]) == 0
    assert "/v1/embeddings" in capsys.readouterr().out
    assert main(["serve", "no/such/folder"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_reports_throughput(engine, capsys) -> None:
    status = main(
        ["bench", "-n", "12", "--repeats", "2", "--max-words", "20", "--json"], engine=engine
    )
    assert status == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_inputs"] == 12 and len(report["seconds"]) == 2
    assert report["num_tokens"] > 12 * 3  # every text has at least four words and two specials
    assert report["inputs_per_s"] > 0
    assert main(["bench", "-n", "0"], engine=engine) == 2


def test_windowed_embed_windows_long_lines(tmp_path: Path) -> None:
    """--windowed-embed: a line over the model's limit is embedded as `Engine.embed` windows
    it (it was cut at the limit, as without the flag), in one process and in two."""
    windowed = Engine(device="cpu", windowed_embed=True)
    lines = [LONG_TEXT + "end", TEXTS[0]]
    source = write_lines(tmp_path / "long.txt", lines)
    expected = windowed.embed(lines)
    cut = windowed.embed(lines, windowed=False, truncate_prompt_tokens=-1)
    assert max_diff(expected[:1], cut[:1]) > 1e-3  # windows and the cut differ
    out = tmp_path / "windowed.npy"
    assert embed(windowed, "-i", str(source), "-o", str(out), "-q") == 0
    assert max_diff(np.load(out), expected) <= 1e-6
    two = tmp_path / "two.npy"
    args = ["-i", str(source), "-o", str(two), "--windowed-embed", "--data-parallel-size", "2"]
    assert main(["embed", *args, "--device", "cpu", "-q"]) == 0
    # Engine processes with fewer threads each: fp32 rounding at most.
    assert max_diff(np.load(two), expected) <= 1e-6
