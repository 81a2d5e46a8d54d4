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
from tests.server.conftest import start_server

POISON = 9947  # "poison" in the MiniLM vocabulary; not among the probe's tokens

_SITECUSTOMIZE = """
import os

if os.environ.get("VECPOOL_TEST_POISON_ID"):
    import vecpool.models.architectures.bert as bert

    _poison = int(os.environ["VECPOOL_TEST_POISON_ID"])
    _lookup = bert.BertModel.embed_input_ids

    def _faulty_lookup(self, input_ids):
        if bool((input_ids == _poison).any()):
            raise RuntimeError(f"injected fault on token id {_poison}")
        return _lookup(self, input_ids)

    bert.BertModel.embed_input_ids = _faulty_lookup
"""


def test_poison_inputs_sent_alone_to_a_live_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, minilm: vecpool.Engine
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("VECPOOL_TEST_POISON_ID", str(POISON))
    server = start_server(tmp_path)
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
