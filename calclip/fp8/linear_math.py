"""The math of one FP8BlockLinear call, shared by the eager autograd Function (linear_function.py) and the triton ops
torch.compile records (linear_ops.py): which GEMM backend serves a shape, the forward (quantize x, GEMM) and the
backward (quantize dy, dgrad and wgrad GEMMs), and whether a no-grad call takes the fused decode kernel.

    forward  y  = Q1x128(x) Q128x128(W)^T
    dgrad    dx = Q1x128(dy) Q128x128(W)                (the forward's weight codes, transposed)
    wgrad    dW = Q128x1(dy)^T Q128x1(x)                (both quantized along the token axis M)

A forward is one 1x128 quantizer launch (which also counts non-finite tokens), one 128x1 launch when a weight
gradient will be needed, and one GEMM; a backward is two quantizer launches and two GEMMs. The layer was host-bound
(its Python outweighed small GEMMs on the H200, docs/benchmarks-log.md), so which GEMM backend serves a shape is
decided once per (shape, dtype, device) and cached (``_gemm``). The two quantizations of x (and, in the backward, of
dy) come from two kernels reading one stored tensor (``tracing.one_buffer``). All scales are emitted in the strides
torch._scaled_mm reads, so no operand is re-laid out per call.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from calclip.fp8 import quant
from calclip.fp8.config import Fp8Config
from calclip.fp8.gemm import (fp8_block_gemm, operand_rows, resolve_backend, row_scales_of, scaled_mm_blockwise,
                              scaled_mm_on_padded_rows)
from calclip.fp8.tracing import is_traced, one_buffer, same_size

# (backend, a_blocks, b_blocks, m, n, k, out_dtype, device, row_scales) -> "scaled_mm" | other backend name
_gemm_choice: dict[tuple, str] = {}


def _gemm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, out_dtype: torch.dtype, backend: str,
          a_blocks: str, b_blocks: str, row_scales: bool = False, m=None) -> Tensor:
    """fp8_block_gemm for operands already in the layouts the quantizers emit with gemm_layout=True; the
    backend decision is made once per shape, and the torch._scaled_mm path re-lays out nothing (but for
    ``row_scales``' "scaled_mm_rows", which repeats a weight's scales per row: a [K/128, N] fp32 tensor per call).
    m: the rows of the product (default qa's); a 1x128 qa may hold more, zero tokens appended by its quantizer
    (``gemm.operand_rows``), which no backend needs a copy of: the result is cut back to m rows."""
    rows_a, k = qa.shape
    m = rows_a if m is None else m
    n = qb.shape[0]
    traced = is_traced(qa)
    if traced and not all(type(d) is int for d in (m, n, k)):  # symbolic sizes: decided while tracing, not cached
        chosen = resolve_backend(backend, qa, qb, out_dtype=out_dtype, a_blocks=a_blocks, b_blocks=b_blocks,
                                 row_scales=row_scales)
    else:
        key = (backend, a_blocks, b_blocks, m, n, k, out_dtype, qa.device, row_scales)
        chosen = _gemm_choice.get(key)
        if chosen is None:
            chosen = _gemm_choice[key] = resolve_backend(backend, qa, qb, out_dtype=out_dtype, a_blocks=a_blocks,
                                                         b_blocks=b_blocks, row_scales=row_scales)
    if chosen in ("scaled_mm", "scaled_mm_rows"):
        # a [M, K] row-major, b = qb^T [K, N] column-major; 1x128 scales column-major, 128x128 row-major
        # (gemm.scaled_mm_block_gemm, whose re-layouts are no-ops for these operands); "scaled_mm_rows": the
        # 128x128 scales of b repeated per row, a 1x128 scale ([K/128, N] contiguous as scale_b).
        scale_b = (row_scales_of(sb, n) if chosen == "scaled_mm_rows" else sb).t()
        # M not a multiple of 16 (a micro-batch of B x L tokens, L odd): cuBLAS on zero rows appended, not Triton;
        # the quantizer wrote them (gemm.operand_rows) or, for codes of M rows, one M x K byte copy appends them
        return scaled_mm_on_padded_rows(scaled_mm_blockwise if traced else torch._scaled_mm, qa, qb.t(), sa, scale_b,
                                        out_dtype, m)
    if chosen == "splitk":
        y = quant.triton_kernels().fp8_splitk_gemm_triton(qa, sa, qb, sb, out_dtype=out_dtype)
    else:
        y = fp8_block_gemm(qa, sa, qb, sb, out_dtype=out_dtype, backend=chosen, a_blocks=a_blocks, b_blocks=b_blocks)
    return y if same_size(rows_a, m) else y.narrow(0, 0, m)  # padded rows (operand_rows) a backend did not need


def _out_rows(gemm: str, a: Tensor, out_dtype: torch.dtype, row_scales: bool):
    """A quantizer's ``out_rows`` for the 1x128 operand a [M, K] of a forward/dgrad GEMM: ``gemm.operand_rows``, or
    None where that is M (``same_size``: no guard)."""
    rows = operand_rows(gemm, a, out_dtype, row_scales)
    return None if same_size(rows, a.shape[0]) else rows


def _quantize_input(x2: Tensor, weight_bad: Tensor, counter: Tensor, save_for_wgrad: bool, pow2: bool,
                    members: int = 1, *, gemm: str,
                    row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """x2 [M, K] -> its 1x128 codes/scales (the forward GEMM's operand; over ``gemm.operand_rows`` rows for the
    ``gemm`` backend, the rows past M zero tokens) and, when save_for_wgrad, its 128x1 codes/scales (saved for the
    wgrad GEMM), else None; counter (int64 []) += the non-finite rows of ``members`` linears reading x2
    (``weight_bad``: the one linear's flag, or an int32 count of bad weights among members)."""
    rows = _out_rows(gemm, x2, x2.dtype, row_scales)
    if save_for_wgrad:  # two kernels read x2: stored once by its producer (tracing.one_buffer)
        x2 = one_buffer(x2)
    qx, sx = quant.quantize_1x128(x2, pow2=pow2, gemm_layout=True, nonfinite_count=counter, weight_bad=weight_bad,
                                  members=members, out_rows=rows)
    qxt, sxt = quant.quantize_128x1(x2, pow2=pow2, gemm_layout=True) if save_for_wgrad else (None, None)
    return qx, sx, qxt, sxt


def _forward(x2: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor, save_for_wgrad: bool,
             pow2: bool, gemm: str, out_dtype: torch.dtype,
             row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """x2 [M, K]; qw [N, K] e4m3fn, sw [N/128, K/128]; counter int64 [] (+= non-finite rows)
    -> y [M, N] out_dtype, and x quantized 128x1 (qxt [wgrad_rows(M), K], sxt [M/128, K]) when save_for_wgrad,
    else None.
    row_scales: Fp8Config.scaled_mm_row_scales (gemm.resolve_backend)."""
    qx, sx, qxt, sxt = _quantize_input(x2, weight_bad, counter, save_for_wgrad, pow2, gemm=gemm, row_scales=row_scales)
    y = _gemm(qx, sx, qw, sw, out_dtype, gemm, "1x128", "128x128", row_scales, m=x2.shape[0])
    return y, qxt, sxt


def _backward(dy2: Tensor, qwt: Tensor, swt: Tensor, qxt: Tensor, sxt: Tensor, need_dx: bool, need_dw: bool,
              pow2: bool, gemm: str, x_dtype: torch.dtype,
              w_dtype: torch.dtype, row_scales: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """dy2 [M, N]; W^T codes qwt [K, N], swt [K/128, N/128]; saved x 128x1 -> (dx [M, K], dW [N, K])."""
    dx = dw = None
    if need_dx and need_dw:  # two kernels read dy2: stored once by its producer (tracing.one_buffer)
        dy2 = one_buffer(dy2)
    if need_dx:
        # dy's 1x128 codes over the rows the dgrad GEMM runs on (gemm.operand_rows: zero tokens past M, no copy)
        rows = _out_rows(gemm, dy2, x_dtype, row_scales)
        qdy, sdy = quant.quantize_1x128(dy2, pow2=pow2, gemm_layout=True, out_rows=rows)  # [M, N], [M, N/128]
        if qwt.is_cuda and not qwt.is_contiguous():
            # Fp8Config.resident_dgrad_codes=False: W^T made here from the W codes (exact); torch._scaled_mm reads
            # its second operand K-major
            qwt, swt = qwt.contiguous(), swt.contiguous()
        dx = _gemm(qdy, sdy, qwt, swt, x_dtype, gemm, "1x128", "128x128", row_scales, m=dy2.shape[0])
        # dy's 1x128 codes and an on-demand W^T are dead once dx exists: released before the wgrad's operands are
        # made, so a backward holds one layout of dy's codes at a time (memory_budget.py: M x N bytes less at the
        # peak of each linear's backward, and N x K more with resident_dgrad_codes=False)
        del qdy, sdy, qwt, swt
    if need_dw:
        qdyt, sdyt = quant.quantize_128x1(dy2, pow2=pow2, gemm_layout=True)  # [wgrad_rows(M), N], [M/128, N]
        # contracts over wgrad_rows(M) tokens: x's and dy's 128x1 codes both carry zero codes past M
        dw = _gemm(qdyt.t(), sdyt.t(), qxt.t(), sxt.t(), w_dtype, gemm, "1x128", "1x128")
    return dx, dw


_FUSED_DECODE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fused_decode_applies(x2: Tensor, cfg: Fp8Config, *, compiled: bool) -> bool:
    """Fp8Config.decode_fused_max_m's rule: grad disabled (rollout) and 1 to max_m rows, max_m resolved for this
    call (``Fp8Config.fused_decode_max_m``: None is automatic, eager CUDA calls only). An eager call being captured
    into a CUDA graph counts as compiled: in graphs the two launches' GPU time measured lower."""
    if torch.is_grad_enabled():
        return False
    cuda = x2.is_cuda
    # Only the automatic rule tells a capture from an eager call: an explicit limit skips the query.
    in_graph = compiled or (cuda and cfg.decode_fused_max_m is None and torch.cuda.is_current_stream_capturing())
    return 0 < x2.shape[0] <= cfg.fused_decode_max_m(cuda=cuda, compiled=in_graph)


def _fused_decode_kernel(x2: Tensor):
    """``kernels.fp8_linear_decode_unchecked`` (fp8_linear_fused_quant_gemm without its argument checks,
    for the layer's own operands) when it can serve ``x2`` (a CUDA tensor, or a CPU tensor under
    TRITON_INTERPRET=1, in bf16/fp16/fp32, triton importable), else None: then the layer's usual path runs.
    Whether a call may take it is ``_fused_decode_applies`` (Fp8Config.decode_fused_max_m, resolved per call)."""
    if x2.dtype not in _FUSED_DECODE_DTYPES:
        return None
    if not x2.is_cuda and not (x2.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return None
    module = quant.triton_kernels()
    return getattr(module, "fp8_linear_decode_unchecked", None) if module is not None else None

