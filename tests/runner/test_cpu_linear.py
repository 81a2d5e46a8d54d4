"""The CPU's packed linears: every linear of the layer stack is replaced, each computes what
`F.linear` does (float32 to the reordering tolerance; bfloat16 to its own precision), an engine
whose CPU choice is oneDNN packs them and computes what unpacked linears compute, and prompt
embeds stay bit-exact with ids. The engines here are given that choice (`onednn_choice`): which
kernel a machine measures as faster is `cpu_choice`'s concern (tests/runner/test_cpu_choice.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import vecpool
import vecpool.runner.model_runner as model_runner
from tests.conftest import tiny_bert_config
from tests.helpers import (
    REORDERED_RTOL,
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
)
from tests.runner.conftest import VOCAB
from vecpool.models.layers.basic import FusedProjections, activation, linear_residual
from vecpool.runner import cpu_choice
from vecpool.runner.cpu_linear import FUSED_ACTIVATIONS, PackedLinear, can_pack


@pytest.fixture(autouse=True)
def onednn_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine of this module runs oneDNN's linears, whatever this machine measures."""
    monkeypatch.setattr(
        cpu_choice, "choose", lambda *args, **kwargs: cpu_choice.CpuChoice("onednn", "buckets")
    )


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
    # bfloat16 (8 bits of mantissa): within its rounding of the float32 result, where oneDNN
    # has a bfloat16 path on this CPU (AVX-512 or newer); elsewhere the engine does not pack it.
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        return
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


@pytest.mark.parametrize("act", sorted(FUSED_ACTIVATIONS))
def test_a_fused_activation_computes_the_activation_of_the_product(act: str) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(2, 150, 40, generator=gen)  # any leading shape
    linear = PackedLinear(weight, bias)
    fused = linear.fused_activation(x, act)
    assert fused is not None and fused.shape == (2, 150, 96)
    after = activation(act)(linear(x))
    if FUSED_ACTIVATIONS[act][1] == "tanh":  # oneDNN's tanh approximation: an ulp or so apart
        assert_rel_close(fused.numpy(), after.numpy(), 1e-6)
    else:  # erf gelu and relu: the same bits as applying torch's function afterwards
        assert torch.equal(fused, after)
    assert linear.fused_activation(x, "silu") is None  # no such post-op: the caller applies it
    assert PackedLinear(weight, bias, [32, 64]).fused_activation(x, act) is None


def test_a_fused_add_is_the_product_plus_the_residual_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    x, residual = torch.randn(300, 96, generator=gen), torch.randn(300, 40, generator=gen)
    linear = PackedLinear(weight, bias)
    assert torch.equal(linear.fused_add(x, residual), linear(x) + residual)
    # The layers' helpers take the fused kernels where the linear has them, and say the same.
    assert torch.equal(linear_residual(linear, x, residual), linear(x) + residual)
    plain = torch.nn.Linear(96, 40)
    assert torch.equal(linear_residual(plain, x, residual), plain(x) + residual)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_bert_with_fused_epilogues_matches_transformers_and_keeps_embeds_exact(
    hidden_act: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    hf = transformers.BertModel(tiny_bert_config(hidden_act=hidden_act)).eval()
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    calls = {"fused_activation": 0, "fused_add": 0}
    for name in calls:
        original = getattr(PackedLinear, name)

        def counted(self: PackedLinear, *args: Any, _name: str = name, _f: Any = original) -> Any:
            calls[_name] += 1
            return _f(self, *args)

        monkeypatch.setattr(PackedLinear, name, counted)
    prompts = random_prompts(99, [5, 17, 3, 30], seed=3)
    as_ids = engine_hidden(engine, prompts)
    as_embeds = engine_hidden(engine, [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts])
    layers = hf.config.num_hidden_layers
    # Per layer and forward: one activation, two residual adds; two forwards.
    assert calls == {"fused_activation": 2 * layers, "fused_add": 4 * layers}
    for ids, a, b in zip(prompts, as_ids, as_embeds, strict=True):
        assert_rel_close(a, hf_last_hidden(hf, ids), REORDERED_RTOL)
        assert np.array_equal(a, b)
