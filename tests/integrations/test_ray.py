"""Ray: a local cluster (2 CPUs) embeds a dataset through `vecpool.ray` with 2 engine actors, and
the Ray Serve deployment answers the OpenAI client. Vectors are compared with `Engine.embed` on
the same rows: the actors see other batch compositions, so equal within fp32 rounding (1e-6).
A SIGTERM to the test run still ends it cleanly once Ray has started (`StopOnSigterm`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import ray
import ray.data
from ray import serve

import vecpool.ray
from tests.helpers import StopOnSigterm
from vecpool import Engine, EngineArgs
from vecpool.calls import EmbedOptions
from vecpool.integrations.ray_data import EngineActor
from vecpool.integrations.ray_serve import build_app, deployment_options

# The first batch is slow (long texts) and the rest fast: one actor is still on it while the
# other finishes later batches, so rows come out of order unless the order is kept.
TEXTS = [
    f"document {i}: " + "pooling vector engine " * (60 if i < 4 else 1 + i % 3) for i in range(30)
]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # ray.init points SIGTERM at Ray's handler (`SystemExit` in whatever test runs, which
    # pytest counts as that test's failure before it goes on) and leaves it there after
    # `ray.shutdown`: the run's own handler is put back.
    handler = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        signal.signal(signal.SIGTERM, handler)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def engine(minilm: Engine) -> Engine:
    """The default model's engine: the session's."""
    return minilm


def test_import_vecpool_does_not_import_ray() -> None:
    code = "import sys, vecpool, vecpool.cli.main; print('ray' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_dataset_embedded_by_two_actors_equals_engine_embed(cluster: None, engine: Engine) -> None:
    rows = [{"id": i, "text": t, "lang": "en" if i % 2 else "fr"} for i, t in enumerate(TEXTS)]
    ds = ray.data.from_items(rows)  # one block per row: many batches, both actors busy
    out = vecpool.ray.embed(
        ds, "text", engine_args=EngineArgs(device="cpu"), concurrency=2, num_cpus=1, batch_size=4
    )
    # Ray Data keeps block order only when asked; without it this run reorders about half the
    # time, so the setting itself is checked too.
    assert out.context.execution_options.preserve_order
    result = out.take_all()
    assert [r["id"] for r in result] == list(range(len(TEXTS)))  # in order
    assert [r["text"] for r in result] == TEXTS  # the other columns pass through
    assert [r["lang"] for r in result] == [row["lang"] for row in rows]
    vectors = np.stack([r["embedding"] for r in result])
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    assert np.abs(vectors - engine.embed(TEXTS)).max() < TOLERANCE


def test_token_id_and_prompt_embeds_columns_and_scores(cluster: None, engine: Engine) -> None:
    texts = TEXTS[:6]
    rows = [
        {
            "ids": engine.tokenize(t),
            "embeds": engine.embed_tokens(engine.tokenize(t)).numpy(),
            "query": "a vector engine",
            "document": t,
        }
        for t in texts
    ]
    ds = ray.data.from_items(rows)
    args = EngineArgs(device="cpu")
    pool = {"engine_args": args, "num_cpus": 0.5, "batch_size": 4}
    ds = vecpool.ray.embed(ds, "ids", output_column="from_ids", **pool)
    ds = vecpool.ray.embed(ds, "embeds", output_column="from_embeds", **pool)
    ds = vecpool.ray.score(ds, "query", "document", **pool)
    result = ds.take_all()
    expected = engine.embed(texts)
    assert np.abs(np.stack([r["from_ids"] for r in result]) - expected).max() < TOLERANCE
    assert np.abs(np.stack([r["from_embeds"] for r in result]) - expected).max() < TOLERANCE
    scores = np.array([r["score"] for r in result])
    assert np.abs(scores - engine.score("a vector engine", texts)).max() < TOLERANCE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_answers_the_openai_client(cluster: None, engine: Engine) -> None:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({"device": "cpu", "num_cpus": "0.5", "served_model_name": "minilm,default"})
    serve.run(app, name="vecpool", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    response = client.embeddings.create(model="minilm", input=TEXTS[:5])
    vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(5))
    assert response.model == "minilm"
    assert response.usage.prompt_tokens == sum(len(engine.tokenize(t)) for t in TEXTS[:5])
    assert np.abs(vectors - engine.embed(TEXTS[:5])).max() < TOLERANCE
    with pytest.raises(openai.NotFoundError):  # the server's own errors come through
        client.embeddings.create(model="no-such-model", input=["x"])
    serve.delete("vecpool")


def test_deployment_options_from_serve_run_arguments() -> None:
    assert deployment_options({"num_replicas": "3", "num_gpus": 1.0}) == {
        "num_replicas": 3,
        "ray_actor_options": {"num_gpus": 1.0},
    }
    auto = {"num_replicas": "auto", "min_replicas": 1, "max_replicas": 8}
    assert deployment_options(auto) == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 8}
    }
    with pytest.raises(ValueError, match="need num_replicas=auto"):
        deployment_options({"num_replicas": "2", "max_replicas": 4})
    with pytest.raises(ValueError, match="unknown argument"):
        build_app({"replicas": "2"})


def test_actor_hands_its_options_to_the_engine(engine: Engine) -> None:
    """One actor, called in this process: the task's options object reaches `Engine.embed`."""
    options = EmbedOptions(dimensions=64, truncate_prompt_tokens=8)
    actor = EngineActor(EngineArgs(device="cpu"), "embed", ("text",), "vec", options)
    batch = {"text": np.array(TEXTS[:3], dtype=object), "id": np.arange(3)}
    out = actor(batch)
    assert out["vec"].shape == (3, 64)
    expected = engine.embed(TEXTS[:3], dimensions=64, truncate_prompt_tokens=8)
    assert np.abs(out["vec"] - expected).max() < TOLERANCE
    assert np.array_equal(out["id"], batch["id"])


def test_the_runs_sigterm_handler_outlives_ray(cluster: None) -> None:
    """After the cluster started (and Serve, and Ray Data's executions), a SIGTERM still goes
    to the run's handler."""
    assert isinstance(signal.getsignal(signal.SIGTERM), StopOnSigterm)


def test_a_second_sigterm_interrupts_the_running_test() -> None:
    session = SimpleNamespace(shouldstop=False)
    handler = StopOnSigterm(session)  # type: ignore[arg-type]
    handler(signal.SIGTERM, None)
    assert session.shouldstop == "SIGTERM: stopped after the test that was running"
    with pytest.raises(KeyboardInterrupt, match="a second SIGTERM"):
        handler(signal.SIGTERM, None)


SIGNALLED_RUN = """
import os
import signal
from pathlib import Path

import pytest

MARKS = Path(os.environ["SIGTERM_MARKS"])


@pytest.fixture(scope="session")
def held():
    yield
    (MARKS / "torn_down").touch()


def test_signalled(held):
    os.kill(os.getpid(), signal.SIGTERM)
    (MARKS / "finished").touch()


def test_after():
    (MARKS / "after").touch()
"""


def test_a_sigterm_stops_the_run_after_the_running_test(tmp_path: Path) -> None:
    """A run with this suite's conftest, signalled inside its first test: that test finishes
    and passes, the next never starts, the session's fixtures are torn down, and pytest exits
    as interrupted (2), saying why."""
    (tmp_path / "test_signalled.py").write_text(SIGNALLED_RUN)
    marks = tmp_path / "marks"
    marks.mkdir()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest"]
    done = subprocess.run(
        [*command, "-p", "no:cacheprovider", str(tmp_path / "test_signalled.py")],
        cwd=Path(__file__).parents[2],
        env={**os.environ, "SIGTERM_MARKS": str(marks)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == pytest.ExitCode.INTERRUPTED, done.stdout + done.stderr
    assert sorted(p.name for p in marks.iterdir()) == ["finished", "torn_down"]
    assert "1 passed" in done.stdout
    assert "SIGTERM: stopped after the test that was running" in done.stdout
