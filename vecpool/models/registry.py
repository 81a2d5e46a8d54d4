"""Architectures by the `architectures[0]` entry of config.json, imported lazily."""

from __future__ import annotations

import importlib

from vecpool.errors import ConfigError
from vecpool.models.base import PoolingModel

# architecture name -> (module under vecpool.models, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "BertForTokenClassification": ("bert", "BertForTokenClassification"),
    "BertForMaskedLM": ("bert", "BertForMaskedLM"),
    "HF_ColBERT": ("bert", "ColBERTModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "RobertaForTokenClassification": ("bert", "RobertaForTokenClassification"),
    "RobertaForMaskedLM": ("bert", "RobertaForMaskedLM"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForTokenClassification": ("bert", "RobertaForTokenClassification"),
    "XLMRobertaForMaskedLM": ("bert", "RobertaForMaskedLM"),
    "Qwen3Model": ("qwen3", "Qwen3Model"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
    "Qwen3ForTokenClassification": ("qwen3", "Qwen3ForTokenClassification"),
    "LlamaModel": ("llama", "LlamaModel"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "LlamaForTokenClassification": ("llama", "LlamaForTokenClassification"),
    "MistralModel": ("llama", "MistralModel"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "MistralForSequenceClassification": ("llama", "MistralForSequenceClassification"),
    "MistralForTokenClassification": ("llama", "MistralForTokenClassification"),
    "Gemma2Model": ("gemma2", "Gemma2Model"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma2ForSequenceClassification": ("gemma2", "Gemma2ForSequenceClassification"),
    "Gemma2ForTokenClassification": ("gemma2", "Gemma2ForTokenClassification"),
    # -- MPNet, DistilBERT, ALBERT, ELECTRA --
    # -- T5 encoder, DeBERTa-v2, Jina BERT v2 --
    # -- ModernBERT, NomicBERT, GTE --
    # -- Qwen2, Gemma, Gemma3 --
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def model_class(architecture: str) -> type[PoolingModel]:
    """The class serving `architecture`, or a `ConfigError` listing the supported ones."""
    entry = _REGISTRY.get(architecture)
    if entry is None:
        raise ConfigError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module = importlib.import_module(f"vecpool.models.{entry[0]}")
    cls: type[PoolingModel] = getattr(module, entry[1])
    return cls
