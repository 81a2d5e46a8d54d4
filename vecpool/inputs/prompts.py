"""Input forms -> `Prompt`: tokenization, truncation, instruction prompts, validation.

An input is a string, a list of token ids, a 2-D prompt-embeds tensor wrapped as
`{"prompt_embeds": tensor}`, the dict forms `{"prompt": str}` / `{"prompt_token_ids": [...]}`,
or a text pair `{"text": str, "text_pair": str}` (a cross-encoder's query and document, joined
by the tokenizer's pair template, with segment ids). A model with an image tower also takes
images: a dual encoder's as inputs of their own, a vision-language model's inside prompts
(`vecpool.inputs.vision_prompts` lists those forms). Every error names the input's index in the
call and what was wrong with it. `vecpool.inputs.input_forms` tells the forms apart;
`vecpool.inputs.prompt_data` holds the values made here (`Prompt`, limits, options).

A late-interaction (ColBERT) model writes its queries and documents differently: inputs of one
side (`input_type`) get the side's marker token after the first token, the side's length
limit, and, for queries, the expansion up to a fixed length (`SideFormat`).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from vecpool.errors import InputError, InputTooLongError
from vecpool.inputs.arrays import (
    OVERFLOW,
    TruncationSide,
    as_id_array,
    float_array,
    is_tensor,
    peak,
    truncate,
)
from vecpool.inputs.images import ImageReader
from vecpool.inputs.input_forms import NO_TOWER, classify, in_prompt, input_kind, no_vision
from vecpool.inputs.pixels import ImagePixels
from vecpool.inputs.prompt_data import (
    REDUCE_LENGTH,
    TRUNCATE_ADVICE,
    InputLimits,
    Prompt,
    SideFormat,
    TextOptions,
    too_long,
)
from vecpool.inputs.tokenizer import TextTokenizer, id_arrays
from vecpool.inputs.tokenizer_pool import TokenizerPool
from vecpool.inputs.vision_prompts import (
    ImageRows,
    VisionFormat,
    VisionInput,
    image_rows,
    is_precomputed,
    mrope_positions,
    parse_vision_input,
    place_images,
    render,
)

# Re-exported: the names callers import from here.
__all__ = [
    "REDUCE_LENGTH",
    "TRUNCATE_ADVICE",
    "InputLimits",
    "InputProcessor",
    "Prompt",
    "SideFormat",
    "TextOptions",
    "TextTokenizer",
    "TruncationSide",
    "input_kind",
    "is_tensor",
    "too_long",
]


class InputProcessor:
    """Turns the inputs of one call into validated `Prompt`s (tokenizing texts in one batch)."""

    def __init__(
        self,
        limits: InputLimits,
        tokenizer: TextTokenizer | None,
        sides: Mapping[str, SideFormat] | None = None,
        tokenizer_pool: TokenizerPool | None = None,
        images: ImageReader | None = None,
    ):
        self.limits = limits
        self.tokenizer = tokenizer
        self.images = images  # None: the model has no image tower
        # Large batches of single texts are tokenized there when it can take them (engine side).
        self.tokenizer_pool = tokenizer_pool
        self.sides = dict(sides or {})  # by input type; empty unless a late-interaction model
        # A `time.monotonic()` moment by which the call's image fetches end (`until`).
        self.deadline: float | None = None

    def until(self, deadline: float | None) -> InputProcessor:
        """This input stage for one call that must be done by `deadline` (a
        `time.monotonic()` value; None: no deadline): an image it fetches from a URL is cut
        off then. A copy: the stage itself is shared by every call."""
        if deadline is None:
            return self
        stage = copy.copy(self)
        stage.deadline = deadline
        return stage

    def process(
        self, inputs: Sequence[Any], options: TextOptions, input_type: str | None = None
    ) -> list[Prompt]:
        """Validate every input; raise `InputError` naming the first bad one. With `input_type`,
        write them as that side of a late-interaction model."""
        if input_type is not None:
            return self._side(inputs, options, input_type)
        prompts = self._process(inputs, options)
        pad_to = self.limits.pad_to
        if pad_to is None:
            return prompts
        return [_padded(p, pad_to, self.limits.pad_id) for p in prompts]

    def _process(self, inputs: Sequence[Any], options: TextOptions) -> list[Prompt]:
        limit = self._limit(options)  # the call's option: checked once, before any input
        kinds: list[tuple[str, Any]] = [classify(item, i) for i, item in enumerate(inputs)]
        prompts: list[Prompt | None] = [None] * len(kinds)
        text_indices = [i for i, (kind, _) in enumerate(kinds) if kind in ("text", "pair")]
        if text_indices:
            texts = self._texts(kinds, text_indices, options, limit)
            if len(texts) == len(kinds):  # the common call: texts only
                return texts
            for i, prompt in zip(text_indices, texts, strict=True):
                prompts[i] = prompt
        others = [i for i, (kind, _) in enumerate(kinds) if kind not in ("text", "pair")]
        side = options.truncation_side
        checked = None  # token ids only: checked together
        if others and all(kinds[i][0] == "token_ids" for i in others):
            checked = self._id_prompts([kinds[i][1] for i in others], limit, side)
        if checked is not None:
            for i, prompt in zip(others, checked, strict=True):
                prompts[i] = prompt
        else:  # one by one, in input order: the first bad input raises
            vision = self.images.vision if self.images is not None else None
            in_prompts = [i for i in others if in_prompt(kinds[i][0], vision)]
            made = self._vision_prompts(kinds, in_prompts, options, limit)
            images = self._read_images(kinds, [i for i in others if i not in made])
            for i in others:
                kind, value = kinds[i]
                if i in made:
                    result = made[i]
                    if isinstance(result, InputError):
                        raise result
                    prompts[i] = result
                elif kind == "token_ids":
                    prompts[i] = self._token_ids(value, i, limit, side)
                elif kind == "image":
                    pixels = images.get(i)
                    if isinstance(pixels, InputError):
                        raise pixels
                    prompts[i] = Prompt(token_ids=None, prompt_embeds=None, image=pixels)
                else:
                    prompts[i] = self._prompt_embeds(value, i, limit, side)
        return [p for p in prompts if p is not None]

    def _side(self, inputs: Sequence[Any], options: TextOptions, input_type: str) -> list[Prompt]:
        """Inputs of one side: the side's prompt in front of texts, its marker after the first
        token, its length limit (truncate_prompt_tokens counts the marker), and the expansion of
        a shorter input. Prompt embeds are the model's input as given: nothing is inserted (the
        task declares that such a request needs token ids, and it fails alone)."""
        side = self.sides.get(input_type)
        if side is None:
            raise InputError(
                f"input_type {input_type!r} needs a late-interaction model (HF_ColBERT or a "
                "multi-vector sentence-transformers folder, with its tokenizer); this model "
                "writes queries and documents alike",
                field="input_type",
            )
        has_text = False
        for i, item in enumerate(inputs):
            if isinstance(item, Mapping) and set(item) == {"text", "text_pair"}:
                raise InputError(
                    f"a text pair has no {input_type} side; give single inputs", index=i
                )
            if isinstance(item, str) or (isinstance(item, Mapping) and "prompt" in item):
                has_text = True
        max_tokens = min(self.limits.max_model_len, side.max_tokens or sys.maxsize)
        limit = self._limit(options)  # the model's rules for truncate_prompt_tokens
        reserve = 0 if side.marker_id is None else 1
        marker = f" (its {input_type} marker included)" if reserve else ""
        if limit is not None:
            limit = min(limit, max_tokens)
            specials = self.tokenizer.num_special_tokens if self.tokenizer and has_text else 0
            if limit - reserve - specials < 1:
                raise InputError(
                    f"truncation to {limit} tokens leaves no room besides {specials} special "
                    f"tokens{marker}",
                    field="truncate_prompt_tokens",
                )
        # Lengths are checked below, once the marker is in.
        unlimited = InputProcessor(
            replace(self.limits, max_model_len=sys.maxsize),
            self.tokenizer,
            tokenizer_pool=self.tokenizer_pool,
        )
        inner_options = replace(
            options,
            truncate_prompt_tokens=None if limit is None else limit - reserve,
            prompt=(side.prompt or None) if options.prompt is None else options.prompt,
        )
        prompts = []
        for i, prompt in enumerate(unlimited.process(inputs, inner_options)):
            ids = prompt.token_ids
            if ids is not None and side.marker_id is not None:
                ids = np.insert(ids, 1, side.marker_id)
            n = prompt.num_tokens if ids is None else int(ids.shape[0])
            if n > max_tokens:
                raise too_long(n, max_tokens, i, input_type)
            if ids is None:
                prompts.append(prompt)
                continue
            num_attended = None
            if n < side.expand_to:
                padding = np.full(side.expand_to - n, side.expansion_id, dtype=np.int64)
                ids = np.concatenate((ids, padding))
                num_attended = None if side.attend_expansion else n
            prompts.append(Prompt(token_ids=ids, prompt_embeds=None, num_attended=num_attended))
        return prompts

    def _read_images(
        self, kinds: list[tuple[str, Any]], others: list[int]
    ) -> dict[int, ImagePixels | InputError]:
        """The call's images read (in parallel where there are several), by input index."""
        indices = [i for i in others if kinds[i][0] == "image"]
        if not indices:
            return {}
        if self.images is None:
            return {i: InputError(NO_TOWER, index=i) for i in indices}
        read = self.images.read_many([(i, kinds[i][1]) for i in indices], self.deadline)
        return dict(zip(indices, read, strict=True))

    def _vision_prompts(
        self,
        kinds: list[tuple[str, Any]],
        indices: list[int],
        options: TextOptions,
        limit: int | None,
    ) -> dict[int, Prompt | InputError]:
        """The prompts of the inputs that hold images in a prompt (`vecpool.inputs.
        vision_prompts`), or each one's error, by input index; their images read together."""
        if not indices:
            return {}
        reader = self.images
        if reader is None or reader.vision is None:
            return {i: InputError(no_vision(kinds[i][0], reader), index=i) for i in indices}
        out: dict[int, Prompt | InputError] = {}
        parsed: dict[int, VisionInput] = {}
        for i in indices:
            try:
                parsed[i] = parse_vision_input(kinds[i][1], i)
            except InputError as exc:
                out[i] = exc
        to_read = [
            (i, j, value)
            for i, given in parsed.items()
            for j, value in enumerate(given.images)
            if not is_precomputed(value)
        ]
        read = reader.read_many([(i, value) for i, _, value in to_read], self.deadline)
        pixels = {(i, j): got for (i, j, _), got in zip(to_read, read, strict=True)}
        for i, given in parsed.items():
            try:
                out[i] = self._vision_prompt(given, i, reader.vision, pixels, options, limit)
            except InputError as exc:
                out[i] = exc
        return dict(sorted(out.items()))

    def _vision_prompt(
        self,
        given: VisionInput,
        index: int,
        fmt: VisionFormat,
        pixels: dict[tuple[int, int], ImagePixels | InputError],
        options: TextOptions,
        limit: int | None,
    ) -> Prompt:
        limits = self.limits
        images: list[ImagePixels | ImageRows] = []
        for j, value in enumerate(given.images):
            if not is_precomputed(value):
                got = pixels[(index, j)]
                if isinstance(got, InputError):
                    raise got
                images.append(got)
            elif not limits.enable_prompt_embeds:
                raise InputError(
                    "precomputed image rows are prompt embeds, which are disabled on this "
                    "engine (enable_prompt_embeds=False; a server accepts them when started "
                    "with --enable-prompt-embeds)",
                    index=index,
                    field="image_embeds",
                )
            else:
                images.append(image_rows(value, index, fmt, limits.hidden_size, limits.dtype))
        if given.token_ids is not None:
            ids = as_id_array(given.token_ids, index)
            self._check_vocabulary(ids, index, "prompt_token_ids")
        else:
            if self.tokenizer is None:
                raise InputError(
                    "text input needs a tokenizer, and the model folder has no tokenizer.json; "
                    "pass token ids with image placeholders instead",
                    index=index,
                )
            written = given.text is not None  # a prompt written by the caller
            text = given.text
            if text is None:
                try:
                    text = render(fmt, given.parts or [], options.prompt)
                except InputError as exc:  # the template's, or a layout's refusal
                    raise exc.at(index) from None
            self.check_text_size(text, index)
            specials = options.add_special_tokens and written  # a template writes its own
            try:
                (ids,) = self.tokenizer.encode_ids([text], None, "right", specials)
            except InputError as exc:
                raise exc.at(index) from None
        ids, spans = place_images(ids, images, fmt, index)
        n = int(ids.shape[0])
        if limit is not None and n > limit:
            raise InputError(
                f"the input has {n} tokens with its images' placeholders, more than "
                f"truncate_prompt_tokens={limit}; an input with images is not truncated (a cut "
                "could split an image's placeholders)",
                index=index,
                field="truncate_prompt_tokens",
            )
        self._check_length(n, index)
        if not spans:
            return Prompt(token_ids=ids, prompt_embeds=None)
        return Prompt(
            token_ids=ids,
            prompt_embeds=None,
            images=spans,
            mrope_positions=mrope_positions(n, spans, fmt.merge_size) if fmt.mrope else None,
        )

    def check_text_size(self, text: str | tuple[str, str], index: int | None = None) -> None:
        """`InputError` for a text over the character limit, before any tokenizing."""
        limit = self.limits.max_input_chars
        n = sum(map(len, text)) if isinstance(text, tuple) else len(text)
        if limit is not None and n > limit:
            raise InputTooLongError(
                f"the text has {n} characters, more than the limit of {limit} per input "
                "(checked before tokenizing, whether or not it would be truncated)",
                index=index,
                field=None if index is not None else "prompt",
            )

    def truncation_length(self, truncate_prompt_tokens: int) -> int:
        """The length `truncate_prompt_tokens` asks for (-1: the model's limit); `InputError`
        for a length the model does not accept."""
        limit = self._limit(TextOptions(truncate_prompt_tokens))
        assert limit is not None
        return limit

    def _limit(self, options: TextOptions) -> int | None:
        """The truncation length asked for, or None for "do not truncate"."""
        t = options.truncate_prompt_tokens
        if t is None:
            return None
        if t == -1:
            return self.limits.max_model_len
        if t < 1:
            raise InputError(
                f"truncate_prompt_tokens must be -1 or a positive count, got {t}",
                field="truncate_prompt_tokens",
            )
        if t > self.limits.max_model_len:
            # Not lowered to the limit in silence: the caller asked for more than can run.
            raise InputError(
                f"truncate_prompt_tokens={t} is more than the model's limit of "
                f"{self.limits.max_model_len} tokens; pass -1 to truncate to the limit "
                f"(as vLLM words it: truncate_prompt_tokens value ({t}) is greater than "
                f"max_model_len ({self.limits.max_model_len}). Please request a smaller "
                "truncation size.)",
                field="truncate_prompt_tokens",
            )
        return t

    def _check_length(self, n: int, index: int) -> None:
        if n == 0:
            raise InputError("the input is empty (no tokens)", index=index)
        if n > self.limits.max_model_len:
            raise too_long(n, self.limits.max_model_len, index)

    def _texts(
        self,
        kinds: list[tuple[str, Any]],
        indices: list[int],
        options: TextOptions,
        limit: int | None,
    ) -> list[Prompt]:
        if self.tokenizer is None:
            raise InputError(
                "text input needs a tokenizer, and the model folder has no tokenizer.json; "
                "pass token ids or prompt embeds instead",
                index=indices[0],
            )
        values = [kinds[i][1] for i in indices]  # str, or a (text, text_pair) tuple
        if not all(values):  # (a pair's two texts were checked when it was classified)
            first = next(j for j, value in enumerate(values) if not value)
            raise InputError("the input is an empty string", index=indices[first])
        prefix = options.prompt  # instruction prompts are for single texts
        texts: list[str | tuple[str, str]] = (
            values
            if prefix is None
            else [v if isinstance(v, tuple) else prefix + v for v in values]
        )
        vision = self.images.vision if self.images is not None else None
        query = vision.retrieval if vision is not None else None
        if query is not None:  # a retrieval model's texts are queries, in its processor's layout
            texts = [t if isinstance(t, tuple) else query.query(t) for t in texts]
        max_chars = self.limits.max_input_chars
        if max_chars is not None:
            sizes = [len(t) if isinstance(t, str) else len(t[0]) + len(t[1]) for t in texts]
            over = next((j for j, n in enumerate(sizes) if n > max_chars), None)
            if over is not None:
                self.check_text_size(texts[over], indices[over])
        pairs = [j for j, t in enumerate(texts) if isinstance(t, tuple)]
        if pairs and limit is not None and limit - self.tokenizer.num_pair_special_tokens < 2:
            raise InputError(
                f"truncation to {limit} tokens leaves no room for a text pair besides "
                f"{self.tokenizer.num_pair_special_tokens} special tokens",
                index=indices[pairs[0]],
            )
        side, specials = options.truncation_side, options.add_special_tokens
        specials = specials and (query is None or query.query_special_tokens)
        type_ids: dict[int, np.ndarray] = {}  # of the pairs, by their place in `texts`
        try:
            if pairs and specials and len(pairs) == len(texts):
                arrays, pair_types = self.tokenizer.encode_pair_ids(texts, limit, side)  # type: ignore[arg-type]
                type_ids = dict(enumerate(pair_types))
            elif pairs:
                encodings = self.tokenizer.encode_batch(texts, limit, side, specials, offsets=False)
                arrays = id_arrays(encodings)
                type_ids = {j: np.array(encodings[j].type_ids, dtype=np.int64) for j in pairs}
            else:
                single: list[str] = texts  # type: ignore[assignment]  # no pairs among them
                pool = self.tokenizer_pool
                pooled = None if pool is None else pool.encode_ids(single, limit, side, specials)
                # No pool, or one that left this batch to us.
                arrays = pooled or self.tokenizer.encode_ids(single, limit, side, specials)
        except InputError as exc:  # indexed within `texts`, or about the whole call
            raise exc.at(indices[exc.index or 0]) from None
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        bad = np.flatnonzero((lengths == 0) | (lengths > self.limits.max_model_len))
        if bad.size:
            j = int(bad[0])
            self._check_length(int(lengths[j]), indices[j])
        prompts = [Prompt(a, None) for a in arrays]
        # A single text is all segment 0, which the batch builder fills in itself.
        for j, segment_ids in type_ids.items():
            prompts[j] = replace(prompts[j], token_type_ids=segment_ids)
        return prompts

    def _id_prompts(
        self, values: list[Any], limit: int | None, side: TruncationSide
    ) -> list[Prompt] | None:
        """The prompts of token-id inputs, checked together; None when any of them is bad
        (the one-by-one path then names the first)."""
        try:
            arrays = [as_id_array(value, None) for value in values]
        except InputError:
            return None
        if limit is not None:
            arrays = [truncate(a, limit, side) for a in arrays]
        lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
        if lengths.min() < 1 or lengths.max() > self.limits.max_model_len:
            return None
        flat = np.concatenate(arrays)
        if flat.min() < 0 or flat.max() >= self.limits.vocab_size:
            return None
        return [Prompt(token_ids=a, prompt_embeds=None) for a in arrays]

    def _token_ids(self, value: Any, index: int, limit: int | None, side: TruncationSide) -> Prompt:
        ids = truncate(as_id_array(value, index), limit, side)
        self._check_length(int(ids.shape[0]), index)
        self._check_vocabulary(ids, index, "prompt_token_ids")
        return Prompt(token_ids=ids, prompt_embeds=None)

    def vocabulary_ids(self, value: Any, field: str = "prompt_token_ids") -> np.ndarray:
        """`value` as a `[n]` int64 array of ids of the model's vocabulary (any length), or an
        `InputError` naming `field` and the first bad position."""
        ids = as_id_array(value, None, field)
        self._check_vocabulary(ids, None, field)
        return ids

    def _check_vocabulary(self, ids: np.ndarray, index: int | None, field: str) -> None:
        bad = np.flatnonzero((ids < 0) | (ids >= self.limits.vocab_size))
        if bad.size:
            pos = int(bad[0])
            raise InputError(
                f"token id {int(ids[pos])} at position {pos} is outside the vocabulary "
                f"[0, {self.limits.vocab_size})",
                index=index,
                field=field,
            )

    def _prompt_embeds(
        self, value: Any, index: int, limit: int | None, side: TruncationSide
    ) -> Prompt:
        limits = self.limits
        field = "prompt_embeds"
        if not limits.enable_prompt_embeds:
            raise InputError(
                "prompt embeds are disabled on this engine (enable_prompt_embeds=False; "
                "a server accepts them when started with --enable-prompt-embeds)",
                index=index,
                field=field,
            )
        value = float_array(value, index, field)
        if value.ndim != 2:
            raise InputError(
                f"expected a 2-D tensor [num_tokens, {limits.hidden_size}], got shape "
                f"{list(value.shape)}",
                index=index,
                field=field,
            )
        if value.shape[1] != limits.hidden_size:
            raise InputError(
                f"hidden size {value.shape[1]} does not match the model's {limits.hidden_size}",
                index=index,
                field=field,
            )
        value = truncate(value, limit, side)
        self._check_length(int(value.shape[0]), index)
        if not np.isfinite(value).all():
            raise InputError("the tensor contains NaN or inf", index=index, field=field)
        if value.size and peak(value, limits.dtype) >= OVERFLOW[limits.dtype]:
            raise InputError(
                "the tensor is not finite in the model dtype", index=index, field=field
            )
        return Prompt(token_ids=None, prompt_embeds=np.ascontiguousarray(value))


def _padded(prompt: Prompt, length: int, pad_id: int) -> Prompt:
    """`prompt`'s token ids padded with `pad_id` up to `length` (others as they are)."""
    ids = prompt.token_ids
    if ids is None or ids.shape[0] >= length:
        return prompt
    padding = np.full(length - ids.shape[0], pad_id, dtype=np.int64)
    return replace(prompt, token_ids=np.concatenate((ids, padding)))
