"""SigLIP (`SiglipModel`) and SigLIP2 (`Siglip2Model`) against Hugging Face transformers on the
same random weights: text rows at each prompt's last position against `get_text_features`,
image rows against `get_image_features` (SigLIP2: a padded batch of several grids, with
`pixel_attention_mask` and `spatial_shapes`, as its processor gives it), texts and images
mixed in one flat batch, an image alone against the same image in a batch; and through
`vecpool.Engine`, pictures preprocessed by vecpool against transformers' own processor.

As in test_clip.py: the model is loaded by the registry and the strict loader, run on the flat
batch the runner builds; SigLIP's images as (channel, y, x) patch rows of the same
`pixel_values`, SigLIP2's as the rows of its own patchified `pixel_values`. Tolerance: 1e-5 of
the largest output (fp32 on the CPU, the same arithmetic in another order).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.helpers import REORDERED_RTOL, assert_rel_close, save_hf_model
from tests.models.test_clip import (
    Image,
    hf_eager,
    load,
    patchify,
    pictures,
    randomize,
    run_step,
    text_prompts,
)
from vecpool.errors import ConfigError, InputError
from vecpool.models.base import Capability, PoolingModel

TEXT: dict[str, Any] = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=24,
    projection_size=40,  # the vision tower's width: the shared space
)
VISION: dict[str, Any] = dict(
    hidden_size=40,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    patch_size=8,
)
PATCH_DIM = 3 * 8 * 8
LENGTHS = [5, 17, 3, 24, 11]
# SigLIP2 grids: the table's own 4 x 4, smaller, larger, one repeated (grouped with its twin).
GRIDS = [(4, 4), (2, 6), (6, 7), (2, 6), (1, 3)]


@pytest.fixture(scope="module")
def siglip(tmp_path_factory: pytest.TempPathFactory) -> tuple[PoolingModel, Any, Path]:
    config = transformers.SiglipConfig(text_config=TEXT, vision_config={**VISION, "image_size": 32})
    hf = randomize(transformers.SiglipModel(hf_eager(config)), seed=10)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("siglip"))
    return load(folder), hf, folder


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory: pytest.TempPathFactory) -> tuple[PoolingModel, Any, Path]:
    config = transformers.Siglip2Config(
        text_config=TEXT, vision_config={**VISION, "num_patches": 16}
    )
    hf = randomize(transformers.Siglip2Model(hf_eager(config)), seed=11)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("siglip2"))
    return load(folder), hf, folder


@torch.no_grad()
def hf_text(hf: Any, prompt: list[int]) -> np.ndarray:
    return hf.get_text_features(input_ids=torch.tensor([prompt])).pooler_output[0].numpy()


def siglip_images(count: int, seed: int) -> tuple[torch.Tensor, list[Image]]:
    """`[count, 3, 32, 32]` pixel values, and the same as patch rows."""
    pixel_values = torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return pixel_values, [Image(rows, (4, 4)) for rows in patchify(pixel_values, 8)]


@torch.no_grad()
def hf_siglip_images(hf: Any, pixel_values: torch.Tensor) -> np.ndarray:
    return hf.get_image_features(pixel_values=pixel_values).pooler_output.numpy()


def siglip2_images(grids: list[tuple[int, int]], seed: int) -> list[Image]:
    gen = torch.Generator().manual_seed(seed)
    return [Image(torch.randn(r * c, PATCH_DIM, generator=gen), (r, c)) for r, c in grids]


@torch.no_grad()
def hf_siglip2_images(hf: Any, images: list[Image]) -> np.ndarray:
    """The images as Siglip2's processor batches them: rows padded to the longest, with
    `pixel_attention_mask` and `spatial_shapes`."""
    longest = max(image.patches.shape[0] for image in images)
    pixel_values = torch.zeros(len(images), longest, PATCH_DIM)
    mask = torch.zeros(len(images), longest, dtype=torch.int32)
    for i, image in enumerate(images):
        pixel_values[i, : len(image.patches)] = image.patches
        mask[i, : len(image.patches)] = 1
    out = hf.get_image_features(
        pixel_values=pixel_values,
        pixel_attention_mask=mask,
        spatial_shapes=torch.tensor([image.grid for image in images]),
    )
    return out.pooler_output.numpy()


@pytest.mark.parametrize("name", ["siglip", "siglip2"])
def test_loads_as_a_dual_encoder(name: str, request: pytest.FixtureRequest) -> None:
    model, _, _ = request.getfixturevalue(name)
    assert type(model).__module__ == "vecpool.models.architectures.siglip"
    assert type(model).__name__ == {"siglip": "SiglipModel", "siglip2": "Siglip2Model"}[name]
    assert model.capabilities == frozenset({Capability.IMAGE_TOWER})
    assert (model.hidden_size, model.output_size, model.image_patch_dim) == (32, 40, PATCH_DIM)
    assert model.default_pooler == "LAST" and not model.is_causal


@pytest.mark.parametrize("name", ["siglip", "siglip2"])
def test_text_rows_match_get_text_features(name: str, request: pytest.FixtureRequest) -> None:
    model, hf, _ = request.getfixturevalue(name)
    prompts = text_prompts(LENGTHS, seed=1, eos=None)  # SigLIP pools the last token, whatever
    for prompt, rows in zip(prompts, run_step(model, list(prompts)), strict=True):
        assert_rel_close(rows[-1].numpy(), hf_text(hf, prompt))


def test_siglip_images_match_get_image_features(siglip: tuple[PoolingModel, Any, Path]) -> None:
    model, hf, _ = siglip
    pixel_values, images = siglip_images(3, seed=2)
    ours = torch.stack(run_step(model, list(images))).numpy()
    assert_rel_close(ours, hf_siglip_images(hf, pixel_values))


def test_siglip_texts_and_images_in_one_batch(siglip: tuple[PoolingModel, Any, Path]) -> None:
    model, hf, _ = siglip
    prompts = text_prompts([7, 2, 19], seed=3, eos=None)
    pixel_values, images = siglip_images(3, seed=4)
    out = run_step(model, [images[0], prompts[0], prompts[1], images[1], images[2], prompts[2]])
    expected = hf_siglip_images(hf, pixel_values)
    for got, want in zip([out[0], out[3], out[4]], expected, strict=True):
        assert_rel_close(got.numpy(), want)
    for got, prompt in zip([out[1], out[2], out[5]], prompts, strict=True):
        assert_rel_close(got[-1].numpy(), hf_text(hf, prompt))
    (alone,) = run_step(model, [images[2]])
    assert_rel_close(alone.numpy(), out[4].numpy(), rtol=REORDERED_RTOL)


def test_siglip_refuses_an_image_of_another_grid(siglip: tuple[PoolingModel, Any, Path]) -> None:
    model, _, _ = siglip
    with pytest.raises(InputError, match=r"image 0 of the step has 2x8 patches.*takes 4x4"):
        run_step(model, [Image(torch.zeros(16, PATCH_DIM), (2, 8))])


def test_siglip2_images_of_several_grids_match_get_image_features(
    siglip2: tuple[PoolingModel, Any, Path],
) -> None:
    model, hf, _ = siglip2
    images = siglip2_images(GRIDS, seed=5)
    ours = torch.stack(run_step(model, list(images))).numpy()
    assert_rel_close(ours, hf_siglip2_images(hf, images))


def test_siglip2_texts_and_images_in_one_batch(siglip2: tuple[PoolingModel, Any, Path]) -> None:
    model, hf, _ = siglip2
    prompts = text_prompts([4, 21], seed=6, eos=None)
    images = siglip2_images([(6, 7), (4, 4), (3, 2)], seed=7)
    out = run_step(model, [prompts[0], images[0], images[1], prompts[1], images[2]])
    # transformers runs each image alone here: the batch's are compared to them.
    for got, image in zip([out[1], out[2], out[4]], images, strict=True):
        assert_rel_close(got.numpy(), hf_siglip2_images(hf, [image])[0])
    for got, prompt in zip([out[0], out[3]], prompts, strict=True):
        assert_rel_close(got[-1].numpy(), hf_text(hf, prompt))
    (alone,) = run_step(model, [images[2]])
    assert_rel_close(alone.numpy(), out[4].numpy(), rtol=REORDERED_RTOL)


def test_config_checks(tmp_path: Path) -> None:
    """A SigLIP without its pooling head, or whose text head leaves the image space, is
    refused naming the setting."""
    config = transformers.SiglipConfig(text_config=TEXT, vision_config={**VISION, "image_size": 32})
    folder = save_hf_model(transformers.SiglipModel(config), tmp_path)
    saved = json.loads((folder / "config.json").read_text())
    changes: list[tuple[dict[str, Any], str]] = [
        ({"vision_use_head": False}, "vision_use_head"),
        ({"hidden_size": 48}, "projection_size 40 differs from vision_config.hidden_size 48"),
    ]
    for change, message in changes:
        edited = {**saved, "vision_config": {**saved["vision_config"], **change}}
        (folder / "config.json").write_text(json.dumps(edited))
        with pytest.raises(ConfigError, match=message):
            load(folder)


@pytest.mark.parametrize("name", ["siglip", "siglip2"])
def test_engine_embeds_texts_and_pictures(name: str, request: pytest.FixtureRequest) -> None:
    """`Engine.embed` on pictures (SigLIP: resized to 32 x 32; SigLIP2: each aspect ratio its
    own grid of at most 24 patches) and token-id texts in one call, unnormalized, against
    transformers on its own processor's output (the preprocessings agree to ~1e-6; the
    tolerance stays 1e-5 of the largest output)."""
    _, hf, folder = request.getfixturevalue(name)
    processor = (
        transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
        if name == "siglip"
        else transformers.Siglip2ImageProcessorPil(patch_size=8, max_num_patches=24)
    )
    processor.save_pretrained(str(folder))
    engine = vecpool.Engine(folder, device="cpu")
    images = pictures([(40, 50), (20, 90), (64, 64)], seed=9)
    prompts = text_prompts([6, 13], seed=10, eos=None)
    out = engine.embed([images[0], prompts[0], images[1], images[2], prompts[1]], normalize=False)
    inputs = processor(images=images, return_tensors="pt")
    if name == "siglip2":  # three grids: the step groups none of them
        assert len({tuple(s) for s in inputs.spatial_shapes.tolist()}) == 3
    with torch.no_grad():
        expected = hf.get_image_features(**inputs).pooler_output.numpy()
    assert_rel_close(out[[0, 2, 3]], expected)
    # Token prompts are padded to the text length with the pad id, as SigLIP was trained.
    text_config = hf.config.text_config
    pad = text_config.max_position_embeddings
    for got, prompt in zip(out[[1, 4]], prompts, strict=True):
        padded = prompt + [text_config.pad_token_id] * (pad - len(prompt))
        assert_rel_close(got, hf_text(hf, padded))
