# Sourced by the GPU run scripts (rerun_gpu_figures.sh, pending_gpu_runs.sh): `step NAME LIMIT
# COMMAND...` runs one benchmark under a time limit, its output shown (progress bars left out)
# and kept in $OUT/NAME.log; a step that fails or runs past its time sets `status=1` and leaves
# the others' results. SIGINT lets a benchmark stop the processes it started before it exits.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local started=$SECONDS
    if ! timeout --signal=INT --kill-after=30 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" |
        grep --line-buffered -v -e "it/s]" -e "s/it]"; then
        echo "== $name FAILED (see $OUT/$name.log)"
        status=1
    fi
    echo "== $name: $((SECONDS - started)) s"
}
