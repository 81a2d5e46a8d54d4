"""Which task heads a loaded model has: built once per engine from the model's head methods."""

from __future__ import annotations

import torch

from vecpool.errors import ModelLoadError
from vecpool.models.base import PoolingModel
from vecpool.models.folder import ModelFolder, SpladeSpec
from vecpool.pooling.heads import DenseStack
from vecpool.pooling.task_heads import (
    ClassifierHead,
    EmbedHead,
    LogitScoreHead,
    SparseHead,
    TaskHead,
    TokenClassifierHead,
    TokenEmbedHead,
    classifier_activation,
)
from vecpool.runner.pooling_runner import PoolingDefaults
from vecpool.tasks import (
    EMBEDDING,
    SCORER,
    SEQUENCE_CLASSIFIER,
    SPARSE,
    TOKEN_CLASSIFIER,
    TOKEN_EMBEDDING,
)


def build_task_heads(
    model: PoolingModel,
    folder: ModelFolder,
    defaults: PoolingDefaults,
    dense: DenseStack,
    device: torch.device,
    *,
    scorer_vocab_ids: list[int] | None,
    special_token_ids: list[int],
) -> tuple[dict[str, TaskHead], dict[str, str]]:
    """The heads this model serves, by name, and for each head it lacks, why.

    `scorer_vocab_ids` (the true and false tokens of an LLM reranker) make the scorer an LLM
    reranker; without them a sequence classifier, if any, scores pairs (a cross-encoder).
    """
    arch = folder.architecture
    heads: dict[str, TaskHead] = {
        EMBEDDING: EmbedHead(
            defaults.pooler, dense.to(device), defaults.normalize, defaults.output_dim
        ),
        TOKEN_EMBEDDING: TokenEmbedHead(
            model.project_tokens if "token_projection" in model.heads else None,
            defaults.normalize,
            defaults.token_output_dim,
        ),
    }
    missing: dict[str, str] = {}
    activation = classifier_activation(folder.hf_config, model.num_labels)
    if "sequence_classifier" in model.heads:
        heads[SEQUENCE_CLASSIFIER] = ClassifierHead(
            model.classify, model.classifier_pooler, activation
        )
    else:
        missing[SEQUENCE_CLASSIFIER] = (
            f"{arch} has no sequence-classification head (a *ForSequenceClassification "
            "checkpoint has one)"
        )
    if scorer_vocab_ids is not None:
        ids = torch.tensor(scorer_vocab_ids, dtype=torch.int64, device=device)
        heads[SCORER] = LogitScoreHead(model.compute_logits, ids)
    elif SEQUENCE_CLASSIFIER in heads:
        heads[SCORER] = heads[SEQUENCE_CLASSIFIER]
    else:
        missing[SCORER] = (
            f"{arch} is neither a cross-encoder (*ForSequenceClassification) nor configured as "
            "an LLM reranker (Engine(llm_reranker=...))"
        )
    if "token_classifier" in model.heads:
        heads[TOKEN_CLASSIFIER] = TokenClassifierHead(model.classify_tokens, activation)
    else:
        missing[TOKEN_CLASSIFIER] = (
            f"{arch} has no token-classification head (a *ForTokenClassification checkpoint "
            "has one)"
        )
    if "masked_lm" in model.heads:
        special = torch.zeros(model.vocab_size, dtype=torch.bool)
        special[[i for i in special_token_ids if 0 <= i < model.vocab_size]] = True
        splade = folder.splade or SpladeSpec()  # a plain *ForMaskedLM: max of log1p(relu)
        heads[SPARSE] = SparseHead(
            model.compute_logits,
            special.to(device),
            splade.pooling_strategy,
            splade.activation_function,
        )
    elif folder.splade is not None:
        raise ModelLoadError(
            f"modules.json has a SpladePooling module, but {arch} has no masked-LM head "
            "(a *ForMaskedLM checkpoint has one)"
        )
    else:
        missing[SPARSE] = f"{arch} has no masked-LM head (a *ForMaskedLM checkpoint has one)"
    return heads, missing
