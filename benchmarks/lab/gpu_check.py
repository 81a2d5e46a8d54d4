"""Correctness on CUDA: the FlashAttention varlen path and the padded fallback against
Hugging Face transformers, prompt embeds ≡ token ids, and batch invariance, per architecture.

    python benchmarks/lab/gpu_check.py [--output report.json]

CI has no GPU; this is the check to run on one. Each architecture is built with random weights
at a realistic head size (64), run by transformers in float32 as the ground truth, and by
vecpool in float32 (padded fallback) and in half precision (varlen kernel, except where
soft-capping needs the fallback). The half-precision error is judged against transformers' own
error in the same dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vecpool
from benchmarks import record
from tests.helpers import engine_hidden, random_prompts, save_hf_model

LENGTHS = [1, 3, 9, 17, 30, 100, 257, 64]
SIZE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)


def _encoders() -> list[tuple[str, Any]]:
    """Every encoder family transformers defines, at `SIZE` (head size 64), 3 layers."""
    t = transformers
    enc = dict(vocab_size=101, num_hidden_layers=3, max_position_embeddings=512, **SIZE)
    configs: dict[str, tuple[Any, Any]] = {
        "bert": (t.BertModel, t.BertConfig(**enc)),
        "mpnet": (t.MPNetModel, t.MPNetConfig(**enc)),
        "distilbert": (
            t.DistilBertModel,
            t.DistilBertConfig(vocab_size=101, dim=256, hidden_dim=512, n_heads=4, n_layers=3),
        ),
        "albert": (
            t.AlbertModel,
            t.AlbertConfig(**enc, embedding_size=128, num_hidden_groups=1),
        ),
        "electra": (t.ElectraModel, t.ElectraConfig(**enc, embedding_size=128)),
        "t5-encoder": (
            t.T5EncoderModel,
            t.T5Config(vocab_size=101, d_model=256, d_kv=64, d_ff=512, num_heads=4, num_layers=3),
        ),
        "deberta-v2": (
            t.DebertaV2Model,
            t.DebertaV2Config(
                **enc,
                relative_attention=True,
                position_buckets=64,
                pos_att_type=["p2c", "c2p"],
                position_biased_input=False,
                norm_rel_ebd="layer_norm",
                share_att_key=True,
            ),
        ),
        "modernbert": (
            t.ModernBertModel,
            t.ModernBertConfig(
                **enc,
                global_attn_every_n_layers=2,
                local_attention=64,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                cls_token_id=1,
                sep_token_id=2,
            ),
        ),
    }
    return [(name, lambda m=m, c=c: m(c)) for name, (m, c) in configs.items()]


def _models() -> list[tuple[str, Any]]:
    from tests.models.test_decoders import ARCHS

    out: list[tuple[str, Any]] = _encoders()
    for arch in ARCHS:
        extra = dict(SIZE, num_key_value_heads=2, max_position_embeddings=512)
        if "head_dim" in arch.options:
            extra["head_dim"] = 64
        out.append((arch.name, lambda arch=arch, extra=extra: arch.hf_model(**extra)))
    return out


@torch.no_grad()
def _hf_hidden(hf: Any, prompts: list[list[int]], device: str) -> list[np.ndarray]:
    out = []
    for p in prompts:
        res = hf(input_ids=torch.tensor([p], device=device), output_hidden_states=True)
        h = getattr(res, "last_hidden_state", None)
        out.append((h if h is not None else res.hidden_states[-1])[0].float().cpu().numpy())
    return out


def _row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return np.sum(a64 * b64, axis=1) / np.maximum(norms, 1e-30)


def _rel(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b, strict=True))


def check(
    name: str,
    build: Any,
    half: torch.dtype,
    tmp: Path,
    device: str = "cuda",
    compile: bool = False,
) -> dict[str, Any]:
    torch.manual_seed(0)
    hf = build().eval()
    folder = save_hf_model(hf, tmp / name)
    prompts = random_prompts(101, LENGTHS, seed=1)
    hf = hf.to(device)
    truth = _hf_hidden(hf, prompts, device)
    hf_half = _hf_hidden(hf.to(half), prompts, device)
    row: dict[str, Any] = {"arch": name, "half": str(half).removeprefix("torch.")}
    for label, dtype in (("fp32", torch.float32), ("half", half)):
        engine = vecpool.Engine(folder, device=device, dtype=dtype)
        ours = engine_hidden(engine, prompts)
        row[f"{label}_varlen"] = engine.model_runner.use_varlen
        row[f"{label}_rel_err_vs_hf_fp32"] = _rel(ours, truth)
        embeds = engine_hidden(engine, [{"prompt_embeds": engine.embed_tokens(p)} for p in prompts])
        mixed = engine_hidden(
            engine,
            [
                p if i % 2 else {"prompt_embeds": engine.embed_tokens(p)}
                for i, p in enumerate(prompts)
            ],
        )
        row[f"{label}_embeds_vs_ids_max_abs"] = max(
            float(np.abs(a - b).max()) for a, b in zip(ours, embeds, strict=True)
        )
        row[f"{label}_mixed_vs_ids_max_abs"] = max(
            float(np.abs(a - b).max()) for a, b in zip(ours, mixed, strict=True)
        )
        alone = [engine_hidden(engine, [p])[0] for p in prompts]
        row[f"{label}_alone_vs_batch_max_abs"] = max(
            float(np.abs(a - b).max()) for a, b in zip(ours, alone, strict=True)
        )
    row["hf_half_rel_err_vs_hf_fp32"] = _rel(hf_half, truth)
    # Replayed from CUDA graphs (and compiled, with --compile) where the family's attention
    # allows; a family whose attention needs the padded path turns graphs off by itself.
    fast = vecpool.Engine(folder, device=device, dtype=half, compile=compile, cuda_graphs=True)
    fast_out = engine_hidden(fast, prompts)
    row["graphs_rel_err_vs_hf_fp32"] = _rel(fast_out, truth)
    small = engine_hidden(fast, prompts[:3])  # small steps: the ones graphs serve
    row["graphs_small_vs_batch_min_cosine"] = min(
        float(_row_cosines(a, b).min()) for a, b in zip(small, fast_out[:3], strict=True)
    )
    graphs = fast.model_runner.graphs
    row["graphs_enabled"] = bool(graphs is not None and graphs.enabled)
    row["graphs_replays"] = graphs.replays if graphs is not None else 0
    row["compiled"] = compile
    row["ok"] = bool(
        row["fp32_rel_err_vs_hf_fp32"] < 1e-4
        and row["half_rel_err_vs_hf_fp32"] < 2 * row["hf_half_rel_err_vs_hf_fp32"] + 1e-3
        and row["fp32_embeds_vs_ids_max_abs"] == 0.0
        and row["half_embeds_vs_ids_max_abs"] == 0.0
        and row["graphs_rel_err_vs_hf_fp32"] < 2 * row["hf_half_rel_err_vs_hf_fp32"] + 1e-3
    )
    return row


def default_model_check(model_dir: Path | None, device: str = "cuda") -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    texts = [f"sentence number {i} about {'cats ' * (i % 7)}and dogs" for i in range(64)]
    folder = model_dir or vecpool.api.default_model_path()
    st = SentenceTransformer(str(folder), device=device).float()
    ref = st.encode(texts)
    row: dict[str, Any] = {"model": "default (all-MiniLM-L6-v2)"}
    for dtype in ("float32", "float16"):
        ours = vecpool.Engine(folder, device=device, dtype=dtype).embed(texts)
        row[f"{dtype}_max_abs_vs_st_fp32"] = float(np.abs(ours - ref).max())
        row[f"{dtype}_min_cosine_vs_st_fp32"] = float(np.min(np.sum(ours * ref, axis=1)))
    row["ok"] = (
        row["float32_max_abs_vs_st_fp32"] < 1e-5 and row["float16_min_cosine_vs_st_fp32"] > 0.999
    )
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", type=Path)
    parser.add_argument("--default-model", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script")
    parser.add_argument("--archs", nargs="*", help="only these architectures (default: all)")
    parser.add_argument("--compile", action="store_true", help="compile the graphed engine")
    parser.add_argument("--no-default-model", action="store_true", help="skip the MiniLM check")
    record.add_args(parser)
    args = parser.parse_args(argv)
    device = args.device
    report: dict[str, Any] = {
        **record.header("lab/gpu_check.py", argv, device=device, commit=args.commit),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in _models():
            if args.archs and name not in args.archs:
                continue
            # fp16 overflows in T5's unscaled attention and in Gemma's scaled embeddings.
            half = torch.float16 if name == "bert" else torch.bfloat16
            try:
                row = check(name, build, half, Path(tmp), device, args.compile)
            except Exception as exc:  # report and go on to the next architecture
                row = {"arch": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    if not args.no_default_model:
        try:
            row = default_model_check(args.default_model, device)
        except Exception as exc:
            row = {"model": "default", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)
        report["rows"].append(row)
    record.write(args.output, report)
    return 0 if all(r["ok"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
