"""Tiny dual encoders saved as complete model folders (weights, config.json, tokenizer.json,
preprocessor_config.json), for the tests that run them through the engine, the server and the
command line; and their Hugging Face references on the same files.

The folders are what a real CLIP / SigLIP checkpoint holds, at toy sizes: random weights (every
parameter drawn, so that a wrong row, bias or position shows), a word-level tokenizer of a few
words with the family's special tokens, and the family's image processor settings.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = (
    "a photo of cat dog red blue green house tree car sky sea small large old new the on in "
    "with and two three running sitting white black bird"
).split()
IMAGE_SIZE = 32
PATCH = 8


@dataclass(frozen=True)
class TinyFamily:
    name: str  # "clip" or "siglip"
    bos: str | None  # the token in front of every text, if any
    eos: str  # the token every text ends with (the pooled one)
    processor: str  # transformers' (PIL) image processor class

    @property
    def specials(self) -> list[str]:
        return [t for t in ("<pad>", "<unk>", self.bos, self.eos) if t is not None]


CLIP = TinyFamily("clip", "<|startoftext|>", "<|endoftext|>", "CLIPImageProcessorPil")
SIGLIP = TinyFamily("siglip", None, "</s>", "SiglipImageProcessorPil")


def _tokenizer(family: TinyFamily) -> Tokenizer:
    vocab = {token: i for i, token in enumerate([*family.specials, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    single = f"{family.bos} $A {family.eos}" if family.bos else f"$A {family.eos}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single,
        special_tokens=[(t, vocab[t]) for t in (family.bos, family.eos) if t is not None],
    )
    return tokenizer


@torch.no_grad()
def randomize(model: Any, seed: int = 0) -> Any:
    """`model`'s parameters drawn anew from `seed`: noise of 0.2, norm weights about 1; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen) * 0.2
        is_norm = "norm" in name and name.endswith("weight")
        param.copy_(noise + 1.0 if is_norm else noise)
    return model.eval()


def save_tiny_dual_encoder(path: Path, family: TinyFamily = CLIP, seed: int = 0) -> Any:
    """Write a complete tiny `family` folder at `path`; return the transformers model (fp32,
    eager attention) holding the same weights."""
    tokenizer = _tokenizer(family)
    vocab_size = tokenizer.get_vocab_size()
    text = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    vision = dict(
        hidden_size=40,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    if family is CLIP:
        eos_id = tokenizer.token_to_id(family.eos)
        text.update(bos_token_id=tokenizer.token_to_id(family.bos), eos_token_id=eos_id)
        text.update(pad_token_id=0)
        config: Any = transformers.CLIPConfig(
            text_config=text, vision_config=vision, projection_dim=24
        )
        model = transformers.CLIPModel(config)
        processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
    else:
        vision["hidden_size"] = 32  # SigLIP's towers share a width
        text["projection_size"] = 32
        config = transformers.SiglipConfig(text_config=text, vision_config=vision)
        model = transformers.SiglipModel(config)
        processor = transformers.SiglipImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        )
    config._attn_implementation = "eager"
    randomize(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    processor.save_pretrained(str(path))
    tokenizer.save(str(path / "tokenizer.json"))
    return model


def hf_image_processor(path: Path) -> Any:
    """The folder's image processor, as transformers reads it (its PIL backend)."""
    config = json.loads((path / "preprocessor_config.json").read_text())
    cls = {
        "CLIPImageProcessor": transformers.CLIPImageProcessorPil,
        "SiglipImageProcessor": transformers.SiglipImageProcessorPil,
    }[config["image_processor_type"]]
    return cls.from_pretrained(str(path))


@torch.no_grad()
def hf_image_features(model: Any, path: Path, images: list[Image.Image]) -> np.ndarray:
    """`get_image_features` of `images`, preprocessed by the folder's own processor."""
    pixels = hf_image_processor(path)(images=images, return_tensors="pt")["pixel_values"]
    out = model.get_image_features(pixel_values=pixels)
    out = getattr(out, "pooler_output", out)
    return out.float().numpy()


@torch.no_grad()
def hf_text_features(model: Any, path: Path, texts: list[str]) -> np.ndarray:
    """`get_text_features` of each text, tokenized by the folder's tokenizer: unpadded for
    CLIP; for SigLIP padded to the text length with its pad id, as its processor is told to
    (padding="max_length") and as it was trained."""
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    text_config = model.config.text_config
    pad_to = text_config.max_position_embeddings if model.config.model_type == "siglip" else 0
    rows = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        ids = torch.tensor([ids + [text_config.pad_token_id] * (pad_to - len(ids))])
        out = model.get_text_features(input_ids=ids)
        rows.append(getattr(out, "pooler_output", out)[0].float().numpy())
    return np.stack(rows)


def sample_images(count: int = 3, seed: int = 0) -> list[Image.Image]:
    """RGB pictures of assorted sizes and aspect ratios (random pixels over a gradient)."""
    gen = np.random.default_rng(seed)
    sizes = [(37, 53), (64, 48), (20, 90), (101, 77), (45, 45)]
    images = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        ramp = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
        noise = gen.integers(0, 96, size=(h, w, 3))
        images.append(Image.fromarray(np.clip(ramp * 0.6 + noise, 0, 255).astype(np.uint8)))
    return images


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    """`image` encoded as `fmt` (PNG, JPEG, WEBP, GIF, BMP, TIFF)."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()
