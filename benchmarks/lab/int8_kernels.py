"""Which int8 kernel pays on the CPU: MiniLM's projections through each candidate, natively and
with the instruction set capped to AVX2, against float32.

    python benchmarks/lab/int8_kernels.py --output benchmarks/results/int8_kernels.json

Each instruction set runs in a subprocess of its own, since oneDNN, MKL and ATen read their
caps once, when torch loads: `native` (no caps) and `avx2` (`ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2`: AVX2
without VNNI, as on AMD Zen 2 / 3; FBGEMM reads the CPU's flags itself and only its own variable
caps it).
Shapes: all-MiniLM-L6-v2's q/k/v fused (384 -> 1152), o (384 -> 384), up (384 -> 1536) and
down (1536 -> 384), at `--rows` rows. Candidates, each the whole linear (quantizing the rows,
the product, the scaling, the bias), milliseconds per call:

- `fp32`: `F.linear` (the BLAS GEMM); `fp32-packed`: oneDNN with the weight prepacked
  (`runner/cpu_linear.py`, the engine's float32 CPU path).
- `int-mm`: per-row symmetric int8 through `torch._int_mm` (the int8 linear before this probe).
- `onednn-u8`: per-row asymmetric uint8 rows (one scale and one offset per row) times per-channel
  int8 weights through `torch.ops.onednn.qlinear_pointwise` (weights prepacked by
  `onednn.qlinear_prepack`), float32 out, then the rows' scales and offsets.
- `fbgemm-u8`: the same rows through FBGEMM (`quantized.linear_with_input_q_dq_qweight_dq_output_fp32`
  on rows already scaled to [0, 255], input scale 1), then the same finish.
- `vecpool-int8`: `models/quant/int8.py`'s `Int8Linear` as the engine runs it (FBGEMM, one
  input channel in float32, 7-bit weights where the kernel would saturate 8-bit ones).
- `fbgemm-dynamic`: FBGEMM's `quantized.linear_dynamic` (one scale for the whole input: a row's
  result depends on the other rows; for the kernel's speed alone).

Every candidate's relative error to float64 on the same random rows is kept too (the u8 ones
are the same arithmetic up to the order of the float32 finish). The machine may be shared:
the candidates of a shape are timed in rounds, in an order that rotates, and the report keeps
the median and the best of the rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = {"qkv": (384, 1152), "o": (384, 384), "up": (384, 1536), "down": (1536, 384)}
CAPS = {
    "native": {},
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    },
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", nargs="+", default=list(CAPS), choices=list(CAPS))
    parser.add_argument("--seconds", type=float, default=0.05, help="per timing, at least")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(args)))
        return {}
    # The load average around the run: the machine may be shared (timings then move).
    report: dict[str, Any] = {"argv": sys.argv[1:], "load_average_at_start": os.getloadavg()}
    report["isa"] = {}
    for isa in args.isa:
        child = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--output"]
        if args.output is not None:
            child = [a for a in child if a != str(args.output)]
        env = {**os.environ, **CAPS[isa]}
        out = subprocess.run(
            [sys.executable, __file__, *child, "--child"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        report["isa"][isa] = {"caps": CAPS[isa], **json.loads(out.strip().splitlines()[-1])}
        print_table(isa, report["isa"][isa])
    report["load_average_at_end"] = os.getloadavg()
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_table(isa: str, result: dict[str, Any]) -> None:
    print(
        f"== {isa} (cpu capability {result['cpu_capability']}, {result['threads']} threads, "
        f"FBGEMM exact over the full uint8 x int8 range: {result['fbgemm_full_range_exact']})"
    )
    for name, by_rows in result["ms_median"].items():
        for rows, by_kernel in by_rows.items():
            base = by_kernel["fp32-packed"]
            cells = "  ".join(f"{k} {v:7.3f}" for k, v in by_kernel.items())
            print(
                f"{name:5s} {rows:>5s}  {cells}   (fp32-packed / vecpool-int8 "
                f"{base / by_kernel['vecpool-int8']:.2f}x)"
            )
    print("relative error to float64:", json.dumps(result["rel_error"]))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
    from vecpool.models.quant.int8 import full_range_exact

    result: dict[str, Any] = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # Whether FBGEMM sums 255 * 127 products exactly here (VNNI), or saturates (AVX2)
        "fbgemm_full_range_exact": full_range_exact("fbgemm"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "ms_median": {},
        "ms_best": {},
        "rel_error": {},
    }
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            gen = torch.Generator().manual_seed(0)
            weight = torch.randn(n, k, generator=gen) / k**0.5
            bias = torch.randn(n, generator=gen) * 0.1
            kernels = candidates(weight, bias)
            for rows in args.rows:
                # Rows shaped like a layer norm's or a GELU's output: mostly small, a few large.
                x = torch.randn(rows, k, generator=gen)
                x[:, :: max(1, k // 8)] *= 6
                times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
                order = list(kernels)
                for r in range(args.rounds):
                    for kernel in order[r % len(order) :] + order[: r % len(order)]:
                        run = functools.partial(kernels[kernel], x)
                        times[kernel].append(time_ms(run, args.seconds))
                result["ms_median"].setdefault(name, {})[str(rows)] = {
                    kernel: statistics.median(t) for kernel, t in times.items()
                }
                result["ms_best"].setdefault(name, {})[str(rows)] = {
                    kernel: min(t) for kernel, t in times.items()
                }
                if rows == args.rows[-1]:
                    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
                    result["rel_error"][name] = {
                        kernel: float((f(x).double() - exact).norm() / exact.norm())
                        for kernel, f in kernels.items()
                    }
    return result


def time_ms(fn: Callable[[], object], seconds: float) -> float:
    fn()
    iters, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < seconds or iters < 3:
        fn()
        iters += 1
        elapsed = time.perf_counter() - start
    return elapsed / iters * 1e3


def candidates(weight: Any, bias: Any) -> dict[str, Callable[[Any], Any]]:
    import torch
    import torch.nn.functional as F

    from vecpool.models.quant.int8 import Int8Linear

    n = weight.shape[0]
    packed32 = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    w_scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N]
    w_q = (weight / w_scale[:, None]).round().to(torch.int8)  # [N, K]
    w_t = w_q.t().contiguous()
    # Each output channel's sum of its dequantized weights: what a row's offset adds to it.
    w_sums = (w_q.float().sum(dim=1) * w_scale).contiguous()  # [N]
    finish = torch.stack([w_sums, bias])  # [2, N]
    packed_onednn = torch.ops.onednn.qlinear_prepack(w_q, None)
    zero_points = torch.zeros(n, dtype=torch.long)
    torch.backends.quantized.engine = (
        "fbgemm" if "fbgemm" in (torch.backends.quantized.supported_engines) else "x86"
    )
    qweight = torch.quantize_per_channel(weight, w_scale.double(), zero_points, 0, torch.qint8)
    packed_fbgemm = torch.ops.quantized.linear_prepack(qweight, None)
    packed_dynamic = torch.ops.quantized.linear_prepack(qweight, bias)

    def rows_u8(x: Any) -> tuple[Any, Any, Any]:
        """[M, K] -> uint8 rows, [M, 1] scales and offsets: x ~ q * scale + offset."""
        low, high = torch.aminmax(x, dim=1, keepdim=True)
        scale = (high - low).clamp_(min=1e-12) / 255
        inv = scale.reciprocal()
        q = torch.addcmul(-low * inv, x, inv).round_().to(torch.uint8)
        return q, scale, low

    def rows_scaled(x: Any) -> tuple[Any, Any, Any]:
        """[M, K] -> float rows in [0, 255] (FBGEMM rounds them), scales and offsets."""
        low, high = torch.aminmax(x, dim=1, keepdim=True)
        scale = (high - low).clamp_(min=1e-12) / 255
        inv = scale.reciprocal()
        return torch.addcmul(-low * inv, x, inv), scale, low

    def finish_rows(y: Any, scale: Any, low: Any) -> Any:
        # y * scale + [low, 1] @ [w_sums; bias]: two passes over the output.
        return y.mul_(scale).addmm_(torch.cat([low, torch.ones_like(low)], dim=1), finish)

    def onednn_u8(x: Any) -> Any:
        q, scale, low = rows_u8(x)
        y = torch.ops.onednn.qlinear_pointwise(
            q,
            1.0,
            0,
            packed_onednn,
            w_scale,
            zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )
        return finish_rows(y, scale, low)

    def fbgemm_u8(x: Any) -> Any:
        xs, scale, low = rows_scaled(x)
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            xs, 1.0, 0, packed_fbgemm
        )
        return finish_rows(y, scale, low)

    def int_mm(x: Any) -> Any:
        s = (
            torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True).clamp_(min=1e-12)
            / 127
        )
        q = (x / s).round_().to(torch.int8)
        return (torch._int_mm(q, w_t) * s).mul_(w_scale).add_(bias)

    return {
        "fp32": lambda x: F.linear(x, weight, bias),
        "fp32-packed": lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed32, bias, "none", [], ""
        ),
        "int-mm": int_mm,
        "onednn-u8": onednn_u8,
        "fbgemm-u8": fbgemm_u8,
        "vecpool-int8": Int8Linear(weight, bias, kernel="fbgemm", outliers=[0]),
        "fbgemm-dynamic": lambda x: torch.ops.quantized.linear_dynamic(x, packed_dynamic, False),
    }


if __name__ == "__main__":
    main(sys.argv[1:])
