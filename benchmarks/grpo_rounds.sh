#!/usr/bin/env bash
# Rounds of `bench_vllm.py --parts grpo`, one bench_vllm.py run per round, pooled as they go.
#
# On a shared host the rollout's speed moves between runs (2026-12-07, H200: the same 8-layer rollout took 1.07 to
# 2.07 s), so a ratio needs several rounds of every arm, each round's arms run back to back; and a lent GPU's calls
# are time-limited (10 minutes: about one round of three arms at 8 layers). This script runs rounds while its time
# budget lasts; each round's results land in $ROUNDS/<n>/bench_vllm.json (and its log in $ROUNDS/<n>/log.txt), and every
# round passes the earlier rounds' files to --grpo-earlier, so its summary pools all rounds so far and prints each
# ratio paired over them with a 95% interval. Run it again with the same ROUNDS (in the next call) and it goes on.
#
#   ROUNDS=/tmp/rounds BUDGET=590 NEED=400 ALTERNATE=1 bash benchmarks/grpo_rounds.sh \
#       --grpo-arms bf16,fp8 --recipes tensorwise,blockwise --grpo-layers 8 --grpo-completions 128 --grpo-tokens 256 \
#       --grpo-micro-batches 2 --grpo-steps 6
#
# ROUNDS      folder of the rounds (required); a round n is $ROUNDS/<n>/
# BUDGET      seconds this run may use (default 0: no limit); a round is cut at the budget's end
# NEED        seconds one round needs: a round starts only while BUDGET - elapsed >= NEED (default 300)
# MAX_ROUNDS  rounds this run adds at most (default 3)
# ALTERNATE   1: even rounds run --grpo-arms and --recipes reversed (A B C, then C B A), so no arm always runs first
# PYTHON      the interpreter (default python3)
# Exit status: 0, or 1 when a round wrote no results (its log's tail is printed; later rounds are not started).
set -u
: "${ROUNDS:?set ROUNDS to the rounds folder}"
BUDGET=${BUDGET:-0} NEED=${NEED:-300} MAX_ROUNDS=${MAX_ROUNDS:-3} ALTERNATE=${ALTERNATE:-0} PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
T0=$(date +%s)
mkdir -p "$ROUNDS"

reverse_list() { echo "$1" | tr , '\n' | tac | paste -sd, -; }

# the highest round number already in $ROUNDS
last=0
for dir in "$ROUNDS"/*/; do
    n=$(basename "$dir")
    [[ $n =~ ^[0-9]+$ ]] && ((10#$n > last)) && last=$((10#$n))
done

added=0
while ((added < MAX_ROUNDS)); do
    elapsed=$(($(date +%s) - T0))
    if ((BUDGET > 0 && BUDGET - elapsed < NEED)); then
        echo "grpo_rounds: ${elapsed} s used of ${BUDGET}; a round needs ${NEED}: stop"
        break
    fi
    n=$((last + 1))
    args=("$@")
    if [[ $ALTERNATE == 1 ]] && ((n % 2 == 0)); then
        for i in "${!args[@]}"; do
            if [[ ${args[$i]} == --grpo-arms || ${args[$i]} == --recipes ]] && ((i + 1 < ${#args[@]})); then
                args[i + 1]=$(reverse_list "${args[$((i + 1))]}")
            fi
        done
    fi
    earlier=()
    for ((k = 1; k < n; k++)); do
        [[ -s $ROUNDS/$k/bench_vllm.json ]] && earlier+=("$ROUNDS/$k/bench_vllm.json")
    done
    mkdir -p "$ROUNDS/$n"
    limit=()
    ((BUDGET > 0)) && limit=(timeout $((BUDGET - elapsed)))
    echo "grpo_rounds: round $n at ${elapsed} s: ${args[*]}${earlier:+ (pooled with ${#earlier[@]} earlier)}"
    OUT=$ROUNDS/$n "${limit[@]}" "$PYTHON" "$HERE/bench_vllm.py" --parts grpo "${args[@]}" \
        ${earlier:+--grpo-earlier "$(IFS=,; echo "${earlier[*]}")"} > "$ROUNDS/$n/log.txt" 2>&1
    status=$?
    if [[ ! -s $ROUNDS/$n/bench_vllm.json ]]; then
        echo "grpo_rounds: round $n wrote no results (exit $status); its log ends:"
        tail -n 30 "$ROUNDS/$n/log.txt"
        mv "$ROUNDS/$n" "$ROUNDS/failed-$n-$(date +%s)"  # kept for its log, out of the round numbering
        exit 1
    fi
    # the round's summary: its tables, the paired ratios over every round so far, its warnings and notes
    grep -E '^\||paired over|round by round|!!|^   ~ ' "$ROUNDS/$n/log.txt"
    echo "grpo_rounds: round $n done after $(($(date +%s) - T0)) s (exit $status)"
    last=$n added=$((added + 1))
done
