"""Request bodies, as pydantic models (strict types, unknown fields refused).

`input` fields are typed `Any` here and parsed by `codec.parse_inputs`, which names the index of
a bad item; everything else is checked by pydantic, whose errors become 400s naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EncodingFormat = Literal["float", "base64"]
EmbedDtype = Literal["float32", "float16", "bfloat16"]

INPUT_DOC = (
    "a string, a list of strings, a token array, a list of token arrays, or a list mixing "
    'strings, token arrays and {"prompt_embeds": "<base64 of .npy or torch.save>"} objects'
)


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextParams(ApiModel):
    """Tokenization options shared by every endpoint that takes text."""

    model: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, description="keep this many tokens of each input; -1: the model's limit"
    )
    truncation_side: Literal["left", "right"] = "right"
    prompt_name: str | None = Field(
        None, description="prefix text inputs with this instruction prompt of the model folder"
    )
    user: str | None = None  # OpenAI's end-user tag; accepted and not used


class OutputParams(TextParams):
    """How vectors come back."""

    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDtype = Field(
        "float32", description="dtype of the values: the bytes of base64, the rounding of floats"
    )
    dimensions: int | None = None
    normalize: bool | None = None


class EmbeddingRequest(OutputParams):
    """`POST /v1/embeddings`, OpenAI's shape plus vecpool's extensions."""

    input: Any = Field(..., description=INPUT_DOC)


class PoolingRequest(OutputParams):
    """`POST /pooling`: any task the engine declares, including per-token outputs."""

    input: Any = Field(..., description=INPUT_DOC)
    task: str = "embed"
    step_tag_id: int | None = None
    use_activation: bool | None = Field(
        None, description="score tasks: apply the head's activation (false: raw logits)"
    )
    exclude_special_tokens: bool | None = Field(
        None, description="sparse: pool over non-special tokens only (needs token ids)"
    )


class TokenizeRequest(ApiModel):
    model: str | None = None
    prompt: str
    prompt_name: str | None = None


class DetokenizeRequest(ApiModel):
    model: str | None = None
    tokens: list[int]


class RerankDocument(ApiModel):
    text: str


class RerankRequest(TextParams):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: the Cohere and Jina shapes."""

    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, description="how many to return; null or 0: every document")
    return_documents: bool = True


class ScoreRequest(TextParams):
    """`POST /score`: `text_1` against each of `text_2` (or pairwise for two equal lists)."""

    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None


class ClassifyRequest(TextParams):
    """`POST /classify`: class probabilities per input (text pairs as
    `{"text": ..., "text_pair": ...}`)."""

    input: Any = Field(..., description=INPUT_DOC)
    use_activation: bool | None = None
