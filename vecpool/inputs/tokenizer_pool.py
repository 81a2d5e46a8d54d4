"""`TokenizerPool`: copies of a tokenizer in processes of their own, which tokenize large
batches of single texts while the engine's process goes on.

A large call runs on two threads of one interpreter (the engine's steps, and the worker that
tokenizes the next chunks), and they take turns for the interpreter lock: most of tokenizing's
CPU time (NumPy's calls in `vecpool.inputs.wordpiece`, each text's ids made into an array) holds it.
So a host-bound call from text took as long as the same call from ids plus the tokenizing
(BERT-base queries from text 79% of ids on an H200). In a child process the tokenizing holds
no lock of ours; the engine's process only pickles the texts and unpickles one flat array of
ids and their ends a batch. A batch is split among the children by characters, so that long
texts are tokenized as fast as the device runs them.

Each child is a new interpreter running `serve` (started by `subprocess`, not by
`multiprocessing`, which would import the caller's main script again in it). It talks over one
end of a socket pair, and exits when the other end closes (the engine's process gone, or the
pool collected). Whatever goes wrong with one costs a batch nothing: the batch is tokenized in
the calling process instead (`encode_ids` returns None), and a pool whose child died or
answered out of turn is not used again.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from vecpool.inputs.arrays import TruncationSide
from vecpool.inputs.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

# Batches of fewer characters are tokenized in the calling process, and a batch goes to as
# many children as it has this many characters: a round trip's fixed cost (two messages
# through a socket, two wake-ups) is more than a small batch's tokenizing.
PROCESS_MIN_CHARS = 8192
# The child's program (run by `-c`: as `-m`, this module would be imported twice in it).
_CHILD = (
    "import sys; from pathlib import Path; from vecpool.inputs.tokenizer_pool import serve; "
    "serve(int(sys.argv[1]), Path(sys.argv[2]))"
)
# How long a closing child gets to exit before it is killed.
_EXIT_TIMEOUT_S = 5.0


def default_size() -> int:
    """Children for an engine: a core in four, one to four. On an H200's 16-core host, against
    none (the worker thread tokenizing), MiniLM passages from text ran 1.58x with four, 1.43x
    with two and 0.98x with one (one core tokenizes them slower than the device embeds them),
    MiniLM queries 1.13-1.25x with any (`ab_tokenizer_processes_h200.json`). The cores are
    those this process may run on (a container's or a pinned worker's share, not the host's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cores or 1) // 4))


class TokenizerPool:
    """`size` child processes that tokenize with their own `TextTokenizer` of `path`.

    The children start with the first batch large enough to send (which is tokenized here
    meanwhile). Thread-safe: one batch at a time goes to the children; a thread that finds
    them busy (or still starting) is told to tokenize in its own process (None)."""

    def __init__(self, path: Path, size: int):
        if size < 1:
            raise ValueError(f"a tokenizer pool needs at least one process, got {size}")
        self.path = path
        self.size = size
        self.children: list[_Child] = []
        self._lock = threading.Lock()
        self._stop: weakref.finalize | None = None
        self._broken = False
        # The process the children belong to: a fork of it (a worker of `multiprocessing`'s
        # fork start) shares their sockets, and never uses or stops them.
        self._pid = os.getpid()

    def start(self) -> None:
        """Start the children, not waiting for them (done by the first large batch)."""
        with self._lock:
            if not self.children and not self._broken:
                self._start()

    def _start(self) -> None:
        try:
            while len(self.children) < self.size:
                self.children.append(_Child(self.path))
        finally:
            self._stop = weakref.finalize(self, _close, list(self.children), os.getpid())

    def wait_ready(self, timeout: float) -> bool:
        """Whether every child has started within `timeout` seconds (benchmarks, tests)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                return all(c.is_ready(max(0.0, deadline - time.monotonic())) for c in self.children)
            except (OSError, EOFError):
                self._fail()
                return False

    def encode_ids(
        self,
        texts: Sequence[str],
        max_tokens: int | None,
        side: TruncationSide,
        add_special_tokens: bool,
    ) -> list[np.ndarray] | None:
        """`TextTokenizer.encode_ids` of `texts` as the children run it, or None where the
        caller must tokenize them itself: the children busy with another thread's batch, still
        starting, failed, or the batch one they could not tokenize (a bad text: the caller's
        own tokenizing then raises the error that names it)."""
        if self._broken or os.getpid() != self._pid:
            return None
        ends = list(accumulate(map(len, texts)))
        chars = ends[-1] if ends else 0
        if chars < PROCESS_MIN_CHARS or not self._lock.acquire(blocking=False):
            return None
        try:
            if not self.children:
                self._start()  # this batch is tokenized here while they start
                return None
            ready = [child for child in self.children if child.is_ready(0.0)]
            ready = ready[: chars // PROCESS_MIN_CHARS]
            if not ready:
                return None
            # Parts of about equal characters, in order: part k ends where the running count
            # passes (k + 1) / len(ready) of them.
            cuts = [bisect_left(ends, chars * (k + 1) // len(ready)) + 1 for k in range(len(ready))]
            cuts[-1] = len(texts)
            starts = [0, *cuts[:-1]]
            options = (max_tokens, side, add_special_tokens)
            for child, a, b in zip(ready, starts, cuts, strict=True):
                child.conn.send((list(texts[a:b]), *options))
            replies = [child.conn.recv() for child in ready]
        except BaseException as exc:  # their state unknown from here: never used again
            self._fail()
            if isinstance(exc, Exception):
                logger.warning("a tokenizer process failed (%s); tokenizing in process", exc)
                return None
            raise
        finally:
            self._lock.release()
        out: list[np.ndarray] = []
        for reply in replies:
            if reply is None:
                return None
            flat, flat_ends = reply
            bounds = zip([0, *flat_ends[:-1]], flat_ends, strict=True)
            out.extend(flat[a:b] for a, b in bounds)  # (np.split: 5x the time)
        return out

    def _fail(self) -> None:
        self._broken = True
        if self._stop is not None:
            self._stop()

    def close(self) -> None:
        """Stop the children (also done when the pool is collected)."""
        with self._lock:
            self._fail()


class _Child:
    """One child process and the parent's end of its socket."""

    def __init__(self, path: Path):
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), str(path)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                # A session of its own: a terminal's Ctrl-C, sent to the foreground process
                # group, stops the caller, not a child mid-batch (each exits when it reads the
                # end of its input: the caller's process gone, or the pool closed).
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._ready = False  # it said it has built its tokenizer

    def is_ready(self, timeout: float) -> bool:
        """Whether it has built its tokenizer (waiting up to `timeout` seconds to hear)."""
        if not self._ready and self.conn.poll(timeout):
            if self.conn.recv() != "ready":
                raise EOFError("the tokenizer process did not start")
            self._ready = True
        return self._ready


def _close(children: list[_Child], pid: int) -> None:
    if os.getpid() != pid:  # a fork's copy: the sockets and children are its parent's
        return
    for child in children:
        child.conn.close()  # the child reads the end of its input and exits
    for child in children:
        try:
            child.proc.wait(_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def serve(fd: int, path: Path) -> None:
    """A child's loop: a batch in, its ids out, until the other end closes."""
    conn = Connection(fd)
    tokenizer = TextTokenizer(path)
    try:
        conn.send("ready")
        while True:
            texts, max_tokens, side, add_special_tokens = conn.recv()
            try:
                arrays = tokenizer.encode_ids(texts, max_tokens, side, add_special_tokens)
            except Exception:  # the caller tokenizes the batch itself, and raises it there
                conn.send(None)
                continue
            ends = np.cumsum(np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)))
            flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
            conn.send((flat, ends.tolist()))  # each text's ids: flat[end before it : its end]
    except (EOFError, OSError):  # the other end closed (reset, if it left a reply unread)
        return
