"""benchmarks/check_markstein.py: the division-free quantizer step (per-block reciprocal + one FMA correction)
gives the reference's e4m3 codes, and the check is sharp enough to see the plain reciprocal's errors."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import check_markstein as mk  # noqa: E402


def test_markstein_codes_equal_division_and_the_plain_reciprocal_does_not():
    rng, mids = np.random.default_rng(3), mk.e4m3_midpoints()
    recip_code_errors = 0
    for name, s, x in mk.samples(rng, 20_000, mids):
        want = (x.astype(mk.F64) / s.astype(mk.F64)).astype(mk.F32)
        q1, q0 = mk.markstein(x, s)
        assert (mk.e4m3(q1) == mk.e4m3(want)).all(), name
        if name.startswith("midpoint") or name == "uniform":
            assert (q1 == want).all(), name  # the fp32 quotient itself, away from subnormal x
        recip_code_errors += int((mk.e4m3(q0) != mk.e4m3(want)).sum())
    assert recip_code_errors > 1000  # the midpoint sets do catch a 1-ulp quotient error


def test_negative_zero_keeps_its_sign():
    x = np.array([-0.0, 0.0, -1e-45], mk.F32)
    s = np.array([1e-3, 1e-3, 1e30], mk.F32)
    q1, _ = mk.markstein(x, s)
    assert list(np.signbit(q1)) == [True, False, True]
    assert list(mk.e4m3(q1)) == [0x80, 0x00, 0x80]


def test_rn32_resolves_a_float64_sum_on_an_fp32_midpoint():
    mid = (1.0 + (1.0 + 2.0 ** -23)) / 2  # halfway between 1 and the next fp32
    hi = np.array([mid, mid, mid])
    lo = np.array([1e-30, -1e-30, 0.0])
    assert list(mk.rn32(hi, lo)) == [np.float32(1.0 + 2.0 ** -23), np.float32(1.0), np.float32(1.0)]
