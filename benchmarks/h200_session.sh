#!/usr/bin/env bash
# The next H200 hold, one device call per step (docs/benchmarks-log.md, sixteenth session, "To run next"): issue 28
# only (no vLLM, no GGUF). Start each step within 30 s of the previous one's end (the machine keeps /tmp only while
# warm). Steps 1-3 fit 30 device minutes with the ~1 min start; 4 only if time is left.
#
#   step 1: carry .whl      (~9 min)  GPU tests of compile_layers (the trainer's regional compile) and of the FP8
#                                     layers under torch.compile (the weight codes are now marked static); the 1.5B
#                                     model row with the layers compiled one by one against the whole-model compile
#   step 2: carry nothing   (~9 min)  the trainer step: FP8 eager vs FP8 with compile_layers vs BF16 eager (a cold
#                                     cache), then compile_layers again in a new process (a warm cache: first-step cost)
#   step 3: carry nothing   (~9 min)  the 7B and 8B compiled rows (whole model and by layer); FP8 eager vs torchao
#                                     eager at the 8B row
#   step 4: carry nothing   (~3 min)  the 1.5B row's profile with its host side (FP8c waits ~3 ms a step on the host)
#   step 5: carry .whl      (~5 min)  (a new machine) the trainer step again after rollouts set the compiled layers
#                                     aside (eager_blocks): FP8 eager and compile_layers in turn, two rounds, with
#                                     Dynamo's recompile log
#   step 6: carry .whl      (~4 min)  (a new machine) the weight refresh as one CUDA-graph replay (refresh_graph):
#                                     its GPU tests, then the 1.5B row again
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
    run 170 gpu_compiled_layers.log python -m pytest -q -rf -s --tb=short -p no:cacheprovider \
        tests/trainers/test_gpu_compiled_layers.py
    run 150 gpu_compile.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_compile.py
    run 230 model_1.5b_by_layer.log python benchmarks/bench_speed.py --only model --models qwen2.5-1.5b \
        --model-arms bf16c,fp8c,fp8r --repeats 3
    ;;
2)
    run 330 trainer_layers.log python benchmarks/bench_speed.py --only trainer \
        --trainer-runs fp8_eager,fp8_layers,bf16_eager --trainer-steps 4 --trainer-warmup 2 --run-rounds 1
    run 200 trainer_layers_warm.log python benchmarks/bench_speed.py --only trainer --trainer-runs fp8_layers \
        --trainer-steps 2 --trainer-warmup 2 --run-rounds 1
    ;;
3)
    run 320 model_7b_8b.log python benchmarks/bench_speed.py --only model --models qwen2.5-7b,llama3-8b \
        --model-arms bf16c,fp8c,fp8r --repeats 2
    run 240 model_8b_torchao.log python benchmarks/bench_speed.py --only model --models llama3-8b \
        --model-arms fp8,torchao --repeats 2
    ;;
4)
    run 200 profile_1.5b.log python benchmarks/probes/profile_model_step.py --model qwen2.5-1.5b --arms bf16c,fp8c
    ;;
5)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export TORCH_LOGS=recompiles
    run 330 trainer_layers_2.log python benchmarks/bench_speed.py --only trainer \
        --trainer-runs fp8_eager,fp8_layers --trainer-steps 4 --trainer-warmup 2 --run-rounds 2
    echo "recompiles logged: $(grep -c 'Recompiling function' "$OUT/trainer_layers_2.log")"
    ;;
6)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    run 100 gpu_compile_graph.log python -m pytest -q -rf --tb=short -p no:cacheprovider tests/fp8/test_gpu_compile.py
    run 175 model_1.5b_graph.log python benchmarks/bench_speed.py --only model --models qwen2.5-1.5b \
        --model-arms bf16c,fp8c,fp8r --repeats 2
    ;;
*)
    echo "usage: bash benchmarks/h200_session.sh 1|2|3|4|5|6"; exit 2 ;;
esac
