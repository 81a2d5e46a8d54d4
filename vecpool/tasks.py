"""Task declarations and per-request pooling parameters.

Each task is declared once, here: which head serves it, which request parameters it accepts,
whether its requests need token ids. Code that serves a task reads the declaration at the point
of use; nothing else decides on a task's behalf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from vecpool.errors import InputError, check_flag

INPUT_TYPES = ("query", "document")  # the two sides of a late-interaction model


@dataclass(frozen=True)
class PoolingParams:
    """What one request asks of the pooling stage. `None` means "as the model says"."""

    task: str = "embed"
    dimensions: int | None = None  # matryoshka truncation of the output vector(s)
    normalize: bool | None = None  # L2-normalize the output vector(s)
    step_tag_id: int | None = None  # per-token tasks: keep only positions holding this token id
    use_activation: bool | None = None  # scores: apply the head's activation (False: raw logits)
    # token_embed of a late-interaction model: write the input as a "query" or a "document"
    # (markers, query expansion, skiplist); None: as given
    input_type: str | None = None
    exclude_special_tokens: bool | None = None  # sparse: pool over non-special tokens only

    def __post_init__(self) -> None:
        if not isinstance(self.task, str):
            raise InputError(f"task must be a string, got {type(self.task).__name__}", field="task")
        for name in ("dimensions", "step_tag_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"must be an integer, got {value!r}", field=name)
        if self.step_tag_id is not None and not 0 <= self.step_tag_id < 2**31:
            raise InputError(
                f"must be a token id (a non-negative integer), got {self.step_tag_id}",
                field="step_tag_id",
            )
        for name in ("normalize", "use_activation", "exclude_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                check_flag(value, name)
        if self.input_type is not None and self.input_type not in INPUT_TYPES:
            raise InputError(
                f"must be one of {list(INPUT_TYPES)}, got {self.input_type!r}", field="input_type"
            )

    def set_fields(self) -> list[str]:
        """Names of the parameters this request sets (everything but `task`)."""
        return [
            f.name for f in fields(self) if f.name != "task" and getattr(self, f.name) is not None
        ]


class Head(enum.Enum):
    """The heads of the pooling stage (`vecpool.pooling.heads`), by what they compute."""

    EMBEDDING = "embedding"  # the model's pooling, Dense projections, truncate, normalize
    SEQUENCE_CLASSIFIER = "sequence_classifier"  # the checkpoint's classifier, its activation
    SCORER = "scorer"  # a relevance score: a cross-encoder's classifier or an LLM's yes/no logits
    TOKEN_EMBEDDING = "token_embedding"  # per token: projection, skiplist, truncate, normalize
    TOKEN_CLASSIFIER = "token_classifier"  # per token: the checkpoint's token classifier
    SPARSE = "sparse"  # masked-LM logits -> log1p(relu(x)) (log1p_relu: again) -> max or sum


@dataclass(frozen=True)
class TaskSpec:
    """The declaration of one task."""

    name: str
    head: Head
    accepted_params: frozenset[str]
    # Parameters that make a request need its token ids when set (a flag: when true), e.g.
    # STEP selection.
    token_id_params: frozenset[str] = frozenset()
    requires_token_ids: bool = False  # every request of the task needs its token ids

    def needs_token_ids(self, params: PoolingParams) -> bool:
        """Whether a request with `params` can only be served from token ids."""
        if self.requires_token_ids:
            return True
        values = (getattr(params, name) for name in self.token_id_params)
        return any(value is not None and value is not False for value in values)

    def token_ids_reason(self, params: PoolingParams | None = None) -> str:
        """Why a request of this task (with `params`: this request) needs token ids, for error
        messages."""
        if self.requires_token_ids:
            return f"task {self.name!r} needs token ids"
        names = sorted(self.token_id_params)
        if params is not None:
            names = [n for n in names if getattr(params, n) is not None] or names
        return f"task {self.name!r} with {' or '.join(names)} set needs token ids"

    def check_params(self, params: PoolingParams, index: int | None = None) -> None:
        """Raise `InputError` for a parameter this task does not accept."""
        for name in params.set_fields():
            if name not in self.accepted_params:
                accepted = ", ".join(sorted(self.accepted_params)) or "none"
                raise InputError(
                    f"task {self.name!r} does not accept parameter {name!r} "
                    f"(it accepts: {accepted})",
                    index=index,
                    field=name,
                )


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        # One dense vector per input: the model's pooling, Dense modules, normalize.
        TaskSpec("embed", Head.EMBEDDING, frozenset({"dimensions", "normalize"})),
        # Class probabilities (or raw logits) per input: [num_labels].
        TaskSpec("classify", Head.SEQUENCE_CLASSIFIER, frozenset({"use_activation"})),
        # A relevance score per (query, document) input: a cross-encoder's classifier
        # ([num_labels]) or an LLM reranker's yes/no logits ([1]).
        TaskSpec("score", Head.SCORER, frozenset({"use_activation"})),
        # One vector per token; with step_tag_id only at positions holding that id; with
        # input_type ("query" / "document") written as that side of a late-interaction model,
        # which needs token ids: a side inserts markers and expansion tokens by id and leaves
        # skiplist tokens out by id.
        TaskSpec(
            "token_embed",
            Head.TOKEN_EMBEDDING,
            frozenset({"dimensions", "normalize", "step_tag_id", "input_type"}),
            token_id_params=frozenset({"step_tag_id", "input_type"}),
        ),
        # Class probabilities per token: [num_tokens, num_labels]; with step_tag_id only at
        # positions holding that id (STEP).
        TaskSpec(
            "token_classify",
            Head.TOKEN_CLASSIFIER,
            frozenset({"use_activation", "step_tag_id"}),
            token_id_params=frozenset({"step_tag_id"}),
        ),
        # A SPLADE vector over the vocabulary, as sentence-transformers' SpladePooling: max (or
        # sum) over every token of log(1 + relu(masked-LM logits)) (log1p_relu: log1p of that
        # again); with exclude_special_tokens over non-special tokens only: [vocab_size]. Special
        # tokens are found by id.
        TaskSpec(
            "sparse",
            Head.SPARSE,
            frozenset({"exclude_special_tokens"}),
            token_id_params=frozenset({"exclude_special_tokens"}),
        ),
    )
}


def get_task(name: str, index: int | None = None) -> TaskSpec:
    """The declaration of task `name`, or an `InputError` listing the known tasks."""
    spec = TASKS.get(name)
    if spec is None:
        raise InputError(
            f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}",
            index=index,
            field="task",
        )
    return spec
