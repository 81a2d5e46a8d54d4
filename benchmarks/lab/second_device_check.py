"""An engine on a second CUDA device answers as the same engine on the first: the check to run
on a machine with two GPUs.

    python benchmarks/lab/second_device_check.py --output second_device.json

Per architecture (random weights, head size 64, bf16, compiled and replayed from CUDA graphs,
as `vecpool serve` runs them): one engine on cuda:0 and one on cuda:1 in this process, while
the current device stays cuda:0, the same prompts through each (steps small enough for the
graphs, packed steps of short prompts, and longer prompts). cuda:1's answers are taken three
ways: `Engine` from this thread, `Engine` from a thread of its own (a thread's current device
starts at 0) and `AsyncEngine` (its loop thread). With eager layers each must equal cuda:0's
bit for bit (the same kernels on the same kind of device); compiled, within 2^-6 of the
largest value (below). Both engines must replay steps from CUDA graphs. Before the engine
made its device the current one around its steps (`ModelRunner.on_device`), graph captures,
events and Triton launches went to device 0 and an engine on cuda:1 failed with device-side
asserts (`dp_qwen3-0.6b_h200x2_before_fix.json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vecpool
from benchmarks import record
from benchmarks.lab.gpu_check import _models
from tests.helpers import engine_hidden, random_prompts, save_hf_model

# Short prompts (graphed and packed steps) and long ones (a step of its own), 101-token vocab.
LENGTHS = [1, 3, 9, 17, 30, 64, 100, 257, 500, *[12] * 40, *[40] * 40]
ARCHS = ("bert", "modernbert", "qwen3", "gemma3", "llama")


def _max_abs(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


async def _async_pooled(engine: vecpool.Engine, prompts: list[list[int]]) -> list[np.ndarray]:
    """The prompts as one call through `AsyncEngine` (its loop thread steps): the same steps
    as `Engine.embed` of them, so that the answers may be compared bit for bit."""
    from vecpool.api.async_engine import AsyncEngine
    from vecpool.tasks import PoolingParams

    served = AsyncEngine(engine)
    served.start()
    try:
        out = await served.pool(prompts, PoolingParams(normalize=False))
    finally:
        served.shutdown()
    return [np.asarray(o.data) for o in out]


def check(
    name: str, build: Any, tmp: Path, compile: bool, devices: tuple[str, str]
) -> dict[str, Any]:
    torch.manual_seed(0)
    folder = save_hf_model(build().eval(), tmp / name)
    prompts = random_prompts(101, LENGTHS, seed=1)
    kw = dict(dtype=torch.bfloat16, compile=compile, cuda_graphs=True)
    cuda = devices[0].startswith("cuda")
    if cuda:
        torch.cuda.set_device(0)
    first = vecpool.Engine(folder, device=devices[0], **kw)
    second = vecpool.Engine(folder, device=devices[1], **kw)
    row: dict[str, Any] = {"arch": name, "compiled": compile}
    truth = engine_hidden(first, prompts)
    row["this_thread_max_abs"] = _max_abs(engine_hidden(second, prompts), truth)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(engine_hidden, second, prompts).result()
    row["other_thread_max_abs"] = _max_abs(other, truth)
    # AsyncEngine's call against cuda:0's pooled vectors of the same call.
    pooled = list(first.embed(prompts, normalize=False))
    row["async_engine_max_abs"] = _max_abs(asyncio.run(_async_pooled(second, prompts)), pooled)
    for label, engine in (("first", first), ("second", second)):
        graphs = engine.model_runner.graphs
        row[f"{label}_graphs_enabled"] = bool(graphs is not None and graphs.enabled)
        row[f"{label}_graph_replays"] = graphs.replays if graphs is not None else 0
    row["largest_abs"] = max(float(np.abs(x).max()) for x in truth)
    row["current_device_after"] = torch.cuda.current_device() if cuda else 0
    diffs = [row[f"{k}_max_abs"] for k in ("this_thread", "other_thread", "async_engine")]
    # Eager layers run the same kernels on both devices: equal bit for bit. Compiled ones may
    # not: Inductor picks among a kernel's configurations by timing each on its own device, and
    # another pick sums in another order: a few bf16 ulps of the largest value (an ulp is
    # 2^-8 of it at most; the bound is four).
    bound = 0.0 if not compile else row["largest_abs"] * 2**-6
    row["ok"] = bool(
        all(d <= bound for d in diffs)
        and row["second_graphs_enabled"] == row["first_graphs_enabled"]
        and (row["second_graph_replays"] > 0 or not row["first_graphs_enabled"])
        and row["current_device_after"] == 0
    )
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--archs", nargs="*", default=list(ARCHS))
    parser.add_argument("--no-compile", action="store_true", help="eager layers (graphs stay)")
    parser.add_argument(
        "--devices", nargs=2, default=["cuda:0", "cuda:1"], help="cpu cpu: a check of the script"
    )
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.devices[1].startswith("cuda") and torch.cuda.device_count() < 2:
        print("this check needs two CUDA devices", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        **record.header(
            "lab/second_device_check.py", argv, device=args.devices[1], commit=args.commit
        ),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in _models():
            if name not in args.archs:
                continue
            try:
                row = check(name, build, Path(tmp), not args.no_compile, tuple(args.devices))
            except Exception as exc:  # report and go on to the next architecture
                row = {"arch": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    record.write(args.output, report)
    return 0 if report["rows"] and all(r["ok"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
