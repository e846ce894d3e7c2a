"""The small-M forward GEMM split along K, in Triton: enough programs to stream the weight at decode's few rows.

Torch reference: ``calclip.fp8.gemm.emulated_block_gemm`` with (1x128, 128x128) operands; it runs the block GEMM's
own K step (``block_gemm._fp8_block_gemm_step``), so the two Triton GEMMs differ only in fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from calclip.fp8.config import BLOCK
from calclip.fp8.kernels.block_gemm import _checked_gemm_operands, _fp8_block_gemm_step
from calclip.fp8.kernels.launch import _bucket, _ceil_div, _Tuned
from calclip.fp8.tracing import size_hint


# ----------------------------------------------------------------------------------------------------------
# Small-M forward GEMM, split along K: enough programs to stream the weight at decode's few rows.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_splitk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, p_ptr, sa_ptr, sb_ptr,  # a [M, K], b [N, K] e4m3fn; c [M, N]; p [SPLIT, M, N] fp32
    M, N, K, KB_PER_SPLIT,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    M_BUCKET,  # autotune key only
    SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: the K blocks [pid_s * KB_PER_SPLIT, (pid_s + 1) * KB_PER_SPLIT) of a [BLOCK_M, BLOCK_N] tile of
    c = (a * sa) @ (b * sb)^T, a 1x128-scaled (sa [M, KB]), b 128x128-scaled (sb [N/128, KB]). Each K step is
    _fp8_block_gemm_step, the unfused GEMM's. SPLIT == 1 stores c; else the fp32 partial sum goes to p[pid_s] and
    _splitk_reduce_kernel adds the SPLIT partials in a fixed order (deterministic: no atomics)."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # rows/columns past M/N wrap (in bounds, never stored)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    sa_ptrs = sa_ptr + offs_m * stride_sam
    sb_ptrs = sb_ptr + (offs_n // BLOCK_K) * stride_sbn
    k_first = pid_s * KB_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(k_first + KB_PER_SPLIT * BLOCK_K, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter passes ints as 1-element arrays (see _fp8_block_gemm_kernel)
        k0 = k_first
        while k0 < k_end:
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)
            k0 += BLOCK_K
    else:
        for k0 in range(k_first, k_end, BLOCK_K):
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT == 1:
        c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = p_ptr + (pid_s * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(p_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """c (contiguous [M, N], MN elements) = sum over s = 0 .. SPLIT-1 of p[s] (fp32, in that order), cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# BLOCK_M 64 in every config, as in _FUSED_CONFIGS: a BLOCK_M >= 64 FP8 dot runs on Hopper's FP8 wgmma, like every
# config of the unfused GEMM, so a K block's partial product is summed the same way whichever config runs.
_SPLITK_DEFAULT = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=4)
_SPLITK_CONFIGS = [
    _SPLITK_DEFAULT,
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=6),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=6),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=4),
]
_splitk_tuned: dict[int, _Tuned] = {}
_REDUCE_CONFIG = triton.Config({"BLOCK": 1024}, num_warps=4)
_splitk_reduce = _Tuned(_splitk_reduce_kernel, [_REDUCE_CONFIG], key=["MN"])
SPLITK_MAX_SPLIT = 16
_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 8 for CPU tensors under the interpreter (tests), and the
    H200's 132 for a trace on fake CUDA tensors where no CUDA runtime exists (nothing can run there anyway)."""
    if device.type != "cuda":
        return 8
    if not torch.cuda.is_available():
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def splitk_splits(m: int, n: int, k: int, sms: int) -> int:
    """How many K ranges the small-M GEMM splits into: doubled (up to SPLITK_MAX_SPLIT, at least two K blocks per
    range) while the programs of 64 x 64 tiles still fit on the device's ``sms`` multiprocessors at once. Decode
    shapes give few output tiles (N = 2048 at M = 64: 32), too few programs to stream the weight at full bandwidth."""
    tiles = _ceil_div(m, 64) * _ceil_div(n, 64)
    kb = _ceil_div(k, BLOCK)
    split = 1
    while split * 2 <= SPLITK_MAX_SPLIT and tiles * split * 2 <= sms and kb >= split * 4:
        split *= 2
    return split


def _splitk_kernel(split: int) -> _Tuned:
    tuned = _splitk_tuned.get(split)
    if tuned is None:
        tuned = _splitk_tuned[split] = _Tuned(_fp8_splitk_gemm_kernel, _SPLITK_CONFIGS, key=["M_BUCKET", "N", "K"])
    return tuned


def fp8_splitk_gemm_triton(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype,
                           split: int | None = None) -> Tensor:
    """The forward GEMM y = (qa * sa) @ (qb * sb)^T for few rows (decode): fp8_block_gemm_triton's math (the same
    K step), with K split into ``split`` ranges (default ``splitk_splits`` for the device) whose fp32 partial sums
    a second launch adds in a fixed order. Same values as fp8_block_gemm_triton up to fp32 summation order.

    qa: [M, K] float8_e4m3fn, sa: float32 [M, ceil(K/128)] (1x128), any strides
    qb: [N, K] float8_e4m3fn, sb: float32 [ceil(N/128), ceil(K/128)] (128x128), any strides
    -> y [M, N] out_dtype (bf16/fp16/fp32), contiguous. Extra memory: split x M x N fp32 while it runs (split > 1).
    """
    soft_fp8, m, n, k, kb = _checked_gemm_operands(qa, sa, qb, sb, out_dtype)
    for name, s, want in (("sa", sa, (m, kb)), ("sb", sb, (_ceil_div(n, BLOCK), kb))):
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"{name} must be float32 {want}, got {s.dtype} {tuple(s.shape)}")
    if split is None:  # symbolic sizes (torch.compile, dynamic shapes) by their hints: any split is correct
        split = splitk_splits(*(size_hint(d) or 1 for d in (m, n, k)), sm_count(qa.device))
    if type(split) is not int or not 1 <= split <= SPLITK_MAX_SPLIT:
        raise ValueError(f"split must be an int in [1, {SPLITK_MAX_SPLIT}], got {split!r}")
    y = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    per = _ceil_div(kb, split)  # K blocks per range; the ranges cover every block at any (symbolic) K
    if type(per) is int:
        split = _ceil_div(kb, per)  # no empty K range
    partial = torch.empty(split, m, n, dtype=torch.float32, device=qa.device) if split > 1 else y
    bucket = _bucket(m)
    _splitk_kernel(split).launch(
        lambda meta: (_ceil_div(n, meta["BLOCK_N"]), split, _ceil_div(m, meta["BLOCK_M"])),
        (bucket, n, k, out_dtype), soft_fp8,
        qa, qb, y, partial, sa, sb, m, n, k, per,
        qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1), y.stride(0), y.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), bucket,
        SPLIT=split, INTERPRET=soft_fp8, BLOCK_K=BLOCK)
    if split > 1:
        mn = m * n
        _splitk_reduce.launch(lambda meta: (_ceil_div(mn, meta["BLOCK"]),), (mn,), soft_fp8,
                              partial, y, mn, SPLIT=split)
    return y
