"""The numerics contract of ``calclip.fp8.reference`` (its module docstring) as ``@triton.jit`` helpers: one scale
per block, codes from a block and its scale, and the e4m3fn cast (hardware, or in software under the interpreter).

Every quantizer kernel and the fused decode kernel build on these, so all of them produce the reference's fp32
scales bit for bit and its e4m3fn codes exactly. Under ``TRITON_INTERPRET=1`` the interpreter's own fp32 -> fp8
cast truncates instead of rounding and cannot produce NaN, so in that mode the kernels encode the e4m3fn bits in
software (``_e4m3fn_bits``); the GPU tests check that this software encoder equals the hardware
``cvt.rn.satfinite.e4m3x2.f32`` on every fp32 input they try.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from calclip.fp8.config import FP8_E4M3_MAX
from calclip.fp8.reference import AMAX_FLOOR

# Constants used inside kernels must be tl.constexpr globals (Triton rejects plain Python globals in @jit code).
# Triton reads TRITON_INTERPRET when @triton.jit decorates, at import: so does this module (INTERPRETED: for the
# launchers' import-time choices too).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRETED = tl.constexpr(INTERPRETED)
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
# fp32 bit fields for the exact power-of-two round-up of a scale (reference.round_scale_up_to_pow2).
_FP32_MANTISSA_MASK = tl.constexpr(0x007FFFFF)
_FP32_EXPONENT_MASK = tl.constexpr(0x7F800000)
_FP32_EXPONENT_ONE = tl.constexpr(0x00800000)
# e4m3fn: 3 mantissa bits, exponent bias 7; smallest normal 2**-6; subnormal step 2**-9; NaN code 0x7F.
_E4M3_MANTISSA_BITS = tl.constexpr(3)
_E4M3_BIAS = tl.constexpr(7)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEPS = tl.constexpr(2.0**9)  # 1 / subnormal step
_E4M3_NAN_CODE = tl.constexpr(0x7F)
# Adding then subtracting 1.5 * 2**23 rounds an fp32 in [0, 2**22) to the nearest integer, ties to even.
_RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _abs_max(x, axis: tl.constexpr):
    """max |x| along ``axis``, +Inf if any element is NaN or +-Inf: one reduction gives both the amax and the
    non-finite test (``amax == inf``). NaN is mapped to Inf first because a max reduction may drop NaN."""
    return tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=axis)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _abs_max_lean(x, axis: tl.constexpr):
    """``_abs_max`` (the same values) in one instruction per element: compiled, the reduction's max keeps NaN
    (sm_90 ``max.NaN.f32``, the abs folded in) and a NaN result becomes +Inf once per block, not per element. The
    interpreter runs a reduction with a combine function of its own element by element in Python (~28x slower), so
    there this is ``_abs_max``."""
    if _INTERPRETED:
        return _abs_max(x, axis)
    amax = tl.reduce(tl.abs(x), axis, _max_keeping_nan)
    return tl.where(amax == amax, amax, float("inf"))


@triton.jit
def _block_scale(amax, nonfinite, POW2: tl.constexpr):
    """amax (from _abs_max), nonfinite (amax == inf), per block -> fp32 dequantization scale, NaN for
    non-finite blocks.

    s = max(amax, AMAX_FLOOR) / FP8_E4M3_MAX with IEEE division; POW2 rounds s up to a power of two exactly.
    """
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = bits & _FP32_EXPONENT_MASK
        has_mantissa = (bits & _FP32_MANTISSA_MASK) != 0
        scale = tl.where(has_mantissa, exponent + _FP32_EXPONENT_ONE, exponent).to(tl.float32, bitcast=True)
    return tl.where(nonfinite, float("nan"), scale)


@triton.jit
def _scaled_codes(x, scale, nonfinite):
    """x fp32, scale and nonfinite broadcastable to x -> fp32 values on the fp8 grid's range [-448, 448] or NaN."""
    codes = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
    return tl.where(nonfinite, float("nan"), codes)  # explicit: clamp's NaN behaviour is unspecified


@triton.jit
def _reciprocal(scale):
    """RN(1 / scale) per block (IEEE division, once per block): what ``_codes``' division-free step multiplies by."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _codes(x, scale, recip, nonfinite, DIV_FREE: tl.constexpr):
    """The activation quantizers' codes (1x128, 128x1): ``_scaled_codes`` (one IEEE division per element, clamped,
    NaN blocks selected), or with DIV_FREE the same codes in three instructions per element, for a ``scale`` from
    ``_block_scale`` of x's own block (|x| <= its amax) and ``recip`` = ``_reciprocal(scale)``:

        q0 = RN(x * recip)     e = fma(scale, q0, -x) = -(x - scale * q0)  (exact)     q = fma(-e, recip, q0)

    - q = RN(x / scale) for every normal x (Markstein's correction), and for subnormal x within an fp32 ulp of a
      quotient far below e4m3's smallest step, so the e4m3 codes are the same (benchmarks/check_markstein.py: 1.9e9
      pairs, amax from AMAX_FLOOR to 1e38, e4m3 midpoints +-3 ulps, every code equal);
    - the residual is taken negated so that x = -0 gives -0 (q0 = -0, e = +0, q = -0 + -0) with no sign fix-up (the
      codes of -0 and +0 differ: 0x80 / 0x00);
    - no clamp: |q| <= 448 / (1 - 2**-24) < 448.0001, which the e4m3fn cast (hardware satfinite, or
      ``_e4m3fn_bits``) rounds to 448 as the clamp would have;
    - no per-element NaN select: a non-finite block's scale is NaN, so are its reciprocal and every q.

    The twins' first formulation (a sign fix-up, a clamp and a select: ~10 instructions per element) ran slower than
    the division on an H100; this one ran the 128x1 quantizer 1.31x and the 1x128 1.01-1.04x faster (H100,
    2026-12-07), so each table's default is a DIV_FREE twin (quantize.py; ``CALCLIP_DIV_FREE=0`` leaves the dividing
    tiles alone). In a dividing config ``recip`` is dead code the compiler drops (sm_90: the dividing configs' div.rn
    count is one per code and scale)."""
    if DIV_FREE:
        # ``v * -1.0``, not ``-v``: Triton lowers a float's unary minus to 0 - v, which turns -0 into +0
        q0 = x * recip
        return tl.fma(tl.fma(scale, q0, x * -1.0) * -1.0, recip, q0)
    return _scaled_codes(x, scale, nonfinite)


@triton.jit
def _e4m3fn_bits(v):
    """fp32 in [-448, 448] or NaN -> e4m3fn bit pattern (int32 in [0, 255]), round to nearest even.

    The software twin of the hardware cast, used only under the interpreter (see the module docstring).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = v != v
    mag = tl.where(is_nan, 0.0, tl.abs(v))  # NaN is encoded at the end; keep it out of the integer casts
    # Subnormals (|v| < 2**-6) count steps of 2**-9; the carry to 8 is the smallest normal's code.
    sub_code = ((mag * _E4M3_SUBNORMAL_STEPS + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)
    # Normals: round the fp32 mantissa to 3 bits, ties to even; a carry ripples into the exponent.
    mag_bits = mag.to(tl.int32, bitcast=True)
    drop = 23 - _E4M3_MANTISSA_BITS
    mag_bits = mag_bits + ((1 << (drop - 1)) - 1) + ((mag_bits >> drop) & 1)
    normal_code = (mag_bits >> drop) - ((127 - _E4M3_BIAS) << _E4M3_MANTISSA_BITS)
    code = tl.where(mag < _E4M3_MIN_NORMAL, sub_code, normal_code) | sign
    return tl.where(is_nan, _E4M3_NAN_CODE, code)


@triton.jit
def _store_codes(q_ptrs, codes, mask, SOFT_FP8: tl.constexpr):
    """Store fp32 codes as e4m3fn: hardware cast, or software bits through a uint8 pointer (interpreter)."""
    if SOFT_FP8:
        tl.store(q_ptrs, _e4m3fn_bits(codes).to(tl.uint8), mask=mask)
    else:
        tl.store(q_ptrs, codes.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _e4m3fn_in_registers(codes, SOFT_FP8: tl.constexpr):
    """fp32 codes from _scaled_codes -> e4m3fn values for tl.dot: the very cast _store_codes stores (hardware
    round-to-nearest-even cast, or under the interpreter the software bits reinterpreted as e4m3fn)."""
    if SOFT_FP8:
        a = _e4m3fn_bits(codes).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        a = codes.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return a
