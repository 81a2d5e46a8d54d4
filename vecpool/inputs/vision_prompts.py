"""Inputs of a vision-language model (Qwen2-VL, Qwen2.5-VL): text with images becomes token
ids with one run of placeholder tokens per image, the images (patch rows, or rows computed
before), and the multimodal rotary positions (M-RoPE) of transformers' `get_rope_index`.

The forms, for a model whose folder's image processor is Qwen2-VL's (one input each):

- an image alone (any form `vecpool.inputs.images` reads), or `{"image": image}`;
- `{"text": str, "image": image or [images]}`: the images, then the text;
- a list of parts, `{"type": "text", "text": str}`, `{"type": "image", "image": image}` and
  `{"type": "image_url", "image_url": {"url": str}}` (or the URL as a string), in order.

These are written as one user message by the folder's chat template (its generation prompt
added), the call's instruction (`prompt`) as the system message; a folder without a chat
template gets Qwen2-VL's own layout. A prompt already written takes its images as they are:

- `{"prompt": str, "image": ...}` or `{"prompt_token_ids": [int], "image": ...}`, each image's
  placeholder a run of `<|image_pad|>` tokens (`image_token_id`) of length 1, which becomes
  the image's count, or of the image's count already.

A retrieval model (ColQwen2, ColPali) writes its inputs in its processor's two layouts instead
(`RetrievalLayout`): an image alone is a page, in the image prompt; a text is a query, between
the query prefix and its augmentation tokens. Text with images is refused, as its processor
refuses it.

In place of any image, its rows as the vision tower gives them may come precomputed, in vLLM's
names: `{"image_embeds": [num_tokens, hidden], "image_grid_thw": [1, rows, columns]}` (the grid
of patches before merging, which the positions need). They are prompt embeddings of the
placeholder span: the result equals the image's, bit for bit, when they are the model's own.

Model-free: numpy, and Jinja's sandbox for templates (a template is data, never code we trust).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from vecpool.errors import ConfigError, InputError
from vecpool.inputs.arrays import OVERFLOW, float_array, peak
from vecpool.inputs.pixels import ImagePixels, ImageSpan

# Qwen2-VL's tokens around an image and its placeholder, as its processor and template write them.
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class RetrievalLayout:
    """How a multi-vector retrieval model's processor writes its inputs (transformers'
    `ColQwen2Processor`, `ColPaliProcessor`): a page image in `image_prompt` (one placeholder
    token), a text query as `query_prefix + text + query_suffix`."""

    image_prompt: str
    query_prefix: str
    query_suffix: str  # the augmentation tokens (ten pad tokens) and a newline
    query_special_tokens: bool  # whether the tokenizer adds its special tokens to a query

    def query(self, text: str) -> str:
        """The text of a query, as the processor writes it."""
        return f"{self.query_prefix}{text}{self.query_suffix}"


@dataclass(frozen=True)
class VisionFormat:
    """How a vision-language model's prompts hold images, read from its folder."""

    image_token_id: int  # the placeholder token (`<|image_pad|>`)
    merge_size: int  # patches per placeholder token: merge_size**2
    chat_template: str | None  # the folder's chat template (Jinja); None: Qwen2-VL's layout
    special_tokens: tuple[tuple[str, str], ...] = ()  # bos_token, eos_token, ... for templates
    # Whether prompts with images carry multimodal rotary positions (Qwen2-VL's `get_rope_index`);
    # False: the positions 0, 1, 2, ... (ColQwen2 as transformers runs it, ColPali).
    mrope: bool = True
    retrieval: RetrievalLayout | None = None  # a retrieval model's layouts (ColQwen2, ColPali)

    def num_tokens(self, grid: tuple[int, int]) -> int:
        """Placeholder tokens of an image of `grid` patches."""
        return grid[0] * grid[1] // self.merge_size**2


def is_vision_language(folder: Path) -> bool:
    """Whether the model in `folder` puts images into prompts: its config.json names an image
    placeholder token (a dual encoder's does not)."""
    config = _json(folder / "config.json")
    return _image_token(_vlm_config(config)) is not None


def _vlm_config(config: dict[str, Any]) -> dict[str, Any]:
    """The vision-language model's config: a retrieval model's `vlm_config`, else the top level."""
    vlm = config.get("vlm_config")
    return vlm if isinstance(vlm, dict) else config


def _image_token(config: dict[str, Any]) -> Any:
    return config.get("image_token_id", config.get("image_token_index"))


def read_vision_format(folder: Path, merge_size: int) -> VisionFormat:
    """The vision format of the model in `folder`: `image_token_id` from config.json (a
    retrieval model's `vlm_config`), the chat template from chat_template.jinja,
    chat_template.json or tokenizer_config.json (in transformers' order), `merge_size` (the
    image processor's), and a retrieval model's layouts (`read_retrieval_layout`)."""
    config = _json(folder / "config.json")
    token = _image_token(_vlm_config(config))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ConfigError(
            f"{folder / 'config.json'}: a vision-language model needs image_token_id (its "
            f"image placeholder token), got {token!r}"
        )
    tokenizer_config = _json(folder / "tokenizer_config.json")
    template: Any = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = _json(folder / "chat_template.json").get("chat_template")
    else:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    special = []
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer_config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special.append((name, value))
    model_type = config.get("model_type")
    return VisionFormat(
        image_token_id=token,
        merge_size=merge_size,
        chat_template=template if isinstance(template, str) and template else None,
        special_tokens=tuple(special),
        mrope=model_type not in _PLAIN_POSITIONS,
        retrieval=read_retrieval_layout(folder, str(model_type), dict(special)),
    )


# Vision-language models whose language model reads plain positions: transformers' ColQwen2
# runs Qwen2-VL's on inputs embeds alone (no M-RoPE); PaliGemma's has no M-RoPE.
_PLAIN_POSITIONS = ("colqwen2", "colpali", "paligemma")
# transformers' defaults of the retrieval processors' settings (processor_config.json).
_COLQWEN2_IMAGE_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>"
    "<|endoftext|>"
)
_QUERY_AUGMENTATION = 10  # pad tokens after a query: the processors' default suffix


def read_retrieval_layout(
    folder: Path, model_type: str, special: dict[str, str]
) -> RetrievalLayout | None:
    """The layouts of a retrieval model's processor, as transformers builds them from the
    folder: `visual_prompt_prefix` and `query_prefix` from processor_config.json (their class
    defaults where absent), the query augmentation token the tokenizer's pad token (ten of
    them), the image and BOS tokens the tokenizer's. None for a model of another type.

    ColQwen2 (`ColQwen2Processor`): a page is its `visual_prompt_prefix` (which holds the image
    placeholder), a query `query_prefix + text + pad * 10 + newline`, tokenized with the
    tokenizer's special tokens. ColPali (`ColPaliProcessor`, which turns the tokenizer's BOS and
    EOS off): a page `image_token + bos + visual_prompt_prefix + newline`, a query
    `bos + query_prefix + text + pad * 10 + newline`."""
    if model_type not in ("colqwen2", "colpali"):
        return None
    source = folder / "processor_config.json"
    settings = _json(source)
    tokenizer_config = _json(folder / "tokenizer_config.json")

    def setting(key: str, default: str) -> str:
        value = settings.get(key)
        if value is None or value == "":  # transformers: `value or default`
            return default
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
        return value

    pad = special.get("pad_token")
    if pad is None:
        raise ConfigError(
            f"{folder / 'tokenizer_config.json'}: {model_type} writes queries with the "
            "tokenizer's pad token (its query augmentation token), and none is named"
        )
    suffix = pad * _QUERY_AUGMENTATION + "\n"
    if model_type == "colqwen2":
        return RetrievalLayout(
            image_prompt=setting("visual_prompt_prefix", _COLQWEN2_IMAGE_PROMPT),
            query_prefix=setting("query_prefix", "Query: "),
            query_suffix=suffix,
            query_special_tokens=True,
        )
    bos = special.get("bos_token")
    if bos is None:
        raise ConfigError(
            f"{folder / 'tokenizer_config.json'}: ColPali writes its prompts with the "
            "tokenizer's BOS token, and none is named"
        )
    image_token = tokenizer_config.get("image_token")
    image_token = image_token if isinstance(image_token, str) else "<image>"
    page = setting("visual_prompt_prefix", "Describe the image.")
    return RetrievalLayout(
        image_prompt=f"{image_token}{bos}{page}\n",
        query_prefix=bos + setting("query_prefix", "Question: "),
        query_suffix=suffix,
        query_special_tokens=False,
    )


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read as JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


# ---- the input forms ------------------------------------------------------------------------


@dataclass
class VisionInput:
    """One input of text with images, as given: exactly one of `parts` (to be written by the
    template), `text` (a prompt already written) and `token_ids`; its images in order."""

    parts: list[tuple[str, Any]] | None  # ("text", str) | ("image", i): the i-th of `images`
    text: str | None
    token_ids: Any
    images: list[Any]  # image values (any form an image takes), or precomputed-rows dicts


def is_vision_dict(item: Mapping[str, Any]) -> bool:
    """Whether a dict input is text (or a prompt) with images: "image" and one of "text",
    "prompt", "prompt_token_ids"."""
    keys = set(item)
    return (
        "image" in keys and len(keys) == 2 and bool(keys & {"text", "prompt", "prompt_token_ids"})
    )


def is_parts(item: Any) -> bool:
    """Whether a list input is a list of parts (dicts with a "type"), not token ids."""
    return bool(item) and isinstance(item[0], Mapping)


def parse_vision_input(item: Any, index: int) -> VisionInput:
    """A vision form (`is_vision_dict`, `is_parts`, or an image value alone) as a
    `VisionInput`; `InputError` naming the input for a malformed one."""
    if isinstance(item, Mapping) and is_vision_dict(item):
        value = item["image"]
        images = list(value) if isinstance(value, list | tuple) else [value]
        if not images:
            raise InputError("'image' is an empty list", index=index, field="image")
        if "text" in item:
            text = item["text"]
            if not isinstance(text, str):
                raise InputError(
                    f"'text' must be a string, got {type(text).__name__}", index=index, field="text"
                )
            parts: list[tuple[str, Any]] = [("image", i) for i in range(len(images))]
            if text:
                parts.append(("text", text))
            return VisionInput(parts, None, None, images)
        if "prompt" in item:
            prompt = item["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise InputError("'prompt' must be a non-empty string", index=index, field="prompt")
            return VisionInput(None, prompt, None, images)
        return VisionInput(None, None, item["prompt_token_ids"], images)
    if isinstance(item, list) and is_parts(item):
        return _parts(item, index)
    return VisionInput([("image", 0)], None, None, [item])  # an image alone


def _parts(items: Sequence[Any], index: int) -> VisionInput:
    parts: list[tuple[str, Any]] = []
    images: list[Any] = []
    for j, part in enumerate(items):
        kind = part.get("type") if isinstance(part, Mapping) else None
        where = f"part {j}"
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InputError(f"{where}: 'text' must be a string", index=index, field="text")
            parts.append(("text", text))
        elif kind in ("image", "image_url", "image_embeds"):
            if kind == "image_embeds":
                value: Any = {k: part.get(k) for k in ("image_embeds", "image_grid_thw")}
            else:
                value = part.get(kind)
                if kind == "image_url" and isinstance(value, Mapping):
                    value = value.get("url")
                if value is None:
                    raise InputError(f"{where}: an {kind} part needs {kind!r}", index=index)
            parts.append(("image", len(images)))
            images.append(value)
        else:
            raise InputError(
                f"{where}: a part must be a dict with type 'text', 'image', 'image_url' or "
                f"'image_embeds', got {kind if kind is not None else type(part).__name__!r}",
                index=index,
            )
    if not images and not any(text for _, text in parts):
        raise InputError("the list of parts holds no image and no text", index=index)
    return VisionInput(parts, None, None, images)


def is_precomputed(value: Any) -> bool:
    """Whether an image value is precomputed rows (`{"image_embeds": ..., ...}`)."""
    return isinstance(value, Mapping) and "image_embeds" in value


def render(fmt: VisionFormat, parts: list[tuple[str, Any]], instruction: str | None) -> str:
    """The text of `parts` as one user message: by the folder's chat template, with its
    generation prompt, or in Qwen2-VL's layout; `instruction` is the system message. A
    retrieval model's page (one image, no text) is its image prompt."""
    retrieval = fmt.retrieval
    if retrieval is not None:
        if len(parts) != 1 or parts[0][0] != "image":
            raise InputError(
                "a retrieval model embeds a page image alone or a text query (its processor "
                "takes one or the other): give the image and the text as inputs of their own"
            )
        return retrieval.image_prompt
    if fmt.chat_template is None:
        content = "".join(IMAGE_TEXT if kind == "image" else value for kind, value in parts)
        system = DEFAULT_SYSTEM if instruction is None else instruction
        return (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    message = [
        {"type": "image"} if kind == "image" else {"type": "text", "text": value}
        for kind, value in parts
    ]
    messages: list[dict[str, Any]] = []
    if instruction is not None:
        messages.append({"role": "system", "content": instruction})
    messages.append({"role": "user", "content": message})
    try:
        return str(
            _compile(fmt.chat_template).render(
                messages=messages, add_generation_prompt=True, **dict(fmt.special_tokens)
            )
        )
    except InputError:
        raise
    except Exception as exc:  # the template's own error (raise_exception, a bad filter)
        raise InputError(f"the chat template failed: {exc}") from None


@cache
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InputError(f"the chat template refused the input: {message}")

    def tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False, **kwargs)

    # The settings transformers renders chat templates with.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


# ---- images into the prompt -----------------------------------------------------------------


@dataclass(frozen=True)
class ImageRows:
    """Precomputed rows of one image, checked: `[num_tokens, hidden]` float32 and its grid."""

    rows: np.ndarray
    grid: tuple[int, int]


def image_rows(
    value: Mapping[str, Any], index: int, fmt: VisionFormat, hidden_size: int, dtype: str
) -> ImageRows:
    """`{"image_embeds": rows, "image_grid_thw": [1, h, w]}` checked: a 2-D float array of
    `hidden_size` columns, finite in the model `dtype`, as many rows as the grid's merged
    patches; `InputError` naming the input and the field otherwise."""
    field = "image_embeds"
    grid_value = value.get("image_grid_thw")
    grid = _grid(grid_value, index, fmt)
    rows = float_array(value.get("image_embeds"), index, field)
    if rows.ndim != 2:
        raise InputError(
            f"expected a 2-D tensor [num_tokens, {hidden_size}], got shape {list(rows.shape)}",
            index=index,
            field=field,
        )
    if rows.shape[1] != hidden_size:
        raise InputError(
            f"rows of width {rows.shape[1]} do not match the model's hidden size {hidden_size}",
            index=index,
            field=field,
        )
    expected = fmt.num_tokens(grid)
    if rows.shape[0] != expected:
        raise InputError(
            f"{rows.shape[0]} rows for an image of {grid[0]}x{grid[1]} patches, which has "
            f"{expected} (its patches / {fmt.merge_size**2})",
            index=index,
            field=field,
        )
    if not np.isfinite(rows).all() or (rows.size and peak(rows, dtype) >= OVERFLOW[dtype]):
        raise InputError("the tensor is not finite in the model dtype", index=index, field=field)
    return ImageRows(np.ascontiguousarray(rows, dtype=np.float32), grid)


def _grid(value: Any, index: int, fmt: VisionFormat) -> tuple[int, int]:
    """(rows, columns) of patches from `image_grid_thw`: [1, rows, columns] or [rows, columns]."""
    array = np.asarray(value) if value is not None else None
    numbers = array.reshape(-1).tolist() if array is not None and array.ndim <= 2 else None
    if numbers is not None and len(numbers) == 3 and numbers[0] == 1:
        numbers = numbers[1:]
    m = fmt.merge_size
    if (
        numbers is None
        or len(numbers) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numbers)
        or numbers[0] % m
        or numbers[1] % m
    ):
        raise InputError(
            f"image_grid_thw must be [1, rows, columns] of patches (multiples of {m}: one "
            f"frame, as an image has), got {value!r}",
            index=index,
            field="image_grid_thw",
        )
    return numbers[0], numbers[1]


def place_images(
    ids: np.ndarray,  # [n] int64, the prompt's tokens
    images: Sequence[ImagePixels | ImageRows],
    fmt: VisionFormat,
    index: int,
) -> tuple[np.ndarray, tuple[ImageSpan, ...]]:
    """The prompt's ids with each image's placeholder run grown to the image's count (a run of
    one token), and the images' spans; `InputError` naming the input where the runs and the
    images do not match (their number, or a run of another length)."""
    is_placeholder = np.concatenate(([False], ids == fmt.image_token_id, [False]))
    edges = np.flatnonzero(np.diff(is_placeholder.astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(images):
        raise InputError(
            f"the prompt has {len(starts)} image placeholder{'s' if len(starts) != 1 else ''} "
            f"(runs of token {fmt.image_token_id}) for {len(images)} image"
            f"{'s' if len(images) != 1 else ''}",
            index=index,
        )
    pieces: list[np.ndarray] = []
    spans: list[ImageSpan] = []
    cursor, offset = 0, 0  # in `ids`; what the runs grown so far add
    for j, (start, end, image) in enumerate(zip(starts, ends, images, strict=True)):
        grid = image.grid
        count = fmt.num_tokens(grid)
        run = int(end - start)
        if run not in (1, count):
            raise InputError(
                f"image {j}'s placeholder is {run} tokens long, but the image has {count} "
                f"({grid[0]}x{grid[1]} patches / {fmt.merge_size**2}); write one placeholder "
                "token, or as many as the image has",
                index=index,
            )
        pieces.append(ids[cursor:start])
        pieces.append(np.full(count, fmt.image_token_id, dtype=np.int64))
        cursor = int(end)
        pixels = image if isinstance(image, ImagePixels) else None
        rows = image.rows if isinstance(image, ImageRows) else None
        spans.append(ImageSpan(int(start) + offset, count, grid, pixels, rows))
        offset += count - run
    pieces.append(ids[cursor:])
    return np.concatenate(pieces).astype(np.int64, copy=False), tuple(spans)


def mrope_positions(num_tokens: int, spans: Sequence[ImageSpan], merge_size: int) -> np.ndarray:
    """`[3, num_tokens]` int64 (temporal, height, width) positions, as transformers'
    Qwen2-VL `get_rope_index` computes them for one sequence: text tokens count on from the
    last position on all three axes; an image's tokens sit at (p, p + row, p + column) over
    its merged grid, p the position after the text before it, and the text after it goes on
    from p + max(rows, columns)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    position, cursor = 0, 0  # the next position; the next token
    for span in spans:
        text = span.start - cursor
        out[:, cursor : span.start] = position + np.arange(text)
        position += text
        rows, cols = span.grid[0] // merge_size, span.grid[1] // merge_size
        out[0, span.start : span.end] = position
        out[1, span.start : span.end] = position + np.repeat(np.arange(rows), cols)
        out[2, span.start : span.end] = position + np.tile(np.arange(cols), rows)
        position += max(rows, cols)
        cursor = span.end
    out[:, cursor:] = position + np.arange(num_tokens - cursor)
    return out
