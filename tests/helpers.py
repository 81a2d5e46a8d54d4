"""Test helpers: tiny Hugging Face models saved as model folders, and reference outputs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
import torch

import vecpool


def save_hf_model(hf_model: Any, path: Path, **extra_config: Any) -> Path:
    """Save a `transformers` model as a safetensors folder; merge `extra_config` into config.json."""
    hf_model.save_pretrained(str(path), safe_serialization=True)
    if extra_config:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(extra_config)
        cfg_path.write_text(json.dumps(cfg))
    return path


def write_st_modules(
    folder: Path, hidden_size: int, pooling: str, max_seq_length: int | None = 64
) -> Path:
    """Make `folder` (a saved model) a sentence-transformers folder: Transformer, a Pooling
    module of `pooling` ("mean_tokens", "cls_token", ...), then Normalize."""
    kinds = ("Transformer", "Pooling", "Normalize")
    paths = ("", "1_Pooling", "2_Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(zip(kinds, paths, strict=True))
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden_size, f"pooling_mode_{pooling}": True})
    )
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
        )
    return folder


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids drawn from [3, vocab_size): no pad or specials)."""
    gen = np.random.default_rng(seed)
    return [gen.integers(3, vocab_size, size=n).tolist() for n in lengths]


@torch.no_grad()
def hf_last_hidden(hf_model: Any, ids: list[int], **kwargs: Any) -> np.ndarray:
    """`[n, hidden]` final hidden states of one unpadded prompt from a `transformers` model."""
    out = hf_model(input_ids=torch.tensor([ids]), output_hidden_states=True, **kwargs)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out.hidden_states[-1]
    return hidden[0].float().numpy()


def padded_cpu_attention(engine: vecpool.Engine) -> vecpool.Engine:
    """`engine` with its CPU attention in the padded layout, which compiled blocks run: an
    eager engine compared bit for bit with compiled blocks must run it too. The way its machine
    measured (`cpu_choice`: by groups of lengths or by sequence; a loaded machine picks the
    latter) is the same attention within an ulp, in another kernel blocking, not bit for bit."""
    runner = engine.model_runner
    if runner.cpu_choice is not None:
        runner.cpu_choice = dataclasses.replace(runner.cpu_choice, attention="padded")
    return engine


def engine_hidden(engine: vecpool.Engine, inputs: list[Any]) -> list[np.ndarray]:
    """Un-normalized final hidden states per token, from one engine call (one flat batch)."""
    return engine.encode(inputs, task="token_embed", normalize=False)


# Two fp32 runs of one model whose kernels differ in shape (another batch, thread count or CPU
# model) sum in another order: an ulp or two per operation, compounded over the layers (~1e-6
# of the largest magnitude has been seen). They are compared to 1e-5 of it: the precision
# parity with transformers is held to, which is the same arithmetic in another order too.
REORDERED_RTOL = 1e-5


def assert_rel_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-5) -> None:
    """Max abs difference within `rtol` of the reference's largest magnitude."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = float(np.abs(expected).max())
    diff = float(np.abs(actual - expected).max())
    assert diff <= rtol * scale, f"max abs diff {diff:.3e} > {rtol:g} * {scale:.3e}"


def run_interpreted(script: str, *args: str) -> Any:
    """`script`'s last printed line, as JSON, from a process of its own under Triton's
    interpreter (chosen when Triton is imported, which torch may have done here already)."""
    done = subprocess.run(
        [sys.executable, script, *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def pipeline_chunks(monkeypatch: pytest.MonkeyPatch, first: int, chunk: int) -> list[int]:
    """The sizes of the chunks the engines' calls are prepared in from now on, in order, with a
    first chunk of `first` and later ones of `chunk` (texts, or their weight)."""
    import vecpool.api.running as running

    monkeypatch.setattr(running, "PIPELINE_CHUNK", chunk)
    monkeypatch.setattr(running, "PIPELINE_FIRST_CHUNK", first)
    sizes: list[int] = []
    prepare = running.calls.prepare_encode

    def counted(ctx: Any, items: Any, options: Any) -> Any:
        sizes.append(len(items))
        return prepare(ctx, items, options)

    monkeypatch.setattr(running.calls, "prepare_encode", counted)
    return sizes


def batch_sizes_of(monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> list[int]:
    """The sizes of the batches `cls.method` is called with from now on (its first argument
    after `self`), in order; the method still runs."""
    sizes: list[int] = []
    original = getattr(cls, method)

    def counted(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(batch))
        return original(self, batch, *args, **kwargs)

    monkeypatch.setattr(cls, method, counted)
    return sizes


class StopOnSigterm:
    """The test run's SIGTERM handler: the running test finishes, then the run stops as an
    interrupted one does (exit status 2), every fixture torn down (servers stopped, Ray shut
    down). A second SIGTERM interrupts the running test at once (`KeyboardInterrupt`, torn
    down the same way). Python's default would end the process at once, leaving the servers
    a test started; Ray's (`ray.init` installs one) raises `SystemExit` in the running test,
    which pytest counts as that test's failure before it goes on with the next."""

    def __init__(self, session: pytest.Session):
        self.session = session
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            raise KeyboardInterrupt("a second SIGTERM")
        self.received = True
        self.session.shouldstop = "SIGTERM: stopped after the test that was running"
