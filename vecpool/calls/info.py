"""`EngineInfo`: what an engine serves and accepts, as plain values.

It is everything a front needs to know about a loaded engine without reaching into it: the
server's `/v1/models`, `/tokenize` and error messages read it, and API-server processes that
hold no model build their input stage (`CallContext.from_info`) from it. Frozen and
picklable, so it crosses process boundaries as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vecpool.calls.options import fields_from
from vecpool.config import ListwiseRerankerConfig, LLMRerankerConfig, PairTemplate
from vecpool.inputs.prompts import InputLimits, SideFormat


@dataclass(frozen=True)
class EngineInfo:
    """A loaded engine's model, limits and tasks. Built once by `Engine`; `Engine.info()`."""

    model_name: str  # the folder's name, or the default model's
    model_path: str  # the model folder
    architecture: str  # config.json's architectures[0]
    # "vecpool" (a native class) or "transformers" (the fallback through transformers' class)
    model_impl: str
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # the model's torch dtype name: "float32", "float16", "bfloat16"
    max_model_len: int  # tokens per input
    hidden_size: int  # width of the hidden states (and of prompt embeds)
    vocab_size: int
    output_dim: int  # of `embed`, after the Dense projections
    token_output_dim: int  # of `token_embed`, after a ColBERT projection if any
    num_labels: int  # of the classifier heads (0 without one)
    id2label: dict[int, str]
    score_mode: str  # how score / rerank compare inputs (one of `SCORE_MODES`)
    tasks: tuple[str, ...]  # the tasks this engine serves, sorted
    unavailable_tasks: dict[str, str]  # the tasks it cannot serve, with why
    matryoshka_dimensions: tuple[int, ...] | None  # the dimensions `dimensions` may take
    enable_prompt_embeds: bool  # whether prompt-embeds inputs are accepted
    max_input_chars: int | None  # longer texts are refused before they are tokenized
    prompts: dict[str, str]  # instruction prompts by name (config_sentence_transformers.json)
    default_prompt_name: str | None  # the prompt text inputs get unless the call names one
    llm_reranker: LLMRerankerConfig | None  # the prompt template of an LLM reranker
    late_interaction: bool  # a ColBERT / multi-vector folder (queries and documents differ)
    mean_maxsim: bool  # late-interaction scores divided by the query's vector count
    max_num_batched_tokens: int  # token budget of one engine step
    max_num_seqs: int  # inputs of one engine step
    tokenizer_file: str | None  # the folder's tokenizer.json, if any
    # How a late-interaction model writes each side ("query", "document") at the input stage.
    input_sides: dict[str, SideFormat] = field(default_factory=dict)
    pooling: str = ""  # how `embed` pools token states: "CLS", "MEAN", "LAST", ...
    embed_normalize: bool = True  # whether `embed` normalizes unless a call says
    windowed_embed: bool = False  # inputs over the limit are windowed unless a call says
    embed_window_overlap: int = 0  # tokens consecutive windows share
    # A listwise reranker's prompt format and limits (score_mode "listwise"), else None.
    listwise_reranker: ListwiseRerankerConfig | None = None
    # config.json declares matryoshka support (`is_matryoshka`, or `matryoshka_dimensions`).
    is_matryoshka: bool = False
    # A model with an image tower: the folder holding its preprocessor_config.json, and how
    # image inputs may be fetched (`vecpool.inputs.media.MediaPolicy`); None: text only.
    image_processor_dir: str | None = None
    media_policy: Any = None
    # The tasks it could serve but was not made for (embed on a classifier, token_classify on a
    # sequence classifier), with why: refused unless the engine's `tasks` option names them.
    opt_in_tasks: dict[str, str] = field(default_factory=dict)
    # The chat template `messages` are rendered by in place of the folder's (`chat_template`
    # option: vLLM's --chat-template); None: the folder's own.
    chat_template: str | None = None
    # A cross-encoder that reads each pair as one written prompt (jina-reranker-m0): how it
    # writes them (score_mode "cross_encoder"); None: the tokenizer's pair template.
    pair_template: PairTemplate | None = None
    # A vision-language model (Qwen2-VL): its images go into prompts at placeholder tokens,
    # and `messages` with image parts are rendered by its chat template.
    vision_language: bool = False

    @property
    def input_limits(self) -> InputLimits:
        """What the input stage checks every input against."""
        return fields_from(InputLimits, self)  # the limits of the names this info shares

    def embed_dim(self, dimensions: int | None) -> int:
        """The width of an `embed` vector: `dimensions` (a matryoshka truncation) when a call
        asks for it, else the model's output size."""
        return dimensions or self.output_dim
