"""CLIP (`CLIPModel`) against Hugging Face transformers on the same random weights: text rows
at each prompt's last position against `get_text_features`, image rows against
`get_image_features`, texts and images mixed in one flat batch, an image alone against the
same image in a batch; strict loading and config.json's sub-configs; and through
`vecpool.Engine`, pictures preprocessed by vecpool against transformers' own processor.

The model runs as the engine runs it: loaded by the registry and the strict loader, the text's
flat batch built by `build_flat_batch`, images given as patch rows made from the same
`pixel_values` (each row laid out (channel, y, x), patches row-major: the layout
`vecpool.inputs.pixels` documents). Tolerance: 1e-5 of the largest output, fp32 on the CPU
(the same arithmetic as transformers' in another order and other kernel shapes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image as PILImage
from safetensors.torch import load_file, save_file

import vecpool
from tests.helpers import REORDERED_RTOL, assert_rel_close, save_hf_model
from vecpool.errors import InputError, ModelLoadError
from vecpool.inputs.prompts import Prompt
from vecpool.models.base import Capability, ImageBatch, PoolingModel
from vecpool.models.loading.folder import ModelFolder
from vecpool.models.loading.loader import load_model
from vecpool.runner.batch import build_flat_batch
from vecpool.runner.step import ScheduledChunk, StepInput
from vecpool.tasks import TASKS, PoolingParams

VOCAB = 99
EOS = 98  # CLIP pools its end-of-text token: the last of every prompt here
TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=24,
    bos_token_id=97,
    eos_token_id=EOS,
    pad_token_id=1,
)
VISION: dict[str, Any] = dict(
    hidden_size=40,  # unlike the text tower's, and the shared space's
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,  # 4 x 4 patches
)
PROJECTION = 24
LENGTHS = [5, 17, 3, 24, 11]


@torch.no_grad()
def randomize(model: Any, seed: int) -> Any:
    """Every parameter drawn anew (std 0.2; norms' weights around 1): transformers' own
    initialization leaves biases zero and projections small, where a wrong bias, position or
    pooled row would not show."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen) * 0.2
        is_norm = "norm" in name and name.endswith("weight")
        param.copy_(noise + 1.0 if is_norm else noise)
    return model.eval()


def hf_eager(config: Any) -> Any:
    config._attn_implementation = "eager"
    return config


def patchify(pixel_values: torch.Tensor, patch: int) -> list[torch.Tensor]:
    """`[B, C, H, W]` -> per image `[rows * cols, C * patch * patch]`: each row (channel, y, x),
    patches row-major, so that `rows @ conv.weight.view(out, -1).T` is the Conv2d."""
    b, c, h, w = pixel_values.shape
    grid = pixel_values.reshape(b, c, h // patch, patch, w // patch, patch)
    rows = grid.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), -1)
    return list(rows)


@dataclass(frozen=True)
class Image:
    """One image of a step: its patch rows and grid."""

    patches: torch.Tensor  # [rows * cols, patch_dim]
    grid: tuple[int, int]


@torch.no_grad()
def run_step(model: PoolingModel, items: list[list[int] | Image]) -> list[torch.Tensor]:
    """One forward over a flat batch of texts (token ids) and images, as the model runner
    builds it (an image takes one row of id 0, which the model fills); per item, its output
    rows: `[length, output_size]` for a text, `[output_size]` for an image."""
    chunks = []
    for i, item in enumerate(items):
        ids = np.zeros(1, np.int64) if isinstance(item, Image) else np.asarray(item, np.int64)
        prompt = Prompt(token_ids=ids, prompt_embeds=None)
        chunks.append(ScheduledChunk(f"r{i}", prompt, PoolingParams(), TASKS["embed"], 0, len(ids)))
    batch = build_flat_batch(
        StepInput(chunks), torch.device("cpu"), use_varlen=False, with_token_types=False
    )
    cu = batch.attn.cu_seqlens.tolist()
    images = [(item, cu[i]) for i, item in enumerate(items) if isinstance(item, Image)]
    image_batch = None
    if images:
        counts = [image.patches.shape[0] for image, _ in images]
        cu_patches = torch.zeros(len(images) + 1, dtype=torch.int32)
        cu_patches[1:] = torch.tensor(counts).cumsum(0)
        image_batch = ImageBatch(
            pixel_values=torch.cat([image.patches for image, _ in images]),
            cu_patches=cu_patches,
            max_patches=max(counts),
            grids=[image.grid for image, _ in images],
            rows=torch.tensor([row for _, row in images]),
        )
    x = model.embed_input_ids(batch.input_ids)
    out = model(x, batch.positions, batch.attn, images=image_batch)
    assert out.shape == (len(x), model.output_size)
    return [
        out[cu[i]] if isinstance(item, Image) else out[cu[i] : cu[i + 1]]
        for i, item in enumerate(items)
    ]


def text_prompts(lengths: list[int], seed: int, eos: int | None) -> list[list[int]]:
    """Random prompts (ids in [3, 97)), ending with `eos` where given."""
    gen = np.random.default_rng(seed)
    prompts = [gen.integers(3, 97, size=n).tolist() for n in lengths]
    if eos is not None:
        for p in prompts:
            p[-1] = eos
    return prompts


def load(folder: Path) -> PoolingModel:
    return load_model(ModelFolder.load(folder), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> tuple[PoolingModel, Any, Path]:
    config = transformers.CLIPConfig(
        text_config=TEXT, vision_config=VISION, projection_dim=PROJECTION
    )
    hf = randomize(transformers.CLIPModel(hf_eager(config)), seed=0)
    folder = save_hf_model(hf, tmp_path_factory.mktemp("clip"))
    return load(folder), hf, folder


def pixels(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_text(hf: Any, prompt: list[int]) -> np.ndarray:
    return hf.get_text_features(input_ids=torch.tensor([prompt])).pooler_output[0].numpy()


@torch.no_grad()
def hf_images(hf: Any, pixel_values: torch.Tensor) -> np.ndarray:
    return hf.get_image_features(pixel_values=pixel_values).pooler_output.numpy()


def test_loads_as_a_dual_encoder(clip: tuple[PoolingModel, Any, Path]) -> None:
    model, _, _ = clip
    assert type(model).__module__ == "vecpool.models.architectures.clip"
    assert type(model).__name__ == "CLIPModel"
    assert model.capabilities == frozenset({Capability.IMAGE_TOWER})
    assert (model.hidden_size, model.output_size, model.image_patch_dim) == (32, 24, 3 * 8 * 8)
    assert model.default_pooler == "LAST" and model.is_causal
    assert model.max_positions == 24


def test_text_rows_match_get_text_features(clip: tuple[PoolingModel, Any, Path]) -> None:
    model, hf, _ = clip
    prompts = text_prompts(LENGTHS, seed=1, eos=EOS)
    outputs = run_step(model, list(prompts))
    for prompt, rows in zip(prompts, outputs, strict=True):
        assert_rel_close(rows[-1].numpy(), hf_text(hf, prompt))


def test_image_rows_match_get_image_features(clip: tuple[PoolingModel, Any, Path]) -> None:
    model, hf, _ = clip
    pixel_values = pixels(3, seed=2)
    images = [Image(rows, (4, 4)) for rows in patchify(pixel_values, 8)]
    ours = torch.stack(run_step(model, list(images))).numpy()
    assert_rel_close(ours, hf_images(hf, pixel_values))


def test_texts_and_images_in_one_batch(clip: tuple[PoolingModel, Any, Path]) -> None:
    model, hf, _ = clip
    prompts = text_prompts([7, 2, 19], seed=3, eos=EOS)
    pixel_values = pixels(3, seed=4)
    images = [Image(rows, (4, 4)) for rows in patchify(pixel_values, 8)]
    items: list[list[int] | Image] = [
        prompts[0],
        images[0],
        images[1],
        prompts[1],
        images[2],
        prompts[2],
    ]
    out = run_step(model, items)
    expected_images = hf_images(hf, pixel_values)
    for got, i in zip([out[1], out[2], out[4]], range(3), strict=True):
        assert_rel_close(got.numpy(), expected_images[i])
    for got, prompt in zip([out[0], out[3], out[5]], prompts, strict=True):
        assert_rel_close(got[-1].numpy(), hf_text(hf, prompt))
    # The same image alone in its step: the same embedding (other kernel shapes: an ulp or so).
    (alone,) = run_step(model, [images[1]])
    assert_rel_close(alone.numpy(), out[2].numpy(), rtol=REORDERED_RTOL)


def test_an_image_of_another_grid_is_refused(clip: tuple[PoolingModel, Any, Path]) -> None:
    model, _, _ = clip
    good = Image(torch.zeros(16, 192), (4, 4))
    bad = Image(torch.zeros(12, 192), (3, 4))
    with pytest.raises(InputError, match=r"image 1 of the step has 3x4 patches.*takes 4x4"):
        run_step(model, [good, [5, 6, EOS], bad])


def test_config_defaults_and_legacy_dicts_are_read(
    clip: tuple[PoolingModel, Any, Path], tmp_path: Path
) -> None:
    """A config.json that leaves out values equal to transformers' defaults (older saves did)
    and gives others in the legacy `text_config_dict`, which wins over `text_config`."""
    _, hf, folder = clip
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = json.loads((folder / "config.json").read_text())
    for key in ("hidden_act", "layer_norm_eps"):  # quick_gelu, 1e-5: the defaults
        del config["text_config"][key]
        del config["vision_config"][key]
    del config["vision_config"]["num_channels"]
    config["text_config_dict"] = {"num_hidden_layers": 2}
    config["text_config"]["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = load(tmp_path)
    prompt = text_prompts([9], seed=5, eos=EOS)[0]
    pixel_values = pixels(1, seed=6)
    text, image = run_step(reloaded, [prompt, Image(patchify(pixel_values, 8)[0], (4, 4))])
    assert_rel_close(text[-1].numpy(), hf_text(hf, prompt))
    assert_rel_close(image.numpy(), hf_images(hf, pixel_values)[0])


def test_loading_is_strict(clip: tuple[PoolingModel, Any, Path], tmp_path: Path) -> None:
    """`logit_scale` is known and left unused; a missing or an unknown tensor is named."""
    _, _, folder = clip
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    assert "logit_scale" in weights
    missing = {k: v for k, v in weights.items() if k != "visual_projection.weight"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors.*visual_projection\.weight"):
        load(tmp_path)
    extra = {**weights, "vision_model.head.probe": torch.zeros(1, 1, 40)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensors.*vision_model\.head\.probe"):
        load(tmp_path)


def pictures(sizes: list[tuple[int, int]], seed: int) -> list[PILImage.Image]:
    """Random RGB pictures of (height, width) `sizes`."""
    gen = np.random.default_rng(seed)
    return [
        PILImage.fromarray(gen.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for h, w in sizes
    ]


def test_engine_embeds_texts_and_pictures(clip: tuple[PoolingModel, Any, Path]) -> None:
    """`Engine.embed` on pictures of several sizes (resized and cropped by vecpool's CLIP
    preprocessing) and token-id texts in one call, unnormalized, against transformers on its
    own processor's `pixel_values` (the two preprocessings agree to ~1e-6; the tolerance stays
    1e-5 of the largest output). A text given as its prompt embeds gives the same bits."""
    _, hf, folder = clip
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    processor.save_pretrained(str(folder))
    engine = vecpool.Engine(folder, device="cpu")
    images = pictures([(40, 50), (32, 32), (70, 33)], seed=7)
    prompts = text_prompts([5, 9], seed=8, eos=EOS)
    out = engine.embed([prompts[0], images[0], images[1], prompts[1], images[2]], normalize=False)
    with torch.no_grad():
        pixel_values = processor(images=images, return_tensors="pt").pixel_values
    expected = hf_images(hf, pixel_values)
    assert_rel_close(out[[1, 2, 4]], expected)
    for got, prompt in zip(out[[0, 3]], prompts, strict=True):
        assert_rel_close(got, hf_text(hf, prompt))
    embeds = engine.embed([{"prompt_embeds": engine.embed_tokens(p)} for p in prompts])
    assert np.array_equal(embeds, engine.embed(prompts))
