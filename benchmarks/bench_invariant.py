"""The batch-invariant mode: its throughput cost, and whether it is bit-exact on this device.

One command on one GPU (random weights of a model shape, the tokenizer of `--tokenizer`):

    python benchmarks/bench_invariant.py --tokenizer TOKENIZER_DIR

1. Throughput, inputs per second, of one engine call over the workload (`--n` inputs), with and
   without `batch_invariant` (`--repeats` rounds each after a warm-up, medians); the cost is
   `1 - invariant / normal`.
2. Bit-exactness: `--check` inputs (1 to 300 tokens) embedded one per call, then in five
   shuffled calls of them all; how many outputs differ from the input alone (must be 0 for the
   invariant engines), for the normal engine, the invariant one as the engine builds it by
   default (compiled, CUDA graphs) and the invariant one eager (neither). Also the largest
   difference between the invariant and the normal outputs (they compute the same function).

Writes the report as JSON (`--output`) and exits non-zero when an invariant engine differs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--workload", default="passages", choices=WORKLOADS)
    parser.add_argument("--n", type=int, default=1024, help="inputs per timed call")
    parser.add_argument("--repeats", type=int, default=record.MIN_ROUNDS, help="timed rounds")
    parser.add_argument("--check", type=int, default=200, help="inputs of the exactness check")
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/...json")
    record.add_args(parser)
    return parser.parse_args(argv)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _throughput(engine: Any, ids: list[list[int]], repeats: int, device: str) -> list[float]:
    engine.embed(ids[: max(64, len(ids) // 8)], show_progress=False)  # warm-up (compiles)
    rounds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        engine.embed(ids, show_progress=False)
        _sync(device)
        rounds.append(len(ids) / (time.perf_counter() - start))
    return rounds


def _exactness(engine: Any, ids: list[list[int]]) -> tuple[int, np.ndarray]:
    """Outputs of five shuffled calls that differ from their input alone, and the alone ones."""
    alone = np.stack([engine.embed([p], show_progress=False)[0] for p in ids])
    differ = 0
    for call in range(5):
        order = list(range(len(ids)))
        random.Random(call).shuffle(order)
        mixed = engine.embed([ids[i] for i in order], show_progress=False)
        differ += sum(not np.array_equal(mixed[j], alone[i]) for j, i in enumerate(order))
    return differ, alone


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tokenizers import Tokenizer

    import vecpool

    device = args.device
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    tokenizer_dir = args.tokenizer or vecpool.api.default_model_path()
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    shape = SHAPES[args.model]
    _, ids = make_inputs(tokenizer, workload_lengths(args.workload, args.n))
    gen = np.random.default_rng(7)
    vocab = tokenizer.get_vocab_size()
    check_ids = [
        gen.integers(1000, vocab, size=int(n)).tolist()
        for n in np.concatenate([np.arange(1, 9), gen.integers(9, 300, size=args.check - 8)])
    ]
    report: dict[str, Any] = {
        **record.header(
            "bench_invariant.py",
            sys.argv[1:] if argv is None else argv,
            device=device,
            commit=args.commit,
        ),
        "model_shape": args.model,
        "dtype": dtype,
        "workload": args.workload,
        "n": args.n,
        "check_inputs": len(check_ids),
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(shape, Path(tmp) / args.model, tokenizer_dir, device)
        engines = {
            "normal": dict(),
            "invariant": dict(batch_invariant=True),
            "invariant-eager": dict(batch_invariant=True, compile=False, cuda_graphs=False),
        }
        alone: dict[str, np.ndarray] = {}
        for name, options in engines.items():
            start = time.perf_counter()
            engine = vecpool.Engine(folder, device=device, dtype=dtype, **options)
            entry: dict[str, Any] = {"options": options}
            if name != "invariant-eager":
                rounds = _throughput(engine, ids, args.repeats, device)
                entry["inputs_per_s_rounds"] = rounds
                entry["inputs_per_s_median"] = statistics.median(rounds)
            entry["differ_from_alone"], alone[name] = _exactness(engine, check_ids)
            entry["seconds"] = time.perf_counter() - start
            report[name] = entry
            print(name, json.dumps(entry), flush=True)
            del engine
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    report["cost"] = (
        1 - report["invariant"]["inputs_per_s_median"] / (report["normal"]["inputs_per_s_median"])
    )
    diff = np.abs(alone["invariant"].astype(np.float64) - alone["normal"])
    report["max_abs_diff_invariant_vs_normal"] = float(diff.max())
    print(json.dumps({k: report[k] for k in ("cost", "max_abs_diff_invariant_vs_normal")}))
    output = args.output or Path(__file__).parent / "results" / (
        "batch_invariant_h200.json" if device.startswith("cuda") else "batch_invariant_cpu.json"
    )
    record.write(output, report)
    failed = [n for n in ("invariant", "invariant-eager") if report[n]["differ_from_alone"]]
    if failed:
        print(f"FAILED: {failed} differ from the inputs alone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
