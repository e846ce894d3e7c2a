"""The block-scaled FP8 GEMM in Triton: y = (qa * sa) @ (qb * sb)^T, scales applied per 128-wide K chunk in fp32,
for every layout pair of the recipe's three GEMMs (forward, dgrad, wgrad).

Torch reference: ``calclip.fp8.gemm.emulated_block_gemm`` (dequantize both operands, one fp32 matmul); the two
agree within fp32 summation order (tests/fp8/_gemm_bound.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from calclip.fp8.config import BLOCK, FP8_DTYPE
from calclip.fp8.kernels.launch import _bucket, _ceil_div, _check_device, _Tuned


# ----------------------------------------------------------------------------------------------------------
# Block-scaled FP8 GEMM: y = (qa * sa) @ (qb * sb)^T, scales applied per 128-wide K chunk in fp32.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                         stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += (a_blk @ b_blk) * sa x sb for the K block starting at k0 (a multiple of BLOCK_K).

    a_ptrs [BLOCK_M, 1] / b_ptrs [1, BLOCK_N] point at column 0 of their rows; sa_ptrs / sb_ptrs at scale column 0.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K  # ragged last K block: masked codes are zero and contribute nothing
    a = tl.load(a_ptrs + offs_k[None, :] * stride_ak, mask=k_mask[None, :], other=0.0)
    b = tl.load(b_ptrs + offs_k[:, None] * stride_bk, mask=k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
    sa = tl.load(sa_ptrs + (k0 // BLOCK_K) * stride_sak)
    sb = tl.load(sb_ptrs + (k0 // BLOCK_K) * stride_sbk)
    return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])


@triton.jit
def _fp8_block_gemm_kernel(
    # a [M, K], b [N, K] e4m3fn, c [M, N]; sa [M or M/128, KB], sb [N or N/128, KB]
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    M_BUCKET,  # autotune key only
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,  # rows sharing one scale: 1 (1x128) or 128 (128x128)
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] tile of c. BLOCK_K is the quantization block (128): every K step's
    partial product is exact in fp32 up to accumulation order, then scaled by sa (per row) x sb (per column)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share their B column tiles while those are hot in L2.
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    # Rows/columns past M/N wrap around (in bounds, never stored), so only K needs a load mask.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am  # [BLOCK_M, 1]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    sa_ptrs = sa_ptr + (offs_m // A_SCALE_ROWS) * stride_sam
    sb_ptrs = sb_ptr + (offs_n // B_SCALE_ROWS) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter passes K as a 1-element array, which numpy >= 2.4 will not turn into an int
        k0 = 0
        while k0 < K:
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


_GEMM_DEFAULT = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4)
_GEMM_CONFIGS = [
    _GEMM_DEFAULT,
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),  # small M (decode)
]
_fp8_block_gemm_tuned = _Tuned(_fp8_block_gemm_kernel, _GEMM_CONFIGS, key=["M_BUCKET", "N", "K"])

_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _scale_rows(rows: int, s: Tensor, kb: int, name: str) -> int:
    """Rows of an operand sharing one scale: 1 for per-row (1x128) scales [rows, KB], 128 for [ceil(rows/128), KB]."""
    if s.dim() != 2 or s.dtype != torch.float32 or s.shape[1] != kb:
        raise ValueError(f"{name} must be float32 [{rows} or {_ceil_div(rows, BLOCK)}, {kb}], got "
                         f"{s.dtype} {tuple(s.shape)}")
    if s.shape[0] == rows:
        return 1  # when rows <= 1 both readings coincide
    if s.shape[0] == _ceil_div(rows, BLOCK):
        return BLOCK
    raise ValueError(f"{name} has {s.shape[0]} rows; expected {rows} (1x128) or {_ceil_div(rows, BLOCK)} (128x128)")


def _checked_gemm_operands(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor,
                           out_dtype: torch.dtype) -> tuple[bool, int, int, int, int]:
    """(soft_fp8, M, N, K, K blocks) of a GEMM's codes qa [M, K], qb [N, K] (scales: checked by the caller)."""
    soft_fp8 = _check_device(qa, sa, qb, sb)
    if qa.dtype != FP8_DTYPE or qb.dtype != FP8_DTYPE:
        raise TypeError(f"qa and qb must be {FP8_DTYPE}, got {qa.dtype} and {qb.dtype}")
    if qa.dim() != 2 or qb.dim() != 2 or qa.shape[1] != qb.shape[1]:
        raise ValueError(f"need qa [M, K] and qb [N, K], got {tuple(qa.shape)} and {tuple(qb.shape)}")
    if out_dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_GEMM_OUT_DTYPES}, got {out_dtype}")
    (m, k), n = qa.shape, qb.shape[0]
    kb = _ceil_div(k, BLOCK)
    return soft_fp8, m, n, k, kb


def fp8_block_gemm_triton(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype) -> Tensor:
    """y = dequant(qa, sa) @ dequant(qb, sb)^T with per-128-K-chunk scaling and fp32 accumulation.

    qa: [M, K] float8_e4m3fn, any strides;   sa: float32 [M, ceil(K/128)] (1x128) or [ceil(M/128), ceil(K/128)]
    qb: [N, K] float8_e4m3fn, any strides;   sb: float32 [ceil(N/128), ceil(K/128)] (128x128) or [N, ceil(K/128)]
    -> y [M, N] out_dtype (bf16/fp16/fp32), contiguous. Scales may have any strides. M, N, K ragged allowed.

    The recipe's three GEMMs: forward y = x W^T: (qx, sx, qw, sw); dgrad dx = dy W: (qdy, sdy, qw.t(), sw.t());
    wgrad dW = dy^T x with 128x1 quantization along tokens: (qdy.t(), sdy.t(), qx.t(), sx.t()) — all views,
    no copies. Fastest when both operands are K-contiguous (Hopper's FP8 MMA reads K-major operands; other
    layouts cost a transpose in shared memory).
    """
    soft_fp8, m, n, k, kb = _checked_gemm_operands(qa, sa, qb, sb, out_dtype)
    a_rows, b_rows = _scale_rows(m, sa, kb, "sa"), _scale_rows(n, sb, kb, "sb")
    y = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()

    bucket = _bucket(m)
    _fp8_block_gemm_tuned.launch(
        lambda meta: (_ceil_div(m, meta["BLOCK_M"]) * _ceil_div(n, meta["BLOCK_N"]),),
        (bucket, n, k, out_dtype, a_rows, b_rows), soft_fp8,
        qa, qb, y, sa, sb, m, n, k,
        qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1), y.stride(0), y.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), bucket,
        A_SCALE_ROWS=a_rows, B_SCALE_ROWS=b_rows, INTERPRET=soft_fp8, BLOCK_K=BLOCK)
    return y
