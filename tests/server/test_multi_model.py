"""`vecpool serve A B`: two models behind one port, one engine process each.

A tiny BERT embedder (hidden 48, served as "emb") and a tiny cross-encoder (hidden 32, "ce"):
each call goes to the engine of the model its `model` field names (the vectors and scores are
that model's, as an offline `Engine` on its folder gives them); a call naming no model goes to
the first; an unknown name is a 404 in the route's own shape; /v1/models lists both; the
engines' metrics carry the model. One engine killed: its call in flight fails at once, /health
names it (and its model), the other model serves throughout, and the killed one is restarted
(counted for its model only). The refusals at start (names and memory shares that do not fit)
are checked without starting a server.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import transformers

import vecpool
from tests.helpers import save_hf_model
from tests.server.conftest import Server, ServerPool, ServerSpec, assert_error
from tests.server.gate import EngineGate
from tests.server.test_processes import _alive
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.api import EngineArgs
from vecpool.cli.serve import add_serve_arguments, serve
from vecpool.config import LLMRerankerConfig
from vecpool.errors import ConfigError
from vecpool.server.config import ServerConfig

# The server's engine and the offline one run the same code on the same weights, but with
# other thread counts (the server's engines share the cores): float32 sums may round apart.
TOLERANCE = 1e-6
TEXTS = ["a first sentence for two models", "and a second one, longer than the first"]
QUERY = "which sentence is first"


def _two_models(folder: Path, default_model_dir: Path, cross_encoder_dir: Path) -> list[str]:
    """ "emb" (the default): a random 2-layer BERT of hidden size 48 on the MiniLM tokenizer,
    an embedder whose vectors cannot be mistaken for the cross-encoder's (hidden 32); and
    "ce" (also "reranker"), the cross-encoder."""
    hf = tiny_bert_head(transformers.BertModel, hidden_size=48)
    emb = with_minilm_tokenizer(save_hf_model(hf, folder / "emb"), default_model_dir)
    return [
        *(str(emb), str(cross_encoder_dir), "--served-model-name", "emb"),
        *("--served-model-name", "ce", "reranker"),
        # The cross-encoder embeds too, asked (once for both: the embedder's own).
        *("--task", "embed"),
    ]


# Behind a gate the tests may hold. The last test of this module kills the cross-encoder's
# engine process.
SERVERS = {
    "mm_server": ServerSpec(
        _two_models,
        fixtures=("default_model_dir", "cross_encoder_dir"),
        log_level="info",
        gated=True,
    )
}


@pytest.fixture(scope="module")
def emb_dir(server_pool: ServerPool, request: pytest.FixtureRequest) -> Path:
    return server_pool.folder(request, "mm_server") / "emb"


@pytest.fixture(scope="module")
def emb_engine(emb_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(emb_dir, device="cpu")


@pytest.fixture(scope="module")
def cross_engine(cross_encoder_dir: Path) -> vecpool.Engine:
    """The cross-encoder as "ce" is served: asked to embed too (`--task embed`)."""
    return vecpool.Engine(cross_encoder_dir, device="cpu", tasks=["embed"])


@pytest.fixture(scope="module")
def mm_gate(server_pool: ServerPool, request: pytest.FixtureRequest) -> EngineGate:
    return server_pool.gate(request, "mm_server")


@pytest.fixture(scope="module")
def mm_server(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "mm_server")
    yield srv
    srv.stop()


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def _engine_pids(server: Server) -> list[int]:
    """The engine processes' pids, in the models' order (one engine each)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"engine processes \(pids ([\d, ]+)\)", server.log.read_text())
        if found:
            return [int(p) for p in found[1].split(", ")]
        time.sleep(0.1)
    raise AssertionError(f"no engine pids in the log:\n{server.log.read_text()}")


def test_each_model_answers_its_own_calls(
    mm_server: Server, emb_engine: vecpool.Engine, cross_engine: vecpool.Engine
) -> None:
    server = mm_server
    emb = server.post("/v1/embeddings", {"input": TEXTS, "model": "emb"})
    assert emb.json()["model"] == "emb"
    assert np.abs(_vectors(emb) - emb_engine.embed(TEXTS)).max() <= TOLERANCE
    for name in ("ce", "reranker"):  # either of its names
        ce = server.post("/v1/embeddings", {"input": TEXTS, "model": name})
        assert ce.json()["model"] == name
        assert np.abs(_vectors(ce) - cross_engine.embed(TEXTS)).max() <= TOLERANCE
    assert _vectors(emb).shape == (2, 48) and _vectors(ce).shape == (2, 32)
    # No model: the first.
    default = server.post("/v1/embeddings", {"input": TEXTS})
    assert default.json()["model"] == "emb"
    assert np.abs(_vectors(default) - emb_engine.embed(TEXTS)).max() <= TOLERANCE
    # Another family's route: Cohere's embed and a rerank, each on the model it names.
    cohere = server.post("/v2/embed", {"texts": TEXTS, "model": "ce", "embedding_types": ["float"]})
    assert cohere.status_code == 200, cohere.text
    got = np.array(cohere.json()["embeddings"]["float"], dtype=np.float32)
    assert np.abs(got - cross_engine.embed(TEXTS)).max() <= TOLERANCE
    rerank = server.post("/v1/rerank", {"model": "ce", "query": QUERY, "documents": TEXTS})
    assert rerank.status_code == 200, rerank.text
    scores = {r["index"]: r["relevance_score"] for r in rerank.json()["results"]}
    expected = cross_engine.score(QUERY, TEXTS)
    assert np.abs(np.array([scores[0], scores[1]]) - np.array(expected)).max() <= TOLERANCE
    # SageMaker's /invocations serves a body as the model it names does: a cross-encoder
    # classifies (its route picked by that model's tasks, not the first model's).
    invoked = server.post("/invocations", {"input": TEXTS, "model": "ce"})
    assert invoked.status_code == 200, invoked.text
    probs = np.array([d["probs"] for d in invoked.json()["data"]], dtype=np.float32)
    assert np.abs(probs - cross_engine.classify(TEXTS)).max() <= TOLERANCE
    assert (
        np.abs(
            _vectors(server.post("/invocations", {"input": TEXTS})) - emb_engine.embed(TEXTS)
        ).max()
        <= TOLERANCE
    )
    # TEI's bodies name no model: the first's, unless the URL's `model` query or SageMaker's
    # target-model header names another; /invocations takes the header too (the body's
    # `model` first).
    tei = server.post("/embed", {"inputs": TEXTS})
    assert tei.status_code == 200, tei.text
    assert np.abs(np.array(tei.json()) - emb_engine.embed(TEXTS)).max() <= TOLERANCE
    header = {"X-Amzn-SageMaker-Target-Model": "ce"}
    for named in (
        server.post("/embed?model=ce", {"inputs": TEXTS}),
        server.post("/embed", {"inputs": TEXTS}, headers=header),
    ):
        assert named.status_code == 200, named.text
        assert np.abs(np.array(named.json()) - cross_engine.embed(TEXTS)).max() <= TOLERANCE
    tei_rerank = server.post("/invocations", {"query": QUERY, "texts": TEXTS}, headers=header)
    assert tei_rerank.status_code == 200, tei_rerank.text
    got = dict(sorted((r["index"], r["score"]) for r in tei_rerank.json()))
    assert np.abs(np.array([got[0], got[1]]) - np.array(expected)).max() <= TOLERANCE
    info = server.client.get("/info?model=reranker").json()
    assert info["model_id"] == "ce" and "reranker" in info["model_type"], info
    assert "embedding" in server.client.get("/info").json()["model_type"]
    invoked = server.post("/invocations", {"input": TEXTS}, headers=header)
    assert invoked.status_code == 200, invoked.text
    probs = np.array([d["probs"] for d in invoked.json()["data"]], dtype=np.float32)
    assert np.abs(probs - cross_engine.classify(TEXTS)).max() <= TOLERANCE
    body_first = server.post("/invocations", {"input": TEXTS, "model": "emb"}, headers=header)
    assert np.abs(_vectors(body_first) - emb_engine.embed(TEXTS)).max() <= TOLERANCE


def test_an_unknown_model_is_a_404_in_the_routes_shape(mm_server: Server) -> None:
    server = mm_server
    message = assert_error(
        server.post("/v1/embeddings", {"input": TEXTS, "model": "nope"}), 404, "model"
    )
    assert "'nope'" in message and all(f"'{n}'" in message for n in ("emb", "ce", "reranker"))
    assert_error(
        server.post("/v1/rerank", {"model": "nope", "query": QUERY, "documents": TEXTS}), 404
    )
    cohere = server.post(
        "/v2/embed", {"texts": TEXTS, "model": "nope", "embedding_types": ["float"]}
    )
    assert cohere.status_code == 404
    assert set(cohere.json()) == {"id", "message"} and "'nope'" in cohere.json()["message"]
    tei = server.post("/embed?model=nope", {"inputs": TEXTS})
    assert tei.status_code == 404 and "'nope'" in tei.json()["error"], tei.text
    invoked = server.post(
        "/invocations", {"input": TEXTS}, headers={"X-Amzn-SageMaker-Target-Model": "nope"}
    )
    assert_error(invoked, 404, "model")


def test_models_lists_every_model(mm_server: Server) -> None:
    for path in ("/v1/models", "/models"):
        data = mm_server.client.get(path).json()["data"]
        assert [(m["id"], m["hidden_size"]) for m in data] == [
            ("emb", 48),
            ("ce", 32),
            ("reranker", 32),
        ]
        assert [m["score_mode"] for m in data] == ["embed", "cross_encoder", "cross_encoder"]
    # OpenAI's retrieve: one model under the name asked for, as the list has it.
    listed = {m["id"]: m for m in data}
    for name in ("emb", "reranker"):
        response = mm_server.client.get(f"/v1/models/{name}")
        assert response.status_code == 200, response.text
        got = response.json()
        assert {k: v for k, v in got.items() if k != "stats"} == {
            k: v for k, v in listed[name].items() if k != "stats"
        }
    assert "'nope'" in assert_error(mm_server.client.get("/v1/models/nope"), 404, "model")
    long = assert_error(mm_server.client.get("/v1/models/" + "x" * 10_000), 404, "model")
    assert len(long) < 300  # the name asked for is cut in the message


def test_engine_metrics_carry_the_model(mm_server: Server) -> None:
    """Each model's engine counts its own steps and the tokens of the calls sent to it."""
    server = mm_server
    before = {
        m: server.metric("vecpool_engine_answered_tokens_total", engine="0", model=m)
        for m in ("emb", "ce")
    }
    steps = {m: server.metric("vecpool_engine_steps_total", model=m) for m in ("emb", "ce")}
    tokens = {}
    for name, texts in (("emb", TEXTS), ("ce", TEXTS[:1])):
        response = server.post("/v1/embeddings", {"input": texts, "model": name})
        assert response.status_code == 200, response.text
        tokens[name] = response.json()["usage"]["prompt_tokens"]
    for m in ("emb", "ce"):
        answered = server.metric("vecpool_engine_answered_tokens_total", engine="0", model=m)
        assert answered - before[m] == tokens[m]
        server.wait_for("vecpool_engine_steps_total", lambda v, m=m: v > steps[m], model=m)
    assert tokens["emb"] != tokens["ce"]  # the counts cannot be swapped unnoticed
    for m in ("emb", "ce"):
        assert server.metric("vecpool_engine_restarts_total", engine="0", model=m) == 0


def test_a_killed_engine_fails_its_calls_and_the_other_model_serves(
    mm_server: Server,
    mm_gate: EngineGate,
    emb_engine: vecpool.Engine,
    cross_engine: vecpool.Engine,
) -> None:
    """Both engines held before their next step (the gate): a call for "ce" waits in its
    engine, which is killed; the call fails while the gate is still closed (nothing else could
    have answered it), /health names the engine and its model, a new "ce" call is refused,
    and once the gate opens "emb" serves. The supervisor, held with SIGSTOP meanwhile, then
    restarts the "ce" engine, which serves again; the restart is counted for "ce" only."""
    server = mm_server
    emb_pid, ce_pid = _engine_pids(server)
    results: list[httpx.Response] = []
    caller = threading.Thread(
        target=lambda: results.append(
            server.post("/v1/embeddings", {"input": TEXTS, "model": "ce"})
        )
    )
    os.kill(server.process.pid, signal.SIGSTOP)  # hold the supervisor: no restart yet
    try:
        with mm_gate.held():
            caller.start()
            server.wait_for("vecpool_queue_size", lambda v: v == len(TEXTS), 60, model="ce")
            os.kill(ce_pid, signal.SIGKILL)
            caller.join(timeout=60)
            (failed,) = results
            assert "of model 'ce' exited" in assert_error(failed, 503)
            assert failed.headers["retry-after"] == "1"
            health = server.client.get("/health")
            assert "the engine process of model 'ce' exited" in assert_error(health, 503)
            assert "'emb'" not in health.json()["error"]["message"]
            refused = server.post("/v1/embeddings", {"input": TEXTS, "model": "reranker"})
            assert "of model 'ce'" in assert_error(refused, 503)
            assert refused.headers["retry-after"] == "1"
        # The gate open: the other model serves while the killed one is down.
        emb = server.post("/v1/embeddings", {"input": TEXTS, "model": "emb"})
        assert np.abs(_vectors(emb) - emb_engine.embed(TEXTS)).max() <= TOLERANCE
        assert server.client.get("/health").status_code == 503
    finally:
        os.kill(server.process.pid, signal.SIGCONT)

    server.wait_healthy()
    assert server.metric("vecpool_engine_restarts_total", engine="0", model="ce") == 1
    assert server.metric("vecpool_engine_restarts_total", engine="0", model="emb") == 0
    ce = server.post("/v1/embeddings", {"input": TEXTS, "model": "ce"})
    assert np.abs(_vectors(ce) - cross_engine.embed(TEXTS)).max() <= TOLERANCE
    assert _alive(emb_pid)  # the other model's engine served throughout, never restarted
    # The first model's engine killed in turn: a call naming no model (or it) is refused
    # naming that model, with when to retry, not as if every engine were gone.
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        os.kill(emb_pid, signal.SIGKILL)
        for body in ({"input": TEXTS}, {"input": TEXTS, "model": "emb"}):
            deadline = time.monotonic() + 30
            while (refused := server.post("/v1/embeddings", body)).status_code == 200:
                assert time.monotonic() < deadline  # until the loss is seen
                time.sleep(0.05)
            message = assert_error(refused, 503)
            assert "of model 'emb' exited" in message and "every engine" not in message
            assert refused.headers["retry-after"] == "1"
        ce = server.post("/v1/embeddings", {"input": TEXTS, "model": "ce"})
        assert np.abs(_vectors(ce) - cross_engine.embed(TEXTS)).max() <= TOLERANCE
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    server.wait_healthy()


# ---- refusals at start, before any model loads ----------------------------------------------


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_that_differ_by_model_are_given_once_per_model(tmp_path: Path) -> None:
    """An embedder and an LLM reranker: the reranker's template, lengths and dtype given per
    model ("auto" / "none": as the folder says); options given once apply to both."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = _serve_args(
        a, b,
        "--llm-reranker", "none", "--llm-reranker", "qwen3",
        "--max-model-len", "auto", "--max-model-len", "64",
        "--score-mode", "embed", "--score-mode", "auto",
        "--dtype", "bfloat16",
        "--max-num-seqs", "8",
    )  # fmt: skip
    first, second = EngineArgs.per_model(args)
    assert (first.llm_reranker, second.llm_reranker) == (None, LLMRerankerConfig.qwen3())
    assert (first.max_model_len, second.max_model_len) == (None, 64)
    assert (first.score_mode, second.score_mode) == ("embed", None)
    assert first.dtype == second.dtype == "bfloat16"
    assert first.max_num_seqs == second.max_num_seqs == 8
    with pytest.raises(ConfigError, match="--max-model-len is given 3 times for 2 models"):
        EngineArgs.per_model(_serve_args(a, b, *["--max-model-len", "8"] * 3))
    # One model: each option once, as before.
    (alone,) = EngineArgs.per_model(_serve_args(a, "--max-model-len", "32"))
    assert alone.max_model_len == 32 and alone.llm_reranker is None
    with pytest.raises(ConfigError, match="--dtype is given 2 times for 1 model:"):
        EngineArgs.per_model(_serve_args(a, "--dtype", "float32", "--dtype", "bfloat16"))


def test_memory_shares_one_per_model_or_split_evenly(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    split = EngineArgs.per_model(_serve_args(a, b, "--gpu-memory-fraction", "0.8"))
    assert [m.gpu_memory_fraction for m in split] == [0.4, 0.4]
    assert [Path(str(m.model)).name for m in split] == ["a", "b"]
    each = EngineArgs.per_model(
        _serve_args(a, b, "--gpu-memory-fraction", "0.3", "--gpu-memory-fraction", "0.5")
    )
    assert [m.gpu_memory_fraction for m in each] == [0.3, 0.5]
    assert [m.gpu_memory_fraction for m in EngineArgs.per_model(_serve_args(a, b))] == [None, None]
    with pytest.raises(ConfigError, match="given 3 times for 2 models"):
        EngineArgs.per_model(_serve_args(a, b, *["--gpu-memory-fraction", "0.2"] * 3))
    with pytest.raises(ConfigError, match=r"gpu_memory_fraction must be in \(0, 1\]"):
        EngineArgs.per_model(_serve_args(a, "--gpu-memory-fraction", "1.5"))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--gpu-memory-fraction", "0.6", "--gpu-memory-fraction", "0.5"],
            "add up to 1.1, more than the whole of a device",
        ),
        (["--served-model-name", "x"], "--served-model-name is given 1 times for 2 models"),
        (
            ["--served-model-name", "x", "--served-model-name", "x"],
            "the served model name 'x' is given twice",
        ),
        (["--api-server-count", "0"], "2 models run one engine process each"),
    ],
)
def test_what_does_not_fit_is_refused_at_start(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The folders need not exist: each refusal comes before any model loads.
    args = _serve_args(str(tmp_path / "a"), str(tmp_path / "b"), "--device", "cpu", *argv)
    assert serve(args) == 2
    assert words in capsys.readouterr().err


def test_server_config_keeps_each_models_names() -> None:
    config = ServerConfig(model_names=("a", "a2"), other_model_names=(("b",),))
    assert config.served_model_names == (("a", "a2"), ("b",)) and config.model_name == "a"
    with pytest.raises(ConfigError, match="model name"):
        ServerConfig(model_names=("a",), other_model_names=((),))
