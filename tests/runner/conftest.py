"""What the runner's tests share: a tiny random Qwen3 (grouped-query attention, 3 layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.helpers import save_hf_model

VOCAB = 101


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    return save_hf_model(transformers.Qwen3Model(cfg).eval(), tmp_path_factory.mktemp("qwen3"))
