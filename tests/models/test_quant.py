"""Quantized projections: the FP8 / int8 row quantization, the quantized linears against
float32 references, the swap into a model, engines that run quantized, and checkpoints stored
in FP8 (compressed-tensors) against transformers on the dequantized weights.

The CPU runs FP8 through torch's FP8 casts with the products accumulated in float32, the path
`torch._scaled_mm` replaces on CUDA; the Triton kernels are checked on the GPU by
benchmarks/lab/fp8_check.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import vecpool
from tests.helpers import (
    engine_hidden,
    hf_last_hidden,
    padded_cpu_attention,
    random_prompts,
    save_hf_model,
)
from vecpool.errors import ConfigError, ModelLoadError
from vecpool.models.architectures.decoder import SumInNormLayer
from vecpool.models.layers.basic import FusedProjections
from vecpool.models.loading.folder import ModelFolder
from vecpool.models.loading.loader import load_model
from vecpool.models.quant import linear as quant
from vecpool.models.quant.linear import (
    Fp8GatedMLP,
    Fp8Linear,
    Fp8NormLinear,
    quantize_model,
)
from vecpool.models.quant.quantize import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows
from vecpool.runner.compiled import compile_blocks

# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of the value (a
# relative bound for normal numbers; below 2^-6 of the scale, subnormals are spaced 2^-9).
FP8_REL_ERR = 2.0**-4
LENGTHS = [3, 9, 17, 30]
VOCAB = 101


def _rows(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(6, 64, generator=gen)
        * torch.tensor([1e-3, 1.0, 10.0, 300.0, 1e4, 1.0])[:, None]
    )
    x[5] = 0.0  # an all-zero row
    return x


def test_fp8_rows_scale_by_amax_and_round_within_the_format() -> None:
    x = _rows()
    rows = quantize_rows(x, FP8_DTYPE)
    assert rows.data.dtype == FP8_DTYPE and rows.scale.shape == (6, 1)
    amax = x.abs().amax(dim=-1)
    # Each row's largest magnitude lands on the format's largest value, exactly.
    assert torch.equal(rows.data[:5].float().abs().amax(dim=-1), torch.full((5,), FP8_MAX))
    torch.testing.assert_close(rows.scale[:5, 0], amax[:5] / FP8_MAX, rtol=0, atol=0)
    err = (dequantize_rows(rows) - x).abs()
    bound = FP8_REL_ERR * x.abs() + 2.0**-9 * rows.scale  # relative, or the subnormal step
    assert bool((err <= bound).all()), float((err - bound).max())
    # The zero row: a positive scale and zeros, not NaN.
    assert float(rows.scale[5]) > 0 and not rows.data[5].float().any()


def test_int8_rows_round_to_nearest_and_clamp() -> None:
    x = _rows()
    rows = quantize_rows(x, torch.int8)
    assert rows.data.dtype == torch.int8
    assert int(rows.data.abs().max()) == 127
    err = (dequantize_rows(rows) - x).abs()
    assert bool((err <= rows.scale / 2 * (1 + 1e-6)).all())


def test_fp8_linear_matches_float32_within_the_quantization_error() -> None:
    gen = torch.Generator().manual_seed(1)
    w, b, x = (
        torch.randn(48, 64, generator=gen),
        torch.randn(48, generator=gen),
        torch.randn(2, 5, 64, generator=gen),
    )
    layer = Fp8Linear.from_weight(w, b)
    out = layer(x)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 48)
    # Against the exact product of the quantized operands (float64): only the float32
    # accumulation order differs.
    qx, qw = quantize_rows(x.reshape(-1, 64)), quantize_rows(w)
    exact = dequantize_rows(qx).double() @ dequantize_rows(qw).double().t() + b.double()
    torch.testing.assert_close(out.reshape(-1, 48).double(), exact, rtol=1e-5, atol=1e-4)
    # And against the float32 layer: two fp8 roundings of up to 2^-4 each.
    ref = F.linear(x, w, b)
    cos = F.cosine_similarity(out.reshape(-1, 48), ref.reshape(-1, 48), dim=-1)
    assert float(cos.min()) > 0.99


def _qwen3(tmp_path: Path) -> tuple[Path, Any]:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "eager"
    hf = transformers.Qwen3Model(cfg).eval()
    return save_hf_model(hf, tmp_path / "qwen3"), hf


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return _qwen3(tmp_path_factory.mktemp("quant"))


def test_swap_quantizes_the_layer_stack_only(qwen3: tuple[Path, Any]) -> None:
    # The model as loaded (an engine's runner would have packed its CPU linears already).
    model = load_model(ModelFolder.load(qwen3[0]), torch.device("cpu"), torch.float32, "auto")
    embed, norm = model.embed_tokens.weight.clone(), model.norm
    assert quantize_model(model, "fp8", torch.device("cpu")) == 2 * 4  # qkv, o, gate_up, down
    assert torch.equal(model.embed_tokens.weight, embed) and model.norm is norm
    for layer in model.layers:
        # The norms feeding q/k/v and gate/up moved into those projections.
        assert isinstance(layer.input_layernorm, torch.nn.Identity)
        assert isinstance(layer.self_attn.qkv_proj, Fp8NormLinear)
        assert isinstance(layer.self_attn.o_proj, Fp8Linear)
        assert isinstance(layer.mlp, Fp8GatedMLP)
        assert layer.self_attn.q_norm is not None  # per-head norms stay
    assert not any(
        isinstance(m, (torch.nn.Linear, FusedProjections)) for m in model.layers.modules()
    )


def _cosines(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    x, y = np.concatenate(a), np.concatenate(b)
    cos = (x * y).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(y, axis=-1)
    return float(cos.min())


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantized_engine_close_to_float32_and_embeds_exact(
    qwen3: tuple[Path, Any], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if method == "fp8":  # the CPU has no FP8 matmul: run the emulated path the CPU tests check
        monkeypatch.setattr(vecpool.api.build, "check_quantization", lambda m, d: None)
    prompts = random_prompts(VOCAB, LENGTHS)
    reference = engine_hidden(vecpool.Engine(qwen3[0], device="cpu"), prompts)
    engine = vecpool.Engine(qwen3[0], device="cpu", quantization=method)
    from_ids = engine_hidden(engine, prompts)
    # Per-token hidden states of a random 2-layer model: fp8 rounds each operand to 2^-4,
    # int8 to half a step of 1/127 of the row's amax.
    assert _cosines(from_ids, reference) > (0.99 if method == "fp8" else 0.999)
    # Prompt embeds take the same path as ids: the same bits, alone and mixed with ids.
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    for got, want in zip(engine_hidden(engine, embeds[:2] + prompts[2:]), from_ids, strict=True):
        assert np.array_equal(got, want)


def test_fp8_refused_without_an_fp8_device(qwen3: tuple[Path, Any]) -> None:
    with pytest.raises(ConfigError, match=r"fp8.*the device is cpu"):
        vecpool.Engine(qwen3[0], device="cpu", quantization="fp8")
    with pytest.raises(ConfigError, match="quantization 'int4'"):
        vecpool.Engine(qwen3[0], device="cpu", quantization="int4")


def test_quantization_flag() -> None:
    parser = argparse.ArgumentParser()
    vecpool.EngineArgs.add_cli_args(parser)
    args = vecpool.EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int8"]))
    assert args.quantization == "int8"
    assert vecpool.EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    with pytest.raises(ConfigError, match="quantization 'int4' is not one of"):
        vecpool.EngineArgs(quantization="int4")


def _compressed_tensors(folder: Path, dest: Path, strategy: str, drop: str | None = None) -> Any:
    """Rewrite `folder` as a compressed-tensors FP8 checkpoint: every layer linear's weight
    in FP8 with a `weight_scale` per channel ([N, 1]) or per tensor ([]); returns the state
    dict with those weights dequantized (what transformers should run to compare)."""
    dest.mkdir()
    state = load_file(str(folder / "model.safetensors"))
    stored, dequantized = {}, dict(state)
    for key, tensor in state.items():
        if "layers." in key and key.endswith("proj.weight") and tensor.ndim == 2:
            if strategy == "channel":
                rows = quantize_rows(tensor)
                data, scale = rows.data, rows.scale  # [N, 1]
            else:
                scale = tensor.abs().max().float() / FP8_MAX  # []
                data = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            stored[key], stored[key[: -len("weight")] + "weight_scale"] = data, scale
            dequantized[key] = (data.float() * scale).to(tensor.dtype)
        else:
            stored[key] = tensor
    if drop is not None:
        del stored[drop]
    save_file(stored, str(dest / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    (dest / "config.json").write_text(json.dumps(cfg))
    return dequantized


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_checkpoint_loads_as_stored(
    qwen3: tuple[Path, Any], tmp_path: Path, strategy: str
) -> None:
    folder, hf = qwen3
    dequantized = _compressed_tensors(folder, tmp_path / "fp8", strategy)
    engine = vecpool.Engine(tmp_path / "fp8", device="cpu")
    layer = engine.model.layers[0]
    assert layer.self_attn.qkv_proj.linear.weight.dtype == FP8_DTYPE
    # The stored FP8 values are used as they are, under the per-channel scales.
    q = load_file(str(tmp_path / "fp8" / "model.safetensors"))["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(
        layer.self_attn.qkv_proj.linear.weight[: q.shape[0]].view(torch.uint8), q.view(torch.uint8)
    )
    # transformers on the dequantized weights; the rest of the difference is the activations'
    # per-token FP8 rounding (2^-4 relative per operand).
    hf.load_state_dict(dequantized)
    prompts = random_prompts(VOCAB, LENGTHS)
    want = [hf_last_hidden(hf, p) for p in prompts]
    assert _cosines(engine_hidden(engine, prompts), want) > 0.99


def test_fp8_checkpoint_missing_scale_is_named(qwen3: tuple[Path, Any], tmp_path: Path) -> None:
    _compressed_tensors(
        qwen3[0], tmp_path / "fp8", "channel", drop="layers.1.mlp.up_proj.weight_scale"
    )
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        vecpool.Engine(tmp_path / "fp8", device="cpu")


def test_fp8_ops_path_equals_the_reference_and_compiles_whole(
    qwen3: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path CUDA takes (rows quantized by the `vecpool::fp8_*` ops, here their CPU
    kernels) gives the bits of the plain torch path on a float32 model, and each fused module
    traces as one graph with a dynamic token count."""
    import vecpool.models.quant.fp8_ops  # the ops, with their CPU kernels (the reference math)

    monkeypatch.setattr(vecpool.api.build, "check_quantization", lambda m, d: None)
    prompts = random_prompts(VOCAB, LENGTHS)
    plain = vecpool.Engine(qwen3[0], device="cpu", quantization="fp8")
    monkeypatch.setattr(quant, "fused_fp8_ops", lambda device: True)
    ops = vecpool.Engine(qwen3[0], device="cpu", quantization="fp8")
    assert_ops_path_equal(ops, plain, prompts, (5, 11))


@pytest.mark.parametrize("ops_path", [False, True])
def test_residual_sums_in_the_norms_give_the_same_bits(
    qwen3: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, ops_path: bool
) -> None:
    """A stack of folded FP8 layers hands each residual sum on to the next norm, which adds it
    (`SumInNormLayer`; on CUDA in the norm's kernel, here in the op's CPU kernel or in
    torch): the same additions in the same order, so the bits of the layers that add their
    own, eager and compiled with a dynamic token count, from ids and from prompt embeds."""
    import vecpool.models.quant.fp8_ops  # the ops, with their CPU kernels

    monkeypatch.setattr(vecpool.api.build, "check_quantization", lambda m, d: None)
    if ops_path:
        monkeypatch.setattr(quant, "fused_fp8_ops", lambda device: True)
    prompts = random_prompts(VOCAB, LENGTHS)
    # Compiled blocks below run the padded attention: the eager engines run it too.
    summed = padded_cpu_attention(vecpool.Engine(qwen3[0], device="cpu", quantization="fp8"))
    monkeypatch.setattr(quant, "SUM_IN_NORM", False)
    own = padded_cpu_attention(vecpool.Engine(qwen3[0], device="cpu", quantization="fp8"))
    layers = list(summed.model.layers)
    assert all(type(layer) is SumInNormLayer for layer in layers)
    assert [layer.hands_on_sum for layer in layers] == [True] * (len(layers) - 1) + [False]
    assert not any(isinstance(layer, SumInNormLayer) for layer in own.model.layers)
    assert layers[0].self_attn.qkv_proj.linear.kernels == ops_path
    want = engine_hidden(own, prompts)
    for got, expected in zip(engine_hidden(summed, prompts), want, strict=True):
        assert np.array_equal(got, expected)
    embeds = [{"prompt_embeds": summed.embed_tokens(p)} for p in prompts]
    for got, expected in zip(engine_hidden(summed, embeds[:2] + prompts[2:]), want, strict=True):
        assert np.array_equal(got, expected)
    torch._dynamo.reset()
    compile_blocks(summed.model, backend="aot_eager")  # a pair in and out, a tensor out last
    for got, expected in zip(engine_hidden(summed, prompts), want, strict=True):
        assert np.array_equal(got, expected)


def assert_ops_path_equal(
    ops: vecpool.Engine, plain: vecpool.Engine, prompts: list[Any], counts: tuple[int, ...]
) -> None:
    """`ops` (the fused FP8 modules) gives `plain`'s bits on `prompts`, and its first layer's
    fused modules each trace as one graph giving their eager bits for `counts` tokens."""
    layer = ops.model.layers[0]
    assert layer.mlp.fused_silu and layer.self_attn.qkv_proj.linear.kernels
    assert not plain.model.layers[0].mlp.fused_silu
    for got, want in zip(engine_hidden(ops, prompts), engine_hidden(plain, prompts), strict=True):
        assert np.array_equal(got, want)
    for module in (layer.mlp, layer.self_attn.qkv_proj, layer.self_attn.o_proj):
        compiled = torch.compile(module, backend="aot_eager", dynamic=True, fullgraph=True)
        for n in counts:
            x = torch.randn(n, module_in(module))
            eager, traced = module(x), compiled(x)
            for a, b in zip(
                eager if isinstance(eager, tuple) else (eager,),
                traced if isinstance(traced, tuple) else (traced,),
                strict=True,
            ):
                assert a.shape[0] == n and torch.equal(a, b)


def module_in(module: torch.nn.Module) -> int:
    from vecpool.models.quant.fp8_block import Fp8BlockLinear

    kinds = (Fp8Linear, Fp8BlockLinear)
    return next(m for m in module.modules() if isinstance(m, kinds)).in_features
