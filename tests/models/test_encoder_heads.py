"""The shared encoder heads (vecpool.models.architectures.encoder_heads) keep each family's checkpoint names:
every head class holds exactly the parameters transformers' class of the same name holds (the
base model's under the family prefix), and the masked-LM heads read `tie_word_embeddings`.

The numbers of these heads are compared with transformers in test_bert.py, test_encoders.py,
test_encoders_relative.py and test_encoders_rotary.py; this checks the names and the tie alone.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest
import torch
import transformers

from vecpool.models.loading.loader import model_class

_SIZES: dict[str, Any] = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 37,
    "num_labels": 3,
}
_FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "Bert": (transformers.BertConfig, {}),
    "Roberta": (transformers.RobertaConfig, {}),
    "DistilBert": (
        transformers.DistilBertConfig,
        {"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 37},
    ),
    "Albert": (transformers.AlbertConfig, {"embedding_size": 16}),
    "Electra": (transformers.ElectraConfig, {"embedding_size": 16}),
    "MPNet": (transformers.MPNetConfig, {}),
    "DebertaV2": (transformers.DebertaV2Config, {}),
}
_HEADS = ["ForSequenceClassification", "ForTokenClassification", "ForMaskedLM"]
_CASES = [
    (family, head)
    for family in _FAMILIES
    for head in _HEADS
    if not (family == "DebertaV2" and head == "ForSequenceClassification")  # pooler_hidden_size
]


def _hf_config(family: str, **extra: Any) -> transformers.PretrainedConfig:
    config_class, own = _FAMILIES[family]
    return config_class(**{**_SIZES, **own, **extra})


@pytest.mark.parametrize(("family", "head"), _CASES)
def test_a_shared_head_holds_the_parameters_of_transformers_class(family: str, head: str) -> None:
    config = _hf_config(family)
    with torch.device("meta"):
        ours = model_class(family + head).from_hf_config(config.to_dict())
        theirs = getattr(transformers, family + head)(config)
    prefix = theirs.base_model_prefix + "."
    expected = {
        name.removeprefix(prefix) for name, _ in theirs.named_parameters(remove_duplicate=False)
    }
    got = {name for name, _ in ours.named_parameters(remove_duplicate=False)}
    # Left out of ours: only what the model declares unused (a bare model's BERT pooler).
    unused = [n for n in expected - got if _matches(n, ours.unused_checkpoint_keys)]
    assert got - set(ours.tied_weights) == expected - set(ours.tied_weights) - set(unused)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


@pytest.mark.parametrize("family", list(_FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
def test_a_masked_lm_head_reads_the_tie_from_the_config(family: str, tied: bool) -> None:
    hf = _hf_config(family, tie_word_embeddings=tied).to_dict()
    with torch.device("meta"):
        model = model_class(family + "ForMaskedLM").from_hf_config(hf)
    # DeBERTa-v2's non-legacy head reads the embeddings whatever the flag; legacy is the default.
    assert model.tie_word_embeddings is tied
