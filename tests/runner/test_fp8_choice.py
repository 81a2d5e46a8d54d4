"""FP8 by step size (`runner/fp8_choice.py`): which row counts multiply in FP8, decided once per
layer form from timings, applied to every layer of the form, cached; and the bf16 steps of an
FP8 layer multiply its own weights, dequantized.

The CPU runs FP8 through the emulated path (the FP8 values multiplied in float32) and the
`vecpool::fp8_*` ops' CPU kernels; the timings the CUDA choice rests on are taken on the GPU
(benchmarks/lab/fp8_check.py prints them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.models.test_quant import _qwen3 as tiny_qwen3
from vecpool.models.layers.basic import RMSNorm
from vecpool.models.loading.folder import ModelFolder
from vecpool.models.loading.loader import load_model
from vecpool.models.quant import linear as quant
from vecpool.models.quant.linear import Fp8Linear, quantize_model
from vecpool.runner import choice_cache, fp8_choice
from vecpool.runner.fp8_choice import NEVER, LayerForm

CPU = torch.device("cpu")


def test_fp8_from_is_the_least_count_from_which_fp8_wins_throughout() -> None:
    slow_small = {16: (1.0, 2.0), 256: (1.0, 1.5), 4096: (2.0, 1.5), 16384: (8.0, 5.0)}
    assert fp8_choice.fp8_from(slow_small) == 4096
    # A win below a loss does not count: the steps between would take the slower path.
    assert fp8_choice.fp8_from({16: (2.0, 1.0), 256: (1.0, 1.2), 4096: (3.0, 2.0)}) == 4096
    assert fp8_choice.fp8_from({16: (2.0, 1.0), 4096: (3.0, 2.0)}) == 0
    assert fp8_choice.fp8_from({16: (1.0, 2.0), 4096: (3.0, 3.0)}) == NEVER  # a tie: bf16


@pytest.fixture(scope="module")
def fp8_layer() -> tuple[Fp8Linear, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(48, 32)
    layer = Fp8Linear.from_weight(weight, torch.randn(48))
    return layer, (layer.weight.float() * layer.weight_scale.view(-1, 1))


def test_dense_steps_multiply_the_dequantized_weights_and_fp8_steps_stay(
    fp8_layer: tuple[Fp8Linear, torch.Tensor],
) -> None:
    layer, dequantized = fp8_layer
    small, large = torch.randn(7, 32), torch.randn(40, 32)
    layer.dense_below(0)
    assert layer.dense_weight is None
    fp8_small, fp8_large = layer(small), layer(large)
    layer.dense_below(8)
    try:
        assert torch.equal(layer.dense_weight, dequantized)
        # Fewer rows than 8: the same weights, the rows unquantized.
        assert torch.equal(layer(small), F.linear(small, dequantized) + layer.bias)
        assert not torch.equal(layer(small), fp8_small)
        assert torch.equal(layer(large), fp8_large)  # 40 rows: FP8 as before
    finally:
        layer.dense_below(0)


def test_dense_steps_of_the_fused_producers(
    fp8_layer: tuple[Fp8Linear, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the CUDA path's ops (their CPU kernels), a dense step computes what the op would
    have fed the FP8 product, unquantized: the norm, the residual sum and its norm, SiLU * up."""
    import vecpool.models.quant.fp8_ops  # noqa: F401 - the ops, with their CPU kernels

    layer, dequantized = fp8_layer
    monkeypatch.setattr(layer, "kernels", True)
    norm = RMSNorm(32, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x, delta = torch.randn(5, 32), torch.randn(5, 32)
    gate_up = torch.randn(5, 64)
    fp8_norm = layer.norm_forward(x, norm)
    layer.dense_below(8)
    try:
        bias = layer.bias
        assert torch.equal(layer.norm_forward(x, norm), F.linear(norm(x), dequantized) + bias)
        total, out = layer.add_norm_forward(x, delta, norm)
        assert torch.equal(total, x + delta)
        assert torch.equal(out, F.linear(norm(x + delta), dequantized) + bias)
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(
            layer.silu_mul_forward(gate_up), F.linear(F.silu(gate) * up, dequantized) + bias
        )
        assert not torch.equal(layer.norm_forward(x, norm), fp8_norm)
    finally:
        layer.dense_below(0)
    assert torch.equal(layer.norm_forward(x, norm), fp8_norm)


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_quant's random 2-layer Qwen3 (hidden 32, 4 heads of 16, 2 key-value heads, MLP 48)."""
    return tiny_qwen3(tmp_path_factory.mktemp("fp8_choice"))[0]


def _fp8_model(folder: Path, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    import vecpool.models.quant.fp8_ops  # noqa: F401 - the ops, with their CPU kernels

    monkeypatch.setattr(quant, "fused_fp8_ops", lambda device: True)  # CUDA's producers
    model = load_model(ModelFolder.load(folder), CPU, torch.float32, "auto")
    quantize_model(model, "fp8", CPU)
    return model


QKV = LayerForm(32, 4 * 16 + 2 * 2 * 16, "norm")
O_PROJ = LayerForm(64, 32, "rows")
GATE_UP = LayerForm(32, 2 * 48, "norm")
DOWN = LayerForm(48, 32, "silu")


def test_each_form_measured_once_and_its_choice_set_on_every_layer(
    qwen3_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _fp8_model(qwen3_folder, monkeypatch)
    forms = fp8_choice.layer_forms(model)
    assert set(forms) == {QKV, O_PROJ, GATE_UP, DOWN}
    assert all(len(site.layers) == 2 for site in forms.values())  # one per layer of the stack
    # Timings by form: FP8 loses below 64 rows on q/k/v, always on o_proj, never on the MLP.
    timings = {
        QKV: {16: (1.0, 2.0), 64: (2.0, 1.0)},
        O_PROJ: {16: (1.0, 2.0), 64: (1.0, 2.0)},
        GATE_UP: {16: (2.0, 1.0), 64: (2.0, 1.0)},
        DOWN: {16: (2.0, 1.0), 64: (2.0, 1.0)},
    }
    calls: list[LayerForm] = []

    def measure(site: Any, device: torch.device, rows: list[int]) -> dict[int, Any]:
        assert rows == [16, 64]  # up to the step budget
        form = next(f for f, s in forms.items() if s.layer is site.layer)
        calls.append(form)
        return timings[form]

    monkeypatch.setattr(fp8_choice, "measure", measure)
    chosen = fp8_choice.choose(model, CPU, max_rows=100)
    assert chosen == {QKV: 64, O_PROJ: NEVER, GATE_UP: 0, DOWN: 0}
    assert sorted(map(str, calls)) == sorted(map(str, forms))
    for form, site in forms.items():
        for layer in site.layers:
            assert layer.fp8_from == chosen[form]
            assert (layer.dense_weight is None) == (chosen[form] == 0)
    # The next load on this machine reads the timings instead of measuring.
    entries = choice_cache.read_entries(
        choice_cache.cache_path(fp8_choice.CACHE_NAME), fp8_choice.CACHE_VERSION
    )
    assert len(entries) == 4
    calls.clear()
    fp8_choice.reset_dense(model)
    assert fp8_choice.choose(model, CPU, max_rows=100) == chosen
    assert calls == []


def test_measured_timings_on_the_cpu_paths(
    qwen3_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measurement itself runs each form's own forward both ways (here eagerly: the CUDA
    graphs need a GPU) and leaves the layer as it found it."""
    model = _fp8_model(qwen3_folder, monkeypatch)
    site = fp8_choice.layer_forms(model)[DOWN]
    timings = fp8_choice.measure(site, CPU, [16, 64])
    assert set(timings) == {16, 64}
    assert all(bf16 > 0 and fp8 > 0 for bf16, fp8 in timings.values())
    assert site.layer.fp8_from == 0 and site.layer.dense_weight is None
