#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, sixteenth session, "To run next"): issue 28.
# Start each step within 30 s of the previous one's end (the machine keeps /tmp, the wheels' install, only while warm;
# it goes back after 30 s idle). Steps 1-3 fit 30 device minutes with the ~1 min start.
# (The sixteenth session's own hold, its steps 1-6, is in git history: 0890eab's version of this file.)
#
#   step 1: carry .whl      (~8 min)  what the refresh's CUDA-graph replay buys at the 1.5B row (fp8c with it, the
#                                     FP8+ arm without: --fp8-options refresh_graph=false; fp8r by layer), then the
#                                     row's profile with its host side (the refresh cost 9.1 ms of CPU before it)
#   step 2: carry nothing   (~8 min)  FP8 eager vs torchao eager at the 7B row (not yet measured); the 7B profile
#   step 3: carry nothing   (~9 min)  the trainer at Qwen2.5-1.5B widths: FP8 eager vs compile_layers vs BF16, two
#                                     rounds (1.03x over whole cycles at h2048, sixteenth session)
# Usage on the device: bash benchmarks/h200_session.sh STEP
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export PYTHONPATH=/tmp/site

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
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    python3 -c "import trl, datasets, torchao; print('trl', trl.__version__, 'datasets', datasets.__version__, \
'torchao', torchao.__version__)"
    run 250 model_1.5b_refresh.log python benchmarks/bench_speed.py --only model --models qwen2.5-1.5b \
        --model-arms bf16c,fp8c,fp8xc,fp8r --fp8-options refresh_graph=false --repeats 3
    run 200 profile_1.5b.log python benchmarks/probes/profile_model_step.py --model qwen2.5-1.5b --arms bf16c,fp8c
    ;;
2)
    run 250 model_7b_torchao.log python benchmarks/bench_speed.py --only model --models qwen2.5-7b \
        --model-arms fp8,torchao --repeats 2
    run 200 profile_7b.log python benchmarks/probes/profile_model_step.py --model qwen2.5-7b --arms bf16c,fp8c
    ;;
3)
    run 520 trainer_1.5b.log python benchmarks/bench_speed.py --only trainer --trainer-model 8,1536,8960 \
        --trainer-runs fp8_eager,fp8_layers,bf16_eager --trainer-steps 4 --trainer-warmup 2 --run-rounds 2
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2|3"; exit 2 ;;
esac
