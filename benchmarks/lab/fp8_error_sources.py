"""Where FP8's error comes from, on the CPU: each projection's weight and input rounded or not.

    python benchmarks/lab/fp8_error_sources.py --n 128 \
        --output benchmarks/results/fp8_error_sources_minilm_cpu.json

Runs a model folder (by default the packaged all-MiniLM-L6-v2) in float32 on bench_gpu.py's
passages, with the FP8 projections of `quantization="fp8"` (emulated, as fp8_emulate.py does)
replaced by probes that round, or not, each projection's weight (per output channel) and its
input rows (per token), and reports the cosine of the embeddings to float32's for: weights
only, inputs only, both; FP8 in one kind of projection at a time; in one layer at a time; the
weights' rounding scale searched per channel (8 candidate scales between amax / 448 and
2 amax / 448, the one of least squared error); and the weights' error on the inputs' mean
removed through the bias (the mean measured on other inputs: a calibration, as a bound).
Off the rounding, each probe multiplies in float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench_gpu, record
from benchmarks.lab.fp8_emulate import cosines, embed, emulated_fp8


def fp8_weight(weight: torch.Tensor, candidates: int = 1) -> torch.Tensor:
    """`weight` rounded to FP8 per output channel, dequantized: scale amax / 448 (the engine's),
    or the least-squares best of `candidates` scales from there up to twice that."""
    from vecpool.models.quant.quantize import FP8_DTYPE, FP8_MAX, MIN_AMAX

    amax = weight.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX)
    best, best_err = weight, torch.full_like(amax, float("inf"))
    for k in range(candidates):
        scale = amax / FP8_MAX * 2 ** (k / candidates)
        q = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale
        err = (q - weight).pow(2).sum(dim=1, keepdim=True)
        best = torch.where(err < best_err, q, best)
        best_err = torch.minimum(err, best_err)
    return best


class Probe(nn.Module):
    """A projection in float32 whose weight and input rows are rounded to FP8 or not."""

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Any):
        super().__init__()
        self.name, self.sizes = name, sizes
        self.weight32 = weight.float()  # [N, K]
        self.weight8 = fp8_weight(self.weight32)  # [N, K], FP8 values times their scales
        self.bias = None if bias is None else bias.float()  # [N]
        self.correction = torch.zeros(weight.shape[0])  # [N], added to the output
        self.round_weight = self.round_input = True
        self.input_sum: torch.Tensor | None = None  # [K] when collecting
        self.input_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        from vecpool.models.quant.quantize import dequantize_rows, quantize_rows

        rows = x.reshape(-1, x.shape[-1]).float()
        if self.input_sum is not None:
            self.input_sum += rows.sum(0)
            self.input_rows += rows.shape[0]
        if self.round_input:
            rows = dequantize_rows(quantize_rows(rows))
        out = rows @ (self.weight8 if self.round_weight else self.weight32).t() + self.correction
        if self.bias is not None:
            out = out + self.bias
        out = out.view(*x.shape[:-1], -1)
        return out.split(self.sizes, dim=-1) if self.sizes else out


def probed_engine(model_dir: Path) -> tuple[Any, list[Probe]]:
    """A float32 CPU engine whose FP8 projections are `Probe`s over the original weights."""
    import vecpool
    from vecpool.models.loading.loader import load_model
    from vecpool.models.quant.linear import Fp8Linear

    with emulated_fp8():
        engine = vecpool.Engine(model_dir, device="cpu", dtype="float32", quantization="fp8")
    original = dict(
        load_model(engine.folder, torch.device("cpu"), torch.float32, "auto").named_modules()
    )
    probes = []
    for parent_name, parent in list(engine.model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                full = f"{parent_name}.{name}" if parent_name else name
                src = original[full]
                probe = Probe(full, src.weight, src.bias, child.sizes)
                setattr(parent, name, probe)
                probes.append(probe)
    return engine, probes


def kind(name: str) -> str:
    """The projection's role, from its Hugging Face name (BERT or decoder naming)."""
    for key, label in (
        ("self.qkv", "qkv"),
        ("qkv_proj", "qkv"),
        ("attention.output", "attention_out"),
        ("o_proj", "attention_out"),
        ("intermediate", "mlp_in"),
        ("gate_up", "mlp_in"),
        ("output.dense", "mlp_out"),
        ("down_proj", "mlp_out"),
    ):
        if key in name:
            return label
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    import vecpool
    from vecpool.api import default_model_path

    model_dir = args.model_dir or default_model_path()
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = bench_gpu.make_inputs(tokenizer, bench_gpu.workload_lengths("passages", args.n))[1]
    calibration = bench_gpu.make_inputs(
        tokenizer, bench_gpu.workload_lengths("passages", 32, seed=5), seed=7
    )[1]
    reference = embed(vecpool.Engine(model_dir, device="cpu", dtype="float32"), ids)
    engine, probes = probed_engine(model_dir)
    report: dict[str, Any] = {
        **record.header("lab/fp8_error_sources.py", sys.argv[1:], device="cpu"),
        "emulation": "FP8 emulated on the CPU",
        "model": model_dir.name,
        "workload": "passages",
        "inputs": len(ids),
        "reference": "float32",
        "weight_relative_error": {
            p.name: float((p.weight8 - p.weight32).norm() / p.weight32.norm()) for p in probes
        },
        "cosine_to_float32": {},
    }

    def case(label: str, setup: Callable[[Probe], None]) -> None:
        for p in probes:
            p.round_weight = p.round_input = True
            p.correction.zero_()
            setup(p)
        got = cosines(embed(engine, ids), reference)
        report["cosine_to_float32"][label] = got
        print(f"{label}: {got}", flush=True)

    def only(test: Callable[[Probe], bool]) -> Callable[[Probe], None]:
        def setup(p: Probe) -> None:
            p.round_weight = p.round_input = test(p)

        return setup

    case("weights and inputs", lambda p: None)
    case("weights only", lambda p: setattr(p, "round_input", False))
    case("inputs only", lambda p: setattr(p, "round_weight", False))
    for label in dict.fromkeys(kind(p.name) for p in probes):
        case(f"only {label}", only(lambda p, label=label: kind(p.name) == label))
    layers = sorted({int(part) for p in probes for part in p.name.split(".") if part.isdigit()})
    for layer in layers:
        case(f"only layer {layer}", only(lambda p, layer=layer: f".{layer}." in f".{p.name}."))
    saved = {p.name: p.weight8 for p in probes}
    for p in probes:
        p.weight8 = fp8_weight(p.weight32, candidates=8)
    case("weights' scale searched per channel", lambda p: None)
    for p in probes:  # the inputs' mean over other inputs, nothing rounded
        p.weight8 = saved[p.name]
        p.round_weight = p.round_input = False
        p.input_sum, p.input_rows = torch.zeros(p.weight32.shape[1]), 0
    embed(engine, calibration)
    means = {p.name: p.input_sum / max(p.input_rows, 1) for p in probes if p.input_sum is not None}
    for p in probes:
        p.input_sum = None

    def corrected(p: Probe) -> None:
        p.correction.copy_((p.weight32 - p.weight8) @ means[p.name])

    case("weights' error on the calibration mean moved to the bias", corrected)
    text = json.dumps(report, indent=1) + "\n"
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    np.set_printoptions(precision=5)
    main()
