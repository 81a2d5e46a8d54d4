"""GPU check of the biased varlen attention kernel (vecpool/models/layers/biased_attention.py): its
output against a float32 reference per sequence, and its time against the padded fallback it
replaces, at MPNet-base's attention shape (12 heads of 64) over query- and passage-like steps.

    PYTHONPATH=. python benchmarks/lab/biased_attention_check.py [--output FILE]

Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import record
from vecpool.models.layers import biased_attention
from vecpool.models.layers.attention import AttentionMetadata, flat_attention

HEADS, DIM = 12, 64


def metadata(lengths: list[int], device: str, use_varlen: bool) -> AttentionMetadata:
    counts = torch.tensor(lengths)
    cu = torch.tensor([0, *counts.cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), counts).to(device)
    starts = torch.repeat_interleave(cu[:-1].cpu().long(), counts).to(device)
    pos = torch.arange(int(counts.sum()), device=device) - starts
    return AttentionMetadata(cu, max(lengths), seq_ids, pos, use_varlen=use_varlen)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out, start = torch.empty_like(q), 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        logits = qs @ ks.transpose(1, 2) * scale + bias[0, :, :n, :n]
        out[start : start + n] = (logits.softmax(-1) @ vs).transpose(0, 1)
        start += n
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, bias: torch.Tensor
) -> torch.Tensor:
    return flat_attention(q, k, v, meta, causal=False, scale=DIM**-0.5, bias=bias)


def timed(fn: Any, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    report: dict[str, Any] = record.header(
        "lab/biased_attention_check.py", argv, device=dev, commit=args.commit
    )
    failures: list[str] = []
    gen = torch.Generator().manual_seed(0)
    cases = {
        "mixed": [1, 5, 63, 64, 65, 130, 512, 7],
        "queries": torch.randint(8, 60, (1024,), generator=gen).tolist(),
        "passages": torch.randint(100, 400, (160,), generator=gen).tolist(),
    }
    for name, lengths in cases.items():
        total, longest = sum(lengths), max(lengths)
        # q, k and v as a fused projection's output split into heads (strided rows).
        qkv = torch.randn(total, 3 * HEADS * DIM, device=dev, dtype=dt)
        q, k, v = (t.view(total, HEADS, DIM) for t in qkv.split(HEADS * DIM, dim=1))
        bias = torch.randn(1, HEADS, longest, longest, device=dev, dtype=dt) * 2
        for scale in (DIM**-0.5, 1.0):  # MPNet / T5
            out = biased_attention.biased_attention(
                q, k, v, metadata(lengths, dev, True).cu_seqlens, longest, bias, scale
            )
            ref = reference(q.float(), k.float(), v.float(), lengths, bias.float(), scale)
            error = float((out.float() - ref).abs().max())
            report[f"max_error_{name}_scale{scale:.3g}"] = error
            if error > 3e-2 or not bool(torch.isfinite(out).all()):
                failures.append(f"{name}, scale {scale}: max error {error}")
        kernel_meta, padded_meta = metadata(lengths, dev, True), metadata(lengths, dev, False)
        runs = {
            "kernel": functools.partial(attend, q, k, v, kernel_meta, bias),
            "padded": functools.partial(attend, q, k, v, padded_meta, bias),
        }
        difference = (runs["kernel"]() - runs["padded"]()).abs().max()
        report[f"max_difference_to_padded_{name}"] = float(difference)
        for system, run in runs.items():
            report[f"seconds_{system}_{name}"] = timed(run)
        report[f"speedup_{name}"] = (
            report[f"seconds_padded_{name}"] / report[f"seconds_kernel_{name}"]
        )
    report["failures"] = failures
    print(json.dumps(report, indent=1))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:])["failures"] else 0)
