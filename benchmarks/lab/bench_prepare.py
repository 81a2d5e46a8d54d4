"""The host side of a call, without the model: what preparing inputs costs per input, from text
and from token ids, beside what the tokenizer alone costs.

    PYTHONPATH=. python benchmarks/lab/bench_prepare.py --output benchmarks/results/prepare_minilm_2core.json
    PYTHONPATH=. python benchmarks/lab/bench_prepare.py --shape minilm --tokenizer devtok

The workloads are `bench_gpu.py`'s (`workloads.py`: 4,096 queries of U[8, 64] tokens, 4,096
passages of lognormal(ln 180, 0.6) tokens clipped to [32, 512]), clipped here to the model's
limit (256 for the packaged all-MiniLM-L6-v2), so that text and ids make the same prompts, and
embedded as `bench_gpu.py` embeds them (`truncate_prompt_tokens=-1`). The call is prepared as `Engine.embed` prepares a large call: in
chunks of `PIPELINE_CHUNK` inputs. The model folder is the packaged MiniLM (`--model-dir` for
another, or `--shape` for a random-weight folder of a `workloads.SHAPES` shape with the
tokenizer files of `--tokenizer`); an engine on the CPU is built only for its `CallContext`.

`--pairs` adds a workload "pairs": text pairs as a cross-encoder's rerank call sends them, the
queries workload's texts each with the passages workload's text of the same index; timed
through the input stage (`InputProcessor.process`, truncating to the model's limit, longest
text first), as `text` and `text_library` below, with `tokenizer_fast` of the pairs beside them
(pairs have no ids form).

`--corpus FILE...` adds a workload "prose": the files' paragraphs (split at blank lines, each
one line, those of at least 200 characters), cycled to `--n` inputs; its ids are the
`tokenizers` library's of those texts, cut to the model's limit. The other workloads' texts are
runs of whole vocabulary words; prose has words that WordPiece takes apart, and characters
outside ASCII.

Timed per round, each over the whole workload (per input, microseconds):
- `text`: `calls.prepare_encode` of the texts (tokenize, truncate, validate, requests);
- `text_library`: the same with `vecpool.inputs.wordpiece`'s array path switched off (every batch to
  the `tokenizers` library, as before that path): the baseline of `text`, in the same rounds;
- `ids`: the same of the token ids;
- `ids_numpy`: the same with each id list converted by numpy (`arrays.PACK_ID_LISTS` off, as
  before the lists were packed): the baseline of `ids`, in the same rounds;
- `submit`: `Engine.submit` of the text path's prepared requests (engine `Request`s);
- `tokenizer`: the `tokenizers` library's `encode_batch` alone, on a tokenizer truncating as
  the engine's does;
- `tokenizer_fast`: the same with `encode_batch_fast` (no character offsets), where the
  installed library has it (else `encode_batch` again): the floor of the text path;
- `text_python` = `text` - `tokenizer_fast` in the same round: the time the text path takes
  beyond the cheapest call that gives the ids, mostly Python that holds the GIL (a
  difference of two wall times: noisy on a shared host);
- `*_thread_cpu`: the CPU time of the calling thread in `text`, `ids` and the tokenizer: the
  time it holds the GIL (the tokenizer's own threads do not count; the conversion of their
  results into Python objects does). Steadier than a difference of two wall times on a
  shared host, and the figure that says how much of the engine thread's time a call takes;
- `text_engine_loss`, `ids_engine_loss`: the time a thread that runs Python without pause (as
  the engine thread does while it schedules and launches steps) loses while this thread
  prepares the texts or the ids: the time it would have run at its pace alone, less what it
  ran. What preparing takes from the engine thread: the GIL that the preparing thread holds,
  and the cores that the tokenizer's threads take.

Rounds alternate the systems, so that a slow moment of a shared host falls on all of them.
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vecpool
from benchmarks import record
from benchmarks.workloads import SHAPES, WORKLOADS, make_inputs, workload_lengths, write_folder
from vecpool import calls
from vecpool.api import default_model_path
from vecpool.api.running import PIPELINE_CHUNK
from vecpool.inputs import arrays
from vecpool.inputs import tokenizer as tokenizer_module
from vecpool.inputs.prompts import TextOptions

FIGURES = (
    "text",
    "text_thread_cpu",
    "text_library",
    "text_library_thread_cpu",
    "ids",
    "ids_thread_cpu",
    "ids_numpy",
    "ids_numpy_thread_cpu",
    "submit",
    "tokenizer",
    "tokenizer_thread_cpu",
    "tokenizer_fast",
    "tokenizer_fast_thread_cpu",
    "text_python",
)
LOSSES = (
    "text_engine_loss",
    "text_library_engine_loss",
    "ids_engine_loss",
    "ids_numpy_engine_loss",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="a random-weight folder of this shape instead"
    )
    parser.add_argument("--tokenizer", type=Path, help="the --shape folder's tokenizer files")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--corpus", nargs="+", type=Path, help="text files: the prose workload")
    parser.add_argument("--pairs", action="store_true", help="add the text pairs workload")
    parser.add_argument("--n", type=int, default=4096, help="inputs per workload")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (at least 3)")
    parser.add_argument(
        "--spin-alone", type=float, default=0.3, help="seconds the spinning thread runs alone"
    )
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < record.MIN_ROUNDS:
        parser.error("--rounds must be at least 3 (the median of 3 or more)")
    if args.shape is not None and args.model_dir is not None:
        parser.error("--shape and --model-dir exclude each other")
    return args


@contextmanager
def library_only() -> Iterator[None]:
    """Every batch to the `tokenizers` library while inside: `vecpool.inputs.wordpiece`'s array
    path off (the baseline of `text`)."""
    threshold = tokenizer_module.WORDPIECE_MIN_CHARS
    tokenizer_module.WORDPIECE_MIN_CHARS = sys.maxsize
    try:
        yield
    finally:
        tokenizer_module.WORDPIECE_MIN_CHARS = threshold


@contextmanager
def numpy_ids() -> Iterator[None]:
    """Id lists converted by numpy while inside (the baseline of `ids`)."""
    packed = arrays.PACK_ID_LISTS
    arrays.PACK_ID_LISTS = False
    try:
        yield
    finally:
        arrays.PACK_ID_LISTS = packed


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Seconds of `fn()`: wall, and CPU of the calling thread (the tokenizer's own threads
    are not counted there: what is left is Python, holding the GIL, and the conversion of the
    tokenizer's results into Python objects, which holds it too)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _spin(stop: threading.Event, loops: list[int]) -> None:
    count = 0
    while not stop.is_set():
        sum(range(100))  # a few microseconds of Python, the GIL held
        count += 1
    loops.append(count)


def _spin_beside(fn: Callable[[], object] | None, alone: float = 0.3) -> tuple[int, float]:
    """Loops of a thread spinning in Python while `fn()` runs on this one, and the seconds
    it spun (with `fn` None: for `alone` seconds beside nothing)."""
    stop, loops = threading.Event(), list[int]()
    spinner = threading.Thread(target=_spin, args=(stop, loops))
    started = time.perf_counter()
    spinner.start()
    if fn is None:
        time.sleep(alone)
    else:
        fn()
    stop.set()
    spinner.join()
    return loops[0], time.perf_counter() - started


def measure(
    engine: vecpool.Engine,
    texts: list[str],
    ids: list[list[int]],
    rounds: int,
    spin_alone: float,
) -> Any:
    """Every figure's rounds (microseconds per input) on one workload."""
    ctx = engine.context
    n = len(texts)
    starts = range(0, n, PIPELINE_CHUNK)
    options = calls.EncodeOptions(task="embed", truncate_prompt_tokens=-1)
    # The tokenizer alone: the library's own, truncating to the model's limit as the engine's.
    assert ctx.info.tokenizer_file is not None
    floor = tokenizers.Tokenizer.from_file(ctx.info.tokenizer_file)
    floor.no_padding()
    floor.enable_truncation(ctx.info.max_model_len)

    def prepare(items: list[Any]) -> list[Any]:
        return [calls.prepare_encode(ctx, items[s : s + PIPELINE_CHUNK], options) for s in starts]

    def prepare_library(items: list[Any]) -> list[Any]:
        """`prepare` with every batch tokenized by the library."""
        with library_only():
            return prepare(items)

    def prepare_numpy(items: list[Any]) -> list[Any]:
        """`prepare` with each id list converted by numpy."""
        with numpy_ids():
            return prepare(items)

    def tokenize(fast: bool) -> Callable[[], object]:
        encode = getattr(floor, "encode_batch_fast", None) if fast else None
        encode = encode or floor.encode_batch
        return lambda: [encode(texts[s : s + PIPELINE_CHUNK]) for s in starts]

    prepared = prepare(texts)
    # The paths make the same prompts (the workload's texts are their ids).
    for other in (prepare(ids), prepare_numpy(ids), prepare_library(texts)):
        for a, b in zip(prepared, other, strict=True):
            for x, y in zip(a.requests, b.requests, strict=True):
                if not np.array_equal(x.prompt.token_ids, y.prompt.token_ids):
                    raise SystemExit("FAILED: the paths prepared different prompts")
    num_tokens = sum(r.prompt.num_tokens for call in prepared for r in call.requests)
    out: dict[str, list[float]] = {name: [] for name in FIGURES + LOSSES}
    for _ in range(rounds):
        gc.collect()
        text, text_cpu = _timed(lambda: prepare(texts))
        library, library_cpu = _timed(lambda: prepare_library(texts))
        ids_wall, ids_cpu = _timed(lambda: prepare(ids))
        numpy_wall, numpy_cpu = _timed(lambda: prepare_numpy(ids))
        submit, _ = _timed(lambda: [engine.submit(call.requests) for call in prepared])
        tok, tok_cpu = _timed(tokenize(fast=False))
        fast, fast_cpu = _timed(tokenize(fast=True))
        figures = dict(
            text=text,
            text_thread_cpu=text_cpu,
            text_library=library,
            text_library_thread_cpu=library_cpu,
            ids=ids_wall,
            ids_thread_cpu=ids_cpu,
            ids_numpy=numpy_wall,
            ids_numpy_thread_cpu=numpy_cpu,
            submit=submit,
            tokenizer=tok,
            tokenizer_thread_cpu=tok_cpu,
            tokenizer_fast=fast,
            tokenizer_fast_thread_cpu=fast_cpu,
            text_python=text - fast,
        )
        for name, seconds in figures.items():
            out[name].append(seconds / n * 1e6)
        paths: tuple[tuple[str, Callable[[list[Any]], object], list[Any]], ...] = (
            ("text_engine_loss", prepare, texts),
            ("text_library_engine_loss", prepare_library, texts),
            ("ids_engine_loss", prepare, ids),
            ("ids_numpy_engine_loss", prepare_numpy, ids),
        )
        for name, run, items in paths:
            # The pace alone, just before and just after: a shared host's pace drifts.
            before = _spin_beside(None, spin_alone)
            loops, seconds = _spin_beside(partial(run, items))
            after = _spin_beside(None, spin_alone)
            pace = (before[0] + after[0]) / (before[1] + after[1])
            out[name].append((seconds - loops / pace) / n * 1e6)
    rounds_ = {k: record.rounds(v) for k, v in out.items()}
    return {"num_inputs": n, "num_tokens": num_tokens, **rounds_}


PAIR_FIGURES = (
    "text",
    "text_thread_cpu",
    "text_library",
    "text_library_thread_cpu",
    "tokenizer_fast",
    "tokenizer_fast_thread_cpu",
)


def measure_pairs(engine: vecpool.Engine, pairs: list[tuple[str, str]], rounds: int) -> Any:
    """The pairs workload's rounds (microseconds per pair): the input stage with and without
    the array path, and the library's fastest call."""
    ctx = engine.context
    items = [{"text": a, "text_pair": b} for a, b in pairs]
    starts = range(0, len(items), PIPELINE_CHUNK)
    options = TextOptions(truncate_prompt_tokens=-1)
    assert ctx.info.tokenizer_file is not None
    floor = tokenizers.Tokenizer.from_file(ctx.info.tokenizer_file)
    floor.no_padding()
    floor.enable_truncation(ctx.info.max_model_len)
    fast = getattr(floor, "encode_batch_fast", floor.encode_batch)

    def prepare() -> list[Any]:
        return [
            p for s in starts for p in ctx.inputs.process(items[s : s + PIPELINE_CHUNK], options)
        ]

    def prepare_library() -> list[Any]:
        with library_only():
            return prepare()

    # Both paths make the same prompts: ids and segment ids.
    for a, b in zip(prepare(), prepare_library(), strict=True):
        if not (
            np.array_equal(a.token_ids, b.token_ids)
            and np.array_equal(a.token_type_ids, b.token_type_ids)
        ):
            raise SystemExit("FAILED: the paths prepared different pairs")
    out: dict[str, list[float]] = {name: [] for name in PAIR_FIGURES}
    for _ in range(rounds):
        gc.collect()
        text, text_cpu = _timed(prepare)
        library, library_cpu = _timed(prepare_library)
        tok, tok_cpu = _timed(lambda: [fast(pairs[s : s + PIPELINE_CHUNK]) for s in starts])
        figures = dict(
            text=text,
            text_thread_cpu=text_cpu,
            text_library=library,
            text_library_thread_cpu=library_cpu,
            tokenizer_fast=tok,
            tokenizer_fast_thread_cpu=tok_cpu,
        )
        for name, seconds in figures.items():
            out[name].append(seconds / len(pairs) * 1e6)
    num_tokens = sum(p.num_tokens for p in prepare())
    rounds_ = {k: record.rounds(v) for k, v in out.items()}
    return {"num_inputs": len(pairs), "num_tokens": num_tokens, **rounds_}


def run(args: argparse.Namespace, folder: Path, report: dict[str, Any]) -> None:
    engine = vecpool.Engine(folder, device="cpu")
    report["max_model_len"] = engine.info().max_model_len
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    limit = engine.info().max_model_len
    inputs: dict[str, tuple[list[str], list[list[int]]]] = {}
    for w in args.workloads:
        # Clipped to the model's limit: the same tokens from text as from ids.
        lengths = np.minimum(workload_lengths(w, args.n), engine.info().max_model_len)
        inputs[w] = make_inputs(tokenizer, lengths)
    if args.corpus:
        tokenizer.no_padding()
        tokenizer.enable_truncation(engine.info().max_model_len)
        texts = prose(args.corpus, args.n)
        inputs["prose"] = texts, [e.ids for e in tokenizer.encode_batch(texts)]
    for w, (texts, ids) in inputs.items():
        result = measure(engine, texts, ids, args.rounds, args.spin_alone)
        report["workloads"][w] = result
        medians = "  ".join(f"{k} {result[k]['median']:.2f}" for k in FIGURES + LOSSES)
        print(f"{w:8} us/input: {medians}", flush=True)
    if args.pairs:
        queries, passages = (
            make_inputs(tokenizer, np.minimum(workload_lengths(w, args.n), limit))[0]
            for w in ("queries", "passages")
        )
        result = measure_pairs(engine, list(zip(queries, passages, strict=True)), args.rounds)
        report["workloads"]["pairs"] = result
        medians = "  ".join(f"{k} {result[k]['median']:.2f}" for k in PAIR_FIGURES)
        print(f"pairs    us/input: {medians}", flush=True)


def prose(files: list[Path], n: int) -> list[str]:
    """The paragraphs of `files` of at least 200 characters, each on one line, cycled to `n`."""
    paragraphs = [
        " ".join(block.split())
        for path in files
        for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
    ]
    paragraphs = [p for p in paragraphs if len(p) >= 200]
    if not paragraphs:
        raise SystemExit("--corpus: no paragraph of 200 characters or more")
    return [paragraphs[i % len(paragraphs)] for i in range(n)]


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    report: dict[str, Any] = {
        **record.header("lab/bench_prepare.py", argv, device="cpu", commit=args.commit),
        "vecpool": getattr(vecpool, "__version__", "unknown"),
        "pipeline_chunk": PIPELINE_CHUNK,
        "unit": "microseconds per input",
        "workloads": {},
    }
    if args.shape is None:
        folder = args.model_dir or default_model_path()
        report["model"] = folder.name
        run(args, folder, report)
    else:
        report["model"] = args.shape
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer_dir = args.tokenizer or default_model_path()
            run(args, write_folder(SHAPES[args.shape], Path(tmp), tokenizer_dir, "cpu"), report)
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
