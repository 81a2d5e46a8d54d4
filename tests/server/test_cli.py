"""The server's command line and wire codecs, without a server."""

from __future__ import annotations

import argparse
import base64
import io
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from vecpool.cli.serve import add_serve_arguments, serve
from vecpool.errors import ConfigError, InputError
from vecpool.server.codec import decode_prompt_embeds, parse_inputs, to_bytes
from vecpool.server.config import ServerConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_arguments_and_defaults() -> None:
    args = parse()
    assert args.model is None and args.port == 8000 and args.host == "127.0.0.1"
    assert not args.enable_prompt_embeds and args.api_key is None
    args = parse("some/folder", "--max-queued", "8", "--api-key", "k", "--no-normalize")
    assert args.model == "some/folder" and args.max_queued == 8 and args.normalize is False


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-queued", "4", "--max-batch-inputs", "8"], "above --max-queued=4"),
        (["--max-input-chars", "0"], "serve: --max-input-chars must be positive"),
        (["--max-model-len", "8", "--max-model-len", "9"], "--max-model-len is given 2 times"),
        (["--max-batch-inputs", "0"], "must be positive"),
        (["--max-payload-mb", "0"], "must be positive"),
        (["--api-key", ""], "must not be empty"),
        (["no/such/folder"], "does not exist"),
    ],
)
def test_serve_refuses_bad_settings(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve(parse(*argv)) == 2
    assert words in capsys.readouterr().err
    # The children's metrics directory is theirs: this process's environment is as it was.
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="model name"):
        ServerConfig(model_names=())
    assert ServerConfig(model_names=("a", "b")).model_name == "a"


def test_import_vecpool_stays_lean() -> None:
    code = (
        "import sys, vecpool, vecpool.server, vecpool.cli; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'pydantic', "
        "'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_module_entry_point_help() -> None:
    # `python -m vecpool serve` itself is what the server fixtures run.
    out = subprocess.run(
        [sys.executable, "-m", "vecpool", "serve", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--enable-prompt-embeds" in out.stdout


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_decode_npy_any_byte_order_and_torch_dtypes() -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    buf = io.BytesIO()
    np.save(buf, values.astype(">f4"))
    decoded = decode_prompt_embeds(b64(buf.getvalue()), 0)
    assert isinstance(decoded, np.ndarray) and decoded.dtype.isnative
    assert np.array_equal(decoded, values)
    # torch.save data is read without torch: the values of each dtype exactly (bfloat16
    # widened to float32), a view's own elements only.
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        tensor = torch.from_numpy(values).to(dtype)
        for saved in (tensor, tensor[1:, 1:3], tensor.t()):
            buf = io.BytesIO()
            torch.save(saved, buf)
            decoded = decode_prompt_embeds(b64(buf.getvalue()), 0)
            assert isinstance(decoded, np.ndarray) and list(decoded.shape) == list(saved.shape)
            assert np.array_equal(
                decoded, saved.float().numpy() if dtype == torch.bfloat16 else saved.numpy()
            )
    buf = io.BytesIO()
    torch.save({"embeds": torch.zeros(2, 4)}, buf)
    with pytest.raises(InputError, match="holds a dict, not a tensor") as err:
        decode_prompt_embeds(b64(buf.getvalue()), 3)
    assert err.value.index == 3 and err.value.field == "prompt_embeds"


def test_output_bytes() -> None:
    values = np.array([1.0, -2.5, 1 / 3, 3e-8], dtype=np.float32)
    assert to_bytes(values, "float32") == values.astype("<f4").tobytes()
    assert np.array_equal(np.frombuffer(to_bytes(values, "float16"), "<f2"), values.astype("<f2"))
    bf16 = torch.from_numpy(values).bfloat16().float().numpy()
    upper = np.frombuffer(to_bytes(values, "bfloat16"), "<u2").astype(np.uint32) << 16
    assert np.array_equal(upper.view(np.float32), bf16)


def test_parse_inputs_shapes() -> None:
    assert parse_inputs("a") == ["a"]
    assert parse_inputs([1, 2, 3]) == [[1, 2, 3]]
    assert parse_inputs(["a", [1, 2]]) == ["a", [1, 2]]
    with pytest.raises(InputError) as err:
        parse_inputs(["a", [1, True]])
    assert err.value.index == 1
