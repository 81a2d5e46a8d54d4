"""Chat-format inputs (vLLM's `messages`): a conversation rendered to one text by the chat
template of the model folder, as `transformers`' `apply_chat_template` renders it.

The template is the folder's own: `chat_template.jinja`, else the `chat_template` entry of
`tokenizer_config.json` (a string, or named templates of which "default" is taken). It runs
in Jinja's sandbox (the template is data of the folder, never code we trust), with the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. A folder without one
is refused with vLLM's words: no default template is made up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from vecpool.errors import InputError

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


def load_chat_template(tokenizer_file: str | None) -> ChatTemplate | None:
    """The chat template of the folder holding `tokenizer_file`, or None."""
    if tokenizer_file is None:
        return None
    return _load(str(Path(tokenizer_file).parent))


def render_chat(
    tokenizer_file: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """`messages` as one text by the folder's chat template; `InputError` naming `messages`
    for a folder without one (vLLM's words) or a conversation that is not one."""
    if continue_final_message:
        raise InputError(
            "continue_final_message: a pooling model reads the whole conversation; it "
            "continues no message",
            field="continue_final_message",
        )
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise InputError("must be an object", field="chat_template_kwargs")
    template = load_chat_template(tokenizer_file)
    if template is None:
        raise InputError(NO_TEMPLATE, field="messages")
    return template.render(
        messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
    )


def _plain_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise InputError("messages must be a non-empty list of messages", field="messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InputError(
                'a message must be an object with a string "role"', index=i, field="messages"
            )
        content = message.get("content")
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
    config: dict[str, Any] = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
    jinja_file = path / "chat_template.jinja"
    source: Any = (
        jinja_file.read_text(encoding="utf-8")
        if jinja_file.is_file()
        else config.get("chat_template")
    )
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    special = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    return ChatTemplate(source, special)


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
