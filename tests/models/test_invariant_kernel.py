"""The batch-invariant mode's Triton matmul (`invariant.triton_linear`) under Triton's
interpreter, in a process of its own (the interpreter is chosen when Triton is imported): in
each launch configuration, with the weight's tile read across its rows or along them, every
row's bits are the same alone, among a few rows and among many, and the product is `F.linear`'s
within float32 rounding.

Bit equality across batches holds by construction: each output block is one program that walks
K in one order with blocks of fixed shape, padded rows masked to zero. The tolerance to
`F.linear` (1e-5 of the largest magnitude) is float32's: the same sums in another order.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

CONFIGS = [
    None,  # the engine's: `TRITON_CONFIG`
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2, W_ROWS=False),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2, W_ROWS=True),
]


def kernel_checks() -> list[dict[str, float | bool]]:
    from vecpool.models.layers.invariant import triton_linear

    torch.manual_seed(0)
    weight, bias = torch.randn(48, 80), torch.randn(48)  # K = 80: a last block of K masked
    x = torch.randn(37, 80)
    out = []
    for config in CONFIGS:
        whole = triton_linear(x, weight, bias, config)
        few = triton_linear(x[:5].contiguous(), weight, bias, config)
        alone = torch.cat([triton_linear(x[i : i + 1], weight, bias, config) for i in range(5)])
        ref = F.linear(x, weight, bias)
        out.append(
            {
                "invariant": bool(torch.equal(whole[:5], few) and torch.equal(few, alone)),
                "rel_diff": float((whole - ref).abs().max() / ref.abs().max()),
            }
        )
    return out


def test_every_configuration_is_invariant_and_equals_linear() -> None:
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted  # here: this file also runs as that script

    results = run_interpreted(__file__)
    assert len(results) == len(CONFIGS)
    for config, result in zip(CONFIGS, results, strict=True):
        assert result["invariant"], config
        assert result["rel_diff"] <= 1e-5, config


if __name__ == "__main__":
    print(json.dumps(kernel_checks()))
    sys.exit(0)
