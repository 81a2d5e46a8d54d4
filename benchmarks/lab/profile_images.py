"""Where a vision-language model's page time goes: one `Engine.embed` call of page images (JPEG
bytes with GME's prompt, as `bench_images.py` sends them) under torch.profiler, after a warm-up
call; the host's time by phase (image reading and processing, the vision tower's steps, the
language model's steps) and the device's busiest kernels; then the calling thread's Python
under cProfile.

    PYTHONPATH=. python benchmarks/lab/profile_images.py --shape gme --images 64 --size 1024x768
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.images_common import jpegs
from benchmarks.images_vlm import _IMAGE_TEXT, GME_SHAPES, build_gme_folder, gme_prompt


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="gme", choices=sorted(GME_SHAPES))
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", default="1024x768")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=30, help="kernels and operators listed")
    parser.add_argument("--trace", type=Path, help="write a Chrome trace here")
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="*",
        default=[],
        help="also time engines of these step budgets (max_num_batched_tokens), pages/s each",
    )
    args = parser.parse_args(argv)
    import vecpool

    width, height = map(int, args.size.split("x"))
    files = jpegs(args.images, width, height)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.shape
        build_gme_folder(args.shape, folder, dtype)
        dtype_name = str(dtype).split(".")[1]
        pages = [{"prompt": gme_prompt(_IMAGE_TEXT), "image": f} for f in files]
        for budget in args.budgets:
            other = vecpool.Engine(
                folder, device=args.device, dtype=dtype_name, max_num_batched_tokens=budget
            )
            other.embed(pages, show_progress=False)
            seconds = []
            for _ in range(3):
                started = time.perf_counter()
                other.embed(pages, show_progress=False)
                seconds.append(time.perf_counter() - started)
            best = min(seconds)
            print(f"budget {budget}: {args.images / best:.1f} pages/s {seconds}", flush=True)
            del other
        engine = vecpool.Engine(folder, device=args.device, dtype=dtype_name)
        engine.embed(pages, show_progress=False)  # warm: compile, graphs, the image processor
        started = time.perf_counter()
        engine.embed(pages, show_progress=False)
        plain = time.perf_counter() - started
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        host = cProfile.Profile()
        host.enable()
        engine.embed(pages, show_progress=False)
        host.disable()
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            engine.embed(pages, show_progress=False)
            profiled = time.perf_counter() - started
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    print(
        f"{args.images} pages {args.size}: {plain:.3f} s ({args.images / plain:.1f} pages/s); "
        f"under the profiler {profiled:.3f} s, device busy {device_us / 1e6:.3f} s",
        flush=True,
    )
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    print(events.table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print("the calling thread's Python, by cumulative time:")
    pstats.Stats(host).sort_stats("cumulative").print_stats(args.rows)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
