"""Sequence and token classification heads against Hugging Face transformers (same random
weights, fp32): BERT, RoBERTa and every decoder architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import assert_rel_close, random_prompts, save_hf_model
from tests.models.test_decoders import ARCH_IDS, ARCHS
from vecpool.pooling.heads import classifier_activation

LENGTHS = [3, 9, 17, 30]
NUM_LABELS = 3
TAG = 42
MODELS = ["bert", "roberta", *ARCH_IDS]
TOKEN_MODELS = [m for m in MODELS if m != "gemma3"]  # transformers has no Gemma3 token classifier


def _hf_model(name: str, head: str, **overrides: Any) -> tuple[Any, int]:
    """(transformers `*For{head}` model, vocab size) of a tiny random config."""
    torch.manual_seed(0)
    if name in ("bert", "roberta"):
        kind = "Bert" if name == "bert" else "Roberta"
        config: Any = tiny_bert_config(initializer_range=0.2, **overrides)
        if name == "roberta":
            config = transformers.RobertaConfig(**{**config.to_dict(), "type_vocab_size": 1})
        return getattr(transformers, f"{kind}For{head}")(config).eval(), config.vocab_size
    arch = next(a for a in ARCHS if a.name == name)
    cls = getattr(transformers, arch.base.__name__.replace("Model", f"For{head}"))
    config = arch.hf_config(**overrides)
    return cls(config).eval(), config.vocab_size


def _load(name: str, head: str, tmp: Path, **overrides: Any) -> tuple[Any, int, vecpool.Engine]:
    hf, vocab = _hf_model(name, head, num_labels=NUM_LABELS, **overrides)
    return hf, vocab, vecpool.Engine(save_hf_model(hf, tmp), device="cpu")


@pytest.mark.parametrize("name", MODELS)
def test_sequence_classification_matches_transformers(name: str, tmp_path: Path) -> None:
    hf, vocab, engine = _load(name, "SequenceClassification", tmp_path)
    assert type(engine.model).__name__ == type(hf).__name__
    prompts = random_prompts(vocab, LENGTHS, seed=1)
    raw = engine.classify(prompts, use_activation=False)  # one flat batch
    probs = engine.classify(prompts)
    assert raw.shape == probs.shape == (len(prompts), NUM_LABELS)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt])).logits[0]
        assert_rel_close(raw[i], expected.numpy())
        assert_rel_close(probs[i], torch.softmax(expected, -1).numpy())
    assert engine.id2label == {i: f"LABEL_{i}" for i in range(NUM_LABELS)}


@pytest.mark.parametrize("name", TOKEN_MODELS)
def test_token_classification_matches_transformers(name: str, tmp_path: Path) -> None:
    hf, vocab, engine = _load(name, "TokenClassification", tmp_path)
    prompts = random_prompts(vocab, LENGTHS, seed=2)
    raw = engine.encode(prompts, task="token_classify", use_activation=False)
    probs = engine.encode(prompts, task="token_classify")
    for prompt, ours, ours_probs in zip(prompts, raw, probs, strict=True):
        with torch.no_grad():
            expected = hf(input_ids=torch.tensor([prompt])).logits[0]
        assert ours.shape == (len(prompt), NUM_LABELS)
        assert_rel_close(ours, expected.numpy())
        assert_rel_close(ours_probs, torch.softmax(expected, -1).numpy())


def test_token_classification_step_selects_tagged_positions(tmp_path: Path) -> None:
    _, _, engine = _load("bert", "TokenClassification", tmp_path)
    prompts = [[5, TAG, 7, 8, TAG], [9, 10, 11], [TAG, 3]]
    # The forward is the same in both calls (the same batch); the classifier is not: STEP runs
    # it on the 4 tagged rows, ALL on all 10, and matmuls of different shapes may sum each
    # logit's 32 products in a different order (which order depends on the CPU model and the
    # thread count). That moves a logit by an fp32 rounding or two: here |logits| < 2, whose
    # ulp is 1.2e-7, and probabilities <= 1 move by less. 1e-6 is ~8 such ulps; any two rows
    # of these outputs differ by more than 1e-2.
    for use_activation in (False, True):
        full = engine.encode(prompts, task="token_classify", use_activation=use_activation)
        steps = engine.encode(
            prompts, task="token_classify", step_tag_id=TAG, use_activation=use_activation
        )
        assert max(float(np.abs(rows).max()) for rows in full) < 2  # the scale the 1e-6 is for
        for prompt, rows, sel in zip(prompts, full, steps, strict=True):
            positions = [i for i, t in enumerate(prompt) if t == TAG]
            assert sel.shape == (len(positions), NUM_LABELS)
            if positions:
                assert np.abs(sel - rows[positions]).max() <= 1e-6


@pytest.mark.parametrize(
    ("config", "num_labels", "expected"),
    [
        ({}, 1, "sigmoid"),
        ({}, 3, "softmax"),
        ({"problem_type": "multi_label_classification"}, 3, "sigmoid"),
        ({"problem_type": "regression"}, 1, "identity"),
        (
            {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
            1,
            "identity",
        ),
        ({"sbert_ce_default_activation_function": "torch.nn.Sigmoid"}, 2, "sigmoid"),
    ],
)
def test_classifier_activation(config: dict[str, Any], num_labels: int, expected: str) -> None:
    assert classifier_activation(config, num_labels) == expected


@pytest.mark.parametrize("problem_type", ["multi_label_classification", "regression"])
def test_problem_type_sets_the_activation(problem_type: str, tmp_path: Path) -> None:
    _, vocab, engine = _load("llama", "SequenceClassification", tmp_path, problem_type=problem_type)
    prompts = random_prompts(vocab, [4, 7], seed=3)
    raw = engine.classify(prompts, use_activation=False)
    activated = 1 / (1 + np.exp(-raw)) if problem_type != "regression" else raw
    assert np.abs(engine.classify(prompts) - activated).max() < 1e-6


def test_reward_model_is_one_label(tmp_path: Path) -> None:
    hf, vocab = _hf_model("qwen3", "SequenceClassification", num_labels=1)
    engine = vecpool.Engine(save_hf_model(hf, tmp_path), device="cpu")
    prompt = random_prompts(vocab, [12], seed=4)[0]
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([prompt])).logits[0]
    (raw,) = engine.classify([prompt], use_activation=False)
    assert_rel_close(raw, expected.numpy())
    assert np.allclose(engine.classify([prompt])[0], torch.sigmoid(expected).numpy(), atol=1e-6)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("classify", "has no sequence-classification head"),
        ("token_classify", "has no token-classification head"),
        ("sparse", "has no masked-LM head"),
        ("score", "is neither a cross-encoder"),
    ],
)
def test_task_without_head_is_refused(
    tiny_bert_engine: vecpool.Engine, task: str, message: str
) -> None:
    with pytest.raises(
        vecpool.InputError, match=rf"cannot serve task '{task}': BertModel {message}"
    ):
        tiny_bert_engine.pool([[5, 6, 7]], vecpool.PoolingParams(task=task))
