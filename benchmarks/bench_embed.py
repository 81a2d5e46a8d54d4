"""Throughput of `Engine.embed` against sentence-transformers, in one process, on the same data.

    python benchmarks/bench_embed.py [--model DIR] [--synthetic KIND] [--device cuda] [--n 20000]

Both sides embed the same texts on the same device and dtype; each is run `--repeats` times
after a warm-up, and the report gives the median inputs/s of each, their ratio, the raw
timings, and the largest difference between the two sides' vectors. `--synthetic` builds a
BERT-base or Qwen3-0.6B shaped sentence-transformers folder with random weights and the
default model's tokenizer, to measure models where the GPU has real work to do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vecpool
from benchmarks import record
from vecpool.api import default_model_path
from vecpool.cli.bench import make_texts

SYNTHETIC = ("bert-base", "qwen3-0.6b")


def make_synthetic_folder(kind: str, dest: Path, tokenizer_from: Path) -> Path:
    """A sentence-transformers folder of a real model's shape with random weights and the
    tokenizer of `tokenizer_from`: "bert-base" (mean pooling) or "qwen3-0.6b" (last token,
    bfloat16, the tokenizer's vocabulary)."""
    import transformers

    torch.manual_seed(0)
    if kind == "bert-base":
        cfg: Any = transformers.BertConfig(
            hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
        )
        model: Any = transformers.BertModel(cfg)
        pooling = {"pooling_mode_mean_tokens": True}
    else:
        cfg = transformers.Qwen3Config(
            vocab_size=30522,
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        )
        model = transformers.Qwen3Model(cfg).to(torch.bfloat16)
        pooling = {"pooling_mode_lasttoken": True}
    model.save_pretrained(str(dest), safe_serialization=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
    ):
        shutil.copy(tokenizer_from / name, dest / name)
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": cfg.hidden_size, **pooling})
    )
    return dest


def timed(fn: Any, repeats: int, sync: bool) -> tuple[list[float], Any]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument(
        "--synthetic", choices=SYNTHETIC, help="a random model of this shape, --model's tokenizer"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 on CPU")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=record.MIN_ROUNDS, help="timed rounds")
    parser.add_argument("--st-batch-size", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--output", type=Path, default=None, help="write the raw report as JSON")
    record.add_args(parser)
    args = parser.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    tmp = None
    if args.synthetic:
        tmp = tempfile.mkdtemp()
        model_dir = make_synthetic_folder(
            args.synthetic, Path(tmp), args.model or default_model_path()
        )
    else:
        model_dir = args.model or default_model_path()
    dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
        dtype
    ]
    texts = make_texts(args.n)
    sync = args.device.startswith("cuda")

    engine = vecpool.Engine(
        model_dir,
        device=args.device,
        dtype=dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    st = SentenceTransformer(str(model_dir), device=args.device)
    st.to(torch_dtype)
    num_tokens = sum(len(engine.tokenize(t, prompt="")) for t in texts[: min(len(texts), 2000)])
    num_tokens = int(num_tokens * len(texts) / min(len(texts), 2000))

    ours_t, ours = timed(
        lambda: engine.embed(texts, truncate_prompt_tokens=-1, show_progress=False),
        args.repeats,
        sync,
    )
    ref_t, ref = timed(
        lambda: st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True),
        args.repeats,
        sync,
    )
    ours_med, ref_med = statistics.median(ours_t), statistics.median(ref_t)
    cos = np.sum(ours * ref, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    report = {
        **record.header("bench_embed.py", argv, device=args.device, commit=args.commit),
        "model": f"{args.synthetic} (random weights)"
        if args.synthetic
        else engine.folder.hf_config.get("_name_or_path", str(model_dir)),
        "dtype": dtype,
        "num_inputs": len(texts),
        "approx_tokens": num_tokens,
        "vecpool_seconds": ours_t,
        "sentence_transformers_seconds": ref_t,
        "vecpool_inputs_per_s_median": len(texts) / ours_med,
        "sentence_transformers_inputs_per_s_median": len(texts) / ref_med,
        "speedup_median": ref_med / ours_med,
        "max_abs_diff": float(np.abs(ours - ref).max()),
        "min_cosine": float(cos.min()),
    }
    print(json.dumps(report, indent=2))
    record.write(args.output, report)
    if tmp:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main(sys.argv[1:])
