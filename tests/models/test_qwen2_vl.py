"""Qwen2-VL and Qwen2.5-VL embedders (GME-style: the last row of the language model, images
spliced in at their placeholder tokens) against transformers' `Qwen2VLModel` /
`Qwen2_5_VLModel` on the same random weights, folder and pixel values: the image processor,
the multimodal rotary positions, the vision tower, and the pooled rows through the engine for
every input form, texts and images mixed in one step. Precomputed image rows sent for the
placeholder span give what the image gives, bit for bit. Bad inputs fail alone, named.

Tolerance: 1e-5 of the largest output (`assert_rel_close`), fp32 on the CPU: the same
arithmetic in other kernel shapes (flat batches, the patch convolution as one matrix product,
attention over padded sequences). Positions and pixel values are compared exactly: they are
integer arithmetic, and the same float operations on the same 8-bit values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

import vecpool
from tests.helpers import assert_rel_close
from tests.image_models import randomize, save_tiny_dual_encoder
from vecpool.errors import InputError
from vecpool.inputs.image_processing import load_image_processor
from vecpool.inputs.pixels import ImageSpan
from vecpool.inputs.vision_prompts import mrope_positions

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = "<unk> system user assistant You are a helpful . photo of cat dog red house on the".split()
PATCH, MERGE = 4, 2
# Qwen2-VL's chat template, as its folders ship it (tokenizer_config.json), its layout
# kept: the default system message, an image part as its placeholder between its markers.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def user(content: str, system: str = SYSTEM) -> str:
    """What the template writes for one user message (its generation prompt added)."""
    return f"{system}<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def _tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate([*SPECIALS, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tokenizer


IMAGE_TOKEN = SPECIALS.index("<|image_pad|>")


def tiny_text_config(vocab_size: int = 64) -> dict[str, Any]:
    """The tiny language model of every Qwen2-VL-based test folder (M-RoPE in three sections)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"type": "mrope", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
    )


def vision_token_ids(specials: list[str]) -> dict[str, int]:
    """The config's image, video and vision start / end token ids in a `specials` vocabulary."""
    return dict(
        image_token_id=specials.index("<|image_pad|>"),
        video_token_id=specials.index("<|video_pad|>"),
        vision_start_token_id=specials.index("<|vision_start|>"),
        vision_end_token_id=specials.index("<|vision_end|>"),
    )


def tiny_qwen2_vl_config(specials: list[str], vocab_size: int = 64) -> Any:
    """A tiny `Qwen2VLConfig`: `tiny_text_config` and a two-block tower of width 16."""
    vision = dict(
        depth=2,
        embed_dim=16,
        hidden_size=32,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
    )
    return transformers.Qwen2VLConfig(
        text_config=tiny_text_config(vocab_size), vision_config=vision, **vision_token_ids(specials)
    )


def tiny_image_processor() -> Any:
    """transformers' Qwen2-VL image processor at the tiny tower's patch and merge sizes."""
    return transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 24},
    )


def save_tiny_qwen2_vl(path: Path, qwen2_5: bool, *, template: bool = True) -> Any:
    """A complete tiny Qwen2-VL (or Qwen2.5-VL) folder at `path`; the transformers model
    (fp32, eager attention) with the same weights."""
    tokenizer = _tokenizer()
    text = tiny_text_config()
    tokens = vision_token_ids(SPECIALS)
    geometry = dict(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2)
    if qwen2_5:
        # Windows of 2x2 merge blocks (16 pixels), the second block attending to the whole image.
        vision: dict[str, Any] = dict(
            depth=2,
            hidden_size=16,
            intermediate_size=24,
            out_hidden_size=32,
            num_heads=2,
            window_size=16,
            fullatt_block_indexes=[1],
            **geometry,
        )
        config: Any = transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, **tokens
        )
        model: Any = transformers.Qwen2_5_VLForConditionalGeneration(config)
    else:
        config = tiny_qwen2_vl_config(SPECIALS)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    config._attn_implementation = "eager"
    randomize(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tiny_image_processor().save_pretrained(str(path))
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {"eos_token": "<|im_end|>"}
    if template:
        tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model


def sample_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


SIZES = [(40, 27), (21, 50), (64, 64)]


@pytest.fixture(scope="module", params=[False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("qwen2_5_vl" if request.param else "qwen2_vl") / "model"
    hf = save_tiny_qwen2_vl(path, request.param)
    engine = vecpool.Engine(path, device="cpu", normalize=False, allowed_local_media_path=path)
    return engine, hf, path


def hf_processor(path: Path) -> Any:
    return transformers.Qwen2VLImageProcessorPil.from_pretrained(str(path))


def reference(hf: Any, path: Path, text: str, images: list[Image.Image]) -> np.ndarray:
    """The last row of transformers' base model for `text` (placeholders of one token each,
    grown here to the images' counts, as the Qwen2-VL processor does) and `images`."""
    ids = _tokenizer().encode(text).ids
    kwargs: dict[str, Any] = {}
    if images:
        inputs = hf_processor(path)(images=images, return_tensors="pt")
        counts = (inputs["image_grid_thw"].prod(-1) // MERGE**2).tolist()
        grown: list[int] = []
        for token in ids:
            grown += [token] * (counts.pop(0) if token == IMAGE_TOKEN else 1)
        ids = grown
        kwargs = dict(
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=(torch.tensor([ids]) == IMAGE_TOKEN).int(),
        )
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([ids]), **kwargs).last_hidden_state
    return np.asarray(out[0, -1].numpy())


def test_image_processor_equals_transformers(vlm: Any) -> None:
    _, _, path = vlm
    ours, theirs = load_image_processor(path), hf_processor(path)
    assert ours is not None
    for image in sample_images([*SIZES, (5, 7), (300, 41), (17, 120)], seed=4):
        expected = theirs(images=[image], return_tensors="np")
        pixels = ours(image)
        assert (1, *pixels.grid) == tuple(expected["image_grid_thw"][0])
        np.testing.assert_array_equal(pixels.patches, expected["pixel_values"])


def test_rope_positions_equal_transformers(vlm: Any) -> None:
    _, hf, path = vlm
    images = sample_images(SIZES)
    inputs = hf_processor(path)(images=images, return_tensors="pt")
    grids = [(int(g[1]), int(g[2])) for g in inputs["image_grid_thw"]]
    counts = [r * c // MERGE**2 for r, c in grids]
    # text, image, text, image, image (adjacent but for their markers), text
    pieces = [7, counts[0], 3, counts[1], 2, counts[2], 5]
    ids = np.concatenate(
        [np.full(n, IMAGE_TOKEN if i % 2 else 10 + i) for i, n in enumerate(pieces)]
    )
    starts = np.cumsum([0, *pieces])[1:-1:2]
    spans = [ImageSpan(int(s), n, g, None) for s, n, g in zip(starts, counts, grids, strict=True)]
    input_ids = torch.from_numpy(ids)[None]
    expected, _ = hf.model.get_rope_index(
        input_ids, (input_ids == IMAGE_TOKEN).int(), image_grid_thw=inputs["image_grid_thw"]
    )
    np.testing.assert_array_equal(mrope_positions(len(ids), spans, MERGE), expected[:, 0].numpy())


def test_vision_tower_equals_transformers(vlm: Any) -> None:
    engine, hf, path = vlm
    images = sample_images(SIZES)
    inputs = hf_processor(path)(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = torch.cat(
            hf.model.get_image_features(
                inputs["pixel_values"], inputs["image_grid_thw"]
            ).pooler_output
        )
    processor = load_image_processor(path)
    assert processor is not None
    # Each image's rows alone, and the three in one flat batch of the tower.
    alone = torch.cat([engine.model_runner.image_rows(processor(image)) for image in images])
    assert_rel_close(alone.numpy(), expected.numpy())
    from vecpool.models.base import ImageBatch

    pixels = [processor(image) for image in images]
    counts = [p.num_patches for p in pixels]
    batch = ImageBatch(
        pixel_values=torch.from_numpy(np.concatenate([p.patches for p in pixels])),
        cu_patches=torch.tensor(np.cumsum([0, *counts]), dtype=torch.int32),
        max_patches=max(counts),
        grids=[p.grid for p in pixels],
        rows=torch.zeros(0, dtype=torch.int64),
    )
    with torch.no_grad():
        together = engine.model_runner.model.vision_rows(batch, False)
    assert_rel_close(together.numpy(), expected.numpy())


def test_every_form_in_one_step_equals_transformers(vlm: Any) -> None:
    engine, hf, path = vlm
    a, b, c = sample_images(SIZES, seed=1)
    (path / "b.png").parent.mkdir(exist_ok=True)
    b.save(path / "b.png")
    inputs: list[Any] = [
        "a photo of the cat",  # a text, as it is
        {"text": "a red house", "image": a},
        c,  # an image alone
        [
            {"type": "text", "text": "dog on"},
            {"type": "image", "image": str(path / "b.png")},
            {"type": "image", "image": a},
        ],
        {"prompt": f"{IMAGE} the cat {IMAGE}", "image": [b, c]},  # written by the caller
        [{"type": "text", "text": "the house"}],
    ]
    expected = [
        reference(hf, path, "a photo of the cat", []),
        reference(hf, path, user(f"{IMAGE}a red house"), [a]),
        reference(hf, path, user(IMAGE), [c]),
        reference(hf, path, user(f"dog on{IMAGE}{IMAGE}"), [b, a]),
        reference(hf, path, f"{IMAGE} the cat {IMAGE}", [b, c]),
        reference(hf, path, user("the house"), []),
    ]
    out = engine.embed(inputs)
    assert_rel_close(out, np.stack(expected))
    # Each alone gives the same rows (within tolerance: other step shapes).
    for item, row in zip(inputs, out, strict=True):
        assert_rel_close(engine.embed([item])[0], row)


def test_instruction_is_the_system_message(vlm: Any) -> None:
    engine, hf, path = vlm
    (image,) = sample_images(SIZES[:1])
    out = engine.embed({"text": "a cat", "image": image}, prompt="You are a dog.")
    system = "<|im_start|>system\nYou are a dog.<|im_end|>\n"
    assert_rel_close(out[0], reference(hf, path, user(f"{IMAGE}a cat", system), [image]))


def test_token_ids_with_placeholders_grown_or_given(vlm: Any) -> None:
    engine, hf, path = vlm
    (image,) = sample_images(SIZES[:1])
    tokenizer = _tokenizer()
    ids = tokenizer.encode(user(f"{IMAGE}a cat")).ids
    count = int(np.prod(engine.inputs.images.processor(image).grid)) // MERGE**2
    at = ids.index(IMAGE_TOKEN)
    grown = ids[:at] + [IMAGE_TOKEN] * count + ids[at + 1 :]
    expected = reference(hf, path, user(f"{IMAGE}a cat"), [image])
    out = engine.embed(
        [{"prompt_token_ids": ids, "image": image}, {"prompt_token_ids": grown, "image": image}]
    )
    assert_rel_close(out, np.stack([expected, expected]))


def test_precomputed_rows_equal_the_image_bit_for_bit(vlm: Any) -> None:
    engine, _, path = vlm
    a, b = sample_images(SIZES[:2], seed=2)
    b.save(path / "b_rows.png")
    # `Engine.image_rows`: each image's rows and grid, in the form an input takes back.
    given, given_b = engine.image_rows([a, {"image": str(path / "b_rows.png")}])
    pixels = engine.inputs.images.processor(a)
    rows, grid = given["image_embeds"], given["image_grid_thw"]
    assert grid == [1, *pixels.grid] and given_b["image_grid_thw"][0] == 1
    assert rows.dtype == torch.float32 and rows.shape == (np.prod(pixels.grid) // MERGE**2, 32)
    np.testing.assert_array_equal(engine.image_rows(a)[0]["image_embeds"], rows)  # one image
    np.testing.assert_array_equal(rows, engine.model_runner.image_rows(pixels))
    rows_b, grid_b = given_b["image_embeds"], given_b["image_grid_thw"]
    for form in (rows, rows.numpy()):  # a tensor, or an array
        by_rows = {"text": "a red cat", "image": {"image_embeds": form, "image_grid_thw": grid}}
        np.testing.assert_array_equal(
            engine.embed([by_rows]), engine.embed([{"text": "a red cat", "image": a}])
        )
    # In a step with texts, and beside precomputed rows of another image: the tower runs `a`
    # alone, as `image_rows` did. (A step whose tower runs several images computes each one's
    # rows in other matrix shapes: equal within rounding, not to the bit.)
    others = ["the dog", {"text": "x", "image": {"image_embeds": rows_b, "image_grid_thw": grid_b}}]
    np.testing.assert_array_equal(
        engine.embed([others[0], [{"type": "image_embeds", **given}], others[1]]),
        engine.embed([others[0], [{"type": "image", "image": a}], others[1]]),
    )


def test_a_prompt_with_images_over_the_budget_runs_in_chunks(vlm: Any, tmp_path: Path) -> None:
    """Its chunk boundaries split its images' spans (tests/engine/test_chunked_images.py)."""
    _, hf, path = vlm
    small = vecpool.Engine(path, device="cpu", normalize=False, max_num_batched_tokens=32)
    images = sample_images([(64, 64), (64, 56)], seed=5)  # 16 + 14 tokens, 120 patches
    text = user(f"a photo {IMAGE} of {IMAGE} the cat on the red house")
    out = small.embed([{"prompt": text, "image": images}, "a cat"])
    assert_rel_close(out[0], reference(hf, path, text, images))
    assert_rel_close(out[1], reference(hf, path, "a cat", []))


def test_the_earlier_checkpoint_layout_loads(vlm: Any, tmp_path: Path) -> None:
    """Published checkpoints (GME's) keep transformers 4's names (`model.layers.`,
    `visual.`) and the language model's settings at the top of config.json."""
    engine, _, path = vlm
    old = tmp_path / "old"
    old.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (old / name).write_bytes((path / name).read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {
        k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
        for k, v in tensors.items()
    }
    save_file(renamed, str(old / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update(text)
    config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config["rope_theta"] = rope["rope_theta"]
    config["vision_config"]["in_chans"] = config["vision_config"].pop("in_channels")
    (old / "config.json").write_text(json.dumps(config))
    (image,) = sample_images(SIZES[:1])
    item = {"text": "a cat", "image": image}
    old_engine = vecpool.Engine(old, device="cpu", normalize=False)
    np.testing.assert_array_equal(old_engine.embed([item]), engine.embed([item]))


def test_bad_inputs_fail_alone_naming_the_input(vlm: Any) -> None:
    engine, _, _ = vlm
    (image,) = sample_images(SIZES[:1])
    pixels = engine.inputs.images.processor(image)
    rows = engine.model_runner.image_rows(pixels).numpy()
    grid = [1, *pixels.grid]
    cases = [
        ({"prompt": f"{IMAGE} a cat", "image": [image, image]}, "1 image placeholder .* 2 images"),
        ({"prompt": "a cat", "image": image}, "0 image placeholders .* 1 image"),
        (
            {"prompt_token_ids": [1, IMAGE_TOKEN, IMAGE_TOKEN, 2], "image": image},
            "placeholder is 2 tokens long",
        ),
        (
            {"text": "a", "image": {"image_embeds": rows[:, :31], "image_grid_thw": grid}},
            "width 31 .* hidden size 32",
        ),
        (
            {"text": "a", "image": {"image_embeds": rows[:-1], "image_grid_thw": grid}},
            f"{len(rows) - 1} rows for an image",
        ),
        (
            {"text": "a", "image": {"image_embeds": rows, "image_grid_thw": [1, 3, 4]}},
            "image_grid_thw must be",
        ),
        ({"text": "a", "image": b"not an image"}, "not an image"),
        ([{"type": "video", "video": "x"}], "part 0"),
    ]
    for bad, reason in cases:
        with pytest.raises(InputError, match=rf"input 1.*{reason}") as info:
            engine.embed(["a cat", bad])
        assert info.value.index == 1
    with pytest.raises(InputError, match=r"input 0.*truncate_prompt_tokens=4"):
        engine.embed([{"text": "a", "image": image}], truncate_prompt_tokens=4)
    # The engine is untouched: the next call is served.
    assert engine.embed(["a cat", {"text": "a", "image": image}]).shape == (2, 32)
    with pytest.raises(InputError, match=r"input 1.*not an image"):
        engine.image_rows([image, b"not an image"])


def test_text_models_and_dual_encoders_refuse_text_with_images(
    minilm: vecpool.Engine, tmp_path: Path
) -> None:
    (image,) = sample_images(SIZES[:1])
    for item, what in (
        ({"text": "a", "image": image}, "text with images"),
        ([{"type": "image", "image": image}], "a list of parts"),
        ([{"type": "text", "text": "a"}], "a list of parts"),
    ):
        with pytest.raises(InputError, match=f"input 1: {what}, but this model has no image"):
            minilm.embed(["text", item])
    save_tiny_dual_encoder(tmp_path / "clip")
    clip = vecpool.Engine(tmp_path / "clip", device="cpu")
    with pytest.raises(InputError, match=r"input 0: text with images, but .*a dual encoder"):
        clip.embed([{"text": "a photo", "image": image}])
    assert minilm.embed(["text"]).shape[0] == 1
    for engine in (minilm, clip):
        with pytest.raises(InputError, match="image_rows needs a vision-language model"):
            engine.image_rows(image)


def test_the_base_model_class_loads(vlm: Any, tmp_path: Path) -> None:
    """`Qwen2VLModel` / `Qwen2_5_VLModel` folders (`visual.`, `language_model.`, no head)."""
    engine, hf, path = vlm
    base = tmp_path / "base"
    base.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (base / name).write_bytes((path / name).read_bytes())
    hf.model.save_pretrained(str(base))
    (image,) = sample_images(SIZES[:1])
    item = {"text": "a cat", "image": image}
    base_engine = vecpool.Engine(base, device="cpu", normalize=False)
    np.testing.assert_array_equal(base_engine.embed([item]), engine.embed([item]))
