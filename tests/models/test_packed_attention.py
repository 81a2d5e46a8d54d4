"""The packed attention kernel (vecpool/models/layers/packed_attention.py), run by Triton's
interpreter on the CPU, against attention computed one sequence at a time; and when the
engine sends a step's attention to it."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from vecpool.models.layers import attention, packed_attention
from vecpool.models.layers.attention import AttentionMetadata, flat_attention


def boundaries(lengths: list[int], slots: int) -> torch.Tensor:
    """int32 boundaries of `lengths` in `slots` sequence slots, the empty ones after the last
    repeating its end (as a recorded step pads them)."""
    cu = np.zeros(slots + 1, dtype=np.int32)
    cu[1 : len(lengths) + 1] = np.cumsum(lengths)
    cu[len(lengths) + 1 :] = cu[len(lengths)]
    return torch.from_numpy(cu)


def per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], causal: bool
) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    out, start = torch.zeros_like(q), 0
    for n in lengths:
        qs = q[start : start + n].transpose(0, 1)
        ks, vs = (t[start : start + n].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        logits = qs @ ks.transpose(1, 2) * q.shape[2] ** -0.5
        if causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[start : start + n] = (logits.softmax(-1) @ vs).transpose(0, 1)
        start += n
    return out


# (query heads, key/value heads, head size, causal, lengths, sequence slots, padding rows)
CASES = [
    (heads, kv_heads, head_dim, causal, lengths, slots, padding)
    for heads, kv_heads, head_dim, causal in [(4, 2, 32, True), (4, 4, 16, False), (6, 3, 24, True)]
    for lengths, slots, padding in [
        ([5, 17, 1, 30, 9], 8, 6),  # several sequences per tile; empty slots; padding rows
        ([40, 0, 25], 4, 10),  # an empty sequence between two
        ([70, 3, 33], 3, 0),  # a sequence over more than one tile of rows
        ([1], 1, 0),
    ]
]


def run_cases(tile: tuple[int, ...] | None) -> list[dict[str, float | bool]]:
    """Every case through the kernel with `tile` (None: the default, `tile_for` the case's
    group; a tile of several query heads a program where that count divides the group, the
    default elsewhere): the largest difference from the per-sequence reference, and whether
    the padding rows came out finite."""
    results = []
    for i, (heads, kv_heads, head_dim, causal, lengths, slots, padding) in enumerate(CASES):
        case_tile = tile if tile is None or (heads // kv_heads) % (*tile, 1)[3] == 0 else None
        torch.manual_seed(i)
        tokens = sum(lengths)
        q = torch.randn(tokens + padding, heads, head_dim)
        k = torch.randn(tokens + padding, kv_heads, head_dim)
        v = torch.randn(tokens + padding, kv_heads, head_dim)
        cu = boundaries(lengths, slots)
        out = packed_attention._launch(q, k, v, cu, causal, head_dim**-0.5, case_tile)
        want = per_sequence(q, k, v, lengths, causal)
        results.append(
            {
                "max_abs_diff": float((out[:tokens] - want[:tokens]).abs().max()),
                "padding_finite": bool(torch.isfinite(out[tokens:]).all()),
            }
        )
    return results


# Small tiles: sequences span several; (16, 16, 4, 2): two query heads a program.
@pytest.mark.parametrize("tile", [(16, 16, 4), (16, 16, 4, 2), None])
def test_each_sequence_attends_to_itself_alone(tile: tuple[int, ...] | None) -> None:
    """The kernel under Triton's interpreter, in a process of its own: the interpreter is
    chosen when Triton is imported, and torch imports it here first."""
    pytest.importorskip("triton", reason="the test extras install Triton")
    from tests.helpers import run_interpreted  # here: this file also runs as that script

    results = run_interpreted(__file__, json.dumps(tile))
    assert len(results) == len(CASES)
    for case, result in zip(CASES, results, strict=True):
        # float32 throughout; the kernel sums keys in blocks with a running maximum, the
        # reference in one softmax: they differ by float32 rounding of values of order 1.
        assert result["max_abs_diff"] <= 1e-5, case
        # The padding rows (a recorded step's, read by no sequence) come out finite.
        assert result["padding_finite"], case


class Spy:
    """Stands in for the kernel: records its calls, answers with the per-sequence reference."""

    def __init__(self, lengths: list[int]):
        self.lengths = lengths
        self.calls = 0

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        self.calls += 1
        return per_sequence(q, k, v, self.lengths, causal)


@pytest.mark.parametrize(
    ("packed", "window", "bias", "key_rows", "sent"),
    [
        (True, None, False, False, True),
        (True, 64, False, False, True),  # a window no sequence of the step reaches
        (False, None, False, False, False),  # the runner said the step's sequences are long
        (True, 4, False, False, False),  # a window within a sequence
        (True, None, True, False, False),  # an additive bias
        (True, None, False, True, False),  # keys cut short (ColBERT's query expansion)
    ],
)
def test_plain_attention_of_a_packed_step_goes_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
    packed: bool,
    window: int | None,
    bias: bool,
    key_rows: bool,
    sent: bool,
) -> None:
    lengths = [5, 9]
    spy = Spy(lengths)
    monkeypatch.setattr(packed_attention, "serves", lambda q, k, v: True)
    monkeypatch.setattr(packed_attention, "packed_attention", spy)
    # What the other kernels would have been asked, answered by the exact fallback.
    monkeypatch.setattr(attention, "_flash_attention", lambda *a, **kw: torch.zeros(0))
    monkeypatch.setattr(
        attention.biased_attention, "biased_attention", lambda *a, **kw: torch.zeros(0)
    )
    monkeypatch.setattr(attention.biased_attention, "serves", lambda *a: True)
    counts = torch.tensor(lengths)
    meta = AttentionMetadata(
        boundaries(lengths, 2),
        max(lengths),
        torch.repeat_interleave(torch.arange(2), counts),
        torch.cat([torch.arange(n) for n in lengths]),
        use_varlen=True,
        packed=packed,
    )
    if key_rows:
        meta.key_rows = torch.arange(12)
        meta.cu_seqlens_k = torch.tensor([0, 5, 12], dtype=torch.int32)
        meta.max_seqlen_k = 7
    q, k, v = torch.randn(14, 2, 8), torch.randn(14, 2, 8), torch.randn(14, 2, 8)
    flat_attention(
        q,
        k,
        v,
        meta,
        causal=not (bias or key_rows),  # keys cut short and a bias: encoders only
        scale=8**-0.5,
        window=window,
        bias=torch.zeros(1, 2, 9, 9) if bias else None,
    )
    assert spy.calls == int(sent)


if __name__ == "__main__":  # the interpreted run of `test_each_sequence_attends_to_itself_alone`
    tile = json.loads(sys.argv[1])
    print(json.dumps(run_cases(None if tile is None else tuple(tile))))
