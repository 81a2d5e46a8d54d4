"""The CPU's packed linears: every linear of the layer stack is replaced, each computes what
`F.linear` does (float32 to the reordering tolerance; bfloat16 to its own precision), the engine
packs them by default on the CPU and computes what unpacked linears compute, and prompt embeds
stay bit-exact with ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vecpool
import vecpool.runner.model_runner as model_runner
from tests.helpers import REORDERED_RTOL, assert_rel_close, engine_hidden, random_prompts
from tests.runner.conftest import VOCAB
from vecpool.models.layers import FusedProjections
from vecpool.runner.cpu_linear import PackedLinear, can_pack


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_a_packed_linear_computes_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    expected = F.linear(x, weight, bias)
    assert_rel_close(PackedLinear(weight, bias)(x).numpy(), expected.numpy())
    assert_rel_close(PackedLinear(weight, None)(x).numpy(), F.linear(x, weight).numpy())
    parts = PackedLinear(weight, bias, [32, 64])(x)
    assert isinstance(parts, tuple) and [p.shape[-1] for p in parts] == [32, 64]
    assert torch.equal(torch.cat(parts, dim=-1), PackedLinear(weight, bias)(x))
    # bfloat16 (8 bits of mantissa): within its rounding of the float32 result.
    packed16 = PackedLinear(weight.bfloat16(), bias.bfloat16())(x.bfloat16()).float()
    scale = expected.abs().max()
    assert (packed16 - expected).abs().max() <= 2e-2 * scale


def test_the_engine_packs_the_layer_stack_on_the_cpu(qwen3_folder: Path) -> None:
    assert can_pack(torch.device("cpu"), torch.float32)
    assert not can_pack(torch.device("cuda"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float16)
    engine = vecpool.Engine(qwen3_folder, device="cpu")
    modules = list(engine.model.modules())
    layers = [m for layer in engine.model.layers for m in layer.modules()]
    assert not any(isinstance(m, torch.nn.Linear | FusedProjections) for m in layers)
    # Per layer: the fused q/k/v, o_proj, the fused gate/up, down_proj.
    assert sum(isinstance(m, PackedLinear) for m in modules) == 4 * len(engine.model.layers)


def test_packed_engines_compute_what_plain_ones_do_and_keep_embeds_exact(
    qwen3_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = vecpool.Engine(qwen3_folder, device="cpu")
    monkeypatch.setattr(model_runner, "can_pack", lambda device, dtype: False)
    plain = vecpool.Engine(qwen3_folder, device="cpu")
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    prompts = random_prompts(VOCAB, [5, 17, 3, 30], seed=4)
    expected = engine_hidden(plain, prompts)
    as_ids = engine_hidden(packed, prompts)
    as_embeds = engine_hidden(packed, [{"prompt_embeds": packed.embed_tokens(p)} for p in prompts])
    for e, a, b in zip(expected, as_ids, as_embeds, strict=True):
        assert_rel_close(a, e, REORDERED_RTOL)  # the same sums in another order
        assert np.array_equal(a, b)
