"""Chunked prefill on a device: attention with queries shorter than keys, and what chunking does
to short queries that arrive while long prompts are embedded.

    PYTHONPATH=. python benchmarks/lab/chunked_prefill.py --output chunked_prefill.json

**attention**: `flat_attention` as the engine runs it for chunks of longer prompts (each chunk's
queries the last rows of its keys: its prompt's cached positions, then its own), against a dense
float32 reference computed per sequence with the mask written out (causal, aligned to the end of
the keys), and against the exact padded fallback on the same inputs in float32. Cases: full
causal and a sliding window; grouped-query heads as the kernel takes them (`enable_gqa` where
torch has it, else expanded), expanded by the caller, and as many key heads as query heads. On
CUDA in bfloat16 this is FlashAttention (`varlen_attn` with `cu_seq_q` != `cu_seq_k`); the
"top-left" column is the error against a mask aligned to the start of the keys instead, a
control that shows which alignment the kernel follows.

**stream**: one engine (Qwen3-0.6B shape, random weights, the sentence-transformers layout of
`bench_gpu.py`: last-token pooling, normalized) embeds `--long` prompts of `--long-tokens`
tokens, submitted at once, while another thread submits single queries of U[8, 64] tokens
every `--interval-ms`. Three scheduler configurations of the same engine (the same compiled
model): `chunked` (budget `--budget`, long prompts in chunks), `alone` (the same budget, no
chunking: a long prompt runs whole, alone in its step) and `raised` (the budget raised to the
model's length, as the engine did before chunking: a long prompt fills a step). Reported: the
latency of the queries submitted while long prompts were running (p50, p99, max), the long
prompts' tokens per second (from submission to the last one done), steps, and the cosine of
each long prompt's chunked embedding against its whole one.

`--tiny` runs the same on a tiny shape in seconds (CPU: float32, the padded fallback).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import record
from benchmarks.workloads import SHAPES, write_folder

# ---- attention --------------------------------------------------------------------------------


def dense_reference(
    q: torch.Tensor,  # [m, H, D]: the chunk's queries
    k: torch.Tensor,  # [n, KV, D]: every key of the sequence up to the chunk's end
    v: torch.Tensor,
    *,
    window: int | None,
    scale: float,
    aligned_to_end: bool = True,
) -> torch.Tensor:  # [m, H, D] float32
    """Causal attention of `m` queries over `n` keys in float32, head by head; query `i` sits at
    key position `i + n - m` (or `i`, aligned to the start: the control)."""
    m, n = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    pos = torch.arange(m, device=q.device)[:, None] + (n - m if aligned_to_end else 0)
    j = torch.arange(n, device=q.device)[None, :]
    allowed = j <= pos
    if window is not None:
        allowed &= pos - j < window
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group].float(), v[:, h // group].float()
        scores = (q[:, h].float() @ kh.T) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def _chunk_batch(spans: list[tuple[int, int, int]], device: torch.device, use_varlen: bool) -> Any:
    """The flat batch of chunks `(prompt length, start, chunk length)` and its key cache."""
    from vecpool.inputs.prompts import Prompt
    from vecpool.runner.batch import build_flat_batch
    from vecpool.runner.kv_cache import KVCache
    from vecpool.runner.step import ScheduledChunk, StepInput
    from vecpool.tasks import TASKS, PoolingParams

    chunks = [
        ScheduledChunk(
            f"r{i}",
            Prompt(token_ids=np.zeros(n, dtype=np.int64), prompt_embeds=None),
            PoolingParams(),
            TASKS["embed"],
            start,
            m,
        )
        for i, (n, start, m) in enumerate(spans)
    ]
    cache = KVCache()
    batch = build_flat_batch(
        StepInput(chunks), device, use_varlen=use_varlen, with_token_types=False, kv_cache=cache
    )
    return batch, cache


def attention_check(
    device: torch.device, dtype: torch.dtype, tiny: bool, seed: int = 0
) -> list[dict[str, Any]]:
    """Max abs errors of chunked attention on `device` in `dtype` (see the module docstring)."""
    from vecpool.models.layers.attention import flat_attention, varlen_available

    heads, kv_heads, dim = (4, 2, 16) if tiny else (16, 8, 128)
    # (prompt length, chunk start, chunk length): whole, later chunks, a first unfinished chunk,
    # one-token chunks, a chunk of one token after a long prefix.
    spans = (
        [(40, 0, 40), (90, 50, 30), (70, 64, 6), (33, 1, 32), (50, 0, 17), (65, 64, 1)]
        if tiny
        else [
            (2048, 0, 2048),
            (6000, 4000, 2000),
            (5000, 4096, 904),
            (3000, 1, 2999),
            (9000, 0, 1500),
            (9000, 8191, 1),
        ]
    )
    window = 8 if tiny else 1024
    scale = dim**-0.5
    use_varlen = varlen_available(device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for kv_mode in ("gqa", "gqa_expanded", "mha"):
        n_kv = heads if kv_mode == "mha" else kv_heads
        full = [
            (
                torch.randn(n, heads, dim, generator=gen, device=device, dtype=dtype),
                torch.randn(n, n_kv, dim, generator=gen, device=device, dtype=dtype),
                torch.randn(n, n_kv, dim, generator=gen, device=device, dtype=dtype),
            )
            for n, _, _ in spans
        ]
        if kv_mode == "gqa_expanded":  # the caller repeats each key head for its query heads
            full = [
                (q, k.repeat_interleave(heads // n_kv, 1), v.repeat_interleave(heads // n_kv, 1))
                for q, k, v in full
            ]
        for win in (None, window):
            row: dict[str, Any] = {"kv_heads": kv_mode, "window": win, "kernel": "padded"}
            outs = {}
            for path, varlen, run_dtype in (
                ("kernel", use_varlen, dtype),
                ("padded", False, torch.float32),
            ):
                batch, cache = _chunk_batch(spans, device, varlen)
                for i, ((q, k, v), (_, start, _)) in enumerate(zip(full, spans, strict=True)):
                    if start:  # what the earlier chunks left
                        keys, values = cache.buffers(f"r{i}", q.shape[0]).layer(0, k.to(run_dtype))
                        keys[:start], values[:start] = k[:start], v[:start]
                q, k, v = (
                    torch.cat([t[j][s : s + m] for t, (_, s, m) in zip(full, spans, strict=True)])
                    for j in range(3)
                )
                assert batch.attn.kv is not None
                batch.attn.kv.rewind()
                with torch.inference_mode():
                    outs[path] = flat_attention(
                        q.to(run_dtype),
                        k.to(run_dtype),
                        v.to(run_dtype),
                        batch.attn,
                        causal=True,
                        scale=scale,
                        window=win,
                    ).float()
            row["kernel"] = "varlen_attn" if use_varlen else "padded"
            errors = {"kernel": 0.0, "padded": 0.0, "top_left": 0.0}
            at = 0
            for (q, k, v), (_, start, m) in zip(full, spans, strict=True):
                qs, ks, vs = q[start : start + m], k[: start + m], v[: start + m]
                ref = dense_reference(qs, ks, vs, window=win, scale=scale)
                wrong = dense_reference(qs, ks, vs, window=win, scale=scale, aligned_to_end=False)
                for path in ("kernel", "padded"):
                    err = (outs[path][at : at + m] - ref).abs().max().item()
                    errors[path] = max(errors[path], err)
                errors["top_left"] = max(
                    errors["top_left"], (outs["kernel"][at : at + m] - wrong).abs().max().item()
                )
                at += m
            row["max_abs_err_vs_dense"] = errors["kernel"]
            row["max_abs_err_padded_fp32_vs_dense"] = errors["padded"]
            row["max_abs_err_vs_padded"] = (outs["kernel"] - outs["padded"]).abs().max().item()
            row["max_abs_err_vs_top_left_control"] = errors["top_left"]
            rows.append(row)
            print(
                f"attention {kv_mode:13} window {win!s:5} {row['kernel']:11} "
                f"err {row['max_abs_err_vs_dense']:.2e} (padded fp32 "
                f"{row['max_abs_err_padded_fp32_vs_dense']:.2e}, top-left control "
                f"{row['max_abs_err_vs_top_left_control']:.2e})",
                flush=True,
            )
    return rows


# ---- the query stream -------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def stream_run(
    engine: Any,
    longs: list[list[int]],
    queries: list[list[int]],
    interval_s: float,
) -> dict[str, Any]:
    """Submit `longs` at once and `queries` one by one every `interval_s` from another thread,
    stepping the engine here; latencies and throughput (see the module docstring)."""
    from vecpool.tasks import PoolingParams

    core = engine.core
    done_at: dict[str, float] = {}

    def on_done(request: Any) -> None:
        done_at[request.request_id] = time.perf_counter()

    def submit(inputs: list[list[int]]) -> list[Any]:
        requests = engine.make_requests(inputs, PoolingParams())
        for r in requests:
            r.add_done_callback(on_done)
        core.add_requests(requests)
        return requests

    steps_before = core.num_steps
    stop = threading.Event()
    submitted: list[tuple[Any, float]] = []

    def feed() -> None:
        for q in queries:
            if stop.is_set():
                return
            t = time.perf_counter()
            (request,) = submit([q])
            submitted.append((request, t))
            time.sleep(interval_s)

    started = time.perf_counter()
    long_requests = submit(longs)
    feeder = threading.Thread(target=feed, name="queries")
    feeder.start()
    while True:
        if all(r.is_done for r in long_requests):
            stop.set()
        if core.has_work():
            core.step()
        elif stop.is_set() and not feeder.is_alive():
            if not core.has_work():
                break
        else:
            time.sleep(0.0002)
    feeder.join()
    longs_done = max(done_at[r.request_id] for r in long_requests)
    failed = [str(r.error) for r in long_requests if r.error is not None]
    latencies = [
        done_at[r.request_id] - t for r, t in submitted if t < longs_done and r.output is not None
    ]
    return {
        "num_queries_during_longs": len(latencies),
        "query_latency_p50_s": _percentile(latencies, 50),
        "query_latency_p99_s": _percentile(latencies, 99),
        "query_latency_max_s": max(latencies, default=float("nan")),
        "long_seconds": longs_done - started,
        "long_tokens_per_s": sum(len(x) for x in longs) / (longs_done - started),
        "long_done_after_s": sorted(done_at[r.request_id] - started for r in long_requests),
        "steps": core.num_steps - steps_before,
        "errors": failed,
        "outputs": np.stack([r.output for r in long_requests if r.output is not None])
        if not failed
        else None,
    }


def _configs(args: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    from vecpool.config import SchedulerConfig

    seqs = 256 if args.tiny else 1024
    return {
        "chunked": SchedulerConfig(args.budget, seqs, max_cached_tokens=max_model_len),
        "alone": SchedulerConfig(args.budget, seqs, max_cached_tokens=0),
        "raised": SchedulerConfig(max(args.budget, max_model_len), seqs, max_cached_tokens=0),
    }


def stream_bench(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    import vecpool
    from vecpool.engine.scheduler import Scheduler

    shape = SHAPES["tiny-qwen3" if args.tiny else "qwen3-0.6b"]
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from vecpool.api import default_model_path

        tokenizer_dir = default_model_path()
    gen = np.random.default_rng(args.seed)
    vocab = shape.config["vocab_size"]
    longs = [gen.integers(1000, vocab, size=args.long_tokens).tolist() for _ in range(args.long)]
    lengths = gen.integers(8, 64, size=args.num_queries, endpoint=True)
    queries = [gen.integers(1000, vocab, size=int(n)).tolist() for n in lengths]
    out: dict[str, Any] = {"model": "tiny-qwen3" if args.tiny else "qwen3-0.6b"}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        folder = write_folder(shape, Path(tmp), tokenizer_dir, str(device))
        out["folder_seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        engine = vecpool.Engine(
            folder,
            device=str(device),
            dtype=args.dtype,
            max_model_len=args.long_tokens,
            compile=args.compile,
        )
        out["compiled"] = engine.model_runner.compiled
        out["dtype"] = str(engine.dtype).removeprefix("torch.")
        configs = _configs(args, engine.max_model_len)
        # Warm up every configuration's shapes (compiled graphs, the chunked path's breaks).
        for config in configs.values():
            engine.core.scheduler = Scheduler(config)
            engine.embed([longs[0], *queries[:8]], show_progress=False)
        out["warmup_seconds"] = time.perf_counter() - started
        results: dict[str, Any] = {}
        for name, config in configs.items():
            engine.core.scheduler = Scheduler(config)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result = stream_run(engine, longs, queries, args.interval_ms / 1000)
            result["max_num_batched_tokens"] = config.max_num_batched_tokens
            result["max_cached_tokens"] = config.max_cached_tokens
            results[name] = result
            print(
                f"stream {name:8} queries p50 {result['query_latency_p50_s'] * 1e3:8.1f} ms  "
                f"p99 {result['query_latency_p99_s'] * 1e3:8.1f} ms  "
                f"({result['num_queries_during_longs']} queries)  long prompts "
                f"{result['long_tokens_per_s']:,.0f} tok/s  steps {result['steps']}",
                flush=True,
            )
        cache = engine.model_runner.kv_cache
        out["cache_after"] = {
            "entries": None if cache is None else cache.num_entries,
            "bytes": None if cache is None else cache.num_bytes,
            "pooling_states": engine.core.pooling_runner.num_states,
        }
    chunked, whole = results["chunked"]["outputs"], results["raised"]["outputs"]
    if chunked is not None and whole is not None:
        cosines = np.sum(chunked * whole, axis=1) / (
            np.linalg.norm(chunked, axis=1) * np.linalg.norm(whole, axis=1)
        )
        out["chunked_vs_whole_cosines"] = [float(c) for c in cosines]
        out["chunked_vs_whole_min_cosine"] = float(cosines.min())
    for result in results.values():
        result.pop("outputs")
    out["configs"] = results
    return out


# ---- the run ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: seconds on a CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--long", type=int, help="long prompts (default: 4; tiny: 2)")
    parser.add_argument("--long-tokens", type=int, help="their length (default: 32768; tiny: 512)")
    parser.add_argument("--budget", type=int, help="token budget (default: 8192; tiny: 128)")
    parser.add_argument("--num-queries", type=int, help="queries at most (default: 2000)")
    parser.add_argument("--interval-ms", type=float, help="between queries (default: 5; tiny: 1)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--tokenizer", type=Path, help="default: the packaged MiniLM's folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-stream", action="store_true")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    record.add_args(parser)
    args = parser.parse_args(argv)
    tiny = args.tiny
    defaults = {
        "long": 2 if tiny else 4,
        "long_tokens": 512 if tiny else 32768,
        "budget": 128 if tiny else 8192,
        "num_queries": 200 if tiny else 2000,
        "interval_ms": 1.0 if tiny else 5.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    report: dict[str, Any] = {
        **record.header(
            "lab/chunked_prefill.py",
            sys.argv[1:] if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        "args": {
            k: record.portable_arg(str(v)) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
    }

    def save() -> None:
        report["seconds"] = time.perf_counter() - started
        record.write(args.output, report)

    if not args.skip_attention:
        try:
            report["attention"] = attention_check(device, getattr(torch, args.dtype), args.tiny)
        except Exception as exc:  # keep the other half's numbers
            report["attention_error"] = f"{type(exc).__name__}: {exc}"
            print(f"attention: FAILED {report['attention_error']}", flush=True)
        save()
    if not args.skip_stream:
        try:
            report["stream"] = stream_bench(args, device)
        except Exception as exc:
            report["stream_error"] = f"{type(exc).__name__}: {exc}"
            print(f"stream: FAILED {report['stream_error']}", flush=True)
        save()
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
