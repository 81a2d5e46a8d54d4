"""`vecpool embed`: a file of texts or token ids into .npy or .parquet, read in chunks; with no
input, example sentences and how they compare."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from vecpool.api import Engine, EngineArgs
from vecpool.api.args import DEFAULT_MODEL_NAME
from vecpool.cli.common import CommandError
from vecpool.errors import InputError

DEFAULT_CHUNK_SIZE = 4096
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
Embed a file of texts or token ids into .npy or .parquet, reading it in chunks.
With no --input, embed a few example sentences and compare them.

input:  one text per line; or JSONL (--format jsonl, or a .jsonl file): per line a JSON
        string, or an object with a text field (--field) or "prompt_token_ids"
output: .npy, float32 [n, dim] in input order; or .parquet, columns `index` (the input's
        0-based line number), the --id-field if given, and `embedding` (list<float32>)
"""
EMBED_EXAMPLES = """\
examples:
  vecpool embed
  vecpool embed --input texts.txt --output vectors.npy
  vecpool embed MODEL_DIR --input docs.jsonl --id-field doc_id --output docs.parquet
  cat texts.txt | vecpool embed --input - --output vectors.npy --dimensions 256
"""


@dataclass
class Chunk:
    """Up to `--chunk-size` inputs read from the file, and where each one came from."""

    inputs: list[str | dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # 1-based file line of each input
    ids: list[str | int] = field(default_factory=list)  # --id-field values, when asked for
    num_lines: int = 0  # file lines consumed, skipped ones included


def add_embed_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `embed` options to `parser`."""
    EngineArgs.add_cli_args(parser)
    io = parser.add_argument_group("input and output")
    io.add_argument("-i", "--input", metavar="FILE", help="texts or JSONL to embed; - for stdin")
    io.add_argument("-o", "--output", metavar="FILE", help="the .npy or .parquet file to write")
    io.add_argument("--format", choices=("text", "jsonl"), help="default: by the file's suffix")
    io.add_argument("--field", default="text", help="JSONL text field (default: text)")
    io.add_argument("--id-field", metavar="NAME", help="JSONL field to keep as a parquet column")
    io.add_argument("--skip-empty", action="store_true", help="skip blank lines, not fail")
    io.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        metavar="N",
        help="inputs per chunk (default: %(default)s)",
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
    """`vecpool embed`: a file into .npy / .parquet or, with no --input, the examples."""
    output = _check_embed_args(args)
    source = _open_input(args.input) if args.input is not None else None
    try:
        start = time.perf_counter()
        if engine is None:
            engine = Engine.from_args(EngineArgs.from_cli_args(args))
        if source is None or output is None:
            return _show_examples(engine, args, load_seconds=time.perf_counter() - start)
        return _embed_file(engine, args, source, output)
    finally:
        if source is not None and args.input != "-":
            source.close()


def read_chunks(
    lines: Iterable[bytes],
    *,
    jsonl: bool,
    text_field: str = "text",
    id_field: str | None = None,
    skip_empty: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Iterator[Chunk]:
    """Parse raw lines into chunks of at most `chunk_size` inputs.

    A bad line raises `CommandError` naming its 1-based line number.
    """
    chunk = Chunk()
    id_kind: str | None = None  # JSON type of the first id; every id must share it
    for number, raw in enumerate(lines, start=1):
        chunk.num_lines += 1
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            item, id_value = _parse_line(text, jsonl, text_field, id_field)
            if id_value is not None:
                id_kind = id_kind or _json_type(id_value)
                if _json_type(id_value) != id_kind:
                    raise ValueError(
                        f"{id_field!r} is a {_json_type(id_value)}; earlier ids are {id_kind}s"
                    )
        except UnicodeDecodeError as exc:
            raise CommandError(f"line {number}: not UTF-8 text (byte {exc.start + 1})") from None
        except ValueError as exc:
            raise CommandError(f"line {number}: {exc}") from None
        if item is None:
            if skip_empty:
                continue
            raise CommandError(f"line {number}: blank input (--skip-empty skips these)")
        chunk.inputs.append(item)
        chunk.lines.append(number)
        if id_value is not None:
            chunk.ids.append(id_value)
        if len(chunk.inputs) == chunk_size:
            yield chunk
            chunk = Chunk()
    if chunk.num_lines:
        yield chunk


def _parse_line(
    text: str, jsonl: bool, text_field: str, id_field: str | None
) -> tuple[str | dict[str, Any] | None, str | int | None]:
    """(input, id) of one line; the input is None when the line or its text is blank."""
    if not jsonl or not text.strip():
        return (text if text.strip() else None), None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg}, column {exc.colno})") from None
    if isinstance(value, str) and id_field is None:
        return (value if value.strip() else None), None
    if not isinstance(value, dict):
        raise ValueError(
            f"expected a JSON object{'' if id_field else ' or string'}, got {_json_type(value)}"
        )
    item: str | dict[str, Any] | None
    if "prompt_token_ids" in value:
        item = {"prompt_token_ids": value["prompt_token_ids"]}
    elif isinstance(value.get(text_field), str):
        item = value[text_field] if value[text_field].strip() else None
    elif text_field in value:
        raise ValueError(f"{text_field!r} must be a string, got {_json_type(value[text_field])}")
    else:
        raise ValueError(f"the object has no {text_field!r} field (nor 'prompt_token_ids')")
    if id_field is None:
        return item, None
    id_value = value.get(id_field)
    if not isinstance(id_value, str | int) or isinstance(id_value, bool):
        raise ValueError(f"{id_field!r} must be a string or an integer, got {_json_type(id_value)}")
    return item, id_value


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")


def _check_embed_args(args: argparse.Namespace) -> Path | None:
    """Refuse inconsistent options before the model loads; return the output path."""
    if args.input is None:
        if args.output is not None:
            raise CommandError("--output needs --input (with neither, examples are shown)")
        return None
    if args.output is None:
        raise CommandError("--input needs --output FILE (.npy or .parquet)")
    output = Path(args.output)
    if output.suffix not in (".npy", ".parquet"):
        raise CommandError(f"--output {args.output!r}: the name must end in .npy or .parquet")
    if args.chunk_size < 1:
        raise CommandError(f"--chunk-size must be at least 1, got {args.chunk_size}")
    if args.id_field is not None:
        if not _is_jsonl(args) or output.suffix != ".parquet":
            raise CommandError("--id-field needs JSONL input and a .parquet output")
        if args.id_field in ("index", "embedding"):
            raise CommandError(f"--id-field {args.id_field!r} clashes with a parquet column")
    if output.suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise CommandError(
                "parquet output needs pyarrow: pip install 'vecpool[parquet]'"
            ) from None
    return output


def _is_jsonl(args: argparse.Namespace) -> bool:
    return bool(args.format == "jsonl" or (args.format is None and args.input.endswith(".jsonl")))


def _open_input(name: str) -> BinaryIO:
    if name == "-":
        return sys.stdin.buffer
    try:
        return open(name, "rb")  # closed by run_embed
    except OSError as exc:
        raise CommandError(f"cannot read {name!r}: {exc.strerror}") from None


def _embed(engine: Engine, inputs: list[Any], args: argparse.Namespace) -> np.ndarray:
    return engine.embed(
        inputs,
        dimensions=args.dimensions,
        normalize=args.normalize,
        truncate_prompt_tokens=-1 if args.truncate else None,
        prompt_name=args.prompt_name,
        show_progress=False,
    )


def _embed_file(engine: Engine, args: argparse.Namespace, source: BinaryIO, output: Path) -> int:
    start, count = time.perf_counter(), 0
    path = Path(args.input)
    counted = not args.quiet and args.input != "-" and path.is_file()
    total = _count_lines(path) if counted else None  # None: no total for pipes and stdin
    chunks = read_chunks(
        source,
        jsonl=_is_jsonl(args),
        text_field=args.field,
        id_field=args.id_field,
        skip_empty=args.skip_empty,
        chunk_size=args.chunk_size,
    )
    dim = args.dimensions or engine.output_dim
    sink = ParquetSink(output, args.id_field) if output.suffix == ".parquet" else NpySink(output)
    try:
        with tqdm(total=total, unit="line", desc="embed", disable=args.quiet) as bar:
            for chunk in chunks:
                if chunk.inputs:
                    try:
                        vectors = _embed(engine, chunk.inputs, args)
                    except InputError as exc:
                        raise CommandError(_located(exc, chunk)) from None
                    sink.write(chunk, vectors)
                    count += len(vectors)
                bar.update(chunk.num_lines)
        sink.close(dim)
    except BaseException:
        sink.discard()
        raise
    if not args.quiet:
        seconds = time.perf_counter() - start
        print(
            f"wrote {count:,} embeddings of {dim} dims to {output} in {seconds:.1f} s",
            file=sys.stderr,
        )
    return 0


def _located(exc: InputError, chunk: Chunk) -> str:
    """The engine's error, located by file line instead of by index in the chunk."""
    if exc.index is None or not 0 <= exc.index < len(chunk.lines):
        return exc.reason
    where = f"line {chunk.lines[exc.index]}" + (f" ({exc.field})" if exc.field else "")
    return f"{where}: {exc.reason}"


def _count_lines(path: Path) -> int:
    """Lines in `path`, for the progress bar's total (a fast pass over the raw bytes)."""
    count, last = 0, b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


class NpySink:
    """Collects each chunk's vectors; writes one float32 `[n, dim]` .npy file at the end."""

    def __init__(self, path: Path):
        self.path = path
        self.parts: list[np.ndarray] = []  # [chunk_inputs, dim] float32 each

    def write(self, chunk: Chunk, vectors: np.ndarray) -> None:
        self.parts.append(vectors)

    def close(self, dim: int) -> None:
        array = np.concatenate(self.parts) if self.parts else np.zeros((0, dim), np.float32)
        with self.path.open("wb") as f:
            np.save(f, array)

    def discard(self) -> None:
        self.parts.clear()  # nothing is on disk yet


class ParquetSink:
    """Writes a row group per chunk: `index` int64, the id column, `embedding` list<float32>."""

    def __init__(self, path: Path, id_field: str | None):
        self.path = path
        self.id_field = id_field
        self.writer: Any = None  # pyarrow.parquet.ParquetWriter, opened by the first chunk

    def write(self, chunk: Chunk, vectors: np.ndarray) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        n, dim = vectors.shape  # [chunk_inputs, dim] float32
        columns = {"index": pa.array(np.asarray(chunk.lines, np.int64) - 1, pa.int64())}
        if self.id_field is not None:
            columns[self.id_field] = pa.array(chunk.ids, None if chunk.ids else pa.string())
        offsets = pa.array(np.arange(0, n * dim + 1, dim, dtype=np.int32))
        values = pa.array(vectors.reshape(-1), pa.float32())
        columns["embedding"] = pa.ListArray.from_arrays(offsets, values)
        table = pa.table(columns)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema)
        self.writer.write_table(table)

    def close(self, dim: int) -> None:
        if self.writer is None:  # no input at all: still a valid, empty file
            self.write(Chunk(), np.zeros((0, dim), np.float32))
        self.writer.close()

    def discard(self) -> None:
        """Remove a partly written file, so that it cannot pass for a result."""
        if self.writer is not None:
            self.writer.close()
            self.path.unlink(missing_ok=True)


def _show_examples(engine: Engine, args: argparse.Namespace, load_seconds: float) -> int:
    """Embed the example sentences; print how paraphrases compare with unrelated pairs."""
    sentences = list(dict.fromkeys(s for pair in PARAPHRASES + UNRELATED for s in pair))
    start = time.perf_counter()
    vectors = _embed(engine, sentences, args)
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
