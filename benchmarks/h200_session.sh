#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, seventeenth session, "To run next"): issue 28's
# follow-ups. Start each step within 30 s of the previous one's end (the machine keeps /tmp, the wheels' install, only
# while warm; it goes back after 30 s idle). Steps 1-2 fit 30 device minutes with the ~1 min start.
# (The seventeenth session's own holds are in git history: 1d6ba1b's version of this file.)
#
#   step 1: carry .whl      (~10 min) FP8 eager with the shared input vs torchao eager at 7B/8B (0.97x before it;
#                                     FP8+ = without it), then the kernel and layer GPU suites in full (test_triton.py
#                                     last ran whole on abe27e9)
#   step 2: carry nothing   (~9 min)  the trainer at Qwen2.5-1.5B widths with BF16 compiled by layer as well: is the
#                                     FP8 trainer's 0.83x of BF16 eager the batch size or the compile?
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
    run 300 model_7b_8b_eager.log python benchmarks/bench_speed.py --only model --models qwen2.5-7b,llama3-8b \
        --model-arms fp8,fp8x,torchao --fp8-options share_sibling_inputs=false --repeats 2
    run 240 gpu_kernels.log python -m pytest -q -p no:cacheprovider -rf tests/fp8/test_triton.py \
        tests/fp8/test_gpu_linear.py
    ;;
2)
    run 520 trainer_1.5b_layers.log python benchmarks/bench_speed.py --only trainer --trainer-model 8,1536,8960 \
        --trainer-runs bf16_layers,fp8_layers,bf16_eager --trainer-steps 4 --trainer-warmup 2 --run-rounds 2
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2"; exit 2 ;;
esac
