"""FP8BlockLinear's math as torch.library triton ops, for torch.compile (CUDA-graph safe: no syncs).

Under torch.compile the layer calls ``calclip::fp8_linear_forward`` / ``calclip::fp8_linear_backward`` (training;
sibling linears sharing an input: ``calclip::fp8_quantize_input`` once, then ``calclip::fp8_linear_forward_codes``),
``calclip::fp8_linear_infer`` (no grad) and ``calclip::fp8_linear_decode`` (the fused decode kernel): no graph break
inside the layer. Dynamo records one op per layer call (its fake implementation is the same code run on
FakeTensors); AOTAutograd then decomposes each op into the Triton kernels (recorded through wrap_triton, see
``kernels.launch._Tuned.launch``) and the opaque cuBLAS GEMM op ``calclip::scaled_mm_blockwise``, so Inductor
launches them from its own generated code: no Python of this module runs per call in a compiled graph.

Importing this module registers the ops; calclip.fp8.linear imports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calclip.fp8.compile_cache import tag_compile_caches
from calclip.fp8.linear_math import _backward, _forward, _fused_decode_kernel, _gemm, _quantize_input

# torch.compile's caches key these ops by name, not by the dispatch inside them: calclip's fingerprint goes into
# every cache key from here on (compile_cache.py)
tag_compile_caches()


@torch.library.triton_op("calclip::fp8_linear_forward", mutates_args=())
def _forward_op(x2: Tensor, weight: Tensor, qw: Tensor, sw: Tensor, qwt: Tensor | None, swt: Tensor | None,
                weight_bad: Tensor, save_for_wgrad: bool, pow2: bool, fused: bool, gemm: str,
                out_dtype: torch.dtype, row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (y [M, N], qxt [wgrad_rows(M), K] (128x1 codes, column-major) or [0], sxt [M/128, K] or [0], non-finite
    rows []).
    weight and the dgrad codes qwt/swt are inputs only for autograd (the weight's grad slot, saved for dx). The
    count is returned, not added to the layer's counter: torch.library registers autograd for functional ops only
    (calls without grad take ``_infer_op``, which adds in place)."""
    counter = torch.zeros((), dtype=torch.int64, device=x2.device)
    y, qxt, sxt = _forward(x2, qw, sw, weight_bad, counter, save_for_wgrad, pow2, fused, gemm, out_dtype,
                           row_scales)
    if qxt is None:
        qxt, sxt = x2.new_empty((0,), dtype=torch.float8_e4m3fn), x2.new_empty((0,), dtype=torch.float32)
    return y, qxt, sxt, counter


@torch.library.triton_op("calclip::fp8_quantize_input", mutates_args=())
def _quantize_input_op(x2: Tensor, weight_bad: Tensor, members: int, save_for_wgrad: bool, pow2: bool,
                       fused: bool, gemm: str = "auto",
                       row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The input that ``members`` sibling linears share, quantized once (shared_input.py) -> (qx [rows, K] 1x128
    codes over gemm.operand_rows(M) rows for the members' ``gemm`` backend, sx, qxt [wgrad_rows(M), K] 128x1 codes or
    [0], sxt or [0], the members' non-finite rows [] summed; weight_bad: int32 [] number of their bad weights). Each
    member then takes ``fp8_linear_forward_codes``."""
    counter = torch.zeros((), dtype=torch.int64, device=x2.device)
    qx, sx, qxt, sxt = _quantize_input(x2, weight_bad, counter, save_for_wgrad, pow2, fused, members, gemm=gemm,
                                       row_scales=row_scales)
    if qxt is None:
        qxt, sxt = x2.new_empty((0,), dtype=torch.float8_e4m3fn), x2.new_empty((0,), dtype=torch.float32)
    return qx, sx, qxt, sxt, counter


@torch.library.triton_op("calclip::fp8_linear_forward_codes", mutates_args=())
def _forward_codes_op(x2: Tensor, weight: Tensor, qx: Tensor, sx: Tensor, qxt: Tensor, sxt: Tensor, qw: Tensor,
                      sw: Tensor, qwt: Tensor | None, swt: Tensor | None, pow2: bool, fused: bool, gemm: str,
                      out_dtype: torch.dtype, row_scales: bool = False) -> Tensor:
    """``fp8_linear_forward`` for an x quantized already (``fp8_quantize_input``) -> y [M, N]. x2 and weight are
    inputs only for autograd (their grad slots); the backward is ``fp8_linear_backward`` with qxt/sxt."""
    return _gemm(qx, sx, qw, sw, out_dtype, gemm, "1x128", "128x128", row_scales, m=x2.shape[0])


@torch.library.triton_op("calclip::fp8_linear_infer", mutates_args=("counter",))
def _infer_op(x2: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor, pow2: bool, gemm: str,
              out_dtype: torch.dtype, row_scales: bool = False) -> Tensor:
    """The no-grad forward -> y [M, N]; the layer's counter (int64 []) += non-finite rows in place, by the
    quantizer's own atomic add on CUDA: a compiled decode step runs no zeroed count and no add_ per linear (the
    two extra kernels per layer call that the functional op costs)."""
    return _forward(x2, qw, sw, weight_bad, counter, False, pow2, False, gemm, out_dtype, row_scales)[0]


@torch.library.triton_op("calclip::fp8_linear_backward", mutates_args=())
def _backward_op(dy2: Tensor, qwt: Tensor, swt: Tensor, qxt: Tensor, sxt: Tensor, need_dx: bool, need_dw: bool,
                 pow2: bool, fused: bool, gemm: str, x_dtype: torch.dtype,
                 w_dtype: torch.dtype, row_scales: bool = False) -> tuple[Tensor, Tensor]:
    """-> (dx [M, K] or [0], dW [N, K] or [0])"""
    dx, dw = _backward(dy2.contiguous(), qwt, swt, qxt, sxt, need_dx, need_dw, pow2, fused, gemm, x_dtype,
                       w_dtype, row_scales)
    return (dx if dx is not None else dy2.new_empty((0,), dtype=x_dtype)), \
        (dw if dw is not None else dy2.new_empty((0,), dtype=w_dtype))


@torch.library.triton_op("calclip::fp8_linear_decode", mutates_args=("counter",))
def _decode_op(x2: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor, pow2: bool,
               out_dtype: torch.dtype) -> Tensor:
    """The fused no-grad forward (Fp8Config.decode_fused_max_m) -> y [M, N]; counter += non-finite rows."""
    return _fused_decode_kernel(x2)(x2, qw, sw, out_dtype=out_dtype, nonfinite_count=counter, weight_bad=weight_bad,
                                    pow2=pow2)


def _setup_context(ctx, inputs, output) -> None:
    x2, weight, qw, sw, qwt, swt, weight_bad, save_for_wgrad, pow2, fused, gemm, out_dtype, row_scales = inputs
    _, qxt, sxt, _ = output
    ctx.opts = (pow2, fused, gemm, x2.dtype, weight.dtype, row_scales)
    ctx.save_for_backward(qwt, swt, qxt, sxt)


def _forward_op_backward(ctx, dy2, _dqxt, _dsxt, _dcount):
    qwt, swt, qxt, sxt = ctx.saved_tensors
    pow2, fused, gemm, x_dtype, w_dtype, row_scales = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if need_dx and qwt is None:
        raise RuntimeError("calclip::fp8_linear_forward ran without dgrad codes but its input needs a gradient")
    dx, dw = torch.ops.calclip.fp8_linear_backward(dy2, qwt, swt, qxt, sxt, need_dx, need_dw, pow2, fused, gemm,
                                                   x_dtype, w_dtype, row_scales)
    return (dx if need_dx else None), (dw if need_dw else None), *([None] * 11)


_forward_op.register_autograd(_forward_op_backward, setup_context=_setup_context)


def _codes_setup_context(ctx, inputs, output) -> None:
    x2, weight, _qx, _sx, qxt, sxt, _qw, _sw, qwt, swt, pow2, fused, gemm, _out_dtype, row_scales = inputs
    ctx.opts = (pow2, fused, gemm, x2.dtype, weight.dtype, row_scales)
    ctx.save_for_backward(qwt, swt, qxt, sxt)


def _forward_codes_op_backward(ctx, dy2):
    return *_forward_op_backward(ctx, dy2, None, None, None)[:2], *([None] * 13)


_forward_codes_op.register_autograd(_forward_codes_op_backward, setup_context=_codes_setup_context)

