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

GME (`--models gme`: random weights of Alibaba-NLP/gme-Qwen2-VL-2B-Instruct's shape, Qwen2-VL-2B
in a sentence-transformers folder whose pooling is the last token, then normalised, as GME's;
`gme-tiny` for a CPU smoke run) measures the same two works, one vector per input: each page is
an image in GME's prompt (the default instruction as the system message), each query a text in
GME's prompt with its text-to-image instruction, written as GME's reference writes them
(`gme_prompt`). vecpool embeds them by `Engine.embed` (`{"prompt": ..., "image": bytes}` for a
page); the transformers side runs GME's reference: batches of `--vlm-batch-size`, written as
`Qwen2VLProcessor` writes them, through `Qwen2VLModel`, the last row of the final norm,
normalised. The rounds, rates and cosines are ColQwen2's (`compare_rounds`).

    python benchmarks/bench_images.py --device cuda --models b16 l14 --output results/x.json
    python benchmarks/bench_images.py --device cuda --models colqwen2 --images 256 \
        --size 1024x768 --output results/colqwen2.json
    python benchmarks/bench_images.py --device cuda --models gme --images 64 --queries 512 \
        --size 1024x768 --output results/gme.json
"""

from __future__ import annotations

import argparse
import functools
import io
import json
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


# Qwen2-VL-2B's language model and vision tower, and a tiny pair of the same layout for the CPU.
_QWEN2_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
_QWEN2_VL_2B: dict[str, Any] = {
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
}
_QWEN2_VL_TINY: dict[str, Any] = {
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
}
# ColQwen2 on Qwen2-VL-2B (vidore/colqwen2-v1.0): the projection, and its processor's pixel
# bounds (colpali-engine's max_pixels: 768 merged patches).
COLQWEN2_SHAPES: dict[str, dict[str, Any]] = {
    "colqwen2": {
        **_QWEN2_VL_2B,
        "min_pixels": 4 * 28 * 28,
        "max_pixels": 768 * 28 * 28,
        "embedding_dim": 128,
    },
    "colqwen2-tiny": {  # a CPU smoke run
        **_QWEN2_VL_TINY,
        "min_pixels": 4 * 28 * 28,
        "max_pixels": 64 * 28 * 28,
        "embedding_dim": 32,
    },
}
# GME on Qwen2-VL-2B (Alibaba-NLP/gme-Qwen2-VL-2B-Instruct): the base model's last row, its
# reference's pixel bounds (min_image_tokens=256, max_image_tokens=1280 merged patches).
GME_SHAPES: dict[str, dict[str, Any]] = {
    "gme": {**_QWEN2_VL_2B, "min_pixels": 256 * 28 * 28, "max_pixels": 1280 * 28 * 28},
    "gme-tiny": {  # a CPU smoke run
        **_QWEN2_VL_TINY,
        "min_pixels": 4 * 28 * 28,
        "max_pixels": 64 * 28 * 28,
    },
}
# GME's reference (gme_inference.py): every input one user message after a system message (the
# default instruction, or a query's task), the generation prompt and `<|endoftext|>` after it.
GME_DEFAULT_INSTRUCTION = "You are a helpful assistant."
GME_QUERY_INSTRUCTION = "Find an image that matches the given text."
_IMAGE_PAD = "<|image_pad|>"
_IMAGE_TEXT = f"<|vision_start|>{_IMAGE_PAD}<|vision_end|>"


def gme_prompt(content: str, instruction: str = GME_DEFAULT_INSTRUCTION) -> str:
    """GME's prompt for one input (`content`: the image's placeholder and/or the text)."""
    return (
        f"<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n"
        "<|im_start|>assistant\n<|endoftext|>"
    )


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


def _qwen2_vl_parts(spec: dict[str, Any], words: list[str]) -> tuple[Any, Any, Any]:
    """The Qwen2-VL config of `spec`, a word-level tokenizer of Qwen2-VL's special tokens and
    `words`, and Qwen2-VL's image processor within `spec`'s pixel bounds."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = _QWEN2_VL_SPECIALS
    words = [*specials, "<unk>", *words]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = transformers.Qwen2VLConfig(
        text_config=dict(spec["text"], bos_token_id=0, eos_token_id=specials.index("<|im_end|>")),
        vision_config=dict(
            spec["vision"], patch_size=spec["patch"], spatial_merge_size=2, temporal_patch_size=2
        ),
        image_token_id=specials.index("<|image_pad|>"),
        video_token_id=specials.index("<|video_pad|>"),
        vision_start_token_id=specials.index("<|vision_start|>"),
        vision_end_token_id=specials.index("<|vision_end|>"),
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=spec["patch"],
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": spec["min_pixels"], "longest_edge": spec["max_pixels"]},
    )
    return config, fast, images


def build_colqwen2_folder(shape: str, path: Path, dtype: torch.dtype) -> None:
    """A ColQwen2 folder of `shape` with random weights (in `dtype`), its processor (Qwen2-VL's
    image processor, the query and page layouts) and a word-level tokenizer."""
    import transformers

    spec = COLQWEN2_SHAPES[shape]
    vlm, tokenizer, images = _qwen2_vl_parts(
        spec, [*QUERY_WORDS, "Query", ":", "Describe", "image", "."]
    )
    config = transformers.ColQwen2Config(vlm_config=vlm, embedding_dim=spec["embedding_dim"])
    torch.manual_seed(0)
    model = transformers.ColQwen2ForRetrieval._from_config(config, dtype=dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    transformers.ColQwen2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(
        str(path)
    )


def build_gme_folder(shape: str, path: Path, dtype: torch.dtype) -> None:
    """A GME folder of `shape`: `Qwen2VLForConditionalGeneration` with random weights (in
    `dtype`), Qwen2-VL's image processor, a word-level tokenizer, and the sentence-transformers
    modules GME ships: the model, last-token pooling, normalisation."""
    import transformers

    instructions = f"{GME_DEFAULT_INSTRUCTION} {GME_QUERY_INSTRUCTION}".replace(".", " .")
    words = ["system", "user", "assistant", *dict.fromkeys(instructions.split()), *QUERY_WORDS]
    config, tokenizer, images = _qwen2_vl_parts(GME_SHAPES[shape], words)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    model.save_pretrained(str(path), safe_serialization=True)
    images.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    modules = [
        ("Transformer", ""),
        ("Pooling", "1_Pooling"),
        ("Normalize", "2_Normalize"),
    ]
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (t, p) in enumerate(modules)
            ]
        )
    )
    for _, sub in modules[1:]:
        (path / sub).mkdir()
    width = config.text_config.hidden_size
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": width, "pooling_mode_lasttoken": True})
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


class TransformersGME:
    """GME's reference (gme_inference.py) on transformers: batches of GME's prompts, pages
    Pillow-decoded, written as `Qwen2VLProcessor` writes them (the folder's image processor, each
    placeholder grown to its image's count of merged patches, the tokenizer padding on the
    right), then the base model `Qwen2VLModel`; each input's last row of the final norm,
    normalised. (The processor class itself wants a video processor, which needs torchvision.)"""

    def __init__(self, folder: Path, device: str, dtype: torch.dtype, batch_size: int):
        import transformers

        model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
            str(folder), dtype=dtype
        )
        self.model = model.model.to(device).eval()
        self.image_token_id = model.config.image_token_id
        self.images = transformers.AutoImageProcessor.from_pretrained(str(folder))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        self.tokenizer.padding_side = "right"
        self.device, self.batch_size = device, batch_size

    def _inputs(self, texts: list[str], images: list[Any] | None) -> dict[str, torch.Tensor]:
        vision: dict[str, torch.Tensor] = {}
        if images is not None:
            vision = dict(self.images(images=images, return_tensors="pt"))
            counts = (vision["image_grid_thw"].prod(-1) // self.images.merge_size**2).tolist()
            grown = []
            for text in texts:  # each placeholder, in order, grown to its image's count
                pieces = text.split(_IMAGE_PAD)
                grown.append(
                    pieces[0] + "".join(_IMAGE_PAD * counts.pop(0) + p for p in pieces[1:])
                )
            texts = grown
        tokens = dict(self.tokenizer(texts, padding=True, return_tensors="pt"))
        tokens["mm_token_type_ids"] = (tokens["input_ids"] == self.image_token_id).int()
        return {k: v.to(self.device) for k, v in (tokens | vision).items()}

    @torch.inference_mode()
    def _run(self, texts: list[str], images: list[Any] | None) -> list[torch.Tensor]:
        batch = self._inputs(texts, images)
        hidden = self.model(**batch).last_hidden_state  # [batch, seq, hidden]
        last = batch["attention_mask"].sum(dim=1) - 1
        rows = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return list(torch.nn.functional.normalize(rows.float(), dim=-1).cpu())

    def pages(self, files: list[bytes]) -> list[torch.Tensor]:
        from PIL import Image

        out: list[torch.Tensor] = []
        for start in range(0, len(files), self.batch_size):
            chunk = files[start : start + self.batch_size]
            images = [Image.open(io.BytesIO(b)).convert("RGB") for b in chunk]
            out += self._run([gme_prompt(_IMAGE_TEXT)] * len(chunk), images)
        return out

    def queries(self, texts: list[str]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start : start + self.batch_size]
            out += self._run([gme_prompt(t, GME_QUERY_INSTRUCTION) for t in chunk], None)
        return out


def bench_vlm(shape: str, args: argparse.Namespace, files: list[bytes]) -> dict[str, Any]:
    """Pages/s and queries/s of vecpool and transformers on one ColQwen2 or GME folder (the
    module docstring says how)."""
    dtype = getattr(torch, args.dtype)
    texts = queries(args.queries)
    work: dict[str, list[Any]] = {"pages": files, "queries": texts}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / shape
        baseline: TransformersColQwen2 | TransformersGME
        if shape in GME_SHAPES:
            build_gme_folder(shape, folder, dtype)
            baseline = TransformersGME(folder, args.device, dtype, args.vlm_batch_size)
            engine = vecpool.Engine(folder, device=args.device, dtype=args.dtype)
            # GME's prompts, written as its reference writes them, each page's image for its
            # placeholder.
            ours: dict[str, list[Any]] = {
                "pages": [{"prompt": gme_prompt(_IMAGE_TEXT), "image": f} for f in files],
                "queries": [gme_prompt(t, GME_QUERY_INSTRUCTION) for t in texts],
            }
            vecpool_run: Callable[[list[Any]], Any] = engine.embed
        else:
            build_colqwen2_folder(shape, folder, dtype)
            baseline = TransformersColQwen2(folder, args.device, dtype, args.vlm_batch_size)
            engine = vecpool.Engine(folder, device=args.device, dtype=args.dtype)
            ours = work
            vecpool_run = functools.partial(engine.encode, task="token_embed")
        runs: dict[str, dict[str, Callable[[], Any]]] = {
            w: {
                "vecpool": functools.partial(vecpool_run, ours[w]),
                "transformers": functools.partial(getattr(baseline, w), items),
            }
            for w, items in work.items()
        }
        result = {"shape": shape, "num_pages": len(files), "num_queries": len(texts)}
        return result | compare_rounds(shape, runs, {w: len(v) for w, v in work.items()}, args)


def compare_rounds(
    shape: str,
    runs: dict[str, dict[str, Callable[[], Any]]],
    counts: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Each work's (`runs[work][system]`) inputs per second by each system, in interleaved
    rounds after a full-size warm-up, and the cosine of the two systems' vectors (each output one
    unit vector per input, or a `[rows, dim]` array of them)."""
    # Warm both at full size, keeping the outputs to compare; then interleave.
    outputs = {(w, name): run() for w, systems in runs.items() for name, run in systems.items()}
    seconds: dict[str, dict[str, list[float]]] = {
        w: {name: [] for name in systems} for w, systems in runs.items()
    }
    for _ in range(args.rounds):
        for w, systems in runs.items():
            for name, run in systems.items():
                seconds[w][name].append(timed(run)[0])
    result: dict[str, Any] = {}
    line = [shape]
    for w, systems in runs.items():
        n = counts[w]
        rates = {name: [n / s for s in seconds[w][name]] for name in systems}
        ratio = [
            a / b for a, b in zip(seconds[w]["transformers"], seconds[w]["vecpool"], strict=True)
        ]
        ours = [np.atleast_2d(np.asarray(v, dtype=np.float32)) for v in outputs[(w, "vecpool")]]
        theirs = [np.atleast_2d(np.asarray(v, np.float32)) for v in outputs[(w, "transformers")]]
        if len(ours) != n or any(a.shape != b.shape for a, b in zip(ours, theirs, strict=True)):
            raise AssertionError(f"{shape} {w}: vecpool and transformers give other row counts")
        cos = np.concatenate([np.sum(a * b, axis=1) for a, b in zip(ours, theirs, strict=True)])
        result[w] = {
            "per_s": {name: record.rounds(r) for name, r in rates.items()},
            "seconds": seconds[w],
            "ratio_median": statistics.median(ratio),
            "vectors": int(sum(a.shape[0] for a in ours)),
            "cosine_to_transformers": {"min": float(cos.min()), "median": float(np.median(cos))},
        }
        line.append(
            f"{w}: vecpool {statistics.median(rates['vecpool']):,.1f}/s, transformers "
            f"{statistics.median(rates['transformers']):,.1f}/s "
            f"({statistics.median(ratio):.2f}x), cosine min {cos.min():.5f}"
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
        "--models",
        nargs="+",
        default=["b16", "l14"],
        choices=sorted({*SHAPES, *COLQWEN2_SHAPES, *GME_SHAPES}),
    )
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", default="640x480", help="WIDTHxHEIGHT of the JPEG files")
    parser.add_argument("--batch-size", type=int, default=128, help="the baseline's batches")
    parser.add_argument(
        "--vlm-batch-size", type=int, default=16, help="the ColQwen2 and GME baselines' batches"
    )
    parser.add_argument(
        "--queries", type=int, default=1024, help="ColQwen2's and GME's text queries"
    )
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
        "vlm_baseline_batch_size": args.vlm_batch_size,
        "threads": torch.get_num_threads(),
        "results": [],
    }
    for shape in args.models:  # one shape's engine and model are gone before the next
        bench = bench_vlm if shape in {*COLQWEN2_SHAPES, *GME_SHAPES} else bench_shape
        report["results"].append(bench(shape, args, files))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.output is not None:
        record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
