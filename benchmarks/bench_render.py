"""What writing one embeddings response costs an API process: `routes.common.render_vectors`
of one input's vector (the single-query case) and of 32, at the default models' widths, as
vecpool writes it (msgspec) and as the standard library's `json` wrote it before, alternating
in one process on the same vectors.

    PYTHONPATH=. python benchmarks/bench_render.py [--rounds 7] [--output FILE]

Under many single-query clients this is CPU an API process spends per request, beside parsing
the request, tokenizing and the hop to the engine (`bench_online.py`'s server CPU per request).
The figure is microseconds per response, the median of `--rounds` rounds of `--calls` calls
each, every round kept; the two bodies are checked to read back as the same values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from vecpool.server.protocol import OutputParams
from vecpool.server.routes import common
from vecpool.server.routes.common import Timings, render_vectors

CASES = ((384, 1), (1024, 1), (1024, 32), (4096, 1))  # (width, vectors per response)


def _stdlib_dumps(body: Any) -> bytes:
    """The writer before msgspec."""
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


def _render(vectors: list[np.ndarray]) -> bytes:
    response = render_vectors(
        vectors,
        OutputParams(),
        Timings(num_inputs=len(vectors), prompt_tokens=8),
        prefix="embd",
        item_object="embedding",
        key="embedding",
        model="m",
    )
    return bytes(response.body)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="responses per round")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = record.header(
        "bench_render.py", argv, device="cpu", commit=args.commit
    )
    report["unit"] = "microseconds per response"
    rng = np.random.default_rng(0)
    writers = {"msgspec": common.dumps, "json": _stdlib_dumps}
    rows = []
    for width, count in CASES:
        vectors = list(rng.standard_normal((count, width)).astype(np.float32))
        seconds: dict[str, list[float]] = {name: [] for name in writers}
        bodies: dict[str, bytes] = {}
        try:
            for _ in range(args.rounds):
                for name, writer in writers.items():
                    common.dumps = writer  # type: ignore[assignment]
                    started = time.perf_counter()
                    for _ in range(args.calls):
                        bodies[name] = _render(vectors)
                    seconds[name].append((time.perf_counter() - started) / args.calls * 1e6)
        finally:
            common.dumps = writers["msgspec"]  # type: ignore[assignment]
        read = {name: json.loads(body)["data"] for name, body in bodies.items()}
        if read["msgspec"] != read["json"]:
            raise RuntimeError(f"the two bodies differ at width {width}")
        row = {
            "width": width,
            "vectors": count,
            "bytes": {name: len(body) for name, body in bodies.items()},
            **{name: record.rounds(values) for name, values in seconds.items()},
        }
        row["ratio_json_to_msgspec"] = row["json"]["median"] / row["msgspec"]["median"]
        rows.append(row)
        print(
            f"{width:5d} x {count:2d}: msgspec {row['msgspec']['median']:8.1f} µs, "
            f"json {row['json']['median']:8.1f} µs ({row['ratio_json_to_msgspec']:.1f}x)",
            flush=True,
        )
    report["rows"] = rows
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
