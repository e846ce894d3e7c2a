"""benchmarks/grpo_rounds.sh: rounds of ``bench_vllm.py --parts grpo`` pooled as they go, run here against a stand-in
interpreter that records each command line and writes the results file a round leaves (no GPU, no vLLM)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_rounds.sh"
STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
calls=$(wc -l < "$CALLS")
if [ -n "${FAIL_AT:-}" ] && [ "$calls" -ge "$FAIL_AT" ]; then echo "worker failed: CUDA out of memory"; exit 3; fi
sleep "${SLEEP:-0}"
echo '{"grpo": {}}' > "$OUT/bench_vllm.json"
echo "| arm | step s |"
echo "   step ratio bf16 / fp8 paired over $calls rounds: geometric mean 1.10x"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tac") is None,
                                reason="needs bash and coreutils")


def run_rounds(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    full_env = {**os.environ, "ROUNDS": str(tmp_path / "rounds"), "PYTHON": str(stand_in),
                "CALLS": str(tmp_path / "calls.txt"), **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=60)


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.txt").read_text().splitlines()


def test_rounds_alternate_the_arm_order_and_pool_every_earlier_round(tmp_path):
    """Three rounds: the even one runs --grpo-arms and --recipes reversed; round n names rounds 1..n-1's results in
    --grpo-earlier; a second run with the same ROUNDS goes on at round 4, pooled with all three."""
    args = ("--grpo-arms", "bf16,fp8", "--recipes", "tensorwise,blockwise", "--grpo-layers", "8")
    done = run_rounds(tmp_path, *args, MAX_ROUNDS="3", ALTERNATE="1")
    assert done.returncode == 0, done.stdout + done.stderr
    rounds = tmp_path / "rounds"
    first, second, third = calls(tmp_path)
    assert first.endswith("--parts grpo --grpo-arms bf16,fp8 --recipes tensorwise,blockwise --grpo-layers 8")
    assert "--grpo-arms fp8,bf16 --recipes blockwise,tensorwise --grpo-layers 8" in second
    assert "--grpo-arms bf16,fp8 --recipes tensorwise,blockwise" in third
    assert "--grpo-earlier" not in first
    assert second.endswith(f"--grpo-earlier {rounds}/1/bench_vllm.json")
    assert third.endswith(f"--grpo-earlier {rounds}/1/bench_vllm.json,{rounds}/2/bench_vllm.json")
    assert sorted(p.name for p in rounds.iterdir()) == ["1", "2", "3"]
    assert "paired over 3 rounds" in done.stdout and "round 3 done" in done.stdout
    again = run_rounds(tmp_path, *args, MAX_ROUNDS="1", ALTERNATE="1")
    assert again.returncode == 0, again.stdout + again.stderr
    fourth = calls(tmp_path)[3]
    assert "--grpo-arms fp8,bf16 --recipes blockwise,tensorwise" in fourth  # round 4: even
    assert fourth.endswith(",".join(f"{rounds}/{k}/bench_vllm.json" for k in (1, 2, 3)))


def test_rounds_keep_the_order_without_alternate_and_stop_when_the_budget_cannot_hold_a_round(tmp_path):
    """Without ALTERNATE every round runs the lists as given; with BUDGET and NEED a round starts only while the
    time left holds it (here the first round's second leaves 3 s of a 4 s budget, and a round needs 3.5)."""
    done = run_rounds(tmp_path, "--grpo-arms", "bf16,fp8", MAX_ROUNDS="2")
    assert done.returncode == 0
    assert all("--grpo-arms bf16,fp8" in c for c in calls(tmp_path))
    budget = tmp_path / "budget"
    budget.mkdir()
    cut = run_rounds(budget, "--grpo-arms", "bf16,fp8", BUDGET="4", NEED="3", SLEEP="1.5", MAX_ROUNDS="5")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert 1 <= len(calls(budget)) <= 2 and "a round needs 3: stop" in cut.stdout
    none = tmp_path / "none"
    none.mkdir()
    refused = run_rounds(none, "--grpo-arms", "bf16,fp8", BUDGET="2", NEED="5")
    assert refused.returncode == 0 and not (none / "calls.txt").exists()  # no round fits: none starts


def test_a_round_without_results_stops_the_run_and_is_not_pooled_later(tmp_path):
    """The second round's worker fails before writing results: the run exits 1 with the log's tail, starts no third
    round, and the failed round's folder is set aside so that the next run's round 2 pools round 1 only."""
    failed = run_rounds(tmp_path, "--grpo-arms", "bf16,fp8", MAX_ROUNDS="3", FAIL_AT="2")
    assert failed.returncode == 1
    assert "round 2 wrote no results (exit 3)" in failed.stdout and "CUDA out of memory" in failed.stdout
    assert len(calls(tmp_path)) == 2
    rounds = tmp_path / "rounds"
    assert (rounds / "1" / "bench_vllm.json").is_file() and not (rounds / "2").exists()
    assert [p.name.startswith("failed-2-") for p in rounds.iterdir() if p.name != "1"] == [True]
    again = run_rounds(tmp_path, "--grpo-arms", "bf16,fp8", MAX_ROUNDS="1")
    assert again.returncode == 0
    assert calls(tmp_path)[2].endswith(f"--grpo-earlier {rounds}/1/bench_vllm.json")


def test_rounds_folder_is_required(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ROUNDS"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "set ROUNDS" in done.stderr
