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

from calclip.fp8 import quant
from calclip.fp8.compile_cache import tag_compile_caches
from calclip.fp8.linear_math import _backward, _forward, _fused_decode_kernel, _gemm, _quantize_input

# torch.compile's caches key these ops by name, not by the dispatch inside them: calclip's fingerprint goes into
# every cache key from here on (compile_cache.py)
tag_compile_caches()


@torch.library.triton_op("calclip::fp8_quantize_weight", mutates_args=())
def _quantize_weight_op(weight: Tensor, block: int, pow2: bool) -> tuple[Tensor, Tensor]:
    """A weight's 128x128 codes [N, K] and scales, made in the graph (``Fp8Config.resident_weight_codes=False``):
    ``quant.quantize_128x128``."""
    return quant.quantize_128x128(weight, block=block, pow2=pow2)


@torch.library.triton_op("calclip::fp8_linear_forward", mutates_args=())
def _forward_op(x2: Tensor, weight: Tensor, qw: Tensor, sw: Tensor, qwt: Tensor | None, swt: Tensor | None,
                weight_bad: Tensor, save_for_wgrad: bool, pow2: bool, gemm: str,
                out_dtype: torch.dtype, row_scales: bool = False, dgrad_from_weight: bool = False,
                block: int = 128) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (y [M, N], qxt [wgrad_rows(M), K] (128x1 codes, column-major) or [0], sxt [M/128, K] or [0], non-finite
    rows []).
    weight and the dgrad codes qwt/swt are inputs only for autograd (the weight's grad slot, saved for dx). The
    count is returned, not added to the layer's counter: torch.library registers autograd for functional ops only
    (calls without grad take ``_infer_op``, which adds in place). dgrad_from_weight (qwt/swt None): the backward
    quantizes W^T from the weight, in ``block`` tiles (``Fp8Config.resident_weight_codes=False``)."""
    counter = torch.zeros((), dtype=torch.int64, device=x2.device)
    y, qxt, sxt = _forward(x2, qw, sw, weight_bad, counter, save_for_wgrad, pow2, gemm, out_dtype, row_scales)
    if qxt is None:
        qxt, sxt = x2.new_empty((0,), dtype=torch.float8_e4m3fn), x2.new_empty((0,), dtype=torch.float32)
    return y, qxt, sxt, counter


@torch.library.triton_op("calclip::fp8_quantize_input", mutates_args=())
def _quantize_input_op(x2: Tensor, weight_bad: Tensor, members: int, save_for_wgrad: bool, pow2: bool,
                       gemm: str = "auto",
                       row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The input that ``members`` sibling linears share, quantized once (shared_input.py) -> (qx [rows, K] 1x128
    codes over gemm.operand_rows(M) rows for the members' ``gemm`` backend, sx, qxt [wgrad_rows(M), K] 128x1 codes or
    [0], sxt or [0], the members' non-finite rows [] summed; weight_bad: int32 [] number of their bad weights). Each
    member then takes ``fp8_linear_forward_codes``."""
    counter = torch.zeros((), dtype=torch.int64, device=x2.device)
    qx, sx, qxt, sxt = _quantize_input(x2, weight_bad, counter, save_for_wgrad, pow2, members, gemm=gemm,
                                       row_scales=row_scales)
    if qxt is None:
        qxt, sxt = x2.new_empty((0,), dtype=torch.float8_e4m3fn), x2.new_empty((0,), dtype=torch.float32)
    return qx, sx, qxt, sxt, counter


@torch.library.triton_op("calclip::fp8_linear_forward_codes", mutates_args=())
def _forward_codes_op(x2: Tensor, weight: Tensor, qx: Tensor, sx: Tensor, qxt: Tensor, sxt: Tensor, qw: Tensor,
                      sw: Tensor, qwt: Tensor | None, swt: Tensor | None, pow2: bool, gemm: str,
                      out_dtype: torch.dtype, row_scales: bool = False, dgrad_from_weight: bool = False,
                      block: int = 128) -> Tensor:
    """``fp8_linear_forward`` for an x quantized already (``fp8_quantize_input``) -> y [M, N]. x2 and weight are
    inputs only for autograd (their grad slots); the backward is ``fp8_linear_backward`` with qxt/sxt (and W^T
    quantized from the weight when ``dgrad_from_weight``)."""
    return _gemm(qx, sx, qw, sw, out_dtype, gemm, "1x128", "128x128", row_scales, m=x2.shape[0])


@torch.library.triton_op("calclip::fp8_linear_infer", mutates_args=("counter",))
def _infer_op(x2: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor, pow2: bool, gemm: str,
              out_dtype: torch.dtype, row_scales: bool = False) -> Tensor:
    """The no-grad forward -> y [M, N]; the layer's counter (int64 []) += non-finite rows in place, by the
    quantizer's own atomic add on CUDA: a compiled decode step runs no zeroed count and no add_ per linear (the
    two extra kernels per layer call that the functional op costs)."""
    return _forward(x2, qw, sw, weight_bad, counter, False, pow2, gemm, out_dtype, row_scales)[0]


@torch.library.triton_op("calclip::fp8_linear_backward", mutates_args=())
def _backward_op(dy2: Tensor, qwt: Tensor, swt: Tensor, qxt: Tensor, sxt: Tensor, need_dx: bool, need_dw: bool,
                 pow2: bool, gemm: str, x_dtype: torch.dtype,
                 w_dtype: torch.dtype, row_scales: bool = False) -> tuple[Tensor, Tensor]:
    """-> (dx [M, K] or [0], dW [N, K] or [0])"""
    dx, dw = _backward(dy2.contiguous(), qwt, swt, qxt, sxt, need_dx, need_dw, pow2, gemm, x_dtype, w_dtype,
                       row_scales)
    return (dx if dx is not None else dy2.new_empty((0,), dtype=x_dtype)), \
        (dw if dw is not None else dy2.new_empty((0,), dtype=w_dtype))


@torch.library.triton_op("calclip::fp8_linear_decode", mutates_args=("counter",))
def _decode_op(x2: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor, pow2: bool,
               out_dtype: torch.dtype) -> Tensor:
    """The fused no-grad forward (Fp8Config.decode_fused_max_m) -> y [M, N]; counter += non-finite rows."""
    return _fused_decode_kernel(x2)(x2, qw, sw, out_dtype=out_dtype, nonfinite_count=counter, weight_bad=weight_bad,
                                    pow2=pow2)


def _save_dgrad_operands(ctx, weight: Tensor, qwt: Tensor | None, swt: Tensor | None, qxt: Tensor, sxt: Tensor,
                         dgrad_from_weight: bool, block: int) -> None:
    """Save what the backward's GEMMs read: the dgrad codes, or (``dgrad_from_weight``) the weight itself, which the
    backward quantizes (W^T) and autograd's version check guards like the codes."""
    ctx.from_weight = (dgrad_from_weight, block)
    ctx.save_for_backward(weight if dgrad_from_weight else qwt, None if dgrad_from_weight else swt, qxt, sxt)


def _setup_context(ctx, inputs, output) -> None:
    (x2, weight, qw, sw, qwt, swt, weight_bad, save_for_wgrad, pow2, gemm, out_dtype, row_scales,
     dgrad_from_weight, block) = inputs
    _, qxt, sxt, _ = output
    ctx.opts = (pow2, gemm, x2.dtype, weight.dtype, row_scales)
    _save_dgrad_operands(ctx, weight, qwt, swt, qxt, sxt, dgrad_from_weight, block)


def _forward_op_backward(ctx, dy2, _dqxt, _dsxt, _dcount):
    qwt, swt, qxt, sxt = ctx.saved_tensors
    pow2, gemm, x_dtype, w_dtype, row_scales = ctx.opts
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    from_weight, block = ctx.from_weight
    if need_dx and from_weight:  # qwt is the weight [N, K]: quantized as the forward did, then transposed (views;
        # the backward's contiguous copy on CUDA), which is exact for 128x128 tiles
        qw, sw = torch.ops.calclip.fp8_quantize_weight(qwt.detach(), block, pow2)
        qwt, swt = qw.t(), sw.t()
    if need_dx and qwt is None:
        raise RuntimeError("calclip::fp8_linear_forward ran without dgrad codes but its input needs a gradient")
    dx, dw = torch.ops.calclip.fp8_linear_backward(dy2, qwt, swt, qxt, sxt, need_dx, need_dw, pow2, gemm,
                                                   x_dtype, w_dtype, row_scales)
    return (dx if need_dx else None), (dw if need_dw else None), *([None] * 12)


_forward_op.register_autograd(_forward_op_backward, setup_context=_setup_context)


def _codes_setup_context(ctx, inputs, output) -> None:
    (x2, weight, _qx, _sx, qxt, sxt, _qw, _sw, qwt, swt, pow2, gemm, _out_dtype, row_scales,
     dgrad_from_weight, block) = inputs
    ctx.opts = (pow2, gemm, x2.dtype, weight.dtype, row_scales)
    _save_dgrad_operands(ctx, weight, qwt, swt, qxt, sxt, dgrad_from_weight, block)


def _forward_codes_op_backward(ctx, dy2):
    return *_forward_op_backward(ctx, dy2, None, None, None)[:2], *([None] * 14)


_forward_codes_op.register_autograd(_forward_codes_op_backward, setup_context=_codes_setup_context)

