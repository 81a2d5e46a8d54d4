"""The input stage's values: a validated `Prompt`, the limits and options it is checked
against, how a late-interaction model's sides are written, and the words of a too-long error.
`vecpool.inputs.prompts` turns inputs into them; the engine and runners read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vecpool.errors import InputError, InputTooLongError, check_flag
from vecpool.inputs.arrays import TruncationSide
from vecpool.inputs.pixels import ImagePixels, ImageSpan


@dataclass(frozen=True)
class Prompt:
    """One validated input: token ids, prompt embeds that replace the embedding lookup, or an
    image for a dual encoder's image tower (one row of the flat batch, which the model fills
    with the image's embedding). A vision-language model's prompt is token ids with `images`:
    each image fills its run of placeholder tokens, and the prompt carries its multimodal
    rotary positions. Such a prompt may run in chunks like any causal model's: its images'
    rows are computed once, by the model runner, and kept until its last chunk has read them."""

    token_ids: np.ndarray | None  # [num_tokens] int64; None for prompt embeds
    # [num_tokens, hidden]: a float numpy array as the input stage checked it (a bfloat16
    # tensor widened to float32, exactly); a CPU torch tensor in the model dtype once an engine
    # takes it (`Engine.submit`), which is all the runner sees. None for token ids. (Typed Any:
    # this module names no torch type, so that it never loads torch.)
    prompt_embeds: Any
    token_type_ids: np.ndarray | None = None  # [num_tokens] int64, segment ids of a text pair
    # Only the first `num_attended` tokens are attended to (ColBERT's query expansion that the
    # model does not attend to); None: every token is.
    num_attended: int | None = None
    image: ImagePixels | None = None  # an image input (token_ids and prompt_embeds None)
    # A vision-language prompt's images, in order of their placeholder spans in `token_ids`.
    images: tuple[ImageSpan, ...] = ()
    # [3, num_tokens] int64 (temporal, height, width) positions of a prompt with `images`, for
    # a model with multimodal rotary positions (M-RoPE); None: the positions 0, 1, 2, ...
    mrope_positions: np.ndarray | None = None
    # Rows of the prompt: read several times per step, so set once.
    num_tokens: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.image is not None:
            object.__setattr__(self, "num_tokens", 1)
            return
        rows = self.token_ids if self.token_ids is not None else self.prompt_embeds
        assert rows is not None
        object.__setattr__(self, "num_tokens", int(rows.shape[0]))

    @property
    def num_patches(self) -> int:
        """Patch rows the vision tower runs for the prompt: an image's, or those of a
        vision-language prompt's images given as pixels (not as precomputed rows)."""
        if self.image is not None:
            return self.image.num_patches
        return sum(s.pixels.num_patches for s in self.images if s.pixels is not None)

    def patches_in(self, start: int, end: int) -> int:
        """Patch rows the vision tower runs for a chunk of prompt positions `[start, end)`:
        those of the images whose placeholder span begins in it (an image's rows are computed
        once, in the step whose chunk reaches its first placeholder token, and kept for the
        chunks after it that its span reaches)."""
        if self.image is not None:
            return self.image.num_patches if start == 0 < end else 0
        return sum(
            s.pixels.num_patches
            for s in self.images
            if s.pixels is not None and start <= s.start < end
        )

    @property
    def runs_whole(self) -> bool:
        """Whether the prompt runs in one step, never in chunks: a dual encoder's image (one
        row of the batch). A vision-language prompt with images may run in chunks."""
        return self.image is not None


@dataclass(frozen=True)
class InputLimits:
    """What the model accepts; set once by the engine."""

    vocab_size: int
    hidden_size: int
    max_model_len: int
    dtype: str  # the model's dtype name: "float32", "float16", "bfloat16"
    enable_prompt_embeds: bool
    # Longer texts are refused before they are tokenized (tokenizing costs time and memory in
    # proportion to the text, truncated or not); None: no limit.
    max_input_chars: int | None = None
    # Texts and token-id prompts shorter than this are padded with `pad_id` to it, as the
    # model was trained (SigLIP: 64); prompt embeds are taken as given. None: no padding.
    pad_to: int | None = None
    pad_id: int = 0


@dataclass(frozen=True)
class TextOptions:
    """Per-call options of tokenization."""

    truncate_prompt_tokens: int | None = None  # keep this many tokens; -1: the model's limit
    truncation_side: TruncationSide = "right"  # "right" keeps the start, "left" the end
    prompt: str | None = None  # instruction prefix for text inputs
    # False: a text becomes its own tokens only, without the tokenizer's special tokens
    # ([CLS], [SEP], BOS ...): what a text already rendered by a chat template wants.
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int)):
            raise InputError(
                f"must be an integer (-1: the model's limit), got {t!r}",
                field="truncate_prompt_tokens",
            )
        if self.truncation_side not in ("left", "right"):
            raise InputError(
                f"must be 'left' or 'right', got {self.truncation_side!r}", field="truncation_side"
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise InputError(f"must be a string, got {type(self.prompt).__name__}", field="prompt")
        check_flag(self.add_special_tokens, "add_special_tokens")


@dataclass(frozen=True)
class SideFormat:
    """How the inputs of one side (query or document) of a late-interaction model are written."""

    prompt: str = ""  # text in front of a text input (unless the call gives its own prompt)
    marker_id: int | None = None  # a token inserted after the first one (ColBERT's [Q] after [CLS])
    max_tokens: int | None = None  # the side's length limit, marker and special tokens included
    expand_to: int = 0  # a shorter input is padded with `expansion_id` up to this many tokens
    expansion_id: int = 0
    attend_expansion: bool = True  # False: no token attends to the expansion tokens


# How a too-long error says to truncate, in the API's terms; `vecpool embed` words it as its
# own option.
TRUNCATE_ADVICE = "pass truncate_prompt_tokens (-1 for the limit) to truncate it"
# vLLM's closing words of a too-long error (before its renderer's "... input prompt."), which
# clients match on.
REDUCE_LENGTH = "Please reduce the length of the input."


def too_long(n: int, limit: int, index: int | None, side: str | None = None) -> InputError:
    """The error of an input over the length limit (of the model, or of a late-interaction
    model's query or document `side`). Its wording carries "maximum context length", the
    phrase of OpenAI and vLLM that clients match on to truncate and retry, and vLLM's "Please
    reduce the length of the input."."""
    what = "input" if side is None else side
    scope = "" if side is None else f" for a {side}"
    return InputTooLongError(
        f"the {what} has {n} tokens, more than the model's maximum context length{scope} of "
        f"{limit} tokens; {TRUNCATE_ADVICE}. {REDUCE_LENGTH}",
        index=index,
    )
