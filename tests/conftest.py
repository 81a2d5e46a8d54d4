"""Shared fixtures: the real default model, and tiny random BERT folders."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import vecpool
from tests.helpers import StopOnSigterm, save_hf_model


def pytest_configure(config: pytest.Config) -> None:
    # torch sizes its thread pool from the cores it sees and ignores an OMP_NUM_THREADS above
    # that; honour the variable, so that the suite can be run at any thread count (results that
    # depend on it are compared with a stated tolerance). Two threads otherwise.
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else 2)
    # The CPU path's per-machine choice (`vecpool.runner.cpu_choice`) is measured once per
    # model shape and cached: in a folder of the run's own (its subprocesses inherit it), not
    # the user's cache, so that a run neither reads a choice made elsewhere nor leaves one.
    os.environ.setdefault("VECPOOL_CACHE_DIR", tempfile.mkdtemp(prefix="vecpool-tests-"))


def pytest_sessionstart(session: pytest.Session) -> None:
    # A SIGTERM stops the run after the running test, fixtures torn down (`StopOnSigterm`).
    signal.signal(signal.SIGTERM, StopOnSigterm(session))


@pytest.fixture(autouse=True)
def _torch_threads_kept() -> Iterator[None]:
    """torch's thread count as it was before each test (a benchmark's `main` run in process
    may set its own): the tests after it, and the servers they size from it, see the suite's."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return vecpool.api.default_model_path()


@pytest.fixture(scope="session")
def minilm(default_model_dir: Path) -> vecpool.Engine:
    """The real all-MiniLM-L6-v2, as the default model."""
    return vecpool.Engine(device="cpu")


def tiny_bert_config(**overrides: Any) -> transformers.BertConfig:
    kwargs: dict[str, Any] = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return transformers.BertConfig(**kwargs)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """(folder, HF model) of a random 2-layer BERT with no tokenizer."""
    torch.manual_seed(0)
    model = transformers.BertModel(tiny_bert_config()).eval()
    folder = save_hf_model(model, tmp_path_factory.mktemp("tiny_bert"))
    yield folder, model


@pytest.fixture(scope="session")
def tiny_bert_engine(tiny_bert: tuple[Path, Any]) -> vecpool.Engine:
    return vecpool.Engine(tiny_bert[0], device="cpu")


def make_st_folder(
    dest: Path,
    default_model_dir: Path,
    *,
    pooling: str = "pooling_mode_cls_token",
    dense_out: int | None = 24,
    normalize: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
) -> Path:
    """A sentence-transformers folder: a tiny random BERT with the real MiniLM tokenizer,
    a Pooling module, optionally a Dense projection and Normalize."""
    torch.manual_seed(1)
    bert = transformers.BertModel(tiny_bert_config(vocab_size=30522, max_position_embeddings=128))
    save_hf_model(bert.eval(), dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(default_model_dir / name, dest / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (dest / "1_Pooling").mkdir()
    modes = (
        "cls_token",
        "mean_tokens",
        "max_tokens",
        "mean_sqrt_len_tokens",
        "weightedmean_tokens",
        "lasttoken",
    )
    pool_cfg = {f"pooling_mode_{m}": f"pooling_mode_{m}" == pooling for m in modes}
    (dest / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, **pool_cfg})
    )
    if dense_out is not None:
        from safetensors.torch import save_file

        (dest / "2_Dense").mkdir()
        (dest / "2_Dense" / "config.json").write_text(
            json.dumps(
                {
                    "in_features": 32,
                    "out_features": dense_out,
                    "bias": True,
                    "activation_function": "torch.nn.modules.activation.Tanh",
                }
            )
        )
        gen = torch.Generator().manual_seed(2)
        save_file(
            {
                "linear.weight": torch.randn(dense_out, 32, generator=gen) * 0.2,
                "linear.bias": torch.randn(dense_out, generator=gen) * 0.1,
            },
            str(dest / "2_Dense" / "model.safetensors"),
        )
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
        )
    if normalize:
        modules.append(
            {
                "idx": len(modules),
                "name": str(len(modules)),
                "path": f"{len(modules)}_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (dest / "modules.json").write_text(json.dumps(modules))
    (dest / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False})
    )
    st_cfg: dict[str, Any] = {"prompts": prompts or {}, "default_prompt_name": default_prompt_name}
    (dest / "config_sentence_transformers.json").write_text(json.dumps(st_cfg))
    return dest
