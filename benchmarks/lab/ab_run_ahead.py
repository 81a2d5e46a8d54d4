"""Pooling a step after the next step's forward is queued (`EngineCore.run_ahead`) against
pooling each step at once, in one process on the same engine and inputs, rounds interleaved.

    PYTHONPATH=. python benchmarks/lab/ab_run_ahead.py --models bert-base --tokenizer DIR

`--against pageable-copies` compares the engine as it is with the same engine copying each of
a batch's arrays to the device on its own from pageable memory (as it did before `upload`),
run-ahead on in both. `--against pow2-buckets` compares the CUDA graphs' token buckets as they
are (quarter steps from 128 tokens) with powers of two up to 1,024 (as they were); with
`--max-num-seqs` (e.g. 16 or 32) the steps are as small as a server's under single-query
clients. `--against flash-attention` compares the engine as it is (steps of short sequences
attend through `packed_attention`'s kernel) with FlashAttention's varlen kernel for every step
(each variant with CUDA graphs of its own). `--against unfused-rotary` compares the query /
key norms and rotary positions of a decoder with those norms (Qwen3, Gemma3) through
`qk_rotary`'s one kernel with the modules it replaces (compiled as the engine compiles them; CUDA graphs of its own
too). `--against inductor-gelu` compares compiled layers calling ATen's GELU kernel
(`layers.gelu`) with the kernel the compiler generates for `F.gelu`; `--against graphs-8k` compares
replaying steps up to the step budget (32,768 tokens at most, as narrow models do) with
replaying them up to 8,192 (a model 1,024 wide or more, as the engine has it);
`--against one-head-tiles` compares the packed attention kernel taking several query heads of
one key/value head a program (`packed_attention.GQA_TILE`) with one head a program;
`--against copied-residual` compares a layer's attention and feed-forward products
accumulated into their residuals in place (`layers.add_linear`; decoders) with the compiler's
`addmm` into new tensors. `--against sum-outside-norm` (FP8 decoders, `--quantization fp8`)
compares layers whose residual sums the next norm's kernel adds (`decoder.SumInNormLayer`)
with the same layers adding each sum on its own. Each variant of these eight runs the whole
workload once before the rounds, recording its graphs.

For each `bench_gpu.py` shape and workload (from token ids, the engine's defaults): a warm-up,
then `--rounds` pairs of `Engine.embed` calls, the order inside each pair alternating; tokens
per second, the median of the rounds with every round kept, and the ratio of the medians. Both
orders run the same steps through the same kernels: their outputs must be identical (checked;
for the buckets and graph sizes, where a step's rows are padded to another count, and the
GELU's two kernels, the largest difference is kept too).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vecpool
from benchmarks import record
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder
from vecpool.models.architectures.decoder import DecoderLayer, SumInNormLayer
from vecpool.models.layers import basic as model_layers
from vecpool.models.layers import packed_attention
from vecpool.runner import batch, graphs

UPLOAD = batch.upload

# Per baseline, the names of the engine as it is and of the baseline, in the report.
LABELS = {
    "in-order": ("run-ahead", "in order"),
    "pageable-copies": ("packed", "pageable copies"),
    "pow2-buckets": ("quarter buckets", "pow2 buckets"),
    "flash-attention": ("packed attention", "flash attention"),
    "unfused-rotary": ("one-kernel rotary", "unfused rotary"),
    "inductor-gelu": ("ATen gelu", "inductor gelu"),
    "graphs-8k": ("graphs to 32k", "graphs to 8k"),
    "one-head-tiles": ("GQA tiles", "one-head tiles"),
    "copied-residual": ("residual in place", "residual copied"),
    "sum-outside-norm": ("sums in norms", "sums outside"),
}
# Variants that record CUDA graphs of their own before the clock.
OWN_GRAPHS = (
    "pow2-buckets",
    "flash-attention",
    "unfused-rotary",
    "inductor-gelu",
    "graphs-8k",
    "one-head-tiles",
    "copied-residual",
    "sum-outside-norm",
)

# The packed kernel's grouped-query tile as this tree has it (`--against one-head-tiles`).
GQA_TILE = packed_attention.GQA_TILE

# The graphs' token buckets before quarter steps from 128: powers of two up to 1,024.
POW2_UP_TO = 1024


def _pageable_upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    return [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]


# Per `StepGraphs` (by id), its recorded graphs by the variant they were recorded with.
_GRAPH_SETS: dict[int, dict[Any, dict[Any, Any]]] = {}


def _use_graph_set(engine: vecpool.Engine, variant: Any, current: Any) -> None:
    """Keep the engine's recorded graphs as `current`'s, and replay `variant`'s from now on (a
    graph keeps the kernels it recorded)."""
    if (step_graphs := engine.model_runner.graphs) is not None:
        sets = _GRAPH_SETS.setdefault(id(step_graphs), {})
        sets.setdefault(current, step_graphs.graphs)
        step_graphs.graphs = sets.setdefault(variant, {})


def _set_variant(engine: vecpool.Engine, baseline: str, new: bool) -> None:
    """The engine as it is (`new`), or as the baseline has it."""
    if baseline == "in-order":
        engine.core.run_ahead = new
    elif baseline == "flash-attention":
        runner = engine.model_runner
        limit = packed_attention.max_len(runner.model.is_causal) if new else 0
        runner.packed_max_len = limit  # read when a step's batch is built
        if (step_graphs := runner.graphs) is not None:
            _use_graph_set(engine, limit, step_graphs.packed_max_len)
            step_graphs.packed_max_len = limit
    elif baseline == "unfused-rotary":
        model = engine.model_runner.model
        layers = [m for m in model.modules() if hasattr(m, "one_kernel_rotary")]
        if not layers:
            raise SystemExit("--against unfused-rotary: the model has no rotary attention")
        _use_graph_set(engine, ("rotary", new), ("rotary", layers[0].one_kernel_rotary))
        for layer in layers:
            layer.one_kernel_rotary = new
    elif baseline == "inductor-gelu":
        # Compiled layers guard on the switch: each value compiles (and records) its own.
        _use_graph_set(engine, ("gelu", new), ("gelu", model_layers.COMPILED_ATEN_GELU))
        model_layers.COMPILED_ATEN_GELU = new
    elif baseline == "graphs-8k":
        # Both share the graphs up to 8,192 tokens; the candidate replays steps up to 32,768.
        if (step_graphs := engine.model_runner.graphs) is not None:
            step_graphs.buckets = graphs.token_buckets(
                graphs.NARROW_MAX_TOKENS if new else graphs.DEFAULT_MAX_TOKENS
            )
    elif baseline == "copied-residual":
        flag = model_layers.COMPILED_RESIDUAL_IN_PLACE
        _use_graph_set(engine, ("residual", new), ("residual", flag))
        model_layers.COMPILED_RESIDUAL_IN_PLACE = new
    elif baseline == "sum-outside-norm":
        # The folded modules serve both forwards: the layers' class picks one.
        layers = [m for m in engine.model_runner.model.modules() if isinstance(m, DecoderLayer)]
        if not layers or not hasattr(layers[-1], "hands_on_sum"):
            raise SystemExit("--against sum-outside-norm: FP8 decoder layers (--quantization fp8)")
        current = type(layers[0]) is SumInNormLayer
        _use_graph_set(engine, ("sum", new), ("sum", current))
        for layer in layers:
            layer.__class__ = SumInNormLayer if new else DecoderLayer
    elif baseline == "one-head-tiles":
        # The kernel reads the tile when it launches: only the graphs need their own sets.
        tile = GQA_TILE if new else None
        _use_graph_set(engine, ("tile", tile), ("tile", packed_attention.GQA_TILE))
        packed_attention.GQA_TILE = tile
    elif baseline == "pageable-copies":
        batch.upload = UPLOAD if new else _pageable_upload  # type: ignore[assignment]
    elif (step_graphs := engine.model_runner.graphs) is not None:
        largest = step_graphs.buckets[-1]
        step_graphs.buckets = (
            graphs.token_buckets(largest)
            if new
            else graphs.token_buckets(largest, fine_from=POW2_UP_TO)
        )


def _timed(engine: vecpool.Engine, ids: list[list[int]], device: str) -> tuple[float, np.ndarray]:
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = engine.embed(ids, show_progress=False)
    return time.perf_counter() - started, out


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert-base"], choices=sorted(SHAPES))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--n", type=int, default=4096, help="inputs per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--against", choices=sorted(LABELS), default="in-order")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="inputs per step at most (default: the engine's)",
    )
    parser.add_argument(
        "--quantization", choices=["fp8"], help="the engine's `quantization` (default: none)"
    )
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    report = record.header("lab/ab_run_ahead.py", argv, device=args.device, commit=args.commit)
    report["max_num_seqs"] = args.max_num_seqs
    report["quantization"] = args.quantization
    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    rows = report["rows"] = []
    for name in args.models:
        folder = write_folder(SHAPES[name], Path(tempfile.mkdtemp()), args.tokenizer, args.device)
        narrow_width = graphs.NARROW_WIDTH
        if args.against == "graphs-8k":  # every width replays steps up to its step budget
            graphs.NARROW_WIDTH = 1 << 30
        try:
            engine = vecpool.Engine(
                folder,
                device=args.device,
                quantization=args.quantization,
                **({} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}),
                # on the CPU too: the same padding, as plain forwards
                **({"cuda_graphs": True} if args.against in OWN_GRAPHS else {}),
            )
        finally:  # read when an engine is built
            graphs.NARROW_WIDTH = narrow_width
        limit = engine.info().max_model_len
        for workload in args.workloads:
            lengths = workload_lengths(workload, args.n).clip(max=limit)
            _, ids = make_inputs(tokenizer, lengths)
            engine.embed(ids[:512], show_progress=False)
            if args.against in OWN_GRAPHS:  # each records its graphs before the clock
                for variant in (False, True):
                    _set_variant(engine, args.against, variant)
                    engine.embed(ids, show_progress=False)
            gc.collect()
            gc.freeze()
            new, old = LABELS[args.against]
            seconds: dict[str, list[float]] = {new: [], old: []}
            outputs: dict[str, np.ndarray] = {}
            for i in range(args.rounds):
                for label in (new, old) if i % 2 == 0 else (old, new):
                    _set_variant(engine, args.against, label == new)
                    took, outputs[label] = _timed(engine, ids, args.device)
                    seconds[label].append(took)
            gc.unfreeze()
            _set_variant(engine, args.against, True)
            tokens = int(lengths.sum())
            per_variant = {
                label: {
                    "tokens_per_s": tokens / statistics.median(values),
                    "seconds": values,
                }
                for label, values in seconds.items()
            }
            row = {
                "model": name,
                "workload": workload,
                "num_inputs": len(ids),
                "num_tokens": tokens,
                **per_variant,
                "ratio": per_variant[new]["tokens_per_s"] / per_variant[old]["tokens_per_s"],
                "identical": bool(np.array_equal(outputs[new], outputs[old])),
                "max_abs_diff": float(np.abs(outputs[new] - outputs[old]).max()),
            }
            rows.append(row)
            print(
                f"{name:11s} {workload:8s} {new} {row[new]['tokens_per_s']:,.0f} "
                f"{old} {row[old]['tokens_per_s']:,.0f} tok/s: "
                f"{row['ratio']:.3f}x, identical {row['identical']} "
                f"(max diff {row['max_abs_diff']:.2g})",
                flush=True,
            )
            record.write(args.output, report)
        del engine
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
