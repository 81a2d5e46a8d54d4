"""Configuration dataclasses: built once, validated when built, never mutated."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from vecpool.errors import ConfigError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` picks CUDA when available, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device: {exc}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for, but CUDA is not available")
    return resolved


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, checkpoint_dtype: str | None
) -> torch.dtype:
    """`None` means float32 on the CPU; on CUDA the checkpoint's half type, else float16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype {dtype} is not supported; use float32, float16 or bfloat16")
        return dtype
    if dtype is not None and dtype != "auto":
        if dtype not in _DTYPES:
            raise ConfigError(
                f"dtype {dtype!r} is not supported; use one of {sorted(set(_DTYPES))} or 'auto'"
            )
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("bfloat16", "float16"):
        return _DTYPES[checkpoint_dtype]
    return torch.float16


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may hold."""

    max_num_batched_tokens: int = 8192  # token budget of one flat batch
    max_num_seqs: int = 256  # request cap of one batch
    # Keys and values kept for prompts that run in chunks (causal models), counted in prompt
    # positions: a prompt reserves its length while it runs. 0: prompts run whole (one longer
    # than the budget runs alone in its own step).
    max_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_cached_tokens < 0:
            raise ConfigError(
                f"max_cached_tokens must be 0 or positive, got {self.max_cached_tokens}"
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


_QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
_PLACEHOLDERS = re.compile(r"\{(query|document|instruction)\}")


@dataclass(frozen=True)
class LLMRerankerConfig:
    """How a causal language model scores a (query, document) pair.

    The pair is written into `template` (placeholders `{query}`, `{document}` and optionally
    `{instruction}`; other braces are literal); the model reads the whole prompt, and the
    logits of `true_token` and `false_token` (vocabulary entries) at its last position give
    the score `sigmoid(l_true - l_false)`, or `sigmoid(l_true)` without a false token.
    """

    template: str
    true_token: str = "yes"
    false_token: str | None = "no"
    instruction: str = ""

    def __post_init__(self) -> None:
        found = set(_PLACEHOLDERS.findall(self.template))
        missing = sorted({"query", "document"} - found)
        if missing:
            raise ConfigError(
                f"the reranker template has no {', '.join('{' + m + '}' for m in missing)} "
                "placeholder"
            )
        if not self.true_token or self.false_token == "":
            raise ConfigError("the reranker's true and false tokens must be non-empty")

    def format(self, query: str, document: str) -> str:
        """The prompt for one pair (substituted in one pass: text that looks like a
        placeholder stays as it is)."""
        values = {"query": query, "document": document, "instruction": self.instruction}
        return _PLACEHOLDERS.sub(lambda m: values[m.group(1)], self.template)

    @classmethod
    def qwen3(
        cls,
        instruction: str = "Given a web search query, retrieve relevant passages that answer "
        "the query",
    ) -> LLMRerankerConfig:
        """The prompt and tokens of Qwen3-Reranker (a `Qwen3ForCausalLM` checkpoint)."""
        return cls(_QWEN3_RERANKER_TEMPLATE, "yes", "no", instruction)
