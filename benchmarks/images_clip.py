"""The CLIP part of `bench_images.py`: random-weight CLIP folders of the published shapes, a
transformers user's image embedding (Pillow, the folder's `AutoImageProcessor`,
`get_image_features`), and the rounds that compare it with `Engine.embed`, end to end and the
preprocessing alone."""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vecpool
from benchmarks import record
from benchmarks.images_common import timed


def _tower(hidden: int, layers: int, heads: int, **more: Any) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        **more,
    )


def _clip(text: int, text_heads: int, vision: int, layers: int, heads: int, patch: int) -> Any:
    return {
        "text": _tower(text, 12, text_heads),
        "vision": _tower(vision, layers, heads, image_size=224, patch_size=patch),
        "projection_dim": text,
    }


# The published CLIP shapes (openai/clip-vit-*): text and vision towers, patch, projection.
SHAPES: dict[str, dict[str, Any]] = {
    "b16": _clip(512, 8, 768, 12, 12, patch=16),
    "l14": _clip(768, 12, 1024, 24, 16, patch=14),
    "b32": _clip(512, 8, 768, 12, 12, patch=32),  # small enough for a CPU run
}


def build_folder(shape: str, path: Path) -> None:
    """A CLIP folder of `shape` with random weights, its image processor and a tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    spec = SHAPES[shape]
    words = ["<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>"] + [f"w{i}" for i in range(996)]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 2), ("<|endoftext|>", 3)],
    )
    text = dict(
        spec["text"],
        vocab_size=len(words),
        max_position_embeddings=77,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    config = transformers.CLIPConfig(
        text_config=text, vision_config=spec["vision"], projection_dim=spec["projection_dim"]
    )
    torch.manual_seed(0)
    model = transformers.CLIPModel(config)
    model.save_pretrained(str(path), safe_serialization=True)
    size = spec["vision"]["image_size"]
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(str(path))
    tokenizer.save(str(path / "tokenizer.json"))


class Transformers:
    """What a transformers (or sentence-transformers) user runs: batches decoded with Pillow,
    the folder's AutoImageProcessor, get_image_features."""

    def __init__(self, folder: Path, device: str, dtype: torch.dtype, batch_size: int):
        import transformers

        self.model = (
            transformers.CLIPModel.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        )
        self.processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
        self.device, self.dtype, self.batch_size = device, dtype, batch_size

    def preprocess(self, files: list[bytes]) -> torch.Tensor:
        from PIL import Image

        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in files]
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    @torch.inference_mode()
    def embed(self, files: list[bytes]) -> np.ndarray:
        out = []
        for start in range(0, len(files), self.batch_size):
            pixels = self.preprocess(files[start : start + self.batch_size])
            pixels = pixels.to(self.device, self.dtype)
            features = self.model.get_image_features(pixel_values=pixels)
            features = getattr(features, "pooler_output", features)
            out.append(features.float().cpu())
        return torch.cat(out).numpy()


def bench_shape(shape: str, args: argparse.Namespace, files: list[bytes]) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / shape
        build_folder(shape, folder)
        engine = vecpool.Engine(folder, device=args.device, dtype=args.dtype, normalize=False)
        baseline = Transformers(folder, args.device, dtype, args.batch_size)
        reader = engine.context.inputs.images
        assert reader is not None
        items = list(enumerate(files))
        # Warm both at full size (kernels, allocator, compiled shapes), then interleave.
        ours = engine.embed(files)
        theirs = baseline.embed(files)
        rounds: dict[str, list[float]] = {k: [] for k in ("vecpool", "transformers")}
        prep: dict[str, list[float]] = {k: [] for k in ("vecpool", "transformers")}
        for _ in range(args.rounds):
            rounds["vecpool"].append(timed(lambda: engine.embed(files))[0])
            rounds["transformers"].append(timed(lambda: baseline.embed(files))[0])
            prep["vecpool"].append(timed(lambda: reader.read_many(items))[0])
            prep["transformers"].append(
                timed(
                    lambda: [
                        baseline.preprocess(files[s : s + args.batch_size])
                        for s in range(0, len(files), args.batch_size)
                    ]
                )[0]
            )
        cos = np.sum(ours * theirs, axis=1) / (
            np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
        )
        n = len(files)

        def per_second(seconds: list[float]) -> dict[str, Any]:
            rates = [n / s for s in seconds]
            return {"images_per_s": record.rounds(rates), "seconds": seconds}

        vec = statistics.median(n / s for s in rounds["vecpool"])
        ref = statistics.median(n / s for s in rounds["transformers"])
        result = {
            "shape": shape,
            "images": n,
            "end_to_end": {k: per_second(v) for k, v in rounds.items()},
            "preprocessing_only": {k: per_second(v) for k, v in prep.items()},
            "ratio_median": vec / ref,
            "cosine_to_transformers": {"min": float(cos.min()), "median": float(np.median(cos))},
        }
        print(
            f"{shape}: vecpool {vec:,.0f} images/s, transformers {ref:,.0f} images/s "
            f"({vec / ref:.2f}x); preprocessing alone vecpool "
            f"{statistics.median(n / s for s in prep['vecpool']):,.0f}/s, transformers "
            f"{statistics.median(n / s for s in prep['transformers']):,.0f}/s; cosine min "
            f"{cos.min():.5f}",
            flush=True,
        )
        return result
