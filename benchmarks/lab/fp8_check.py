"""FP8 on one Hopper / Ada GPU: the quantization kernels against their torch reference, the
projection matmuls bf16 vs FP8, engine throughput bf16 vs FP8 with the cosine between them,
and prompt embeds == ids under FP8.

    python benchmarks/lab/fp8_check.py --tokenizer TOKENIZER_DIR \
        --output benchmarks/results/fp8_h200.json          # about 6 minutes; --quick: 1

(a) **kernels**: `fp8_kernels.quant_rows`, `rms_norm_rows`, `silu_mul_rows`,
    `add_rms_norm_rows` against `quantize.quantize_rows` of the same rows computed in float32
    (cosine per row, scales; the residual sum against torch's, to the bit).
(b) **matmul**: the q/k/v, o, gate/up and down projections of the Qwen3-0.6B and Mistral-7B
    shapes at M = 8192 and 16384 tokens: bf16 `F.linear`, `torch._scaled_mm` alone on rows
    quantized beforehand, the same with the rows quantized by the one-pass kernel, by torch
    ops (what separate kernels cost), and fused with the producer (RMSNorm for q/k/v and
    gate/up, SiLU * up for down) against the bf16 producer + `F.linear`.
(c) **engine**: bench_gpu.py's random-weight folders and workloads (queries, passages, and a
    quarter of the queries 16 per call: steps of ~200 rows), an engine in bf16, one with
    `quantization="fp8"` (FP8 where `runner/fp8_choice.py` measured it faster, by step size;
    each form's threshold recorded under `fp8_from`) and one FP8 at every step, all with the
    engine's defaults (compiled, CUDA graphs); tokens/s each round and the median; the minimum cosine of the FP8 embeddings
    to the bf16 ones over every input, and, on the first `--fp32-inputs` inputs, of bf16 and
    FP8 to a float32 engine (eager): a random-weight network far from float32 in bf16 already
    amplifies rounding, whatever rounds.
(d) **exactness**: under FP8, prompt embeds (the model's own embedding of the ids) give the
    same bits as the ids, alone and mixed with ids in one call.

Every error is recorded in the report, which is written as it grows; the script exits non-zero
if any check failed or anything raised.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder

# Projection shapes (hidden, intermediate, heads, kv heads, head_dim) of the two models.
MODELS = {"qwen3-0.6b": (1024, 3072, 16, 8, 128), "mistral-7b": (4096, 14336, 32, 8, 128)}
MIN_COSINE = 0.999  # the bar for FP8 against bf16


STEPS = ("kernels", "matmul", "engine")
# The engines of (c): bf16; FP8 where it was measured faster, by step size; FP8 at every step.
SYSTEMS = {"bf16": None, "fp8": "fp8", "fp8_every_step": "fp8"}
SMALL_CALL = 16  # the inputs of one call in the workload of small steps


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/fp8_h200.json"))
    parser.add_argument("--quick", action="store_true", help="a one-minute smoke run")
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS, help="at least 3")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--steps", nargs="+", default=list(STEPS), choices=list(STEPS), help="what to run"
    )
    parser.add_argument(
        "--matmul-rows",
        type=int,
        nargs="+",
        help="the row counts M of (b) (default 8192 16384; 2048 with --quick): small ones show "
        "where FP8 stops paying",
    )
    record.add_args(parser)
    parser.add_argument(
        "--fp32-inputs",
        type=int,
        default=256,
        help="the first N inputs of each workload also run in float32 (eager): the cosines of "
        "bf16 and FP8 to float32 say how much of FP8's distance to bf16 is bf16's own; 0: none",
    )
    return parser.parse_args(argv)


def cuda_ms(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call of `fn`, averaged over `iters` calls between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def rounds(fn: Callable[[], object], n: int, iters: int) -> dict[str, Any]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    raw = [cuda_ms(fn, iters) for _ in range(n)]
    return {"ms": raw, "median_ms": statistics.median(raw)}


# ---- (a) kernels ------------------------------------------------------------------------


def check_kernels(report: dict[str, Any]) -> None:
    from vecpool.models.quant import fp8_kernels  # noqa: F401 - the ops' CUDA kernels
    from vecpool.models.quant.quantize import dequantize_rows, quantize_rows

    out: dict[str, Any] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for cols in (1024, 4096, 14336):
        x = torch.randn(1000, cols, device="cuda", generator=gen, dtype=torch.bfloat16)
        x[0] = 0  # an all-zero row
        x[1] *= 1000
        w = torch.randn(cols, device="cuda", generator=gen, dtype=torch.bfloat16)
        gu = torch.randn(1000, 2 * cols, device="cuda", generator=gen, dtype=torch.bfloat16)
        gu[0] = 0
        norm32 = F.rms_norm(x.float(), (cols,), w.float(), 1e-6)
        gate, up = gu.float().chunk(2, dim=-1)
        delta = torch.randn(1000, cols, device="cuda", generator=gen, dtype=torch.bfloat16)
        delta[0] = 0  # the sum's zero row too
        total, *summed = torch.ops.vecpool.fp8_add_rms_norm(x, delta, w, 1e-6, False)
        sums = {"add_rms_norm_rows": torch.equal(total, x + delta)}  # torch's bf16 sum, bits
        cases = {
            "quant_rows": (torch.ops.vecpool.fp8_quant_rows(x), x.float()),
            "rms_norm_rows": (torch.ops.vecpool.fp8_rms_norm(x, w, 1e-6, False), norm32),
            "silu_mul_rows": (torch.ops.vecpool.fp8_silu_mul(gu), F.silu(gate) * up),
            "add_rms_norm_rows": (
                tuple(summed),
                F.rms_norm((x + delta).float(), (cols,), w.float(), 1e-6),
            ),
        }
        for name, ((data, scale), ref32) in cases.items():
            ref = quantize_rows(ref32)
            got = dequantize_rows(type(ref)(data, scale))
            cos = F.cosine_similarity(got[1:], ref32[1:], dim=-1)
            scale_err = ((scale - ref.scale).abs() / ref.scale)[1:].max()
            row = {
                "min_row_cosine": float(cos.min()),
                "max_scale_rel_diff": float(scale_err),
                "zero_row_ok": bool(torch.isfinite(scale[0]).all() and not got[0].any()),
                "max_abs_vs_reference_fp8": float((got - dequantize_rows(ref)).abs().max()),
            }
            if name in sums:
                row["sum_equals_torch"] = sums[name]
            row["ok"] = (
                row["min_row_cosine"] > 0.998
                and row["max_scale_rel_diff"] < 1e-5
                and row["zero_row_ok"]
                and sums.get(name, True)
            )
            out[f"{name}@{cols}"] = row
            print(f"kernel {name}@{cols}: {row}", flush=True)
    report["kernels"] = out
    if not all(r["ok"] for r in out.values()):
        report["failures"].append("kernels differ from the torch reference")


# ---- (b) matmul microbenchmark ---------------------------------------------------------


def bench_matmuls(report: dict[str, Any], args: argparse.Namespace) -> None:
    sizes = args.matmul_rows or ((2048,) if args.quick else (8192, 16384))
    n_rounds, iters = (3, 3) if args.quick else (max(3, args.rounds), 10)
    for model in args.models:
        hidden, inter, heads, kv, hd = MODELS[model]
        projections = {
            "qkv": (hidden, (heads + 2 * kv) * hd, "rms_norm"),
            "o": (heads * hd, hidden, None),
            "gate_up": (hidden, 2 * inter, "rms_norm"),
            "down": (inter, hidden, "silu_mul"),
        }
        for m in sizes:
            for proj, (kdim, ndim, producer) in projections.items():
                row = {"model": model, "proj": proj, "M": m, "K": kdim, "N": ndim}
                # Small products take microseconds: more calls between the events.
                calls = max(iters, min(200, 131072 // m))
                row.update(bench_projection(m, kdim, ndim, producer, n_rounds, calls))
                report["matmul"].append(row)
                print(
                    f"matmul {model} {proj} M={m}: bf16 {row['bf16']['median_ms']:.3f} ms, "
                    f"x{row['speedup_mm_only']:.2f} mm only, x{row['speedup_kernel_quant']:.2f} "
                    f"with kernel quant, x{row['speedup_torch_quant']:.2f} torch quant, "
                    f"x{row.get('speedup_fused_producer', float('nan')):.2f} fused producer",
                    flush=True,
                )


def bench_projection(
    m: int, kdim: int, ndim: int, producer: str | None, n_rounds: int, iters: int
) -> dict[str, Any]:
    """Timings of one `[m, kdim] x [kdim, ndim]` projection, bf16 and FP8 (see the docstring)."""
    from vecpool.models.quant import fp8_kernels  # noqa: F401 - the ops' CUDA kernels
    from vecpool.models.quant.linear import Fp8Linear
    from vecpool.models.quant.quantize import quantize_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(ndim, kdim, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(m, kdim, device="cuda", dtype=torch.bfloat16, generator=gen)
    layer = Fp8Linear.from_weight(w, None)
    pre = quantize_rows(x)
    wt, ws = layer.weight.t(), layer.weight_scale.view(1, -1)

    def scaled(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(data, wt, scale_a=scale, scale_b=ws, out_dtype=torch.bfloat16)

    row: dict[str, Any] = {
        "bf16": rounds(lambda: F.linear(x, w), n_rounds, iters),
        "fp8_mm_only": rounds(lambda: scaled(pre.data, pre.scale), n_rounds, iters),
        "fp8_kernel_quant": rounds(
            lambda: scaled(*torch.ops.vecpool.fp8_quant_rows(x)), n_rounds, iters
        ),
        "fp8_torch_quant": rounds(lambda: scaled(*quantize_rows(x)), n_rounds, iters),
    }
    if producer == "rms_norm":
        nw = torch.ones(kdim, device="cuda", dtype=torch.bfloat16)
        row["bf16_with_producer"] = rounds(
            lambda: F.linear(F.rms_norm(x, (kdim,), nw, 1e-6), w), n_rounds, iters
        )
        row["fp8_fused_producer"] = rounds(
            lambda: scaled(*torch.ops.vecpool.fp8_rms_norm(x, nw, 1e-6, False)), n_rounds, iters
        )
    elif producer == "silu_mul":
        gu = torch.randn(m, 2 * kdim, device="cuda", dtype=torch.bfloat16, generator=gen)

        def bf16_silu() -> torch.Tensor:
            g, u = gu.chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, w)

        row["bf16_with_producer"] = rounds(bf16_silu, n_rounds, iters)
        row["fp8_fused_producer"] = rounds(
            lambda: scaled(*torch.ops.vecpool.fp8_silu_mul(gu)), n_rounds, iters
        )
    base = row["bf16"]["median_ms"]
    for name in ("mm_only", "kernel_quant", "torch_quant"):
        row[f"speedup_{name}"] = base / row[f"fp8_{name}"]["median_ms"]
    if "fp8_fused_producer" in row:
        row["speedup_fused_producer"] = (
            row["bf16_with_producer"]["median_ms"] / row["fp8_fused_producer"]["median_ms"]
        )
    return row


# ---- (c) engine throughput and cosine, (d) exactness -------------------------------------


def bench_engines(
    report: dict[str, Any], args: argparse.Namespace, tokenizer_dir: Path, save: Callable[[], None]
) -> None:
    import tokenizers

    import vecpool
    from vecpool.runner import fp8_choice

    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    n_rounds = 1 if args.quick else max(3, args.rounds)
    for model in args.models:
        n = 256 if args.quick else (4096 if model == "qwen3-0.6b" else 2048)
        workloads = {
            w: make_inputs(tokenizer, workload_lengths(w, n))[1] for w in ("queries", "passages")
        }
        workloads["queries_in_16s"] = workloads["queries"][: n // 4]
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            folder = write_folder(SHAPES[model], Path(tmp), tokenizer_dir, "cuda")
            print(f"{model}: folder written in {time.perf_counter() - started:.0f} s", flush=True)
            outputs: dict[str, dict[str, np.ndarray]] = {}
            for system, quantization in SYSTEMS.items():
                started = time.perf_counter()
                # "fp8_every_step": FP8 at every step size, the choice by step size off.
                fp8_choice.MEASURED = system != "fp8_every_step"
                engine = vecpool.Engine(
                    folder, device="cuda", dtype="bfloat16", quantization=quantization
                )
                if quantization:
                    forms = fp8_choice.layer_forms(engine.model)
                    report.setdefault("fp8_from", {})[f"{model} {system}"] = {
                        str(form): site.layer.fp8_from for form, site in forms.items()
                    }
                engine.embed(workloads["passages"][:512], show_progress=False)  # compile, graphs
                print(
                    f"{model} {system}: engine ready in {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
                outputs[system] = {}
                for name, ids in workloads.items():
                    tokens = sum(map(len, ids))
                    # "queries_in_16s": one call per 16 queries, steps of ~200 rows.
                    per_call = SMALL_CALL if name == "queries_in_16s" else len(ids)
                    raw = []
                    for _ in range(n_rounds):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        parts = [
                            engine.embed(
                                ids[i : i + per_call],
                                truncate_prompt_tokens=-1,
                                show_progress=False,
                            )
                            for i in range(0, len(ids), per_call)
                        ]
                        out = np.concatenate([np.asarray(p) for p in parts])
                        torch.cuda.synchronize()
                        raw.append(tokens / (time.perf_counter() - t0))
                    outputs[system][name] = np.asarray(out, dtype=np.float32)
                    row = {
                        "model": model,
                        "system": system,
                        "workload": name,
                        "inputs": len(ids),
                        "tokens": tokens,
                        "tokens_per_s": raw,
                        "median_tokens_per_s": statistics.median(raw),
                        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                    }
                    report["engine"].append(row)
                    print(
                        f"{model} {system} {name}: {row['median_tokens_per_s']:.0f} tok/s {raw}",
                        flush=True,
                    )
                    save()
                if quantization == "fp8":
                    checked = exactness(engine, workloads["passages"][:64])
                    report["exactness"][f"{model} {system}"] = checked
                    if not checked["ok"]:
                        report["failures"].append(
                            f"{model} {system}: prompt embeds differ from ids"
                        )
                del engine
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if args.fp32_inputs:
                outputs["fp32"] = float32_outputs(folder, workloads, args.fp32_inputs)
            for name, fp8 in itertools.product(workloads, ("fp8", "fp8_every_step")):
                a, b = outputs["bf16"][name], outputs[fp8][name]
                cos = np.sum(a * b, axis=1) / (
                    np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
                )
                speed = {
                    s: next(
                        r["median_tokens_per_s"]
                        for r in report["engine"]
                        if r["model"] == model and r["system"] == s and r["workload"] == name
                    )
                    for s in ("bf16", fp8)
                }
                summary = {
                    "model": model,
                    "workload": name,
                    "system": fp8,
                    "speedup": speed[fp8] / speed["bf16"],
                    "min_cosine": float(cos.min()),
                    "median_cosine": float(np.median(cos)),
                    "inputs": len(cos),
                }
                if "fp32" in outputs and name in outputs["fp32"]:
                    k = len(outputs["fp32"][name])
                    ref = outputs["fp32"][name]
                    summary["vs_fp32_inputs"] = k
                    summary["bf16_vs_fp32"] = min_median_cosine(a[:k], ref)
                    summary["fp8_vs_fp32"] = min_median_cosine(b[:k], ref)
                report["summary"].append(summary)
                print(f"summary {summary}", flush=True)
                if summary["min_cosine"] < MIN_COSINE:
                    report["failures"].append(
                        f"{model} {name}: min cosine {summary['min_cosine']:.5f} < {MIN_COSINE}"
                    )
                save()


def float32_outputs(
    folder: Path, workloads: dict[str, list[list[int]]], n: int
) -> dict[str, np.ndarray]:
    """The first `n` inputs of each workload embedded by a float32 engine, eager."""
    import vecpool

    started = time.perf_counter()
    engine = vecpool.Engine(
        folder, device="cuda", dtype="float32", compile=False, cuda_graphs=False
    )
    out = {
        name: np.asarray(
            engine.embed(ids[:n], truncate_prompt_tokens=-1, show_progress=False),
            dtype=np.float32,
        )
        for name, ids in workloads.items()
    }
    print(f"float32 reference: {time.perf_counter() - started:.0f} s", flush=True)
    del engine
    torch.cuda.empty_cache()
    return out


def min_median_cosine(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"min": float(cos.min()), "median": float(np.median(cos))}


def exactness(engine: Any, ids: list[list[int]]) -> dict[str, Any]:
    from_ids = np.asarray(engine.embed(ids, show_progress=False))
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in ids]
    alone = np.asarray(engine.embed(embeds, show_progress=False))
    # Every other input as embeds, in the same order: the same flat batches as the ids.
    mixed_inputs = [
        e if i % 2 == 0 else p for i, (e, p) in enumerate(zip(embeds, ids, strict=True))
    ]
    mixed = np.asarray(engine.embed(mixed_inputs, show_progress=False))
    expected_mixed = from_ids
    result = {
        "inputs": len(ids),
        "embeds_equal_ids": bool(np.array_equal(alone, from_ids)),
        "mixed_equal_ids": bool(np.array_equal(mixed, expected_mixed)),
    }
    result["ok"] = result["embeds_equal_ids"] and result["mixed_equal_ids"]
    print(f"exactness {result}", flush=True)
    return result


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_check.py needs a CUDA device")
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        raise SystemExit(
            f"{torch.cuda.get_device_name()} (compute capability {capability}) has no FP8"
        )
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from vecpool.api import default_model_path

        tokenizer_dir = default_model_path()
    import triton

    report: dict[str, Any] = {
        **record.header("lab/fp8_check.py", argv, device="cuda", commit=args.commit),
        "triton": triton.__version__,
        "compute_capability": list(capability),
        "quick": args.quick,
        "kernels": {},
        "matmul": [],
        "engine": [],
        "summary": [],
        "exactness": {},
        "failures": [],
        "errors": [],
    }

    def save() -> None:
        record.write(args.output, report)

    started = time.perf_counter()
    steps: list[tuple[str, Callable[[], None]]] = [
        ("kernels", lambda: check_kernels(report)),
        ("matmul", lambda: bench_matmuls(report, args)),
        ("engine", lambda: bench_engines(report, args, tokenizer_dir, save)),
    ]
    steps = [(name, step) for name, step in steps if name in args.steps]
    return run_steps(steps, report, save, started, args.output)


def run_steps(
    steps: list[tuple[str, Callable[[], None]]],
    report: dict[str, Any],
    save: Callable[[], None],
    started: float,
    output: Path,
) -> int:
    """Run each step, recording its traceback if it raises, saving the report after each;
    the exit status: 1 if any check failed or anything raised."""
    for name, step in steps:
        try:
            step()
        except Exception:  # recorded, and the script fails at the end
            report["errors"].append({"step": name, "traceback": traceback.format_exc()})
            print(f"ERROR in {name}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        report["seconds"] = time.perf_counter() - started
        save()
    print(f"done in {report['seconds']:.0f} s; report in {output}", flush=True)
    if report["failures"] or report["errors"]:
        print(
            f"FAILED: {report['failures']} {[e['step'] for e in report['errors']]}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
