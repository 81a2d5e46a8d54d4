"""What preparing a call starts from: `CallContext` (an engine's description and its input
stage), turning a call's inputs into validated requests (`make_requests`), instruction prompts,
and tokenizing for the `/tokenize` family. Model-free: no torch, no engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from vecpool.calls.info import EngineInfo
from vecpool.calls.outputs import PromptRequest
from vecpool.errors import InputError, check_flag
from vecpool.inputs.images import image_reader, is_image
from vecpool.inputs.prompts import InputProcessor, TextOptions, TextTokenizer, is_tensor
from vecpool.inputs.tokenizer import check_unicode
from vecpool.tasks import PoolingParams, get_task


@dataclass(frozen=True)
class CallContext:
    """What preparing a call needs: the engine's description and its input stage (the
    tokenizer, the limits, a late-interaction model's side formats)."""

    info: EngineInfo
    inputs: InputProcessor

    @classmethod
    def from_info(cls, info: EngineInfo) -> CallContext:
        """A context built from `info` alone (its tokenizer read from the model folder): what a
        process without the model prepares calls with."""
        tokenizer = TextTokenizer(Path(info.tokenizer_file)) if info.tokenizer_file else None
        images = image_reader(info.image_processor_dir, info.media_policy)
        return cls(
            info, InputProcessor(info.input_limits, tokenizer, info.input_sides, images=images)
        )

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.inputs.tokenizer

    def until(self, deadline: float | None) -> CallContext:
        """This context for one call that must be done by `deadline` (a `time.monotonic()`
        value; None: no deadline): an image the call fetches from a URL is cut off then."""
        return self if deadline is None else replace(self, inputs=self.inputs.until(deadline))


# ---- inputs ----------------------------------------------------------------------------


class InputList(list[Any]):
    """Inputs already listed by `as_input_list`: read again as they are, a list of inputs.
    A large call's chunk is a slice of its list; one that starts with a token id (the call
    `["a", ..., 1000, ...]`, refused at that input) must not be read as one id prompt."""


def as_input_list(inputs: Any) -> InputList:
    """A single input (text, dict, image, flat id list or 1-D tensor) becomes a list of one."""
    if isinstance(inputs, InputList):
        return inputs
    if isinstance(inputs, str | Mapping) or is_image(inputs):
        return InputList([inputs])
    if isinstance(inputs, np.ndarray) or is_tensor(inputs):
        if inputs.ndim == 0:
            raise InputError(
                "inputs must be a string, a dict or a list of inputs, got a 0-d "
                f"{type(inputs).__name__} (one number, not token ids)"
            )
        return InputList([inputs] if inputs.ndim == 1 else inputs)
    if isinstance(inputs, Sequence):
        if (
            len(inputs) > 0
            and isinstance(inputs[0], int | np.integer)
            and not isinstance(inputs[0], bool)
        ):
            return InputList([inputs])
        return InputList(inputs)
    raise InputError(
        f"inputs must be a string, a dict or a list of inputs, got {type(inputs).__name__}"
    )


def make_requests(
    ctx: CallContext,
    inputs: Any,
    params: PoolingParams,
    options: TextOptions | None = None,
    matryoshka_only: bool = False,
) -> list[PromptRequest]:
    """Validate and tokenize `inputs` into requests under `params`; `InputError` on the first
    bad input or parameter. Safe to call from any thread. `matryoshka_only`: `dimensions`
    only for a model whose folder declares matryoshka support (vLLM's and OpenAI's rule)."""
    items = as_input_list(inputs)
    task = get_task(params.task)
    # Parameters belong to the whole call: checked once, before any input is touched.
    task.check_params(params)
    check_task(ctx.info, task.name)
    _check_dimensions(ctx.info, params, matryoshka_only)
    tag, vocab = params.step_tag_id, ctx.info.vocab_size
    if tag is not None and tag >= vocab:  # no position could hold it: an empty answer
        raise InputError(
            f"step_tag_id {tag} is outside the vocabulary [0, {vocab})", field="step_tag_id"
        )
    prompts = ctx.inputs.process(items, options or TextOptions(), params.input_type)
    return [PromptRequest(index, prompt, params) for index, prompt in enumerate(prompts)]


def check_task(info: EngineInfo, name: str) -> None:
    """`InputError` naming `task` unless the engine serves task `name`: one it cannot serve,
    or one it was not made for (embed on a classifier) and was not asked to serve, with how
    to ask. The words lead with vLLM's: "Unsupported task", and for a task vLLM serves once a
    model's pooling task is switched (token_classify on a sequence classifier), "Try
    switching the model's pooling_task"."""
    served = ", ".join(info.tasks)
    reason = info.unavailable_tasks.get(name)
    if reason is not None:
        raise InputError(
            f"Unsupported task: {name!r}: this model cannot serve task {name!r}: {reason}. "
            f"Supported tasks: {served}",
            field="task",
        )
    reason = info.opt_in_tasks.get(name)
    if reason is None:
        return
    how = f"start the engine with tasks=[{name!r}] (`vecpool serve --task {name}`)"
    if name == "token_classify":
        message = (
            f"Try switching the model's pooling_task via the engine's tasks option: {how}. "
            f"{reason}. Supported tasks: {served}"
        )
    else:
        message = (
            f"Unsupported task: {name!r}: {reason}. Supported tasks: {served}. To serve it "
            f"anyway, {how}"
        )
    raise InputError(message, field="task")


def instruction(ctx: CallContext, prompt_name: str | None, prompt: str | None) -> str | None:
    """The instruction prefix of text inputs: `prompt`, else the folder's prompt named
    `prompt_name`, else its default prompt, else none."""
    for value, field in ((prompt, "prompt"), (prompt_name, "prompt_name")):
        if value is not None and not isinstance(value, str):
            raise InputError(f"must be a string, got {type(value).__name__}", field=field)
    if prompt is not None and prompt_name is not None:
        raise InputError("pass either prompt or prompt_name, not both", field="prompt_name")
    if prompt is not None:
        try:
            check_unicode(prompt, None)
        except InputError as exc:  # the call's prompt, not an input
            raise InputError(exc.reason, field="prompt") from None
        return prompt
    info = ctx.info
    name = prompt_name if prompt_name is not None else info.default_prompt_name
    if name is None:
        return None
    if name not in info.prompts:
        known = ", ".join(sorted(info.prompts)) or "none"
        raise InputError(
            f"unknown prompt name {name!r}; the model's prompts: {known}", field="prompt_name"
        )
    return info.prompts[name]


def check_dimensions(info: EngineInfo, dimensions: int | None, task: str = "embed") -> None:
    """`InputError` unless `dimensions` (None: the model's own) is a width the task's vectors
    can be cut to: from 1 to their full size."""
    if dimensions is None:
        return
    size = info.token_output_dim if task == "token_embed" else info.output_dim
    if not 1 <= dimensions <= size:
        raise InputError(
            f"dimensions={dimensions} must be between 1 and the model's output size {size}",
            field="dimensions",
        )


def _check_dimensions(info: EngineInfo, params: PoolingParams, matryoshka_only: bool) -> None:
    d = params.dimensions
    if d is None:
        return
    check_dimensions(info, d, params.task)
    if matryoshka_only and not info.is_matryoshka:
        raise InputError(
            f'Model "{info.model_name}" does not support matryoshka representation, changing '
            "output dimensions will lead to poor results (its config.json declares neither "
            "is_matryoshka nor matryoshka_dimensions).",
            field="dimensions",
        )
    if info.matryoshka_dimensions is not None and d not in info.matryoshka_dimensions:
        raise InputError(
            f"dimensions={d} is not one of the model's matryoshka dimensions "
            f"{list(info.matryoshka_dimensions)}",
            field="dimensions",
        )


@dataclass(frozen=True)
class TokenizedText:
    """A text as the model's tokenizer writes it: one entry per token, in order."""

    text: str  # the text tokenized: the instruction prompt, if any, then the input
    ids: list[int]
    tokens: list[str]  # the vocabulary entry of each token
    special: list[bool]  # whether each token is a special token ([CLS], [SEP], ...)
    offsets: list[tuple[int, int]]  # (start, end) characters of `text` each token covers


def tokenize(
    ctx: CallContext,
    text: str,
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    add_special_tokens: bool = True,
) -> list[int]:
    """The token ids a text input becomes (special tokens and instruction included), however
    long: counting tokens is one of its uses."""
    return tokenize_text(
        ctx, text, prompt_name=prompt_name, prompt=prompt, add_special_tokens=add_special_tokens
    ).ids


def tokenize_text(
    ctx: CallContext,
    text: str,
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    add_special_tokens: bool = True,
) -> TokenizedText:
    """`tokenize`, with each token's vocabulary entry, whether it is special, and the
    characters it covers. `add_special_tokens=False`: the text's own tokens only."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer.json", field="prompt")
    if not isinstance(text, str):
        raise InputError(f"must be a string, got {type(text).__name__}", field="prompt")
    if not text:
        raise InputError("the input is an empty string", field="prompt")
    check_flag(add_special_tokens, "add_special_tokens")
    prefix = instruction(ctx, prompt_name, prompt) or ""
    full = prefix + text
    ctx.inputs.check_text_size(full)
    check_unicode(full, None)  # one text, not the first of a list
    if add_special_tokens:
        encoding = tokenizer.encode_batch([full])[0]
    else:
        encoding = tokenizer.encode_plain(full)
    return TokenizedText(
        text=full,
        ids=list(encoding.ids),
        tokens=list(encoding.tokens),
        special=[bool(m) for m in encoding.special_tokens_mask],
        offsets=[(int(a), int(b)) for a, b in encoding.offsets],
    )


def detokenize(
    ctx: CallContext, token_ids: Sequence[int], *, skip_special_tokens: bool = True
) -> str:
    """The text of vocabulary ids (special tokens skipped unless `skip_special_tokens=False`)."""
    tokenizer = ctx.tokenizer
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer.json", field="tokens")
    check_flag(skip_special_tokens, "skip_special_tokens")
    ids = ctx.inputs.vocabulary_ids(token_ids, field="tokens")
    return tokenizer.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)


# Which of a model's instruction prompts serves each retrieval role, in order of preference.
_ROLE_PROMPTS = {
    "query": ("query",),
    "document": ("document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


def role_prompt_name(info: EngineInfo, role: str | None) -> str | None:
    """The model's prompt for a retrieval `role` ("query", "document", "classification",
    "clustering"): a prompt of that name ("document" or "passage" for documents) when the
    folder has one, else None (no prompt named; the folder's default prompt applies)."""
    for name in _ROLE_PROMPTS.get(role or "", ()):
        if name in info.prompts:
            return name
    return None
