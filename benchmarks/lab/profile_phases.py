"""Where the engine thread's time goes in one large `Engine.embed` call on CUDA, by phase:
what the host does while the device computes, and what it does while the device waits.

    PYTHONPATH=. python benchmarks/lab/profile_phases.py --models bert-base --tokenizer DIR

For each `bench_gpu.py` shape and workload (from token ids, the engine's defaults), five calls
after a warm-up; per call the wall time and the host seconds in each phase (medians of the
five, summed over the call's steps):
- `schedule + build`: the next step scheduled and its batch built (runs while the device
  computes the current step);
- `forward (launch)`: the forward's kernels queued (or its graph replayed);
- `wait for the device`: the host idle until the step's forward is done (a wait put before
  pooling, which would wait there anyway);
- `pool (host)`: pooling once the step's forward is done: its kernels, the copy to the host,
  the Python per request; the device runs the next step's forward meanwhile when that was
  queued first (`EngineCore.step`), else it waits;
- `rest`: the wall time less the phases above: finishing requests, the call's own Python,
  preparing the input chunks.

`--cprofile N` adds, per row, one more call under `cProfile` (its N functions of most own
time); `--torch-profile N` one more under `torch.profiler` (its N operators and CUDA runtime
calls of most own host time, and its kernels' device time): what the phases are made of.
`--quantization fp8` runs the engines in FP8 (CUDA of compute capability 8.9 or higher).
`--gaps N` one more under `torch.profiler` with the phases labelled and no wait added: how long
the device sat idle within the call, that idle time by what the host was doing when each idle
stretch began, and the N longest stretches.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vecpool
from benchmarks import record
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder

PHASES = ("schedule + build", "forward (launch)", "wait for the device", "pool (host)")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _wrap_phases(engine: vecpool.Engine, seconds: dict[str, float], device: str) -> None:
    core = engine.core

    def timed(name: str, fn: Any, sync: bool = False) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if sync:  # until the step's forward is done (not a forward queued after it)
                started = time.perf_counter()
                after = kwargs.get("after")
                if after is not None:
                    after.synchronize()
                else:
                    _sync(device)
                seconds["wait for the device"] += time.perf_counter() - started
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - started

        return run

    core._prepare_next = timed("schedule + build", core._prepare_next)  # type: ignore[method-assign]
    runner, pooling = engine.model_runner, core.pooling_runner
    runner.forward = timed("forward (launch)", runner.forward)  # type: ignore[method-assign]
    pooling.pool = timed("pool (host)", pooling.pool, sync=True)  # type: ignore[method-assign]


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert-base"], choices=sorted(SHAPES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="inputs per step at most (e.g. 16: the steps of a server under single-query "
        "clients); default: the engine's",
    )
    parser.add_argument(
        "--quantization",
        choices=["fp8"],
        help="the engines' `quantization` (default: none, the model dtype)",
    )
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="N")
    parser.add_argument("--gaps", type=int, default=0, metavar="N")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = record.header(
        "lab/profile_phases.py", argv, device=args.device, commit=args.commit
    )
    rows = []
    for name in args.models:
        folder = write_folder(SHAPES[name], Path(tempfile.mkdtemp()), args.tokenizer, args.device)
        engine = vecpool.Engine(
            folder,
            device=args.device,
            quantization=args.quantization,
            **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
        )
        tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
        for workload in args.workloads:
            _, ids = make_inputs(tokenizer, workload_lengths(workload, args.n))
            engine.embed(ids[:512], truncate_prompt_tokens=-1, show_progress=False)
            engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
            seconds: dict[str, float] = {}
            original = (engine.core._prepare_next, engine.model_runner.forward)
            original_pool = engine.core.pooling_runner.pool
            _wrap_phases(engine, seconds, args.device)
            calls: list[dict[str, float]] = []
            gc.collect()
            for _ in range(5):
                seconds.clear()
                seconds.update(dict.fromkeys(PHASES, 0.0))
                _sync(args.device)
                steps = engine.core.num_steps
                started = time.perf_counter()
                engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
                _sync(args.device)
                wall = time.perf_counter() - started
                rest = wall - sum(seconds.values())
                calls.append({"wall": wall, **seconds, "rest": rest})
                num_steps = engine.core.num_steps - steps
            engine.core._prepare_next, engine.model_runner.forward = original  # type: ignore[method-assign]
            engine.core.pooling_runner.pool = original_pool  # type: ignore[method-assign]
            medians = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
            row: dict[str, Any] = {
                "model": name,
                "workload": workload,
                "quantization": args.quantization,
                "num_inputs": len(ids),
                "num_tokens": sum(map(len, ids)),
                "max_num_seqs": engine.info().max_num_seqs,
                "steps_per_call": num_steps,
                "median_seconds": medians,
                "calls": calls,
            }
            if args.cprofile:
                row["cprofile"] = _cprofile(engine, ids, args.cprofile)
            if args.torch_profile:
                row["torch_profile"] = _torch_profile(engine, ids, args.torch_profile, args.device)
            if args.gaps:
                row["device_gaps"] = _device_gaps(engine, ids, args.gaps, args.device)
            rows.append(row)
            print(name, workload, {k: round(v * 1e3, 1) for k, v in medians.items()}, flush=True)
        del engine
        torch.cuda.empty_cache()
    report["rows"] = rows
    record.write(args.output, report)
    return report


def _cprofile(engine: vecpool.Engine, ids: list[list[int]], top: int) -> list[str]:
    """One more call under cProfile: its `top` functions by own time, as text lines."""
    profile = cProfile.Profile()
    profile.enable()
    engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return _lines(out.getvalue())


def _torch_profile(
    engine: vecpool.Engine, ids: list[list[int]], top: int, device: str
) -> list[str]:
    """One more call under torch.profiler: its `top` operators and runtime calls by own host
    time, then by device time, as text lines."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
        _sync(device)
    events = prof.key_averages()
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)]
    if device == "cuda":
        tables.append(
            events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60)
        )
    return _lines("\n".join(tables))


# What `_device_gaps` labels: (label, object path from the engine, attribute).
_LABELS = (
    ("schedule + build", "core", "_prepare_next"),
    ("forward (launch)", "model_runner", "forward"),
    ("pool (host)", "core.pooling_runner", "pool"),
    ("finish requests", "core", "_finish"),
    ("queue a chunk", "core", "add_requests"),
)


def _device_gaps(
    engine: vecpool.Engine, ids: list[list[int]], top: int, device: str
) -> dict[str, Any]:
    """One more call under torch.profiler, the engine's phases labelled (no wait added): the
    device's idle time within the call, by the host phases running when each idle stretch
    began (several at once: the input worker's thread too), and the `top` longest. (On the
    CPU there is no device activity: the whole call is one stretch; a check of the script.)"""
    from vecpool.api import engine as api_engine

    def labelled(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return run

    patched: list[tuple[Any, str]] = []
    for name, path, attr in _LABELS:
        owner: Any = engine
        for part in path.split("."):
            owner = getattr(owner, part)
        setattr(owner, attr, labelled(name, getattr(owner, attr)))
        patched.append((owner, attr))
    prepare = api_engine.calls.prepare_encode
    api_engine.calls.prepare_encode = labelled("prepare a chunk (worker)", prepare)  # type: ignore[attr-defined]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with (
            torch.profiler.profile(activities=activities) as prof,
            torch.profiler.record_function("the call"),
        ):
            engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
            _sync(device)
    finally:
        api_engine.calls.prepare_encode = prepare  # type: ignore[attr-defined]
        for owner, attr in patched:
            delattr(owner, attr)  # the class's own method again
    events = list(prof.events())
    names = {name for name, _, _ in _LABELS} | {"prepare a chunk (worker)"}
    call = next(e for e in events if e.name == "the call")
    begin, end = call.time_range.start, call.time_range.end
    device = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > begin
    )
    host = [(e.time_range.start, e.time_range.end, e.name) for e in events if e.name in names]
    gaps: list[tuple[float, float]] = []
    cursor = begin
    for start, stop in device:
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, stop)
    if end > cursor:
        gaps.append((cursor, end))
    by_phase: dict[str, float] = {}
    stretches = []
    for start, stop in gaps:
        doing = sorted({n for s, e, n in host if s <= start < e}) or ["(none of these)"]
        key = " + ".join(doing)
        by_phase[key] = by_phase.get(key, 0.0) + (stop - start) / 1e3
        stretches.append({"at_ms": (start - begin) / 1e3, "ms": (stop - start) / 1e3, "host": key})
    idle = sum(stop - start for start, stop in gaps) / 1e3
    return {
        "call_ms": (end - begin) / 1e3,
        "device_idle_ms": idle,
        "idle_ms_by_host_phase": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
        "longest": sorted(stretches, key=lambda g: -g["ms"])[:top],
        "num_stretches": len(stretches),
    }


def _lines(text: str) -> list[str]:
    """Text as lines with the machine's own paths cut: the repository's to its files', the
    installed packages' and the standard library's to a placeholder."""
    stdlib = sysconfig.get_paths()["stdlib"]
    text = re.sub(r"[^\s(]*/site-packages/", "<site-packages>/", text)
    text = text.replace(str(Path.cwd()) + "/", "").replace(stdlib + "/", "<stdlib>/")
    return [line for line in text.splitlines() if line.strip()]


if __name__ == "__main__":
    main(sys.argv[1:])
