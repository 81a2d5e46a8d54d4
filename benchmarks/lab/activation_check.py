"""The feed-forward activation between two matrix products, timed kernel by kernel on CUDA.

    PYTHONPATH=. python benchmarks/lab/activation_check.py --output activation_check.json

BERT's exact GELU (`0.5 x (1 + erf(x / sqrt 2))`) is one elementwise kernel that reads and
writes a `[tokens, intermediate]` tensor; if it ran at the memory's speed it would cost what a
copy of that tensor costs. This script times, at BERT-base's shape (768 -> 3,072) and a step
of `--tokens`, each way of computing it: the compiler's kernel for `F.gelu` (dynamic token
dimension, as the engine compiles), eager `F.gelu`, the tanh approximation, `layers.gelu`
compiled (ATen's kernel through an op opaque to the compiler), and the compiled `x * 1.5` as
the memory's floor; then the whole
`linear -> activation` against cuBLASLt's GELU epilogue (`torch._addmm_activation`, the tanh
approximation). Each figure: the median of `--rounds` rounds of `--iters` launches timed by
CUDA events, every round kept. Errors: each bf16 output against the exact GELU of the same
bf16 input in float64 (largest absolute error, and the share of outputs not equal to the
compiled `F.gelu`'s).

`--device cpu` runs the same on the CPU (a check of the script; its times say nothing), with
`--backend aot_eager` even where no C++ compiler is installed.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from vecpool.models.layers import basic as layers


def _time(fn: Callable[[], Any], device: str, iters: int) -> float:
    """Seconds per call of `fn`, over `iters` calls after one."""
    fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - started) / iters


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 4096])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="inductor", help="the compiler (tests: aot_eager)")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report = record.header("lab/activation_check.py", argv, device=args.device, commit=args.commit)
    dtype = torch.bfloat16
    compile_kw: dict[str, Any] = {"dynamic": True, "backend": args.backend}
    activations: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "compiled gelu": torch.compile(F.gelu, **compile_kw),
        "eager gelu": F.gelu,
        "compiled tanh gelu": torch.compile(lambda x: F.gelu(x, approximate="tanh"), **compile_kw),
        "compiled layers.gelu": torch.compile(layers.gelu, **compile_kw),
        "compiled x * 1.5 (memory floor)": torch.compile(lambda x: x * 1.5, **compile_kw),
    }
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = report["rows"] = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=gen).to(args.device, dtype)
        w = (torch.randn(args.intermediate, args.hidden, generator=gen) / args.hidden**0.5).to(
            args.device, dtype
        )
        b = (torch.randn(args.intermediate, generator=gen) * 0.1).to(args.device, dtype)
        h = F.linear(x, w, b)
        exact = F.gelu(h.double())
        reference = activations["compiled gelu"](h)
        row: dict[str, Any] = {"tokens": tokens, "activation": {}, "linear + activation": {}}
        for name, act in activations.items():
            out = act(h)
            call = functools.partial(act, h)
            seconds = [_time(call, args.device, args.iters) for _ in range(args.rounds)]
            entry = {"seconds": record.rounds(seconds)}
            if "floor" not in name:
                entry["max_abs_error"] = float((out.double() - exact).abs().max())
                entry["share_unequal_to_compiled_gelu"] = float((out != reference).double().mean())
            row["activation"][name] = entry

        def then(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
            return lambda: act(F.linear(x, w, b))  # noqa: B023 - called in this iteration

        fused: dict[str, Callable[[], torch.Tensor]] = {
            "linear, compiled gelu": then(activations["compiled gelu"]),
            "linear, compiled layers.gelu": then(activations["compiled layers.gelu"]),
            "linear alone": functools.partial(F.linear, x, w, b),
        }
        if args.device == "cuda":
            fused["cuBLASLt gelu epilogue (tanh)"] = functools.partial(
                torch._addmm_activation, b, x, w.t(), use_gelu=True
            )
        for name, fn in fused.items():
            seconds = [_time(fn, args.device, args.iters) for _ in range(args.rounds)]
            row["linear + activation"][name] = {"seconds": record.rounds(seconds)}
        rows.append(row)
        for part in ("activation", "linear + activation"):
            for name, entry in row[part].items():
                us = entry["seconds"]["median"] * 1e6
                extra = (
                    f" max err {entry['max_abs_error']:.2e},"
                    f" unequal {entry['share_unequal_to_compiled_gelu']:.2%}"
                    if "max_abs_error" in entry
                    else ""
                )
                print(f"{tokens:6d} {name:34s} {us:9.1f} us{extra}", flush=True)
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
