"""`vecpool embed`: what a corpus may hold and what a run refuses, by line or row: token-id
columns and lists, ids (the text column as ids, ids no output can hold), blank inputs,
dictionary-encoded columns; a .npy output's index and the output's path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli.corpus_data import corpus_texts, embed, vectors_of
from vecpool import Engine


def test_parquet_token_id_column(engine: Engine, tmp_path: Path) -> None:
    texts = corpus_texts(5)
    ids = [engine.tokenize(t) for t in texts]
    source = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"prompt_token_ids": ids}), source)
    out = tmp_path / "ids.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "-q") == 0
    assert np.abs(np.load(out) - engine.embed(texts)).max() < 1e-6


def test_parquet_id_field_may_name_the_text_column(engine: Engine, tmp_path: Path) -> None:
    """As in JSONL, `--id-field` naming the text column writes each text as its id (the
    column was asked of pyarrow twice, which returned it once)."""
    texts = corpus_texts(5)
    source = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"text": texts}), source)
    out = tmp_path / "out.parquet"
    args = ["-i", str(source), "-o", str(out), "--id-field", "text", "--chunk-size", "2", "-q"]
    assert embed(engine, *args) == 0
    table = pq.read_table(out)
    assert table["text"].to_pylist() == texts
    assert np.abs(vectors_of(out) - engine.embed(texts)).max() < 1e-6


def test_an_empty_token_list_is_a_blank_input_in_jsonl_as_in_parquet(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = engine.tokenize("a short text")
    source = tmp_path / "ids.jsonl"
    source.write_text("".join(json.dumps({"prompt_token_ids": i}) + "\n" for i in (ids, [], ids)))
    out = tmp_path / "out.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "-q") == 2
    assert "line 2: blank input (--skip-empty skips these)" in capsys.readouterr().err
    assert embed(engine, "-i", str(source), "-o", str(out), "-q", "--skip-empty") == 0
    np.testing.assert_array_equal(np.load(tmp_path / "out.index.npy"), [0, 2])
    assert np.abs(np.load(out) - engine.embed([ids, ids])).max() < 1e-6


def test_ids_no_output_can_hold_are_refused_by_line(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An id with a lone surrogate (JSON's escapes allow one; UTF-8 does not) or an integer
    outside int64 (Parquet's id column) is refused at its line or row, exit 2, before it is
    written (the writers raised tracebacks: a run that failed so on every resume)."""
    jsonl = tmp_path / "ids.jsonl"
    cases = [
        ('{"text": "a", "id": "ok"}\n{"text": "b", "id": "x\\ud800"}\n', ".jsonl", "line 2"),
        ('{"text": "a", "id": 1180591620717411303424}\n', ".parquet", "line 1"),
    ]
    for content, suffix, where in cases:
        jsonl.write_text(content)
        out = tmp_path / f"out{suffix}"
        args = ["-i", str(jsonl), "-o", str(out), "--id-field", "id", "--chunk-size", "1", "-q"]
        assert embed(engine, *args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vecpool: error: {where}: 'id' ") and err.count("\n") == 1, err
        assert "Traceback" not in err and not out.exists()
    source = tmp_path / "ids.parquet"
    ids = pa.array([5, 2**64 - 1], pa.uint64())
    pq.write_table(pa.table({"text": ["a", "b"], "id": ids}), source)
    out = tmp_path / "out.parquet"
    assert embed(engine, "-i", str(source), "-o", str(out), "--id-field", "id", "-q") == 2
    assert "row 2: 'id' 18446744073709551615 is outside" in capsys.readouterr().err


def test_a_huge_chunk_size_reads_parquet_whole(
    engine: Engine, corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.npy"
    args = ["-i", str(corpus), "--field", "body", "-o", str(out), "--chunk-size", str(10**20)]
    assert embed(engine, *args, "-q") == 0
    assert np.abs(np.load(out) - engine.embed(corpus_texts())).max() < 1e-6


def test_an_npy_outputs_index_is_replaced_with_it(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run without --skip-empty over an output that had an index: refused without
    --overwrite, and with it the old index goes (it described the old rows); the output may
    not be the input file."""
    source = tmp_path / "texts.txt"
    source.write_text("one\n\nthree\n")
    out = tmp_path / "out.npy"
    assert embed(engine, "-i", str(source), "-o", str(out), "--skip-empty", "-q") == 0
    index = tmp_path / "out.index.npy"
    assert np.load(index).tolist() == [0, 2]
    source.write_text("one\ntwo\n")
    out.rename(tmp_path / "moved.npy")  # the index alone is the output's too
    assert embed(engine, "-i", str(source), "-o", str(out), "-q") == 2
    assert "out.index.npy' exists (--overwrite replaces it)" in capsys.readouterr().err
    assert embed(engine, "-i", str(source), "-o", str(out), "--overwrite", "-q") == 0
    assert np.load(out).shape == (2, 384) and not index.exists()
    same = tmp_path / "same.jsonl"
    same.write_text('{"text": "a"}\n')
    assert embed(engine, "-i", str(same), "-o", str(same), "--overwrite", "-q") == 2
    assert "is the input file" in capsys.readouterr().err
    assert same.read_text() == '{"text": "a"}\n'


def test_dictionary_encoded_columns_are_read_as_their_values(
    engine: Engine, tmp_path: Path
) -> None:
    """Pandas writes a categorical column dictionary-encoded: its values are the texts (and
    ids), as in a plain column."""
    texts = corpus_texts(6)
    ids = [f"doc-{i % 2}" for i in range(6)]
    source = tmp_path / "dict.parquet"
    table = pa.table(
        {"body": pa.array(texts).dictionary_encode(), "doc_id": pa.array(ids).dictionary_encode()}
    )
    pq.write_table(table, source)
    out = tmp_path / "out.parquet"
    args = ["-i", str(source), "--field", "body", "--id-field", "doc_id", "-o", str(out), "-q"]
    assert embed(engine, *args) == 0
    assert pq.read_table(out)["doc_id"].to_pylist() == ids
    assert np.abs(vectors_of(out) - engine.embed(texts)).max() < 1e-6


def test_json_booleans_are_not_token_ids(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "ids.jsonl"
    source.write_text(
        '{"prompt_token_ids": [101, 2000, 102]}\n{"prompt_token_ids": [101, true, 102]}\n'
    )
    assert embed(engine, "-i", str(source), "-o", str(tmp_path / "out.npy"), "-q") == 2
    assert "line 2: 'prompt_token_ids' must be integers, got a boolean" in capsys.readouterr().err
