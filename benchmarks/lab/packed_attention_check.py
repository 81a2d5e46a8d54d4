"""GPU check of the packed attention kernel (vecpool/models/layers/packed_attention.py): its output
against a float32 reference per sequence, next to FlashAttention's varlen kernel (the path it
replaces), and both kernels' device time, at the attention shapes of Qwen3-0.6B (16 query
heads, 8 key/value heads of 128, causal), BERT-base (12 of 64) and MiniLM-L6 (12 of 32),
over steps of query-, mid-, passage-length and long sequences (up to 4,096 tokens).

    PYTHONPATH=. python benchmarks/lab/packed_attention_check.py [--output FILE]

Each kernel's time is the median over 5 replays of a CUDA graph of 20 calls (no host launch
cost in it), microseconds per call. The `online` step is 16 queries as a server's CUDA graph
holds them: rows padded to a multiple of 128 and 128 sequence slots, the empty ones repeating
the last boundary. `--tiles` adds tile shapes (BLOCK_M,BLOCK_N,warps[,query heads a
program]) to time beside the default (`packed_attention.tile_for` the layout's group); a tile
whose head count does not divide a layout's group is not timed there. Exits non-zero when a check fails: the packed kernel's largest difference from the
reference above twice FlashAttention's (or 0.02, whichever is more).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from vecpool.models.layers import packed_attention
from vecpool.models.layers.attention import AttentionMetadata, flat_attention

# name: (query heads, key/value heads, head size, causal)
SHAPES = {
    "qwen3-0.6b": (16, 8, 128, True),
    "bert-base": (12, 12, 64, False),
    "minilm": (12, 12, 32, False),
}


STEPS = ("online", "queries", "mid", "passages", "long", "longest")


def step_lengths(name: str, rng: np.random.Generator) -> list[int]:
    if name in ("online", "queries"):
        return rng.integers(8, 65, size=16 if name == "online" else 700).tolist()
    if name == "mid":
        return rng.integers(64, 129, size=200).tolist()
    if name == "long":
        return rng.integers(512, 1025, size=32).tolist()
    if name == "longest":
        return rng.integers(2048, 4097, size=8).tolist()
    lengths = np.clip(np.exp(rng.normal(np.log(180), 0.6, size=160)), 32, 512)
    return lengths.astype(int).tolist()


def boundaries(lengths: list[int], slots: int, device: str) -> torch.Tensor:
    cu = np.zeros(slots + 1, dtype=np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    return torch.from_numpy(cu).to(device)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool
) -> torch.Tensor:
    """float32 attention, one sequence at a time."""
    group = q.shape[1] // k.shape[1]
    out, start = torch.zeros_like(q, dtype=torch.float32), 0
    for n in lengths:
        qs = q[start : start + n].float().transpose(0, 1)  # [H, n, D]
        ks, vs = (
            t[start : start + n].float().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v)
        )
        logits = qs @ ks.transpose(1, 2) * q.shape[2] ** -0.5
        if causal:
            logits = logits.masked_fill(
                torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        out[start : start + n] = (logits.softmax(-1) @ vs).transpose(0, 1)
        start += n
    return out


def graph_time(fn: Any, calls: int = 20, repeats: int = 5) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles the kernel (and warms FlashAttention) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return float(np.median(times))


def check(
    shape: str,
    layout: tuple[int, int, int, bool],
    step: str,
    lengths: list[int],
    tiles: list[tuple[int, ...]],
) -> dict[str, Any]:
    """One step of `lengths` at `shape`'s attention layout: both kernels' errors and times."""
    heads, kv_heads, dim, causal = layout
    tokens = sum(lengths)
    rows = -(-tokens // 128) * 128 if step == "online" else tokens
    slots = 128 if step == "online" else len(lengths)
    cu = boundaries(lengths, slots, "cuda")
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(rows, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    scale = dim**-0.5

    def flash(cu: torch.Tensor = cu) -> torch.Tensor:
        meta = AttentionMetadata(cu, max(lengths), torch.empty(0), torch.empty(0), True)
        return flat_attention(q, k, v, meta, causal=causal, scale=scale)

    def packed(t: tuple[int, ...] | None = None) -> torch.Tensor:
        return packed_attention._launch(q, k, v, cu, causal, scale, t)  # type: ignore[arg-type]

    want = reference(q, k, v, lengths, causal)[:tokens]
    flash_err = float((flash()[:tokens].float() - want).abs().max())
    packed_err = float((packed()[:tokens].float() - want).abs().max())
    us = {"flash": graph_time(flash), "packed": graph_time(packed)}
    if step == "online":  # FlashAttention with only the step's own slots
        own = cu[: len(lengths) + 1]
        us["flash, own slots"] = graph_time(lambda: flash(own))
    for t in tiles:
        if (heads // kv_heads) % (*t, 1)[3] == 0:  # heads a program must divide the group
            us["packed " + ",".join(map(str, t))] = graph_time(lambda t=t: packed(t))
    return {
        "shape": shape,
        "step": step,
        "sequences": len(lengths),
        "tokens": tokens,
        "rows": rows,
        "slots": slots,
        "max_len": max(lengths),
        "default_tile": packed_attention.tile_for(heads // kv_heads),
        "max_abs_err": {"flash": flash_err, "packed": packed_err},
        "ok": packed_err <= max(2 * flash_err, 0.02),
        "us_per_call": us,
        "speedup": us["flash"] / us["packed"],
    }


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", nargs="*", default=[], help="e.g. 128,64,8 64,32,4")
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report: dict[str, Any] = record.header(
        "lab/packed_attention_check.py", argv, device="cuda", commit=args.commit
    )
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    rows_out = []
    for shape, layout in SHAPES.items():
        for step in STEPS:
            row = check(shape, layout, step, step_lengths(step, rng), tiles)
            rows_out.append(row)
            us = row["us_per_call"]
            err = row["max_abs_err"]
            print(
                f"{shape:11s} {step:8s} {row['sequences']:4d} seqs {row['tokens']:6d} tok  "
                + "  ".join(f"{name} {t:8.1f} us" for name, t in us.items())
                + f"  err flash {err['flash']:.4f} packed {err['packed']:.4f}"
                + ("" if row["ok"] else "  FAILED"),
                flush=True,
            )
    failures = sum(not row["ok"] for row in rows_out)
    report["rows"] = rows_out
    report["failures"] = failures
    record.write(args.output, report)
    if failures:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
