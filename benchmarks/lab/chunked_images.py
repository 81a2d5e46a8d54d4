"""Pages with large images in chunks under a patch budget, and what that does to short queries
that arrive while the pages are embedded.

    PYTHONPATH=. python benchmarks/lab/chunked_images.py --output chunked_images.json
    PYTHONPATH=. python benchmarks/lab/chunked_images.py --tiny   # a CPU smoke run, seconds

One engine (a GME-style embedder of Qwen2-VL-2B's shape, random weights, last-row pooling; the
image processor's `max_pixels` set so that a `--size` page is `--page-tokens` placeholders)
embeds `--pages` pages (`{"text": ..., "image": JPEG bytes}`), submitted at once, while another
thread submits a query every `--interval-ms`, alternately a short text and a small image
(`--query-size`). Three scheduler configurations of the same engine:
- `chunked`: token budget `--budget`, patch budget `--patches`; pages run in chunks, each
  image through the tower once, its rows kept between chunks;
- `alone`: the same budgets, no chunking (`max_cached_tokens=0`): a page over the token budget
  runs whole, alone in its step (as every prompt with images ran before chunking);
- `raised`: the budgets raised to a whole page (the token budget to the model's length), no
  chunking: pages fill steps.
Reported: the latency of the queries submitted while pages were running (p50, p99, max), the
pages per second (submission to the last page done), the steps, the most tokens and patch rows
of one step, and the cosine of each page's embedding against the `raised` run's.
"""

from __future__ import annotations

import argparse
import io
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

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = [f"w{i}" for i in range(500)]
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-vl-2b": {  # GME-Qwen2-VL-2B's language model and tower
        "text": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_parameters={"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        ),
        "vision": dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=1536),
        "patch": 14,
    },
    "tiny": {
        "text": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            max_position_embeddings=4096,
            rope_parameters={"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        ),
        "vision": dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64),
        "patch": 14,
    },
}


def build_folder(shape: str, path: Path, dtype: torch.dtype, page_tokens: int) -> None:
    """A Qwen2-VL folder of `shape` with random weights, an image processor whose `max_pixels`
    is `page_tokens` placeholders and a word-level tokenizer (a causal model: last-row pooling)."""
    import json

    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    spec = SHAPES[shape]
    words = [*SPECIALS, "<unk>", *WORDS]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    config = transformers.Qwen2VLConfig(
        text_config=dict(spec["text"], bos_token_id=0, eos_token_id=SPECIALS.index("<|im_end|>")),
        vision_config=dict(
            spec["vision"], patch_size=spec["patch"], spatial_merge_size=2, temporal_patch_size=2
        ),
        image_token_id=SPECIALS.index("<|image_pad|>"),
        video_token_id=SPECIALS.index("<|video_pad|>"),
        vision_start_token_id=SPECIALS.index("<|vision_start|>"),
        vision_end_token_id=SPECIALS.index("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    with torch.no_grad():  # small weights: random bf16 activations stay finite over 28 layers
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.02)
    model.save_pretrained(str(path), safe_serialization=True)
    unit = (2 * spec["patch"]) ** 2  # pixels per placeholder
    transformers.Qwen2VLImageProcessorPil(
        patch_size=spec["patch"],
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 4 * unit, "longest_edge": page_tokens * unit},
    ).save_pretrained(str(path))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def jpeg(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def text(gen: np.random.Generator, lo: int, hi: int) -> str:
    return " ".join(gen.choice(WORDS, size=int(gen.integers(lo, hi))))


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


def stream_run(
    engine: Any, pages: list[Any], queries: list[Any], interval_s: float
) -> dict[str, Any]:
    """Submit `pages` at once and `queries` one by one every `interval_s` from another thread,
    stepping the engine here, each step's tokens and patch rows recorded."""
    from vecpool.tasks import PoolingParams

    core, runner = engine.core, engine.model_runner
    done_at: dict[str, float] = {}
    sizes: list[tuple[int, int]] = []  # (tokens, patch rows) of each step
    prepare = runner.prepare

    def recorded(step: Any) -> Any:
        sizes.append((step.num_batched_tokens, step.num_batched_patches))
        return prepare(step)

    runner.prepare = recorded

    def on_done(request: Any) -> None:
        done_at[request.request_id] = time.perf_counter()

    def submit(inputs: list[Any]) -> list[Any]:
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
    page_requests = submit(pages)
    feeder = threading.Thread(target=feed, name="queries")
    feeder.start()
    try:
        while True:
            if all(r.is_done for r in page_requests):
                stop.set()
            if core.has_work():
                core.step()
            elif stop.is_set() and not feeder.is_alive():
                if not core.has_work():
                    break
            else:
                time.sleep(0.0002)
    finally:
        feeder.join()
        runner.prepare = prepare
    pages_done = max(done_at[r.request_id] for r in page_requests)
    failed = [str(r.error) for r in page_requests if r.error is not None]
    latencies = [
        done_at[r.request_id] - t for r, t in submitted if t < pages_done and r.output is not None
    ]
    return {
        "num_queries_during_pages": len(latencies),
        "query_latency_p50_s": _percentile(latencies, 50),
        "query_latency_p99_s": _percentile(latencies, 99),
        "query_latency_max_s": max(latencies, default=float("nan")),
        "page_seconds": pages_done - started,
        "pages_per_s": len(pages) / (pages_done - started),
        "steps": core.num_steps - steps_before,
        "max_step_tokens": max(t for t, _ in sizes),
        "max_step_patches": max(p for _, p in sizes),
        "errors": failed,
        "outputs": None if failed else np.stack([r.output for r in page_requests]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape: a CPU smoke run")
    parser.add_argument("--pages", type=int, default=None, help="default: 32 (tiny: 4)")
    parser.add_argument("--page-tokens", type=int, default=None, help="default: 4096 (tiny: 256)")
    parser.add_argument("--size", default="1600x1200", help="page width x height in pixels")
    parser.add_argument("--query-size", default="224x224", help="an image query's size")
    parser.add_argument("--queries", type=int, default=None, help="default: 200 (tiny: 16)")
    parser.add_argument("--interval-ms", type=float, default=None, help="default: 10 (tiny: 5)")
    parser.add_argument("--budget", type=int, default=None, help="default: 2048 (tiny: 64)")
    parser.add_argument("--patches", type=int, default=None, help="default: 16384 (tiny: 1024)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--output", default=None)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    tiny = args.tiny
    pages_n = args.pages or (4 if tiny else 32)
    page_tokens = args.page_tokens or (256 if tiny else 4096)
    budget = args.budget or (64 if tiny else 2048)
    patches = args.patches or (1024 if tiny else 16384)
    num_queries = args.queries or (16 if tiny else 200)
    interval = (args.interval_ms or (5.0 if tiny else 10.0)) / 1000
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)

    import vecpool
    from vecpool.config import SchedulerConfig
    from vecpool.engine.scheduler import Scheduler

    gen = np.random.default_rng(0)
    width, height = (int(v) for v in args.size.split("x"))
    qw, qh = (int(v) for v in args.query_size.split("x"))
    pages = [
        {"text": text(gen, 8, 32), "image": jpeg(width, height, seed=i)} for i in range(pages_n)
    ]
    queries: list[Any] = [
        text(gen, 4, 16) if i % 2 else {"text": text(gen, 2, 8), "image": jpeg(qw, qh, 1000 + i)}
        for i in range(num_queries)
    ]
    report: dict[str, Any] = record.header(
        "lab/chunked_images.py", argv, device=args.device, commit=args.commit
    )
    report.update(shape="tiny" if tiny else "qwen2-vl-2b", dtype=dtype_name, budget=budget)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build_folder("tiny" if tiny else "qwen2-vl-2b", folder, dtype, page_tokens)
        engine = vecpool.Engine(folder, device=args.device, dtype=dtype_name)
        reader = engine.inputs.images
        assert reader is not None
        (page_pixels,) = reader.read_many([(0, pages[0]["image"])])
        if isinstance(page_pixels, Exception):
            raise page_pixels
        report["page_patches"] = page_pixels.num_patches
        seqs = engine.scheduler_config.max_num_seqs
        length = engine.max_model_len
        configs = {
            "chunked": SchedulerConfig(budget, seqs, length, max_num_batched_patches=patches),
            "alone": SchedulerConfig(budget, seqs, 0, max_num_batched_patches=patches),
            "raised": SchedulerConfig(
                max(budget, length), seqs, 0, max_num_batched_patches=max(patches, 4 * length)
            ),
        }
        for config in configs.values():  # warm every configuration's shapes
            engine.core.scheduler = Scheduler(config)
            engine.embed([pages[0], *queries[:4]], show_progress=False)
        results: dict[str, Any] = {}
        for name, config in configs.items():
            engine.core.scheduler = Scheduler(config)
            runs = [stream_run(engine, pages, queries, interval) for _ in range(args.rounds)]
            results[name] = runs
        reference = results["raised"][0]["outputs"]
        for name, runs in results.items():
            for run in runs:
                outputs = run.pop("outputs")
                if outputs is not None and reference is not None:
                    a, b = outputs.astype(np.float64), reference.astype(np.float64)
                    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
                    run["page_cosine_to_raised_min"] = float(cos.min())
            last = runs[-1]
            print(
                f"{name:8} queries p50 {1e3 * last['query_latency_p50_s']:8.1f} ms, p99 "
                f"{1e3 * last['query_latency_p99_s']:8.1f} ms, max "
                f"{1e3 * last['query_latency_max_s']:8.1f} ms ({last['num_queries_during_pages']} "
                f"during pages); pages {last['pages_per_s']:6.2f}/s; {last['steps']} steps, at "
                f"most {last['max_step_tokens']} tokens and {last['max_step_patches']} patch rows",
                flush=True,
            )
        report["stream"] = results
    if args.output:
        record.write(Path(args.output), report)
    return report


if __name__ == "__main__":
    main()
