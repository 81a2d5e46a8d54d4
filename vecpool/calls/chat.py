"""Chat-format inputs (vLLM's `messages`): a conversation rendered to one text by the chat
template of the model folder, as `transformers`' `apply_chat_template` renders it.

The template is the engine's `chat_template` option when given (vLLM's `--chat-template`:
for a folder without one, or to replace it), else the folder's own: `chat_template.jinja`,
else the `chat_template` entry of `tokenizer_config.json` (a string, or named templates of
which "default" is taken). It runs in Jinja's sandbox (a template is data, never code we
trust), with the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. A
folder without one, and no option, is refused with vLLM's words: no default template is made
up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from vecpool.errors import ConfigError, InputError

# vLLM's (and transformers') refusal for a tokenizer without a chat template.
NO_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must "
    "provide a chat template if the tokenizer does not define one."
)
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class ChatTemplate:
    """A folder's chat template and the special tokens it may name."""

    source: str  # the Jinja text
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the tokenizer writes them

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The text of `messages` (a list of `{"role", "content"}`, content a string or a list
        of `{"type": "text", "text"}` parts, joined by new lines as vLLM joins them)."""
        variables = {
            **self.special_tokens,
            **(template_kwargs or {}),
            "messages": _plain_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return str(_compile(self.source).render(**variables))
        except InputError:
            raise
        except Exception as exc:  # the template's own error (raise_exception, a bad filter)
            raise InputError(f"the chat template failed: {exc}", field="messages") from None


def load_chat_template(
    tokenizer_file: str | None, chat_template: str | None = None
) -> ChatTemplate | None:
    """The chat template of the folder holding `tokenizer_file` (`chat_template`, the Jinja
    text, in place of the folder's own when given), or None."""
    if tokenizer_file is None:
        return None if chat_template is None else ChatTemplate(chat_template, {})
    folder = str(Path(tokenizer_file).parent)
    if chat_template is not None:
        return ChatTemplate(chat_template, _special_tokens(folder))
    return _load(folder)


def read_chat_template(value: str) -> str:
    """The Jinja text the `chat_template` option names, as vLLM reads `--chat-template`: the
    file at that path, else the text itself when it holds Jinja's characters (`{`, `}` or a
    new line), its backslash escapes (`\\n`, `\\t`, ...) read as such; anything else is a
    path that could not be read (`ConfigError` naming it)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"chat_template {value!r} is not a UTF-8 text file") from None
    except (OSError, ValueError) as exc:  # no such file (ValueError: a NUL in the text)
        if not any(c in value for c in "{}\n"):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(
                f"chat_template {value!r} looks like a file path, but it could not be read: "
                f"{reason}"
            ) from None
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m[1], m[0]), value)


def check_chat_template(source: str) -> str:
    """`source` if Jinja can compile it, else a `ConfigError` saying where it is wrong (a
    template given to the engine is checked when it starts, not at its first call)."""
    from jinja2 import TemplateSyntaxError

    try:
        _compile(source)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template: line {exc.lineno}: {exc.message}") from None
    return source


# The escapes a template given as text may use (vLLM decodes it with Python's escapes; these
# are the ones a template needs, without reading other characters as Latin-1 as that does).
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def render_chat(
    tokenizer_file: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> str:
    """`messages` as one text by the folder's chat template (`chat_template`, the engine's
    option, in its place when given); `InputError` naming `messages` for a folder without one
    (vLLM's words) or a conversation that is not one."""
    if continue_final_message:
        raise InputError(
            "continue_final_message: a pooling model reads the whole conversation; it "
            "continues no message",
            field="continue_final_message",
        )
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise InputError("must be an object", field="chat_template_kwargs")
    template = load_chat_template(tokenizer_file, chat_template)
    if template is None:
        raise InputError(NO_TEMPLATE, field="messages")
    return template.render(
        messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
    )


def render_chat_with_images(
    tokenizer_file: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> tuple[str, list[Any]]:
    """`messages` of a vision-language model as one text and its images, in order: content
    parts stay parts for the template (`{"type": "text", "text"}`, and an image part as
    `{"type": "image"}`, where Qwen2-VL's template writes the image's placeholder), each
    image part's value (`image_url`'s URL, `image`'s value, or `image_embeds`' precomputed
    rows) listed. Otherwise as `render_chat`."""
    if continue_final_message:
        render_chat(tokenizer_file, messages, continue_final_message=True)  # its refusal
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise InputError("must be an object", field="chat_template_kwargs")
    template = load_chat_template(tokenizer_file, chat_template)
    if template is None:
        raise InputError(NO_TEMPLATE, field="messages")
    images: list[Any] = []
    plain = _plain_messages(messages, images)
    variables = {
        **template.special_tokens,
        **(template_kwargs or {}),
        "messages": plain,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        text = str(_compile(template.source).render(**variables))
    except InputError:
        raise
    except Exception as exc:  # the template's own error (raise_exception, a bad filter)
        raise InputError(f"the chat template failed: {exc}", field="messages") from None
    return text, images


# The image parts of a vision-language model's messages: vLLM's and ours.
_IMAGE_PARTS = ("image_url", "image", "image_embeds")


def _image_part(part: Mapping[str, Any], i: int, j: int) -> Any:
    """The value of image part `j` of message `i`: an image source, or precomputed rows."""
    kind = part["type"]
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InputError(
            f"content part {j}: an {kind} part needs {kind!r}", index=i, field="messages"
        )
    return value


def _plain_messages(messages: Any, images: list[Any] | None = None) -> list[dict[str, Any]]:
    """The messages as a template reads them: text parts joined by new lines (as vLLM joins
    them); with `images` (a vision-language model's), parts kept, an image part written as
    `{"type": "image"}` and its value added to `images`."""
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise InputError("messages must be a non-empty list of messages", field="messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InputError(
                'a message must be an object with a string "role"', index=i, field="messages"
            )
        content = message.get("content")
        if isinstance(content, list) and images is not None:
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in _IMAGE_PARTS:
                    images.append(_image_part(part, i, j))
                    parts.append({"type": "image"})
                else:
                    raise InputError(
                        f"content part {j}: a part is {{'type': 'text', 'text': str}} or an "
                        f"image ({', '.join(_IMAGE_PARTS)}), got {kind!r}",
                        index=i,
                        field="messages",
                    )
            plain.append({**message, "content": parts})
            continue
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    raise InputError(
                        'content parts must be text parts ({"type": "text", "text": ...}): '
                        "this server reads text only",
                        index=i,
                        field="messages",
                    )
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        elif content is None:  # no content is empty text, as transformers and vLLM read it
            content = ""
        elif not isinstance(content, str):
            raise InputError(
                "content must be a string or a list of text parts", index=i, field="messages"
            )
        plain.append({**message, "content": content})
    return plain


@cache
def _load(folder: str) -> ChatTemplate | None:
    path = Path(folder)
    jinja_file = path / "chat_template.jinja"
    source: Any = (
        jinja_file.read_text(encoding="utf-8")
        if jinja_file.is_file()
        else _tokenizer_config(folder).get("chat_template")
    )
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, _special_tokens(folder))


@cache
def _special_tokens(folder: str) -> dict[str, str]:
    """bos_token, eos_token, ... as the folder's tokenizer_config.json writes them."""
    config = _tokenizer_config(folder)
    special = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    return special


def _tokenizer_config(folder: str) -> dict[str, Any]:
    config_file = Path(folder) / "tokenizer_config.json"
    if not config_file.is_file():
        return {}
    config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    return config


@cache
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InputError(f"the chat template refused the conversation: {message}", field="messages")

    def tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False, **kwargs)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # The settings transformers renders chat templates with.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
