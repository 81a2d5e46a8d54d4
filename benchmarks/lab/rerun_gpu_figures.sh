#!/usr/bin/env bash
# Re-measures, on one H200, the GPU figures of README.md and docs/SERVING.md whose results files
# do not say how they were taken (no command, versions or commit of their own): about 6 to 8
# minutes of wall time. From the repository root:
#
#     COMMIT=$(git rev-parse HEAD) TOKENIZER=DIR bash benchmarks/lab/rerun_gpu_figures.sh
#
# COMMIT: the commit measured (a copy of the tree may carry a stale .git); TOKENIZER: a folder
# with the all-MiniLM-L6-v2 tokenizer files (tokenizer.json, tokenizer_config.json, vocab.txt,
# special_tokens_map.json), needed where the packaged model is not installed; OUT: where the
# results go (default benchmarks/results); PYTHON: the interpreter (default python).
# SMOKE=1 runs the same steps tiny, on the CPU where CUDA is needed for nothing (a check of the
# script itself, in a minute).
#
# 1. cuda_graphs_small_calls_h200.json: one-query and 32-query `embed` with and without CUDA
#    graphs, Qwen3-0.6B and MiniLM shapes (README "Engine options", docs/SERVING.md), ~2 min.
# 2. online_qwen3-0.6b_h200.json: the online table of README.md and docs/SERVING.md on today's
#    tree and defaults: one query per request from 64 and 256 raw clients, and 32 clients of
#    32 passages, 3 rounds each between offline runs, ~4 min.
# Left out: bench_gpu.py's table and the FP8, GQA, prefix and batch-invariance figures (their
# files record their command and commit; bench_gpu alone takes far longer than 8 minutes);
# bench_embed.py's table (three models, ~4 minutes more, and bench_gpu's `st-128` column makes
# the same comparison); the online rows of earlier layouts (history: they describe trees that
# are gone); the one-process baseline (the issue's, of a tree that is gone).
set -uo pipefail

OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
tok=()
if [ -n "${TOKENIZER:-}" ]; then tok=(--tokenizer "$TOKENIZER"); fi
status=0

# shellcheck source=benchmarks/lab/steps.sh
source "$(dirname "$0")/steps.sh"

if [ "${SMOKE:-0}" = 1 ]; then
    step online_smoke 300 "$PY" benchmarks/bench_online.py --synthetic tiny-bert --device cpu \
        --scenarios embed batched --clients 4 --batched-clients 2 --batched-inputs 64 --n 48 \
        --client raw --client-processes 1 "${tok[@]}" --commit "$COMMIT" \
        --output "$OUT/online_smoke.json"
    exit $status
fi

step cuda_graphs_small_calls_h200 180 "$PY" benchmarks/lab/cuda_graphs_check.py "${tok[@]}" \
    --commit "$COMMIT" --output "$OUT/cuda_graphs_small_calls_h200.json"
step online_qwen3-0.6b_h200 330 "$PY" benchmarks/bench_online.py --synthetic qwen3-0.6b \
    --device cuda --client raw --scenarios embed batched --clients 64 256 --repeats 3 \
    "${tok[@]}" --commit "$COMMIT" --output "$OUT/online_qwen3-0.6b_h200.json"
exit $status
