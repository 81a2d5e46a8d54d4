"""`qk_rotary`'s kernel against the modules it replaces (RMSNorm on the query / key heads, then
`apply_rotary`), eager and compiled, on CUDA: time per call for each tile, and the largest
error of each against the same math in float32.

    PYTHONPATH=. python benchmarks/lab/qk_rotary_check.py --output qk_rotary_check.json

Layouts (query heads, key/value heads, head size, norm, unit offset) of the models that take
the kernel: Qwen3-0.6B, Mistral-7B (rotary alone), EmbeddingGemma-300m (Gemma3's 256-wide heads
and offset norm), Qwen2-1.5B. q and k are views of one fused projection's output, as in the
model. Times: the median of `--repeats` CUDA-event timings of `--iters` calls each.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.lab.fp8_check import cuda_ms
from vecpool.models.layers import qk_rotary
from vecpool.models.layers.basic import RMSNorm, Rotary, apply_rotary

LAYOUTS = {
    "qwen3-0.6b": (16, 8, 128, True, False),
    "mistral-7b": (32, 8, 128, False, False),
    "embeddinggemma-300m": (3, 1, 256, True, True),
    "qwen2-1.5b": (12, 2, 128, False, False),
}
TILES = [(8, 2), (16, 4), (32, 4), (32, 8), (64, 8)]


def timed(fn: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median microseconds per call."""
    for _ in range(3):
        fn()
    times = [cuda_ms(fn, iters) * 1000 for _ in range(repeats)]
    return statistics.median(times)


def measure(name: str, tokens: int, dtype: torch.dtype, iters: int, repeats: int) -> dict[str, Any]:
    """One layout at one step size: errors against float32, then times."""
    heads, kv_heads, head_dim, norm, offset = LAYOUTS[name]
    torch.manual_seed(0)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = torch.randn(tokens, sum(sizes), device="cuda").mul(3).to(dtype)
    q, k, _ = qkv.split(sizes, -1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cos, sin = Rotary(head_dim, {"rope_theta": 1e6}).cos_sin(positions, dtype)
    weights = [(1 + 0.3 * torch.randn(head_dim, device="cuda")).to(dtype) for _ in range(2)]

    def norms(in_dtype: torch.dtype) -> list[RMSNorm] | None:
        """The query and key norms in `in_dtype`, built once (not in the timed calls)."""
        if not norm:
            return None
        out = [RMSNorm(head_dim, 1e-6, offset).cuda().to(in_dtype) for _ in "qk"]
        for module, weight in zip(out, weights, strict=True):
            module.weight.data = weight.to(in_dtype)
        return out

    def modules(q: torch.Tensor, k: torch.Tensor, qk_norms: list[RMSNorm] | None) -> Any:
        if qk_norms is not None:
            q, k = qk_norms[0](q), qk_norms[1](k)
        c, s = cos.to(q.dtype), sin.to(q.dtype)
        return apply_rotary(q, c, s), apply_rotary(k, c, s)

    half_norms = norms(dtype)

    def eager() -> Any:
        return modules(q, k, half_norms)

    compiled = torch.compile(eager, dynamic=False)
    w = weights if norm else [None, None]

    def kernel(tile: tuple[int, int] | None = None) -> Any:
        return qk_rotary._launch(q, k, cos, sin, w[0], w[1], 1e-6, offset, tile)

    # The same math in float32 from the same inputs: the error of each way.
    truth = modules(q.float(), k.float(), norms(torch.float32))
    errors = {
        way: max(float((a.float() - b).abs().max()) for a, b in zip(out, truth, strict=True))
        for way, out in (("eager", eager()), ("compiled", compiled()), ("kernel", kernel()))
    }
    row: dict[str, Any] = {
        "layout": name,
        "tokens": tokens,
        "max_abs_error_vs_float32": errors,
        "us_eager": timed(eager, iters, repeats),
        "us_compiled": timed(compiled, iters, repeats),
        "us_kernel_by_tile": {
            str(tile): timed(lambda: kernel(tile), iters, repeats)  # noqa: B023 - called here
            for tile in TILES
        },
    }
    by_tile = row["us_kernel_by_tile"]
    row["best_tile"] = min(by_tile, key=by_tile.get)
    row["us_kernel_default_tile"] = by_tile[str(qk_rotary._TILE)]
    row["bytes_moved"] = (sum(sizes[:2]) * 2 + 2 * head_dim) * tokens * qkv.element_size()
    row["kernel_default_tb_per_s"] = row["bytes_moved"] / row["us_kernel_default_tile"] / 1e6
    return row


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 32768])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report = record.header("lab/qk_rotary_check.py", argv, device="cuda", commit=args.commit)
    rows = report["rows"] = []
    with torch.no_grad():
        for name, tokens in itertools.product(args.layouts, args.tokens):
            row = measure(name, tokens, getattr(torch, args.dtype), args.iters, args.repeats)
            rows.append(row)
            best = row["best_tile"]
            print(
                f"{name:20s} {tokens:6d} tokens: eager {row['us_eager']:.1f} us, compiled "
                f"{row['us_compiled']:.1f}, kernel {row['us_kernel_default_tile']:.1f} "
                f"({row['kernel_default_tb_per_s']:.2f} TB/s; best {best} "
                f"{row['us_kernel_by_tile'][best]:.1f}); errors "
                f"{row['max_abs_error_vs_float32']}",
                flush=True,
            )
            record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
