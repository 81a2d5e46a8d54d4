"""The corpus the `vecpool embed` tests read, and how they run the command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from vecpool import Engine
from vecpool.cli import main

WORDS = "the a of to and in model vector pooling engine batch token attention layer".split()
NUM_ROWS = 36


def corpus_texts(n: int = NUM_ROWS) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for _ in range(n)]


def embed(engine: Engine | None, *args: str) -> int:
    """`vecpool embed ARGS` in this process (on `engine`, when given)."""
    return main(["embed", *args], engine=engine)


def vectors_of(path: Path) -> np.ndarray:
    return np.array(pq.read_table(path)["embedding"].to_pylist(), dtype=np.float32)
