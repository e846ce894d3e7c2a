"""benchmarks/sweep_quant.py --smoke (TRITON_INTERPRET=1 on CPU): every production kernel and the exact experimental
variants give the CPU reference's codes and scales on a ragged tensor with NaN/Inf blocks, and the check sees the
inexact ones (the plain reciprocal, no division). docs/benchmarks.md's Markstein row rests on this check."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_checks_the_variants_against_the_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_quant.py"), "--smoke"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    checks = dict(re.findall(r"^  (\S+) +(\d+ codes.*|exact|n/a.*)$", run.stdout, re.M))
    for exact in ("prod", "ctrl", "two", "markstein", "approx", "rows", "cols"):
        assert checks[exact] == "exact", (exact, checks)
    for inexact in ("recip", "nodiv"):
        codes = int(re.match(r"(\d+) codes", checks[inexact]).group(1))
        assert codes > 0, (inexact, checks[inexact])
    assert "recip with pow2=True scales: exact" in run.stdout  # 1/s is exact for power-of-two scales
    # one timing table per smoke shape, each with the production row
    assert run.stdout.count("| (a) prod via calclip [default]") == 2
    # the (b) sweep launches the production kernel through its launcher, one config at a time: two configs per
    # shape, each exact (until 2026-12-06 it launched the kernel by an old signature and swallowed the TypeError)
    swept = re.findall(r"^\| \(b\) prod kernel (C\d+ w\d+s\d+) .*\| (\S[^|]*?) *\|$", run.stdout, re.M)
    assert sorted(label for label, _ in swept) == ["C128 w8s2"] * 2 + ["C32 w8s1"] * 2, swept
    assert all(check == "exact" for _, check in swept), swept
