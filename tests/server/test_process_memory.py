"""`vecpool serve --api-server-count 2`: torch is loaded in the engine process only.

Each process's mapped files (`/proc/PID/maps`) say whether it loaded torch's library: the
supervisor (the launcher) and both API processes must not have, before or after they served
calls that decode `torch.save` prompt embeds and encode bfloat16 / fp8 vectors (the paths that
used torch); the engine process must have. Each process's resident memory is printed (run with
`-s`): docs/SERVING.md "Process memory" quotes it.
"""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import vecpool
from tests.server.conftest import Server, ServerPool, ServerSpec
from tests.server.test_processes import _pids

TEXTS = ["a cat sat on the mat", "vecpool serves pooling models"]


def _loads_torch(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps  # libtorch_cpu.so / libtorch_cuda.so, mapped by `import torch`


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


SERVERS = {
    "two_apis": ServerSpec(
        lambda folder: ["--api-server-count", "2", "--enable-prompt-embeds"], log_level="info"
    )
}


@pytest.fixture(scope="module")
def two_apis(server_pool: ServerPool, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = server_pool.take(request, "two_apis")
    yield srv
    srv.stop()


def test_torch_only_in_the_engine_process(two_apis: Server, minilm: vecpool.Engine) -> None:
    engine, apis = _pids(two_apis)
    launcher = two_apis.process.pid
    # Calls over the paths that used torch on the API side; each API process takes some (the
    # kernel spreads connections), so send enough that both serve.
    tensor = minilm.embed_tokens(minilm.tokenize(TEXTS[0])).to(torch.bfloat16)
    buf = io.BytesIO()
    torch.save(tensor, buf)
    embeds = base64.b64encode(buf.getvalue()).decode()
    for _ in range(8):
        response = two_apis.post("/v1/embeddings", {"input": [{"prompt_embeds": embeds}]})
        assert response.status_code == 200, response.text
        for dtype in ("bfloat16", "fp8_e4m3"):
            body = {"input": TEXTS, "embed_dtype": dtype, "encoding_format": "base64"}
            assert two_apis.post("/v1/embeddings", body).status_code == 200
    expected = minilm.embed({"prompt_embeds": tensor})
    got = np.asarray(response.json()["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_array_equal(got, expected[0])  # bf16 embeds decoded without torch: exact
    assert _loads_torch(engine)
    for pid in (launcher, *apis):
        assert not _loads_torch(pid), f"pid {pid} loaded torch"
    print()
    print(f"RSS launcher (pid {launcher}): {_rss_mib(launcher):.0f} MiB")
    for pid in apis:
        print(f"RSS API process (pid {pid}): {_rss_mib(pid):.0f} MiB")
    print(f"RSS engine process (pid {engine}): {_rss_mib(engine):.0f} MiB")


def test_api_side_modules_import_no_torch() -> None:
    """What the launcher and the API processes import, imported alone: no torch, nothing of
    the engine (the import-linter contracts say the same of the import graph)."""
    code = (
        "import sys\n"
        "import vecpool, vecpool.calls, vecpool.cli.main, vecpool.server.app\n"
        "import vecpool.server.launcher, vecpool.server.routes, vecpool.server.served\n"
        "from vecpool.api import EngineArgs\n"
        "EngineArgs().replicas()\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('vecpool.engine', "
        "'vecpool.runner', 'vecpool.models', 'vecpool.pooling', 'vecpool.api.engine'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
