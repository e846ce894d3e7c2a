"""Producer kernels: the elementwise end of a decoder layer's RMSNorm and of its SiLU-multiply, with the FP8
quantization of their output for the linears that read it, from the registers that hold the output.

    rms_norm_quantize   y = w * bf16(float(x) * rstd)            (HF LlamaRMSNorm's last two ops; rstd from torch)
    mul_quantize        y = a * b                                (HF LlamaMLP's act_fn(gate) * up; act_fn from torch)

Each returns y (in the inputs' dtype) and, from that y, exactly what ``quantize_1x128(y)`` and
``quantize_128x1(y)`` give with ``gemm_layout=True`` (same codes, same scale values and strides) plus their
non-finite row count for ``members`` linears (``quantize_1x128``'s ``members`` / ``weight_bad`` rule). The plain-torch
twins are ``calclip.fp8.producers.rms_norm_quantize_reference`` / ``mul_quantize_reference``.

Only the elementwise ops are fused: the norm's variance (a reduction) and SiLU (an exp) stay torch ops, so y is
HF's y bit for bit (a reduction order or an exp approximation of our own would not be). Every op here is one IEEE
fp32 multiply rounded once to the output dtype, which is what torch's bf16 elementwise ops compute.

One program: a [GROUP, GROUP] tile (128 rows x 128 columns): its row amaxes are GROUP 1x128 groups, its column amaxes
one 128x1 group per column. A row is counted by the program of its first column
tile with a non-finite group (a program that finds such rows re-derives their earlier values: rare, never in a
healthy run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from calclip.fp8.config import BLOCK, FP8_DTYPE
from calclip.fp8.kernels.launch import _bucket, _ceil_div, _check_block, _check_device, _codes_out, _Tuned
from calclip.fp8.kernels.numerics import _abs_max, _block_scale, _scaled_codes, _store_codes
from calclip.fp8.kernels.quantize import _scales_out
from calclip.fp8.reference import check_out_rows

_KIND_RMS_NORM = tl.constexpr(0)
_KIND_MUL = tl.constexpr(1)
_BF16_MASK = tl.constexpr(-65536)  # 0xFFFF0000 as int32: the bf16 bits of an fp32


@triton.jit
def _round_to_out(v, OUT_BF16: tl.constexpr, SOFT: tl.constexpr):
    """fp32 -> the nearest value of the output dtype (bf16: round to nearest even; fp32: itself), as fp32.
    Under the interpreter in software: its fp32 -> bf16 cast is not guaranteed to round to nearest even."""
    if OUT_BF16:
        if SOFT:
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & _BF16_MASK
            v = tl.where(v == v, bits.to(tl.float32, bitcast=True), v)
        else:
            v = v.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    return v


@triton.jit
def _producer_values(a_ptr, b_ptr, r_ptr, rows, cols, M, K, stride_am, stride_bm,
                     KIND: tl.constexpr, OUT_BF16: tl.constexpr, SOFT: tl.constexpr):
    """The producer's output for rows x cols (fp32, each value one of the output dtype; 0 outside [M, K]).
    RMS norm: a = x [M, K], b = weight [K], r = rstd [M]; mul: a, b [M, K]."""
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    a = tl.load(a_ptr + rows[:, None] * stride_am + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if KIND == _KIND_RMS_NORM:
        r = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
        w = tl.load(b_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        normed = _round_to_out(a * r[:, None], OUT_BF16, SOFT)  # hidden_states.to(input_dtype)
        y = _round_to_out(w[None, :] * normed, OUT_BF16, SOFT)  # self.weight * ...
    else:
        b = tl.load(b_ptr + rows[:, None] * stride_bm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = _round_to_out(a * b, OUT_BF16, SOFT)
    return tl.where(mask, y, 0.0)  # an Inf weight times a padding row's 0 would be NaN: padding must stay 0


@triton.jit
def _nonfinite_rows_before(a_ptr, b_ptr, r_ptr, rows, wanted, end_col, M, K, stride_am, stride_bm,
                           KIND: tl.constexpr, OUT_BF16: tl.constexpr, SOFT: tl.constexpr, GROUP: tl.constexpr):
    """int32 [GROUP]: 1 where a ``wanted`` row has a non-finite output in columns [0, end_col) (recomputed, one
    column tile at a time; rows not wanted are masked out)."""
    found = tl.zeros_like(wanted)
    live_rows = tl.where(wanted != 0, rows, M)  # rows >= M load nothing
    col0 = end_col * 0
    while col0 < end_col:
        cols = col0 + tl.arange(0, GROUP)
        y = _producer_values(a_ptr, b_ptr, r_ptr, live_rows, cols, M, K, stride_am, stride_bm, KIND, OUT_BF16, SOFT)
        found = tl.maximum(found, (_abs_max(y, 1) == float("inf")).to(tl.int32))
        col0 += GROUP
    return found


@triton.jit
def _producer_quantize_kernel(
    a_ptr, b_ptr, r_ptr, y_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr, count_ptr, weight_bad_ptr,
    # a [M, K] (last dim contiguous); b [K] (RMS norm) or [M, K]; r [M] fp32 (RMS norm); y [M, K] contiguous;
    # q_row [M, K] contiguous, s_row [M, NBK] any strides; q_col^T [K, M_CODES] contiguous (M_CODES =
    # wgrad_rows(M): zero codes past M), s_col [NBM, K] any strides;
    # count int64 [] (+= non-finite rows, MEMBERS linears); weight_bad int32 [] (bad weights among them)
    M, K, M_CODES, stride_am, stride_bm, stride_srm, stride_srk, stride_scm, stride_sck,
    M_ROW,  # q_row / s_row rows written, M <= M_ROW <= ceil(M / GROUP) * GROUP: those past M zero tokens
    K_BUCKET, M_BUCKET,  # autotune key only
    KIND: tl.constexpr, OUT_BF16: tl.constexpr, NEED_T: tl.constexpr, POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    MEMBERS: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    cols = (pid_k * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    y = _producer_values(a_ptr, b_ptr, r_ptr, rows, cols, M, K, stride_am, stride_bm, KIND, OUT_BF16, SOFT_FP8)
    # y's values are exact in its dtype, so this store rounds nothing (the interpreter's truncating cast included)
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    row_amax = _abs_max(y, 1)  # [GROUP]: one 1x128 group per row
    row_nonfinite = row_amax == float("inf")
    row_scale = _block_scale(row_amax, row_nonfinite, POW2)
    _store_codes(q_row_ptr + rows[:, None] * K + cols[None, :],
                 _scaled_codes(y, row_scale[:, None], row_nonfinite[:, None]),
                 (rows[:, None] < M_ROW) & (cols[None, :] < K), SOFT_FP8)
    tl.store(s_row_ptr + rows * stride_srm + pid_k * stride_srk, row_scale, mask=rows < M_ROW)

    if NEED_T:
        col_amax = _abs_max(y, 0)  # [GROUP]: one 128x1 group per column
        col_nonfinite = col_amax == float("inf")
        col_scale = _block_scale(col_amax, col_nonfinite, POW2)
        col_codes = tl.where(rows[:, None] < M, _scaled_codes(y, col_scale[None, :], col_nonfinite[None, :]), 0.0)
        _store_codes(q_col_ptr + cols[None, :] * M_CODES + rows[:, None], col_codes,
                     (rows[:, None] < M_CODES) & (cols[None, :] < K), SOFT_FP8)
        tl.store(s_col_ptr + pid_m * stride_scm + cols * stride_sck, col_scale, mask=cols < K)

    # The count quantize_1x128(..., members=MEMBERS) adds: every row per bad weight, non-finite rows per healthy one
    bad_members = tl.load(weight_bad_ptr).to(tl.int32)
    n_bad = bad_members * tl.sum((rows < M).to(tl.int32), axis=0) * (pid_k == 0).to(tl.int32)
    if bad_members < MEMBERS:
        row_bad = row_nonfinite.to(tl.int32)  # rows past M are finite zeros
        n_rows = tl.sum(row_bad, axis=0)
        if n_rows > 0:
            earlier = _nonfinite_rows_before(a_ptr, b_ptr, r_ptr, rows, row_bad, pid_k * GROUP, M, K, stride_am,
                                             stride_bm, KIND, OUT_BF16, SOFT_FP8, GROUP)
            n_rows = tl.sum(row_bad * (1 - earlier), axis=0)
        n_bad += (MEMBERS - bad_members) * n_rows
    tl.atomic_add(count_ptr, n_bad.to(tl.int64), mask=n_bad > 0)


_PRODUCER_CONFIGS = [
    triton.Config({}, num_warps=8),
    triton.Config({}, num_warps=4),
    triton.Config({}, num_warps=16),
]
_producer_tuned = _Tuned(_producer_quantize_kernel, _PRODUCER_CONFIGS, key=["K_BUCKET", "M_BUCKET"],
                         restore_value=["count_ptr"])

PRODUCER_DTYPES = (torch.bfloat16, torch.float32)


def _check_operands(name: str, a: Tensor, weight_bad: Tensor, members: int) -> None:
    if a.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [M, K] input, got shape {tuple(a.shape)}")
    if a.dtype not in PRODUCER_DTYPES:
        raise TypeError(f"{name}: the input must be bf16 or fp32, got {a.dtype}")
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"{name}: members must be an int >= 1, got {members!r}")
    if weight_bad.dtype != torch.int32 or weight_bad.numel() != 1:
        raise ValueError(f"{name}: weight_bad must be an int32 [] tensor, got {weight_bad.dtype} "
                         f"{tuple(weight_bad.shape)}")


def _launch(kind: int, a: Tensor, b: Tensor, r: Tensor, weight_bad: Tensor, members: int, need_t: bool,
            pow2: bool, block: int, out_rows=None) -> tuple[Tensor, ...]:
    _check_block(block)
    soft_fp8 = _check_device(a, b, r, weight_bad)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    nbm, nbk = _ceil_div(m, block), _ceil_div(k, block)
    m_row = check_out_rows("rms_norm_quantize" if kind == 0 else "mul_quantize", a, out_rows, most=nbm * block)
    device = a.device
    y = torch.empty(m, k, dtype=a.dtype, device=device)
    q_row = torch.empty(m_row, k, dtype=FP8_DTYPE, device=device)
    s_row = _scales_out(m_row, nbk, True, device)  # gemm_layout: column-major, as quantize_1x128 gives it
    m_codes = nbm * block  # reference.wgrad_rows(m): the wgrad GEMM's padded token rows
    q_col_t = torch.empty(k if need_t else 0, m_codes if need_t else 0, dtype=FP8_DTYPE, device=device)
    s_col = _scales_out(nbm if need_t else 0, k if need_t else 0, False, device)  # gemm_layout: row-major
    count = torch.zeros((), dtype=torch.int64, device=device)
    if a.numel():
        _producer_tuned.launch(
            lambda meta: (nbm, nbk), (_bucket(k), _bucket(m), a.dtype), soft_fp8,
            a, b, r, y, _codes_out(q_row, soft_fp8), s_row, _codes_out(q_col_t, soft_fp8) if need_t else q_row,
            s_col if need_t else s_row, count, weight_bad,
            m, k, m_codes, a.stride(0), b.stride(0), s_row.stride(0), s_row.stride(1),
            s_col.stride(0) if need_t else 0, s_col.stride(1) if need_t else 0, m_row, _bucket(k), _bucket(m),
            KIND=kind, OUT_BF16=a.dtype == torch.bfloat16, NEED_T=need_t, POW2=pow2, SOFT_FP8=soft_fp8,
            MEMBERS=members, GROUP=block)
    return y, q_row, s_row, q_col_t.t(), s_col, count


def rms_norm_quantize(x: Tensor, rstd: Tensor, weight: Tensor, weight_bad: Tensor, *, members: int = 1,
                      need_t: bool = True, pow2: bool = False, block: int = BLOCK,
                      out_rows=None) -> tuple[Tensor, ...]:
    """y = weight * (x.float() * rstd).to(x.dtype), with y's FP8 codes.

    x: [M, K] bf16/fp32 (last dim contiguous or copied); rstd: fp32 [M] or [M, 1] (HF's torch.rsqrt(variance + eps));
    weight: [K] in x's dtype; weight_bad: int32 [] number of bad weights among the ``members`` linears reading y
    -> (y [M, K] x.dtype, q_row, s_row, q_col, s_col, count int64 []): quantize_1x128(y, gemm_layout=True),
    quantize_128x1(y, gemm_layout=True) ([0, 0] each unless ``need_t``) and the non-finite rows those linears count.
    ``out_rows``: q_row and s_row over that many rows, zero tokens past M (``quantize_1x128``'s ``out_rows``; at most
    ceil(M / 128) * 128, the rows the kernel's tiles cover).
    """
    _check_operands("rms_norm_quantize", x, weight_bad, members)
    if weight.dtype != x.dtype or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm_quantize: weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    if rstd.dtype != torch.float32 or rstd.numel() != x.shape[0]:
        raise ValueError(f"rms_norm_quantize: rstd must be fp32 with one value per row ({x.shape[0]}), got "
                         f"{rstd.dtype} {tuple(rstd.shape)}")
    return _launch(0, x, weight.contiguous(), rstd.reshape(-1).contiguous(), weight_bad, members, need_t, pow2,
                   block, out_rows)


def mul_quantize(a: Tensor, b: Tensor, weight_bad: Tensor, *, members: int = 1, need_t: bool = True,
                 pow2: bool = False, block: int = BLOCK, out_rows=None) -> tuple[Tensor, ...]:
    """y = a * b (a = SiLU(gate), b = up), with y's FP8 codes: as ``rms_norm_quantize`` for y = a * b.
    a, b: [M, K] bf16/fp32, one dtype and shape."""
    _check_operands("mul_quantize", a, weight_bad, members)
    if b.shape != a.shape or b.dtype != a.dtype:
        raise ValueError(f"mul_quantize: b must be {tuple(a.shape)} {a.dtype} like a, got {tuple(b.shape)} {b.dtype}")
    if b.stride(-1) != 1:
        b = b.contiguous()
    return _launch(1, a, b, a, weight_bad, members, need_t, pow2, block, out_rows)
