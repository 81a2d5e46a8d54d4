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
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.images_clip import SHAPES, bench_shape
from benchmarks.images_common import jpegs
from benchmarks.images_vlm import COLQWEN2_SHAPES, GME_SHAPES, bench_vlm


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
            sys.argv[1:] if argv is None else argv,
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
