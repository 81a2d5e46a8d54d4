"""docs/grafana-dashboard.json reads only metrics the server exports.

Every metric name in the dashboard's PromQL (panels and template variables) must be a sample
of a live server's /metrics: two models (so that engine metrics carry `model`), prefix caching
on (so that its counters exist), after requests that succeeded and one that did not. A panel
that filters by `model` or `endpoint` reads a metric carrying that label, and a quantile reads
a histogram's buckets by `le`.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_prefix_cache import QWEN3, B, _shared
from tests.helpers import save_hf_model
from tests.server.conftest import Server, ServerPool, ServerSpec

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(vecpool_[a-z_]+)\b")


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables'
    queries."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _two_models_args(folder: Path) -> list[str]:
    """One tiny Qwen3 folder served twice ("first", "second"), with prefix caching."""
    model = save_hf_model(QWEN3.hf_model(), folder / "qwen3")
    return [
        *(str(model), str(model), "--served-model-name", "first", "--served-model-name", "second"),
        *("--device", "cpu", "--enable-prefix-caching", "--prefix-cache-tokens", "64"),
    ]


SERVERS = {"two_models": ServerSpec(_two_models_args)}


@pytest.fixture(scope="module")
def two_models(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    """The server after requests to both models that share a prefix, one refused call and a
    client gone mid-upload."""
    server = server_pool.take(request, "two_models")
    try:
        for model in ("first", "second"):
            body = {"input": _shared(2 * B + 1, [2, 7]), "model": model}
            response = server.post("/v1/embeddings", body)
            assert response.status_code == 200, response.text
        assert server.post("/pooling", {"input": "a", "task": "summarize"}).status_code == 400
        _leave_mid_upload(server)
        server.wait_for("vecpool_client_disconnects_total", lambda v: v > 0, endpoint="/pooling")
        server.wait_for("vecpool_prefix_cache_hit_tokens_total", lambda v: v > 0)
        yield server
    finally:
        server.stop()


def _leave_mid_upload(server: Server) -> None:
    """A client that sends part of its body and goes: counted as a disconnect."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST /pooling HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        sock.sendall(f'{head}content-length: 1000\r\n\r\n{{"input": '.encode())


def test_the_dashboard_is_grafana_json_with_a_model_variable(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] == "vecpool" and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "endpoint"} <= set(variables)
    assert variables["model"]["includeAll"] and variables["model"]["allValue"] == ".*"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("latency", "queue", "tokens / s", "restarts", "prefix cache"):
        assert topic in titles, topic
    # No two panels overlap on Grafana's 24-column grid.
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


def test_every_metric_the_dashboard_reads_is_exported(
    dashboard: dict[str, Any], two_models: Server
) -> None:
    text = two_models.client.get("/metrics").text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    exprs = _exprs(dashboard)
    read = {name for expr in exprs for name in METRIC.findall(expr)}
    assert len(read) >= 15  # every family the server exports but the process-level ones
    missing = sorted(read - set(labels))
    assert not missing, f"the dashboard reads metrics /metrics does not export: {missing}"
    for expr in exprs:
        for name in METRIC.findall(expr):
            for label in ("model", "endpoint"):
                if f"{label}=~" in expr:
                    assert label in labels[name], (name, label, expr)
        if "histogram_quantile" in expr:
            assert "by (le" in expr and all(n.endswith("_bucket") for n in METRIC.findall(expr))


def test_the_metrics_docs_name_what_the_dashboard_reads(dashboard: dict[str, Any]) -> None:
    """Each family the dashboard reads is listed in docs/server.md's metrics section."""
    docs = (DASHBOARD.parent / "server.md").read_text()
    suffixes = ("_bucket", "_total")
    for expr in _exprs(dashboard):
        for name in METRIC.findall(expr):
            family = next((name[: -len(s)] for s in suffixes if name.endswith(s)), name)
            assert family in docs, family
