"""The output of `vecpool embed`: resumable while it is written, atomic when it is done.

While a run works, its results live in a work folder beside the output, `OUTPUT.partial/`:

    manifest.json        the input's identity (path, size, mtime) and every option that
                         changes the vectors; a resumed run must match it, or it is refused
    part-000000.npy      one file per chunk, in the output's format (.npy, .parquet, .jsonl),
    part-000000.json     committed by its record: rows, where the chunk ended in the input,
                         tokens. A part without its record does not exist.

Every file is written to a `.tmp` name, flushed to disk, then renamed, and the folder is synced:
a run killed at any moment leaves whole parts and at most a stray `.tmp` (ignored, removed on
resume). Parts are written in input order, so the committed ones are always a prefix of the
input and a resumed run starts where the last one ended. At the end the parts are merged into a
temporary file inside the work folder, which is renamed over the output path (one `os.replace`)
before the work folder is removed: the output path holds either nothing (or the old file) or
the whole result, never a part of it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from vecpool.cli.common import CommandError
from vecpool.cli.corpus import Chunk, Position

OUTPUT_SUFFIXES = (".npy", ".parquet", ".jsonl")


def work_folder_of(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def index_path_of(output: Path) -> Path:
    """Where a .npy output keeps the 0-based line numbers of its rows (with --skip-empty)."""
    return output.with_name(output.stem + ".index.npy")


def check_output(output: Path, *, overwrite: bool, with_index: bool) -> None:
    """Refuse an output path that cannot be written, before anything is loaded or read."""
    if output.suffix not in OUTPUT_SUFFIXES:
        raise CommandError(
            f"--output {str(output)!r}: the name must end in .npy, .parquet or .jsonl"
        )
    parent = output.parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise CommandError(f"--output {str(output)!r}: the folder {str(parent)!r} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CommandError(f"--output {str(output)!r}: the folder {str(parent)!r} is not writable")
    # A .npy output's index, written or not, is the output's too: an earlier run's would
    # misdescribe these vectors (it is removed when they come without one).
    targets = [output, index_path_of(output)] if output.suffix == ".npy" else [output]
    for target in targets:
        if target.is_dir():
            raise CommandError(f"--output {str(target)!r} is a directory")
        if target.exists() and not overwrite:
            raise CommandError(f"{str(target)!r} exists (--overwrite replaces it)")


@dataclass(frozen=True)
class PartRecord:
    """A committed part: its rows, the input position after it, and the tokens it embedded."""

    number: int
    rows: int
    lines: int  # Position.lines after the part
    offset: int  # Position.offset after the part
    tokens: int
    # JSONL --id-field: the JSON type of the part's ids ("integer" or "string"), which every
    # later id must share, resumed or not; None: the part has no ids.
    id_kind: str | None = None

    @property
    def end(self) -> Position:
        return Position(self.lines, self.offset)


class WorkFolder:
    """`OUTPUT.partial/`: the manifest and the committed parts of one run (see the module)."""

    def __init__(self, output: Path, manifest: dict[str, Any], id_field: str | None):
        self.output = output
        self.path = work_folder_of(output)
        self.manifest = manifest
        self.format = _FORMATS[output.suffix](id_field, with_index=bool(manifest["skip_empty"]))
        self.parts: list[PartRecord] = []

    @classmethod
    def open(
        cls, output: Path, manifest: dict[str, Any], *, id_field: str | None, restart: bool
    ) -> WorkFolder:
        """The work folder of `output`: resumed when one of the same input and options exists,
        created otherwise. Raises `CommandError` for one that belongs to another run."""
        work = cls(output, manifest, id_field)
        if work.path.exists() and restart:
            shutil.rmtree(work.path)
        if work.path.exists():
            work._resume()
            return work
        try:
            work.path.mkdir()
        except OSError as exc:
            raise CommandError(f"cannot create {str(work.path)!r}: {exc.strerror}") from None
        _write_atomic(
            work.path / "manifest.json", lambda f: f.write(json.dumps(manifest, indent=1).encode())
        )
        _sync_dir(work.path.parent)
        return work

    def _resume(self) -> None:
        where = str(self.path)
        try:
            found = json.loads((self.path / "manifest.json").read_text())
        except (OSError, ValueError):
            raise CommandError(
                f"{where!r} is not the work folder of an interrupted run (no readable "
                "manifest.json); remove it, or pass --restart"
            ) from None
        if found.get("input", {}).get("path") == "-":
            raise CommandError(
                f"{where!r} holds an interrupted run that read standard input, which cannot be "
                "resumed; pass --restart to start over"
            )
        for key in sorted(set(found) | set(self.manifest)):
            if found.get(key) != self.manifest.get(key):
                raise CommandError(
                    f"{where!r} holds an interrupted run of a different {_describe(key)} "
                    f"(was {found.get(key)!r}, now {self.manifest.get(key)!r}); run the same "
                    "command on the same input to resume it, or pass --restart to start over"
                )
        number = 0
        while (record := self.path / f"part-{number:06d}.json").exists():
            try:
                values = json.loads(record.read_text())
                part = PartRecord(number=number, **values)
            except (ValueError, TypeError):
                break  # cannot happen with atomic commits; redo from here if it does
            if not all(p.exists() for p in self.format.files(self._base(number))):
                break
            self.parts.append(part)
            number += 1
        for stray in self.path.iterdir():  # uncommitted parts and temporary files
            uncommitted = stray.name.startswith("part-") and not self._committed(stray.name)
            if uncommitted or stray.name.endswith(".tmp"):
                stray.unlink()

    def _committed(self, name: str) -> bool:
        number = name.removeprefix("part-").split(".", 1)[0]
        return number.isdigit() and int(number) < len(self.parts)

    @property
    def resume_from(self) -> Position:
        return self.parts[-1].end if self.parts else Position()

    @property
    def id_kind(self) -> str | None:
        """The JSON type of the ids the committed parts hold (None: none holds ids)."""
        return next((part.id_kind for part in self.parts if part.id_kind), None)

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    def _base(self, number: int) -> Path:
        return self.path / f"part-{number:06d}"

    def add_part(self, chunk: Chunk, vectors: np.ndarray, tokens: int) -> None:
        """Commit one chunk's vectors (`[rows, dim]` float32): data first, then its record."""
        number = len(self.parts)
        base = self._base(number)
        self.format.write_part(base, chunk, vectors)
        kind = None if not chunk.ids else "string" if isinstance(chunk.ids[0], str) else "integer"
        part = PartRecord(number, len(vectors), chunk.end.lines, chunk.end.offset, tokens, kind)
        values = {k: v for k, v in asdict(part).items() if k != "number"}
        _write_atomic(base.with_suffix(".json"), lambda f: f.write(json.dumps(values).encode()))
        _sync_dir(self.path)
        self.parts.append(part)

    def finish(self, dim: int) -> None:
        """Merge the parts into the output (atomically), then remove the work folder."""
        bases = [self._base(part.number) for part in self.parts]
        self.format.merge(bases, self.rows, dim, self.output, self.path)
        _sync_dir(self.output.parent)
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _describe(key: str) -> str:
    """How the manifest's `key` reads in a message: the input, or the option's flag."""
    if key == "input":
        return "input file (path, size or modification time)"
    return "output format" if key == "output" else f"--{key.replace('_', '-')}"


def _write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write `path` through `PATH.tmp`: flushed to disk, then renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_dir(path: Path) -> None:
    """Make the renames in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp_name: str, work: Path, target: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Write a finished file in the work folder, then move it onto `target` in one rename."""
    tmp = work / tmp_name
    _write_atomic(tmp, write)
    os.replace(tmp, target)


class _NpyFormat:
    """Parts `.npy` `[rows, dim]` float32 (and `.index.npy` int64 line numbers with
    --skip-empty); merged into one `.npy` (and `OUTPUT.index.npy`) by streaming the parts."""

    def __init__(self, id_field: str | None, *, with_index: bool):
        self.with_index = with_index

    def files(self, base: Path) -> list[Path]:
        vectors = base.with_suffix(".npy")
        return [vectors, base.with_suffix(".index.npy")] if self.with_index else [vectors]

    def write_part(self, base: Path, chunk: Chunk, vectors: np.ndarray) -> None:
        paths = self.files(base)
        _write_atomic(paths[0], lambda f: np.save(f, vectors))
        if self.with_index:
            index = np.asarray(chunk.lines, np.int64) - 1
            _write_atomic(paths[1], lambda f: np.save(f, index))

    def merge(self, bases: list[Path], rows: int, dim: int, output: Path, work: Path) -> None:
        def concat(suffix: str, dtype: str, shape: tuple[int, ...]) -> Callable[[BinaryIO], None]:
            def write(f: BinaryIO) -> None:
                header = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
                np.lib.format.write_array_header_1_0(f, header)
                for base in bases:
                    part = np.load(base.with_suffix(suffix))
                    f.write(np.ascontiguousarray(part, dtype).tobytes())

            return write

        if self.with_index:  # first, so that the vectors' appearance means both are there
            _install(
                "merged.index.tmp",
                work,
                index_path_of(output),
                concat(".index.npy", "<i8", (rows,)),
            )
        else:  # an earlier output's (replaced with --overwrite): not these vectors' index
            index_path_of(output).unlink(missing_ok=True)
        _install("merged.tmp", work, output, concat(".npy", "<f4", (rows, dim)))


class _ParquetFormat:
    """Parts `.parquet` with columns `index` int64, the --id-field, `embedding` list<float32>;
    merged into one file, a row group per part."""

    def __init__(self, id_field: str | None, *, with_index: bool):
        self.id_field = id_field

    def files(self, base: Path) -> list[Path]:
        return [base.with_suffix(".parquet")]

    def table(self, chunk: Chunk, vectors: np.ndarray) -> Any:
        import pyarrow as pa

        n, dim = vectors.shape  # [rows, dim] float32
        columns = {"index": pa.array(np.asarray(chunk.lines, np.int64) - 1, pa.int64())}
        if self.id_field is not None:
            columns[self.id_field] = pa.array(chunk.ids, None if chunk.ids else pa.string())
        offsets = pa.array(np.arange(0, n * dim + 1, dim, dtype=np.int32))
        values = pa.array(vectors.reshape(-1), pa.float32())
        columns["embedding"] = pa.ListArray.from_arrays(offsets, values)
        return pa.table(columns)

    def write_part(self, base: Path, chunk: Chunk, vectors: np.ndarray) -> None:
        import pyarrow.parquet as pq

        table = self.table(chunk, vectors)
        _write_atomic(base.with_suffix(".parquet"), lambda f: pq.write_table(table, f))

    def merge(self, bases: list[Path], rows: int, dim: int, output: Path, work: Path) -> None:
        import pyarrow.parquet as pq

        tables = (pq.read_table(base.with_suffix(".parquet")) for base in bases)

        def write(f: BinaryIO) -> None:
            writer = None
            for table in tables:
                if table.num_rows == 0:
                    continue  # a chunk of skipped lines only; its id column has no type
                if writer is None:
                    writer = pq.ParquetWriter(f, table.schema)
                writer.write_table(table.cast(writer.schema))
            if writer is None:  # no rows at all: still a valid, empty file
                writer = pq.ParquetWriter(f, self.table(Chunk(), np.zeros((0, dim))).schema)
            writer.close()

        _install("merged.tmp", work, output, write)


class _JsonlFormat:
    """Parts `.jsonl`, a line per row: {"index": ..., ID_FIELD: ..., "embedding": [...]};
    merged by concatenation."""

    def __init__(self, id_field: str | None, *, with_index: bool):
        self.id_field = id_field

    def files(self, base: Path) -> list[Path]:
        return [base.with_suffix(".jsonl")]

    def write_part(self, base: Path, chunk: Chunk, vectors: np.ndarray) -> None:
        lines = []
        for i, (line, vector) in enumerate(zip(chunk.lines, vectors.tolist(), strict=True)):
            row: dict[str, Any] = {"index": line - 1}
            if self.id_field is not None:
                row[self.id_field] = chunk.ids[i]
            row["embedding"] = vector
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        data = "".join(lines).encode()
        _write_atomic(base.with_suffix(".jsonl"), lambda f: f.write(data))

    def merge(self, bases: list[Path], rows: int, dim: int, output: Path, work: Path) -> None:
        def write(f: BinaryIO) -> None:
            for base in bases:
                with base.with_suffix(".jsonl").open("rb") as part:
                    shutil.copyfileobj(part, f)

        _install("merged.tmp", work, output, write)


_FORMATS: dict[str, Any] = {".npy": _NpyFormat, ".parquet": _ParquetFormat, ".jsonl": _JsonlFormat}
