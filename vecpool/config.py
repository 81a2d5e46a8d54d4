"""Configuration dataclasses: built once, validated when built, never mutated."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vecpool.errors import ConfigError

# Choices of `EngineArgs` that the model and pooling layers implement, named here so that the
# command line and the launcher offer them without loading those layers (or torch).
QUANTIZATIONS = ("fp8", "int8")
MODEL_IMPLS = ("auto", "vecpool", "transformers")
SEQUENCE_METHODS = ("CLS", "MEAN", "LAST", "MAX", "MEAN_SQRT_LEN", "WEIGHTED_MEAN")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may hold."""

    max_num_batched_tokens: int = 8192  # token budget of one flat batch
    max_num_seqs: int = 256  # request cap of one batch
    # Keys and values kept for prompts that run in chunks (causal models), counted in prompt
    # positions: a prompt reserves its length while it runs. 0: prompts run whole (one longer
    # than the budget runs alone in its own step).
    max_cached_tokens: int = 0
    # Patch rows a step's vision tower runs (images of any size are sequences of patches, as
    # texts are of tokens): an image waits for a step with room for it; one larger than the
    # whole budget runs in a step whose tower runs nothing else. None: the token budget.
    max_num_batched_patches: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_patches is None:
            object.__setattr__(self, "max_num_batched_patches", self.max_num_batched_tokens)
        elif self.max_num_batched_patches < 1:
            raise ConfigError(
                f"max_num_batched_patches must be positive, got {self.max_num_batched_patches}"
            )
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

    @property
    def patch_budget(self) -> int:
        """Patch rows a step's vision tower runs: `max_num_batched_patches`, as resolved."""
        return self.max_num_batched_patches or self.max_num_batched_tokens


_QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
_BGE_GEMMA_RERANKER_TEMPLATE = "A: {query}\nB: {document}\n{instruction}"
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

    @classmethod
    def bge_gemma(
        cls,
        instruction: str = "Given a query A and a passage B, determine whether the passage "
        "contains an answer to the query by providing a prediction of either 'Yes' or 'No'.",
    ) -> LLMRerankerConfig:
        """The prompt of bge-reranker-v2-gemma (a `GemmaForCausalLM` checkpoint), as
        FlagEmbedding's LLM reranker writes it: the tokenizer's <bos>, "A: {query}", a newline,
        "B: {document}", a newline, the instruction; the score is the "Yes" logit alone.
        FlagEmbedding tokenizes the pieces apart and joins the ids; one pass over the joined
        text gives the same ids unless a piece's edge merges with the newline next to it."""
        return cls(_BGE_GEMMA_RERANKER_TEMPLATE, "Yes", None, instruction)


# jina-reranker-v3's listwise prompt (its remote code, `format_docs_prompts_func`): the system
# turn, then the user turn holding the documents and the query, then an empty thinking block.
_JINA_V3_SYSTEM = (
    "<|im_start|>system\nYou are a search relevance expert who can determine a ranking of the "
    "passages based on how relevant they are to the query. If the query is a question, how "
    "relevant a passage is depends on how well it answers the question. If not, try to analyze "
    "the intent of the query and assess how well each passage satisfies the intent. If an "
    "instruction is provided, you should follow the instruction when determining the ranking."
    "<|im_end|>\n<|im_start|>user\n"
)
_JINA_V3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class ListwiseRerankerConfig:
    """How a listwise reranker (jina-reranker-v3) writes a query and its documents into one
    prompt, and how many documents one prompt holds.

    Each document is followed by `doc_token` and the query (written after the documents) by
    `query_token`; the model's vectors at those tokens give a document's score, the cosine of
    its vector with the query's. Texts are cut to `max_query_tokens` / `max_doc_tokens` tokens
    of their own first. Documents beyond one prompt's room (`max_docs_per_prompt`, or the
    token room the model's code leaves) go into further prompts that repeat the query.
    """

    doc_token: str
    query_token: str
    system: str
    suffix: str
    instruction: str = ""  # written into the prompt when not empty
    max_docs_per_prompt: int = 125
    max_doc_tokens: int = 2048
    max_query_tokens: int = 512

    def __post_init__(self) -> None:
        if not self.doc_token or not self.query_token or self.doc_token == self.query_token:
            raise ConfigError("a listwise reranker needs two distinct, non-empty marker tokens")
        for name in ("max_docs_per_prompt", "max_doc_tokens", "max_query_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def sanitize(self, text: str) -> str:
        """`text` without the marker tokens (a text may not place a marker of its own)."""
        return text.replace(self.doc_token, "").replace(self.query_token, "")

    def format(self, query: str, documents: list[str]) -> str:
        """The prompt of one query and its documents (both sanitized and cut already)."""
        user = (
            f"I will provide you with {len(documents)} passages, each indicated by a numerical "
            f"identifier. Rank the passages based on their relevance to query: {query}\n"
        )
        if self.instruction:
            user += f"<instruct>\n{self.instruction}\n</instruct>\n"
        user += "\n".join(
            f'<passage id="{i}">\n{doc}{self.doc_token}\n</passage>'
            for i, doc in enumerate(documents)
        )
        user += f"\n<query>\n{query}{self.query_token}\n</query>"
        return self.system + user + self.suffix

    @classmethod
    def jina_v3(cls, instruction: str = "") -> ListwiseRerankerConfig:
        """jina-reranker-v3's prompt, markers and limits (`JinaForRanking`)."""
        return cls(
            "<|embed_token|>", "<|rerank_token|>", _JINA_V3_SYSTEM, _JINA_V3_SUFFIX, instruction
        )


@dataclass(frozen=True)
class PairTemplate:
    """How a cross-encoder that reads a (query, document) pair as one written prompt
    (jina-reranker-m0) writes it, in place of the tokenizer's pair template.

    The two sides go into `template` (placeholders `{query}` and `{document}`; other braces
    are literal); a side that is an image is written as `image_text` (its placeholder, which
    the image's rows fill). The prompt's text is tokenized with special tokens, then
    `suffix_ids` are appended (the token whose row the score head reads).
    """

    template: str
    image_text: str
    suffix_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        found = _PLACEHOLDERS.findall(self.template)
        if sorted(found) != ["document", "query"]:
            raise ConfigError(
                "a pair template holds {query} and {document} once each, got "
                f"{', '.join('{' + f + '}' for f in found) or 'neither'}"
            )

    @property
    def document_first(self) -> bool:
        """Whether the document comes before the query (its images are the prompt's first)."""
        return self.template.index("{document}") < self.template.index("{query}")

    def format(self, query: str, document: str) -> str:
        """The prompt's text for one pair (substituted in one pass: text that looks like a
        placeholder stays as it is)."""
        values = {"query": query, "document": document}
        return _PLACEHOLDERS.sub(lambda m: values.get(m.group(1), m.group(0)), self.template)
