"""`vecpool embed` at corpus scale: Parquet and JSONL in and out, resuming after an
interruption (in this process, and a real process killed by SIGKILL, SIGINT or SIGTERM), atomic
outputs, overwrite refusal, output paths checked before the model loads, the --skip-empty
index, and data parallel equal to one process."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.cli import hold
from tests.cli.corpus_data import NUM_ROWS, corpus_texts, embed, vectors_of
from vecpool import Engine
from vecpool.cli import main
from vecpool.cli.corpus import ParquetInput, Position
from vecpool.cli.output import WorkFolder

CHUNK = 3  # 12 parts


def cli_command(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vecpool",
        "embed",
        "-i",
        str(corpus),
        "--field",
        "body",
        "--id-field",
        "doc_id",
        "-o",
        str(out),
        "--chunk-size",
        str(CHUNK),
        "--device",
        "cpu",
        *extra,
    ]


def held_at(command: list[str], part: int) -> tuple[list[str], dict[str, str]]:
    """`command` (a `python -m vecpool` one) and its environment, as a run that stops still
    once `part` is committed, until a signal ends it (`tests/cli/hold.py`)."""
    assert command[1:3] == ["-m", "vecpool"]
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, hold.ENV: str(part), "PYTHONPATH": path}
    return [command[0], "-m", "tests.cli.hold", *command[3:]], env


def _default_sigint() -> None:
    # A test run started in the background of a shell without job control ignores SIGINT, and
    # its children would inherit that (Python then installs no handler for it): the run under
    # test gets SIGINT as a user's Ctrl-C delivers it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class WatchedRun:
    """A `vecpool embed` process, started at once. Its output path must never hold anything
    but the whole result (`look` checks it). With `kill_after_part`, the run stops still once
    that part is committed and gets `sig` there."""

    def __init__(self, command: list[str], out: Path, kill_after_part: int | None, sig: int):
        env = None
        if kill_after_part is not None:
            command, env = held_at(command, kill_after_part)
        self.out, self.kill_after_part, self.sig = out, kill_after_part, sig
        self.record = out.with_name(out.name + ".partial") / f"part-{kill_after_part or 0:06d}.json"
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=_default_sigint,
        )

    def look(self) -> bool:
        """One look at the output and the process; True once it needs no more (it exited,
        or it was signalled where it was held)."""
        if self.out.exists():
            assert pq.read_table(self.out).num_rows == NUM_ROWS  # only ever the whole result
        if self.process.poll() is not None:
            return True
        if self.kill_after_part is not None and self.record.exists():
            self.process.send_signal(self.sig)
            return True
        return False

    def finish(self) -> int:
        """The exit status (0 asserted for a run not killed)."""
        try:
            returncode = self.process.wait(timeout=120)
        finally:
            self.process.kill()
        stderr = self.process.stderr.read().decode() if self.process.stderr else ""
        if self.kill_after_part is None:
            assert returncode == 0, stderr
        return returncode


def watch_all(runs: list[WatchedRun]) -> list[int]:
    """Watch `runs` side by side until each is done; their exit statuses. Several at once:
    a run's start keeps about one core busy."""
    deadline = time.monotonic() + 240  # only bounds a failure
    pending = list(runs)
    try:
        while pending and time.monotonic() < deadline:
            pending = [run for run in pending if not run.look()]
            time.sleep(0.005)
    finally:
        returncodes = [run.finish() for run in runs]
    return returncodes


KILLS = {
    "SIGKILL": (signal.SIGKILL, -signal.SIGKILL),
    "SIGINT": (signal.SIGINT, 130),
    "SIGTERM": (signal.SIGTERM, 130),
}


@dataclass
class Interrupted:
    """A run stopped by a signal where it was held, after part 1, then run again."""

    out: Path
    killed: int  # the stopped run's exit status
    output_after_kill: bool  # whether its output path existed then
    committed: int  # the parts its work folder held then
    resumed: int  # the exit status of the run again
    work_after_resume: bool  # whether the work folder was still there after it


@dataclass
class CorpusRuns:
    """The module's `vecpool embed` processes, run side by side: the uninterrupted reference,
    then an --overwrite run of it killed after part 1; beside them, a run stopped by each of
    `KILLS` after part 1, then resumed."""

    reference: Path
    interrupted: dict[str, Interrupted]
    overwrite_old: bytes  # the output an --overwrite run was given
    overwrite_killed: int  # that run's exit status, SIGKILL after part 1
    overwrite_after: bytes  # the output after it


@pytest.fixture(scope="module")
def corpus_runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> CorpusRuns:
    reference = tmp_path_factory.mktemp("reference") / "vectors.parquet"
    outs = {name: tmp_path_factory.mktemp(name) / "vectors.parquet" for name in KILLS}
    command = {name: cli_command(corpus, out, "-q") for name, out in outs.items()}
    first = [WatchedRun(cli_command(corpus, reference, "-q"), reference, None, 0)]
    first += [WatchedRun(command[name], outs[name], 1, KILLS[name][0]) for name in KILLS]
    _, *killed = watch_all(first)
    seen = {
        name: (out.exists(), len(list(out.with_name(out.name + ".partial").glob("part-*.json"))))
        for name, out in outs.items()
    }
    overwritten = tmp_path_factory.mktemp("overwrite") / "vectors.parquet"
    shutil.copy(reference, overwritten)
    old = overwritten.read_bytes()
    overwrite = cli_command(corpus, overwritten, "-q", "--overwrite")
    second = [WatchedRun(command[name], outs[name], None, 0) for name in KILLS]
    second.append(WatchedRun(overwrite, overwritten, 1, signal.SIGKILL))
    *resumed, overwrite_killed = watch_all(second)
    interrupted = {
        name: Interrupted(
            out,
            returncode,
            seen[name][0],
            seen[name][1],
            again,
            out.with_name(out.name + ".partial").exists(),
        )
        for (name, out), returncode, again in zip(outs.items(), killed, resumed, strict=True)
    }
    return CorpusRuns(reference, interrupted, old, overwrite_killed, overwritten.read_bytes())


@pytest.fixture(scope="module")
def uninterrupted(corpus_runs: CorpusRuns) -> Path:
    return corpus_runs.reference


@pytest.mark.parametrize("name", list(KILLS))
def test_killed_and_restarted_equals_an_uninterrupted_run(
    corpus_runs: CorpusRuns, name: str
) -> None:
    run = corpus_runs.interrupted[name]
    assert run.killed == KILLS[name][1]
    assert not run.output_after_kill
    assert run.committed == 2  # killed where it was held: after part 1
    assert run.resumed == 0
    assert not run.work_after_resume
    table, expected = pq.read_table(run.out), pq.read_table(corpus_runs.reference)
    assert table.column_names == ["index", "doc_id", "embedding"]
    assert table["index"].to_pylist() == list(range(NUM_ROWS))  # every row once, in order
    assert table["doc_id"].to_pylist() == list(range(1000, 1000 + NUM_ROWS))
    # The same chunks, each embedded alone by an engine in the same settings: bit-equal.
    assert np.array_equal(vectors_of(run.out), vectors_of(corpus_runs.reference))
    assert table["doc_id"].equals(expected["doc_id"])


def test_sigkill_of_an_overwriting_run_leaves_the_old_output_whole(
    corpus_runs: CorpusRuns,
) -> None:
    """--overwrite replaces the output only by a finished run: killed midway, the old file
    is still there, byte for byte (and never anything partial at its path meanwhile)."""
    assert corpus_runs.overwrite_killed == -signal.SIGKILL
    assert corpus_runs.overwrite_after == corpus_runs.overwrite_old


def test_parquet_input_equals_engine_embed(engine: Engine, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    args = ["-i", str(corpus), "--field", "body", "--id-field", "doc_id", "-o", str(out)]
    assert embed(engine, *args, "--chunk-size", "32", "-q") == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(NUM_ROWS))
    assert [row["doc_id"] for row in rows] == list(range(1000, 1000 + NUM_ROWS))
    assert list(rows[0]) == ["index", "doc_id", "embedding"]
    vectors = np.array([row["embedding"] for row in rows], dtype=np.float32)
    # JSON floats round-trip float32 exactly; chunks of 32 vs one call of 72: fp32 rounding.
    assert np.abs(vectors - engine.embed(corpus_texts())).max() < 1e-6


@pytest.mark.parametrize("start", [0, 7, 10, 13, 29, 35, 36])
def test_parquet_chunks_start_anywhere(corpus: Path, start: int) -> None:
    """A resumed run starts at any row: inside a row group, past its first batch, at its end."""
    reader = ParquetInput(str(corpus), "body", "doc_id")
    chunks = list(reader.chunks(skip_empty=False, chunk_size=4, start=Position(start, start)))
    assert [c.start.offset for c in chunks] == list(range(start, NUM_ROWS, 4))
    assert [line for c in chunks for line in c.lines] == list(range(start + 1, NUM_ROWS + 1))
    assert [i for c in chunks for i in c.ids] == list(range(1000 + start, 1000 + NUM_ROWS))
    assert [t for c in chunks for t in c.inputs] == corpus_texts()[start:]


def interrupt_after(monkeypatch: pytest.MonkeyPatch, parts: int) -> None:
    """Make the run stop like Ctrl-C once `parts` parts are committed."""
    original = WorkFolder.add_part

    def add_part(self: WorkFolder, *args: object) -> None:
        if len(self.parts) == parts:
            raise KeyboardInterrupt
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(WorkFolder, "add_part", add_part)


def test_resume_embeds_only_what_is_missing(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    texts = corpus_texts(20)
    source = tmp_path / "texts.txt"
    source.write_text("".join(t + "\n" for t in texts))
    out = tmp_path / "out.npy"
    args = ["-i", str(source), "-o", str(out), "--chunk-size", "4"]
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        assert embed(engine, *args, "-q") == 130
    assert not out.exists()
    assert "8 lines are saved" in capsys.readouterr().err

    seen: list[int] = []
    original = engine.prepare_encode

    def counting(inputs: list[object], **kwargs: object) -> object:
        seen.append(len(inputs))
        return original(inputs, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "prepare_encode", counting)
    assert embed(engine, *args) == 0
    assert seen == [4, 4, 4]  # lines 9..20 only
    assert "resuming" in capsys.readouterr().err
    vectors = np.load(out)
    assert vectors.shape == (20, 384)
    assert np.abs(vectors - engine.embed(texts)).max() < 1e-6
    assert not out.with_name("out.npy.partial").exists()


def test_resume_of_a_changed_input_or_option_is_refused(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    texts = corpus_texts(12)
    source = tmp_path / "texts.txt"
    source.write_text("".join(t + "\n" for t in texts))
    out = tmp_path / "out.parquet"
    args = ["-i", str(source), "-o", str(out), "--chunk-size", "4", "-q"]
    with monkeypatch.context() as patch:
        interrupt_after(patch, 1)
        assert embed(engine, *args) == 130
    capsys.readouterr()

    assert embed(engine, *args, "--dimensions", "128") == 2
    err = capsys.readouterr().err
    assert "different --dimensions (was None, now 128)" in err and err.count("\n") == 1
    # The engine's options that change the vectors count too (a resumed run of other
    # options wrote rows of both).
    assert embed(Engine(device="cpu", batch_invariant=True), *args) == 2
    assert "different --batch-invariant (was False, now True)" in capsys.readouterr().err

    source.write_text("".join(t + "\n" for t in reversed(texts)))  # same size, new content
    os.utime(source, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert embed(engine, *args) == 2
    assert "different input file" in capsys.readouterr().err
    assert not out.exists() and out.with_name("out.parquet.partial").is_dir()

    assert embed(engine, *args, "--restart") == 0
    assert np.abs(vectors_of(out) - engine.embed(texts[::-1])).max() < 1e-6


def test_existing_output_is_refused_and_survives_a_failed_run(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("one text\nanother text\n")
    out = tmp_path / "out.npy"
    out.write_bytes(b"precious")
    assert embed(engine, "-i", str(source), "-o", str(out), "-q") == 2
    err = capsys.readouterr().err
    assert "exists (--overwrite replaces it)" in err and err.count("\n") == 1
    assert out.read_bytes() == b"precious"

    bad = tmp_path / "bad.txt"
    bad.write_text("fine\n\nfine\n")  # a blank line fails the run
    assert embed(engine, "-i", str(bad), "-o", str(out), "--overwrite", "-q") == 2
    assert "line 2: blank input" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert not out.with_name("out.npy.partial").exists()

    assert embed(engine, "-i", str(source), "-o", str(out), "--overwrite", "-q") == 0
    assert np.abs(np.load(out) - engine.embed(["one text", "another text"])).max() < 1e-6


@pytest.mark.parametrize("where", ["missing folder", "folder is a file", "output is a folder"])
def test_unusable_output_fails_before_the_model_loads(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("a text\n")
    (tmp_path / "file").write_text("")
    (tmp_path / "dir.npy").mkdir()
    out = {
        "missing folder": tmp_path / "no" / "such" / "out.npy",
        "folder is a file": tmp_path / "file" / "out.npy",
        "output is a folder": tmp_path / "dir.npy",
    }[where]
    loads: list[object] = []
    monkeypatch.setattr(Engine, "from_args", classmethod(lambda cls, args: loads.append(args)))
    assert main(["embed", "-i", str(source), "-o", str(out)]) == 2
    assert loads == []  # no model was loaded
    err = capsys.readouterr().err
    assert err.startswith("vecpool: error: --output") and err.count("\n") == 1
    assert "Traceback" not in err


def test_skip_empty_keeps_an_index_beside_npy(engine: Engine, tmp_path: Path) -> None:
    lines = ["first", "", "third", "   ", "", "sixth"]
    source = tmp_path / "texts.txt"
    source.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "kept.npy"
    args = ["-i", str(source), "-o", str(out), "--skip-empty", "--chunk-size", "2", "-q"]
    assert embed(engine, *args) == 0
    index = np.load(tmp_path / "kept.index.npy")
    assert index.dtype == np.int64 and index.tolist() == [0, 2, 5]
    kept = [lines[i] for i in index]
    assert np.abs(np.load(out) - engine.embed(kept)).max() < 1e-6
    assert embed(engine, *args) == 2  # both files exist now: refused without --overwrite


def test_data_parallel_equals_one_process(engine: Engine, corpus: Path, tmp_path: Path) -> None:
    single, parallel = tmp_path / "single.parquet", tmp_path / "parallel.parquet"
    args = ["-i", str(corpus), "--field", "body", "--chunk-size", "8", "--device", "cpu", "-q"]
    assert embed(engine, *args, "-o", str(single)) == 0
    assert embed(None, *args, "-o", str(parallel), "--data-parallel-size", "2") == 0
    a, b = pq.read_table(single), pq.read_table(parallel)
    assert b["index"].to_pylist() == list(range(NUM_ROWS))
    assert pq.ParquetFile(parallel).num_row_groups == -(-NUM_ROWS // 8)
    # The same chunks; the engine processes use fewer threads each: fp32 rounding at most.
    assert np.abs(vectors_of(parallel) - vectors_of(single)).max() < 1e-6
    assert a["index"].equals(b["index"])


def test_a_data_parallel_run_prints_nothing_but_its_summary(
    corpus: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    """As a user runs it: the engine processes, ended at the run's end, leave nothing for the
    interpreter to warn about (tqdm's lock in each was a named semaphore, reported leaked)."""
    out = tmp_path / "vectors.parquet"
    result = subprocess.run(
        cli_command(corpus, out, "--data-parallel-size", "2"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"wrote {NUM_ROWS} embeddings"), result.stderr
    assert "Warning" not in result.stderr and "leaked" not in result.stderr, result.stderr
    assert np.abs(vectors_of(out) - vectors_of(uninterrupted)).max() < 1e-6


def test_data_parallel_engine_failure_is_one_line_and_leaves_no_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("a text\n")
    missing = str(tmp_path / "no-such-model")
    out = tmp_path / "out.npy"
    args = [missing, "-i", str(source), "-o", str(out), "--device", "cpu", "-q"]
    assert embed(None, *args, "--data-parallel-size", "2") == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and err.count("\n") == 1
    assert multiprocessing.active_children() == []  # the engine processes were stopped
    assert not out.exists() and not out.with_name("out.npy.partial").exists()


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_engine_processes_leave_when_the_parent_is_killed(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "vectors.parquet"
    # Held after part 0: the engine processes are certainly still there when listed.
    command, env = held_at(cli_command(corpus, out, "-q", "--data-parallel-size", "2"), 0)
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    record = out.with_name(out.name + ".partial") / "part-000000.json"
    deadline = time.monotonic() + 240
    while not record.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = children_of(process.pid)
    process.kill()
    process.wait()
    assert len(workers) >= 2  # the engine processes (and multiprocessing's helper)
    deadline = time.monotonic() + 30  # only bounds a failure: they leave as they see it
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers)
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "words"),
    [
        (["--dimensions", "-4"], "dimensions=-4 must be between 1 and the model's output size 384"),
        (["--dimensions", "1000"], "dimensions=1000 must be between 1"),
        (["--prompt-name", "nope"], "unknown prompt name 'nope'"),
    ],
)
def test_options_are_checked_when_the_input_holds_nothing(
    engine: Engine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    option: list[str],
    words: str,
) -> None:
    """An empty input, or only blank lines skipped, refuses a bad option as any input would:
    exit status 2 and one line, no `[0, -4]` array written."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n \n")
    for source, extra in (("empty.txt", []), ("blank.txt", ["--skip-empty"])):
        for suffix in (".npy", ".parquet"):
            out = tmp_path / f"out{suffix}"
            args = ["-i", str(tmp_path / source), "-o", str(out), "-q", *option, *extra]
            assert embed(engine, *args) == 2
            err = capsys.readouterr().err
            assert words in err and err.count("\n") == 1, err
            assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_an_option_the_model_refuses_stops_engine_processes_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "out.npy"
    args = ["-i", str(tmp_path / "empty.txt"), "-o", str(out), "-q", "--dimensions", "-4"]
    assert embed(None, *args, "--device", "cpu", "--data-parallel-size", "2") == 2
    err = capsys.readouterr().err
    assert "dimensions=-4 must be between 1 and the model's output size 384" in err
    assert not out.exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_resumed_run_holds_later_ids_to_the_kind_of_the_first(
    engine: Engine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    suffix: str,
) -> None:
    """Ids of two JSON types are refused whether the run was interrupted between them or not
    (resumed, the string ids were taken: a JSONL of mixed ids, a Parquet merge that failed)."""
    source = tmp_path / "ids.jsonl"
    rows = [("a", 1), ("b", 2), ("c", "x"), ("d", "y")]
    source.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for t, i in rows))
    out = tmp_path / f"out{suffix}"
    args = ["-i", str(source), "-o", str(out), "--id-field", "id", "--chunk-size", "2", "-q"]
    add_part = WorkFolder.add_part

    def interrupted(self: WorkFolder, *part: object) -> None:
        add_part(self, *part)  # type: ignore[arg-type]
        raise KeyboardInterrupt  # once the integer ids are in: the strings were not read yet

    with monkeypatch.context() as patch:
        patch.setattr(WorkFolder, "add_part", interrupted)
        assert embed(engine, *args) == 130
    capsys.readouterr()
    assert embed(engine, *args) == 2
    err = capsys.readouterr().err
    assert "line 3: 'id' is a string; earlier ids are integers" in err and err.count("\n") == 1
    assert not out.exists()
