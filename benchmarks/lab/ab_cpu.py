"""A/B timings of vecpool variants on the CPU, in one process, alternating rounds.

    python benchmarks/lab/ab_cpu.py --variant base --variant budget=1024 ... [--rounds 5]

A variant is `name` or `name=value`, applied by `VARIANTS` below to a freshly built engine
(float32, the packaged MiniLM, bench_cpu.py's workloads); a name starting `int8` builds it with
`quantization="int8"` (`int8_before`: its former arithmetic, for an A/B; `int8_budget=N`: a
step budget of N tokens), and `st=32` is
sentence-transformers `encode` at that batch size. Prints each variant's median wall and
process CPU seconds per workload with its median speed-up over the first variant, and the
largest absolute difference of its vectors from the first variant's. On a shared machine the
CPU seconds of one thread (`--threads 1`) are the steadier measure of a kernel change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_gpu import st_runner, vecpool_runner
from benchmarks.record import git_commit
from benchmarks.workloads import make_inputs, workload_lengths


def build(folder: Path, variant: str) -> Callable[[list[str], list[list[int]]], np.ndarray]:
    name, _, value = variant.partition("=")
    if name == "st":
        return st_runner(folder, "cpu", torch.float32, int(value))[0]
    budget = int(value) if name in ("budget", "int8_budget") else None
    quantization = "int8" if name.startswith("int8") else None
    run, engine = vecpool_runner(
        folder, "cpu", "float32", text=True, compile=None, budget=budget, quantization=quantization
    )
    apply = VARIANTS.get(name)
    if apply is not None:
        apply(engine, value)
    if name == "three_copies":
        import vecpool.models.layers.attention as attention

        joint = attention._joint_rows

        def apart(texts: list[str], ids: list[list[int]]) -> np.ndarray:
            attention._joint_rows = lambda q, k, v: None
            try:
                return run(texts, ids)
            finally:
                attention._joint_rows = joint

        return apart
    return run


def _model(engine: Any) -> Any:
    return engine.model_runner.model


def _unfused(engine: Any, value: str) -> None:
    """The packed linears without their fused epilogues (activation, residual add)."""
    from vecpool.runner.cpu_linear import PackedLinear

    for m in _model(engine).modules():
        if isinstance(m, PackedLinear):
            m.fused_activation = None  # type: ignore[assignment,method-assign]
            m.fused_add = None  # type: ignore[assignment,method-assign]


def _three_copies(engine: Any, value: str) -> None:
    """The padded attention copying q, k and v apart (no single copy of the fused rows):
    `_joint_rows` is switched off around this variant's runs only (see `build`)."""


def _int8_before(engine: Any, value: str) -> None:
    """int8 as it was at 84e726b: the input copied with
    the loud channels zeroed, the rows scaled by one broadcast addcmul, and an epilogue of
    one elementwise pass per term (scale, offset, each loud channel, bias)."""
    import types

    from vecpool.models.quant.int8 import Int8Linear
    from vecpool.models.quant.quantize import MIN_AMAX, OffsetRows

    def quantize_rows_u8(x: torch.Tensor, fbgemm: bool, levels: float, rounded: bool) -> Any:
        low = x.amin(dim=-1, keepdim=True)
        scale = (x.amax(dim=-1, keepdim=True) - low).clamp_(min=MIN_AMAX) / levels
        inverse = scale.reciprocal()
        scaled = torch.addcmul(-low * inverse, x, inverse)
        if rounded or not fbgemm:
            scaled = scaled.round_()
        return OffsetRows(scaled if fbgemm else scaled.to(torch.uint8), scale, low)

    def linear(self: Any, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        loud = x[:, self._outlier_index].float()
        if self.outliers:
            x = x.index_fill(1, self._outlier_index, 0)
        fbgemm = self.kernel == "fbgemm"
        rows = quantize_rows_u8(x, fbgemm, float(self.row_levels), rounded=not fbgemm)
        out = self.products(rows)
        if residual is not None:
            out = torch.addcmul(residual.reshape(out.shape).float(), out, rows.scale)
        else:
            out = out.mul_(rows.scale)
        out = out.addcmul_(rows.offset, self.weight_sums)
        for c in range(len(self.outliers)):
            out = out.addcmul_(loud[:, c : c + 1], self.outlier_weight[c])
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.view(*lead, self.out_features)

    for m in _model(engine).modules():
        if isinstance(m, Int8Linear):
            m._linear = types.MethodType(linear, m)  # type: ignore[method-assign]


VARIANTS: dict[str, Callable[[Any, str], None]] = {
    "unfused": _unfused,
    "int8_before": _int8_before,
    "three_copies": _three_copies,
}


def main(argv: list[str] | None = None) -> None:
    import tokenizers

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--queries", type=int, default=1024)
    parser.add_argument("--passages", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--output", type=Path, help="write every round's timings here as JSON")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from vecpool.api import default_model_path

    folder = default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    inputs = {}
    for w, n in (("queries", args.queries), ("passages", args.passages)):
        if n:
            inputs[w] = make_inputs(tokenizer, workload_lengths(w, n))
    runs = {v: build(folder, v) for v in args.variant}
    outs = {w: {v: run(*inputs[w]) for v, run in runs.items()} for w in inputs}
    seconds: dict[str, dict[str, list[float]]] = {w: {v: [] for v in runs} for w in inputs}
    cpu: dict[str, dict[str, list[float]]] = {w: {v: [] for v in runs} for w in inputs}
    order = list(runs)
    for r in range(args.rounds):
        for w, (texts, ids) in inputs.items():
            for v in order[r % len(order) :] + order[: r % len(order)]:
                start, start_cpu = time.perf_counter(), time.process_time()
                runs[v](texts, ids)
                seconds[w][v].append(time.perf_counter() - start)
                cpu[w][v].append(time.process_time() - start_cpu)
    base = order[0]
    for w in inputs:
        for v in order:
            ratios = [b / s for b, s in zip(seconds[w][base], seconds[w][v], strict=True)]
            cpu_ratios = [b / s for b, s in zip(cpu[w][base], cpu[w][v], strict=True)]
            diff = float(np.abs(outs[w][v] - outs[w][base]).max())
            print(
                f"{w:8s} {v:16s} wall {statistics.median(seconds[w][v]):.3f} s"
                f" ({statistics.median(ratios):.3f}x)  cpu {statistics.median(cpu[w][v]):.3f} s"
                f" ({statistics.median(cpu_ratios):.3f}x)  max|diff| {diff:.2e}"
                f"  wall rounds {' '.join(f'{s:.2f}' for s in seconds[w][v])}"
            )
    print(f"load average at the end: {os.getloadavg()}")
    if args.output:
        report = {
            "command": "python benchmarks/lab/ab_cpu.py " + " ".join(argv or []),
            "commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "device": f"{os.cpu_count()}-core CPU ({platform.machine()})",
            "torch_threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg(),
            "workloads": {w: len(v[0]) for w, v in inputs.items()},
            "wall_seconds": seconds,
            "cpu_seconds": cpu,
            "median_cpu_speedup_over_first": {
                w: {
                    v: statistics.median(
                        b / s for b, s in zip(cpu[w][base], cpu[w][v], strict=True)
                    )
                    for v in order
                }
                for w in inputs
            },
            "max_abs_diff_to_first": {
                w: {v: float(np.abs(outs[w][v] - outs[w][base]).max()) for v in order}
                for w in inputs
            },
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
