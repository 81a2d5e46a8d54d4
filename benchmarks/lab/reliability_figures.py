"""The figures of docs/RELIABILITY.md that its tests print (and, the machine's load moving them,
do not assert), recorded in rounds: each round runs the tests once and reads what they print.

    python benchmarks/lab/reliability_figures.py --output benchmarks/results/reliability_2core.json

- `test_overload_refuses_exactly_the_excess_at_once`: how long a refusal (429) takes, p50 / p99;
- `test_admitted_requests_wait_within_the_bound`: requests admitted and refused, the longest
  wait (on the engine's step clock: exact), the longest `/health` answer during the flood;
- `test_memory_plateaus_and_a_leak_is_caught`: RSS and traced allocations per round of load,
  without and with a leak of 64 kB a request, and their growth from the third round on;
- `test_slow_clients_are_closed_at_the_read_timeout`: when the half-sent requests were closed
  (a 2 s read timeout) and how long a request served meanwhile took.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record

TESTS = (
    "tests/server/test_reliability.py::test_overload_refuses_exactly_the_excess_at_once",
    "tests/server/test_reliability.py::test_admitted_requests_wait_within_the_bound",
    "tests/server/test_reliability.py::test_memory_plateaus_and_a_leak_is_caught",
    "tests/server/test_connections.py::test_slow_clients_are_closed_at_the_read_timeout",
)
NUMBER = r"([0-9.]+)"


def _floats(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?[0-9]+(?:\.[0-9]+)?", text)]


def parse(output: str) -> dict[str, Any]:
    """The figures the tests printed, by name (a missing line raises: the tests changed)."""

    def find(pattern: str) -> re.Match[str]:
        match = re.search(pattern, output)
        if match is None:
            raise RuntimeError(f"no line matching {pattern!r} in the tests' output")
        return match

    out: dict[str, Any] = {}
    m = find(rf"429 latency p50 {NUMBER} ms, p99 {NUMBER} ms")
    out["refusal_ms"] = {"p50": float(m[1]), "p99": float(m[2])}
    m = find(rf"admitted (\d+), refused (\d+), longest wait {NUMBER} s")
    out["admitted"], out["refused"], out["longest_wait_s"] = int(m[1]), int(m[2]), float(m[3])
    m = find(rf"/health during the flood: (\d+) probes, longest {NUMBER} ms")
    out["health_probes"], out["health_longest_ms"] = int(m[1]), float(m[2])
    rss = [_floats(x) for x in re.findall(r"rss per round \(MB\): \[([^\]]*)\]", output)]
    traced = [_floats(x) for x in re.findall(r"traced per round \(MB\): \[([^\]]*)\]", output)]
    if len(rss) != 2 or len(traced) != 2:
        raise RuntimeError("expected the memory of two builds (without and with a leak)")
    for name, r, t in (("memory", rss[0], traced[0]), ("memory_leaking", rss[1], traced[1])):
        out[name] = {
            "rss_mb": r,
            "traced_mb": t,
            "rss_growth_from_round_3_mb": round(r[-1] - r[2], 1),
            "traced_growth_from_round_3_mb": round(t[-1] - t[2], 1),
        }
    m = find(rf"closed at {NUMBER}-{NUMBER} s; a request meanwhile took {NUMBER} ms")
    out["slow_clients_closed_s"] = [float(m[1]), float(m[2])]
    out["request_meanwhile_ms"] = float(m[3])
    return out


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS)
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        **record.header("lab/reliability_figures.py", argv, device="cpu", commit=args.commit),
        "tests": list(TESTS),
        "rounds": [],
    }
    env = {**os.environ, "PYTHONPATH": str(record.REPO)}
    for i in range(args.rounds):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *TESTS],
            cwd=record.REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"the tests failed in round {i + 1}:\n{done.stdout[-4000:]}")
        figures = parse(done.stdout)
        figures["load_average"] = list(os.getloadavg())
        report["rounds"].append(figures)
        print(f"round {i + 1}: {figures}", flush=True)
    report["median"] = record.median_of_rounds(report["rounds"])
    report["load_average_at_end"] = list(os.getloadavg())
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
