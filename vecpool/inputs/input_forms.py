"""The form of one input, told apart before anything is read or tokenized: a text, a text
pair, token ids, prompt embeds, an image, or text with images (a dict, or a list of parts);
and the words a model uses to refuse a form it cannot take. `vecpool.inputs.prompts` turns
each form into a `Prompt`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vecpool.errors import InputError
from vecpool.inputs.arrays import is_float, is_tensor
from vecpool.inputs.images import DATA_IMAGE_PREFIX, ImageReader, is_image
from vecpool.inputs.vision_prompts import VisionFormat, is_parts, is_vision_dict

NO_TOWER = (
    "an image, but this model has no image tower (it embeds text only; CLIP and SigLIP models "
    "embed images, Qwen2-VL models text with images)"
)


def no_vision(kind: str, reader: ImageReader | None) -> str:
    """Why a model that is not a vision-language model refuses an input of `kind`."""
    what = "a list of parts" if kind == "parts" else "text with images"
    if reader is not None:
        return (
            f"{what}, but this model embeds texts and images apart (a dual encoder): give "
            "each text and each image as an input of its own"
        )
    if kind == "image":
        return NO_TOWER
    return (
        f"{what}, but this model has no image tower (it embeds text only; Qwen2-VL models "
        "embed text with images)"
    )


def in_prompt(kind: str, vision: VisionFormat | None) -> bool:
    """Whether an input of `kind` becomes a prompt with images (a vision-language model's
    image, or text with images for any model, which refuses it unless it is one)."""
    return kind in ("vision", "parts") or (kind == "image" and vision is not None)


def input_kind(item: Any, index: int) -> str:
    """The form of one input: "text", "pair", "token_ids", "prompt_embeds", "image", or, with
    images in a prompt, "vision" (a dict) or "parts" (a list of parts)."""
    return classify(item, index)[0]


def holds_images(item: Any) -> bool:
    """Whether an input is an image or a prompt with images (a malformed one: False, its
    error is raised where the input is read)."""
    try:
        return input_kind(item, 0) in ("image", "vision", "parts")
    except InputError:
        return False


def classify(item: Any, index: int) -> tuple[str, Any]:
    """(kind, value) of one input: kind is "text", "pair", "token_ids", "prompt_embeds",
    "image" (see `vecpool.inputs.images.is_image` for the forms an image takes), "vision" or
    "parts" (see `vecpool.inputs.vision_prompts`)."""
    if type(item) is list:  # the common cases first: ABC isinstance checks cost microseconds
        return ("parts", item) if is_parts(item) else ("token_ids", item)
    if isinstance(item, str):
        return ("image", item) if item.startswith(DATA_IMAGE_PREFIX) else ("text", item)
    if isinstance(item, Mapping):
        keys = set(item)
        if keys == {"text", "text_pair"}:
            return "pair", _text_pair(item, index)
        if is_vision_dict(item):
            return "vision", item
        known = {"prompt", "prompt_token_ids", "prompt_embeds", "image"}
        if len(keys) != 1 or not keys <= known:
            raise InputError(
                f"a dict input needs exactly one of the keys {sorted(known)}, the two keys "
                "'text' and 'text_pair', or 'image' with one of 'text', 'prompt', "
                f"'prompt_token_ids'; got {sorted(map(str, keys))}",
                index=index,
            )
        (key,) = keys
        value = item[key]
        if key == "image":
            return "image", value
        if key == "prompt":
            if not isinstance(value, str):
                raise InputError(
                    f"'prompt' must be a string, got {type(value).__name__}", index=index
                )
            return "text", value
        return ("token_ids" if key == "prompt_token_ids" else "prompt_embeds"), value
    if is_image(item):
        return "image", item
    if isinstance(item, np.ndarray) or is_tensor(item):
        if item.ndim == 1 and not is_float(item):
            return "token_ids", item
        raise InputError(
            "a bare tensor is ambiguous; wrap prompt embeds as {'prompt_embeds': tensor}",
            index=index,
        )
    if isinstance(item, Sequence):
        return "token_ids", item
    raise InputError(
        f"unsupported input type {type(item).__name__}; expected a string, a list of token ids, "
        "an image or a dict with 'prompt', 'prompt_token_ids', 'prompt_embeds' or 'image'",
        index=index,
    )


def _text_pair(item: Mapping[str, Any], index: int) -> tuple[str, str]:
    pair = (item["text"], item["text_pair"])
    for name, value in zip(("text", "text_pair"), pair, strict=True):
        if not isinstance(value, str):
            raise InputError(
                f"'{name}' must be a string, got {type(value).__name__}", index=index, field=name
            )
        if not value:
            raise InputError(f"'{name}' is an empty string", index=index, field=name)
    return pair
