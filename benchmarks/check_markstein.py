"""Is the division-free quantizer step exact? CPU only, exact arithmetic (numpy float64 + TwoSum).

The quantizers compute codes = e4m3(RN32(x / s)) with one IEEE division (div.rn.f32) per element; the quantizer
sweep (docs/benchmarks-log.md) measured those divisions as ~80% of the fused 1x128 + 128x1
quantizer's gap to copy bandwidth on the H200. A per-block reciprocal alone, x * RN(1/s), changes 0.05% of the codes.
Markstein's correction adds two FMAs per element:

    y = RN(1/s)  (once per block)     q0 = RN(x * y)     q1 = RN(q0 + fma(-s, q0, x) * y)  (fma)

and, with x's sign put back on a zero result (the FMAs give +0 for x = -0), is meant to give RN32(x / s) itself.
This script checks that claim by emulating the FMAs exactly: products of two fp32 numbers are exact in float64, a
sum's rounding error is recovered with TwoSum, and the one place where a float64 sum can round across an fp32
rounding boundary (landing exactly on an fp32 midpoint) is resolved from that error. The reference RN32(x / s)
comes from float64 division, which rounds innocuously to fp32 (53 >= 2 * 24 + 2).

    python benchmarks/check_markstein.py --rounds 100      # ~10 s per 100 rounds of 1.6e6 pairs

Sets per round: x uniform in [-amax, amax]; x on e4m3 rounding midpoints times s and 1-3 fp32 ulps either side
(the adversarial cases for a 1-ulp quotient error); magnitudes log-uniform down to fp32 subnormals; random fp32 bit
patterns; x = +-amax and its neighbour. amax log-uniform in [AMAX_FLOOR, 1e38], s = RN(max(amax, floor) / 448).
Prints the pairs whose fp32 quotient or whose e4m3 code differs from the reference, for Markstein and for the
plain reciprocal. Result 2026-12-02 (1.9e9 pairs): every e4m3 code equal; fp32 quotients equal except for
subnormal x (the FMA residual underflows), whose codes are 0 either way.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

F32, F64 = np.float32, np.float64
AMAX_FLOOR = 1e-12  # calclip.fp8.reference.AMAX_FLOOR
E4M3_MAX = 448.0


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 a + b = s + err exactly (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def rn32(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """RN32 of the exact value hi + lo, where hi = RN64(hi + lo): hi's own rounding to fp32 unless hi sits exactly on
    an fp32 midpoint, where lo's sign decides (lo = 0: ties to even, as numpy's cast)."""
    c = hi.astype(F32)
    toward = np.where(hi > c.astype(F64), np.nextafter(c, np.inf, dtype=F32), np.nextafter(c, -np.inf, dtype=F32))
    mid = (c.astype(F64) + toward.astype(F64)) / 2  # exact in float64
    at_mid = (hi == mid) & (hi != c.astype(F64))
    other_side = (lo > 0) & (toward.astype(F64) > hi) | (lo < 0) & (toward.astype(F64) < hi)
    return np.where(at_mid & other_side, toward, c)


def markstein(x: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q1, q0): the corrected quotient and the plain reciprocal product, both fp32."""
    x64, s64 = x.astype(F64), s.astype(F64)
    y = (1.0 / s64).astype(F32)
    q0 = (x64 * y.astype(F64)).astype(F32)
    r = rn32(*two_sum(x64, -(s64 * q0.astype(F64))))  # fma(-s, q0, x)
    q1 = rn32(*two_sum(q0.astype(F64), r.astype(F64) * y.astype(F64)))  # fma(r, y, q0)
    return np.copysign(q1, x), q0


def e4m3(q: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.clip(q, -E4M3_MAX, E4M3_MAX).astype(F32))
    return t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def e4m3_midpoints() -> np.ndarray:
    values = sorted({(1 + k / 8) * 2.0 ** e for e in range(-6, 9) for k in range(8)}
                    | {k * 2.0 ** -9 for k in range(8)})
    v = np.array([x for x in values if x <= E4M3_MAX], F64)
    return (v[1:] + v[:-1]) / 2


def samples(rng: np.random.Generator, n: int, mids: np.ndarray):
    amax = np.maximum((10 ** rng.uniform(-12, 38, n)).astype(F32), F32(AMAX_FLOOR))
    s = (amax.astype(F64) / E4M3_MAX).astype(F32)
    sign = rng.choice([-1, 1], n).astype(F32)
    yield "uniform", s, (rng.uniform(-1, 1, n) * amax).astype(F32)
    on_mid = (rng.choice(mids, n) * sign * s.astype(F64)).astype(F32)
    for k in (-3, -2, -1, 0, 1, 2, 3):
        x = on_mid
        for _ in range(abs(k)):
            x = np.nextafter(x, np.inf if k > 0 else -np.inf, dtype=F32)
        yield f"midpoint{k:+d}ulp", s, x
    yield "log-uniform to subnormals", s, (10 ** rng.uniform(-45, 0, n) * amax * sign).astype(F32)
    bits = rng.integers(0, 2**31 - 1, n, dtype=np.int64).astype(np.uint32).view(F32)
    yield "random bits", s, np.where(np.isfinite(bits) & (np.abs(bits) <= amax), bits, amax * F32(0.5)) * sign
    yield "+-amax", s, np.where(rng.uniform(size=n) < 0.5, np.nextafter(amax * sign, 0, dtype=F32), amax * sign)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n", type=int, default=160_000, help="pairs per set per round")
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(argv)
    rng, mids, t0 = np.random.default_rng(opts.seed), e4m3_midpoints(), time.time()
    tally: dict[str, list[int]] = {}
    for _ in range(opts.rounds):
        for name, s, x in samples(rng, opts.n, mids):
            want = (x.astype(F64) / s.astype(F64)).astype(F32)
            q1, q0 = markstein(x, s)
            codes = e4m3(want)
            row = tally.setdefault(name, [0, 0, 0, 0, 0])
            row[0] += x.size
            row[1] += int((q1 != want).sum())
            row[2] += int((e4m3(q1) != codes).sum())
            row[3] += int((q0 != want).sum())
            row[4] += int((e4m3(q0) != codes).sum())
    print("| set | pairs | Markstein: fp32 quotient differs | Markstein: e4m3 code differs | reciprocal: quotient "
          "differs | reciprocal: code differs |")
    print("|---|---|---|---|---|---|")
    for name, (n, dq, dc, rq, rc) in tally.items():
        print(f"| {name} | {n} | {dq} | {dc} | {rq} | {rc} |")
    codes_bad = sum(row[2] for row in tally.values())
    print(f"{sum(r[0] for r in tally.values())} pairs in {time.time() - t0:.0f} s: "
          f"{'every e4m3 code equal' if codes_bad == 0 else f'{codes_bad} CODES DIFFER'}")
    return 0 if codes_bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
