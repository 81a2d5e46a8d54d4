"""Measurements an engine makes once per machine and keeps: one JSON file per kind of choice in
the user's cache directory, entries keyed by what makes the machine and the shape what they are.

`$VECPOOL_CACHE_DIR/<name>.json`, else `$XDG_CACHE_HOME/vecpool/<name>.json` (by default under
`~/.cache`). A file is replaced whole (readers never see half of one), and a measurement is
taken under an exclusive lock on the file's lock file (`measured_once`), so that processes
loading the same model at once measure once and all take the first measurement: the choice of
one machine does not differ between its processes. A file of another `version` reads as empty.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def cache_path(name: str) -> Path:
    """Where the choices called `name` are kept."""
    folder = os.environ.get("VECPOOL_CACHE_DIR")
    if folder:
        return Path(folder) / f"{name}.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vecpool" / f"{name}.json"


def read_entries(path: Path, version: int) -> dict[str, Any]:
    """The file's entries by key; none where it is missing, unreadable or of another version."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != version:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def write_entry(path: Path, version: int, key: str, value: Any) -> None:
    """Add `value` under `key`, the file replaced whole; a folder that cannot be written only
    means measuring again at the next load."""
    entries = read_entries(path, version)
    entries[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({"version": version, "entries": entries}, indent=1))
        partial.replace(path)
    except OSError as e:
        logger.warning("could not cache a measurement in %s: %s", path, e)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path`'s lock file (`<name>.lock`), where the platform has
    `fcntl`; without it, or where the folder cannot be written, go on unlocked."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent first loads may each measure
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(f"{path.name}.lock"), "a")  # noqa: SIM115 - held below
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measured_once(
    path: Path,
    version: int,
    key: str,
    parse: Callable[[Any], T | None],
    measure: Callable[[], T],
    dump: Callable[[T], Any],
) -> tuple[T, bool]:
    """(the measurement under `key`, whether it came from the file): read with `parse` (None:
    not usable), else made by `measure` under the lock and written with `dump`."""
    with locked(path):
        found = parse(read_entries(path, version).get(key))
        if found is not None:
            return found, True
        value = measure()
        write_entry(path, version, key, dump(value))
        return value, False
