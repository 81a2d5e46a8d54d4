"""Architectures by the `architectures[0]` entry of config.json, imported lazily."""

from __future__ import annotations

import importlib

from vecpool.errors import ConfigError
from vecpool.models.base import PoolingModel

# architecture name -> (module under vecpool.models, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "BertModel"),
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "Qwen3Model": ("qwen3", "Qwen3Model"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "LlamaModel": ("llama", "LlamaModel"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralModel": ("llama", "MistralModel"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Gemma2Model": ("gemma2", "Gemma2Model"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
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
