"""`benchmarks/results/README.md` indexes every results file: one row each, no row without its
file, and the commit and device columns say what the file itself records."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import record

RESULTS = Path(record.__file__).parent / "results"
NOT_RECORDED = "not recorded"


def index_rows() -> list[list[str]]:
    """The index's table rows as cells: file, what it shows, commit, device."""
    rows = []
    for line in (RESULTS / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def recorded(path: Path) -> tuple[str, str]:
    """The short commit and the device a results file records, or "not recorded".

    JSON: `commit` (its leading hash), and `device` (record.py's dict: the GPU's name, with the
    count where a host has several, or the CPU's with its cores; older files: a string) or else
    `machine`. Text: a first line `# COMMAND (commit HASH, DEVICE, ...)`."""
    text = path.read_text(errors="replace")
    if path.suffix != ".json":
        head = re.match(r"# .*\(commit ([0-9a-f]{7,40}), ([^,]+),", text)
        return (head[1][:7], head[2]) if head else (NOT_RECORDED, NOT_RECORDED)
    report = json.loads(text)
    commit = re.match(r"[0-9a-f]{7,40}", str(report.get("commit") or ""))
    device = report.get("device")
    machine = report.get("machine")
    if isinstance(device, dict):
        name = device.get("name") or NOT_RECORDED
        if "cuda" in device or "gpu_count" in device:
            count = device.get("gpu_count", 1)
            described = f"{count}x {name}" if count > 1 else name
        else:
            described = f"{name}, {device['cpu_cores']} cores" if device.get("cpu_cores") else name
    elif isinstance(device, str):
        described = device
    elif isinstance(machine, str):
        described = machine
    elif isinstance(machine, dict):
        described = machine.get("device_name") or NOT_RECORDED
        if described == "cpu" and machine.get("cpus"):
            described = f"cpu, {machine['cpus']} cores"
    else:
        described = NOT_RECORDED
    return (commit[0][:7] if commit else NOT_RECORDED), described


def test_every_results_file_has_exactly_one_row() -> None:
    named = [row[0].strip("`") for row in index_rows()]
    files = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert len(named) == len(set(named)), "a file with two rows"
    assert sorted(named) == files


def test_each_row_says_what_the_file_shows_and_records() -> None:
    rows = index_rows()
    assert len(rows) > 100  # the table was read at all
    for row in rows:
        assert len(row) == 4, row
        name, shows, commit, device = row
        assert shows, name
        want_commit, want_device = recorded(RESULTS / name.strip("`"))
        # The commit column is the recorded hash, then at most a qualifier in words.
        assert commit == want_commit or commit.split()[0] == want_commit != NOT_RECORDED, name
        assert device == want_device, name
