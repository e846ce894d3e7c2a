#!/usr/bin/env bash
# Run every calclip benchmark on one GPU. The kernel scripts' limits add up to 9 minutes (a normal run takes ~3-4),
# bench_speed.py's to 9 more: under a 10-minute command cap run SPEED=0 here and bench_speed.py on its own.
# Full output goes to stdout and, when $OUT is set, to $OUT/benchmarks.txt (plus one file per script).
#   bash benchmarks/run_all.sh            # full tables
#   QUICK=1 bash benchmarks/run_all.sh    # the target shapes only, bench_speed's layer+model sections only
#   SPEED=0 bash benchmarks/run_all.sh    # without bench_speed.py
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
QUICK_FLAG=${QUICK:+--quick}
SPEED_FLAGS=${QUICK:+--only layer,model}
OUT_DIR=${OUT:-}
ALL_LOG=/dev/null
[ -n "$OUT_DIR" ] && mkdir -p "$OUT_DIR" && ALL_LOG="$OUT_DIR/benchmarks.txt"

run() {  # run LIMIT_SECONDS SCRIPT [ARGS...]
    local limit=$1 script=$2
    shift 2
    local name
    name=$(basename "$script" .py)
    local log=/dev/null
    [ -n "$OUT_DIR" ] && log="$OUT_DIR/$name.txt"
    echo "### $script $* (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" python "$script" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    echo "### $name: exit $rc after $((SECONDS - start))s"
    echo
}

{
    echo "### calclip benchmarks, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader 2>/dev/null
    run 90 benchmarks/bench_quant.py $QUICK_FLAG
    run 150 benchmarks/bench_gemm.py $QUICK_FLAG
    run 120 benchmarks/bench_linear.py $QUICK_FLAG
    run 120 benchmarks/bench_wgrad.py $QUICK_FLAG
    run 60 benchmarks/bench_memory.py
    if [ "${SPEED:-1}" != 0 ]; then
        run 540 benchmarks/bench_speed.py $SPEED_FLAGS
    fi
} 2>&1 | tee "$ALL_LOG"
