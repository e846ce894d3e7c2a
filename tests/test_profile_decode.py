"""benchmarks/profile_decode.py: its CPU path (--tiny) profiles every arm, and its per-step accounting counts what
one decode step really calls."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_decode  # noqa: E402


@pytest.mark.slow
def test_tiny_profiles_every_arm_and_counts_one_matmul_per_linear_per_decode_step(capsys):
    assert profile_decode.main(["--tiny", "--host-top", "40"]) == 0
    out = capsys.readouterr().out
    sections = re.split(r"\n### ", out)[1:]
    names = [s.split(":")[0] for s in sections]
    assert names == ["eager, BF16", "eager, FP8 two launches", "eager, FP8 fused"], names
    assert all("failed" not in s.splitlines()[0] for s in sections)
    # --tiny is one decoder layer: q, k, v, o, gate, up, down and the LM head, so a decode step of the BF16 arm
    # calls aten::mm 8 times; the script divides its profile by the decode steps (2 here), so a wrong division
    # shows as 4 or 16.
    bf16 = sections[0]
    mm = [line for line in bf16.splitlines() if line.endswith("| `aten::mm` |")]
    assert len(mm) == 1, bf16
    assert float(mm[0].split("|")[2]) == 8.0
