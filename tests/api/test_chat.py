"""`vecpool.calls.chat` renders a conversation as `transformers`' `apply_chat_template` does, from
the template the folder holds (a `chat_template.jinja` file, or `tokenizer_config.json`'s entry,
a string or named templates)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from vecpool.calls import chat
from vecpool.errors import InputError

# Loop controls, a filter, the special tokens, raise_exception: what real templates use.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if not m['content'] %}{% continue %}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] | trim }}{{ sep_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{{ extra | default('') }}"
)
MESSAGES = [
    {"role": "system", "content": "  Be brief. "},
    {"role": "user", "content": "What do cats eat?"},
    {"role": "assistant", "content": None},
]


def folder_with(tmp_path: Path, default_model_dir: Path, how: str) -> Path:
    folder = tmp_path / how
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if how == "file":
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    elif how == "named":
        config["chat_template"] = [
            {"name": "rag", "template": "{{ 'not this one' }}"},
            {"name": "default", "template": TEMPLATE},
        ]
    else:
        config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how", ["file", "config", "named"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_as_transformers(
    tmp_path: Path, default_model_dir: Path, how: str, add_generation_prompt: bool
) -> None:
    folder = folder_with(tmp_path, default_model_dir, how)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    expected = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt, extra="!"
    )
    got = chat.render_chat(
        str(folder / "tokenizer.json"),
        MESSAGES,
        add_generation_prompt=add_generation_prompt,
        template_kwargs={"extra": "!"},
    )
    assert got == expected and "[SEP]" in got


def test_refusals(tmp_path: Path, default_model_dir: Path) -> None:
    folder = folder_with(tmp_path, default_model_dir, "config")
    tokenizer_file = str(folder / "tokenizer.json")
    with pytest.raises(InputError, match="unknown role tool") as error:
        chat.render_chat(tokenizer_file, [{"role": "tool", "content": "x"}])
    assert error.value.field == "messages"
    for bad in ([], "hello", [{"content": "no role"}], [{"role": "user", "content": 3}]):
        with pytest.raises(InputError) as error:
            chat.render_chat(tokenizer_file, bad)
        assert error.value.field == "messages"
    with pytest.raises(InputError, match="text parts"):
        chat.render_chat(tokenizer_file, [{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InputError, match="default chat template is no longer allowed"):
        chat.render_chat(str(default_model_dir / "tokenizer.json"), MESSAGES)
