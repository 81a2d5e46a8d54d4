#!/usr/bin/env bash
# The GPU measurements that README.md and docs/SERVING.md named as owed, in three groups of
# under ten minutes each (fp8 and host taken at 0d2e212; two waits for a host with two GPUs).
# From the repository root:
#
#     COMMIT=$(git rev-parse HEAD) TOKENIZER=DIR bash benchmarks/lab/pending_gpu_runs.sh GROUP...
#
# GROUP (in the order worth running):
#   fp8   one Hopper GPU, ~6 min: FP8's residual sums in the norms (`quant.SUM_IN_NORM`):
#         fp8_check.py --quick (the fused kernels compile, their sums carry torch's bits), the
#         A/B against the sums outside the norms, and where FP8 passages leave the device idle.
#         Keep SUM_IN_NORM only if the A/B is not slower.
#   host  one GPU, ~5 min: the collector's full passes with the engine's objects walked and
#         frozen (`api/heap.py`), and the first chunk of a large call at 128 and 512 inputs
#         (`running.PIPELINE_FIRST_CHUNK`).
#   two   two GPUs, ~8 min: engines on cuda:0 and cuda:1 in one process (graph capture on the
#         engine's own device since a57edfa), then serve and embed at one and two engines
#         (the issue's >= 1.9x; the balancing's stale-wait rule since 7d46f42).
#
# COMMIT: the commit measured (a copy of the tree may carry a stale .git); TOKENIZER: a folder
# with the all-MiniLM-L6-v2 tokenizer files, needed where the packaged model is not installed;
# OUT: where the results go (default benchmarks/results); PYTHON: the interpreter (default
# python). SMOKE=1 runs each step tiny on the CPU, leaving out those that need CUDA (a check
# of the script itself).
set -uo pipefail

OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
SMOKE=${SMOKE:-0}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
common=(--commit "$COMMIT")
if [ -n "${TOKENIZER:-}" ]; then common+=(--tokenizer "$TOKENIZER"); fi
status=0

# shellcheck source=benchmarks/lab/steps.sh
source "$(dirname "$0")/steps.sh"

# The model and device of a step: the real shapes on CUDA, a tiny one on the CPU with SMOKE=1.
if [ "$SMOKE" = 1 ]; then
    suffix=smoke decoder=tiny-qwen3 encoder=tiny-bert encoder2=tiny-bert dev=(--device cpu)
    few=(--n 8 --rounds 1) calls=(--calls 2)
else
    suffix=h200 decoder=qwen3-0.6b encoder=bert-base encoder2=minilm dev=()
    few=() calls=()
fi

fp8() {
    if [ "$SMOKE" = 1 ]; then
        echo "== fp8: needs CUDA, left out"
        return
    fi
    step "fp8_check_sum_in_norm_$suffix" 240 "$PY" benchmarks/lab/fp8_check.py --quick \
        "${common[@]}" --output "$OUT/fp8_check_sum_in_norm_$suffix.json"
    step "ab_sum_in_norm_fp8_${decoder}_$suffix" 240 "$PY" benchmarks/lab/ab_run_ahead.py \
        --models "$decoder" --quantization fp8 --against sum-outside-norm \
        --workloads queries passages --rounds 5 "${common[@]}" \
        --output "$OUT/ab_sum_in_norm_fp8_${decoder}_$suffix.json"
    step "phases_gaps_fp8_${decoder}_$suffix" 150 "$PY" benchmarks/lab/profile_phases.py \
        --models "$decoder" --quantization fp8 --gaps 12 "${common[@]}" \
        --output "$OUT/phases_gaps_fp8_${decoder}_$suffix.json"
}

host() {
    step "gc_stalls_$suffix" 200 "$PY" benchmarks/lab/gc_stalls.py \
        --models "$decoder" "$encoder" "$encoder2" "${dev[@]}" "${few[@]}" "${calls[@]}" \
        "${common[@]}" \
        --output "$OUT/gc_stalls_$suffix.json"
    step "ab_first_chunk_$suffix" 240 "$PY" benchmarks/lab/ab_host_threads.py \
        --models "$decoder" "$encoder" --vary first-chunk --values 128 512 \
        "${dev[@]}" "${few[@]}" "${common[@]}" --output "$OUT/ab_first_chunk_$suffix.json"
}

two() {
    if [ "$SMOKE" = 1 ]; then
        echo "== second_device_check: needs two CUDA devices, left out"
        step "dp_smoke" 300 "$PY" benchmarks/bench_data_parallel.py --synthetic tiny-bert \
            --device cpu --sizes 1 2 --passages 64 --clients 4 --repeats 1 \
            "${common[@]}" --output "$OUT/dp_smoke.json"
        return
    fi
    step second_device_check_h200x2 180 "$PY" benchmarks/lab/second_device_check.py \
        --commit "$COMMIT" --output "$OUT/second_device_check_h200x2.json"
    step "dp_${decoder}_h200x2" 390 "$PY" benchmarks/bench_data_parallel.py \
        --synthetic "$decoder" --device cuda --sizes 1 2 --passages 32768 "${common[@]}" \
        --output "$OUT/dp_${decoder}_h200x2.json"
}

if [ $# -eq 0 ]; then
    echo "usage: bash benchmarks/lab/pending_gpu_runs.sh fp8|host|two ..." >&2
    exit 2
fi
for group in "$@"; do  # every group checked before any runs
    case $group in
        fp8 | host | two) ;;
        *)
            echo "unknown group: $group (fp8, host or two)" >&2
            exit 2
            ;;
    esac
done
for group in "$@"; do
    "$group"
done
exit $status
