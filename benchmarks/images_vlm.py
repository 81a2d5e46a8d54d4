"""The vision-language part of `bench_images.py`: random-weight ColQwen2 and GME folders of
Qwen2-VL-2B's shape (and tiny ones for the CPU), what a transformers user runs on each
(`ColQwen2ForRetrieval`; GME's reference on `Qwen2VLModel`), and the interleaved rounds that
compare them with vecpool on pages and text queries (`compare_rounds`)."""

from __future__ import annotations

import argparse
import functools
import io
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vecpool
from benchmarks import record
from benchmarks.images_common import QUERY_WORDS, queries, timed

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
