"""Request bodies, as pydantic models (strict types, unknown fields refused), one per API shape.

`input` fields are typed `Any` here and parsed by `codec.parse_inputs`, which names the index of
a bad item; everything else is checked by pydantic, whose errors become 400s naming the field.
Bodies are parsed by hand (`routes.common.read_body`), not by FastAPI; `openapi_body` publishes
each route's models in the OpenAPI document all the same.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDtype = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]

INPUT_DOC = (
    "a string, a list of strings, a token array, a list of token arrays, or a list mixing "
    'strings, token arrays and {"prompt_embeds": "<base64 of .npy or torch.save>"} objects; '
    'for a model with an image tower also images: {"image": "<URL, data: URI or base64>"} '
    '(Jina\'s; {"text": ...} beside them) or "data:image/..." strings'
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
    user: str | None = None  # OpenAI's end-user tag; accepted and not used
    priority: int | None = Field(None, description="vLLM's, Cohere's: accepted and not used")


class OutputParams(TextParams):
    """How vectors come back."""

    prompt_name: str | None = Field(
        None, description="prefix text inputs with this instruction prompt of the model folder"
    )

    encoding_format: EncodingFormat = Field(
        "float",
        description="float: JSON numbers; base64: the bytes of each vector; bytes (vLLM): the "
        "body is every vector's bytes, one after another, and the `metadata` header says "
        "where each lies; bytes_only: the same without the header",
    )
    embed_dtype: EmbedDtype = Field(
        "float32", description="dtype of the values: the bytes of base64, the rounding of floats"
    )
    endianness: Endianness = Field(
        "native", description="byte order of base64 and bytes values (native: the server's)"
    )
    dimensions: int | None = None
    normalize: bool | None = None


class ChatFields(ApiModel):
    """vLLM's chat-format input: one conversation, rendered to one text by the model's chat
    template (a folder without one is refused, as vLLM refuses it)."""

    messages: list[dict[str, Any]] = Field(
        ...,
        description='[{"role", "content"}], content a string or a list of {"type": "text", '
        '"text"} parts; for a model with an image tower (CLIP, SigLIP) one text or one '
        '{"type": "image_url", "image_url": {"url"}} part, read without a chat template',
    )
    add_generation_prompt: bool = False
    continue_final_message: bool = Field(False, description="refused when true")
    chat_template: str | None = Field(
        None, description="refused: only the model folder's own chat template is run"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="more variables for the chat template"
    )
    # vLLM's default for chat input: the template writes the special tokens itself.
    add_special_tokens: bool = Field(
        False, description="also add the tokenizer's special tokens to the rendered text"
    )


class EmbeddingParams(OutputParams):
    """`POST /v1/embeddings`: everything but the input."""

    use_activation: bool | None = Field(
        None, description="vLLM's name of normalize for embeddings (false: raw pooled vectors)"
    )
    precision: Precision = Field(
        "float32",
        description="quantized vectors as sentence-transformers' quantize_embeddings makes "
        "them: int8 / uint8 (integers), binary / ubinary (bits packed eight to a byte)",
    )
    ranges: list[list[float]] | None = Field(
        None,
        description="int8 / uint8: [minimums, maximums], one per dimension; default -1 and 1 "
        "(the range of a unit vector's components)",
    )
    windowed: bool | None = Field(
        None,
        description="an input over the model's length is embedded as the token-weighted mean "
        "of overlapping windows (an approximation), not refused; default: the server's "
        "--windowed-embed",
    )


class EmbeddingRequest(EmbeddingParams):
    """`POST /v1/embeddings`, OpenAI's shape plus vLLM's and vecpool's extensions."""

    input: Any = Field(..., description=INPUT_DOC)
    add_special_tokens: bool = Field(
        True, description="vLLM's: false: texts become their own tokens only"
    )


class InfinityEmbeddingRequest(EmbeddingRequest):
    """`POST /embeddings`, Infinity's path: OpenAI's shape and Infinity's `modality`."""

    modality: Literal["text", "image"] = Field(
        "text",
        description="image: each item of `input` is an image URL, data: URI or base64 string",
    )


class EmbeddingChatRequest(ChatFields, EmbeddingParams):
    """`POST /v1/embeddings` with vLLM's `messages`: one vector for the conversation."""


class PoolingParamsBody(OutputParams):
    """`POST /pooling`: everything but the input."""

    task: str = "embed"
    step_tag_id: int | None = None
    use_activation: bool | None = Field(
        None, description="score tasks: apply the head's activation (false: raw logits)"
    )
    exclude_special_tokens: bool | None = Field(
        None, description="sparse: pool over non-special tokens only (needs token ids)"
    )


class PoolingRequest(PoolingParamsBody):
    """`POST /pooling`: any task the engine declares, including per-token outputs."""

    input: Any = Field(..., description=INPUT_DOC)
    add_special_tokens: bool = Field(
        True, description="vLLM's: false: texts become their own tokens only"
    )


class PoolingChatRequest(ChatFields, PoolingParamsBody):
    """`POST /pooling` with vLLM's `messages`."""


class TokenizeRequest(ApiModel):
    """`POST /tokenize`, vLLM's shape."""

    model: str | None = None
    prompt: str
    prompt_name: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = Field(False, description="also return each token's string")


class DetokenizeRequest(ApiModel):
    model: str | None = None
    tokens: list[int]


class RerankDocument(BaseModel):
    """A document as an object: `text`, and any other fields (returned as given)."""

    model_config = ConfigDict(extra="allow", strict=True)
    text: str


class ImageDocument(BaseModel):
    """Jina's image document: `image` (a URL, data: URI or base64), and any other fields
    (returned as given)."""

    model_config = ConfigDict(extra="allow", strict=True)
    image: str


class ContentInput(ApiModel):
    """vLLM's multimodal item: one input written as content parts, `{"type": "text", "text"}`
    or `{"type": "image_url", "image_url": {"url"}}` (a dual encoder: one text or one image)."""

    content: list[Any]


class RerankRequest(TextParams):
    """`POST /rerank`, `/v1/rerank`, `/v2/rerank`: the Cohere, Jina, vLLM and Infinity
    shape (`query` and `documents`)."""

    query: str | ContentInput
    documents: list[str | RerankDocument | ImageDocument | ContentInput]
    top_n: int | None = Field(None, description="how many to return; null or 0: every document")
    return_documents: bool = True
    use_activation: bool | None = Field(
        None, description="apply the score head's activation (false: raw logits)"
    )
    raw_scores: bool | None = Field(
        None, description="Infinity's name: true is use_activation false"
    )
    max_tokens_per_doc: int | None = Field(
        None, description="Cohere: cut each document to this many of its own tokens first"
    )
    rank_fields: list[str] | None = Field(
        None, description='Cohere v1: only ["text"], the field every document is ranked by'
    )
    max_chunks_per_doc: int | None = Field(
        None, description="Cohere v1: refused unless null (vecpool does not chunk documents)"
    )


class ScoreParams(TextParams):
    use_activation: bool | None = None


# A side of a score call: one item or a list; an item is a text or vLLM's content parts.
ScoreSide = str | ContentInput | list[str | ContentInput]


class TextScoreRequest(ScoreParams):
    """`POST /score`: `text_1` against each of `text_2` (or pairwise for two equal lists)."""

    text_1: ScoreSide
    text_2: ScoreSide


class DataScoreRequest(ScoreParams):
    """`POST /score`, vLLM's `data_1` / `data_2` names."""

    data_1: ScoreSide
    data_2: ScoreSide


class QueriesDocumentsScoreRequest(ScoreParams):
    """`POST /score`, vLLM's `queries` / `documents` names."""

    queries: ScoreSide
    documents: ScoreSide


class QueriesItemsScoreRequest(ScoreParams):
    """`POST /score`, vLLM's `queries` / `items` names."""

    queries: ScoreSide
    items: ScoreSide


SCORE_SHAPES: tuple[tuple[type[ScoreParams], str, str], ...] = (
    (TextScoreRequest, "text_1", "text_2"),
    (DataScoreRequest, "data_1", "data_2"),
    (QueriesDocumentsScoreRequest, "queries", "documents"),
    (QueriesItemsScoreRequest, "queries", "items"),
)


class ClassifyParams(TextParams):
    use_activation: bool | None = None


class ClassifyRequest(ClassifyParams):
    """`POST /classify`: class probabilities per input (text pairs as
    `{"text": ..., "text_pair": ...}`)."""

    input: Any = Field(..., description=INPUT_DOC)
    add_special_tokens: bool = Field(
        True, description="vLLM's: false: texts become their own tokens only"
    )


class ClassifyChatRequest(ChatFields, ClassifyParams):
    """`POST /classify` with vLLM's `messages`."""


# ---- Infinity -----------------------------------------------------------------------------


class InfinityClassifyRequest(ApiModel):
    """`POST /classify` with `raw_scores`: Infinity's shape, answered as Infinity answers
    (`data`: per input, every label's `{score, label}`, best first)."""

    model: str | None = None
    input: str | list[str]
    raw_scores: bool = Field(False, description="true: logits, not probabilities")


class InfinityRerankRequest(ApiModel):
    """`POST /rerank` with `raw_scores`: Infinity's shape, answered as Infinity answers
    (`document` a string, only with `return_documents`)."""

    model: str | None = None
    query: str
    documents: list[str]
    return_documents: bool = False
    raw_scores: bool = False
    top_n: int | None = Field(None, gt=0, description="how many to return; null: all")


# ---- Cohere ----------------------------------------------------------------------------

CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereEmbedRequest(ApiModel):
    """`POST /v1/embed`, `/v2/embed`: Cohere's shape (one of `texts`, `images`, `inputs`)."""

    model: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = Field(
        None, description="images as data: URIs (or URLs to allowed hosts), one vector each"
    )
    inputs: list[ContentInput] | None = Field(
        None,
        description='[{"content": [parts]}]: each input one text ({"type": "text", "text"} '
        'parts) or one image ({"type": "image_url", "image_url": {"url"}}), one vector each',
    )
    input_type: (
        Literal["search_document", "search_query", "classification", "clustering", "image"] | None
    ) = Field(
        None,
        description="the model's prompt of that role: query, document (or passage), "
        "classification, clustering; none when the model has no such prompt",
    )
    embedding_types: list[CohereEmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(None, ge=1, description="cut each text to this many tokens")
    output_dimension: int | None = None
    priority: int | None = Field(None, description="accepted and not used")


# ---- Text Embeddings Inference -----------------------------------------------------------

TruncationDirection = Literal["left", "right", "Left", "Right"]
TEI_INPUTS_DOC = "a string, a token array, or a list of strings and token arrays"


class TeiTextParams(ApiModel):
    truncate: bool | None = Field(
        None, description="cut inputs over the model's limit; null: the server's --auto-truncate"
    )
    truncation_direction: TruncationDirection = "right"


class TeiEmbedRequest(TeiTextParams):
    """`POST /embed` (and `/` of an embedding model): Text Embeddings Inference's shape."""

    inputs: Any = Field(..., description=TEI_INPUTS_DOC)
    prompt_name: str | None = None
    normalize: bool = True
    dimensions: int | None = None


class TeiTokensRequest(TeiTextParams):
    """`POST /embed_all`, `/embed_sparse`."""

    inputs: Any = Field(..., description=TEI_INPUTS_DOC)
    prompt_name: str | None = None


class TeiPredictRequest(TeiTextParams):
    """`POST /predict` (and `/` of a classifier)."""

    inputs: Any = Field(
        ...,
        description="a string, a pair [string, string], or a batch [[string], "
        "[string, string], ...]",
    )
    raw_scores: bool = False


class TeiRerankRequest(TeiTextParams):
    """`POST /rerank` with `texts`: Text Embeddings Inference's shape."""

    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False


class TeiTokenizeRequest(ApiModel):
    """`POST /tokenize` with `inputs`: Text Embeddings Inference's shape."""

    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class TeiDecodeRequest(ApiModel):
    """`POST /decode`."""

    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


# ---- OpenAPI -------------------------------------------------------------------------------


def openapi_body(*models: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route whose body is one of `models` (parsed by hand): their
    JSON schemas, inlined, as its request body."""
    schemas = [_schema(model) for model in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@cache
def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    result: dict[str, Any] = inline(schema)
    return result
