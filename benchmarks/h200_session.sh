#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, seventeenth session): issue 28, what the
# shared sibling input (Fp8Config.share_sibling_inputs, calclip.fp8.shared_input) buys.
# Start each step within 30 s of the previous one's end (the machine keeps /tmp only while warm; it goes back after
# 30 s idle). Steps 1-2 fit ~20 device minutes with the ~1 min start.
# (The seventeenth session's first hold, its steps 1-2, and the sixteenth's are in git history.)
#
#   step 1: carry nothing   (~9 min)  GPU tests of the shared input (Triton counting launch for several linears,
#                                     Inductor), then the 1.5B row with it (fp8r) and without (FP8+ by layer)
#   step 2: carry nothing   (~8 min)  the 7B and 8B rows with and without it (compiled whole), then the 1.5B profile
# Usage on the device: bash benchmarks/h200_session.sh STEP
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

run() {  # run LIMIT_S LOG CMD...: the command under a time limit, its whole output in $OUT/LOG, the tail on stdout
    local limit=$1 log=$2
    shift 2
    echo "== $* (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$log" 2>&1
    echo "== rc=$? -> $log"
    grep -v "Autotuning kernel\|Warning\|warnings.warn" "$OUT/$log" | tail -n 40
}

case "${1:-}" in
1)
    run 120 gpu_tests.log python -m pytest -q -p no:cacheprovider tests/fp8/test_gpu_shared_input.py
    run 120 gpu_counts.log python -m pytest -q -p no:cacheprovider tests/fp8/test_triton.py -k counts
    run 300 model_1.5b_shared.log python benchmarks/bench_speed.py --only model --models qwen2.5-1.5b \
        --model-arms bf16c,fp8r,fp8xr --fp8-options share_sibling_inputs=false --repeats 3
    ;;
2)
    run 300 model_7b_8b_shared.log python benchmarks/bench_speed.py --only model --models qwen2.5-7b,llama3-8b \
        --model-arms bf16c,fp8c,fp8xc --fp8-options share_sibling_inputs=false --repeats 2
    run 180 profile_1.5b_shared.log python benchmarks/probes/profile_model_step.py --model qwen2.5-1.5b \
        --arms bf16c,fp8c
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2"; exit 2 ;;
esac
