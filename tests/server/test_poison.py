"""A poison input sent alone, again and again, to a live `vecpool serve`: each one fails alone
(a 4xx naming the fault), /health stays 200, and the next good input is served.

The fault is injected in every process of the server by a `sitecustomize` module on
PYTHONPATH (test-only, written here): the default model's embedding lookup raises when it
meets the marked token id, as a kernel fault or a bug that one input triggers would.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import vecpool
from tests.server.conftest import Server, ServerPool, ServerSpec

POISON = 9947  # "poison" in the MiniLM vocabulary; not among the probe's tokens

# The fault goes in where the BERT module is first imported (the engine process, as it builds
# the model): importing it at every interpreter's start put torch into each of the server's
# processes, and tripled its start.
_SITECUSTOMIZE = """
import importlib.abc
import importlib.util
import os
import sys

_TARGET = "vecpool.models.architectures.bert"


def _install(bert):
    poison = int(os.environ["VECPOOL_TEST_POISON_ID"])
    lookup = bert.BertModel.embed_input_ids

    def faulty_lookup(self, input_ids):
        if bool((input_ids == poison).any()):
            raise RuntimeError(f"injected fault on token id {poison}")
        return lookup(self, input_ids)

    bert.BertModel.embed_input_ids = faulty_lookup


class _Faulty(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # the module's own spec, found as without this finder
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            _install(module)

        spec.loader.exec_module = exec_and_install
        return spec


if os.environ.get("VECPOOL_TEST_POISON_ID"):
    sys.meta_path.insert(0, _Faulty())
"""


def _poisoned_env(folder: Path) -> dict[str, str]:
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return {"PYTHONPATH": str(site), "VECPOOL_TEST_POISON_ID": str(POISON)}


SERVERS = {"poisoned": ServerSpec(env=_poisoned_env)}


@pytest.fixture
def poisoned(server_pool: ServerPool, request: pytest.FixtureRequest) -> Server:
    return server_pool.take(request, "poisoned")


def test_poison_inputs_sent_alone_to_a_live_server(
    poisoned: Server, minilm: vecpool.Engine
) -> None:
    server = poisoned
    try:
        good = "a good sentence after the bad ones"
        for i in range(10):
            response = server.post("/v1/embeddings", {"input": [101, 7592, POISON, 2000 + i, 102]})
            assert response.status_code == 400, response.text
            assert f"injected fault on token id {POISON}" in response.json()["error"]["message"]
            assert server.client.get("/health").status_code == 200
        response = server.post("/v1/embeddings", {"input": good})
        assert response.status_code == 200, response.text
        served = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
        # The server's engine and this one run the same model on the same CPU; the batch
        # differs (none here, the probe there), so within an ulp or two of fp32.
        np.testing.assert_allclose(served, minilm.embed([good])[0], atol=1e-6)
        assert server.process.poll() is None
    finally:
        server.stop()
    assert "injected fault" in server.log.read_text()
