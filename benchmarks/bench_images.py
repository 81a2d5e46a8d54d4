"""Images per second, JPEG bytes to vectors, end to end: vecpool against transformers.

For each CLIP shape (random weights of the real sizes: ViT-B/16, ViT-L/14; or a small one for
the CPU), the same JPEG files (640x480 by default) are embedded
- by `vecpool.Engine.embed` from their bytes (decoding and preprocessing in vecpool's image
  reader, the vision tower in flat batches), and
- as sentence-transformers and a transformers user do it: batches of `--batch-size` (128)
  decoded with Pillow, preprocessed by the folder's `AutoImageProcessor` (the torchvision one
  where torchvision is installed, as transformers chooses), `get_image_features` in the same
  dtype,
rounds interleaved after a warm-up of each at full size. Beside them, the preprocessing alone
(decode + preprocess, no model) of each, and the cosine of the two systems' vectors (their
preprocessing differs: the Pillow and torchvision resizes round differently).

ColQwen2 (`--models colqwen2`: random weights of vidore/colqwen2-v1.0's shape, Qwen2-VL-2B
with a 128-wide projection; `colqwen2-tiny` for a CPU smoke run) measures pages and queries:
the same JPEG pages to every token's vector by `Engine.encode(task="token_embed")`, and by a
transformers user (`ColQwen2Processor.process_images` on batches of `--vlm-batch-size`
Pillow-decoded pages, `ColQwen2ForRetrieval`, the padding rows left out); then text queries
(`process_queries`) likewise; pages/s and queries/s of each, interleaved rounds after a warm-up,
and the cosine of the two systems' token vectors.

    python benchmarks/bench_images.py --device cuda --models b16 l14 --output results/x.json
    python benchmarks/bench_images.py --device cuda --models colqwen2 --images 256 \
        --size 1024x768 --output results/colqwen2.json
"""

from __future__ import annotations

import argparse
import functools
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import record

import vecpool


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


# ColQwen2 on Qwen2-VL-2B (vidore/colqwen2-v1.0): the language model, the vision tower, the
# projection; its processor's pixel bounds (colpali-engine's max_pixels: 768 merged patches).
_QWEN2_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
COLQWEN2_SHAPES: dict[str, dict[str, Any]] = {
    "colqwen2": {
        "text": dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            rope_parameters={"type": "mrope", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        ),
        "vision": dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=1536),
        "patch": 14,
        "max_pixels": 768 * 28 * 28,
        "embedding_dim": 128,
    },
    "colqwen2-tiny": {  # a CPU smoke run
        "text": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=2048,
            rope_parameters={"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        ),
        "vision": dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64),
        "patch": 14,
        "max_pixels": 64 * 28 * 28,
        "embedding_dim": 32,
    },
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


def build_colqwen2_folder(shape: str, path: Path, dtype: torch.dtype) -> None:
    """A ColQwen2 folder of `shape` with random weights (in `dtype`), its processor (Qwen2-VL's
    image processor, the query and page layouts) and a word-level tokenizer."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    spec = COLQWEN2_SHAPES[shape]
    specials = _QWEN2_VL_SPECIALS
    words = [*specials, "<unk>", *QUERY_WORDS, "Query", ":", "Describe", "image", "."]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ids = {name: specials.index(f"<|{name}|>") for name in ("image_pad", "video_pad")}
    vlm = transformers.Qwen2VLConfig(
        text_config=dict(spec["text"], bos_token_id=0, eos_token_id=specials.index("<|im_end|>")),
        vision_config=dict(
            spec["vision"], patch_size=spec["patch"], spatial_merge_size=2, temporal_patch_size=2
        ),
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=specials.index("<|vision_start|>"),
        vision_end_token_id=specials.index("<|vision_end|>"),
    )
    config = transformers.ColQwen2Config(vlm_config=vlm, embedding_dim=spec["embedding_dim"])
    torch.manual_seed(0)
    model = transformers.ColQwen2ForRetrieval._from_config(config, dtype=dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    patch = spec["patch"]
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 4 * (2 * patch) ** 2, "longest_edge": spec["max_pixels"]},
    )
    transformers.ColQwen2Processor(image_processor=images, tokenizer=fast).save_pretrained(
        str(path)
    )


QUERY_WORDS = [f"w{i}" for i in range(1000)]


def queries(count: int, seed: int = 0) -> list[str]:
    """`count` text queries of 6 to 24 words."""
    gen = np.random.default_rng(seed)
    return [" ".join(gen.choice(QUERY_WORDS, size=int(gen.integers(6, 25)))) for _ in range(count)]


def jpegs(count: int, width: int, height: int) -> list[bytes]:
    """`count` different JPEG files: a gradient, shapes and noise, quality 90."""
    from PIL import Image

    gen = np.random.default_rng(0)
    out = []
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    for i in range(count):
        noise = gen.integers(0, 64, size=(height, width, 3))
        tint = np.array([i % 255, (3 * i) % 255, (7 * i) % 255])[None, None, :]
        pixels = np.clip(0.5 * ramp + 0.3 * tint + noise, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


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


class TransformersColQwen2:
    """What a transformers user runs: batches of Pillow-decoded pages through
    `ColQwen2Processor.process_images`, queries through `process_queries`, then
    `ColQwen2ForRetrieval`; each input's token vectors, its padding rows left out."""

    def __init__(self, folder: Path, device: str, dtype: torch.dtype, batch_size: int):
        import transformers

        self.model = (
            transformers.ColQwen2ForRetrieval.from_pretrained(str(folder), dtype=dtype)
            .to(device)
            .eval()
        )
        self.processor = transformers.ColQwen2Processor.from_pretrained(str(folder))
        self.device, self.batch_size = device, batch_size

    @torch.inference_mode()
    def _run(self, batch: Any) -> list[torch.Tensor]:
        batch = batch.to(self.device)
        out = self.model(**batch).embeddings
        mask = batch["attention_mask"].bool()
        return [out[i][mask[i]].float().cpu() for i in range(out.shape[0])]

    def pages(self, files: list[bytes]) -> list[torch.Tensor]:
        from PIL import Image

        out: list[torch.Tensor] = []
        for start in range(0, len(files), self.batch_size):
            chunk = files[start : start + self.batch_size]
            images = [Image.open(io.BytesIO(b)).convert("RGB") for b in chunk]
            out += self._run(self.processor.process_images(images))
        return out

    def queries(self, texts: list[str]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for start in range(0, len(texts), self.batch_size):
            out += self._run(self.processor.process_queries(texts[start : start + self.batch_size]))
        return out


def bench_colqwen2(shape: str, args: argparse.Namespace, files: list[bytes]) -> dict[str, Any]:
    """Pages/s and queries/s of vecpool and transformers on one ColQwen2 folder (the module
    docstring says how)."""
    dtype = getattr(torch, args.dtype)
    texts = queries(args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / shape
        build_colqwen2_folder(shape, folder, dtype)
        engine = vecpool.Engine(folder, device=args.device, dtype=args.dtype)
        baseline = TransformersColQwen2(folder, args.device, dtype, args.vlm_batch_size)
        work: dict[str, list[Any]] = {"pages": files, "queries": texts}
        systems: dict[str, Callable[[list[Any]], list[Any]]] = {
            "vecpool": lambda items: engine.encode(items, task="token_embed"),
            "transformers": lambda items: (
                baseline.pages(items) if items is files else baseline.queries(items)
            ),
        }
        # Warm both at full size, keeping the outputs to compare; then interleave.
        outputs: dict[tuple[str, str], list[Any]] = {
            (w, name): run(items) for w, items in work.items() for name, run in systems.items()
        }
        seconds: dict[str, dict[str, list[float]]] = {w: {n: [] for n in systems} for w in work}
        for _ in range(args.rounds):
            for w, items in work.items():
                for name, run in systems.items():
                    seconds[w][name].append(timed(functools.partial(run, items))[0])
        result: dict[str, Any] = {
            "shape": shape,
            "num_pages": len(files),
            "num_queries": len(texts),
        }
        line = [shape]
        for w, items in work.items():
            n = len(items)
            rates = {name: [n / s for s in seconds[w][name]] for name in systems}
            ratio = [
                a / b
                for a, b in zip(seconds[w]["transformers"], seconds[w]["vecpool"], strict=True)
            ]
            ours = [np.asarray(v, dtype=np.float32) for v in outputs[(w, "vecpool")]]
            theirs = [np.asarray(v, dtype=np.float32) for v in outputs[(w, "transformers")]]
            if any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
                raise AssertionError(f"{shape} {w}: vecpool and transformers give other row counts")
            cos = np.concatenate([np.sum(a * b, axis=1) for a, b in zip(ours, theirs, strict=True)])
            result[w] = {
                "per_s": {name: record.rounds(r) for name, r in rates.items()},
                "seconds": seconds[w],
                "ratio_median": statistics.median(ratio),
                "vectors": int(sum(a.shape[0] for a in ours)),
                "cosine_to_transformers": {
                    "min": float(cos.min()),
                    "median": float(np.median(cos)),
                },
            }
            line.append(
                f"{w}: vecpool {statistics.median(rates['vecpool']):,.1f}/s, transformers "
                f"{statistics.median(rates['transformers']):,.1f}/s "
                f"({statistics.median(ratio):.2f}x), token cosine min {cos.min():.5f}"
            )
        print("; ".join(line), flush=True)
        return result


def timed(fn: Any) -> tuple[float, Any]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, value


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument(
        "--models", nargs="+", default=["b16", "l14"], choices=sorted({*SHAPES, *COLQWEN2_SHAPES})
    )
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", default="640x480", help="WIDTHxHEIGHT of the JPEG files")
    parser.add_argument("--batch-size", type=int, default=128, help="the baseline's batches")
    parser.add_argument(
        "--vlm-batch-size", type=int, default=16, help="the ColQwen2 baseline's batches"
    )
    parser.add_argument("--queries", type=int, default=1024, help="ColQwen2's text queries")
    parser.add_argument("--rounds", type=int, default=record.MIN_ROUNDS)
    parser.add_argument("--output", type=Path)
    record.add_args(parser)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    width, height = (int(v) for v in args.size.split("x"))
    files = jpegs(args.images, width, height)
    report = {
        **record.header(
            "bench_images.py",
            sys.argv if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        "dtype": args.dtype,
        "jpeg_size": args.size,
        "baseline_batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "results": [],
    }
    for shape in args.models:  # one shape's engine and model are gone before the next
        bench = bench_colqwen2 if shape in COLQWEN2_SHAPES else bench_shape
        report["results"].append(bench(shape, args, files))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.output is not None:
        record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
