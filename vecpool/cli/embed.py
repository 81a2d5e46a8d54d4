"""`vecpool embed`: a corpus of texts, token ids or images (text lines, JSONL or Parquet) into
.npy, .parquet or .jsonl, streamed in chunks, resumable after an interruption, written
atomically; with no input, example sentences and how they compare.

Reading is in `corpus.py`, where images may come from and how they are read in `images.py`,
the work folder and the output files in `output.py`, the engines (one here, or one process
per GPU) in `parallel.py`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from vecpool.api.args import DEFAULT_MODEL_NAME, EngineArgs
from vecpool.calls import EmbedOptions
from vecpool.cli.common import CommandError
from vecpool.cli.corpus import (
    INPUT_FORMATS,
    Chunk,
    ParquetInput,
    count_lines,
    file_identity,
    input_format,
    open_lines,
    read_line_chunks,
)
from vecpool.cli.images import IMAGE_CHUNK_SIZE, ImageField, is_image_item
from vecpool.cli.output import WorkFolder, check_output
from vecpool.cli.parallel import EmbedJob, LocalEmbedder, ProcessEmbedder
from vecpool.errors import InputError

if TYPE_CHECKING:  # torch loads where a model runs
    from vecpool.api import Engine

DEFAULT_CHUNK_SIZE = 4096
# Image-reading threads per engine process by default, at most: part of reading a JPEG holds
# the GIL (Pillow's and the loader's Python), so threads stop adding: on 16 cores, 640x480
# JPEGs were read at ~110 images/s by one thread, ~500-700 by 8 and no more by 16.
MAX_IMAGE_THREADS = 16
# Shown by `vecpool embed` with no --input: paraphrases should score above unrelated pairs.
PARAPHRASES = (
    ("A man is playing a guitar.", "Someone is strumming a guitar."),
    ("The cat is asleep on the windowsill.", "A kitten naps by the window."),
    ("How do I reset my password?", "I forgot my password and need a new one."),
    ("The train to Paris was delayed by an hour.", "Our train to Paris left an hour late."),
)
UNRELATED = (
    ("A man is playing a guitar.", "The stock market fell sharply today."),
    ("The cat is asleep on the windowsill.", "How do I reset my password?"),
    ("The train to Paris was delayed by an hour.", "Fresh bread is baked here every morning."),
)
EMBED_HELP = """\
Embed a corpus of texts, token ids or images, streamed in chunks (memory holds a few chunks,
not the corpus). With no --input, embed a few example sentences and compare them.

input:  one text per line; JSONL (--format jsonl, or a .jsonl file): per line a JSON string,
        or an object with a text field (--field) or "prompt_token_ids"; or Parquet (a
        .parquet file): a string column (--field) or a list<int> "prompt_token_ids" column
images: with --image-field NAME (a CLIP or SigLIP model), the JSONL field or Parquet column
        NAME holds an image per line (row): a path, an http(s) URL (--allowed-media-domains),
        a data: URI, base64, or (Parquet) binary bytes; lines with the text field instead
        are texts. Local files only under the input file's folder, or the folder
        --allowed-local-media-path names instead; relative paths from the input's folder
output: .npy, float32 [n, dim] in input order (with --skip-empty, NAME.index.npy beside NAME.npy
        holds each row's 0-based line); .parquet, columns `index` (the input's 0-based line
        or row), the --id-field if given, and `embedding` (list<float32>); or .jsonl, one
        object per row with the same fields

resuming: results are committed chunk by chunk to OUTPUT.partial/; run the same command again
after an interruption (Ctrl-C, SIGTERM, SIGKILL, a crash) and it goes on from the last whole
chunk. The output appears only when complete, in one rename; an existing one is replaced only
with --overwrite, and only by a finished run.
"""
EMBED_EXAMPLES = """\
examples:
  vecpool embed
  vecpool embed --input texts.txt --output vectors.npy
  vecpool embed MODEL_DIR --input docs.jsonl --id-field doc_id --output docs.parquet
  vecpool embed --input corpus.parquet --field body --output vectors.parquet \\
      --data-parallel-size 2 --dtype bfloat16
  cat texts.txt | vecpool embed --input - --output vectors.npy --dimensions 256
  vecpool embed CLIP_DIR --input photos.jsonl --image-field image --output photos.parquet
"""


def add_embed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `embed` options to `parser`."""
    EngineArgs.add_cli_args(parser)
    io = parser.add_argument_group("input and output")
    io.add_argument(
        "-i", "--input", metavar="FILE", help="text, JSONL or Parquet to embed; - for stdin"
    )
    io.add_argument("-o", "--output", metavar="FILE", help="the .npy, .parquet or .jsonl to write")
    io.add_argument("--format", choices=INPUT_FORMATS, help="input format (default: by suffix)")
    io.add_argument("--field", help="JSONL field or Parquet column of the text (default: text)")
    io.add_argument(
        "--image-field",
        metavar="NAME",
        help="JSONL field or Parquet column of images (paths, URLs, data: URIs, base64, bytes)",
    )
    io.add_argument("--id-field", metavar="NAME", help="JSONL field or Parquet column to keep")
    io.add_argument("--skip-empty", action="store_true", help="skip blank inputs, not fail")
    io.add_argument(
        "--chunk-size",
        type=int,
        metavar="N",
        help="lines (rows) per chunk, the unit of work and of resuming (default: "
        f"{DEFAULT_CHUNK_SIZE}; {IMAGE_CHUNK_SIZE} with --image-field)",
    )
    io.add_argument(
        "--image-threads",
        type=int,
        metavar="N",
        help="threads that load and preprocess images, per engine process (default: the CPU "
        f"cores shared among --data-parallel-size processes, at most {MAX_IMAGE_THREADS})",
    )
    io.add_argument("--overwrite", action="store_true", help="replace an existing output")
    io.add_argument(
        "--restart",
        action="store_true",
        help="discard an interrupted run's OUTPUT.partial/ instead of resuming it",
    )
    io.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    emb = parser.add_argument_group("embedding")
    emb.add_argument("--dimensions", type=int, metavar="D", help="keep the first D dimensions")
    emb.add_argument("--prompt-name", metavar="NAME", help="prefix the model's prompt NAME")
    emb.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cut inputs over the model's limit (default), or fail",
    )


def run_embed(args: argparse.Namespace, engine: Engine | None) -> int:
    """`vecpool embed`: a corpus into .npy / .parquet / .jsonl or, with no --input, the
    examples."""
    output = _check_embed_args(args, engine)
    if output is None:
        start = time.perf_counter()
        if engine is None:
            from vecpool.api import Engine

            engine = Engine.from_args(EngineArgs.from_cli_args(args))
        return _show_examples(engine, args, load_seconds=time.perf_counter() - start)
    return _embed_corpus(args, engine, output)


def _check_embed_args(args: argparse.Namespace, engine: Engine | None) -> Path | None:
    """Refuse inconsistent options and unusable paths before the model loads; return the
    output path (None: show the examples)."""
    if args.input is None:
        if args.output is not None:
            raise CommandError("--output needs --input (with neither, examples are shown)")
        if args.data_parallel_size != 1:
            raise CommandError("--data-parallel-size needs --input (the examples run one engine)")
        return None
    if args.output is None:
        raise CommandError("--input needs --output FILE (.npy, .parquet or .jsonl)")
    output = Path(args.output)
    check_output(
        output, overwrite=args.overwrite, with_index=args.skip_empty and output.suffix == ".npy"
    )
    if args.input != "-" and output.exists() and os.path.samefile(args.input, output):
        raise CommandError(f"--output {str(output)!r} is the input file")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CommandError(f"--chunk-size must be at least 1, got {args.chunk_size}")
    if args.image_threads is not None and args.image_threads < 1:
        raise CommandError(f"--image-threads must be at least 1, got {args.image_threads}")
    if args.data_parallel_size < 1:
        raise CommandError(
            f"--data-parallel-size must be at least 1, got {args.data_parallel_size}"
        )
    if args.data_parallel_size > 1 and engine is not None:
        raise CommandError("--data-parallel-size loads its own engines; none may be given")
    fmt = input_format(args.input, args.format)
    if args.image_field is not None:
        if fmt == "text":
            raise CommandError("--image-field needs JSONL or Parquet input (a field per line)")
        if args.image_field == text_field(args):
            raise CommandError(
                f"--image-field and --field name the same field {args.image_field!r}"
            )
    elif args.image_threads is not None:
        raise CommandError("--image-threads needs --image-field (the images to read)")
    if args.id_field is not None:
        if fmt == "text" or output.suffix == ".npy":
            raise CommandError(
                "--id-field needs JSONL or Parquet input and a .parquet or .jsonl output"
            )
        if args.id_field in ("index", "embedding"):
            raise CommandError(f"--id-field {args.id_field!r} clashes with an output column")
    if fmt == "parquet" and args.input == "-":
        raise CommandError("Parquet input must be a file, not standard input")
    if "parquet" in (fmt, output.suffix.lstrip(".")):
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise CommandError("Parquet needs pyarrow: pip install 'vecpool[parquet]'") from None
    return output


def text_field(args: argparse.Namespace) -> str:
    """The JSONL field or Parquet column of texts: --field, else "text"."""
    return args.field if args.field is not None else "text"


def chunk_size(args: argparse.Namespace) -> int:
    """Lines (rows) per chunk: --chunk-size, else the default of texts or of images."""
    if args.chunk_size is not None:
        return int(args.chunk_size)
    return IMAGE_CHUNK_SIZE if args.image_field is not None else DEFAULT_CHUNK_SIZE


def image_threads(args: argparse.Namespace) -> int:
    """Threads reading images in each engine process: --image-threads, else this process's
    cores shared among the engine processes, at most `MAX_IMAGE_THREADS`."""
    if args.image_threads is not None:
        return int(args.image_threads)
    cores = len(os.sched_getaffinity(0)) // args.data_parallel_size
    return max(1, min(MAX_IMAGE_THREADS, cores))


def _manifest(args: argparse.Namespace, engine_args: EngineArgs, fmt: str) -> dict[str, Any]:
    """What a resumed run must share with the interrupted one: the input file and every option
    that changes which rows are written or their vectors."""
    model = engine_args.model
    return {
        "version": 1,
        "input": file_identity(args.input),
        "format": fmt,
        "output": Path(args.output).suffix,
        "model": str(Path(model).resolve()) if model is not None else DEFAULT_MODEL_NAME,
        "dtype": None if engine_args.dtype is None else str(engine_args.dtype),
        "max_model_len": engine_args.max_model_len,
        "max_input_chars": engine_args.max_input_chars,
        "pooling": engine_args.pooling,
        "model_impl": engine_args.model_impl,
        "quantization": engine_args.quantization,
        "batch_invariant": engine_args.batch_invariant,
        "windowed_embed": engine_args.windowed_embed,
        "embed_window_overlap": engine_args.embed_window_overlap,
        "normalize": args.normalize,
        "dimensions": args.dimensions,
        "prompt_name": args.prompt_name,
        "truncate": args.truncate,
        "field": text_field(args),
        "image_field": args.image_field,
        "id_field": args.id_field,
        "skip_empty": args.skip_empty,
        "chunk_size": chunk_size(args),
    }


def _embed_corpus(args: argparse.Namespace, engine: Engine | None, output: Path) -> int:
    """Embed the input into `output` through its work folder, resuming an interrupted run."""
    fmt = input_format(args.input, args.format)
    engine_args = engine.args if engine is not None else EngineArgs.from_cli_args(args)
    unit = "row" if fmt == "parquet" else "line"
    images = None
    if args.image_field is not None:
        images = ImageField.from_args(args, image_threads(args))
    parquet = None
    if fmt == "parquet":
        parquet = ParquetInput(args.input, args.field, args.id_field, args.image_field)
    source = open_lines(args.input) if parquet is None else None
    work = WorkFolder.open(
        output, _manifest(args, engine_args, fmt), id_field=args.id_field, restart=args.restart
    )
    start = work.resume_from
    if work.parts and not args.quiet:
        print(
            f"vecpool embed: resuming {work.path}: {start.lines:,} {unit}s already embedded",
            file=sys.stderr,
        )
    embedder: LocalEmbedder | ProcessEmbedder | None = None
    previous_sigterm = _interrupt_on_sigterm()
    try:
        job = EmbedJob(embed_options(args, engine_args.windowed_embed), unit, images)
        if args.data_parallel_size > 1:
            embedder = ProcessEmbedder(engine_args, job, args.data_parallel_size)
        else:
            from vecpool.api import Engine

            engine = engine or Engine.from_args(engine_args)
            embedder = LocalEmbedder(engine, job)
        if parquet is not None:
            total: int | None = parquet.num_rows
            chunks = parquet.chunks(
                skip_empty=args.skip_empty, chunk_size=chunk_size(args), start=start
            )
        else:
            assert source is not None
            total = _total_lines(args)
            if start.offset:
                source.seek(start.offset)
            chunks = read_line_chunks(
                source,
                jsonl=fmt == "jsonl",
                text_field=text_field(args),
                id_field=args.id_field,
                skip_empty=args.skip_empty,
                chunk_size=chunk_size(args),
                start=start,
                id_kind=work.id_kind,
                image_field=args.image_field,
            )
        _embed_chunks(embedder, chunks, work, args, total, unit)
        work.finish(embedder.output_dim)
    except (CommandError, InputError):
        work.remove()  # the input or an option is at fault: nothing to resume
        raise
    except BaseException as exc:
        if not work.parts:
            work.remove()
        elif isinstance(exc, KeyboardInterrupt):
            print(
                f"vecpool embed: interrupted; {work.parts[-1].lines:,} {unit}s are saved in "
                f"{work.path}/: run the same command again to resume",
                file=sys.stderr,
            )
        raise
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if embedder is not None:
            embedder.close()
        if source is not None and args.input != "-":
            source.close()
    return 0


def _embed_chunks(
    embedder: LocalEmbedder | ProcessEmbedder,
    chunks: Iterator[Chunk],
    work: WorkFolder,
    args: argparse.Namespace,
    total: int | None,
    unit: str,
) -> None:
    """Embed and commit every chunk, showing lines done, inputs/s, images/s (with
    --image-field) and tokens/s."""
    start, inputs, images, tokens = time.perf_counter(), 0, 0, 0
    initial = work.resume_from.lines
    with tqdm(total=total, initial=initial, unit=unit, desc="embed", disable=args.quiet) as bar:
        for chunk, vectors, num_tokens in embedder.run(chunks):
            work.add_part(chunk, vectors, num_tokens)
            inputs += len(vectors)
            if args.image_field is not None:
                images += sum(map(is_image_item, chunk.inputs))
            tokens += num_tokens
            seconds = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(_rates(args, inputs, images, tokens, seconds), refresh=False)
            bar.update(chunk.num_lines)
    if not args.quiet:
        seconds = time.perf_counter() - start
        what = f"{inputs:,} inputs"
        if args.image_field is not None:
            what += f" ({images:,} images)"
        if tokens or args.image_field is None:
            what += f", {tokens:,} tokens"
        print(
            f"wrote {work.rows:,} embeddings of {embedder.output_dim} dims to {work.output} "
            f"({what} embedded in {seconds:.1f} s: "
            f"{_rates(args, inputs, images, tokens, max(seconds, 1e-9))})",
            file=sys.stderr,
        )


def _rates(args: argparse.Namespace, inputs: int, images: int, tokens: int, seconds: float) -> str:
    """The progress line's rates; tokens/s left out of a run of images alone."""
    rates = [f"{inputs / seconds:,.0f} inputs/s"]
    if args.image_field is not None:
        rates.append(f"{images / seconds:,.1f} images/s")
    if tokens or args.image_field is None:
        rates.append(f"{tokens / seconds:,.0f} tokens/s")
    return ", ".join(rates)


def _total_lines(args: argparse.Namespace) -> int | None:
    """The progress bar's total: the file's lines (none for standard input)."""
    path = Path(args.input)
    return count_lines(path) if not args.quiet and args.input != "-" and path.is_file() else None


def _interrupt_on_sigterm() -> Any:
    """Make SIGTERM interrupt like SIGINT (so engine processes stop and the work folder is
    reported); the previous handler, or None where signals cannot be set (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def embed_options(args: argparse.Namespace, windowed: bool = False) -> EmbedOptions:
    """The per-call options of `vecpool embed`: --dimensions, --normalize, --truncate (the
    model's limit, else an input over it fails), --prompt-name; `windowed` (the engine's
    --windowed-embed): an input over the limit is windowed, not cut."""
    return EmbedOptions(
        dimensions=args.dimensions,
        normalize=args.normalize,
        truncate_prompt_tokens=-1 if args.truncate and not windowed else None,
        prompt_name=args.prompt_name,
        windowed=windowed,
    )


def _show_examples(engine: Engine, args: argparse.Namespace, load_seconds: float) -> int:
    """Embed the example sentences; print how paraphrases compare with unrelated pairs."""
    sentences = list(dict.fromkeys(s for pair in PARAPHRASES + UNRELATED for s in pair))
    start = time.perf_counter()
    vectors = engine.embed(sentences, **embed_options(args).keywords(), show_progress=False)
    seconds = time.perf_counter() - start
    unit = dict(
        zip(sentences, vectors / np.linalg.norm(vectors, axis=1, keepdims=True), strict=True)
    )
    model = args.model or f"{DEFAULT_MODEL_NAME} (the default model)"
    normalize = engine.defaults.normalize if args.normalize is None else args.normalize
    dtype = str(engine.dtype).removeprefix("torch.")
    print("vecpool embed: no --input given, so here are some example sentences.\n")
    print(f"  model   {model}")
    print(f"  device  {engine.device}, {dtype}")
    print(f"  output  {vectors.shape[1]} dimensions, {'' if normalize else 'not '}normalized")
    print(
        f"  time    model loaded in {load_seconds:.2f} s, "
        f"{len(sentences)} sentences embedded in {seconds:.2f} s"
    )
    width = max(len(a) for a, _ in PARAPHRASES + UNRELATED)
    scores: dict[str, list[float]] = {"paraphrases": [], "unrelated": []}
    for title, pairs in (("paraphrases", PARAPHRASES), ("unrelated", UNRELATED)):
        print(f"\n  cosine  {title}")
        for a, b in pairs:
            scores[title].append(float(unit[a] @ unit[b]))
            print(f"  {scores[title][-1]:6.2f}  {a:<{width}}  | {b}")
    para, other = scores["paraphrases"], scores["unrelated"]
    verdict = "; every paraphrase pair beats every unrelated one" if min(para) > max(other) else ""
    print(
        f"\nParaphrases score {np.mean(para):.2f} on average, "
        f"unrelated pairs {np.mean(other):.2f}{verdict}."
    )
    print("\nYour own text:  vecpool embed --input texts.txt --output vectors.npy")
    print("All options:    vecpool embed --help")
    return 0
