"""The eager autograd Function of FP8BlockLinear: ``linear_math``'s forward and backward, called directly (no
dispatcher round trip per call). Compiled calls take the triton ops of linear_ops.py instead.

Saved for backward (backward="fp8"): x quantized 128x1 — FP8 codes + one fp32 scale per 128 tokens per feature,
~1.03 bytes per element instead of BF16's 2 — and the weight's W^T codes (the layer's own buffers, no extra memory),
or with ``Fp8Config.resident_weight_codes=False`` the weight itself, whose W^T codes the backward makes.
x is quantized 128x1 directly in the forward, not dequantized from the forward's 1x128 codes and re-quantized in the
backward: one rounding instead of two.

backward="bf16" is the straight-through comparison mode (eager only): dx = dy W_dq with W_dq =
dequant(Q128x128(W)), and dW = dy^T x with the unquantized x (saved in its own dtype), plain matmuls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calclip.fp8 import quant
from calclip.fp8.config import Fp8Config
from calclip.fp8.linear_math import _backward, _gemm, _quantize_input
from calclip.fp8.weight_codes import Fp8WeightCodes


class _FP8BlockLinearFn(torch.autograd.Function):
    """Eager autograd: calls linear_math directly (no dispatcher round trip per call)."""

    @staticmethod
    def forward(ctx, x2: Tensor, weight: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor,
                layer: Fp8WeightCodes, cfg: Fp8Config, out_dtype: torch.dtype, grad: bool,
                codes: tuple | None = None) -> Tensor:
        # x2 [M, K]; weight [N, K] (only its grad slot is used here); qw/sw: the layer's current codes
        # grad: the caller's grad mode (forward runs under no_grad; needs_input_grad follows requires_grad alone)
        # codes: x2 already quantized (qx, sx, qxt, sxt) and counted, by the sibling that quantized the input they
        # share (shared_input.py; qxt/sxt None when no sibling needs a weight gradient); None: quantize here
        need_dx, need_dw = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        fp8_backward = cfg.backward == "fp8"
        if codes is None:  # (given only with backward="fp8"; 128x1 codes whenever any sibling's weight needs a grad)
            codes = _quantize_input(x2, weight_bad, counter, need_dw and fp8_backward, cfg.power_of_two_scales,
                                    gemm=cfg.gemm, row_scales=cfg.row_scales)
        qx, sx, qxt, sxt = codes  # qx, sx: over gemm.operand_rows(M) rows, zero tokens past M
        y = _gemm(qx, sx, qw, sw, out_dtype, cfg.gemm, "1x128", "128x128", cfg.row_scales, m=x2.shape[0])
        ctx.cfg, ctx.need = cfg, (need_dx, need_dw)
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        if fp8_backward:
            # (W^T codes, scales), or (weight, None) with no resident W codes: the backward quantizes W^T from it
            saved_w = layer._dgrad_operands() if need_dx else (None, None)
            ctx.dgrad_from_weight = need_dx and saved_w[1] is None
            ctx.save_for_backward(*saved_w, qxt if need_dw else None, sxt if need_dw else None)
        else:
            ctx.save_for_backward(qw if need_dx else None, sw if need_dx else None, x2 if need_dw else None)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        cfg: Fp8Config = ctx.cfg
        need_dx, need_dw = ctx.need
        dy2 = dy if dy.is_contiguous() else dy.contiguous()
        if cfg.backward == "fp8":
            qwt, swt, qxt, sxt = ctx.saved_tensors
            if ctx.dgrad_from_weight:  # Fp8Config.resident_weight_codes=False: W^T's codes from the saved weight
                # W quantized as the forward did (contiguous reads), transposed by _backward's copy on CUDA
                qw, sw = quant.quantize_128x128(qwt.detach(), block=cfg.block_size, pow2=cfg.power_of_two_scales)
                qwt, swt = qw.t(), sw.t()
            dx, dw = _backward(dy2, qwt, swt, qxt, sxt, need_dx, need_dw, cfg.power_of_two_scales, cfg.gemm,
                               ctx.x_dtype, ctx.w_dtype, cfg.row_scales)
        else:  # straight-through: plain matmuls in the input dtype
            qw, sw, x2 = ctx.saved_tensors
            dx = dw = None
            if need_dx:
                w_dq = quant.dequantize_128x128(qw, sw, block=cfg.block_size).to(dy2.dtype)
                dx = (dy2 @ w_dq).to(ctx.x_dtype)
            if need_dw:
                dw = (dy2.t() @ x2.to(dy2.dtype)).to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None, None, None, None
