"""FP8BlockLinear: an nn.Linear that computes its three GEMMs in block-scaled FP8 (DeepSeek-V3 recipe).

    forward  y  = Q1x128(x) Q128x128(W)^T + b
    dgrad    dx = Q1x128(dy) Q128x128(W)                (the forward's cached weight codes, transposed)
    wgrad    dW = Q128x1(dy)^T Q128x1(x)                (both quantized along the token axis M)

Saved for backward (backward="fp8"): x quantized 128x1 — FP8 codes + one fp32 scale per 128 tokens per
feature, ~1.03 bytes per element instead of BF16's 2 — and the cached weight codes (shared with the cache,
no extra memory). x is quantized 128x1 directly in the forward, not dequantized from the forward's 1x128
codes and re-quantized in the backward: one rounding instead of two. Both quantizations of x (and, in the
backward, both of dy) come from the two quantizer kernels, or from one fused kernel that reads the tensor once
with Fp8Config.fused_quantizer (slower on the H200 today, docs/benchmarks.md).

On CUDA the quantizers emit scales in the strides torch._scaled_mm reads (``gemm_layout``), and dgrad uses
W^T codes [K, N] and scales made contiguous once per weight version and kept with the cached weight (built
on the first backward, so inference never pays for them): the scaled_mm path copies nothing per call. This
costs one extra byte per weight element while the cache lives (training with cache_weights).

backward="bf16" is the straight-through comparison mode: dx = dy W_dq with W_dq = dequant(Q128x128(W)), and
dW = dy^T x with the unquantized x (saved in its own dtype), both plain matmuls in the input dtype.

The quantized weight is cached on the module (a plain attribute, never in state_dict) under the key
(weight epoch, weight.data_ptr(), weight._version, dtype, device): ordinary in-place updates (optimizer.step,
load_state_dict's copy_) bump _version and moves change data_ptr; fused optimizers (transformers' default
adamw_torch_fused) bump neither, so every optimizer step also advances a process-wide weight epoch (a global
optimizer step post-hook), and code that writes ``param.data`` directly calls ``invalidate_fp8_weight_caches()``.
`generate` still quantizes each weight once, not once per decode step.

Non-finite inputs: a 1x128 group with NaN/Inf gets a NaN scale (reference.py), so its token's outputs are
NaN. ``nonfinite_count`` (0-dim int64 tensor, plain attribute, created on the input's device) accumulates
the number of input rows (tokens) whose output is non-finite for that reason — every row when the weight has
a non-finite block. It reads only the scale tensor (1/128 of the input), never syncs, counts every forward
call (including gradient-checkpointing recomputation); ``pop_nonfinite_count(model)`` sums and resets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from calclip.fp8 import quant
from calclip.fp8.config import Fp8Config
from calclip.fp8.gemm import fp8_block_gemm

# Advanced after every optimizer step of any optimizer in the process, and by invalidate_fp8_weight_caches():
# part of every weight-cache key, since fused optimizers and `.data` writes change weights without bumping
# Tensor._version (measured: torch 2.13 AdamW(fused=True) leaves _version unchanged).
_weight_epoch = 0


def invalidate_fp8_weight_caches() -> None:
    """Drop every FP8BlockLinear's cached weight codes: call after writing ``param.data`` directly (EMA
    updates, weight syncs that copy into ``.data``, PEFT merges); optimizer steps do this by themselves."""
    global _weight_epoch
    _weight_epoch += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_fp8_weight_caches()


register_optimizer_step_post_hook(_after_optimizer_step)


@dataclass(frozen=True)
class _Opts:
    block: int
    pow2: bool
    gemm: str
    backward: str
    out_dtype: torch.dtype
    save_for_backward: bool
    gemm_layout: bool  # quantizer scales in torch._scaled_mm's strides (CUDA); values are the same either way
    fused_quantizer: bool  # one-read fused 1x128+128x1 kernel (Fp8Config.fused_quantizer) or two kernels


def _quantize_rows_and_cols(x2: Tensor, opts: _Opts) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x2 [M, K] -> 1x128 codes/scales and 128x1 codes/scales (the same values either path)."""
    kwargs = {"block": opts.block, "pow2": opts.pow2, "gemm_layout": opts.gemm_layout}
    if opts.fused_quantizer:
        return quant.quantize_1x128_and_128x1(x2, **kwargs)
    return (*quant.quantize_1x128(x2, **kwargs), *quant.quantize_128x1(x2, **kwargs))


class _QuantizedWeight:
    """One weight version's codes qw [N, K] e4m3fn, scales sw [N/128, K/128] fp32 and ``bad`` (0-dim bool: a
    non-finite block), plus the dgrad operands W^T built on first use and kept as long as this object."""

    def __init__(self, qw: Tensor, sw: Tensor, bad: Tensor) -> None:
        self.qw, self.sw, self.bad = qw, sw, bad
        self._dgrad: tuple[Tensor, Tensor] | None = None

    def dgrad_operands(self) -> tuple[Tensor, Tensor]:
        """(W^T codes [K, N], W^T scales [K/128, N/128]) for dx = dy W. On CUDA both contiguous, so
        gemm.scaled_mm_block_gemm's qb.contiguous() / scale re-layout are no-ops; on CPU plain views."""
        if self._dgrad is None:
            qwt, swt = self.qw.t(), self.sw.t()
            self._dgrad = (qwt.contiguous(), swt.contiguous()) if self.qw.is_cuda else (qwt, swt)
        return self._dgrad


class _FP8BlockLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, qw: Tensor, sw: Tensor,
                weight_nonfinite: Tensor, counter: Tensor | None, qweight: _QuantizedWeight, opts: _Opts) -> Tensor:
        # x [..., K]; weight [N, K] (only its grad slot is used here); qw [N, K] e4m3fn, sw [N/128, K/128]
        # (qweight's, passed as tensors so autograd saves and checks them)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        need_dx = opts.save_for_backward and ctx.needs_input_grad[0]
        need_dw = opts.save_for_backward and ctx.needs_input_grad[1]
        saved_x: tuple[Tensor, ...] = ()
        if need_dw and opts.backward == "fp8":  # 1x128 for the forward GEMM, 128x1 saved for wgrad
            qx, sx, qxt, sxt = _quantize_rows_and_cols(x2, opts)
            saved_x = (qxt, sxt)
        else:
            qx, sx = quant.quantize_1x128(x2, block=opts.block, pow2=opts.pow2, gemm_layout=opts.gemm_layout)
            if need_dw:
                saved_x = (x2,)
        if counter is not None:
            bad_rows = torch.isnan(sx).any(dim=-1).sum()
            counter.add_(torch.where(weight_nonfinite, x2.shape[0], bad_rows))
        y = fp8_block_gemm(qx, sx, qw, sw, out_dtype=opts.out_dtype, backend=opts.gemm, block=opts.block)
        if bias is not None:
            y = y + bias.to(opts.out_dtype)

        ctx.opts = opts
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.need = (need_dx, need_dw)
        ctx.qweight = qweight if need_dx else None
        saved_w = (qw, sw) if need_dx else ()
        ctx.n_saved_x = len(saved_x)
        ctx.save_for_backward(*saved_x, *saved_w)
        return y  # [M, N]; FP8BlockLinear.forward restores the leading dims

    @staticmethod
    def backward(ctx, dy: Tensor):
        opts: _Opts = ctx.opts
        need_dx, need_dw = ctx.need
        saved = ctx.saved_tensors
        saved_x, saved_w = saved[:ctx.n_saved_x], saved[ctx.n_saved_x:]
        n = dy.shape[-1]
        dy2 = dy.reshape(-1, n)  # [M, N]
        dx = dw = db = None
        if opts.backward == "fp8":
            quant_opts = {"block": opts.block, "pow2": opts.pow2, "gemm_layout": opts.gemm_layout}
            if need_dx and need_dw:  # both quantizations of dy
                qdy, sdy, qdyt, sdyt = _quantize_rows_and_cols(dy2, opts)
            elif need_dx:
                qdy, sdy = quant.quantize_1x128(dy2, **quant_opts)  # [M, N], [M, N/128]
            elif need_dw:
                qdyt, sdyt = quant.quantize_128x1(dy2, **quant_opts)  # [M, N], [M/128, N]
            if need_dx:
                qwt, swt = ctx.qweight.dgrad_operands()  # W^T [K, N], [K/128, N/128]
                dx = fp8_block_gemm(qdy, sdy, qwt, swt, out_dtype=ctx.x_dtype, backend=opts.gemm,
                                    a_blocks="1x128", b_blocks="128x128", block=opts.block)
            if need_dw:
                qxt, sxt = saved_x  # [M, K], [M/128, K]
                dw = fp8_block_gemm(qdyt.t(), sdyt.t(), qxt.t(), sxt.t(), out_dtype=ctx.w_dtype,
                                    backend=opts.gemm, a_blocks="1x128", b_blocks="1x128", block=opts.block)
        else:  # straight-through: plain matmuls in the input dtype
            if need_dx:
                qw, sw = saved_w
                w_dq = quant.dequantize_128x128(qw, sw, block=opts.block).to(dy2.dtype)
                dx = (dy2 @ w_dq).to(ctx.x_dtype)
            if need_dw:
                (x2,) = saved_x
                dw = (dy2.t() @ x2.to(dy2.dtype)).to(ctx.w_dtype)
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(dim=0)
        return dx, dw, db, None, None, None, None, None, None


class FP8BlockLinear(nn.Linear):
    """nn.Linear computing in block FP8. Same Parameters (weight [N, K], bias [N]) and state_dict keys as
    nn.Linear; output and input gradient in the input dtype (the autocast dtype under autocast), weight
    gradient in the weight's dtype. ``bf16_shadow_depth > 0`` (see shadow.py) computes plain F.linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: Fp8Config | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8_state(config)

    def _init_fp8_state(self, config: Fp8Config | None) -> None:
        self.fp8_config = config if config is not None else Fp8Config()
        self.bf16_shadow_depth = 0
        self.nonfinite_count: Tensor | None = None
        self._weight_cache: tuple[tuple, _QuantizedWeight] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config | None = None) -> "FP8BlockLinear":
        """A new FP8BlockLinear sharing ``linear``'s weight and bias Parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._init_fp8_state(config)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this module's Parameters."""
        linear = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(linear)
        linear.in_features, linear.out_features = self.in_features, self.out_features
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        return linear

    def quantized_weight(self) -> tuple[Tensor, Tensor, Tensor]:
        """(codes [N, K] e4m3fn, scales [N/128, K/128] fp32, 0-dim bool "weight has a non-finite block"),
        cached until the weight changes (see module docstring) when config.cache_weights."""
        qweight = self._quantized_weight()
        return qweight.qw, qweight.sw, qweight.bad

    def _quantized_weight(self) -> _QuantizedWeight:
        w, cfg = self.weight, self.fp8_config
        key = (_weight_epoch, w.data_ptr(), w._version, w.dtype, w.device, cfg.block_size, cfg.power_of_two_scales)
        cached = self._weight_cache
        # A cache built under torch.inference_mode holds inference tensors, which autograd cannot save.
        if cfg.cache_weights and cached is not None and cached[0] == key and (
                torch.is_inference_mode_enabled() or not cached[1].qw.is_inference()):
            return cached[1]
        with torch.no_grad():
            qw, sw = quant.quantize_128x128(w.detach(), block=cfg.block_size, pow2=cfg.power_of_two_scales)
            qweight = _QuantizedWeight(qw, sw, torch.isnan(sw).any())
        self._weight_cache = (key, qweight) if cfg.cache_weights else None
        return qweight

    def forward(self, x: Tensor) -> Tensor:
        if self.bf16_shadow_depth > 0:
            return F.linear(x, self.weight, self.bias)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        counter = self.nonfinite_count
        if counter is None or counter.device != x.device or (
                counter.is_inference() and not torch.is_inference_mode_enabled()):
            # (re)created outside inference mode too: an inference tensor cannot be updated in place later
            carried = 0 if counter is None or counter.device != x.device else int(counter)
            self.nonfinite_count = torch.full((), carried, dtype=torch.int64, device=x.device)
        cfg = self.fp8_config
        qweight = self._quantized_weight()
        opts = _Opts(block=cfg.block_size, pow2=cfg.power_of_two_scales, gemm=cfg.gemm, backward=cfg.backward,
                     out_dtype=x.dtype, save_for_backward=torch.is_grad_enabled(), gemm_layout=x.is_cuda,
                     fused_quantizer=cfg.fused_quantizer)
        y = _FP8BlockLinearFn.apply(x, self.weight, self.bias, qweight.qw, qweight.sw, qweight.bad,
                                    self.nonfinite_count, qweight, opts)
        # Reshaped outside the autograd Function: a view returned by a custom Function cannot be modified in
        # place, which nn.Linear's output allows (e.g. y.mul_ in user code).
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return (f"{super().extra_repr()}, block={cfg.block_size}, backward={cfg.backward}, gemm={cfg.gemm}, "
                f"pow2={cfg.power_of_two_scales}")


def pop_nonfinite_count(model: nn.Module) -> Tensor:
    """Sum of ``nonfinite_count`` over every FP8BlockLinear in ``model`` (0-dim int64 tensor, no sync), and
    reset them to zero. Returns a CPU zero when no layer has run yet."""
    total: Tensor | None = None
    for module in model.modules():
        if isinstance(module, FP8BlockLinear) and module.nonfinite_count is not None:
            count = module.nonfinite_count
            total = count.clone() if total is None else total + count.to(total.device)
            count.zero_()
    return total if total is not None else torch.zeros((), dtype=torch.int64)
