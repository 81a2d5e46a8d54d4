"""Score pairs of a cross-encoder that reads each pair as one written prompt (jina-reranker-m0,
`vecpool.config.PairTemplate`): each side a text or an image (or a list of parts of both),
written into the template, tokenized, the template's suffix tokens appended; an input with
images goes to the input stage as token ids with its images (`vecpool.inputs.vision_prompts`),
which grows each placeholder to its image's rows.

Side forms: a string (a `data:image/` URI is an image), an image (a PIL image, bytes, a path),
`{"image": image}`, `{"text": str, "image": image or [images]}` (the images, then the text), or
a list of parts (`{"type": "text" | "image" | "image_url" |
"image_embeds", ...}`, vLLM's score content) whose text parts are written as they are and
image parts as the image's placeholder. Model-free, as all of `vecpool.calls`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vecpool.calls.context import CallContext
from vecpool.config import PairTemplate
from vecpool.errors import InputError
from vecpool.inputs.images import DATA_IMAGE_PREFIX, is_image
from vecpool.inputs.prompts import TruncationSide
from vecpool.inputs.tokenizer import check_unicode
from vecpool.inputs.vision_prompts import is_parts, parse_vision_input

_SIDES = ("text_1", "text_2")
_IMAGE_FIELDS = ("image", "image_embeds", "image_grid_thw")


@dataclass(frozen=True)
class SideText:
    """One side of a pair as the template writes it: its text (an image as its
    placeholder), its images in order, and its text alone when it is only a text."""

    text: str
    images: list[Any]
    plain: str | None  # the side's text when it holds no image (a document that may be cut)


def read_side(value: Any, index: int, field: str, template: PairTemplate) -> SideText:
    """One side of pair `index` (`field` "text_1" or "text_2") in any of the side forms;
    `InputError` naming the pair and the side for another."""
    if isinstance(value, str) and not value.startswith(DATA_IMAGE_PREFIX):
        return SideText(value, [], value)
    if isinstance(value, Mapping) and set(value) == {"image"}:
        return SideText(template.image_text, [value["image"]], None)
    if (isinstance(value, list) and is_parts(value)) or (
        isinstance(value, Mapping) and set(value) == {"text", "image"}
    ):
        try:
            given = parse_vision_input(value, index)
        except InputError as exc:
            raise InputError(exc.reason, index=index, field=field) from None
        parts = given.parts or []
        text = "".join(template.image_text if kind == "image" else v for kind, v in parts)
        return SideText(text, given.images, None if given.images else text)
    if is_image(value) or isinstance(value, str):  # an image, or a data:image/ URI
        return SideText(template.image_text, [value], None)
    raise InputError(
        f"this reranker scores texts and images: a side is a string, an image, "
        f'{{"image": ...}}, {{"text", "image"}} or a list of text and image parts, got {type(value).__name__}',
        index=index,
        field=field,
    )


def template_inputs(
    ctx: CallContext,
    lefts: list[Any],
    rights: list[Any],
    pairing: list[int],
    limit: int | None,
    side: TruncationSide,
) -> tuple[list[Any], list[str | None]]:
    """The input of each pair (`pairing[i]`: its left item), and for each pair the side whose
    images it holds ("text_1" or "text_2"; None: none or both), which an error about its
    images names. `limit`: the tokens a pair may take (truncate_prompt_tokens), met by
    cutting a text document at a token boundary of its own; a pair with images is not cut."""
    info, tokenizer = ctx.info, ctx.tokenizer
    template = info.pair_template
    assert template is not None
    if tokenizer is None:
        raise InputError(
            f"{info.architecture} writes each pair into its prompt template, which needs the "
            "model's tokenizer.json"
        )
    queries: dict[int, SideText] = {}
    pairs: list[tuple[SideText, SideText]] = []
    for i, (left, right) in enumerate(zip(pairing, rights, strict=True)):
        if left not in queries:
            queries[left] = read_side(lefts[left], i, "text_1", template)
        query, document = queries[left], read_side(right, i, "text_2", template)
        for name, part in (("text_1", query.text), ("text_2", document.text)):
            try:
                ctx.inputs.check_text_size(part, i)
                check_unicode(part, i)
            except InputError as exc:
                raise InputError(exc.reason, index=i, field=name) from None
        pairs.append((query, document))
    # Every pair's prompt tokenized in one call (indexed by pair, as its errors are).
    texts = [template.format(query.text, document.text) for query, document in pairs]
    all_ids = tokenizer.encode_ids(texts)
    inputs: list[Any] = []
    image_sides: list[str | None] = []
    suffix = list(template.suffix_ids)
    for i, ((query, document), array) in enumerate(zip(pairs, all_ids, strict=True)):
        ids = [int(t) for t in array]
        over = limit is not None and len(ids) + len(suffix) > limit
        if over and limit is not None and document.plain is not None and not query.images:
            ids = _cut_document(ctx, template, query.text, document.plain, limit, side, i)
        images = document.images + query.images
        if not template.document_first:
            images = query.images + document.images
        ids = ids + suffix
        if images:
            inputs.append({"prompt_token_ids": ids, "image": images})
        else:
            inputs.append({"prompt_token_ids": ids})
        sides = [n for n, s in zip(_SIDES, (query, document), strict=True) if s.images]
        image_sides.append(sides[0] if len(sides) == 1 else None)
    return inputs, image_sides


def _ids(ctx: CallContext, text: str, index: int) -> list[int]:
    assert ctx.tokenizer is not None
    try:
        (ids,) = ctx.tokenizer.encode_ids([text])
    except InputError as exc:
        raise exc.at(index) from None
    return [int(t) for t in ids]


def _cut_document(
    ctx: CallContext,
    template: PairTemplate,
    query: str,
    document: str,
    limit: int,
    side: TruncationSide,
    index: int,
) -> list[int]:
    """The ids of the pair's prompt with the document cut (at a token boundary of its own) so
    that the prompt and the suffix take at most `limit` tokens; the template and the query
    stay whole."""
    assert ctx.tokenizer is not None
    room = limit - len(template.suffix_ids)
    offsets = ctx.tokenizer.encode_plain(document).offsets  # [(start, end)] per token
    ids = _ids(ctx, template.format(query, document), index)
    keep = len(offsets) - (len(ids) - room)
    for _ in range(8):  # token boundaries may merge differently inside the prompt
        if keep < 1:
            raise InputError(
                f"the pair's prompt without its document takes more than {limit} tokens; "
                "raise truncate_prompt_tokens or shorten the query",
                index=index,
                field="truncate_prompt_tokens",
            )
        if side == "right":
            cut = document[: offsets[keep - 1][1]]
        else:
            cut = document[offsets[len(offsets) - keep][0] :]
        ids = _ids(ctx, template.format(query, cut), index)
        over = len(ids) - room
        if over <= 0:
            break
        keep -= over
    return ids


def template_error(exc: InputError, image_sides: list[str | None]) -> InputError:
    """An error about pair `exc.index` naming its side: the one it already names, else the
    side holding the pair's images, else the document ("text_2")."""
    if exc.index is None or (exc.field or "").startswith(_SIDES):
        return exc
    if exc.field not in (None, "prompt", "prompt_token_ids", *_IMAGE_FIELDS):
        return exc
    side = image_sides[exc.index] or "text_2"
    field = side if exc.field in (None, "prompt", "prompt_token_ids") else f"{side}.{exc.field}"
    return type(exc)(exc.reason, index=exc.index, field=field)
