"""Which heads a loaded model serves: built once per engine from the model's capabilities and
its folder's sentence-transformers modules; for each head it lacks, why."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vecpool.errors import ModelLoadError
from vecpool.models.base import Capability, PoolingModel
from vecpool.models.loading.folder import ModelFolder, SpladeSpec
from vecpool.models.loading.loader import load_module
from vecpool.models.loading.st import DenseStack, load_dense_stack
from vecpool.pooling.heads import (
    ClassifierHead,
    EmbedHead,
    LexicalSparseHead,
    ListwiseHead,
    LogitScoreHead,
    RowFn,
    SparseHead,
    TaskHead,
    TokenClassifierHead,
    TokenEmbedHead,
    classifier_activation,
)
from vecpool.tasks import INPUT_TYPES, Head


@dataclass(frozen=True)
class PoolingDefaults:
    """What a request gets when its parameters say nothing."""

    pooler: str  # sequence method of the embed task: one of `vecpool.config.SEQUENCE_METHODS`
    normalize: bool
    output_dim: int  # of embed, after the Dense projections
    token_output_dim: int  # of token_embed, after a ColBERT projection if any
    token_normalize: bool  # of token_embed


def build_heads(
    model: PoolingModel,
    folder: ModelFolder,
    defaults: PoolingDefaults,
    dense: DenseStack,
    device: torch.device,
    *,
    scorer_vocab_ids: list[int] | None,
    special_token_ids: list[int],
    skiplist_ids: list[int] | None = None,
    listwise_ids: list[int] | None = None,
) -> tuple[dict[Head, TaskHead], dict[Head, str]]:
    """The heads this model serves, by name, and for each head it lacks, why.

    `scorer_vocab_ids` (the true and false tokens of an LLM reranker) make the scorer an LLM
    reranker; without them a sequence classifier, if any, scores pairs (a cross-encoder).
    `skiplist_ids`: the token ids a late-interaction model leaves out of some side's vectors.
    `listwise_ids` (the document and query markers of a listwise reranker) make the scorer
    the listwise head.
    """
    arch = folder.architecture
    heads: dict[Head, TaskHead] = {
        Head.EMBEDDING: EmbedHead(defaults.pooler, dense, defaults.normalize, defaults.output_dim),
        Head.TOKEN_EMBEDDING: _token_embed_head(model, folder, defaults, device, skiplist_ids),
    }
    missing: dict[Head, str] = {}
    activation = classifier_activation(folder.hf_config, model.num_labels)
    if Capability.SEQUENCE_CLASSIFIER in model.capabilities:
        heads[Head.SEQUENCE_CLASSIFIER] = ClassifierHead(
            model.classify, model.classifier_pooler, activation
        )
    else:
        missing[Head.SEQUENCE_CLASSIFIER] = (
            f"{arch} has no sequence-classification head (a *ForSequenceClassification "
            "checkpoint has one)"
        )
    if listwise_ids is not None:
        marked = _vocab_mask(listwise_ids, model.vocab_size, device)
        heads[Head.SCORER] = ListwiseHead(model.project_listwise, marked)
    elif scorer_vocab_ids is not None:
        ids = torch.tensor(scorer_vocab_ids, dtype=torch.int64, device=device)
        heads[Head.SCORER] = LogitScoreHead(model.compute_logits, ids)
    elif Head.SEQUENCE_CLASSIFIER in heads:
        heads[Head.SCORER] = heads[Head.SEQUENCE_CLASSIFIER]
    else:
        missing[Head.SCORER] = (
            f"{arch} is neither a cross-encoder (*ForSequenceClassification) nor configured as "
            "an LLM reranker (Engine(llm_reranker=...))"
        )
    if Capability.TOKEN_CLASSIFIER in model.capabilities:
        heads[Head.TOKEN_CLASSIFIER] = TokenClassifierHead(model.classify_tokens, activation)
    elif Capability.SEQUENCE_CLASSIFIER in model.capabilities:
        # A sequence classifier's head on every token's row (what vLLM's token_classify of
        # such a model computes): served only when the engine is asked to (`tasks`).
        heads[Head.TOKEN_CLASSIFIER] = TokenClassifierHead(model.classify, activation)
    else:
        missing[Head.TOKEN_CLASSIFIER] = (
            f"{arch} has no token-classification head (a *ForTokenClassification checkpoint "
            "has one)"
        )
    m3 = folder.bge_m3
    if m3 is not None and m3.sparse_linear is not None:  # BGE-M3's lexical weights
        heads[Head.SPARSE] = LexicalSparseHead(
            _in_float32(_bge_m3_linear(m3.sparse_linear, model.hidden_size, 1, device)),
            _vocab_mask(m3.unused_token_ids, model.vocab_size, device),
            _vocab_mask(special_token_ids, model.vocab_size, device),
        )
    elif Capability.MASKED_LM in model.capabilities:
        special = torch.zeros(model.vocab_size, dtype=torch.bool)
        special[[i for i in special_token_ids if 0 <= i < model.vocab_size]] = True
        splade = folder.splade or SpladeSpec()  # a plain *ForMaskedLM: max of log1p(relu)
        heads[Head.SPARSE] = SparseHead(
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
        missing[Head.SPARSE] = f"{arch} has no masked-LM head (a *ForMaskedLM checkpoint has one)"
    return heads, missing


def _token_embed_head(
    model: PoolingModel,
    folder: ModelFolder,
    defaults: PoolingDefaults,
    device: torch.device,
    skiplist_ids: list[int] | None,
) -> TokenEmbedHead:
    """Token rows through ColBERT's `linear`, a multi-vector folder's per-token Dense modules or
    BGE-M3's `colbert_linear` (its CLS row left out), the skiplist of a late-interaction model,
    truncation, normalization."""
    spec = folder.late_interaction
    projects = Capability.TOKEN_PROJECTION in model.capabilities
    project: RowFn | None = model.project_tokens if projects else None
    if spec is not None and spec.dense:
        token_dense = load_dense_stack(spec.dense, device)

        def project(rows: torch.Tensor) -> torch.Tensor:  # the Dense modules run in float32
            return token_dense(rows.float())

    m3 = folder.bge_m3
    colbert = m3.colbert_linear if m3 is not None else None
    if colbert is not None:
        hidden = model.hidden_size
        project = _in_float32(_bge_m3_linear(colbert, hidden, hidden, device))
    skiplist = None
    skip_sides: frozenset[str] = frozenset()
    if spec is not None and skiplist_ids:
        skiplist = torch.zeros(model.vocab_size, dtype=torch.bool)
        skiplist[[i for i in skiplist_ids if 0 <= i < model.vocab_size]] = True
        skiplist = skiplist.to(device)
        skip_sides = frozenset(side for side in INPUT_TYPES if spec.side(side).skiplist)
    return TokenEmbedHead(
        project,
        defaults.token_normalize,
        defaults.token_output_dim,
        skiplist=skiplist,
        skip_sides=skip_sides,
        drop_first=colbert is not None,
    )


def _bge_m3_linear(path: Path, hidden: int, out: int, device: torch.device) -> nn.Linear:
    """One of BGE-M3's `torch.nn.Linear` state dicts, strictly (names and shapes), on `device`."""
    linear = nn.Linear(hidden, out)
    load_module(linear, path, f"BGE-M3 {path.stem}")
    return linear.to(device).eval().requires_grad_(False)


def _in_float32(module: nn.Module) -> RowFn:
    """`module` applied to float32 rows (the small heads run in float32, as Dense modules do)."""
    return lambda rows: module(rows.float())


def _vocab_mask(
    ids: tuple[int, ...] | list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """`[vocab_size]` bool: True at `ids` (those inside the vocabulary)."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[[i for i in ids if 0 <= i < vocab_size]] = True
    return mask.to(device)
