"""Block-wise FP8 checkpoints on one Hopper GPU: the cuBLAS block-scaled product against the
dequantized float32 arithmetic the CPU runs, its speed against bf16 and per-channel FP8, and an
engine loading such a checkpoint against the bf16 model it was made from.

    python benchmarks/lab/fp8_block_check.py --tokenizer TOKENIZER_DIR \
        --output benchmarks/results/fp8_block_h200.json          # about 5 minutes

(a) **layer**: an `Fp8BlockLinear` (128 x 128 blocks) on the CUDA path (rows quantized by the
    Triton group kernels, plain, after an RMSNorm or from SiLU(gate) * up; cuBLAS's product)
    against the same layer on the dequantized float32 path with torch's quantization, at the
    projection shapes of Qwen3-0.6B and Mistral-7B and row counts that are not multiples of 4
    (the rows are padded): the largest error relative to the output's largest value, and the
    lowest cosine per row.
(b) **matmul**: at M = 16384 tokens, bf16 `F.linear`, per-channel FP8 (`Fp8Linear`, rows
    quantized by its kernel) and block FP8 (rows quantized in groups of 128 by torch ops, eager
    or compiled, or by the Triton group kernel; then cuBLAS), each timed from its input in the
    model's dtype.
(c) **engine**: bench_gpu.py's random-weight folder of each model, rewritten as a fine-grained
    FP8 checkpoint (`quant_method` "fp8", `weight_block_size` [128, 128]); engines on the bf16
    folder, on it with `quantization="fp8"` (per channel) and on the FP8 folder, all with the
    engine's defaults, their rounds interleaved in this one process; tokens/s, the minimum
    cosine of each FP8 engine's embeddings to bf16's, and prompt embeds == ids under block FP8.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.lab.fp8_check import MODELS, exactness, min_median_cosine, rounds, run_steps
from benchmarks.workloads import SHAPES, make_inputs, workload_lengths, write_folder

BLOCK = (128, 128)
SECTIONS = ("layer", "matmul", "engine")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument(
        "--output", type=Path, default=Path("benchmarks/results/fp8_block_h200.json")
    )
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS, help="at least 3")
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(MODELS),
        choices=[*MODELS, "bert-base"],
        help="bert-base: the engine section only (an encoder's layers, not fused with norms)",
    )
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--inputs", type=int, default=2048, help="inputs per workload")
    record.add_args(parser)
    return parser.parse_args(argv)


def block_layer(weight: torch.Tensor) -> Any:
    from vecpool.models.quant.fp8_block import Fp8BlockLinear, quantize_blocks

    n, k = weight.shape
    with torch.device("meta"):
        layer = Fp8BlockLinear(k, n, block=BLOCK, bias=False, out_dtype=weight.dtype)
    data, scale = quantize_blocks(weight, BLOCK)
    layer.weight = torch.nn.Parameter(data, requires_grad=False)
    layer.set_block_scale(scale)
    return layer


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    hidden, inter, heads, kv, head_dim = MODELS[model]
    return {
        "qkv": ((heads + 2 * kv) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def layer_entries(layer: Any, norm: Any, silu_mul: bool) -> dict[str, tuple[Any, Any]]:
    """entry -> (the CUDA path's call, the reference path's call) of `layer`'s inputs: rows as
    they are and after `norm`, or (down) SiLU(gate) * up of a `[M, 2K]` gate | up."""
    if silu_mul:
        k = layer.in_features
        return {
            "silu_mul": (
                layer.silu_mul_forward,
                lambda x: layer(F.silu(x[:, :k].float()) * x[:, k:].float()),
            )
        }
    return {
        "rows": (layer, layer),
        "rms_norm": (lambda x: layer.norm_forward(x, norm), lambda x: layer(norm(x))),
    }


def check_layers(report: dict[str, Any], models: list[str]) -> None:
    """Each projection's three entries (plain rows, RMSNorm rows, SiLU * up rows) on the CUDA
    path (Triton group quantization, cuBLAS) against the dequantized float32 path."""
    from vecpool.models.layers.basic import RMSNorm
    from vecpool.models.quant.linear import fused_fp8_ops

    assert fused_fp8_ops(torch.device("cuda")), "the FP8 Triton kernels are not available"
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in models:
        for name, (n, k) in projection_shapes(model).items():
            w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            layer = block_layer(w)
            norm = RMSNorm(k, 1e-6).to("cuda", torch.bfloat16)
            norm.weight.data = torch.rand(k, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
            entries = layer_entries(layer, norm, silu_mul=name == "down")
            for entry, (fast_fn, ref_fn) in entries.items():
                for m in (1, 37, 300, 4099):
                    width = 2 * k if entry == "silu_mul" else k
                    x = torch.randn(m, width, device="cuda", generator=gen, dtype=torch.bfloat16)
                    layer.choose_backend(torch.device("cuda"))
                    layer.kernels = True
                    assert layer.cublas, "cuBLAS block-scaled FP8 not chosen on this device"
                    fast = fast_fn(x).float()
                    layer.cublas = layer.kernels = False
                    ref = ref_fn(x).float()
                    rel = float((fast - ref).abs().max() / ref.abs().max())
                    cos = float(F.cosine_similarity(fast, ref, dim=-1).min())
                    row = {
                        "model": model,
                        "proj": name,
                        "entry": entry,
                        "m": m,
                        "max_rel_err": rel,
                        "min_cos": cos,
                    }
                    # bf16 outputs of float32 sums, and a value now and then rounded to the
                    # FP8 neighbour of the reference's (its norm computed in another order).
                    row["ok"] = rel < 2e-2 and cos > 0.9995
                    report["layer"].append(row)
                    if not row["ok"]:
                        report["failures"].append(f"layer {row}")
                    print(f"layer {row}", flush=True)


def bench_matmuls(report: dict[str, Any], models: list[str], n_rounds: int) -> None:
    from vecpool.models.quant.linear import Fp8Linear, finish_fp8

    gen = torch.Generator(device="cuda").manual_seed(1)
    m = 16384
    for model in models:
        for name, (n, k) in projection_shapes(model).items():
            w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            channel = torch.nn.Sequential(Fp8Linear.from_weight(w, None))
            finish_fp8(channel, torch.device("cuda"))
            block = block_layer(w)
            block.choose_backend(torch.device("cuda"))
            compiled = torch.compile(block, dynamic=False)
            fused = block_layer(w)  # rows quantized by the Triton group kernel
            fused.choose_backend(torch.device("cuda"))
            fused.kernels = True
            row: dict[str, Any] = {"model": model, "proj": name, "m": m, "n": n, "k": k}
            for system, fn in (
                ("bf16", partial(F.linear, x, w)),
                ("fp8_channel", partial(channel, x)),
                ("fp8_block_eager", partial(block, x)),
                ("fp8_block_compiled", partial(compiled, x)),
                ("fp8_block_kernels", partial(fused, x)),
            ):
                row[system] = rounds(fn, n_rounds, 20)
            base = row["bf16"]["median_ms"]
            for system in (
                "fp8_channel",
                "fp8_block_eager",
                "fp8_block_compiled",
                "fp8_block_kernels",
            ):
                row[f"{system}_speedup"] = base / row[system]["median_ms"]
            report["matmul"].append(row)
            print(
                f"matmul {model} {name}: bf16 {base:.3f} ms, channel "
                f"{row['fp8_channel_speedup']:.2f}x, block eager {row['fp8_block_eager_speedup']:.2f}x"
                f", compiled {row['fp8_block_compiled_speedup']:.2f}x"
                f", kernels {row['fp8_block_kernels_speedup']:.2f}x",
                flush=True,
            )


def is_layer_linear(key: str, tensor: torch.Tensor) -> bool:
    """A linear weight inside the layer stack (a decoder's `layers.`, BERT's `encoder.layer.`)."""
    inside = "layers." in key or "encoder.layer." in key
    return inside and key.endswith(".weight") and tensor.ndim == 2 and "LayerNorm" not in key


def write_block_checkpoint(folder: Path, dest: Path) -> None:
    """`folder` (one safetensors file or shards) rewritten with every layer projection in
    block-wise FP8 and the config's `quantization_config` saying so."""
    from safetensors.torch import load_file, save_file

    from vecpool.models.quant.fp8_block import quantize_blocks

    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    scales: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        stored = {}
        for key, tensor in load_file(str(path), device="cuda").items():
            if is_layer_linear(key, tensor):
                data, scale = quantize_blocks(tensor, BLOCK)
                stored[key], stored[key[: -len("weight")] + "weight_scale_inv"] = data, scale
                scales.add(key[: -len("weight")] + "weight_scale_inv")
            else:
                stored[key] = tensor
        save_file({k: v.cpu() for k, v in stored.items()}, str(dest / path.name))
        del stored
    index = dest / "model.safetensors.index.json"
    if index.is_file():  # the scales join their weights' shards
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        for key in list(weight_map):
            if key.endswith(".weight") and key[: -len("weight")] + "weight_scale_inv" in scales:
                weight_map[key[: -len("weight")] + "weight_scale_inv"] = weight_map[key]
        index.write_text(json.dumps(data))
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (dest / "config.json").write_text(json.dumps(cfg))


def bench_engines(
    report: dict[str, Any], args: argparse.Namespace, tokenizer_dir: Path, save: Any
) -> None:
    import tokenizers

    import vecpool
    from vecpool.models.quant.fp8_block import Fp8BlockLinear

    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    n_rounds = max(3, args.rounds)
    for model in args.models:
        n = args.inputs
        workloads = {
            w: make_inputs(tokenizer, workload_lengths(w, n))[1] for w in ("queries", "passages")
        }
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            folder = write_folder(SHAPES[model], Path(tmp) / "bf16", tokenizer_dir, "cuda")
            write_block_checkpoint(folder, Path(tmp) / "fp8_block")
            print(f"{model}: folders written in {time.perf_counter() - started:.0f} s", flush=True)
            engines = {
                "bf16": vecpool.Engine(folder, device="cuda", dtype="bfloat16"),
                "fp8_channel": vecpool.Engine(
                    folder, device="cuda", dtype="bfloat16", quantization="fp8"
                ),
                "fp8_block": vecpool.Engine(
                    Path(tmp) / "fp8_block", device="cuda", dtype="bfloat16"
                ),
            }
            blocks = [
                m for m in engines["fp8_block"].model.modules() if isinstance(m, Fp8BlockLinear)
            ]
            report["block_layers"][model] = {
                "count": len(blocks),
                "on_cublas": sum(m.cublas for m in blocks),
            }
            for engine in engines.values():  # compile, graphs
                engine.embed(workloads["passages"][:512], show_progress=False)
            print(f"{model}: engines ready in {time.perf_counter() - started:.0f} s", flush=True)
            outputs: dict[str, dict[str, np.ndarray]] = {s: {} for s in engines}
            for name, ids in workloads.items():
                tokens = sum(map(len, ids))
                raw: dict[str, list[float]] = {s: [] for s in engines}
                for _ in range(n_rounds):  # interleaved
                    for system, engine in engines.items():
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        out = engine.embed(ids, truncate_prompt_tokens=-1, show_progress=False)
                        torch.cuda.synchronize()
                        raw[system].append(tokens / (time.perf_counter() - t0))
                        outputs[system][name] = np.asarray(out, dtype=np.float32)
                row: dict[str, Any] = {"model": model, "workload": name, "tokens": tokens}
                for system in engines:
                    row[system] = {
                        "tokens_per_s": raw[system],
                        "median": statistics.median(raw[system]),
                    }
                for system in ("fp8_channel", "fp8_block"):
                    row[f"{system}_speedup"] = row[system]["median"] / row["bf16"]["median"]
                    row[f"{system}_cosine_to_bf16"] = min_median_cosine(
                        outputs[system][name], outputs["bf16"][name]
                    )
                report["engine"].append(row)
                print(f"engine {json.dumps(row)}", flush=True)
                save()
            report["exactness"][model] = exactness(engines["fp8_block"], workloads["passages"][:64])
            if not report["exactness"][model]["ok"]:
                report["failures"].append(f"{model}: block FP8 prompt embeds differ from ids")
            del engines
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_block_check.py needs a CUDA device")
    from vecpool.models.quant.fp8_block import cublas_block_fp8

    if not cublas_block_fp8(torch.device("cuda")):
        raise SystemExit(f"{torch.cuda.get_device_name()}: no cuBLAS block-scaled FP8 (Hopper)")
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from vecpool.api import default_model_path

        tokenizer_dir = default_model_path()
    report: dict[str, Any] = {
        **record.header("lab/fp8_block_check.py", argv, device="cuda", commit=args.commit),
        "layer": [],
        "matmul": [],
        "block_layers": {},
        "engine": [],
        "exactness": {},
        "failures": [],
        "errors": [],
    }

    def save() -> None:
        record.write(args.output, report)

    started = time.perf_counter()
    shapes = [m for m in args.models if m in MODELS]
    steps: list[tuple[str, Callable[[], None]]] = [
        ("layer", lambda: check_layers(report, shapes)),
        ("matmul", lambda: bench_matmuls(report, shapes, max(3, args.rounds))),
        ("engine", lambda: bench_engines(report, args, tokenizer_dir, save)),
    ]
    steps = [(name, step) for name, step in steps if name in args.sections]
    return run_steps(steps, report, save, started, args.output)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
