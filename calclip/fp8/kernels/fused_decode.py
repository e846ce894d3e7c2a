"""The fused decode GEMM in Triton: the forward y = Q1x128(x) Q128x128(W)^T in ONE launch, x's 1x128 groups quantized
in the GEMM's prologue (FP8BlockLinear's no-grad calls of few rows, ``Fp8Config.decode_fused_max_m``).

Torch reference: ``calclip.fp8.gemm.emulated_block_gemm(*calclip.fp8.reference.quantize_1x128(x), qw, sw)``; on the
GPU it equals ``block_gemm.fp8_block_gemm_triton(*quantize.quantize_1x128(x), qw, sw)`` bit for bit (the same
quantizer helpers, the same K step and accumulation order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from calclip.fp8.config import BLOCK, FP8_DTYPE
from calclip.fp8.kernels.block_gemm import _GEMM_OUT_DTYPES
from calclip.fp8.kernels.launch import (
    _as_float_input, _bucket, _ceil_div, _check_2d, _check_device, _counter_operands, _Tuned,
)
from calclip.fp8.kernels.numerics import _abs_max, _block_scale, _e4m3fn_in_registers, _scaled_codes
from calclip.fp8.kernels.quantize import quantize_1x128


# ----------------------------------------------------------------------------------------------------------
# Small-M forward with the activation quantization in the GEMM's prologue: one launch per linear (decode).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _rounded_to_16_bits(x, ROUND: tl.constexpr, SOFT_FP8: tl.constexpr):
    """fp32 x -> the fp32 value of x rounded to bf16 (ROUND 1) or fp16 (ROUND 2), round-to-nearest-even with
    overflow to inf, as torch's x.to(bf16 / fp16) rounds; ROUND 0: x. Under the interpreter (SOFT_FP8) the bf16
    rounding is done on the bits, since the interpreter's own cast truncates (its fp16 cast is numpy's, RTNE)."""
    if ROUND == 1:
        if SOFT_FP8:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            x = tl.where(x != x, x, rounded)  # NaN stays NaN (the carry could make it inf)
        else:
            x = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    elif ROUND == 2:
        if SOFT_FP8:
            x = x.to(tl.float16).to(tl.float32)
        else:
            x = x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    return x


@triton.jit
def _fused_quant_gemm_step(acc, row_bad, x_ptrs, row_mask, b_ptrs, sb_ptrs, k0, K, stride_bk, stride_sbk,
                           POW2: tl.constexpr, SOFT_FP8: tl.constexpr, BLOCK_K: tl.constexpr,
                           ROUND: tl.constexpr):
    """One K block (= one 1x128 group of every row): quantize the x tile as _quantize_1x128_kernel does, then
    ``acc += (codes @ b_blk) * sx x sb`` exactly as _fp8_block_gemm_step does. row_bad [BLOCK_M] int32 |= the
    rows whose group is non-finite. x_ptrs [BLOCK_M, 1] / b_ptrs [1, BLOCK_N] point at column 0. ROUND: fp32 x
    rounded to bf16 / fp16 first (`_rounded_to_16_bits`), the autocast cast done in registers."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K  # ragged last group: masked x are 0 (amax unchanged), masked weight codes are 0
    valid = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptrs + offs_k[None, :], mask=valid, other=0.0).to(tl.float32)
    x = _rounded_to_16_bits(x, ROUND, SOFT_FP8)
    amax = _abs_max(x, 1)  # [BLOCK_M]
    nonfinite = amax == float("inf")
    sa = _block_scale(amax, nonfinite, POW2)
    # The masked elements (padding rows of a decode tile, a ragged group's tail) divide 1 instead of 0 and their
    # code is then set to 0, the code 0 / scale gives. A zero dividend over the floor scale takes the IEEE
    # division's slow path, and at decode's M << BLOCK_M nearly every element of the tile is padding: on the H200
    # M=1 ran slower than M=64 before, faster after (docs/benchmarks-log.md, fourth session).
    codes = _scaled_codes(tl.where(valid, x, 1.0), sa[:, None], nonfinite[:, None])
    a = _e4m3fn_in_registers(tl.where(valid, codes, 0.0), SOFT_FP8)
    b = tl.load(b_ptrs + offs_k[:, None] * stride_bk, mask=k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
    sb = tl.load(sb_ptrs + (k0 // BLOCK_K) * stride_sbk)
    acc = acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])
    return acc, tl.maximum(row_bad, nonfinite.to(tl.int32))


@triton.jit
def _fp8_linear_fused_quant_kernel(
    x_ptr, b_ptr, c_ptr, sb_ptr,  # x [M, K] (last dim contiguous), b [N, K] e4m3fn, c [M, N], sb [N/128, K/128]
    count_ptr, weight_bad_ptr,  # COUNT only: int64 [] counter += bad rows; bool [] "the weight has a NaN block"
    M, N, K,
    stride_xm, stride_bn, stride_bk, stride_cm, stride_cn, stride_sbn, stride_sbk,
    M_BUCKET,  # autotune key only
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr, COUNT: tl.constexpr, ROUND: tl.constexpr, MEMBERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] tile of c = Q1x128(x) Q128x128(W)^T. Each program quantizes its rows'
    groups itself, so no codes go through memory; every N tile redoes that work, which on the H200 made this
    kernel's GPU time higher than quantize + GEMM at every decode shape (see _FUSED_CONFIGS).

    COUNT: the programs of the first N tile (they hold every K group of their rows) add the number of their
    rows with a non-finite group (every valid row when ``weight_bad_ptr`` is set) to ``count_ptr``: each row
    once, as quantize_1x128's counting kernel does. MEMBERS > 1: b holds the codes of that many sibling linears
    that read the same x (q/k/v, gate/up; siblings.py), ``weight_bad_ptr`` the number of them whose weight has a
    NaN block (int32 []), and the count is what the siblings' own calls would add together."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M  # masked rows load zeros: finite, never stored, never counted
    # Weight columns past N wrap around (in bounds, never stored), as in _fp8_block_gemm_kernel.
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    sb_ptrs = sb_ptr + (offs_n // BLOCK_K) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_bad = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if SOFT_FP8:  # the interpreter passes K as a 1-element array (see _fp8_block_gemm_kernel)
        k0 = 0
        while k0 < K:
            acc, row_bad = _fused_quant_gemm_step(acc, row_bad, x_ptrs, row_mask, b_ptrs, sb_ptrs, k0, K,
                                                  stride_bk, stride_sbk, POW2, SOFT_FP8, BLOCK_K, ROUND)
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            acc, row_bad = _fused_quant_gemm_step(acc, row_bad, x_ptrs, row_mask, b_ptrs, sb_ptrs, k0, K,
                                                  stride_bk, stride_sbk, POW2, SOFT_FP8, BLOCK_K, ROUND)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < N))
    if COUNT:
        bad_members = tl.load(weight_bad_ptr).to(tl.int32)  # one linear: its flag, 0 or 1
        n_bad = (bad_members * tl.sum(row_mask.to(tl.int32), axis=0)
                 + (MEMBERS - bad_members) * tl.sum(row_bad, axis=0))
        tl.atomic_add(count_ptr, n_bad.to(tl.int64), mask=(n_bad > 0) & (pid_n == 0))


# BLOCK_M is 64 in every config, although decode has fewer rows: on sm_90 Triton runs a BLOCK_M >= 64 FP8 dot on
# Hopper's FP8 wgmma (like every config of the unfused GEMM) but a BLOCK_M 16/32 one on mma.sync with the codes
# upcast to f16, which sums a K block with other rounding; one MMA family keeps the outputs independent of which
# config the autotuner picks, and equal to the unfused path's. Masked rows cost no memory traffic, but every program
# quantizes its BLOCK_M x 128 x tile per K step (an IEEE division per element): on the H200 the first configs (4
# warps) took several times the GPU time of quantize + GEMM (docs/benchmarks-log.md), so 8-warp configs share it among
# more warps; the kernel stays slower than the two launches on the GPU and pays only where the host's time decides.
# BLOCK_N 32 gives narrow layers (SmolLM2's k/v, N = 192) more programs.
_FUSED_DEFAULT = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3)
_FUSED_CONFIGS = [
    _FUSED_DEFAULT,
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256}, num_warps=8, num_stages=2),
]
_fp8_linear_fused_quant_tuned = _Tuned(_fp8_linear_fused_quant_kernel, _FUSED_CONFIGS, key=["M_BUCKET", "N", "K"],
                                       restore_value=["count_ptr"])


_ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def fp8_linear_fused_quant_gemm(x2: Tensor, qw: Tensor, sw: Tensor, *, out_dtype: torch.dtype,
                                nonfinite_count: Tensor | None = None, weight_bad: Tensor | None = None,
                                pow2: bool = False, round_to: torch.dtype | None = None) -> Tensor:
    """y = Q1x128(x2) Q128x128(W)^T in ONE launch: the 1x128 activation groups are quantized in the GEMM's
    prologue, in registers, never stored. Made for small M (decode); large M re-quantizes x once per N tile.

    x2: [M, K] bf16/fp16/fp32 (fp64 rounded to fp32), last dim contiguous (else copied), M and K ragged allowed
    qw: [N, K] float8_e4m3fn, any strides;   sw: float32 [ceil(N/128), ceil(K/128)], any strides
    -> y [M, N] out_dtype (bf16/fp16/fp32), contiguous.
    Bit for bit ``fp8_block_gemm_triton(*quantize_1x128(x2, pow2=pow2), qw, sw, out_dtype=out_dtype)``: the same
    codes and scales (the quantizer's jit helpers), the same per-K-block products and accumulation order.
    ``nonfinite_count`` / ``weight_bad``: as in quantize_1x128 (the same number is added, inside the kernel).
    ``round_to`` (bf16 / fp16, fp32 x2 only): x2 is first rounded to that dtype in registers, so the result is
    bit for bit that of ``x2.to(round_to)``: the autocast cast of an fp32 activation without its own launch.
    """
    if round_to is not None and (round_to not in _ROUND_CODES or x2.dtype != torch.float32):
        raise ValueError(f"round_to must be torch.bfloat16 or torch.float16 with an fp32 x2, got {round_to} with "
                         f"{x2.dtype}")
    soft_fp8 = _check_device(x2, qw, sw)
    _check_2d("fp8_linear_fused_quant_gemm", x2)
    x2 = _as_float_input(x2)
    if qw.dtype != FP8_DTYPE or qw.dim() != 2 or qw.shape[1] != x2.shape[1]:
        raise ValueError(f"qw must be {FP8_DTYPE} [N, {x2.shape[1]}], got {qw.dtype} {tuple(qw.shape)}")
    if out_dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_GEMM_OUT_DTYPES}, got {out_dtype}")
    (m, k), n = x2.shape, qw.shape[0]
    kb = _ceil_div(k, BLOCK)
    want = (_ceil_div(n, BLOCK), kb)
    if sw.dtype != torch.float32 or tuple(sw.shape) != want:
        raise ValueError(f"sw must be float32 {want} (128x128 blocks of qw), got {sw.dtype} {tuple(sw.shape)}")
    count = nonfinite_count is not None
    if count:
        _, weight_bad = _counter_operands(x2, nonfinite_count, weight_bad)
        if weight_bad.dtype != torch.bool or weight_bad.numel() != 1:
            raise ValueError(f"weight_bad must be a bool [] tensor, got {weight_bad.dtype} {tuple(weight_bad.shape)}")
    y = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0 or k == 0:  # nothing to count either: quantize_1x128 of an empty x adds nothing
        return y.zero_()
    if n == 0:  # no output to fuse into; the rows are still counted as the unfused layer counts them
        if count:
            quantize_1x128(x2 if round_to is None else x2.to(round_to), pow2=pow2, nonfinite_count=nonfinite_count,
                           weight_bad=weight_bad)
        return y
    _launch_fused_quant_gemm(x2, qw, sw, y, nonfinite_count, weight_bad, pow2, round_to, soft_fp8)
    return y


def _launch_fused_quant_gemm(x2: Tensor, qw: Tensor, sw: Tensor, y: Tensor, nonfinite_count: Tensor | None,
                             weight_bad: Tensor | None, pow2: bool, round_to: torch.dtype | None,
                             soft_fp8: bool, members: int = 1) -> None:
    """The launch of fp8_linear_fused_quant_gemm for checked operands with M, N, K >= 1, into y [M, N]."""
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    count = nonfinite_count is not None
    if not count:
        nonfinite_count = weight_bad = sw  # unused (COUNT=False); any pointer will do
    (m, k), n = x2.shape, qw.shape[0]
    bucket = _bucket(m)
    _fp8_linear_fused_quant_tuned.launch(
        lambda meta: (_ceil_div(m, meta["BLOCK_M"]), _ceil_div(n, meta["BLOCK_N"])),
        (bucket, n, k, x2.dtype, y.dtype, count, round_to, members), soft_fp8,
        x2, qw, y, sw, nonfinite_count, weight_bad, m, n, k,
        x2.stride(0), qw.stride(0), qw.stride(1), y.stride(0), y.stride(1), sw.stride(0), sw.stride(1), bucket,
        POW2=pow2, SOFT_FP8=soft_fp8, COUNT=count, ROUND=_ROUND_CODES[round_to], MEMBERS=members, BLOCK_K=BLOCK)


def fp8_linear_decode_unchecked(x2: Tensor, qw: Tensor, sw: Tensor, *, out_dtype: torch.dtype,
                                nonfinite_count: Tensor, weight_bad: Tensor, pow2: bool = False,
                                round_to: torch.dtype | None = None, members: int = 1) -> Tensor:
    """fp8_linear_fused_quant_gemm for FP8BlockLinear's eager decode, without the argument checks: they cost host
    time on every call, and decode calls every linear once per token, where the host's time decides.
    The caller guarantees what the checks would: x2 [M, K] bf16/fp16/fp32 with M >= 1, on the device of the layer's
    own qw [N, K] e4m3fn (K >= 1, N >= 1) and sw [ceil(N/128), ceil(K/128)] fp32, counter int64 [] and flag bool [];
    round_to only with an fp32 x2; out_dtype bf16/fp16/fp32. ``members`` > 1: qw/sw are the stacked codes of that
    many sibling linears (siblings.py) and ``weight_bad`` the int32 [] number of them with a NaN block."""
    y = torch.empty(x2.shape[0], qw.shape[0], dtype=out_dtype, device=x2.device)
    _launch_fused_quant_gemm(x2, qw, sw, y, nonfinite_count, weight_bad, pow2, round_to, _check_device(x2), members)
    return y
