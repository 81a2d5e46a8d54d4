"""BERT-family encoders against Hugging Face transformers on the same random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import (
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
)

LENGTHS = [5, 17, 3, 30, 11]


def _roberta(tmp: Path) -> tuple[Path, Any]:
    torch.manual_seed(3)
    cfg = transformers.RobertaConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=66,
        type_vocab_size=1,
        pad_token_id=1,
        hidden_act="gelu_new",
    )
    model = transformers.RobertaModel(cfg).eval()
    return save_hf_model(model, tmp), model


@pytest.fixture(scope="module", params=["bert", "roberta"])
def encoder(request, tmp_path_factory, tiny_bert) -> tuple[vecpool.Engine, Any]:
    if request.param == "bert":
        folder, hf = tiny_bert
    else:
        folder, hf = _roberta(tmp_path_factory.mktemp("roberta"))
    return vecpool.Engine(folder, device="cpu"), hf


def test_hidden_states_match_transformers(encoder) -> None:
    engine, hf = encoder
    prompts = random_prompts(engine.model.vocab_size, LENGTHS)
    ours = engine_hidden(engine, prompts)
    for prompt, hidden in zip(prompts, ours, strict=True):
        assert_rel_close(hidden, hf_last_hidden(hf, prompt), rtol=1e-5)


def test_token_type_ids_reach_the_model(tiny_bert_engine, tiny_bert) -> None:
    from vecpool.inputs.prompts import Prompt

    _, hf = tiny_bert
    ids = random_prompts(99, [9])[0]
    types = [0] * 4 + [1] * 5
    prompt = Prompt(token_ids=np.asarray(ids), prompt_embeds=None, token_type_ids=np.asarray(types))
    engine = tiny_bert_engine
    # Drive the engine below the public API, as a text pair would arrive from the tokenizer.
    from vecpool.engine.request import Request
    from vecpool.tasks import TASKS, PoolingParams

    request = Request(
        "pair",
        prompt,
        PoolingParams(task="token_embed", normalize=False),
        TASKS["token_embed"],
    )
    engine.core.add_requests([request])
    engine.core.run_until_done([request])
    assert request.output is not None
    ref = hf_last_hidden(hf, ids, token_type_ids=torch.tensor([types]))
    assert_rel_close(request.output, ref)
    assert np.abs(request.output - hf_last_hidden(hf, ids)).max() > 1e-3


def test_prompt_embeds_bit_exact_alone_and_mixed(encoder) -> None:
    engine, _ = encoder
    prompts = random_prompts(engine.model.vocab_size, LENGTHS, seed=4)
    as_ids = engine_hidden(engine, prompts)
    embeds = [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts]
    as_embeds = engine_hidden(engine, embeds)
    mixed = engine_hidden(engine, [embeds[0], prompts[1], embeds[2], prompts[3], embeds[4]])
    # Bit-exact by construction: the embeds are the model's own lookup, written into the rows
    # the ids would fill (same prompts, same order), so the forward is the same computation.
    for a, b, c in zip(as_ids, as_embeds, mixed, strict=True):
        assert np.abs(a - b).max() == 0.0
        assert np.abs(a - c).max() == 0.0


def test_batch_invariance(encoder) -> None:
    engine, _ = encoder
    prompts = random_prompts(engine.model.vocab_size, [7, 2, 25, 13, 4, 19], seed=5)
    alone = [engine_hidden(engine, [p])[0] for p in prompts]
    together = engine_hidden(engine, prompts)
    pooled_alone = np.stack([engine.embed([p])[0] for p in prompts])
    pooled_together = engine.embed(prompts)
    for a, b in zip(alone, together, strict=True):
        assert np.abs(a - b).max() <= 1e-6
    assert np.abs(pooled_alone - pooled_together).max() <= 1e-6


def test_cls_pooling_is_the_first_row(tiny_bert_engine) -> None:
    # No sentence-transformers files: an encoder pools CLS and normalizes.
    engine = tiny_bert_engine
    prompts = random_prompts(99, [6, 12], seed=6)
    hidden = engine_hidden(engine, prompts)
    pooled = engine.embed(prompts)
    for h, v in zip(hidden, pooled, strict=True):
        np.testing.assert_allclose(v, h[0] / np.linalg.norm(h[0]), atol=1e-6)


def test_custom_bert_config_values(tmp_path) -> None:
    torch.manual_seed(7)
    hf = transformers.BertModel(
        tiny_bert_config(hidden_act="relu", layer_norm_eps=1e-5, type_vocab_size=3)
    ).eval()
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    prompt = random_prompts(99, [10], seed=8)[0]
    assert_rel_close(engine_hidden(engine, [prompt])[0], hf_last_hidden(hf, prompt))
