"""Tasks a model was not made for are refused unless the engine is asked to serve them.

A classifier's or cross-encoder's base model is not trained to embed, so `embed` and
`token_embed` on a *ForSequenceClassification / *ForTokenClassification checkpoint are refused
(as vLLM and Infinity refuse them), and a sequence classifier's head is not applied to every
token (vLLM serves `token_classify` on such a model only once its pooling task is switched).
`Engine(tasks=[...])` (`vecpool serve --task ...`) serves them; their outputs are then checked
against transformers running the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.helpers import save_hf_model
from tests.tasks.conftest import tiny_bert_head, with_minilm_tokenizer
from vecpool.errors import ConfigError

TEXTS = ["The food was delicious.", "A short one", "Paris is the capital of France."]
# The engine's float32 CPU forward against transformers' on the same weights: the same
# operations in other kernels and orders, a few ulp of float32 apart at these sizes.
TOL = 1e-5


def _folder(tmp: Path, default_model_dir: Path, cls: Any, **config: Any) -> tuple[Path, Any]:
    hf = tiny_bert_head(cls, **config)
    folder = save_hf_model(hf, tmp)
    return with_minilm_tokenizer(folder, default_model_dir), hf


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, Any]:
    """A one-label BertForSequenceClassification (a cross-encoder)."""
    tmp = tmp_path_factory.mktemp("refusal_cross")
    return _folder(tmp, default_model_dir, transformers.BertForSequenceClassification, num_labels=1)


@pytest.fixture(scope="module")
def classifier(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> tuple[Path, Any]:
    """A three-label BertForSequenceClassification."""
    tmp = tmp_path_factory.mktemp("refusal_classifier")
    return _folder(tmp, default_model_dir, transformers.BertForSequenceClassification, num_labels=3)


@pytest.fixture(scope="module")
def ner(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> tuple[Path, Any]:
    """A four-label BertForTokenClassification."""
    tmp = tmp_path_factory.mktemp("refusal_ner")
    return _folder(tmp, default_model_dir, transformers.BertForTokenClassification, num_labels=4)


def _hidden(hf: Any, text: str) -> tuple[torch.Tensor, list[int]]:
    """The base model's last hidden states of `text` (`[n, hidden]`) and its token ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf.name_or_path or ".")
    ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        out = hf.bert(torch.tensor([ids]))
    return out.last_hidden_state[0], ids


def _refused(call: Any, task: str) -> str:
    with pytest.raises(vecpool.InputError) as caught:
        call()
    assert caught.value.field == "task"
    message = str(caught.value.reason)
    # How to ask for it anyway: the engine option and the server flag.
    assert f"tasks=[{task!r}]" in message and f"vecpool serve --task {task}" in message
    return message


def test_a_cross_encoder_refuses_embed_and_token_embed_by_default(cross: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(cross[0], device="cpu")
    info = engine.info()
    assert info.tasks == ("classify", "score")
    assert set(info.opt_in_tasks) == {"embed", "token_embed", "token_classify"}
    message = _refused(lambda: engine.embed(TEXTS), "embed")
    assert message.startswith("Unsupported task: 'embed'")  # vLLM's words, first
    assert "cross-encoder" in message and "Supported tasks: classify, score" in message
    message = _refused(lambda: engine.encode(TEXTS, task="token_embed"), "token_embed")
    assert message.startswith("Unsupported task: 'token_embed'")
    # vLLM switches a sequence classifier's pooling task to token_classify when asked.
    message = _refused(lambda: engine.encode(TEXTS, task="token_classify"), "token_classify")
    assert message.startswith("Try switching the model's pooling_task via")
    # What it was made for is served as before.
    assert engine.score(TEXTS[0], TEXTS[1:]).shape == (2,)


def test_a_token_classifier_refuses_embed(ner: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(ner[0], device="cpu")
    assert engine.info().tasks == ("token_classify",)
    message = _refused(lambda: engine.embed(TEXTS), "embed")
    assert "BertForTokenClassification is a token classifier" in message
    assert len(engine.encode(TEXTS, task="token_classify")) == len(TEXTS)


def test_an_embedding_model_is_not_affected(default_model_dir: Path) -> None:
    engine = vecpool.Engine(default_model_dir, device="cpu", tokenizer_processes=0)
    assert engine.info().opt_in_tasks == {}
    assert "embed" in engine.info().tasks and "token_embed" in engine.info().tasks


def test_tasks_embed_serves_the_base_models_pooled_states(
    cross: tuple[Path, Any], classifier: tuple[Path, Any]
) -> None:
    for folder, hf in (cross, classifier):
        engine = vecpool.Engine(folder, device="cpu", tasks=["embed", "token_embed"])
        info = engine.info()
        assert {"embed", "token_embed"} <= set(info.tasks)
        assert "embed" not in info.opt_in_tasks and "token_embed" not in info.opt_in_tasks
        got = engine.embed(TEXTS)
        tokens = engine.encode(TEXTS, task="token_embed", normalize=False)
        hf.name_or_path = str(folder)
        for i, text in enumerate(TEXTS):
            hidden, ids = _hidden(hf, text)
            assert info.pooling in ("CLS", "MEAN")
            pooled = hidden[0] if info.pooling == "CLS" else hidden.mean(0)
            expected = torch.nn.functional.normalize(pooled, dim=0).numpy()
            assert np.abs(got[i] - expected).max() <= TOL
            assert tokens[i].shape == (len(ids), hidden.shape[1])
            assert np.abs(tokens[i] - hidden.numpy()).max() <= TOL


def test_tasks_token_classify_applies_the_sequence_head_to_every_token(
    classifier: tuple[Path, Any],
) -> None:
    folder, hf = classifier
    hf.name_or_path = str(folder)
    engine = vecpool.Engine(folder, device="cpu", tasks=("token_classify",))
    assert "token_classify" in engine.info().tasks
    logits = engine.encode(TEXTS, task="token_classify", use_activation=False)
    probs = engine.encode(TEXTS, task="token_classify")
    for i, text in enumerate(TEXTS):
        hidden, ids = _hidden(hf, text)
        with torch.no_grad():  # everything the head applies to the CLS row, on each row
            expected = hf.classifier(hf.bert.pooler.activation(hf.bert.pooler.dense(hidden)))
        assert logits[i].shape == (len(ids), 3)
        assert np.abs(logits[i] - expected.numpy()).max() <= TOL
        assert np.abs(probs[i] - torch.softmax(expected, -1).numpy()).max() <= TOL
    # The sequence task is unchanged by the option.
    sequence = vecpool.Engine(folder, device="cpu").classify(TEXTS, use_activation=False)
    assert np.array_equal(engine.classify(TEXTS, use_activation=False), sequence)


def test_an_explicit_score_mode_asks_for_the_task_it_scores_by(cross: tuple[Path, Any]) -> None:
    engine = vecpool.Engine(cross[0], device="cpu", score_mode="embed")
    assert "embed" in engine.info().tasks and "token_embed" not in engine.info().tasks
    vectors = engine.embed([TEXTS[0], TEXTS[2]])
    cosine = float(vectors[0] @ vectors[1])
    assert abs(engine.score(TEXTS[0], [TEXTS[2]])[0] - cosine) <= 1e-6


def test_tasks_option_refusals(cross: tuple[Path, Any]) -> None:
    with pytest.raises(ConfigError, match=r"cannot serve 'sparse': .*masked-LM head"):
        vecpool.Engine(cross[0], device="cpu", tasks=["sparse"])
    with pytest.raises(ConfigError, match="tasks: unknown task 'summarize'; known tasks: "):
        vecpool.Engine(cross[0], device="cpu", tasks=["summarize"])
    with pytest.raises(ConfigError, match="tasks must be a list of task names, got the string"):
        vecpool.Engine(cross[0], device="cpu", tasks="embed")  # type: ignore[arg-type]


def test_task_flag_reads_per_model(tmp_path: Path) -> None:
    import argparse

    from vecpool.api.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, several_models=True)
    one = parser.parse_args(["a", "b", "--task", "embed,token_embed"])
    assert [m.tasks for m in EngineArgs.per_model(one)] == [("embed", "token_embed")] * 2
    each = parser.parse_args(["a", "b", "--task", "token_classify", "--task", "none"])
    assert [m.tasks for m in EngineArgs.per_model(each)] == [("token_classify",), ()]
    single = argparse.ArgumentParser()
    EngineArgs.add_cli_args(single)
    assert EngineArgs.from_cli_args(single.parse_args(["a"])).tasks == ()
    assert EngineArgs.from_cli_args(single.parse_args(["a", "--task", "embed"])).tasks == ("embed",)
