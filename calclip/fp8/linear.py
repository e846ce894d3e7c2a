"""FP8BlockLinear: an nn.Linear that computes its three GEMMs in block-scaled FP8 (DeepSeek-V3 recipe).

    forward  y  = Q1x128(x) Q128x128(W)^T + b
    dgrad    dx = Q1x128(dy) Q128x128(W)                (the forward's weight codes, transposed)
    wgrad    dW = Q128x1(dy)^T Q128x1(x)                (both quantized along the token axis M)

Saved for backward (backward="fp8"): x quantized 128x1 — FP8 codes + one fp32 scale per 128 tokens per
feature, ~1.03 bytes per element instead of BF16's 2 — and the weight codes (shared with the module's
buffers, no extra memory). x is quantized 128x1 directly in the forward, not dequantized from the forward's
1x128 codes and re-quantized in the backward: one rounding instead of two. The two quantizations of x (and,
in the backward, of dy) come from two kernels, or from one fused kernel that reads the tensor once with
Fp8Config.fused_quantizer (slower on the H200 today, docs/benchmarks.md). All scales are emitted in the
strides torch._scaled_mm reads, so no operand is re-laid out per call.

Hot path (issue 8: the layer was host-bound, ~0.5 ms of Python per forward): a forward is one 1x128
quantizer launch (which also counts non-finite tokens, below), one 128x1 launch when a weight gradient will
be needed, and one GEMM; a backward is two quantizer launches and two GEMMs. Which GEMM backend serves a
shape is decided once per (shape, dtype, device) and cached (``_gemm``).

The quantized weight lives in per-module tensors (plain attributes, never in state_dict) that are refreshed
IN PLACE when the weight changes, so their addresses never move: a CUDA graph captured over the layer (HF
``generate`` with a static cache compiles its decode step with mode="reduce-overhead") reads the current
codes on every replay. Staleness is the key (weight epoch, weight.data_ptr(), weight._version, dtype,
device): in-place updates (optimizer.step, load_state_dict's copy_) bump _version, moves change data_ptr,
and fused optimizers (transformers' default adamw_torch_fused), which bump neither, advance a process-wide
weight epoch through a global optimizer step post-hook; code that writes ``param.data`` directly calls
``invalidate_fp8_weight_caches()``. The W^T codes that dgrad reads ([K, N] contiguous on CUDA, so
torch._scaled_mm gets K-major operands) are made by the first backward that needs them; from then on a refresh
writes codes, scales and the non-finite flag in one Triton launch and W^T in a second (``quant.requantize_128x128_``)
instead of eight launches (quantize, isnan, any, three copies, two transposing copies).
A refresh bumps the codes' autograd version, so a backward whose forward saw older codes raises instead of
computing a gradient against weights it never used.

Eager calls check staleness in the layer; under torch.compile the layer calls the triton ops
``calclip::fp8_linear_forward`` / ``calclip::fp8_linear_backward`` (no graph break inside the layer; Inductor
sees and launches their Triton kernels), and the staleness check runs once per model call in a forward pre-hook that
``quantize_model`` puts on the root module (one graph break at the top of the model, outside the layers).
``refresh_fp8_weights(model)`` does the same by hand, e.g. before replaying a graph captured by other means, or
before each call of one submodule of a converted model compiled on its own (its layers leave the refresh to the
root's hook, which that call does not run; a bare FP8BlockLinear compiled alone refreshes in its own hook).

Fused decode (``Fp8Config.decode_fused_max_m``): a forward with grad disabled (rollout decode) and at most that
many rows takes ONE launch, ``triton_kernels.fp8_linear_fused_quant_gemm``, which quantizes x's 1x128 groups in the
GEMM's prologue and counts non-finite rows itself: the same codes and scales as the two-launch path, which a training
forward always takes (its backward needs the saved 128x1 codes). By default (None) only eager CUDA calls of up to
256 rows take it: there the H200 measured it faster, while in CUDA graphs the two-launch path's GPU time was lower.
An explicit limit also applies to compiled calls on CUDA, recorded as the triton op ``calclip::fp8_linear_decode``
(CUDA graphs included); compiled CPU calls stay unfused (the interpreter's kernels cannot be recorded).

backward="bf16" is the straight-through comparison mode (eager only): dx = dy W_dq with W_dq =
dequant(Q128x128(W)), and dW = dy^T x with the unquantized x (saved in its own dtype), plain matmuls.

Non-finite inputs: a 1x128 group with NaN/Inf gets a NaN scale (reference.py), so its token's outputs are
NaN. ``nonfinite_count`` (0-dim int64 tensor, plain attribute on the weight's device) accumulates the number
of input rows (tokens) whose output is non-finite for that reason — every row when the weight has a
non-finite block. The 1x128 quantizer kernel counts while it holds the rows (CUDA), never syncs, counts every
forward call (including gradient-checkpointing recomputation); ``pop_nonfinite_count(model)`` sums and resets.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from calclip.fp8 import quant
from calclip.fp8.config import Fp8Config
from calclip.fp8.gemm import fp8_block_gemm, resolve_backend, row_scales_of, scaled_mm_blockwise

# Advanced after every optimizer step of any optimizer in the process, and by invalidate_fp8_weight_caches():
# part of every weight-cache key, since fused optimizers and `.data` writes change weights without bumping
# Tensor._version (measured: torch 2.13 AdamW(fused=True) leaves _version unchanged).
_weight_epoch = 0


def invalidate_fp8_weight_caches() -> None:
    """Mark every FP8BlockLinear's weight codes stale: call after writing ``param.data`` directly (EMA
    updates, weight syncs that copy into ``.data``, PEFT merges); optimizer steps do this by themselves."""
    global _weight_epoch
    _weight_epoch += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_fp8_weight_caches()


register_optimizer_step_post_hook(_after_optimizer_step)


# ----------------------------------------------------------------------------------------------------------
# The math of one layer, shared by the eager autograd Function and the custom ops torch.compile sees.
# ----------------------------------------------------------------------------------------------------------

# (backend, a_blocks, b_blocks, m, n, k, out_dtype, device, row_scales) -> "scaled_mm" | other backend name
_gemm_choice: dict[tuple, str] = {}


def _gemm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, out_dtype: torch.dtype, backend: str,
          a_blocks: str, b_blocks: str, row_scales: bool = False) -> Tensor:
    """fp8_block_gemm for operands already in the layouts the quantizers emit with gemm_layout=True; the
    backend decision is made once per shape, and the torch._scaled_mm path re-lays out nothing (but for
    ``row_scales``' "scaled_mm_rows", which repeats a weight's scales per row: a [K/128, N] fp32 tensor per call)."""
    (m, k), n = qa.shape, qb.shape[0]
    traced = quant.is_traced(qa)
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
        mm = scaled_mm_blockwise if traced else torch._scaled_mm
        return mm(qa, qb.t(), scale_a=sa, scale_b=scale_b, out_dtype=out_dtype)
    if chosen == "splitk":
        return quant.triton_kernels().fp8_splitk_gemm_triton(qa, sa, qb, sb, out_dtype=out_dtype)
    return fp8_block_gemm(qa, sa, qb, sb, out_dtype=out_dtype, backend=chosen, a_blocks=a_blocks,
                          b_blocks=b_blocks)


def _quantize_both(t2: Tensor, pow2: bool, fused: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """t2 [M, K] -> 1x128 codes/scales and 128x1 codes/scales (the same values either path)."""
    if fused:
        return quant.quantize_1x128_and_128x1(t2, pow2=pow2, gemm_layout=True)
    return (*quant.quantize_1x128(t2, pow2=pow2, gemm_layout=True),
            *quant.quantize_128x1(t2, pow2=pow2, gemm_layout=True))


def _forward(x2: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor, save_for_wgrad: bool,
             pow2: bool, fused: bool, gemm: str, out_dtype: torch.dtype,
             row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """x2 [M, K]; qw [N, K] e4m3fn, sw [N/128, K/128]; counter int64 [] (+= non-finite rows)
    -> y [M, N] out_dtype, and x quantized 128x1 (qxt [M, K], sxt [M/128, K]) when save_for_wgrad, else None.
    row_scales: Fp8Config.scaled_mm_row_scales (gemm.resolve_backend)."""
    if save_for_wgrad and fused:
        qx, sx, qxt, sxt = _quantize_both(x2, pow2, fused)
        quant.add_nonfinite_rows(counter, sx, weight_bad)
    else:
        qx, sx = quant.quantize_1x128(x2, pow2=pow2, gemm_layout=True, nonfinite_count=counter,
                                      weight_bad=weight_bad)
        qxt, sxt = quant.quantize_128x1(x2, pow2=pow2, gemm_layout=True) if save_for_wgrad else (None, None)
    y = _gemm(qx, sx, qw, sw, out_dtype, gemm, "1x128", "128x128", row_scales)
    return y, qxt, sxt


def _backward(dy2: Tensor, qwt: Tensor, swt: Tensor, qxt: Tensor, sxt: Tensor, need_dx: bool, need_dw: bool,
              pow2: bool, fused: bool, gemm: str, x_dtype: torch.dtype,
              w_dtype: torch.dtype, row_scales: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """dy2 [M, N]; W^T codes qwt [K, N], swt [K/128, N/128]; saved x 128x1 -> (dx [M, K], dW [N, K])."""
    dx = dw = None
    if need_dx and need_dw:
        qdy, sdy, qdyt, sdyt = _quantize_both(dy2, pow2, fused)
    elif need_dx:
        qdy, sdy = quant.quantize_1x128(dy2, pow2=pow2, gemm_layout=True)  # [M, N], [M, N/128]
    elif need_dw:
        qdyt, sdyt = quant.quantize_128x1(dy2, pow2=pow2, gemm_layout=True)  # [M, N], [M/128, N]
    if need_dx:
        dx = _gemm(qdy, sdy, qwt, swt, x_dtype, gemm, "1x128", "128x128", row_scales)
    if need_dw:
        dw = _gemm(qdyt.t(), sdyt.t(), qxt.t(), sxt.t(), w_dtype, gemm, "1x128", "1x128")
    return dx, dw


class _FP8BlockLinearFn(torch.autograd.Function):
    """Eager autograd: calls _forward/_backward directly (no dispatcher round trip per call)."""

    @staticmethod
    def forward(ctx, x2: Tensor, weight: Tensor, qw: Tensor, sw: Tensor, weight_bad: Tensor, counter: Tensor,
                layer: "FP8BlockLinear", cfg: Fp8Config, out_dtype: torch.dtype, grad: bool) -> Tensor:
        # x2 [M, K]; weight [N, K] (only its grad slot is used here); qw/sw: the layer's current codes
        # grad: the caller's grad mode (forward runs under no_grad; needs_input_grad follows requires_grad alone)
        need_dx, need_dw = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        fp8_backward = cfg.backward == "fp8"
        y, qxt, sxt = _forward(x2, qw, sw, weight_bad, counter, need_dw and fp8_backward,
                               cfg.power_of_two_scales, cfg.fused_quantizer, cfg.gemm, out_dtype,
                               cfg.scaled_mm_row_scales)
        ctx.cfg, ctx.need = cfg, (need_dx, need_dw)
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        if fp8_backward:
            saved_w = layer._dgrad_codes() if need_dx else (None, None)
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
            dx, dw = _backward(dy2, qwt, swt, qxt, sxt, need_dx, need_dw, cfg.power_of_two_scales,
                               cfg.fused_quantizer, cfg.gemm, ctx.x_dtype, ctx.w_dtype, cfg.scaled_mm_row_scales)
        else:  # straight-through: plain matmuls in the input dtype
            qw, sw, x2 = ctx.saved_tensors
            dx = dw = None
            if need_dx:
                w_dq = quant.dequantize_128x128(qw, sw, block=cfg.block_size).to(dy2.dtype)
                dx = (dy2 @ w_dq).to(ctx.x_dtype)
            if need_dw:
                dw = (dy2.t() @ x2.to(dy2.dtype)).to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# The same math as torch.library triton ops, for torch.compile (CUDA-graph safe: no syncs). Dynamo records one
# op per layer call (its fake implementation is the same code run on FakeTensors); AOTAutograd then decomposes
# each op into the Triton kernels (recorded through wrap_triton, see triton_kernels._Tuned.launch) and the
# opaque cuBLAS GEMM op ``calclip::scaled_mm_blockwise``, so Inductor launches them from its own generated
# code: no Python of this module runs per call in a compiled graph.
# ----------------------------------------------------------------------------------------------------------


@torch.library.triton_op("calclip::fp8_linear_forward", mutates_args=())
def _forward_op(x2: Tensor, weight: Tensor, qw: Tensor, sw: Tensor, qwt: Tensor | None, swt: Tensor | None,
                weight_bad: Tensor, save_for_wgrad: bool, pow2: bool, fused: bool, gemm: str,
                out_dtype: torch.dtype, row_scales: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (y [M, N], qxt [M, K] (128x1 codes, column-major) or [0], sxt [M/128, K] or [0], non-finite rows []).
    weight and the dgrad codes qwt/swt are inputs only for autograd (the weight's grad slot, saved for dx). The
    count is returned, not added to the layer's counter: torch.library registers autograd for functional ops only
    (calls without grad take ``_infer_op``, which adds in place)."""
    counter = torch.zeros((), dtype=torch.int64, device=x2.device)
    y, qxt, sxt = _forward(x2, qw, sw, weight_bad, counter, save_for_wgrad, pow2, fused, gemm, out_dtype,
                           row_scales)
    if qxt is None:
        qxt, sxt = x2.new_empty((0,), dtype=torch.float8_e4m3fn), x2.new_empty((0,), dtype=torch.float32)
    return y, qxt, sxt, counter


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
    """``triton_kernels.fp8_linear_decode_unchecked`` (fp8_linear_fused_quant_gemm without its argument checks,
    for the layer's own operands) when it can serve ``x2`` (a CUDA tensor, or a CPU tensor under
    TRITON_INTERPRET=1, in bf16/fp16/fp32, triton importable), else None: then the layer's usual path runs.
    Whether a call may take it is ``_fused_decode_applies`` (Fp8Config.decode_fused_max_m, resolved per call)."""
    if x2.dtype not in _FUSED_DECODE_DTYPES:
        return None
    if not x2.is_cuda and not (x2.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return None
    module = quant.triton_kernels()
    return getattr(module, "fp8_linear_decode_unchecked", None) if module is not None else None


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
        # Current weight codes (refreshed in place, addresses stable): qw [N, K], sw [N/128, K/128], bad [].
        self._fp8_qw: Tensor | None = None
        self._fp8_sw: Tensor | None = None
        self._fp8_bad: Tensor | None = None
        self._fp8_key: tuple | None = None
        # dgrad operands W^T (qwt [K, N], swt [K/128, N/128]); built on the first backward that needs them.
        self._fp8_qwt: Tensor | None = None
        self._fp8_swt: Tensor | None = None
        self._fp8_dgrad_key: tuple | None = None
        # A layer compiled on its own refreshes its codes in its own pre-hook; inside a model that quantize_model
        # converted, the root's pre-hook does it for all layers (one graph break per model, not per layer).
        self._fp8_refreshed_by_root = False
        self._fp8_own_refresh_hook = self.register_forward_pre_hook(_refresh_layer_before_compiled_call)
        # Sibling group (siblings.py, Fp8Config.decode_group_siblings): one fused decode launch for q/k/v, gate/up.
        self._fp8_group = None
        self._fp8_group_index = 0

    def _set_refreshed_by_root(self, by_root: bool) -> None:
        """Whether the converted root's pre-hook refreshes this layer's codes before compiled calls. If it does, the
        layer's own pre-hook would do nothing and is removed: a module without hooks takes nn.Module's fast call
        path, which saves host time in every eager call (decode calls each layer once per token)."""
        self._fp8_refreshed_by_root = by_root
        handle = self._fp8_own_refresh_hook
        if by_root and handle is not None:
            handle.remove()
            self._fp8_own_refresh_hook = None
        elif not by_root and handle is None:
            self._fp8_own_refresh_hook = self.register_forward_pre_hook(_refresh_layer_before_compiled_call)

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
        return linear_sharing_parameters(self)

    # -- weight codes -------------------------------------------------------------------------------------

    def _weight_key(self) -> tuple:
        """What the weight codes are current for: the weight epoch and ``_weight_state``."""
        return (_weight_epoch, _weight_state(self))

    def quantized_weight(self) -> tuple[Tensor, Tensor, Tensor]:
        """(codes [N, K] e4m3fn, scales [N/128, K/128] fp32, 0-dim bool "weight has a non-finite block"),
        current for the weight as it is now (re-quantized in place when it changed, see module docstring)."""
        self._refresh_weight_codes()
        return self._fp8_qw, self._fp8_sw, self._fp8_bad

    def _refresh_weight_codes(self) -> None:
        key = self._weight_key()
        if self._fp8_key == key and self.fp8_config.cache_weights:
            return
        cfg = self.fp8_config
        w = self.weight.detach()
        dgrad_fresh = False
        # Outside inference mode, so codes built under torch.inference_mode can still be saved by autograd.
        with torch.inference_mode(False), torch.no_grad():
            qw = self._fp8_qw
            group = self._fp8_group
            new_buffers = qw is None or qw.shape != w.shape or qw.device != w.device
            if new_buffers and group is not None and w.shape == (self.out_features, self.in_features):
                # a grouped sibling's codes are views into the group's stacked buffers (one launch for all)
                qw, sw = group.buffers(self._fp8_group_index, w.device)
                bad = torch.zeros((), dtype=torch.bool, device=w.device)
                quant.requantize_128x128_(w, qw, sw, bad, block=cfg.block_size, pow2=cfg.power_of_two_scales)
                self._fp8_qw, self._fp8_sw, self._fp8_bad = qw, sw, bad
                _mark_static(qw, sw, bad)
            elif new_buffers:
                qw, sw = quant.quantize_128x128(w, block=cfg.block_size, pow2=cfg.power_of_two_scales)
                self._fp8_qw, self._fp8_sw, self._fp8_bad = qw, sw, torch.isnan(sw).any()
                _mark_static(self._fp8_qw, self._fp8_sw, self._fp8_bad)
            else:  # in place: captured graphs and saved-for-backward checks see the same tensors
                qwt = self._fp8_qwt
                # W^T's buffers, once a backward has made them (CUDA; on CPU they are views of the codes), are
                # refreshed by the same launch instead of by two copies at the next backward.
                dgrad_fresh = qw.is_cuda and qwt is not None and qwt.shape == qw.t().shape and qwt.device == qw.device
                quant.requantize_128x128_(w, qw, self._fp8_sw, self._fp8_bad,
                                          transposed=(qwt, self._fp8_swt) if dgrad_fresh else None,
                                          block=cfg.block_size, pow2=cfg.power_of_two_scales)
            if self.nonfinite_count is None or self.nonfinite_count.device != qw.device:
                self._new_counter(qw.device)
        self._fp8_key = key
        self._fp8_dgrad_key = key if dgrad_fresh else None  # else W^T follows on the next backward that needs it

    def _dgrad_codes(self) -> tuple[Tensor, Tensor]:
        """(W^T codes [K, N], W^T scales [K/128, N/128]) of the current weight codes for dx = dy W. On CUDA
        contiguous copies (K-major operands for torch._scaled_mm); on CPU views of the codes."""
        if self._fp8_dgrad_key == self._fp8_key and self._fp8_qwt is not None:
            return self._fp8_qwt, self._fp8_swt
        qw, sw = self._fp8_qw, self._fp8_sw
        with torch.inference_mode(False), torch.no_grad():
            if not qw.is_cuda:
                self._fp8_qwt, self._fp8_swt = qw.t(), sw.t()
            elif self._fp8_qwt is None or self._fp8_qwt.shape != qw.t().shape or self._fp8_qwt.device != qw.device:
                self._fp8_qwt, self._fp8_swt = qw.t().contiguous(), sw.t().contiguous()
                _mark_static(self._fp8_qwt, self._fp8_swt)
            else:
                self._fp8_qwt.copy_(qw.t())
                self._fp8_swt.copy_(sw.t())
        self._fp8_dgrad_key = self._fp8_key
        return self._fp8_qwt, self._fp8_swt

    def _new_counter(self, device: torch.device) -> None:
        old = self.nonfinite_count
        carried = 0 if old is None else int(old)  # a device move: one sync, not per call
        with torch.inference_mode(False):
            self.nonfinite_count = torch.full((), carried, dtype=torch.int64, device=device)
        _mark_static(self.nonfinite_count)

    def refresh(self, *, for_backward: bool | None = None) -> None:
        """Bring the weight codes (and, when a backward may follow, the dgrad W^T codes) up to date with the
        weight; what the eager forward does by itself, and ``refresh_fp8_weights`` does before compiled calls."""
        self._refresh_weight_codes()
        if for_backward is None:  # grad mode alone: a frozen weight (a LoRA base) still needs W^T for dx
            for_backward = torch.is_grad_enabled()
        if for_backward and self.fp8_config.backward == "fp8":
            self._dgrad_codes()

    # -- forward ------------------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        if self.bf16_shadow_depth > 0:
            return F.linear(x, self.weight, self.bias)
        device_type = x.device.type
        cfg = self.fp8_config
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        compiling = torch.compiler.is_compiling()
        y = None if compiling else self._eager_fused_decode(x2, cfg, autocast, x)
        if y is None:
            if autocast is not None:
                x2 = x2.to(autocast)
            if not compiling:
                y = self._eager_forward(x2, cfg)
            elif cfg.backward == "fp8":
                y = self._compiled_forward(x2, cfg)
            else:  # the straight-through comparison mode has no custom op: it runs eagerly (a graph break per layer)
                y = self._eager_forward_outside_graph(x2, cfg)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        # Reshaped outside the autograd Function: a view returned by a custom Function cannot be modified in
        # place, which nn.Linear's output allows (e.g. y.mul_ in user code).
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _eager_forward(self, x2: Tensor, cfg: Fp8Config) -> Tensor:
        self._refresh_weight_codes()
        return _FP8BlockLinearFn.apply(x2, self.weight, self._fp8_qw, self._fp8_sw, self._fp8_bad,
                                       self.nonfinite_count, self, cfg, x2.dtype, torch.is_grad_enabled())

    def _eager_fused_decode(self, x2: Tensor, cfg: Fp8Config, autocast: torch.dtype | None,
                            x: Tensor | None = None) -> Tensor | None:
        """The eager fused decode (one launch: x quantized in the GEMM's prologue, non-finite rows counted), or None
        when it does not apply. x2 is taken before the autocast cast: an fp32 x2 under bf16/fp16 autocast is rounded
        in the kernel's registers (bit for bit ``x2.to(autocast)`` first, one launch fewer; fp32 master weights
        leave the residual stream fp32, so q/k/v and gate/up would each launch a cast)."""
        if not _fused_decode_applies(x2, cfg, compiled=False):
            return None
        round_to = None
        if autocast is not None and x2.dtype != autocast:
            if x2.dtype == torch.float32 and autocast in (torch.bfloat16, torch.float16):
                round_to = autocast
            else:
                x2 = x2.to(autocast)
        fused = _fused_decode_kernel(x2)
        # The kernel takes the layer's operands unchecked: a call it cannot serve (a wrong width, another device,
        # an empty layer) takes the usual path, which raises where nn.Linear would.
        if fused is None or x2.shape[1] != self.in_features or self.in_features == 0 or self.out_features == 0:
            return None
        out_dtype = round_to or x2.dtype
        group = self._fp8_group
        if group is not None and x is not None and cfg.decode_group_siblings:  # x: the caller's tensor, the key
            y = group.decode(self, x, x2, fused, out_dtype=out_dtype, round_to=round_to, pow2=cfg.power_of_two_scales)
            if y is not None:
                return y
        self._refresh_weight_codes()
        if x2.get_device() != self._fp8_qw.get_device():
            return None
        return fused(x2, self._fp8_qw, self._fp8_sw, out_dtype=out_dtype,
                     nonfinite_count=self.nonfinite_count, weight_bad=self._fp8_bad, pow2=cfg.power_of_two_scales,
                     round_to=round_to)

    @torch.compiler.disable
    def _eager_forward_outside_graph(self, x2: Tensor, cfg: Fp8Config) -> Tensor:
        y = self._eager_fused_decode(x2, cfg, None)
        return self._eager_forward(x2, cfg) if y is None else y

    def _compiled_forward(self, x2: Tensor, cfg: Fp8Config) -> Tensor:
        if self._fp8_qw is None:
            raise RuntimeError("FP8BlockLinear is compiled before its weight codes exist: compile the model that "
                               "quantize_model converted (its pre-hook refreshes them), or call "
                               "calclip.fp8.refresh_fp8_weights(model) before the compiled call")
        grad = torch.is_grad_enabled()
        # CUDA only: under the interpreter (CPU) wrap_triton cannot record a kernel, so such calls stay unfused.
        if x2.is_cuda and _fused_decode_applies(x2, cfg, compiled=True) and _fused_decode_kernel(x2) is not None:
            return torch.ops.calclip.fp8_linear_decode(x2, self._fp8_qw, self._fp8_sw, self._fp8_bad,
                                                       self.nonfinite_count, cfg.power_of_two_scales, x2.dtype)
        if not grad:
            return torch.ops.calclip.fp8_linear_infer(x2, self._fp8_qw, self._fp8_sw, self._fp8_bad,
                                                      self.nonfinite_count, cfg.power_of_two_scales, cfg.gemm,
                                                      x2.dtype, cfg.scaled_mm_row_scales)
        qwt, swt = self._fp8_qwt, self._fp8_swt
        if qwt is None:
            raise RuntimeError("FP8BlockLinear is compiled for training before its dgrad codes exist: compile the "
                               "model that quantize_model converted, or call refresh_fp8_weights(model) first")
        y, _, _, bad_rows = torch.ops.calclip.fp8_linear_forward(
            x2, self.weight, self._fp8_qw, self._fp8_sw, qwt, swt, self._fp8_bad, self.weight.requires_grad,
            cfg.power_of_two_scales, cfg.fused_quantizer, cfg.gemm, x2.dtype, cfg.scaled_mm_row_scales)
        self.nonfinite_count.add_(bad_rows)
        return y

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return (f"{super().extra_repr()}, block={cfg.block_size}, backward={cfg.backward}, gemm={cfg.gemm}, "
                f"pow2={cfg.power_of_two_scales}")


def linear_sharing_parameters(module: nn.Module) -> nn.Linear:
    """A plain nn.Linear holding ``module``'s weight and bias Parameters (no copy): every FP8 linear's way back."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = module.in_features, module.out_features
    linear.weight, linear.bias = module.weight, module.bias
    linear.train(module.training)
    return linear


@torch.compiler.disable  # allocation-time only; if a traced call ever reaches it, a graph break, not an error
def _mark_static(*tensors: Tensor) -> None:
    """Tell torch.compile's CUDA-graph trees these long-lived tensors keep their address (like parameters), so
    replays read them in place instead of copying them into the graph's own inputs."""
    for t in tensors:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t)


def fp8_layers(model: nn.Module) -> list[FP8BlockLinear]:
    """Every FP8BlockLinear in ``model`` (``model`` itself included), in module order."""
    return [m for m in model.modules() if isinstance(m, FP8BlockLinear)]


def refresh_fp8_weights(model: nn.Module, *, for_backward: bool | None = None) -> None:
    """Re-quantize, in place, the weight codes of every FP8BlockLinear in ``model`` whose weight changed (and
    their dgrad W^T codes when ``for_backward``, by default when grad mode is on).

    The root's pre-hook calls this before every compiled call (a CUDA-graphed decode step included). When no
    weight changed since the last call that refreshed them all, it returns after one pass over the weights' keys:
    ~30 us against ~42 us for every layer's own check, 56 layers on the development CPU."""
    layers = getattr(model, "_calclip_fp8_layers", None) or fp8_layers(model)
    if for_backward is None:
        for_backward = torch.is_grad_enabled()
    key = _all_codes_key(layers, for_backward)
    if key is not None and model.__dict__.get("_calclip_codes_key") == key:
        return
    for layer in layers:
        layer.refresh(for_backward=for_backward)
    if key is not None:
        model.__dict__["_calclip_codes_key"] = key


def _weight_state(layer: nn.Module) -> tuple:
    """The layer's weight as its codes' staleness key sees it: storage address, autograd version, dtype, device."""
    w = layer._parameters.get("weight")  # nn.Module.__getattr__ costs ~0.8 us a lookup, on every eager call
    if w is None:
        w = layer.weight
    return (w.data_ptr(), w._version, w.dtype, w.device)


def _all_codes_key(layers: list[FP8BlockLinear], for_backward: bool) -> tuple | None:
    """Every layer's ``_weight_key`` (the epoch once, then each ``_weight_state``) with the layer and its config, or
    None when a layer does not cache its codes (``cache_weights=False`` re-quantizes on every refresh)."""
    key = [_weight_epoch, for_backward]
    for layer in layers:
        cfg = layer.fp8_config
        if not cfg.cache_weights:
            return None
        key.append((id(layer), id(cfg), _weight_state(layer)))
    return tuple(key)


@torch.compiler.disable
def _refresh_outside_graph(model: nn.Module) -> None:
    refresh_fp8_weights(model)


def _refresh_layer_before_compiled_call(layer: "FP8BlockLinear", args) -> None:
    if torch.compiler.is_compiling() and not layer._fp8_refreshed_by_root:
        _refresh_outside_graph(layer)


def refresh_before_compiled_call(model: nn.Module, args) -> None:
    """Forward pre-hook that quantize_model registers on the converted root module: under torch.compile it
    refreshes every layer's codes eagerly (one graph break, before the model's graph); eager calls skip it,
    since each layer checks its own weight. Inside ``frozen_fp8_weights(model)`` compiled calls skip it too
    (no graph break): the codes were refreshed on entry."""
    if torch.compiler.is_compiling() and not model._calclip_frozen:
        _refresh_outside_graph(model)


@contextlib.contextmanager
def frozen_fp8_weights(model: nn.Module):
    """A block in which the weights of ``model``'s FP8 layers do not change: a generation call.

    On entry every layer's codes are brought up to date once; inside, compiled calls of ``model`` skip the root
    pre-hook's refresh, so the compiled graph has no graph break in front of it (``generate`` with a static cache
    otherwise leaves its CUDA-graphed decode step once per token to run that check eagerly). Eager calls keep their
    own per-layer check. On a normal exit the weights are checked once: if one changed inside (an optimizer step,
    ``load_state_dict``), it raises, since compiled calls inside may have used the codes of entry.

    Does nothing for a model without FP8 layers, inside another ``frozen_fp8_weights`` of the same model, and when
    a layer does not cache its codes (``cache_weights=False``, sharded parameters: those re-quantize on every call).
    The trainer wraps each transformers ``generate`` call in it."""
    layers = model.__dict__.get("_calclip_fp8_layers")
    key = _all_codes_key(layers, False) if layers and not model._calclip_frozen else None
    if key is None:
        yield model
        return
    refresh_fp8_weights(model, for_backward=False)  # re-quantizes codes, not weights: ``key`` still holds
    model._calclip_frozen = True
    try:
        yield model
    finally:
        model._calclip_frozen = False
    if _all_codes_key(layers, False) != key:
        raise RuntimeError("a weight of an FP8 layer changed inside frozen_fp8_weights(model): compiled calls inside "
                           "may have run on the codes of entry; change weights outside the block")


def pop_nonfinite_count(model: nn.Module, types: tuple[type[nn.Module], ...] = (FP8BlockLinear,)) -> Tensor:
    """Sum of ``nonfinite_count`` over every module of ``types`` in ``model`` (FP8BlockLinear by default;
    ``calclip.fp8.pop_nonfinite_count`` passes every recipe's FP8 linear) as a 0-dim int64 tensor (no sync), and
    reset them to zero. Returns a CPU zero when no layer has run yet."""
    total: Tensor | None = None
    for module in model.modules():
        if isinstance(module, types) and module.nonfinite_count is not None:
            count = module.nonfinite_count
            total = count.clone() if total is None else total + count.to(total.device)
            count.zero_()
    return total if total is not None else torch.zeros((), dtype=torch.int64)
