"""Fixtures of the `vecpool embed` corpus tests: the default model's engine, a Parquet corpus."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli.corpus_data import NUM_ROWS, corpus_texts
from vecpool import Engine


@pytest.fixture(scope="session")
def engine(minilm: Engine) -> Engine:
    """The default model's engine: the session's."""
    return minilm


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Parquet file: `doc_id` (int), `body` (text), `extra`; row groups of 10 rows."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.parquet"
    texts = corpus_texts()
    table = pa.table({"doc_id": list(range(1000, 1000 + NUM_ROWS)), "body": texts, "extra": texts})
    pq.write_table(table, path, row_group_size=10)
    return path
