#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, twelfth session, "To run next"): each step
# stages what its call carried (benchmarks/h200_stage.sh) and then runs its measurements, every output teed in full
# to $OUT. Start each step within 30 s of the previous one's end (the machine keeps /tmp only while warm).
#
# Here first: python benchmarks/h200_pack.py --cut   (re-cuts .vchunks/ to the checkout's size)
#   step 1: carry .gguf/part00 .whl                         (~7 min)  gemm-backend + family tests, issue 26's layer row
#   step 2: carry .gguf/part01 .gguf/init.py .vchunks/c0    (~4 min)  1.5B row, compiled arms, with the row-scales lever
#   step 3: carry .vchunks/c00                              (~2 min)  quantizer sweep (Markstein)
#   step 4: carry .vchunks/c01 .vchunks/install.sh          (~9 min)  vLLM install; mismatch one engine per process
#                                                                     (BF16 on two models, then FP8); decode if the
#                                                                     BF16 control is sane, else BF16 with enforce_eager
#   step 5: carry nothing                                   (~9 min)  vLLM GRPO step and HF decode, the vLLM GPU tests
#   step 6: carry nothing, any machine                      (~5 min)  layer row, GPU linear/compile tests, quantizer sweep
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
    export CALCLIP_TRITON_AUTOTUNE=0
    run 60 gemm.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_linear.py -k gemm_backends
    run 270 fam.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_model_families.py
    unset CALCLIP_TRITON_AUTOTUNE
    run 100 layer.log python benchmarks/bench_speed.py --only layer --layer-shapes 2048x4096x4096,8192x2048x2048 \
        --repeats 3 --no-torchao
    ;;
2)
    bash benchmarks/h200_stage.sh gguf2 2>&1 | tail -1
    run 230 model.log python benchmarks/bench_speed.py --only model --models qwen2.5-1.5b \
        --model-arms bf16c,fp8c,fp8xc --fp8-options scaled_mm_row_scales=true --repeats 3
    ;;
3)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    run 90 sweep.log python benchmarks/probes/sweep_quant.py
    ;;
4)
    bash benchmarks/h200_stage.sh vchunk 2>&1 | tail -1
    bash benchmarks/h200_stage.sh vinstall > "$OUT/vinstall.log" 2>&1; echo "vinstall rc=$?"
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    # one engine per process, as TRL's colocate mode runs it; bench_vllm writes its JSON to $OUT: one folder each
    (OUT="$OUT/bf16_alone"; mkdir -p "$OUT"; export OUT
     run 200 vllm.log python benchmarks/bench_vllm.py --parts mismatch --mismatch-arms bf16 --models issue_probe,llama3_8b)
    (OUT="$OUT/fp8_alone"; mkdir -p "$OUT"; export OUT
     run 150 vllm.log python benchmarks/bench_vllm.py --parts mismatch --mismatch-arms calclip)
    if python benchmarks/h200_session_check.py "$OUT/bf16_alone/bench_vllm.json"; then
        run 190 vllm_decode.log python benchmarks/bench_vllm.py --parts decode --decode-layers 32 --new-tokens 128
    else
        (OUT="$OUT/bf16_eager"; mkdir -p "$OUT"; export OUT
         run 120 vllm.log python benchmarks/bench_vllm.py --parts mismatch --mismatch-arms bf16 --enforce-eager)
    fi
    ;;
5)
    export PYTHONPATH=/tmp/vsite:/tmp/site VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    run 300 vllm_grpo.log python benchmarks/bench_vllm.py --parts grpo,hf_decode
    run 240 vllm_tests.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/trainers/test_gpu_vllm.py
    ;;
6)  # a fresh machine, nothing carried: the FP8 layer after the row-scales default and the quantizer table
    run 60 layer.log python benchmarks/bench_speed.py --only layer --layer-shapes 2048x4096x4096,8192x2048x2048 \
        --repeats 3 --no-torchao
    export CALCLIP_TRITON_AUTOTUNE=0
    run 120 gpu_linear.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_linear.py \
        tests/fp8/test_gpu_compile.py
    unset CALCLIP_TRITON_AUTOTUNE
    run 100 sweep.log python benchmarks/probes/sweep_quant.py
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2|3|4|5|6"; exit 2 ;;
esac
