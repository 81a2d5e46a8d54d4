"""The input stage checks and converts a call's inputs together: the prompts are what the
tokenizer library (texts) or the inputs themselves (token ids) say, whatever the options, and
when several inputs are bad, the error names the same one as a check of each in turn would."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.helpers import batch_sizes_of
from vecpool.errors import InputError
from vecpool.inputs.prompts import InputLimits, InputProcessor, TextOptions, TextTokenizer
from vecpool.inputs.wordpiece import ArrayWordPiece

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "Ünïcödé: naïve café, 東京, emoji 🙂 and a tab\there",
    "short",
    " ".join(["word"] * 40) + " end",
    ("what is a fox?", "A fox is a small omnivorous mammal of the dog family."),
    "\n",  # whitespace only: the special tokens alone
]


def limits(max_model_len: int = 64, **overrides: Any) -> InputLimits:
    values: dict[str, Any] = dict(
        vocab_size=30522,
        hidden_size=8,
        max_model_len=max_model_len,
        dtype="float32",
        enable_prompt_embeds=True,
    )
    return InputLimits(**{**values, **overrides})


def bpe_tokenizer_file(tmp_path: Path) -> Path:
    """A small byte-level BPE tokenizer with a RoBERTa-style template: another model, other
    pre-tokenizer and offsets than BERT's WordPiece."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [t if isinstance(t, str) else " ".join(t) for t in TEXTS] * 4
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B:1 </s>:1",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))],
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(params=["wordpiece", "bpe"])
def tokenizer_file(request: pytest.FixtureRequest, default_model_dir: Path, tmp_path: Path) -> Path:
    if request.param == "wordpiece":
        return default_model_dir / "tokenizer.json"
    return bpe_tokenizer_file(tmp_path)


@pytest.mark.parametrize(
    "options",
    [
        TextOptions(),
        TextOptions(truncate_prompt_tokens=-1),
        TextOptions(truncate_prompt_tokens=9, truncation_side="left"),
        TextOptions(truncate_prompt_tokens=9, truncation_side="right"),
        TextOptions(prompt="query: "),
        TextOptions(add_special_tokens=False),
    ],
    ids=["plain", "limit", "left9", "right9", "prompt", "no-specials"],
)
def test_text_prompts_are_the_tokenizers_ids(tokenizer_file: Path, options: TextOptions) -> None:
    processor = InputProcessor(limits(), TextTokenizer(tokenizer_file))
    inputs: list[Any] = [
        t if isinstance(t, str) else {"text": t[0], "text_pair": t[1]} for t in TEXTS
    ]
    if not options.add_special_tokens:
        inputs.pop()  # a text of no tokens of its own is an empty input then
    prompts = processor.process(inputs, options)
    # The reference: the library's own tokenizer, truncating as asked.
    reference = Tokenizer.from_file(str(tokenizer_file))
    reference.no_padding()
    limit = {None: None, -1: 64}.get(options.truncate_prompt_tokens, 9)
    if limit is not None:
        reference.enable_truncation(limit, direction=options.truncation_side)
    texts = [
        t if isinstance(t, tuple) or options.prompt is None else options.prompt + t
        for t in TEXTS[: len(inputs)]
    ]
    expected = reference.encode_batch(texts, add_special_tokens=options.add_special_tokens)
    assert len(prompts) == len(expected)
    for text, prompt, enc in zip(texts, prompts, expected, strict=True):
        assert prompt.token_ids is not None and prompt.token_ids.dtype == np.int64
        assert prompt.token_ids.tolist() == enc.ids
        assert prompt.prompt_embeds is None and prompt.num_attended is None
        if isinstance(text, tuple):
            assert prompt.token_type_ids is not None and prompt.token_type_ids.dtype == np.int64
            assert prompt.token_type_ids.tolist() == enc.type_ids
            assert 0 in enc.type_ids and 1 in enc.type_ids  # the pair's two segments
        else:
            assert prompt.token_type_ids is None  # all segment 0, filled in by the batch


@pytest.mark.parametrize("side", ["left", "right"])
def test_id_prompts_are_the_ids_given(side: str) -> None:
    processor = InputProcessor(limits(max_model_len=16), None)
    rng = np.random.default_rng(0)
    lists = [rng.integers(0, 30522, size=n).tolist() for n in (1, 5, 16, 30)]
    inputs: list[Any] = [
        *lists,
        np.array([7, 8, 9], dtype=np.int32),
        torch.tensor([3, 4]),
        (11, 12, 13),
        {"prompt_token_ids": [1, 2]},
    ]
    given = [*lists, [7, 8, 9], [3, 4], [11, 12, 13], [1, 2]]
    prompts = processor.process(
        inputs, TextOptions(truncate_prompt_tokens=12, truncation_side=side)
    )
    for ids, prompt in zip(given, prompts, strict=True):
        kept = ids[-12:] if side == "left" else ids[:12]
        assert prompt.token_ids is not None and prompt.token_ids.dtype == np.int64
        assert prompt.token_ids.tolist() == kept
        assert prompt.prompt_embeds is None and prompt.token_type_ids is None


def _error(processor: InputProcessor, inputs: list[Any], options: TextOptions) -> InputError:
    with pytest.raises(InputError) as info:
        processor.process(inputs, options)
    return info.value


EMBEDS = torch.zeros(3, 8)
TOO_LONG = list(range(100, 120))  # 20 ids, over the limit of 16


@pytest.mark.parametrize(
    ("inputs", "index", "message"),
    [
        # Ids and embeds, each checked in turn: the first bad one in input order.
        ([[1, 2], [], [5, 40000], TOO_LONG], 1, "the input is empty"),
        ([[1, 2], [5, 40000], [], TOO_LONG], 1, "token id 40000 at position 1"),
        ([[1], TOO_LONG, [-3]], 1, "20 tokens, more than the model's maximum"),
        ([[1], [-3], TOO_LONG], 1, "token id -3 at position 0"),
        ([[1], [1.5], [-3]], 1, "token ids must be a flat list of ints"),
        ([[1], {"prompt_embeds": torch.zeros(3, 5)}, [-3]], 1, "hidden size 5"),
        ([[1], [-3], {"prompt_embeds": torch.zeros(3, 5)}], 1, "token id -3"),
        ([EMBEDS, [1, 2], {"prompt_embeds": torch.zeros(0, 8)}, [-1]], 2, "the input is empty"),
        # Texts are checked (and tokenized) together, before the other inputs.
        ([[-3], "fine", ""], 2, "the input is an empty string"),
        ([[1], "a " * 30, [-3]], 1, "more than the model's maximum"),
        (["ok", "a " * 30, "", "b " * 30], 2, "the input is an empty string"),
        (["ok", "a " * 30, "fine", "b " * 30], 1, "more than the model's maximum"),
    ],
)
def test_the_first_bad_input_is_named(
    default_model_dir: Path, inputs: list[Any], index: int, message: str
) -> None:
    processor = InputProcessor(limits(16), TextTokenizer(default_model_dir / "tokenizer.json"))
    wrapped = [{"prompt_embeds": x} if isinstance(x, torch.Tensor) else x for x in inputs]
    error = _error(processor, wrapped, TextOptions())
    assert error.index == index
    assert message in str(error)


def test_the_first_text_over_the_character_limit_is_named(default_model_dir: Path) -> None:
    tokenizer = TextTokenizer(default_model_dir / "tokenizer.json")
    processor = InputProcessor(limits(512, max_input_chars=10), tokenizer)
    singles = ["short", "0123456789", "01234567890", "x", "far too long here"]
    error = _error(processor, singles, TextOptions())
    assert error.index == 2 and "11 characters, more than the limit of 10" in str(error)
    # With the instruction prompt in front, the second text is over the limit too.
    error = _error(processor, singles, TextOptions(prompt="q: "))
    assert error.index == 1 and "13 characters" in str(error)
    # A pair counts both of its texts.
    pairs = ["short", {"text": "abcdef", "text_pair": "ghijk"}, "01234567890"]
    error = _error(processor, pairs, TextOptions())
    assert error.index == 1 and "11 characters" in str(error)
    assert processor.process(singles[:2], TextOptions())[1].num_tokens > 0  # at the limit: fine


@pytest.mark.parametrize("limit, side", [(-1, "right"), (20, "left")])
def test_a_large_batch_of_text_pairs_is_the_tokenizers_ids_and_segments(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch, limit: int, side: str
) -> None:
    """A rerank-sized batch of pairs goes through `ArrayWordPiece` (one that it declines, to
    the library) and gives the library's ids and segment ids."""
    tokenizer_file = default_model_dir / "tokenizer.json"
    calls = batch_sizes_of(monkeypatch, ArrayWordPiece, "encode_pairs")
    processor = InputProcessor(limits(), TextTokenizer(tokenizer_file))
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog, café naïve 東京 🙂 unquestionably".split()
    pairs = [
        tuple(" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in "ab")
        for _ in range(40)
    ]
    pairs[5] = ("a\x0bcontrol character", "left to the library")
    options = TextOptions(truncate_prompt_tokens=limit, truncation_side=side)  # type: ignore[arg-type]
    prompts = processor.process([{"text": a, "text_pair": b} for a, b in pairs], options)
    assert calls == [len(pairs)]
    reference = Tokenizer.from_file(str(tokenizer_file))
    reference.no_padding()
    reference.enable_truncation(64 if limit == -1 else limit, direction=side)
    for prompt, expected in zip(prompts, reference.encode_batch(pairs), strict=True):
        assert prompt.token_ids.tolist() == expected.ids
        assert prompt.token_type_ids is not None
        assert prompt.token_type_ids.tolist() == expected.type_ids
