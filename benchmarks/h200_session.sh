#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, fifteenth session, "To run next"): each step
# stages what its call carried (benchmarks/h200_stage.sh) and then runs its measurements, every output teed in full
# to $OUT. Start each step within 30 s of the previous one's end (the machine keeps /tmp only while warm). Steps 1-6
# fit 30 device minutes with the ~2 min start; 8 only if time is left.
#
# Here first: python benchmarks/h200_pack.py --cut   (re-cuts .gguf/ and .vchunks/ to the checkout's size; the plan
#   must end with c02 + install.sh: five carrying calls; with fewer chunks move vinstall to the step of the last one)
#   step 1: carry .gguf/part00 .whl                         (~3 min)  the 1.5B row's profile with its host side
#                                                                     (FP8c waits ~3 ms a step on the host)
#   step 2: carry .gguf/part01 .gguf/init.py .vchunks/c0    (~4 min)  the 7B and 8B compiled rows after the
#                                                                     counting-quantizer change
#   step 3: carry .vchunks/c00                              (~5 min)  FP8 eager vs torchao eager at the 8B row
#   step 4: carry .vchunks/c01                              (~0.5 min) (carry only)
#   step 5: carry .vchunks/c02 .vchunks/install.sh          (~7 min)  vLLM install; GRPO step, FP8 and BF16 in turn,
#                                                                     two rounds of 6 steps (1.03x and 0.87x so far)
#   step 6: carry nothing                                   (~3 min)  where an FP8 decode step's time goes (batch 64)
#   step 7: carry nothing                                   (~6 min)  the kernels' GPU tests, whole, and every family's
#                                                                     layer (the counting launch changed, 8a5d5f4)
#   step 8: carry nothing, if time is left                  (~7 min)  the trainer with torch_compile, FP8
# Usage on the device: bash benchmarks/h200_session.sh STEP
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
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
    bash benchmarks/h200_stage.sh gguf1 2>&1 | tail -1
    run 200 profile_1.5b.log python benchmarks/probes/profile_model_step.py --model qwen2.5-1.5b --arms bf16c,fp8c
    ;;
2)
    bash benchmarks/h200_stage.sh gguf2 2>&1 | tail -1
    run 280 model_7b_8b.log python benchmarks/bench_speed.py --only model --models qwen2.5-7b,llama3-8b \
        --model-arms bf16c,fp8c --repeats 3
    ;;
3)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    run 330 model_8b_torchao.log python benchmarks/bench_speed.py --only model --models llama3-8b \
        --model-arms fp8,torchao --repeats 2
    ;;
4)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    ;;
5)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    bash benchmarks/h200_stage.sh vinstall > "$OUT/vinstall.log" 2>&1; echo "vinstall rc=$?"
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 420 vllm_grpo.log python benchmarks/bench_vllm.py --parts grpo --grpo-arms fp8,bf16 --grpo-rounds 2
    ;;
6)  # the batch-64 decode row (0.99-1.02x): FP8 GEMM, activation quantizer, attention or other, against BF16's step
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 240 vllm_decode_profile.log python benchmarks/bench_vllm.py --parts decode_profile --decode-layers 32 \
        --batches 64
    ;;
7)
    export CALCLIP_TRITON_AUTOTUNE=0
    run 200 triton.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_triton.py
    run 150 families.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_model_families.py
    unset CALCLIP_TRITON_AUTOTUNE
    ;;
8)  # alone in its call: its warm-up outlasted a ~450 s call with BF16's beside it (ninth session)
    run 420 trainer_compile.log python benchmarks/bench_speed.py --only trainer --trainer-runs fp8_compile_all \
        --trainer-warmup 4
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2|3|4|5|6|7|8"; exit 2 ;;
esac
