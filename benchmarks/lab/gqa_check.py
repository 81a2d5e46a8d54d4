"""Grouped-query attention without expanded keys and values, on CUDA: exactness and speed.

    python benchmarks/lab/gqa_check.py --tokenizer DIR --output results.json

On a torch whose `varlen_attn` takes no `enable_gqa` (2.11), vecpool calls the FlashAttention
kernel underneath it with the model's own key/value heads (`attention._flash_gqa`) instead of
repeating each key/value head for its query heads. This checks, on one CUDA device:

1. the kernel: `_flash_gqa` against `varlen_attn` on expanded keys and values, for causal,
   bidirectional and sliding-window attention on a flat batch of mixed lengths (Qwen3-0.6B's
   16 query / 8 key-value heads and Mistral-7B's 32 / 8, head_dim 128): the largest difference
   (0.0 expected: the same kernel reads the same numbers) and the time of each, including the
   expansion, as medians of `--repeats` rounds;
2. the engine: the Qwen3-0.6B shape (random weights, workloads.py's folder and workloads) from
   token ids with `_flash_gqa` against the same engine with the expansion put back, rounds
   interleaved in one process, tokens/s medians and every round, and the outputs' difference.
   The swap is a module attribute, which compiled code and recorded CUDA graphs would keep, so
   this engine runs eager without graphs; then the default engine (compiled, graphs) runs once
   more with `_flash_gqa` for the absolute figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record, workloads
from benchmarks.bench_gpu import flop_model
from vecpool.models.layers import attention

HEADS = {"qwen3-0.6b": (16, 8), "mistral-7b": (32, 8)}


def _expanded(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right):  # type: ignore[no-untyped-def]
    """The path `_flash_gqa` replaces: repeat each key/value head, then `varlen_attn`."""
    varlen_attn, _ = attention._varlen_kernel()  # type: ignore[misc]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, right))


def _timed(fn, repeats: int, iters: int) -> list[float]:  # type: ignore[no-untyped-def]
    rounds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / iters)
    return rounds


def kernel_check(repeats: int) -> dict[str, Any]:
    device = torch.device("cuda")
    lengths = workloads.workload_lengths("passages", 96)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.from_numpy(np.cumsum(lengths))
    cu = cu.to(device)
    total, max_len = int(lengths.sum()), int(lengths.max())
    out: dict[str, Any] = {"tokens": total, "sequences": len(lengths)}
    gen = torch.Generator(device).manual_seed(0)
    for name, (heads, kv_heads) in HEADS.items():
        q = torch.randn(total, heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(total, kv_heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(total, kv_heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
        for mode, (left, right) in {
            "causal": (-1, 0),
            "bidirectional": (-1, -1),
            "causal window 64": (63, 0),
        }.items():
            args = (q, k, v, cu, cu, max_len, max_len, 128**-0.5, left, right)
            ref = _expanded(*args)
            new = attention._flash_gqa(*args)
            base = _timed(lambda a=args: _expanded(*a), repeats, 20)
            fast = _timed(lambda a=args: attention._flash_gqa(*a), repeats, 20)
            out[f"{name} {mode}"] = {
                "max_abs_diff": float((ref.float() - new.float()).abs().max()),
                "expanded_seconds": base,
                "gqa_seconds": fast,
                "speedup_median": statistics.median(base) / statistics.median(fast),
            }
            print(name, mode, out[f"{name} {mode}"], flush=True)
    return out


def engine_check(tokenizer: Path, repeats: int, n: int) -> dict[str, Any]:
    import vecpool

    shape = workloads.SHAPES["qwen3-0.6b"]
    tok = __import__("tokenizers").Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = workloads.write_folder(shape, Path(tmp), tokenizer, "cuda")
        flops = flop_model(folder)
        engine = vecpool.Engine(
            folder, device="cuda", dtype="bfloat16", compile=False, cuda_graphs=False
        )
        gqa = attention._flash_gqa
        for workload in ("queries", "passages"):
            lengths = workloads.workload_lengths(workload, n)
            _, ids = workloads.make_inputs(tok, lengths)
            tokens = int(lengths.sum())
            rounds: dict[str, list[float]] = {"gqa": [], "expanded": []}
            outputs: dict[str, np.ndarray] = {}
            for variant in ("gqa", "expanded"):  # warm-up, and each path's outputs
                attention._flash_gqa = gqa if variant == "gqa" else _expanded
                outputs[variant] = engine.embed(ids, show_progress=False)
            for _ in range(repeats):
                for variant in ("gqa", "expanded"):
                    attention._flash_gqa = gqa if variant == "gqa" else _expanded
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    engine.embed(ids, show_progress=False)
                    torch.cuda.synchronize()
                    rounds[variant].append(tokens / (time.perf_counter() - start))
            attention._flash_gqa = gqa
            med = {k: statistics.median(v) for k, v in rounds.items()}
            out[workload] = {
                "tokens": tokens,
                "tokens_per_s_rounds": rounds,
                "tokens_per_s_median": med,
                "speedup_median": med["gqa"] / med["expanded"],
                "flops_per_token_mean": flops.flops(lengths) / tokens,
                "max_abs_output_diff": float(np.abs(outputs["gqa"] - outputs["expanded"]).max()),
            }
            print(workload, out[workload], flush=True)
        del engine
        engine = vecpool.Engine(folder, device="cuda", dtype="bfloat16")
        for workload in ("queries", "passages"):
            lengths = workloads.workload_lengths(workload, n)
            _, ids = workloads.make_inputs(tok, lengths)
            engine.embed(ids[:512], show_progress=False)
            default_rounds = []
            for _ in range(repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.embed(ids, show_progress=False)
                torch.cuda.synchronize()
                default_rounds.append(int(lengths.sum()) / (time.perf_counter() - start))
            out[workload]["default_engine_tokens_per_s_rounds"] = default_rounds
            out[workload]["default_engine_tokens_per_s_median"] = statistics.median(default_rounds)
            print(workload, "default engine", default_rounds, flush=True)
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gqa_check needs a CUDA device")
    report: dict[str, Any] = {
        **record.header("lab/gqa_check.py", argv, device="cuda", commit=args.commit),
        "varlen_attn_has_enable_gqa": attention._varlen_kernel()[1],  # type: ignore[index]
    }
    report["kernel"] = kernel_check(args.repeats)
    report["engine_qwen3-0.6b"] = engine_check(args.tokenizer, args.repeats, args.n)
    record.write(args.output, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
