"""`TokenizerProcess`: a tokenizer's copy in a process of its own, which tokenizes large batches
of single texts while the engine's process goes on.

A large call runs on two threads of one interpreter (the engine's steps, and the worker that
tokenizes the next chunks), and they take turns for the interpreter lock: most of tokenizing's
CPU time (NumPy's calls in `vecpool.wordpiece`, each text's ids made into an array) holds it.
So a host-bound call from text took as long as the same call from ids plus the tokenizing
(BERT-base queries from text 79% of ids on an H200). In a child process the tokenizing holds
no lock of ours; the engine's process only pickles the texts and unpickles one flat array of
ids and their lengths a batch.

The child is started as a new interpreter running `serve` (`subprocess`), not by
`multiprocessing`, which would import the caller's main script again in it. It talks
over one end of a socket pair, and exits when the other end closes (the engine's process gone,
or this object collected). Whatever goes wrong with it costs a batch nothing: the batch is
tokenized in the calling process instead (`encode_ids` returns None), and a child that died
or answered out of turn is not used again.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from vecpool.arrays import TruncationSide
from vecpool.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

# Batches of fewer characters are tokenized in the calling process: the round trip's fixed
# cost (two messages through a socket, two wake-ups) is more than a small batch's tokenizing.
PROCESS_MIN_CHARS = 8192
# The child's program (run by `-c`: as `-m`, this module would be imported twice in it).
_CHILD = (
    "import sys; from pathlib import Path; from vecpool.tokenizer_process import serve; "
    "serve(int(sys.argv[1]), Path(sys.argv[2]))"
)
# How long a closing child gets to exit before it is killed.
_EXIT_TIMEOUT_S = 5.0


class TokenizerProcess:
    """A child process that tokenizes with its own `TextTokenizer` of `path`.

    The child starts with the first batch large enough to send (which is tokenized here
    meanwhile). Thread-safe: one batch at a time goes to the child; a thread that finds it busy
    (or still starting) is told to tokenize in its own process (None)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self.child: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._stop: weakref.finalize | None = None
        self._ready = False  # the child said it has built its tokenizer
        self._broken = False

    def _start(self) -> None:
        """Start the child (not waiting for it). It imports this copy of vecpool."""
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), str(self.path)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.child, self._conn = proc, Connection(ours.detach())
        self._stop = weakref.finalize(self, _close, self._conn, proc)

    def encode_ids(
        self,
        texts: Sequence[str],
        max_tokens: int | None,
        side: TruncationSide,
        add_special_tokens: bool,
    ) -> list[np.ndarray] | None:
        """`TextTokenizer.encode_ids` of `texts` as the child runs it, or None where the caller
        must tokenize them itself: the child busy with another thread's batch, still starting,
        failed, or the batch one it could not tokenize (a bad text: the caller's own
        tokenizing then raises the error that names it)."""
        if (
            self._broken
            or sum(map(len, texts)) < PROCESS_MIN_CHARS
            or not self._lock.acquire(blocking=False)
        ):
            return None
        try:
            conn = self._conn
            if conn is None:
                self._start()  # this batch is tokenized here while the child starts
                return None
            if not self._ready:
                if not conn.poll():
                    return None
                if conn.recv() != "ready":
                    raise EOFError("the tokenizer process did not start")
                self._ready = True
            conn.send((list(texts), max_tokens, side, add_special_tokens))
            reply = conn.recv()
        except BaseException as exc:  # its state unknown from here: never used again
            self.close()
            if isinstance(exc, Exception):
                logger.warning("the tokenizer process failed (%s); tokenizing in process", exc)
                return None
            raise
        finally:
            self._lock.release()
        if reply is None:
            return None
        flat, ends = reply
        starts = [0, *ends[:-1]]
        return [flat[a:b] for a, b in zip(starts, ends, strict=True)]  # (np.split: 5x the time)

    def close(self) -> None:
        """Stop the child (also done when this object is collected)."""
        self._broken = True
        if self._stop is not None:
            self._stop()


def _close(conn: Connection, proc: subprocess.Popen[bytes]) -> None:
    conn.close()  # the child reads the end of its input and exits
    try:
        proc.wait(_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve(fd: int, path: Path) -> None:
    """The child's loop: a batch in, its ids out, until the other end closes."""
    conn = Connection(fd)
    tokenizer = TextTokenizer(path)
    conn.send("ready")
    while True:
        try:
            texts, max_tokens, side, add_special_tokens = conn.recv()
        except EOFError:
            return
        try:
            arrays = tokenizer.encode_ids(texts, max_tokens, side, add_special_tokens)
        except Exception:  # the caller tokenizes the batch itself, and raises it there
            conn.send(None)
            continue
        ends = np.cumsum(np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays)))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        conn.send((flat, ends.tolist()))  # each text's ids are flat[end before it : its end]
