"""The query / key norm and rotary kernel (vecpool/models/layers/qk_rotary.py), run by Triton's
interpreter on the CPU, against the modules it replaces (`RMSNorm`, `apply_rotary`); and the
decoder's attention giving the same result through it as through those modules."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from vecpool.models.architectures.decoder import DecoderAttention, DecoderConfig
from vecpool.models.layers import qk_rotary
from vecpool.models.layers.attention import AttentionMetadata
from vecpool.models.layers.basic import RMSNorm, Rotary, apply_rotary

# (query heads, key/value heads, head size, norm, unit offset, tokens)
CASES = [
    (4, 2, 32, True, False, 37),  # Qwen3's layout, tokens over several programs
    (6, 3, 24, True, True, 5),  # half a head not a power of two (masked columns); Gemma's offset
    (2, 2, 16, False, False, 70),  # the rotation alone (q_weight None)
    (8, 1, 64, True, False, 1),
    (4, 2, 32, True, False, 0),
]
TILES = [(4, 1), None]  # programs of a few tokens; and the default


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: tuple[RMSNorm, RMSNorm] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def run_cases(tile: tuple[int, int] | None) -> list[float]:
    """Every case through the kernel with `tile`: the largest difference from the modules."""
    results = []
    for i, (heads, kv_heads, head_dim, norm, unit_offset, tokens) in enumerate(CASES):
        torch.manual_seed(i)
        # q and k as the fused projection leaves them: views of one row of q, k and v.
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
        positions = torch.randint(0, 4096, (tokens,))
        cos, sin = Rotary(head_dim, {"rope_theta": 10000.0}).cos_sin(positions, torch.float32)
        norms = None
        if norm:
            norms = (RMSNorm(head_dim, 1e-6, unit_offset), RMSNorm(head_dim, 1e-6, unit_offset))
            for m in norms:
                m.weight.data = 1 + 0.3 * torch.randn(head_dim)
        want_q, want_k = reference(q, k, cos, sin, norms)
        got_q, got_k = qk_rotary._launch(
            q,
            k,
            cos,
            sin,
            None if norms is None else norms[0].weight.data,
            None if norms is None else norms[1].weight.data,
            1e-6,
            unit_offset,
            tile,
        )
        assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
        diffs = [
            float((a - b).abs().max()) for a, b in ((got_q, want_q), (got_k, want_k)) if a.numel()
        ]
        results.append(max(diffs, default=0.0))
    return results


def attention_through_both() -> list[float]:
    """A decoder's attention (fp32, random weights) with the kernel and with the modules: the
    largest difference of its output, per layout (Qwen3, Gemma3)."""
    qk_rotary.serves = lambda *args: True  # the CPU tensors go to the (interpreted) kernel
    launch, calls = qk_rotary._launch, []
    qk_rotary._launch = lambda *args: calls.append(1) or launch(*args)
    results = []
    for unit_offset in (False, True):
        config = DecoderConfig(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=96,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            hidden_act="silu",
            rms_norm_eps=1e-6,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            is_causal=True,
            layer_windows=(None,),
            qk_norm=True,
            norm_unit_offset=unit_offset,
        )
        torch.manual_seed(0)
        layer = DecoderAttention(config, None)
        for p in layer.parameters():
            p.data = torch.randn(p.shape) * 0.2 + (1 if p.dim() == 1 else 0)
        layer.fuse_projections()
        lengths = [7, 3, 12]
        n = sum(lengths)
        meta = AttentionMetadata(
            torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32),
            max(lengths),
            torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)),
            torch.cat([torch.arange(m) for m in lengths]),
            use_varlen=False,
            packed=True,  # the steps the kernel serves (attention: the CPU's fallback)
        )
        cos, sin = Rotary(16, {}).cos_sin(meta.pos_in_seq, torch.float32)
        x = torch.randn(n, 64)
        out = {}
        for fused in (True, False):
            layer.one_kernel_rotary = fused
            out[fused] = layer(x, cos, sin, meta)
        results.append(float((out[True] - out[False]).abs().max()))
    return [*results, len(calls)]


@pytest.mark.parametrize("tile", TILES)
def test_the_kernel_gives_the_norm_and_rotation_of_the_modules(
    tile: tuple[int, int] | None,
) -> None:
    """The kernel under Triton's interpreter, in a process of its own: the interpreter is
    chosen when Triton is imported, and torch imports it here first."""
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted  # here: this file also runs as that script

    results = run_interpreted(__file__, "kernel", json.dumps(tile))
    assert len(results) == len(CASES)
    for case, diff in zip(CASES, results, strict=True):
        # float32 throughout, values of order 1-10: the kernel's sum of squares and rsqrt
        # round differently from torch's, by float32 rounding.
        assert diff <= 2e-5, case


def test_decoder_attention_is_the_same_through_the_kernel() -> None:
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted

    *diffs, kernel_calls = run_interpreted(__file__, "attention")
    assert kernel_calls == 2  # one forward of each layout went through the kernel
    assert len(diffs) == 2
    for diff in diffs:
        assert diff <= 2e-5  # as above; the attention after it is the same code both ways


def op_checks() -> list[dict[str, str]]:
    """torch's checks of the operator that compiled layers call (schema, fake tensors, the
    compiler's tracing), with and without the norms."""
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, 16), torch.randn(7, 2, 16)
    cos, sin, weight = torch.randn(7, 16), torch.randn(7, 16), torch.randn(16)
    op = torch.ops.vecpool.qk_norm_rotary.default
    return [torch.library.opcheck(op, (q, k, cos, sin, w, w, 1e-6, False)) for w in (weight, None)]


def test_the_compiled_layers_operator_passes_torchs_checks() -> None:
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted

    results = run_interpreted(__file__, "opcheck")
    assert len(results) == 2
    for checks in results:
        assert len(checks) >= 3  # schema, fake tensors, tracing at least
        assert set(checks.values()) == {"SUCCESS"}, checks


def test_the_kernel_serves_cuda_layouts_only() -> None:
    q, k = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)
    cos = sin = torch.zeros(4, 8)
    assert not qk_rotary.serves(q, k, cos, sin)  # the CPU keeps the modules
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        dev = [t.cuda() for t in (q, k, cos, sin)]
        assert qk_rotary.serves(*dev)
        assert not qk_rotary.serves(dev[0], dev[1], dev[2][:, :4], dev[3][:, :4])


if __name__ == "__main__":  # the interpreted runs of the tests above
    torch.set_grad_enabled(False)
    if sys.argv[1] == "opcheck":
        print(json.dumps(op_checks()))
    elif sys.argv[1] == "kernel":
        tile = json.loads(sys.argv[2])
        print(json.dumps(run_cases(None if tile is None else tuple(tile))))
    else:
        print(json.dumps(attention_through_both()))
