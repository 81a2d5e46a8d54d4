"""Reading a corpus for `vecpool embed`: text lines, JSONL or Parquet, as chunks of a fixed
number of lines (rows), so that a chunk's place in the input never depends on a previous run.

With `--image-field`, a JSONL field or Parquet column holds images (a path, URL, data: URI or
base64 string; in Parquet also binary bytes, or a `{bytes, path}` struct as Hugging Face
datasets store images). An image enters a chunk as `{"image": value}`, its value as read: where
it may point is decided where it is loaded (`images.py`). A line (row) holds one input: the
text field or the image field, and a file may mix the two.

A reader starts from a `Position` (where a previous run stopped: a byte offset for text, a row
for Parquet) and yields `Chunk`s; each chunk records the position after it, which is what a
resumed run starts from.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from vecpool.cli.common import CommandError

INPUT_FORMATS = ("text", "jsonl", "parquet")


@dataclass(frozen=True)
class Position:
    """A place in the input: `lines` lines (rows) consumed, ending at `offset` (bytes for text
    and JSONL, rows for Parquet)."""

    lines: int = 0
    offset: int = 0


@dataclass
class Chunk:
    """The inputs of up to `--chunk-size` consecutive lines (rows), and where each came from."""

    inputs: list[str | dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # 1-based line (row) of each input
    ids: list[str | int] = field(default_factory=list)  # --id-field values, when asked for
    start: Position = field(default_factory=Position)  # where the chunk begins
    end: Position = field(default_factory=Position)  # where the next chunk begins

    @property
    def num_lines(self) -> int:
        """Lines (rows) the chunk consumed, skipped ones included."""
        return self.end.lines - self.start.lines


def input_format(name: str, given: str | None) -> str:
    """The input's format: `given` (--format), else by the file's suffix."""
    if given is not None:
        return given
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.endswith(".jsonl") else "text"


def file_identity(name: str) -> dict[str, Any]:
    """What identifies an input file's content for a resumed run: path, size, modification
    time. Standard input has none (it cannot be resumed)."""
    if name == "-":
        return {"path": "-"}
    stat = os.stat(name)
    return {"path": str(Path(name).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def count_lines(path: Path) -> int:
    """Lines in `path`, for the progress bar's total (a fast pass over the raw bytes)."""
    count, last = 0, b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def read_line_chunks(
    source: BinaryIO,
    *,
    jsonl: bool,
    text_field: str = "text",
    id_field: str | None = None,
    skip_empty: bool = False,
    chunk_size: int = 4096,
    start: Position = Position(),
    id_kind: str | None = None,
    image_field: str | None = None,
) -> Iterator[Chunk]:
    """Chunks of `chunk_size` lines from `source`, positioned at `start` (its byte offset is
    where the caller has already sought to). A bad line raises `CommandError` naming it.
    `id_kind`: the JSON type of the ids of the lines before `start` (a resumed run's), which
    every id must share. `image_field`: the JSONL field of images, if any."""
    parser = _LineParser(jsonl, text_field, id_field, image_field)
    parser.id_kind = id_kind
    chunk = Chunk(start=start, end=start)
    number, offset = start.lines, start.offset
    for raw in source:
        number += 1
        offset += len(raw)
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            item, id_value = parser.parse(text)
        except UnicodeDecodeError as exc:
            raise CommandError(f"line {number}: not UTF-8 text (byte {exc.start + 1})") from None
        except ValueError as exc:
            raise CommandError(f"line {number}: {exc}") from None
        _add(chunk, item, id_value, number, skip_empty, "line")
        chunk.end = Position(number, offset)
        if chunk.num_lines == chunk_size:
            yield chunk
            chunk = Chunk(start=chunk.end, end=chunk.end)
    if chunk.num_lines:
        yield chunk


def _add(
    chunk: Chunk,
    item: str | dict[str, Any] | None,
    id_value: str | int | None,
    number: int,
    skip_empty: bool,
    unit: str,
) -> None:
    if item is None:
        if skip_empty:
            return
        raise CommandError(f"{unit} {number}: blank input (--skip-empty skips these)")
    chunk.inputs.append(item)
    chunk.lines.append(number)
    if id_value is not None:
        chunk.ids.append(id_value)


class _LineParser:
    """(input, id) of one text or JSONL line; the input is None when the text (image) is
    blank."""

    def __init__(
        self, jsonl: bool, text_field: str, id_field: str | None, image_field: str | None = None
    ):
        self.jsonl = jsonl
        self.text_field = text_field
        self.id_field = id_field
        self.image_field = image_field
        self.id_kind: str | None = None  # JSON type of the first id; every id must share it

    def parse(self, text: str) -> tuple[str | dict[str, Any] | None, str | int | None]:
        if not self.jsonl or not text.strip():
            return (text if text.strip() else None), None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg}, column {exc.colno})") from None
        id_field, text_field = self.id_field, self.text_field
        if isinstance(value, str) and id_field is None:
            return (value if value.strip() else None), None
        if not isinstance(value, dict):
            raise ValueError(
                f"expected a JSON object{'' if id_field else ' or string'}, got {json_type(value)}"
            )
        item: str | dict[str, Any] | None
        image_field = self.image_field
        image = value.get(image_field) if image_field is not None else None
        if image_field is not None and image is not None:
            item = _json_image(value, image, image_field, text_field)
        elif (
            image_field in value
            and value.get(text_field) is None
            and ("prompt_token_ids" not in value)
        ):
            item = None  # a null image, and no other input: a blank one
        elif "prompt_token_ids" in value:
            ids = value["prompt_token_ids"]
            # JSON's true and false are not token ids (Python reads them as 1 and 0), as a
            # Parquet list<bool> column is not.
            if isinstance(ids, list) and any(type(i) is bool for i in ids):
                raise ValueError("'prompt_token_ids' must be integers, got a boolean among them")
            # An empty list is a blank input, as in a Parquet column (--skip-empty skips it).
            item = None if ids == [] else {"prompt_token_ids": ids}
        elif isinstance(value.get(text_field), str):
            item = value[text_field] if value[text_field].strip() else None
        elif text_field in value:
            raise ValueError(f"{text_field!r} must be a string, got {json_type(value[text_field])}")
        else:
            also = f"{image_field!r}, " if image_field is not None else ""
            raise ValueError(
                f"the object has no {text_field!r} field (nor {also}'prompt_token_ids')"
            )
        if id_field is None:
            return item, None
        id_value = value.get(id_field)
        if not isinstance(id_value, str | int) or isinstance(id_value, bool):
            raise ValueError(
                f"{id_field!r} must be a string or an integer, got {json_type(id_value)}"
            )
        check_id(id_field, id_value)
        kind = json_type(id_value)
        self.id_kind = self.id_kind or kind
        if kind != self.id_kind:
            raise ValueError(f"{id_field!r} is a {kind}; earlier ids are {self.id_kind}s")
        return item, id_value


def _json_image(
    value: dict[str, Any], image: Any, image_field: str, text_field: str
) -> dict[str, Any] | None:
    """The image input of a JSONL object whose `image_field` is set (None: blank)."""
    for other in ("prompt_token_ids", text_field):
        if other != image_field and value.get(other) is not None:
            raise ValueError(
                f"both {image_field!r} and {other!r} are given; a line holds one input"
            )
    if not isinstance(image, str):
        raise ValueError(
            f"{image_field!r} must be a string (a path, URL, data: URI or base64), got "
            f"{json_type(image)}"
        )
    return {"image": image} if image.strip() else None


def check_id(field: str, value: str | int) -> None:
    """`ValueError` for an id no output can hold: an integer outside int64 (Parquet's id
    column), a string with a lone surrogate (not UTF-8)."""
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{field!r} {value} is outside the 64-bit integers ids are")
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field!r} is not valid Unicode: {exc.reason} at character {exc.start}"
        ) from None


def json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return "null" if value is None else names.get(type(value), "object")


class ParquetInput:
    """A Parquet file read by record batches: the text column (--field, or a list<int>
    `prompt_token_ids` column), the image column (--image-field) and the --id-field column.
    Checked when opened, before any model loads.

    `text_field` None: the column "text", which a file of images need not have."""

    def __init__(
        self,
        path: str,
        text_field: str | None,
        id_field: str | None,
        image_field: str | None = None,
    ):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            self.file = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as exc:
            raise CommandError(f"cannot read {path!r} as Parquet: {exc}") from None
        schema = self.file.schema_arrow
        names = schema.names
        self.image_column = image_field
        if image_field is not None:
            if image_field not in names:
                raise CommandError(
                    f"{path!r} has no column {image_field!r} (--image-field); its columns: "
                    f"{', '.join(names)}"
                )
            _check_image_type(image_field, _values_type(schema.field(image_field).type))
        text = text_field or "text"
        self.text_column: str | None
        if text in names and text != image_field:
            self.text_column = text
            column_type = _values_type(schema.field(text).type)
            if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
                raise CommandError(f"column {text!r} is {column_type}, not a string column")
        elif "prompt_token_ids" in names:
            self.text_column = "prompt_token_ids"
            column_type = schema.field("prompt_token_ids").type
            if not (pa.types.is_list(column_type) or pa.types.is_large_list(column_type)):
                raise CommandError(f"column 'prompt_token_ids' is {column_type}, not a list")
        elif image_field is not None and text_field is None:
            self.text_column = None  # images only
        else:
            raise CommandError(
                f"{path!r} has no column {text!r} (nor 'prompt_token_ids'); "
                f"its columns: {', '.join(names)} (--field names the text column)"
            )
        self.id_field = id_field
        if id_field is not None:
            if id_field not in names:
                raise CommandError(f"{path!r} has no column {id_field!r} (--id-field)")
            id_type = _values_type(schema.field(id_field).type)
            if not (
                pa.types.is_integer(id_type)
                or pa.types.is_string(id_type)
                or pa.types.is_large_string(id_type)
            ):
                raise CommandError(
                    f"--id-field column {id_field!r} is {id_type}, not ints or strings"
                )
        self.num_rows = int(self.file.metadata.num_rows)

    def chunks(
        self,
        *,
        skip_empty: bool,
        chunk_size: int,
        start: Position = Position(),
    ) -> Iterator[Chunk]:
        """Chunks of `chunk_size` rows from row `start.offset` on; memory holds about two."""
        # A column is read once, whatever roles it has (the ids may be the texts themselves,
        # or an image column's paths, as JSONL allows).
        roles = (self.text_column, self.image_column, self.id_field)
        columns = list(dict.fromkeys(name for name in roles if name is not None))
        first_group, skip = self._row_group_of(start.offset)
        groups = range(first_group, self.file.metadata.num_row_groups)
        batch_size = min(chunk_size, max(self.num_rows, 1))  # (Arrow's size is an int64)
        batches = self.file.iter_batches(batch_size=batch_size, row_groups=groups, columns=columns)
        rows: list[list[Any]] = [[] for _ in roles]  # texts, images, ids
        where = [columns.index(name) if name is not None else None for name in roles]
        read = rows[0] if self.text_column is not None else rows[1]  # as many as rows read
        row = start.offset
        for batch in batches:
            drop = min(skip, batch.num_rows)  # rows before `start` in its row group
            skip -= drop
            values = [batch.column(i).to_pylist()[drop:] for i in range(len(columns))]
            for kept, at in zip(rows, where, strict=True):
                if at is not None:
                    kept.extend(values[at])
            while len(read) >= chunk_size:
                texts, images, ids = (kept[:chunk_size] for kept in rows)
                yield self._chunk(texts, images, ids, row, skip_empty)
                for kept in rows:
                    del kept[:chunk_size]
                row += chunk_size
        if read:
            yield self._chunk(rows[0], rows[1], rows[2], row, skip_empty)

    def _row_group_of(self, row: int) -> tuple[int, int]:
        """(row group holding `row`, rows of that group before it)."""
        first = 0
        for group in range(self.file.metadata.num_row_groups):
            size = self.file.metadata.row_group(group).num_rows
            if row < first + size:
                return group, row - first
            first += size
        return self.file.metadata.num_row_groups, 0

    def _chunk(
        self, texts: list[Any], images: list[Any], ids: list[Any], row: int, skip_empty: bool
    ) -> Chunk:
        size = max(len(texts), len(images))
        chunk = Chunk(start=Position(row, row), end=Position(row + size, row + size))
        for i in range(size):
            number = row + i + 1
            value = texts[i] if texts else None
            item: str | dict[str, Any] | None
            if isinstance(value, str):
                item = value if value.strip() else None
            elif isinstance(value, list):
                item = {"prompt_token_ids": value} if value else None
            else:
                item = None  # a null
            image = _parquet_image(images[i]) if images else None
            if image is not None:
                if item is not None:
                    raise CommandError(
                        f"row {number}: both {self.image_column!r} and {self.text_column!r} "
                        "hold a value; a row holds one input"
                    )
                item = {"image": image}
            id_value = ids[i] if self.id_field else None
            if self.id_field and id_value is None and item is not None:
                raise CommandError(f"row {number}: {self.id_field!r} is null")
            if self.id_field and id_value is not None:
                try:
                    check_id(self.id_field, id_value)
                except ValueError as exc:
                    raise CommandError(f"row {number}: {exc}") from None
            _add(chunk, item, id_value, number, skip_empty, "row")
        return chunk


def _check_image_type(name: str, column_type: Any) -> None:
    """`CommandError` unless an image column is strings, binary, or a struct of `bytes`
    and/or `path` (Hugging Face datasets' Image feature)."""
    import pyarrow as pa

    def plain(t: Any) -> bool:
        return bool(
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
            or pa.types.is_fixed_size_binary(t)
        )

    if plain(column_type):
        return
    if pa.types.is_struct(column_type):
        fields = {
            column_type.field(i).name: column_type.field(i).type
            for i in range(column_type.num_fields)
        }
        known = {k: t for k, t in fields.items() if k in ("bytes", "path")}
        if known and all(plain(t) for t in known.values()):
            return
    raise CommandError(
        f"column {name!r} (--image-field) is {column_type}; an image column holds strings "
        "(paths, URLs, data: URIs, base64), binary (encoded images), or a struct of 'bytes' "
        "and 'path'"
    )


def _parquet_image(value: Any) -> str | bytes | None:
    """The image of one row's image column (None: blank): a string or bytes as they are; of
    a `{bytes, path}` struct its bytes, else its path."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data else path
    if isinstance(value, str):
        return value if value.strip() else None
    return bytes(value) if value else None


def _values_type(column_type: Any) -> Any:
    """The type of a column's values: a dictionary-encoded column's (pandas writes its
    categoricals so), read as its values; else the column's own."""
    import pyarrow as pa

    return column_type.value_type if pa.types.is_dictionary(column_type) else column_type


def open_lines(name: str) -> BinaryIO:
    """The binary stream of a text or JSONL input; `-` is standard input."""
    if name == "-":
        return sys.stdin.buffer
    try:
        return open(name, "rb")
    except OSError as exc:
        raise CommandError(f"cannot read {name!r}: {exc.strerror}") from None
