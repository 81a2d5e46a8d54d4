"""GPU check of attention split at shared prefixes (vecpool/models/layers/split_attention.py):
FlashAttention with log-sum-exps against a float32 reference, the Triton merge against the
torch merge, and a split over a shared prefix against one pass over all keys.

    PYTHONPATH=. python benchmarks/lab/split_attention_check.py [--output FILE]

Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import record
from vecpool.models.layers import split_attention
from vecpool.models.layers.kv_blocks import SharedPrefixes


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dev, dt, heads, kv_heads, dim = "cuda", torch.bfloat16, 16, 8, 128
    report: dict[str, Any] = record.header(
        "lab/split_attention_check.py", argv, device="cuda", commit=args.commit
    )
    failures = []
    # 1. attention with log-sum-exps, causal (queries at the end of longer keys) and not.
    q_lens, k_lens = [40, 7, 300], [40, 90, 500]
    q = torch.randn(sum(q_lens), heads, dim, device=dev, dtype=dt)
    k = torch.randn(sum(k_lens), kv_heads, dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    for causal in (True, False):
        cu_q, cu_k = cu(q_lens), cu(k_lens)
        out, lse = split_attention.attention_with_lse(
            q,
            k,
            v,
            cu_q.to(dev),
            cu_k.to(dev),
            max(q_lens),
            max(k_lens),
            scale=dim**-0.5,
            causal=causal,
        )
        ref_out, ref_lse = split_attention.attention_with_lse(
            q.cpu().float(),
            k.cpu().float(),
            v.cpu().float(),
            cu_q,
            cu_k,
            max(q_lens),
            max(k_lens),
            scale=dim**-0.5,
            causal=causal,
        )
        name = "causal" if causal else "full"
        report[f"lse_shape_{name}"] = list(lse.shape)
        report[f"out_error_{name}"] = float((out.float().cpu() - ref_out).abs().max())
        report[f"lse_error_{name}"] = float((lse.cpu() - ref_lse).abs().max())
        if list(lse.shape) != [heads, sum(q_lens)] or report[f"lse_error_{name}"] > 1e-3:
            failures.append(
                f"log-sum-exps ({name}): {list(lse.shape)}, {report[f'lse_error_{name}']}"
            )
        if report[f"out_error_{name}"] > 2e-2:
            failures.append(f"attention output ({name}): {report[f'out_error_{name}']}")
    # 2. the Triton merge against the torch merge, in place on chosen rows.
    merge = split_attention._triton_merge()
    report["triton_merge"] = merge is not None
    n, total = 700, 1000
    out = torch.randn(total, heads, dim, device=dev, dtype=dt)
    lse = torch.randn(total, heads, device=dev).t()  # [H, T], strided as the kernel's may be
    part = torch.randn(n, heads, dim, device=dev, dtype=dt)
    part_lse = torch.randn(heads, n, device=dev)
    rows = torch.randperm(total, device=dev)[:n]
    expected = split_attention.merge_attention(
        out.index_select(0, rows), lse.index_select(1, rows), part, part_lse
    )
    if merge is not None:
        merged = out.clone()
        merge(merged, lse, part, part_lse, rows)
        diff = (merged.index_select(0, rows).float() - expected.float()).abs()
        report["merge_max_diff"] = float(diff.max())
        untouched = torch.ones(total, dtype=torch.bool, device=dev)
        untouched[rows] = False
        report["merge_other_rows_equal"] = bool(torch.equal(merged[untouched], out[untouched]))
        # Rounded differently at most by one bf16 step of the values (|x| < ~5 here).
        if report["merge_max_diff"] > 0.04 or not report["merge_other_rows_equal"]:
            failures.append(f"Triton merge: {report['merge_max_diff']}")
    # 3. 100 sequences of 30-45 rows after one 496-key prefix: split against one pass.
    own_lens = torch.randint(30, 46, (100,)).tolist()
    prefix_len = 496
    q = torch.randn(sum(own_lens), heads, dim, device=dev, dtype=dt)
    own_k = torch.randn(sum(own_lens), kv_heads, dim, device=dev, dtype=dt)
    own_v = torch.randn_like(own_k)
    pk = torch.randn(prefix_len, kv_heads, dim, device=dev, dtype=dt)
    pv = torch.randn_like(pk)
    cu_own = cu(own_lens).to(dev)
    shared = SharedPrefixes(
        q_rows=torch.arange(sum(own_lens), device=dev),
        cu_q=cu([sum(own_lens)]).to(dev),
        max_q=sum(own_lens),
        pool_rows=torch.arange(prefix_len, device=dev),
        cu_k=cu([prefix_len]).to(dev),
        max_k=prefix_len,
        own_cu_k=cu_own,
        own_max_k=max(own_lens),
        own_num_keys=sum(own_lens),
        own_key_rows=None,
        own_key_starts=cu_own[:-1].tolist(),
    )
    split = split_attention.shared_prefix_attention(
        q, (own_k, own_v, cu_own, max(own_lens)), (pk, pv), shared, causal=True, scale=dim**-0.5
    )
    bounds = cu_own.tolist()
    spans = list(itertools.pairwise(bounds))
    whole_k = torch.cat([torch.cat([pk, own_k[a:b]]) for a, b in spans])
    whole_v = torch.cat([torch.cat([pv, own_v[a:b]]) for a, b in spans])
    whole_lens = [prefix_len + n for n in own_lens]
    one_pass, _ = split_attention.attention_with_lse(
        q,
        whole_k,
        whole_v,
        cu_own,
        cu(whole_lens).to(dev),
        max(own_lens),
        max(whole_lens),
        scale=dim**-0.5,
        causal=True,
    )
    exact, _ = split_attention.attention_with_lse(
        q.cpu().float(),
        whole_k.cpu().float(),
        whole_v.cpu().float(),
        cu_own.cpu(),
        cu(whole_lens),
        max(own_lens),
        max(whole_lens),
        scale=dim**-0.5,
        causal=True,
    )
    report["split_vs_one_pass_max_diff"] = float((split.float() - one_pass.float()).abs().max())
    report["split_error_to_float32"] = float((split.float().cpu() - exact).abs().max())
    report["one_pass_error_to_float32"] = float((one_pass.float().cpu() - exact).abs().max())
    if report["split_error_to_float32"] > 3 * max(report["one_pass_error_to_float32"], 1e-3):
        failures.append("the split's error is over 3x one pass's")
    report["failures"] = failures
    print(json.dumps(report, indent=1))
    record.write(args.output, report)
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
