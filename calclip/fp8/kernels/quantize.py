"""Triton block quantizers, each reproducing its plain-torch twin in ``calclip.fp8.reference`` EXACTLY (the same
fp32 scales bit for bit and the same e4m3fn codes; NaN blocks: NaN scale and NaN codes):

    quantize_1x128             reference.quantize_1x128             (activations, output gradients)
    quantize_128x1             reference.quantize_128x1             (the token axis of the weight-gradient GEMM)
    quantize_128x128           reference.quantize_128x128           (weights)
    requantize_128x128_        quant.requantize_128x128_'s torch path (weights, into existing buffers)

Each op is a pair: a small ``@triton.jit`` kernel and a launcher that checks its inputs, allocates outputs, builds
the grid and launches (``launch._Tuned``). Kernels read every input once (no separate amax pass): a program loads a
tile of whole 128-element groups into registers, reduces it, and writes codes and scales (``numerics``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from calclip.fp8.config import BLOCK, FP8_DTYPE
from calclip.fp8.kernels.launch import (
    _as_float_input, _bucket, _ceil_div, _check_2d, _check_block, _check_device, _codes_out, _counter_operands,
    _Tuned,
)
from calclip.fp8.kernels.numerics import (
    INTERPRETED, _abs_max, _abs_max_lean, _block_scale, _codes, _reciprocal, _scaled_codes, _store_codes,
)
from calclip.fp8.reference import check_out_rows, zero_group_scale


# ----------------------------------------------------------------------------------------------------------
# 1x128: groups of 128 along the last dim (activations, output gradients).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_1x128_groups(x_ptr, q_ptr, s_ptr, rows, first_group, R, K, NB, stride_xr, stride_sr, stride_sg,
                           POW2: tl.constexpr, SOFT_FP8: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                           DIV_FREE: tl.constexpr):
    """Quantize the groups [first_group, first_group + GROUPS) of ``rows`` [BLOCK_R] (int64), loaded once as a
    [BLOCK_R, GROUPS, GROUP] tile -> int32 [BLOCK_R]: 1 where a row has a non-finite group among them. DIV_FREE:
    the codes by ``numerics._codes``' division-free step (the same codes)."""
    groups = first_group + tl.arange(0, GROUPS)
    cols = groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (rows[:, None, None] < R) & (cols < K)  # ragged last group and ragged last row tile
    x = tl.load(x_ptr + rows[:, None, None] * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    amax = _abs_max_lean(x, 2) if DIV_FREE else _abs_max(x, 2)  # [BLOCK_R, GROUPS]
    nonfinite = amax == float("inf")
    scale = _block_scale(amax, nonfinite, POW2)
    codes = _codes(x, scale[:, :, None], _reciprocal(scale)[:, :, None], nonfinite[:, :, None], DIV_FREE)
    _store_codes(q_ptr + rows[:, None, None] * K + cols, codes, mask, SOFT_FP8)
    s_mask = (rows[:, None] < R) & (groups[None, :] < NB)
    tl.store(s_ptr + rows[:, None] * stride_sr + groups[None, :] * stride_sg, scale, mask=s_mask)
    return tl.max(nonfinite.to(tl.int32), axis=1)  # padded groups and rows are finite zeros


@triton.jit
def _nonfinite_rows_before(x_ptr, rows, wanted, end_group, R, K, stride_xr, GROUP: tl.constexpr):
    """int32 [BLOCK_R]: 1 where a ``wanted`` row has a non-finite element in its groups [0, end_group). Only wanted
    rows are read (masked loads), one group at a time: a small tile, so the rare path adds few registers."""
    found = tl.zeros_like(wanted)
    col0 = end_group * 0
    while col0 < end_group * GROUP:
        cols = col0 + tl.arange(0, GROUP)[None, :]
        mask = (wanted[:, None] != 0) & (rows[:, None] < R) & (cols < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
        found = tl.maximum(found, (_abs_max(x, 1) == float("inf")).to(tl.int32))
        col0 += GROUP
    return found


@triton.jit
def _quantize_1x128_kernel(
    x_ptr, q_ptr, s_ptr,  # x [R, K] (last dim contiguous), q [R, K] contiguous, s [R, NB] any strides
    R, K, NB, stride_xr, stride_sr, stride_sg,
    R_BUCKET,  # autotune key only
    count_ptr, weight_bad_ptr,  # COUNT only: int64 [] counter += bad rows; bool [] "the weight has a NaN block"
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
    MEMBERS: tl.constexpr,  # COUNT: linears reading this x (calclip.fp8.shared_input); weight_bad: how many are bad
    DIV_FREE: tl.constexpr,  # codes by numerics._codes' division-free step (every config names it; same codes)
):
    """One program: BLOCK_R rows x GROUPS groups of GROUP elements, loaded once as a [BLOCK_R, GROUPS, GROUP] tile;
    the grid covers rows (axis 0) and chunks of GROUPS groups (axis 1).

    COUNT: also add to ``count_ptr`` the number of rows with a non-finite group (every valid row, once, when
    ``weight_bad_ptr`` is set): the FP8BlockLinear non-finite token count, from registers the program already holds.
    A row is counted by the program of its first chunk with a non-finite group: a program that finds such rows (rare:
    never in a healthy run) reads those rows' earlier groups to drop the ones an earlier chunk counts. So counting
    launches the same grid and tiles as plain quantization and costs nothing while every value is finite.
    MEMBERS > 1: x feeds that many linears (int32 ``weight_bad_ptr``: how many of their weights are bad); the count is
    what each would add on its own, summed: every row per bad weight, the non-finite rows per healthy one."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    first_group = tl.program_id(1) * GROUPS
    row_bad = _quantize_1x128_groups(x_ptr, q_ptr, s_ptr, rows, first_group, R, K, NB, stride_xr, stride_sr,
                                     stride_sg, POW2, SOFT_FP8, GROUPS, GROUP, DIV_FREE)
    if COUNT:
        bad_members = tl.load(weight_bad_ptr).to(tl.int32)  # one linear: its flag, 0 or 1
        n_bad = bad_members * tl.sum((rows < R).to(tl.int32), axis=0) * (first_group == 0).to(tl.int32)
        if bad_members < MEMBERS:
            n_rows = tl.sum(row_bad, axis=0)
            if n_rows > 0:
                earlier = _nonfinite_rows_before(x_ptr, rows, row_bad, first_group, R, K, stride_xr, GROUP)
                n_rows = tl.sum(row_bad * (1 - earlier), axis=0)
            n_bad += (MEMBERS - bad_members) * n_rows
        tl.atomic_add(count_ptr, n_bad.to(tl.int64), mask=n_bad > 0)


# The division-free codes (numerics._codes: the same codes, three instructions per code and a NaN-keeping amax) lead
# the 1x128 and 128x1 tables: on an H100 (2026-12-07, nineteenth session, bench_quant.py --configs, autotune off) the
# 128x1 twin ran at 81-83% of a device copy against the dividing default's 62-63% (1.31x), the 1x128 twins at 96-97%
# against 93-95% (1.01-1.04x), and the Qwen2.5-1.5B step by layer took 91.8-94.1 ms against 95.3-96.4 (three
# alternating process pairs; 7B: 66.9-68.1 against 67.5-68.3). The rest of each table stays dividing (autotune
# candidates; their twins are untimed). The twins' first form (a sign fix-up, a clamp, a per-element select) had run
# slower than dividing (2026-12-06). CALCLIP_DIV_FREE=0 (read at import; part of the compile caches' key) leaves the
# dividing tiles alone in the tables: the A/B switch. Under Triton's interpreter (CPU tests) the tables stay dividing
# too: its tl.fma computes a * b + c with two roundings, not the GPU's single-rounding fma.rn.f32 that Markstein's
# step needs (tests/fp8/test_div_free_codes.py gives the interpreter an exact FMA to test the twins on CPU).
DIV_FREE_DEFAULT = os.environ.get("CALCLIP_DIV_FREE", "1") != "0" and not INTERPRETED


def _default_first(configs: list[triton.Config], div_free_twin: triton.Config) -> list[triton.Config]:
    """``configs`` (dividing tiles, default first) with ``div_free_twin`` in front, unless CALCLIP_DIV_FREE=0."""
    return [div_free_twin, *configs] if DIV_FREE_DEFAULT else configs


_QUANT_1X128_DEFAULT = triton.Config({"BLOCK_R": 16, "GROUPS": 4, "DIV_FREE": False}, num_warps=8)
_QUANT_1X128_DIV_FREE = triton.Config({"BLOCK_R": 16, "GROUPS": 4, "DIV_FREE": True}, num_warps=8)
# division-free twins of the 1x128 training tiles (the first leads the tables; tests/fp8/test_div_free_codes.py pins
# their codes)
_QUANT_1X128_DIV_FREE_TWINS = [_QUANT_1X128_DIV_FREE,
                               triton.Config({"BLOCK_R": 32, "GROUPS": 2, "DIV_FREE": True}, num_warps=8)]
_QUANT_1X128_CONFIGS = _default_first([
    _QUANT_1X128_DEFAULT,
    triton.Config({"BLOCK_R": 8, "GROUPS": 4, "DIV_FREE": False}, num_warps=4),
    triton.Config({"BLOCK_R": 32, "GROUPS": 2, "DIV_FREE": False}, num_warps=8),
    triton.Config({"BLOCK_R": 16, "GROUPS": 8, "DIV_FREE": False}, num_warps=8),
    triton.Config({"BLOCK_R": 4, "GROUPS": 8, "DIV_FREE": False}, num_warps=4),
    triton.Config({"BLOCK_R": 1, "GROUPS": 8, "DIV_FREE": False}, num_warps=4),  # decode: a handful of rows
], _QUANT_1X128_DIV_FREE)
_quantize_1x128_tuned = _Tuned(_quantize_1x128_kernel, _QUANT_1X128_CONFIGS, key=["K", "R_BUCKET"])
# Counting launches: the same tiles, and the counter restored after each autotune timing run. Until 2026-12-02 they
# took whole rows per program (one pass up to K = 16384, chunked beyond); at the Qwen2.5-1.5B row's K = 8960 that
# ran at a fraction of the plain launch's bandwidth (quant_in_situ.py; docs/benchmarks-log.md, fifteenth session).
# Its table is the plain one less the two configs whose counting code spills registers on sm_90 (ptxas: 8 x 4 at 4
# warps, 16 x 8 at 8 warps with power-of-two scales), replaced by 8 x 4 and 8 x 8 at 8 warps.
_QUANT_1X128_COUNT_CONFIGS = _default_first([
    _QUANT_1X128_DEFAULT,
    triton.Config({"BLOCK_R": 8, "GROUPS": 4, "DIV_FREE": False}, num_warps=8),
    triton.Config({"BLOCK_R": 32, "GROUPS": 2, "DIV_FREE": False}, num_warps=8),
    triton.Config({"BLOCK_R": 8, "GROUPS": 8, "DIV_FREE": False}, num_warps=8),
    triton.Config({"BLOCK_R": 4, "GROUPS": 8, "DIV_FREE": False}, num_warps=4),
    triton.Config({"BLOCK_R": 1, "GROUPS": 8, "DIV_FREE": False}, num_warps=4),  # decode: a handful of rows
], _QUANT_1X128_DIV_FREE)
_quantize_1x128_counting_tuned = _Tuned(_quantize_1x128_kernel, _QUANT_1X128_COUNT_CONFIGS, key=["K", "R_BUCKET"],
                                        restore_value=["count_ptr"])


@triton.jit
def _zero_token_rows_kernel(
    q_ptr, s_ptr,  # 1x128 codes q [R_OUT, K] contiguous, scales s [R_OUT, NB] any strides
    R, K, NB, stride_sr, stride_sg, SCALE,  # rows R.. are written; SCALE: an all-zero group's scale (fp32)
    BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """Row R + program_id(0) as a zero token: zero codes in columns of program_id(1)'s BLOCK_K, and SCALE for their
    BLOCK_K / GROUP groups (``quantize_1x128``'s ``out_rows``; at most 15 rows, one program per row and chunk)."""
    row = (R + tl.program_id(0)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(q_ptr + row * K + cols, tl.zeros([BLOCK_K], dtype=q_ptr.dtype.element_ty), mask=cols < K)
    groups = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    tl.store(s_ptr + row * stride_sr + groups * stride_sg, tl.full([BLOCK_K // GROUP], SCALE, tl.float32),
             mask=groups < NB)


_ZERO_ROWS_CONFIGS = [triton.Config({"BLOCK_K": 1024}, num_warps=4)]
_zero_token_rows_tuned = _Tuned(_zero_token_rows_kernel, _ZERO_ROWS_CONFIGS, key=["K"])


def _zero_token_rows(q: Tensor, s: Tensor, r, soft_fp8: bool, pow2: bool) -> None:
    """Rows r.. of the 1x128 codes q [R_OUT, K] and scales s [R_OUT, NB] as zero tokens, in place: one launch (also
    what torch.compile records, like every kernel of this module writing into a fresh buffer)."""
    extra, k = q.shape[0] - r, q.shape[1]
    if type(extra) is int and extra <= 0:
        return
    _zero_token_rows_tuned.launch(
        lambda meta: (extra, _ceil_div(k, meta["BLOCK_K"])), (k,), soft_fp8,
        _codes_out(q, soft_fp8), s, r, k, s.shape[1], s.stride(0), s.stride(1), zero_group_scale(pow2), GROUP=BLOCK)


def _scales_out(rows: int, nb: int, column_major: bool, device: torch.device) -> Tensor:
    """fp32 [rows, nb], row-major, or column-major (the transpose of a contiguous [nb, rows])."""
    if column_major:
        return torch.empty(nb, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, nb, dtype=torch.float32, device=device)


def quantize_1x128(x: Tensor, *, block: int = BLOCK, pow2: bool = False, gemm_layout: bool = False,
                   nonfinite_count: Tensor | None = None, weight_bad: Tensor | None = None,
                   members: int = 1, out_rows=None) -> tuple[Tensor, Tensor]:
    """Quantize in groups of 128 along the last dim (activations, output gradients). Matches the reference.

    x: [..., K] bf16/fp16/fp32 (fp64 rounded to fp32), any leading dims, K ragged allowed
    -> (q float8_e4m3fn [..., K] contiguous, s float32 [..., ceil(K / 128)], x ~= q * s)
    s is contiguous like the reference's; ``gemm_layout=True`` makes it column-major over the flattened rows
    (the strides torch._scaled_mm demands of a 1x128 operand's scale, so gemm.py's re-layout is a no-op).
    nonfinite_count: int64 [] tensor on x's device; when given, the kernel adds the number of rows (tokens)
    with a non-finite group to it — every row when ``weight_bad`` (bool [], optional) is set — without a sync
    or another launch, at any K. Codes and scales are the same with or without it.
    members: the count for that many linears reading x (``calclip.fp8.shared_input``), ``weight_bad`` then an
    int32 [] count of their bad weights: every row per bad weight plus the non-finite rows per healthy one.
    out_rows: a 2-D x [M, K] quantized over out_rows >= M rows (q [out_rows, K], s [out_rows, NB]), the rows past M
    those of zero tokens (zero codes, an all-zero group's scale): ``quantize_1x128`` of x with zero rows appended,
    so torch._scaled_mm takes a ragged token count without a copy of the codes (``gemm.scaled_mm_rows``). The kernel
    writes x's rows and a second launch the at most 15 others (``_zero_token_rows_kernel``: a row bound of its own in
    the quantizer made the counting launch's default tile spill registers on sm_90 with fp32 inputs,
    tests/fp8/test_sm90_compile.py). The count covers x's M rows only.
    """
    _check_block(block)
    count = nonfinite_count is not None
    _check_members(members, weight_bad)
    soft_fp8, weight_bad = _counter_operands(x, nonfinite_count, weight_bad) if count else (_check_device(x), None)
    if x.dim() < 1:
        raise ValueError("quantize_1x128 needs at least one dim")
    x = _as_float_input(x)
    k, nb = x.shape[-1], _ceil_div(x.shape[-1], block)
    r = x.numel() // k if k else 0
    r_out = check_out_rows("quantize_1x128", x, out_rows)
    q = torch.empty(x.shape if out_rows is None else (r_out, k), dtype=FP8_DTYPE, device=x.device)
    s2 = _scales_out(r_out, nb, gemm_layout, x.device)
    s = s2.view(*q.shape[:-1], nb)
    if q.numel() == 0:
        return q, s
    if out_rows is not None:
        _zero_token_rows(q, s2, r, soft_fp8, pow2)
    if x.numel() == 0:
        return q, s
    x2 = x.reshape(r, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    tuned, counter = (_quantize_1x128_counting_tuned, (nonfinite_count, weight_bad)) if count else \
        (_quantize_1x128_tuned, (s2, s2))  # unused pointers when not counting
    tuned.launch(
        lambda meta: (_ceil_div(r, meta["BLOCK_R"]), _ceil_div(nb, meta["GROUPS"])),
        (k, _bucket(r), x2.dtype), soft_fp8,
        x2, _codes_out(q, soft_fp8), s2, r, k, nb, x2.stride(0), s2.stride(0), s2.stride(1), _bucket(r),
        *counter, POW2=pow2, SOFT_FP8=soft_fp8, COUNT=count, GROUP=block, MEMBERS=members)
    return q, s


def _check_members(members: int, weight_bad: Tensor | None) -> None:
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        raise ValueError(f"members must be an int >= 1, got {members!r}")
    if weight_bad is not None and weight_bad.dtype not in (torch.bool, torch.int32):
        raise ValueError(f"weight_bad must be a bool or int32 [] tensor, got {weight_bad.dtype}")


# ----------------------------------------------------------------------------------------------------------
# 128x1: groups of 128 rows along dim 0, one per column (the token axis of the weight-gradient GEMM).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_128x1_kernel(
    x_ptr, q_ptr, s_ptr,  # x [M, K] any strides; q^T [K, M_CODES] contiguous; s [NB, K] any strides
    M, K, M_CODES, stride_xm, stride_xk, stride_sb, stride_sk,  # M_CODES: M, or wgrad_rows(M) (zero codes past M)
    M_BUCKET,  # autotune key only
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
    DIV_FREE: tl.constexpr,  # codes by numerics._codes' division-free step (every config names it; same codes)
    K_FIRST: tl.constexpr,  # grid axis 0 walks column tiles (programs launched together read whole rows), not groups
):
    """One program: one group of GROUP rows x BLOCK_K columns; reduces over rows, stores codes transposed."""
    pid_m, pid_k = (tl.program_id(1), tl.program_id(0)) if K_FIRST else (tl.program_id(0), tl.program_id(1))
    rows = (pid_m * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    cols = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)  # ragged last row group and column tile
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = _abs_max_lean(x, 0) if DIV_FREE else _abs_max(x, 0)  # [BLOCK_K]
    nonfinite = amax == float("inf")
    scale = _block_scale(amax, nonfinite, POW2)
    codes = tl.where(rows[:, None] < M, _codes(x, scale[None, :], _reciprocal(scale)[None, :], nonfinite[None, :],
                                               DIV_FREE), 0.0)
    _store_codes(q_ptr + cols[None, :] * M_CODES + rows[:, None], codes,
                 (rows[:, None] < M_CODES) & (cols[None, :] < K), SOFT_FP8)
    tl.store(s_ptr + pid_m * stride_sb + cols * stride_sk, scale, mask=cols < K)


def _tile_128x1(block_k: int, warps: int, *, div_free: bool = False, k_first: bool = False) -> triton.Config:
    return triton.Config({"BLOCK_K": block_k, "DIV_FREE": div_free, "K_FIRST": k_first}, num_warps=warps)


_QUANT_128X1_DEFAULT = _tile_128x1(64, 8)
_QUANT_128X1_DIV_FREE = _tile_128x1(64, 8, div_free=True)
_QUANT_128X1_CONFIGS = _default_first([
    _QUANT_128X1_DEFAULT,
    _tile_128x1(32, 4),
    _tile_128x1(64, 4),
    _tile_128x1(128, 8),
    _tile_128x1(128, 16),
], _QUANT_128X1_DIV_FREE)
# Candidates: configs kept off the autotune table (so no launch picks them); bench_quant.py --configs pins them, the
# CPU tests pin them against the reference, the sm_90 compile test compiles them. K_FIRST (2026-12-07, eighteenth
# session): the default grid launches the row groups of one column tile together, each program reading 128-byte
# pieces of 128 rows; K_FIRST launches a row group's column tiles together, so the programs resident at once read
# whole rows (about 6 MiB contiguous at 8192 x 4096). Same codes. Timed on an H100 (nineteenth session): 0.996-1.004x
# the default grid, 0.93-0.95x at 128 columns; its twin 1.28-1.29x against the plain twin's 1.31x. Not a lever.
_QUANT_128X1_CANDIDATES = [_tile_128x1(64, 8, k_first=True), _tile_128x1(128, 8, k_first=True)]
_QUANT_128X1_DIV_FREE_TWINS = [_QUANT_128X1_DIV_FREE, _tile_128x1(128, 8, div_free=True),
                               _tile_128x1(64, 8, div_free=True, k_first=True)]
_quantize_128x1_tuned = _Tuned(_quantize_128x1_kernel, _QUANT_128X1_CONFIGS, key=["K", "M_BUCKET"])


def quantize_128x1(x: Tensor, *, block: int = BLOCK, pow2: bool = False,
                   gemm_layout: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D tensor in groups of 128 rows along dim 0, one group per column. Matches the reference.

    x: [M, K] bf16/fp16/fp32, any strides, M and K ragged allowed
    -> (q float8_e4m3fn [M, K], s float32 [ceil(M / 128), K]); like the reference, q is the transpose of a
       contiguous [K, M] tensor (column-major), the layout a GEMM contracting over M reads, and so is s;
       ``gemm_layout=True`` makes s row-major instead (contiguous [ceil(M/128), K]: then the wgrad operands'
       scales s.t() are already column-major, as torch._scaled_mm demands, and gemm.py copies nothing) and pads
       q's token rows to ``reference.wgrad_rows(M)`` with zero codes (q [wgrad_rows(M), K], still column-major).
    """
    _check_block(block)
    soft_fp8 = _check_device(x)
    _check_2d("quantize_128x1", x)
    x = _as_float_input(x)
    m, k = x.shape
    nb = _ceil_div(m, block)
    m_codes = nb * block if gemm_layout else m
    q_t = torch.empty(k, m_codes, dtype=FP8_DTYPE, device=x.device)
    s = _scales_out(nb, k, not gemm_layout, x.device)
    if x.numel() == 0:
        return q_t.t(), s
    _quantize_128x1_tuned.launch(
        lambda meta: (_ceil_div(k, meta["BLOCK_K"]), nb) if meta["K_FIRST"] else (nb, _ceil_div(k, meta["BLOCK_K"])),
        (k, _bucket(m), x.dtype), soft_fp8,
        x, _codes_out(q_t, soft_fp8), s, m, k, m_codes, x.stride(0), x.stride(1), s.stride(0), s.stride(1),
        _bucket(m),
        POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    return q_t.t(), s


# ----------------------------------------------------------------------------------------------------------
# 128x128: square weight blocks.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _weight_tile(w_ptr, N, K, stride_wn, stride_wk, POW2: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """This program's GROUP rows x GROUPS blocks of GROUP columns of w, a [GROUP, GROUPS, GROUP] tile, quantized:
    (rows, groups, cols, mask, codes, scales [GROUPS], non-finite blocks [GROUPS])."""
    pid_n = tl.program_id(0)
    rows = (pid_n * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (rows[:, None, None] < N) & (cols < K)  # ragged edge blocks: real elements only
    w = tl.load(w_ptr + rows[:, None, None] * stride_wn + cols * stride_wk, mask=mask, other=0.0)
    w = w.to(tl.float32)
    amax = tl.max(_abs_max(w, 2), axis=0)  # [GROUPS]
    nonfinite = amax == float("inf")
    scale = _block_scale(amax, nonfinite, POW2)
    codes = _scaled_codes(w, scale[None, :, None], nonfinite[None, :, None])
    return rows, groups, cols, mask, codes, scale, nonfinite


@triton.jit
def _quantize_128x128_kernel(
    w_ptr, q_ptr, s_ptr,  # w [N, K] any strides; q [N, K] contiguous; s [NBN, NBK] contiguous
    N, K, NBK, stride_wn, stride_wk,
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):
    """One program: GROUP rows x GROUPS blocks of GROUP columns, a [GROUP, GROUPS, GROUP] tile."""
    rows, groups, cols, mask, codes, scale, nonfinite = _weight_tile(w_ptr, N, K, stride_wn, stride_wk, POW2, GROUP,
                                                                     GROUPS)
    _store_codes(q_ptr + rows[:, None, None] * K + cols, codes, mask, SOFT_FP8)
    tl.store(s_ptr + tl.program_id(0) * NBK + groups, scale, mask=groups < NBK)


@triton.jit
def _requantize_128x128_kernel(
    w_ptr, q_ptr, s_ptr, bad_ptr,  # w [N, K] any strides; q [N, K], s [NBN, NBK] contiguous; bad: one byte, zeroed
    N, K, NBK, stride_wn, stride_wk,  # by the caller, set to 1 by a NaN/Inf block
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):
    """_quantize_128x128_kernel into existing buffers, also setting the "weight has a non-finite block" flag.

    W^T's codes are a second launch of this kernel on w.t() (a 128x128 block's codes and scale do not depend on
    the order of its elements). Writing them from this launch's registers, through a pointer contiguous along the
    tile's first axis, gave wrong codes on the H200 whenever N was a multiple of 16 (Triton 3.6, 2026-12-01; the
    interpreter got them right), so the transposing store is left to the layout the other stores already use."""
    rows, groups, cols, mask, codes, scale, nonfinite = _weight_tile(w_ptr, N, K, stride_wn, stride_wk, POW2, GROUP,
                                                                     GROUPS)
    _store_codes(q_ptr + rows[:, None, None] * K + cols, codes, mask, SOFT_FP8)
    real = groups < NBK
    tl.store(s_ptr + tl.program_id(0) * NBK + groups, scale, mask=real)
    tl.store(bad_ptr + groups * 0, tl.full([GROUPS], 1, tl.uint8), mask=nonfinite & real)


_QUANT_128X128_DEFAULT = triton.Config({"GROUPS": 1}, num_warps=8)
_QUANT_128X128_CONFIGS = [
    _QUANT_128X128_DEFAULT,
    triton.Config({"GROUPS": 1}, num_warps=4),
    triton.Config({"GROUPS": 1}, num_warps=16),
    triton.Config({"GROUPS": 2}, num_warps=16),
]
_quantize_128x128_tuned = _Tuned(_quantize_128x128_kernel, _QUANT_128X128_CONFIGS, key=["N", "K"])


def quantize_128x128(w: Tensor, *, block: int = BLOCK, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D tensor (a weight [N, K]) in 128x128 tiles. Matches the reference.

    w: [N, K] bf16/fp16/fp32, any strides, ragged N and K allowed
    -> (q float8_e4m3fn [N, K] contiguous, s float32 [ceil(N / 128), ceil(K / 128)] contiguous)
    """
    _check_block(block)
    soft_fp8 = _check_device(w)
    _check_2d("quantize_128x128", w)
    w = _as_float_input(w)
    n, k = w.shape
    nbn, nbk = _ceil_div(n, block), _ceil_div(k, block)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(nbn, nbk, dtype=torch.float32, device=w.device)
    if w.numel() == 0:
        return q, s
    _quantize_128x128_tuned.launch(
        lambda meta: (nbn, _ceil_div(nbk, meta["GROUPS"])), (n, k, w.dtype), soft_fp8,
        w, _codes_out(q, soft_fp8), s, n, k, nbk, w.stride(0), w.stride(1),
        POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    return q, s


_requantize_128x128_tuned = _Tuned(_requantize_128x128_kernel, _QUANT_128X128_CONFIGS, key=["N", "K"])


def requantize_128x128_(w: Tensor, q: Tensor, s: Tensor, bad: Tensor, *, qt: Tensor | None = None,
                        st: Tensor | None = None, block: int = BLOCK, pow2: bool = False) -> None:
    """Re-quantize a weight into existing buffers, in place: one launch writes the codes and scales
    ``quantize_128x128(w)`` returns and ``bad`` (bool []) = whether a scale is NaN (after the flag's zeroing); when
    given, a second launch on ``w.t()`` writes W^T's codes ``qt`` [K, N] and scales ``st`` [NBK, NBN] (``q.t()`` /
    ``s.t()``, contiguous). Every buffer's autograd version is bumped, as ``copy_`` would: a backward that saved the
    old codes raises instead of using the new ones.

    w: [N, K] bf16/fp16/fp32, any strides; q [N, K] e4m3fn, s [ceil(N/128), ceil(K/128)] fp32, contiguous.
    """
    _check_block(block)
    transposed = qt is not None or st is not None
    if transposed and (qt is None or st is None):
        raise ValueError("requantize_128x128_ needs both qt and st, or neither")
    tensors = (w, q, s, bad, qt, st) if transposed else (w, q, s, bad)
    soft_fp8 = _check_device(*tensors)
    _check_2d("requantize_128x128_", w)
    w = _as_float_input(w)
    n, k = w.shape
    nbn, nbk = _ceil_div(n, block), _ceil_div(k, block)
    wanted = [("q", q, (n, k), FP8_DTYPE), ("s", s, (nbn, nbk), torch.float32), ("bad", bad, (), torch.bool)]
    if transposed:
        wanted += [("qt", qt, (k, n), FP8_DTYPE), ("st", st, (nbk, nbn), torch.float32)]
    for name, t, shape, dtype in wanted:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"requantize_128x128_: {name} must be a contiguous {dtype} {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)} (strides {t.stride()})")
    bad.zero_()
    if w.numel():
        flag = bad.view(torch.uint8)
        for src, codes, scales, rows, cols in ((w, q, s, n, k), (w.t(), qt, st, k, n))[:2 if transposed else 1]:
            nb_rows, nb_cols = _ceil_div(rows, block), _ceil_div(cols, block)
            _requantize_128x128_tuned.launch(
                lambda meta, nb_rows=nb_rows, nb_cols=nb_cols: (nb_rows, _ceil_div(nb_cols, meta["GROUPS"])),
                (rows, cols, w.dtype), soft_fp8,
                src, _codes_out(codes, soft_fp8), scales, flag, rows, cols, nb_cols, src.stride(0), src.stride(1),
                POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    for t in (q, s, qt, st) if transposed else (q, s):
        if not t.is_inference():  # inference tensors keep no version (nor can autograd have saved them)
            torch.autograd.graph.increment_version(t)
