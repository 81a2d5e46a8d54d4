"""Throughput and model-FLOP utilization of vecpool against sentence-transformers and padded
Hugging Face transformers, in one process, on one device, on the same inputs.

    python benchmarks/bench_gpu.py --models qwen3-0.6b --workloads queries passages \
        --output results.json

Models are random-weight folders of real shapes (`SHAPES`), written once to a temporary
directory in the sentence-transformers layout (last-token pooling for decoders, mean pooling
for encoders, then Normalize), so every system loads the same files. `--model-dir` runs a real
folder instead (e.g. the packaged MiniLM on the CPU).

Workloads (`WORKLOADS`, fixed seed): **queries** are 4,096 inputs of U[8, 64] tokens,
**passages** 4,096 inputs of lognormal(ln 180, 0.6) tokens clipped to [32, 512]. Text comes
from the tokenizer of all-MiniLM-L6-v2 (BERT WordPiece, `--tokenizer`): each input is a run of
whole-word vocabulary entries that tokenize to one token each, so an input of L tokens is
[CLS] + L - 2 words + [SEP]; the id inputs are exactly those tokens.

Systems (`--systems`): `vecpool-text`, `vecpool-ids` (compiled where the engine compiles by
default), `vecpool-ids-eager` (the same without `torch.compile`: the before/after of that
lever), `vecpool-hf` (token ids through the transformers fallback, `model_impl="transformers"`:
what a family without a native class gets), `st-32` / `st-128` (sentence-transformers `encode` at that batch size, on the texts),
`hf-padded` (transformers `AutoModel`, sdpa attention, inputs sorted by length and padded in
batches of `--hf-batch-size`: the floor). `--budgets` adds `vecpool-ids@N` runs at other token
budgets.

MFU = (2 x non-embedding parameters x tokens + attention FLOPs) / seconds / ceiling, where the
attention FLOPs are 4 x heads x head_dim x layers x (L(L+1)/2 causal, L^2 bidirectional) per
input, and the ceiling is a large bf16 (fp32 on the CPU) matrix product measured in the same
run. Every system is warmed up on the whole workload once (untimed: a first round at full size
took sentence-transformers 3-6x its later ones, and a median of three would keep a half-warm
round; `--warmup N` warms on the first N inputs instead), then timed `--repeats` times on the whole
workload; the report keeps every timing and the medians, and peak device memory of each.

`--http` adds the HTTP path on the passages workload (report key `http`): the model served by
`vecpool serve` in its own processes, `--http-clients` concurrent closed-loop clients (default
32) each sending 32 passages per `/v1/embeddings` request, every round between two offline
`Engine.embed` runs of the same passages; HTTP tokens/s, offline tokens/s, their ratio, latency
p50 / p90 / p99 / max and errors (the clients and server are `bench_online.py`'s batched
scenario).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.workloads import (
    DECODER_TYPES,
    SHAPES,
    WORKLOADS,
    make_inputs,
    workload_lengths,
    write_folder,
)

SYSTEMS = (
    "vecpool-text",
    "vecpool-ids",
    "vecpool-ids-eager",
    "vecpool-hf",
    "st-32",
    "st-128",
    "hf-padded",
)


@dataclass(frozen=True)
class FlopModel:
    """What the MFU formula needs of a model."""

    non_embedding_params: int
    attention_width: int  # heads x head_dim
    num_layers: int
    causal: bool

    def flops(self, lengths: np.ndarray) -> float:
        lengths = lengths.astype(np.float64)
        pairs = lengths * (lengths + 1) / 2 if self.causal else lengths**2
        attention = 4.0 * self.attention_width * self.num_layers * pairs.sum()
        return 2.0 * self.non_embedding_params * lengths.sum() + attention


def flop_model(folder: Path) -> FlopModel:
    """Count a folder's parameters outside its embedding tables and unused heads."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    params = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "embed" not in name and not name.startswith(("pooler.", "lm_head."))
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # Decoders attend causally unless their config turns that off (embedding fine-tunes).
    bidirectional = getattr(cfg, "is_causal", None) is False or bool(
        getattr(cfg, "use_bidirectional_attention", False)
    )
    causal = cfg.model_type in DECODER_TYPES and not bidirectional
    return FlopModel(params, cfg.num_attention_heads * head_dim, cfg.num_hidden_layers, causal)


def matmul_ceiling(device: torch.device, repeats: int = 20) -> float:
    """FLOP/s of a large matrix product on random data: bf16 on CUDA, fp32 on the CPU."""
    if device.type == "cuda":
        n, dtype = 8192, torch.bfloat16
    else:
        n, dtype = 512, torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        times.append(_time(lambda: torch.mm(a, b), device))
    return 2.0 * n**3 / statistics.median(times)


# ---- systems --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


Runner = Callable[[list[str], list[list[int]]], np.ndarray]


def vecpool_runner(
    folder: Path,
    device: str,
    dtype: str,
    *,
    text: bool,
    compile: bool | None,
    budget: int | None,
    model_impl: str = "auto",
    quantization: str | None = None,
) -> tuple[Runner, Any]:
    import vecpool

    engine = vecpool.Engine(
        folder,
        device=device,
        dtype=dtype,
        compile=compile,
        max_num_batched_tokens=budget,
        model_impl=model_impl,
        quantization=quantization,
    )

    def run(texts: list[str], ids: list[list[int]]) -> np.ndarray:
        # Truncated to the model's limit, as sentence-transformers does.
        return engine.embed(texts if text else ids, truncate_prompt_tokens=-1, show_progress=False)

    return run, engine


def st_runner(folder: Path, device: str, dtype: torch.dtype, batch_size: int) -> tuple[Runner, Any]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device=device)
    model.to(dtype)

    def run(texts: list[str], ids: list[list[int]]) -> np.ndarray:
        out = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        return np.asarray(out, dtype=np.float32)

    return run, model


def hf_runner(
    folder: Path, device: str, dtype: torch.dtype, batch_size: int, causal: bool
) -> tuple[Runner, Any]:
    import transformers

    model = transformers.AutoModel.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa"
    )
    model = model.to(device).eval()

    @torch.inference_mode()
    def run(texts: list[str], ids: list[list[int]]) -> np.ndarray:
        lengths = np.array([len(i) for i in ids])
        order = np.argsort(lengths, kind="stable")
        out = torch.empty(len(ids), model.config.hidden_size, device=device)
        for start in range(0, len(ids), batch_size):
            rows = order[start : start + batch_size]
            width = int(lengths[rows].max())
            batch = torch.zeros(len(rows), width, dtype=torch.int64)
            mask = torch.zeros(len(rows), width, dtype=torch.int64)
            for r, i in enumerate(rows):
                batch[r, : lengths[i]] = torch.tensor(ids[i])
                mask[r, : lengths[i]] = 1
            batch, mask = batch.to(device), mask.to(device)
            hidden = model(input_ids=batch, attention_mask=mask).last_hidden_state.float()
            if causal:
                pooled = hidden[torch.arange(len(rows), device=device), mask.sum(1) - 1]
            else:
                m = mask[..., None].float()
                pooled = (hidden * m).sum(1) / m.sum(1)
            out[torch.from_numpy(rows).to(device)] = torch.nn.functional.normalize(pooled, dim=-1)
        return out.cpu().numpy()

    return run, model


# ---- the run --------------------------------------------------------------------------------


def measure(
    run: Runner,
    inputs: dict[str, tuple[list[str], list[list[int]], np.ndarray]],
    workloads: list[str],
    repeats: int,
    device: torch.device,
    warmup: int | None,
) -> dict[str, Any]:
    """Warm up, then time `run` on every workload; timings, outputs, peak memory."""
    out: dict[str, Any] = {}
    for w in workloads:
        texts, ids, _ = inputs[w]
        run(texts[:warmup], ids[:warmup])  # None: the whole workload
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # Every system alike, as `vecpool serve` does once started: the collector's full
        # passes skip what exists now (a pass over a loaded model's objects takes ~0.15 s and
        # lands in one round and not another).
        gc.collect()
        gc.freeze()
        seconds, result = [], None
        try:
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                result = run(texts, ids)
                _sync(device)
                seconds.append(time.perf_counter() - start)
        finally:
            gc.unfreeze()
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        out[w] = {"seconds": seconds, "peak_memory_bytes": peak, "outputs": result}
    return out


def profile_run(run: Runner, texts: list[str], ids: list[list[int]], path: Path) -> dict[str, Any]:
    """One profiled call: wall time, device busy time by kernel family, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run(texts, ids)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    families = {"gemm": 0.0, "attention": 0.0, "fused (triton)": 0.0, "other": 0.0}
    for evt in prof.key_averages():
        t = float(getattr(evt, "self_device_time_total", 0.0)) / 1e6
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.key.lower()
        if "flash" in name or "fmha" in name:
            families["attention"] += t
        elif "triton" in name:
            families["fused (triton)"] += t
        elif any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "sm90")):
            families["gemm"] += t
        else:
            families["other"] += t
    path.write_text(
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=40) + "\n"
    )
    return {
        "wall_seconds": wall,
        "device_seconds": families,
        "device_busy": sum(families.values()) / wall,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"], choices=sorted(SHAPES))
    parser.add_argument("--model-dir", type=Path, help="a real folder instead of --models")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--budgets", type=int, nargs="*", default=[], metavar="N")
    parser.add_argument("--n", type=int, default=4096, help="inputs per workload")
    parser.add_argument("--repeats", type=int, default=record.MIN_ROUNDS, help="timed rounds")
    parser.add_argument("--baseline-repeats", type=int, help="for st-* and hf-padded")
    parser.add_argument(
        "--warmup", type=int, help="inputs of the warm-up call (default: the whole workload)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--hf-batch-size", type=int, default=128)
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument("--fidelity", type=int, default=256, help="inputs checked against fp32")
    parser.add_argument(
        "--quantization", choices=("fp8", "int8"), help="the vecpool systems' quantization"
    )
    parser.add_argument("--profile", action="store_true", help="profile vecpool-ids once")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    http = parser.add_argument_group("the HTTP path (bench_online.py's batched scenario)")
    http.add_argument(
        "--http", action="store_true", help="also serve the model and measure /v1/embeddings"
    )
    http.add_argument("--http-clients", type=int, default=32, help="concurrent clients")
    http.add_argument("--http-repeats", type=int, help="rounds (default: --repeats)")
    http.add_argument("--http-client", choices=("httpx", "raw"), default="httpx")
    http.add_argument("--http-client-processes", type=int, help="default: bench_online's")
    http.add_argument("--server-args", default="", help="more `vecpool serve` options")
    record.add_args(parser)
    return parser.parse_args(argv)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def bench_model(
    name: str,
    folder: Path,
    args: argparse.Namespace,
    report: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Every system on every workload for one model folder, into `report["rows"]`; `save`
    after each system, so that a run cut short keeps what it measured."""
    import tokenizers

    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    flops_of = flop_model(folder)
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    st_config = folder / "sentence_bert_config.json"
    limit = json.loads(st_config.read_text()).get("max_seq_length") if st_config.exists() else None
    inputs = {}
    for w in args.workloads:
        lengths = workload_lengths(w, args.n)
        texts, ids = make_inputs(tokenizer, lengths)
        # Inputs past the model's limit are truncated: count the tokens that run.
        inputs[w] = (texts, ids, lengths if limit is None else np.minimum(lengths, limit))

    systems: list[tuple[str, Callable[[], tuple[Runner, Any]]]] = []
    for s in args.systems:
        if s.startswith("vecpool"):
            compile = False if s.endswith("-eager") else None
            systems.append(
                (
                    s,
                    lambda s=s, compile=compile: vecpool_runner(
                        folder,
                        args.device,
                        dtype_name,
                        text=s == "vecpool-text",
                        compile=compile,
                        budget=None,
                        model_impl="transformers" if s == "vecpool-hf" else "auto",
                        quantization=None if s == "vecpool-hf" else args.quantization,
                    ),
                )
            )
        elif s.startswith("st-"):
            bs = int(s.removeprefix("st-"))
            systems.append((s, lambda bs=bs: st_runner(folder, args.device, dtype, bs)))
        else:
            systems.append(
                (
                    s,
                    lambda: hf_runner(
                        folder, args.device, dtype, args.hf_batch_size, flops_of.causal
                    ),
                )
            )
    for budget in args.budgets:
        systems.append(
            (
                f"vecpool-ids@{budget}",
                lambda budget=budget: vecpool_runner(
                    folder, args.device, dtype_name, text=False, compile=None, budget=budget
                ),
            )
        )

    rows: list[dict[str, Any]] = report["rows"]
    outputs: dict[str, dict[str, np.ndarray]] = {}
    for system, build in systems:
        started = time.perf_counter()
        try:
            run, obj = build()
            extra: dict[str, Any] = {"setup_seconds": time.perf_counter() - started}
            if system.startswith("vecpool"):
                extra["compiled"] = obj.model_runner.compiled
                extra["max_num_batched_tokens"] = obj.scheduler_config.max_num_batched_tokens
                extra["max_num_seqs"] = obj.scheduler_config.max_num_seqs
            repeats = args.repeats
            if not system.startswith("vecpool") and args.baseline_repeats:
                repeats = args.baseline_repeats
            results = measure(run, inputs, args.workloads, repeats, device, args.warmup)
            if args.profile and system == "vecpool-ids" and device.type == "cuda":
                w = args.workloads[-1]
                out_dir = args.output.parent if args.output else Path(".")
                extra["profile"] = profile_run(
                    run, inputs[w][0], inputs[w][1], out_dir / f"profile_{name}_{w}.txt"
                )
                extra["profile"]["workload"] = w
        except Exception as exc:  # one system failing must not lose the others' numbers
            rows.append({"model": name, "system": system, "error": f"{type(exc).__name__}: {exc}"})
            print(f"{name} {system}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if system.startswith("vecpool"):
            dynamo = torch._dynamo.utils.counters
            extra["dynamo"] = {
                k: dict(v) for k, v in dynamo.items() if k in ("stats", "recompiles")
            }
        for w, res in results.items():
            lengths = inputs[w][2]
            median = statistics.median(res["seconds"])
            row = {
                "model": name,
                "workload": w,
                "system": system,
                "num_inputs": len(lengths),
                "num_tokens": int(lengths.sum()),
                "seconds": res["seconds"],
                "median_seconds": median,
                "tokens_per_s": float(lengths.sum()) / median,
                "mfu": flops_of.flops(lengths) / median / report["ceiling_flops"],
                "peak_memory_bytes": res["peak_memory_bytes"],
                **extra,
            }
            outputs.setdefault(system, {})[w] = res["outputs"]
            rows.append(row)
            print(
                f"{name:11} {w:8} {system:18} {row['tokens_per_s']:>11,.0f} tok/s  "
                f"MFU {row['mfu']:6.1%}  (runs {', '.join(f'{s:.3f}' for s in res['seconds'])})",
                flush=True,
            )
        del run, obj, results
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    report["fidelity"].setdefault(name, {}).update(_fidelity(folder, args, inputs, outputs, device))
    save()
    if args.http:
        report["http"].extend(http_rows(name, folder, args, inputs["passages"], dtype_name))
        save()


def http_rows(
    name: str,
    folder: Path,
    args: argparse.Namespace,
    passages: tuple[list[str], list[list[int]], np.ndarray],
    dtype: str,
) -> list[dict[str, Any]]:
    """The passages workload through `vecpool serve`: `--http-clients` closed-loop clients,
    each request 32 passages, rounds between two offline `Engine.embed` runs of the same
    passages (bench_online.py's batched scenario, whose clients and server this runs).
    Rows: HTTP and offline tokens/s, their ratio, latency p50 / p90 / p99 / max, errors."""
    from benchmarks import bench_online

    texts, _, lengths = passages
    num_requests = -(-len(texts) // bench_online.BATCH_INPUTS)
    argv = ["--scenarios", "batched", "--batched-clients", str(args.http_clients)]
    argv += ["--n", str(num_requests), "--device", args.device, "--dtype", dtype]
    argv += ["--repeats", str(args.http_repeats or args.repeats), "--client", args.http_client]
    if args.http_client_processes:
        argv += ["--client-processes", str(args.http_client_processes)]
    online_args = bench_online.parse_args(argv)
    online_args.server_args = args.server_args
    online: dict[str, Any] = {"rows": [], "_passages": texts, "_passage_lengths": lengths}
    with tempfile.TemporaryDirectory(prefix="vecpool-http-") as tmp:
        bench_online.serve_and_run(
            folder,
            lambda engine: bench_online.embed_scenarios(engine, [], online_args, online),
            online_args,
            Path(tmp) / "server.log",
            online,
        )
    rows = []
    for row in online["rows"]:
        row = {"model": name, "workload": "passages", **row}
        row["inputs_per_request"] = bench_online.BATCH_INPUTS
        command = online["server_commands"][0][2:]  # `vecpool serve MODEL ...`
        row["server_command"] = [*command[:2], name, *command[3:]]
        rows.append(row)
    return rows


def _fidelity(
    folder: Path,
    args: argparse.Namespace,
    inputs: dict[str, tuple[list[str], list[list[int]], np.ndarray]],
    outputs: dict[str, dict[str, np.ndarray]],
    device: torch.device,
) -> dict[str, Any]:
    """Text ≡ ids; vecpool against sentence-transformers; vecpool against its own fp32."""
    out: dict[str, Any] = {}
    ids_out = outputs.get("vecpool-ids", {})
    for w, vec in ids_out.items():
        if w in outputs.get("vecpool-text", {}):
            out[f"{w}_text_vs_ids_max_abs"] = float(np.abs(outputs["vecpool-text"][w] - vec).max())
        for st in ("st-32", "st-128", "hf-padded"):
            if w in outputs.get(st, {}):
                out[f"{w}_vs_{st}_min_cosine"] = float(_cosines(vec, outputs[st][w]).min())
    if ids_out and args.fidelity > 0:
        import vecpool

        engine = vecpool.Engine(folder, device=str(device), dtype="float32", compile=False)
        for w, vec in ids_out.items():
            k = min(args.fidelity, len(vec))
            ref = engine.embed(inputs[w][1][:k], show_progress=False)
            out[f"{w}_vs_fp32_min_cosine"] = float(_cosines(vec[:k], ref).min())
        del engine
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from vecpool.api import default_model_path

        tokenizer_dir = default_model_path()
    report: dict[str, Any] = {
        **record.header(
            "bench_gpu.py",
            sys.argv[1:] if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        "ceiling_flops": matmul_ceiling(device),
        "fidelity": {},
        "rows": [],
        "http": [],
    }
    if args.http and "passages" not in args.workloads:
        raise SystemExit("--http serves the passages workload: keep it in --workloads")
    print(f"matmul ceiling: {report['ceiling_flops'] / 1e12:.0f} TFLOP/s", flush=True)

    def save() -> None:
        record.write(args.output, report)

    if args.model_dir is not None:
        bench_model(args.model_dir.name, args.model_dir, args, report, save)
    else:
        for name in args.models:
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                folder = write_folder(SHAPES[name], Path(tmp), tokenizer_dir, args.device)
                print(f"{name}: folder written in {time.perf_counter() - started:.0f} s")
                bench_model(name, folder, args, report, save)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
