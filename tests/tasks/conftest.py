"""Fixtures of the task tests: tiny random checkpoints of each head, with real tokenizers where
the test needs text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import save_hf_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)
WORDPIECE_VOCAB = 30522  # the MiniLM tokenizer's


def with_minilm_tokenizer(folder: Path, default_model_dir: Path) -> Path:
    """Copy the real all-MiniLM-L6-v2 tokenizer files into `folder`."""
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, folder / name)
    return folder


def tiny_bert_head(cls: Any, **overrides: Any) -> Any:
    """A random tiny BERT `*For*` model on the MiniLM vocabulary (weights large enough that
    scores differ between inputs)."""
    torch.manual_seed(3)
    config = tiny_bert_config(
        vocab_size=WORDPIECE_VOCAB, max_position_embeddings=128, initializer_range=0.2
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return cls(config).eval()


@pytest.fixture(scope="session")
def cross_encoder(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> tuple[Path, Any]:
    """(folder, HF model): a one-label BertForSequenceClassification with the MiniLM tokenizer."""
    hf = tiny_bert_head(transformers.BertForSequenceClassification, num_labels=1)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("cross_encoder"))
    return with_minilm_tokenizer(folder, default_model_dir), hf


@pytest.fixture(scope="session")
def cross_encoder_engine(cross_encoder: tuple[Path, Any]) -> vecpool.Engine:
    return vecpool.Engine(cross_encoder[0], device="cpu")


@pytest.fixture(scope="session")
def splade(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, Any]:
    """(folder, HF model): a BertForMaskedLM with the MiniLM tokenizer (SPLADE's layout)."""
    hf = tiny_bert_head(transformers.BertForMaskedLM)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("splade"))
    return with_minilm_tokenizer(folder, default_model_dir), hf


@pytest.fixture(scope="session")
def splade_engine(splade: tuple[Path, Any]) -> vecpool.Engine:
    return vecpool.Engine(splade[0], device="cpu")


@pytest.fixture(scope="session")
def colbert(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> tuple[Path, Any, torch.Tensor]:
    """(folder, HF BertModel, projection): an `HF_ColBERT` checkpoint as colbert-ir ships it:
    `bert.`-prefixed encoder, a bias-free `linear.weight`, no projection size in config.json."""
    hf = tiny_bert_head(transformers.BertModel, add_pooling_layer=False)
    folder = tmp_path_factory.mktemp("colbert")
    hf.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["HF_ColBERT"]
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(5)
    linear = torch.randn(16, 32, generator=gen) * 0.3
    tensors = {f"bert.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    save_file({**tensors, "linear.weight": linear}, str(folder / "model.safetensors"))
    return with_minilm_tokenizer(folder, default_model_dir), hf, linear
