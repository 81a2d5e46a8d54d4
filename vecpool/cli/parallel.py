"""Who embeds the chunks of `vecpool embed`: one engine in this process, or, with
`--data-parallel-size N`, N engine processes (one per GPU: `cuda:0` .. `cuda:N-1`; on the CPU, N
processes sharing the cores). Either way each chunk is embedded whole, on its own, by one engine,
and results come back in input order. A chunk with images has them read on a pool of threads
of the engine's process (`images.py`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from vecpool import calls
from vecpool.api.args import EngineArgs, Replica
from vecpool.calls import EmbedOptions, PreparedCall, windowed
from vecpool.calls.outputs import PoolingOutput, PromptRequest, output_data

if TYPE_CHECKING:  # torch loads where a model runs
    from vecpool.api import Engine
from vecpool.cli.common import CommandError
from vecpool.cli.corpus import Chunk
from vecpool.cli.images import ImageField, ImageReading, is_image_item
from vecpool.errors import ConfigError, EngineError, InputError, ModelLoadError, VecpoolError
from vecpool.inputs.prompts import TRUNCATE_ADVICE

# Chunks sent ahead to each engine process, so that none waits while results are written and
# each has its next chunk to tokenize while it runs one.
CHUNKS_AHEAD_PER_PROCESS = 3
# How often a waiting parent checks its engine processes, and they their parent (seconds).
LIVENESS_INTERVAL = 0.5
# Every queue made for engine processes, kept to this process's exit. Each holds named
# semaphores, unlinked by finalizers: a queue dropped earlier left its last references to its
# feeder thread, whose unlinking at exit could be cut off before it told the resource tracker
# (which then warned of a leaked semaphore). Kept, they are unlinked on the main thread.
_QUEUES: list[Any] = []

Result = tuple[Chunk, np.ndarray, int]  # a chunk, its vectors [rows, dim] float32, its tokens


def prepare_chunk(
    engine: Engine,
    options: EmbedOptions,
    inputs: list[Any],
    images: ImageReading | None = None,
) -> PreparedCall[Any] | None:
    """The embed call of one chunk's inputs (None: no inputs): windowed (`--windowed-embed`)
    as `Engine.embed` windows, else as its plain calls. A chunk with images (`images`: how
    they are read) is one call of both: its texts prepared here, its images on the pool."""
    if not inputs:
        return None
    if images is not None:
        at = [i for i, item in enumerate(inputs) if is_image_item(item)]
        if at:
            return _prepare_with_images(engine, options, inputs, at, images)
    if options.windowed:
        return windowed.prepare_embed_windowed(engine.context, inputs, options)
    return engine.prepare_encode(inputs, **options.encode().keywords())


def _prepare_with_images(
    engine: Engine,
    options: EmbedOptions,
    inputs: list[Any],
    image_at: list[int],
    images: ImageReading,
) -> PreparedCall[np.ndarray]:
    """One call of a chunk's texts and images: `[n, dim]` vectors in input order. An input
    that cannot be prepared raises `InputError` at its index: the first one in the chunk."""
    keywords = options.encode().keywords()
    reading = images.submit(engine, keywords, [(i, inputs[i]["image"]) for i in image_at])
    chosen = set(image_at)
    text_at = [i for i in range(len(inputs)) if i not in chosen]
    errors: list[InputError] = []
    texts: PreparedCall[Any] | None = None
    try:
        texts = prepare_chunk(engine, options, [inputs[i] for i in text_at])
    except InputError as exc:
        errors.append(exc if exc.index is None else exc.at(text_at[exc.index]))
    requests: list[PromptRequest] = []
    if texts is not None:
        requests = [PromptRequest(text_at[r.index], r.prompt, r.params) for r in texts.requests]
    num_texts = len(requests)
    for future in reading:
        try:
            requests.append(future.result())
        except InputError as exc:
            errors.append(exc)
    if errors:
        raise _first(errors)
    dim = engine.info().embed_dim(options.dimensions)

    def finish(outputs: list[PoolingOutput]) -> np.ndarray:
        failed = [out.error for out in outputs if out.error is not None]
        if failed:
            raise _first(failed)
        vectors = np.zeros((len(inputs), dim), np.float32)
        if texts is not None:
            vectors[text_at] = np.asarray(texts.finish(outputs[:num_texts]), np.float32)
        vectors[image_at] = np.stack(output_data(outputs[num_texts:]))
        return vectors

    return PreparedCall(requests, finish)


def _first(errors: list[Any]) -> Any:
    """The error to report of several: one of the whole call, else the first input's."""
    return min(errors, key=lambda e: -1 if getattr(e, "index", None) is None else e.index)


def output_dim(engine: Engine, options: EmbedOptions, images: ImageField | None = None) -> int:
    """The width of the vectors `options` ask of `engine`, once the options every input's call
    would check are checked (`dimensions`, the prompt): a run with no input refuses them too
    (`CommandError`, worded as for an input), rather than writing `[0, -4]` vectors. With
    `images` (--image-field), the model must have an image tower."""
    if images is not None and engine.info().image_processor_dir is None:
        raise CommandError(
            "--image-field: this model has no image tower (it embeds text only; CLIP and "
            "SigLIP models embed images)"
        )
    try:
        calls.check_dimensions(engine.info(), options.dimensions)
        calls.instruction(engine.context, options.prompt_name, options.prompt)
    except InputError as exc:
        raise CommandError(exc.reason) from None
    return engine.info().embed_dim(options.dimensions)


def run_chunk(
    engine: Engine, options: EmbedOptions, call: PreparedCall[Any] | None
) -> tuple[np.ndarray, int]:
    """(vectors `[n, dim]` float32, prompt tokens) of a prepared call (None: no inputs); an
    image counts no tokens."""
    dim = engine.info().embed_dim(options.dimensions)
    if call is None or not call.requests:
        return np.zeros((0, dim), np.float32), 0
    tokens = sum(r.prompt.num_tokens for r in call.requests if r.prompt.image is None)
    vectors = engine.run(call, show_progress=False)  # windowed: already `[n, dim]`
    return (vectors if isinstance(vectors, np.ndarray) else np.stack(vectors)), tokens


def located(exc: InputError, chunk: Chunk, unit: str) -> CommandError:
    """The engine's error, located by input line (row) instead of by index in the chunk, its
    advice in the command's terms (a too-long input: the `--truncate` option)."""
    reason = exc.reason.replace(TRUNCATE_ADVICE, "leave out --no-truncate to truncate it")
    if exc.index is None or not 0 <= exc.index < len(chunk.lines):
        return CommandError(reason)
    where = f"{unit} {chunk.lines[exc.index]}" + (f" ({exc.field})" if exc.field else "")
    return CommandError(f"{where}: {reason}")


@dataclass(frozen=True)
class EmbedJob:
    """What an embedder is given besides its engines: the options of every call, the unit an
    input is counted in (its errors name it: "line", "row") and, with --image-field, the field
    its images are read from."""

    options: EmbedOptions
    unit: str
    images: ImageField | None = None


class LocalEmbedder:
    """One engine in this process. The next chunk is read and tokenized on a helper thread
    (its images on a pool) while the engine runs the current one."""

    def __init__(self, engine: Engine, job: EmbedJob):
        self.engine, self.options, self.unit = engine, job.options, job.unit
        self.output_dim = output_dim(engine, job.options, job.images)
        self.images = ImageReading(job.images) if job.images is not None else None

    def run(self, chunks: Iterator[Chunk]) -> Iterator[Result]:
        def prepare() -> tuple[Chunk, PreparedCall[list[np.ndarray]] | None] | None:
            chunk = next(chunks, None)
            if chunk is None:
                return None
            try:
                call = prepare_chunk(self.engine, self.options, chunk.inputs, self.images)
            except InputError as exc:
                raise located(exc, chunk, self.unit) from None
            return chunk, call

        with ThreadPoolExecutor(1, thread_name_prefix="vecpool-embed-read") as reader:
            upcoming = reader.submit(prepare)
            while (item := upcoming.result()) is not None:
                chunk, call = item
                upcoming = reader.submit(prepare)
                try:
                    vectors, tokens = run_chunk(self.engine, self.options, call)
                except InputError as exc:
                    raise located(exc, chunk, self.unit) from None
                yield chunk, vectors, tokens

    def close(self) -> None:
        if self.images is not None:
            self.images.close()


class ProcessEmbedder:
    """N engine processes (spawned), each embedding whole chunks; results in input order.

    A process that dies is reported (`EngineError`) at once, never waited on; the processes
    leave when the parent closes them, and by themselves when the parent is gone."""

    def __init__(self, engine_args: EngineArgs, job: EmbedJob, size: int):
        self.options, self.unit = job.options, job.unit
        replicas = replace(engine_args, data_parallel_size=size).replicas()
        context = mp.get_context("spawn")
        self.tasks: Any = context.Queue()
        self.results: Any = context.Queue()
        _QUEUES.extend((self.tasks, self.results))
        self.processes = [
            context.Process(
                target=_worker_main,
                args=(replica, job.options, self.tasks, self.results, os.getpid(), job.images),
                name=f"vecpool-embed-{replica.rank}",
                daemon=True,
            )
            for replica in replicas
        ]
        for process in self.processes:
            process.start()
        try:
            dims = [self._receive()[2] for _ in self.processes]  # every engine loaded
        except BaseException:
            self.close()
            raise
        self.output_dim = dims[0]

    def _receive(self) -> tuple[Any, ...]:
        """The next message of any engine process; raises if one has died or failed."""
        while True:
            try:
                message: tuple[Any, ...] = self.results.get(timeout=LIVENESS_INTERVAL)
            except queue.Empty:
                for rank, process in enumerate(self.processes):
                    if not process.is_alive():
                        raise EngineError(
                            f"engine process {rank} died (exit code {process.exitcode})"
                        ) from None
                continue
            if message[0] == "failed":
                _, kind, text = message
                if kind == "CommandError":
                    raise CommandError(text)
                error = {"ConfigError": ConfigError, "ModelLoadError": ModelLoadError}
                raise error.get(kind, EngineError)(text)
            return message

    def run(self, chunks: Iterator[Chunk]) -> Iterator[Result]:
        in_flight: dict[int, Chunk] = {}
        done: dict[int, tuple[np.ndarray, int]] = {}
        sent = next_out = 0
        ahead = CHUNKS_AHEAD_PER_PROCESS * len(self.processes)
        exhausted = False
        while True:
            while not exhausted and len(in_flight) + len(done) < ahead:
                chunk = next(chunks, None)
                if chunk is None:
                    exhausted = True
                    break
                in_flight[sent] = chunk
                self.tasks.put((sent, chunk.inputs))
                sent += 1
            if next_out == sent and exhausted:
                return
            while next_out not in done:
                message = self._receive()
                if message[0] == "input_error":
                    _, seq, index, field, reason = message
                    raise located(InputError(reason, index, field), in_flight[seq], self.unit)
                _, seq, vectors, tokens = message
                done[seq] = (vectors, tokens)
            vectors, tokens = done.pop(next_out)
            yield in_flight.pop(next_out), vectors, tokens
            next_out += 1

    def close(self) -> None:
        """Stop the engine processes (they finish nothing further)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=10)
        self.tasks.cancel_join_thread()
        self.results.cancel_join_thread()


def _worker_main(
    replica: Replica,
    options: EmbedOptions,
    tasks: Any,
    results: Any,
    parent_pid: int,
    images: ImageField | None = None,
) -> None:
    """An engine process: load the engine, then embed the chunks it is sent until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what an interrupt means
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    import torch

    from vecpool.api import Engine
    from vecpool.api.running import use_thread_lock_for_bars

    use_thread_lock_for_bars()

    torch.set_num_threads(replica.threads)
    try:
        engine = Engine.from_args(replica.args)
        dim = output_dim(engine, options, images)
    except CommandError as exc:  # an option the model refuses
        results.put(("failed", "CommandError", str(exc)))
        return
    except VecpoolError as exc:
        results.put(("failed", type(exc).__name__, str(exc)))
        return
    results.put(("ready", str(replica.args.device), dim))
    # The next chunk is tokenized on a thread of its own while the engine runs this one, as
    # `LocalEmbedder` does (serially, a passages chunk's tokenizing left the device idle ~10%
    # of the time: two H200s ran 1.80x one). Daemonic: a worker that leaves on a failure
    # must not wait for it, blocked on the task queue.
    prepared: queue.Queue[tuple[int, Any, Exception | None] | None] = queue.Queue(maxsize=1)
    reading = ImageReading(images) if images is not None else None
    threading.Thread(
        target=_read_tasks, args=(engine, options, tasks, prepared, reading), daemon=True
    ).start()
    while (item := prepared.get()) is not None:
        seq, call, error = item
        try:
            if error is not None:  # the chunk's preparing failed: answered as a run's failure
                raise error
            vectors, tokens = run_chunk(engine, options, call)
        except InputError as exc:
            results.put(("input_error", seq, exc.index, exc.field, exc.reason))
            continue
        except Exception as exc:
            results.put(("failed", "EngineError", f"{type(exc).__name__}: {exc}"))
            return
        results.put(("done", seq, vectors, tokens))


def _read_tasks(
    engine: Engine,
    options: EmbedOptions,
    tasks: Any,
    prepared: queue.Queue,
    images: ImageReading | None = None,
) -> None:
    """An engine process's reader: each task's call prepared (or why it could not be), in
    order, then None once the parent says stop. `images`: how a chunk's images are read."""
    while (task := tasks.get()) is not None:
        seq, inputs = task
        try:
            if images is None:
                call = prepare_chunk(engine, options, inputs)
            else:
                call = prepare_chunk(engine, options, inputs, images)
            prepared.put((seq, call, None))
        except Exception as exc:  # the worker reports it (an input's error, or a failure)
            prepared.put((seq, None, exc))
    prepared.put(None)


def _exit_with_parent(parent_pid: int) -> None:
    """End this process once its parent is gone (killed, even by SIGKILL)."""
    while os.getppid() == parent_pid:
        time.sleep(LIVENESS_INTERVAL)
    os._exit(1)
