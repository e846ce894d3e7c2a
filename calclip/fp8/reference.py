"""Plain-torch reference block quantizers (CPU and GPU). The Triton kernels must reproduce these exactly.

Numerics — the contract every quantizer here and in ``kernels/quantize.py`` follows, step by step:

1. Work in float32. Inputs (bf16/fp16/fp32; fp64 is first rounded to fp32) are converted with ``.float()``.
2. Blocks: ``quantize_1x128`` groups ``block`` consecutive elements of the LAST dim; ``quantize_128x1`` groups
   ``block`` consecutive rows (dim 0) of a 2-D tensor, one group per column; ``quantize_128x128`` tiles a 2-D
   tensor in ``block x block`` squares. A dimension that is not a multiple of ``block`` gives ragged edge
   blocks: their amax is taken over the REAL elements only (the kernels mask the tail; this reference pads
   with zeros, which cannot change ``amax = max |x|``).
3. Scale (FP32, a DEQUANTIZATION multiplier, x ~= q * s, DeepSeek-V3 ``weight_scale_inv`` convention):
       s = max(amax, AMAX_FLOOR) / FP8_E4M3_MAX          (IEEE fp32 division, round to nearest even)
   An all-zero block therefore gets the finite, positive, NORMAL fp32 scale AMAX_FLOOR / FP8_E4M3_MAX and
   zero codes (no 0/0). The floor only touches blocks whose amax is below 1e-12.
4. Power-of-two scales (``pow2=True``): s is rounded UP to the next power of two, exactly, by bit
   manipulation of the fp32 value: if any mantissa bit of s is set, clear the mantissa and add one to the
   exponent; a scale that already is a power of two is kept. Rounding up means |x / s| <= FP8_E4M3_MAX, so
   nothing saturates. (No log2/exp2: approximate transcendental functions on the GPU could differ.)
5. Codes:  q = float8_e4m3fn( clamp(x / s, -FP8_E4M3_MAX, FP8_E4M3_MAX) )
   ``x / s`` is a true IEEE fp32 division rounded to nearest even (Triton: ``tl.div_rn``, NOT a multiply by
   a reciprocal and NOT an approximate division; a kernel may get the same quotient without dividing per
   element, as ``kernels.numerics._codes``' Markstein step does, exact for every e4m3 code); the explicit clamp
   makes the result independent of how a build's fp8 cast treats out-of-range values (x = amax can give
   x / s = 448.00003); the fp32 -> e4m3fn cast rounds to nearest even (``cvt.rn.satfinite.e4m3x2.f32`` on
   NVIDIA GPUs, the same as torch's CPU cast).
6. NaN / Inf: a block that contains ANY non-finite element (NaN, +Inf or -Inf) gets scale NaN, and all of its
   codes are NaN (x / NaN = NaN, clamp keeps NaN, the cast gives e4m3fn NaN; any NaN bit pattern is
   acceptable, compare codes NaN-aware). Rationale: Inf is not representable in e4m3fn, and saturating it to
   +-448 would hide an overflow; NaN makes the block's dequantized values and every GEMM output that
   touches it NaN, so ``FP8BlockLinear`` can count non-finite outputs and the trainer can drop those tokens.
   Other blocks of the same tensor are unaffected. Kernels must test non-finiteness explicitly (a
   ``tl.max``/``fmax`` reduction may drop NaN).

Dequantization returns float32 ``q.float() * s`` broadcast over each block.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from calclip.fp8.config import BLOCK, FP8_DTYPE, FP8_E4M3_MAX

# Smallest amax used to form a scale: keeps all-zero blocks finite (scale 1e-12/448 ~ 2.2e-15, a normal
# fp32 number, so GPUs that flush subnormals to zero cannot turn it into 0) and their codes 0.
AMAX_FLOOR: float = 1e-12

_FP32_MANTISSA_MASK = 0x007FFFFF
_FP32_EXPONENT_MASK = 0x7F800000
_FP32_EXPONENT_ONE = 0x00800000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_scale_up_to_pow2(scale: Tensor) -> Tensor:
    """Round positive, finite, normal fp32 scales UP to a power of two, exactly (see module docstring, 4)."""
    bits = scale.contiguous().view(torch.int32)
    exponent = bits & _FP32_EXPONENT_MASK
    has_mantissa = (bits & _FP32_MANTISSA_MASK) != 0
    return torch.where(has_mantissa, exponent + _FP32_EXPONENT_ONE, exponent).view(torch.float32)


def _scale_from_blocks(blocks: Tensor, dims: tuple[int, ...], pow2: bool) -> Tensor:
    """blocks: fp32, zero-padded; reduce over ``dims`` -> one scale per block (module docstring, 3, 4, 6)."""
    amax = blocks.abs().amax(dim=dims)  # torch's amax propagates NaN, and |Inf| = Inf
    finite = torch.isfinite(amax)
    # Divide by a tensor on amax's device, not a Python float: on CUDA, PyTorch turns division by a scalar into
    # a multiply by its reciprocal, which rounds differently (measured on the H200: scale bits differed from
    # the CPU reference and the Triton kernels).
    fp8_max = torch.full((), FP8_E4M3_MAX, dtype=amax.dtype, device=amax.device)
    scale = amax.clamp(min=AMAX_FLOOR) / fp8_max
    if pow2:
        scale = round_scale_up_to_pow2(torch.where(finite, scale, 1.0))
    return torch.where(finite, scale, torch.nan)


def _cast_codes(x: Tensor, scale: Tensor) -> Tensor:
    """x, scale broadcastable fp32 -> e4m3fn codes: clamp(x / s) then round-to-nearest-even cast."""
    return torch.clamp(x / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def quantize_1x128(x: Tensor, *, block: int = BLOCK, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize in groups of ``block`` along the last dim (activations, output gradients).

    x: [..., K] float -> (q float8_e4m3fn [..., K] contiguous, s float32 [..., ceil(K / block)] contiguous)
    """
    if x.dim() < 1:
        raise ValueError("quantize_1x128 needs at least one dim")
    k = x.shape[-1]
    nb = _ceil_div(k, block)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, nb * block - k)) if nb * block != k else xf
    blocks = padded.reshape(*x.shape[:-1], nb, block)
    scale = _scale_from_blocks(blocks, (-1,), pow2)  # [..., nb]
    q = _cast_codes(blocks, scale.unsqueeze(-1)).reshape(*x.shape[:-1], nb * block)[..., :k]
    return q.contiguous(), scale


def quantize_128x1(x: Tensor, *, block: int = BLOCK, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D tensor in groups of ``block`` rows along dim 0, one group per column (token axis,
    for the weight-gradient GEMM, where M is the contraction dim).

    x: [M, K] -> (q float8_e4m3fn [M, K], s float32 [ceil(M / block), K])
    Layout: this reference returns the transposes of contiguous [K, M] / [K, ceil(M/block)] tensors (i.e.
    column-major q), which is what a GEMM contracting over M wants; values, not strides, are the contract.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_128x1 needs a 2-D tensor, got shape {tuple(x.shape)}")
    q_t, s_t = quantize_1x128(x.t(), block=block, pow2=pow2)
    return q_t.t(), s_t.t()


def wgrad_rows(m: int, block: int = BLOCK) -> int:
    """The token rows of 128x1 codes laid out for the weight-gradient GEMM (``gemm_layout=True``): M rounded up to
    whole groups, ``ceil(M / block) * block``. The GEMM contracts over tokens; with whole groups its K is a multiple of
    128, so calclip's Triton GEMM keeps its aligned, software-pipelined loads (a token count not a multiple of 16
    compiles without them on sm_90) and torch._scaled_mm may take it. The extra rows hold zero codes: they add
    exact zeros to every dot product, so dW is the same bit for bit; the scales keep their ceil(M / block) rows."""
    return _ceil_div(m, block) * block


def pad_128x1_codes(q: Tensor, *, block: int = BLOCK) -> Tensor:
    """128x1 codes q [M, K] -> [wgrad_rows(M), K], column-major (the transpose of a contiguous [K, rows]), rows >= M
    zero codes: the weight-gradient GEMM's layout (``wgrad_rows``)."""
    m, k = q.shape
    out = torch.zeros(k, wgrad_rows(m, block), dtype=torch.uint8, device=q.device)  # bytes: no float8 kernel needed
    out[:, :m].copy_(q.t().view(torch.uint8))
    return out.view(q.dtype).t()


def quantize_128x128(w: Tensor, *, block: int = BLOCK, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D tensor (a weight [N, K]) in ``block x block`` tiles.

    w: [N, K] -> (q float8_e4m3fn [N, K] contiguous, s float32 [ceil(N / block), ceil(K / block)])
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_128x128 needs a 2-D tensor, got shape {tuple(w.shape)}")
    n, k = w.shape
    nbn, nbk = _ceil_div(n, block), _ceil_div(k, block)
    wf = w.float()
    if (nbn * block, nbk * block) != (n, k):
        wf = torch.nn.functional.pad(wf, (0, nbk * block - k, 0, nbn * block - n))
    blocks = wf.reshape(nbn, block, nbk, block)
    scale = _scale_from_blocks(blocks, (1, 3), pow2)  # [nbn, nbk]
    q = _cast_codes(blocks, scale[:, None, :, None]).reshape(nbn * block, nbk * block)[:n, :k]
    return q.contiguous(), scale


def _expand(scale: Tensor, dim: int, size: int, block: int) -> Tensor:
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)


def dequantize_1x128(q: Tensor, s: Tensor, *, block: int = BLOCK) -> Tensor:
    """q [..., K], s [..., ceil(K / block)] -> float32 [..., K]"""
    return q.float() * _expand(s.float(), -1, q.shape[-1], block)


def dequantize_128x1(q: Tensor, s: Tensor, *, block: int = BLOCK) -> Tensor:
    """q [M, K], s [ceil(M / block), K] -> float32 [M, K]"""
    return q.float() * _expand(s.float(), 0, q.shape[0], block)


def dequantize_128x128(q: Tensor, s: Tensor, *, block: int = BLOCK) -> Tensor:
    """q [N, K], s [ceil(N / block), ceil(K / block)] -> float32 [N, K]"""
    n, k = q.shape
    return q.float() * _expand(_expand(s.float(), 0, n, block), 1, k, block)


def check_out_rows(name: str, x: Tensor, out_rows, most=None):
    """The rows a 1x128 quantization of x is written over: x's rows, or ``out_rows`` for a 2-D x [M, K] (M <= out_rows
    <= ``most``), the rows past M those of zero tokens: zero codes and an all-zero group's scale (module docstring,
    3), what quantizing x with zero rows appended gives (``zero_rows_appended``). Sizes are compared only where both
    are ints: under torch.compile a symbolic out_rows is the caller's to prove."""
    if out_rows is None:
        return x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if x.dim() != 2:
        raise ValueError(f"{name}(out_rows=) needs a 2-D tensor, got shape {tuple(x.shape)}")
    m = x.shape[0]
    if type(out_rows) is int and type(m) is int and (out_rows < m or (type(most) is int and out_rows > most)):
        bound = f"{m} <= out_rows" + (f" <= {most}" if most is not None else "")
        raise ValueError(f"{name}: out_rows must satisfy {bound} for x of shape {tuple(x.shape)}, got {out_rows}")
    return out_rows


@functools.cache
def zero_group_scale(pow2: bool = False) -> float:
    """The scale of an all-zero block: AMAX_FLOOR / FP8_E4M3_MAX in fp32 (module docstring, 3), rounded up to a power
    of two with ``pow2`` (4): the same bits ``_scale_from_blocks`` and the kernels give such a block."""
    floor, fp8_max = torch.tensor(AMAX_FLOOR, dtype=torch.float32), torch.tensor(FP8_E4M3_MAX, dtype=torch.float32)
    scale = floor / fp8_max
    return float(round_scale_up_to_pow2(scale.reshape(1))[0] if pow2 else scale)


def zero_rows_appended(x: Tensor, out_rows, name: str = "zero_rows_appended", most=None) -> Tensor:
    """A 2-D x [M, K] -> [out_rows, K]: x, then out_rows - M rows of zeros (``check_out_rows``'s padded tokens, its
    bounds checked under ``name``)."""
    check_out_rows(name, x, out_rows, most)
    return torch.nn.functional.pad(x, (0, 0, 0, out_rows - x.shape[0]))
