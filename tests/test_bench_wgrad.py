"""benchmarks/bench_wgrad.py --smoke (TRITON_INTERPRET=1 on CPU): the script's arms run end to end on calclip's
Triton kernels, the padded layout has wgrad_rows(M) code rows, and the wgrad GEMM over them equals the unpadded
(previous) layout's bit for bit, so the GPU run times two ways of computing the same dW."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_runs_both_layouts_and_they_agree():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_wgrad.py"), "--smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in run.stdout.splitlines()
            if line.startswith("| 192x256")]
    assert [(r[1], r[2]) for r in rows] == [("256", "256"), ("200", "256"), ("77", "128")]  # tokens, code rows
    assert all(r[3] == "triton (interpreter) / triton (interpreter)" and r[-1] == "yes" for r in rows), rows
