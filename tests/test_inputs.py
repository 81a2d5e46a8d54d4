"""Bad inputs give clear errors naming the input; the engine stays usable afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from tests.helpers import random_prompts


@pytest.fixture
def engine(tiny_bert_engine: vecpool.Engine) -> vecpool.Engine:
    yield tiny_bert_engine
    # Whatever the test did, the same engine still serves a good call.
    out = tiny_bert_engine.embed(random_prompts(99, [4, 8]))
    assert out.shape == (2, 32) and np.isfinite(out).all()


GOOD = [5, 6, 7]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"prompt_embeds": torch.zeros(4, 16)},
            r"input 1 \(prompt_embeds\): hidden size 16 does not match the model's 32",
        ),
        (
            {"prompt_embeds": torch.zeros(32)},
            r"input 1 \(prompt_embeds\): expected a 2-D tensor \[num_tokens, 32\], got shape \[32\]",
        ),
        (
            {"prompt_embeds": torch.zeros(1, 4, 32)},
            r"input 1 \(prompt_embeds\): expected a 2-D tensor .* got shape \[1, 4, 32\]",
        ),
        (
            {"prompt_embeds": torch.full((3, 32), float("nan"))},
            r"input 1 \(prompt_embeds\): the tensor contains NaN or inf",
        ),
        (
            {"prompt_embeds": torch.tensor([[float("inf")] * 32])},
            r"input 1 \(prompt_embeds\): the tensor contains NaN or inf",
        ),
        ({"prompt_embeds": torch.zeros(0, 32)}, r"input 1: the input is empty"),
        (
            {"prompt_embeds": torch.zeros(3, 32, dtype=torch.int64)},
            r"input 1 \(prompt_embeds\): expected a floating-point tensor",
        ),
        (
            {"prompt_embeds": [[0.0] * 32]},
            r"input 1 \(prompt_embeds\): expected a torch.Tensor or numpy array, got list",
        ),
        ([], r"input 1: the input is empty"),
        (
            [5, 99],
            r"input 1 \(prompt_token_ids\): token id 99 at position 1 is outside the vocabulary \[0, 99\)",
        ),
        ([-1], r"input 1 \(prompt_token_ids\): token id -1 at position 0"),
        ([1.5, 2], r"input 1 \(prompt_token_ids\): token ids must be a flat list of ints"),
        ([True, False], r"input 1 \(prompt_token_ids\): token ids must be a flat list of ints"),
        # Bytes are an encoded image, which a model without an image tower refuses.
        (bytearray(b"abc"), r"input 1: an image, but this model has no image tower"),
        (
            [[5, 6]],
            r"input 1 \(prompt_token_ids\): .* flat list of ints, got a nested list \(shape \[1, 2\]\)",
        ),
        (
            list(range(3, 3 + 65)),
            r"input 1: the input has 65 tokens, more than the model's maximum context length of 64 tokens; pass truncate_prompt_tokens",
        ),
        (
            {"prompt": "a", "prompt_embeds": None},
            r"input 1: a dict input needs exactly one of the keys",
        ),
        ({"text": "a"}, r"input 1: a dict input needs exactly one of the keys"),
        (3.5, r"input 1: unsupported input type float"),
        (torch.zeros(4, 32), r"input 1: a bare tensor is ambiguous"),
    ],
)
def test_bad_input_names_its_index(engine: vecpool.Engine, bad, message: str) -> None:
    with pytest.raises(vecpool.InputError, match=message) as info:
        engine.embed([GOOD, bad, GOOD])
    assert isinstance(info.value, ValueError)
    assert info.value.index == 1


def test_text_without_tokenizer_is_a_clear_error(engine: vecpool.Engine) -> None:
    with pytest.raises(vecpool.InputError, match="input 0: text input needs a tokenizer"):
        engine.embed(["hello", GOOD])


def test_half_precision_overflow_is_caught(tmp_path, tiny_bert) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu", dtype="float16")
    with pytest.raises(vecpool.InputError, match="not finite in the model dtype"):
        engine.embed([{"prompt_embeds": torch.full((2, 32), 1e6)}])


def test_prompt_embeds_can_be_switched_off(tiny_bert) -> None:
    engine = vecpool.Engine(tiny_bert[0], device="cpu", enable_prompt_embeds=False)
    with pytest.raises(vecpool.InputError, match=r"input 0 .*prompt embeds are disabled"):
        engine.embed([{"prompt_embeds": torch.zeros(2, 32)}])


def test_prompt_embeds_accept_any_float_dtype(engine: vecpool.Engine) -> None:
    ids = random_prompts(99, [6], seed=9)[0]
    lookup = engine.embed_tokens(ids)
    ref = engine.embed([ids])
    # Bit for bit: float64 holds the float32 lookup exactly, and the lookup fills the rows the
    # ids would, so each call is the same computation as `ref`.
    for cast in (torch.float64, torch.float32):
        out = engine.embed([{"prompt_embeds": lookup.to(cast)}])
        assert np.array_equal(out, ref)
    from_numpy = engine.embed([{"prompt_embeds": lookup.double().numpy()}])
    assert np.array_equal(from_numpy, ref)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_of_ids_and_embeds(engine: vecpool.Engine, side: str) -> None:
    ids = random_prompts(99, [40], seed=10)[0]
    kept = ids[:16] if side == "right" else ids[-16:]
    expected = engine.embed([kept])
    got_ids = engine.embed([ids], truncate_prompt_tokens=16, truncation_side=side)
    got_embeds = engine.embed(
        [{"prompt_embeds": engine.embed_tokens(ids)}],
        truncate_prompt_tokens=16,
        truncation_side=side,
    )
    # The kept tokens (as ids, or as their lookup) alone in a batch: the computation of
    # `expected`, bit for bit.
    assert np.array_equal(got_ids, expected)
    assert np.array_equal(got_embeds, expected)


def test_truncation_above_the_limit_is_an_error(
    engine: vecpool.Engine, minilm: vecpool.Engine
) -> None:
    limit = engine.max_model_len
    assert limit == 64
    ids = random_prompts(99, [limit + 10], seed=11)[0]
    with pytest.raises(
        vecpool.InputError,
        match=r"^truncate_prompt_tokens: truncate_prompt_tokens=65 is more than the model's "
        r"limit of 64 tokens; pass -1",
    ):
        engine.embed([ids], truncate_prompt_tokens=limit + 1)
    with pytest.raises(vecpool.InputError, match=r"=257 is more than the model's limit of 256"):
        minilm.embed(["a short text"], truncate_prompt_tokens=257)
    with pytest.raises(vecpool.InputError, match=r"=65 is more than the model's limit of 64"):
        engine.embed([], truncate_prompt_tokens=limit + 1)  # a call's option, inputs or not
    # -1 and the limit itself both keep the first 64 tokens: the computation of `expected`.
    expected = engine.embed([ids[:limit]])
    for t in (-1, limit):
        assert np.array_equal(engine.embed([ids], truncate_prompt_tokens=t), expected)


def test_empty_text_is_an_error(minilm: vecpool.Engine) -> None:
    with pytest.raises(vecpool.InputError, match="input 1: the input is an empty string"):
        minilm.embed(["fine", "", "fine"])


def test_text_truncation_keeps_special_tokens(minilm: vecpool.Engine) -> None:
    text = "one two three four five six seven eight"
    full = minilm.tokenize(text)
    assert full[0] == 101 and full[-1] == 102  # [CLS] ... [SEP]
    right = minilm.embed([text], truncate_prompt_tokens=5)
    left = minilm.embed([text], truncate_prompt_tokens=5, truncation_side="left")
    # The same tokens alone in a batch: the same computation, bit for bit.
    assert np.array_equal(right, minilm.embed([[101, *full[1:4], 102]]))
    assert np.array_equal(left, minilm.embed([[101, *full[-4:-1], 102]]))
    with pytest.raises(vecpool.InputError, match="input 0: truncation to 2 tokens leaves no room"):
        minilm.embed([text], truncate_prompt_tokens=2)


def test_parameters_are_checked_against_the_task(engine: vecpool.Engine) -> None:
    with pytest.raises(
        vecpool.InputError,
        match=r"^step_tag_id: task 'embed' does not accept parameter 'step_tag_id'",
    ):
        engine.encode([GOOD], task="embed", step_tag_id=5)
    with pytest.raises(
        vecpool.InputError, match=r"task: unknown task 'frobnicate'; known tasks: .*embed"
    ):
        engine.encode([GOOD], task="frobnicate")
    with pytest.raises(
        vecpool.InputError,
        match=r"^dimensions: dimensions=33 must be between 1 and the model's output size 32",
    ):
        engine.embed([GOOD], dimensions=33)
    with pytest.raises(
        vecpool.InputError, match=r"truncate_prompt_tokens must be -1 or a positive count"
    ):
        engine.embed([GOOD], truncate_prompt_tokens=0)


def test_prompt_embeds_of_any_byte_order(engine: vecpool.Engine) -> None:
    embeds = np.random.default_rng(3).standard_normal((4, 32)).astype(np.float32)
    native = engine.embed([{"prompt_embeds": embeds}])
    swapped = embeds.astype(embeds.dtype.newbyteorder("S"))  # the same values, bytes swapped
    assert np.array_equal(engine.embed([{"prompt_embeds": swapped}]), native)
    wide = {"prompt_embeds": embeds.astype(np.longdouble)}  # a width torch has no type of
    if np.dtype(np.longdouble) != np.dtype(np.float64):  # (where it is not float64)
        with pytest.raises(vecpool.InputError, match=r"^input 1 \(prompt_embeds\): expected a fl"):
            engine.embed([GOOD, wide])
    assert engine.embed([GOOD]).shape == (1, 32)  # the engine goes on


def test_single_inputs_and_empty_calls(engine: vecpool.Engine) -> None:
    assert engine.embed(GOOD).shape == (1, 32)
    assert engine.embed({"prompt_token_ids": GOOD}).shape == (1, 32)
    assert engine.embed(np.asarray(GOOD)).shape == (1, 32)
    assert engine.embed([]).shape == (0, 32)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([[1, 2], [3]], r"input 1 \(prompt_token_ids\): token ids must be a flat list of ints"),
        ([1, [2]], r"input 1 \(prompt_token_ids\): token ids must be a flat list of ints"),
        (
            [2**70],
            r"input 1 \(prompt_token_ids\): token id 1180591620717411303424 at position 0 is "
            r"outside the vocabulary",
        ),
        (
            [3, 2**63],  # numpy reads it as floats
            r"input 1 \(prompt_token_ids\): token id 9223372036854775808 at position 1 is "
            r"outside the vocabulary",
        ),
        (
            {"prompt_embeds": torch.zeros(2, 32, device="meta")},
            r"input 1 \(prompt_embeds\): the tensor cannot be read",
        ),
        (
            torch.zeros(3, dtype=torch.int64, device="meta"),
            r"input 1 \(prompt_token_ids\): the tensor cannot be read",
        ),
        # Cast to int64 it would wrap to a negative id: named as given.
        (
            np.array([3, 2**63 + 5], dtype=np.uint64),
            r"input 1 \(prompt_token_ids\): token id 9223372036854775813 at position 1 is "
            r"outside the vocabulary",
        ),
    ],
)
def test_odd_inputs_are_input_errors(engine: vecpool.Engine, bad, message: str) -> None:
    with pytest.raises(vecpool.InputError, match=message):
        engine.embed([GOOD, bad])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dimensions": "3"}, r"^dimensions: must be an integer, got '3'"),
        ({"dimensions": True}, r"^dimensions: must be an integer, got True"),
        ({"normalize": "yes"}, r"^normalize: must be true or false, got 'yes'"),
        ({"truncate_prompt_tokens": 2.5}, r"^truncate_prompt_tokens: must be an integer"),
        ({"truncation_side": "middle"}, r"^truncation_side: must be 'left' or 'right'"),
        ({"prompt": 5}, r"^prompt: must be a string, got int"),
        ({"prompt_name": ["q"]}, r"^prompt_name: must be a string, got list"),
    ],
)
def test_option_types_are_checked(engine: vecpool.Engine, options, message: str) -> None:
    with pytest.raises(vecpool.InputError, match=message):
        engine.embed([GOOD], **options)


def test_tokenize_names_what_it_was_given(minilm: vecpool.Engine) -> None:
    for value, got in ((None, "NoneType"), (5, "int"), (["a"], "list")):
        with pytest.raises(vecpool.InputError, match=rf"^prompt: must be a string, got {got}$"):
            minilm.tokenize(value)  # type: ignore[arg-type]
    with pytest.raises(vecpool.InputError, match=r"^prompt: the input is an empty string$"):
        minilm.tokenize("")
    with pytest.raises(vecpool.InputError, match=r"^prompt_token_ids: the tensor cannot be read"):
        minilm.embed_tokens(torch.zeros(2, dtype=torch.int64, device="meta"))
    # A lookup of any length (the limit, 256, applies where the embeddings are used); the
    # call's own prompt is named when it is not valid Unicode, not the first input.
    ids = list(range(1000, 1300))
    whole = minilm.embed_tokens(ids)
    assert whole.shape == (300, 384)
    halves = [minilm.embed_tokens(ids[:150]), minilm.embed_tokens(ids[150:])]
    assert torch.equal(whole, torch.cat(halves))
    with pytest.raises(vecpool.InputError, match=r"^prompt: the text is not valid Unicode"):
        minilm.embed(["a", "b"], prompt="\udc00: ")


def test_rerank_top_n_must_be_an_integer(minilm: vecpool.Engine) -> None:
    for top_n in ("2", 1.5, -1, True):
        with pytest.raises(
            vecpool.InputError, match=r"^top_n: top_n must be a non-negative integer"
        ):
            minilm.rerank("q", ["a", "b"], top_n=top_n)
    assert [i for i, _ in minilm.rerank("cats", ["a dog", "a cat"], top_n=1)] == [1]


def test_lone_surrogate_is_an_input_error(minilm: vecpool.Engine) -> None:
    # The tokenizer takes UTF-8, which a lone surrogate cannot be written as.
    with pytest.raises(vecpool.InputError, match=r"input 1: the text is not valid Unicode"):
        minilm.embed(["fine", "abc\ud800", "also fine"])
    with pytest.raises(vecpool.InputError, match="not valid Unicode"):
        minilm.tokenize("abc\udfff")
    assert minilm.embed(["fine"]).shape == (1, 384)


def test_text_over_the_character_limit_is_refused_before_tokenizing(
    default_model_dir: Path,
) -> None:
    engine = vecpool.Engine(default_model_dir, device="cpu", max_input_chars=1000)
    assert engine.inputs.limits.max_input_chars == 1000
    engine.embed(["x" * 1000])  # at the limit: served
    with pytest.raises(vecpool.InputError, match=r"input 1: the text has 1001 characters"):
        engine.embed(["ok", "x" * 1001], truncate_prompt_tokens=-1)
    with pytest.raises(vecpool.InputError, match="1001 characters"):
        engine.tokenize("x" * 1001)
    # The default: 100 characters per token of the model's length, at least 100,000.
    assert vecpool.EngineArgs().input_char_limit(256) == 100_000
    assert vecpool.EngineArgs().input_char_limit(32768) == 3_276_800


@pytest.mark.parametrize("tag", [-1, 2**63])
def test_step_tag_id_must_be_a_token_id(engine: vecpool.Engine, tag: int) -> None:
    # -1 once meant "every token" inside the engine: it must not be reachable from outside.
    with pytest.raises(vecpool.InputError, match=r"step_tag_id.*must be a token id"):
        engine.encode([GOOD], task="token_embed", step_tag_id=tag)


def test_non_finite_output_fails_its_request_alone(engine: vecpool.Engine) -> None:
    # Finite but huge prompt embeds overflow float32 inside the model (LayerNorm's variance).
    huge = {"prompt_embeds": torch.full((3, 32), 1e30)}
    outs = engine.pool([GOOD, huge, [8, 9]], vecpool.PoolingParams())
    assert outs[0].error is None and outs[2].error is None
    assert isinstance(outs[1].error, vecpool.RequestFailedError)
    assert "not finite" in str(outs[1].error) and outs[1].data is None
    assert np.isfinite(outs[0].data).all() and np.isfinite(outs[2].data).all()


ID_LISTS = [
    [101, 2023, 102],
    [0],
    [np.int32(7), np.int64(8), 9],  # numpy integers among Python ints
    [5, True, 6],  # a bool after an int: packed and converted as id 1, refused
    [1, 0, np.False_],  # a numpy bool among 0s and 1s
    [True, False],  # bools only: refused either way
    [1, 2.5],
    [1, "2"],
    [1, None],
    [1, [2]],
    [2**63],  # past int64
    [-(2**63)],  # int64's least: packed, then outside the vocabulary
    [2**64 + 1],
]


@pytest.mark.parametrize("value", ID_LISTS, ids=range(len(ID_LISTS)))
def test_packed_id_lists_equal_numpys_conversion(
    value: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list packed into its array (`arrays.PACK_ID_LISTS`) gives numpy's conversion, or the
    same refusal."""
    from vecpool.inputs import arrays

    outcomes = []
    for packed in (True, False):
        monkeypatch.setattr(arrays, "PACK_ID_LISTS", packed)
        try:
            ids = arrays.as_id_array(value, 3)
            outcomes.append((ids.dtype, ids.tolist()))
        except vecpool.InputError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
    if isinstance(outcomes[0], tuple):
        assert outcomes[0] == (np.dtype(np.int64), [int(v) for v in value])


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(
    ("value", "pos"),
    [([101, True], 1), ([True, 7], 0), ([0, 1, 1, False, 9], 3), ([3, 4, np.True_], 2)],
)
def test_a_bool_among_token_ids_is_refused_by_position(
    engine: vecpool.Engine,
    monkeypatch: pytest.MonkeyPatch,
    packed: bool,
    value: list[Any],
    pos: int,
) -> None:
    """A bool among ints would pack (or convert) as id 0 or 1: refused, naming its position;
    ids 0 and 1 given as ints stay ids."""
    from vecpool.inputs import arrays

    monkeypatch.setattr(arrays, "PACK_ID_LISTS", packed)
    with pytest.raises(vecpool.InputError, match=rf"input 1 .*a bool\) at position {pos}"):
        engine.embed([[5, 6], value])
    assert arrays.as_id_array([0, 1, 1, 5], 0).tolist() == [0, 1, 1, 5]
