"""FP8 fidelity on the CPU: the engine's FP8 path emulated exactly, against float32 and bf16.

    python benchmarks/lab/fp8_emulate.py --n 1024 --output benchmarks/results/fp8_emulated_minilm.json

FP8 rounding does not need an FP8 device: `Fp8Linear` off CUDA casts each row to
`float8_e4m3fn` with the scale the CUDA kernels compute (`quantize.quantize_rows`: the row's amax
/ 448, float32), multiplies the FP8 values in float32 (exact: a product of two e4m3 values has
at most 8 significant bits) and scales the float32 sums. `torch._scaled_mm` sums the same exact
products in float32, in another order, and rounds the output to bf16, as the emulation in bf16
does. So the cosines here are those of the GPU up to float32 summation order.

The engine refuses FP8 without an FP8 device; this script lets the CPU engine past that check
(`emulated_fp8`) and runs a model folder (by default the packaged all-MiniLM-L6-v2) on
bench_gpu.py's query and passage workloads: float32, bf16, FP8 over float32 activations (the
FP8 error alone) and FP8 over bf16 (what the GPU runs), each policy of `--policies`; it reports
the minimum and median cosine of each to float32 and to bf16, and where the error comes from
(`--layers`: FP8 in one kind of projection at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import tokenizers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench_gpu, record


@contextlib.contextmanager
def emulated_fp8() -> Iterator[None]:
    """Engines built inside accept quantization='fp8' on the CPU (the FP8 reference path)."""
    from vecpool.models.quant import linear as quant

    def check(method: str | None, device: torch.device) -> None:
        if method != "fp8":
            quant.check_quantization(method, device)

    with mock.patch("vecpool.api.build.check_quantization", check):
        yield


def cosines(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    order = np.argsort(cos)
    return {
        "min": float(cos.min()),
        "p01": float(np.quantile(cos, 0.01)),
        "median": float(np.median(cos)),
        "worst_inputs": [int(i) for i in order[:3]],
    }


def narrowed_shape(name: str, divisor: int) -> bench_gpu.Shape:
    """bench_gpu.py's decoder shape `name` with its widths divided by `divisor` and the
    weights' standard deviation (transformers' `initializer_range`, 0.02) multiplied by
    sqrt(divisor), so each projection scales its input as the full shape's does."""
    shape = bench_gpu.SHAPES[name]
    config = dict(shape.config)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        config[key] = max(1, config[key] // divisor)
    config["initializer_range"] = 0.02 * divisor**0.5
    config["vocab_size"] = 30522  # the packaged MiniLM's tokenizer
    return dataclasses.replace(shape, config=config)


def embed(engine: Any, ids: list[list[int]]) -> np.ndarray:
    out = engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
    return np.asarray(out, dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--workloads", nargs="+", default=["queries", "passages"])
    parser.add_argument(
        "--random-shape",
        choices=[k for k, v in bench_gpu.SHAPES.items() if v.causal],
        help="instead of a folder: bench_gpu.py's random-weight decoder of this shape, narrowed",
    )
    parser.add_argument(
        "--width-divisor",
        type=int,
        default=8,
        help="with --random-shape: hidden, intermediate and head counts divided by this, the "
        "weights' standard deviation multiplied by its square root (each projection's gain, "
        "std * sqrt(fan-in), stays the full shape's); depth and head size as they are",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    import vecpool
    from vecpool.api import default_model_path

    tokenizer_dir = default_model_path() if args.model_dir is None else args.model_dir
    tmp = tempfile.TemporaryDirectory()
    if args.random_shape:
        model_dir = bench_gpu.write_folder(
            narrowed_shape(args.random_shape, args.width_divisor),
            Path(tmp.name),
            tokenizer_dir,
            "cpu",
        )
    else:
        model_dir = tokenizer_dir
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    report: dict[str, Any] = {
        **record.header("lab/fp8_emulate.py", sys.argv[1:], device="cpu"),
        "emulation": "FP8 emulated on the CPU",
        "model": (
            f"{args.random_shape} / {args.width_divisor} (random weights)"
            if args.random_shape
            else model_dir.name
        ),
    }
    inputs = {
        w: bench_gpu.make_inputs(tokenizer, bench_gpu.workload_lengths(w, args.n))[1]
        for w in args.workloads
    }
    out: dict[str, dict[str, np.ndarray]] = {w: {} for w in inputs}
    # FP8 over float32 activations is the FP8 rounding alone; over bf16 it is the GPU's path.
    systems = [
        ("float32", "float32", None),
        ("bfloat16", "bfloat16", None),
        ("fp8/float32", "float32", "fp8"),
        ("fp8/bfloat16", "bfloat16", "fp8"),
    ]
    for name, dtype, quantization in systems:
        started = time.perf_counter()
        with emulated_fp8():
            engine = vecpool.Engine(model_dir, device="cpu", dtype=dtype, quantization=quantization)
        for w, ids in inputs.items():
            out[w][name] = embed(engine, ids)
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    for w in inputs:
        ref32, ref16 = out[w]["float32"], out[w]["bfloat16"]
        report[w] = {
            "inputs": len(inputs[w]),
            **{
                name: {"vs_fp32": cosines(v, ref32), "vs_bf16": cosines(v, ref16)}
                for name, v in out[w].items()
                if name != "float32"
            },
        }
        print(w, json.dumps(report[w], indent=1), flush=True)
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
