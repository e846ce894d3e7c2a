"""FP8BlockLinear: an nn.Linear that computes its three GEMMs in block-scaled FP8 (DeepSeek-V3 recipe).

    forward  y  = Q1x128(x) Q128x128(W)^T + b
    dgrad    dx = Q1x128(dy) Q128x128(W)                (the forward's weight codes, transposed)
    wgrad    dW = Q128x1(dy)^T Q128x1(x)                (both quantized along the token axis M)

This module holds the layer and decides, per call, which path serves it; the rest of the layer lives beside it:

    linear_math.py      the math of one call (quantizers, GEMM backend choice, forward, backward, fused decode rule)
    linear_function.py  the eager autograd Function (what is saved for backward; backward="bf16")
    linear_ops.py       the same math as torch.library triton ops, which compiled calls record (no graph break)
    weight_codes.py     the weight codes' lifecycle: refreshed in place when the weight changes (weight epoch,
                        optimizer hook, refresh hooks before compiled calls, ``frozen_fp8_weights``)

Fused decode (``Fp8Config.decode_fused_max_m``): a forward with grad disabled (rollout decode) and at most that
many rows takes ONE launch, ``kernels.fp8_linear_fused_quant_gemm``, which quantizes x's 1x128 groups in the
GEMM's prologue and counts non-finite rows itself: the same codes and scales as the two-launch path, which a training
forward always takes (its backward needs the saved 128x1 codes). By default (None) only eager CUDA calls of up to
256 rows take it: there the H200 measured it faster, while in CUDA graphs the two-launch path's GPU time was lower.
An explicit limit also applies to compiled calls on CUDA, recorded as the triton op ``calclip::fp8_linear_decode``
(CUDA graphs included); compiled CPU calls stay unfused (the interpreter's kernels cannot be recorded).

Non-finite inputs: a 1x128 group with NaN/Inf gets a NaN scale (reference.py), so its token's outputs are
NaN. ``nonfinite_count`` (0-dim int64 tensor, plain attribute on the weight's device) accumulates the number
of input rows (tokens) whose output is non-finite for that reason — every row when the weight has a
non-finite block. The 1x128 quantizer kernel counts while it holds the rows (CUDA), never syncs, counts every
forward call (including gradient-checkpointing recomputation); ``pop_nonfinite_count(model)`` sums and resets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from calclip.fp8 import linear_ops  # noqa: F401  (registers the torch.compile ops the layer calls)
from calclip.fp8.config import Fp8Config
from calclip.fp8.linear_function import _FP8BlockLinearFn
from calclip.fp8.linear_math import _fused_decode_applies, _fused_decode_kernel
from calclip.fp8.weight_codes import Fp8WeightCodes


_NO_DGRAD_CODES = ("FP8BlockLinear is compiled for training before its dgrad codes exist: compile the model that "
                   "quantize_model converted, or call refresh_fp8_weights(model) first")


class FP8BlockLinear(nn.Linear, Fp8WeightCodes):
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
        self._init_weight_codes()
        # Sibling group (siblings.py, Fp8Config.decode_group_siblings): one fused decode launch for q/k/v, gate/up.
        self._fp8_group = None
        self._fp8_group_index = 0
        # Shared input (shared_input.py, Fp8Config.share_sibling_inputs): q/k/v, gate/up quantize their x once.
        self._fp8_share = None
        self._fp8_share_index = 0
        # A group of one fed by the op that produces this layer's input (producers.py, Fp8Config.fuse_producers:
        # down_proj, fed by its MLP's SiLU-multiply): the same seam, apart from the sibling groups.
        self._fp8_producer_group = None

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

    # -- forward ------------------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        check_floating_input(self, x)
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
                y = self._eager_forward(x2, cfg, x)
            elif cfg.backward == "fp8":
                y = self._compiled_forward(x2, cfg, x)
            else:  # the straight-through comparison mode has no custom op: it runs eagerly (a graph break per layer)
                y = self._eager_forward_outside_graph(x2, cfg)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        # Reshaped outside the autograd Function: a view returned by a custom Function cannot be modified in
        # place, which nn.Linear's output allows (e.g. y.mul_ in user code).
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _eager_forward(self, x2: Tensor, cfg: Fp8Config, x: Tensor | None = None) -> Tensor:
        self._refresh_weight_codes()
        qw, sw = (self._fp8_qw, self._fp8_sw) if self._fp8_qw is not None else self._transient_codes()
        share = self._fp8_share or self._fp8_producer_group
        # x: the caller's tensor, the key of the input a sibling may have quantized already (shared_input.py)
        codes = share.codes(self, x, x2, compiled=False) if share is not None and x is not None else None
        return _FP8BlockLinearFn.apply(x2, self.weight, qw, sw, self._fp8_bad, self.nonfinite_count, self, cfg,
                                       x2.dtype, torch.is_grad_enabled(), codes)

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
        if x2.get_device() != self._fp8_bad.get_device():
            return None
        qw, sw = (self._fp8_qw, self._fp8_sw) if self._fp8_qw is not None else self._transient_codes()
        return fused(x2, qw, sw, out_dtype=out_dtype,
                     nonfinite_count=self.nonfinite_count, weight_bad=self._fp8_bad, pow2=cfg.power_of_two_scales,
                     round_to=round_to)

    @torch.compiler.disable
    def _eager_forward_outside_graph(self, x2: Tensor, cfg: Fp8Config) -> Tensor:
        y = self._eager_fused_decode(x2, cfg, None)
        return self._eager_forward(x2, cfg) if y is None else y

    def _compiled_forward(self, x2: Tensor, cfg: Fp8Config, x: Tensor | None = None) -> Tensor:
        if self._fp8_bad is None:
            raise RuntimeError("FP8BlockLinear is compiled before its weight codes exist: compile the model that "
                               "quantize_model converted (its pre-hook refreshes them), or call "
                               "calclip.fp8.refresh_fp8_weights(model) before the compiled call")
        grad = torch.is_grad_enabled()
        # Fp8Config.resident_weight_codes=False: the graph quantizes the weight itself, and a backward quantizes W^T
        # from the weight it saves (no codes live from the forward to the backward)
        transient = self._fp8_qw is None
        if transient:
            qw, sw = torch.ops.calclip.fp8_quantize_weight(self.weight.detach(), cfg.block_size,
                                                           cfg.power_of_two_scales)
        else:
            qw, sw = self._fp8_qw, self._fp8_sw
        # CUDA only: under the interpreter (CPU) wrap_triton cannot record a kernel, so such calls stay unfused.
        if x2.is_cuda and _fused_decode_applies(x2, cfg, compiled=True) and _fused_decode_kernel(x2) is not None:
            return torch.ops.calclip.fp8_linear_decode(x2, qw, sw, self._fp8_bad, self.nonfinite_count,
                                                       cfg.power_of_two_scales, x2.dtype)
        share = self._fp8_share or self._fp8_producer_group
        qwt, swt = self._compiled_dgrad_operands() if grad and not transient else (None, None)
        if grad and not transient and qwt is None:
            raise RuntimeError(_NO_DGRAD_CODES)
        from_weight = grad and transient
        if share is not None and x is not None:
            qx, sx, qxt, sxt = share.codes(self, x, x2, compiled=True)
            return torch.ops.calclip.fp8_linear_forward_codes(
                x2, self.weight, qx, sx, qxt, sxt, qw, sw, qwt, swt, cfg.power_of_two_scales, cfg.gemm, x2.dtype,
                cfg.row_scales, from_weight, cfg.block_size)
        if not grad:
            return torch.ops.calclip.fp8_linear_infer(x2, qw, sw, self._fp8_bad, self.nonfinite_count,
                                                      cfg.power_of_two_scales, cfg.gemm, x2.dtype, cfg.row_scales)
        y, _, _, bad_rows = torch.ops.calclip.fp8_linear_forward(
            x2, self.weight, qw, sw, qwt, swt, self._fp8_bad, self.weight.requires_grad, cfg.power_of_two_scales,
            cfg.gemm, x2.dtype, cfg.row_scales, from_weight, cfg.block_size)
        self.nonfinite_count.add_(bad_rows)
        return y

    def _compiled_dgrad_operands(self) -> tuple[Tensor | None, Tensor | None]:
        """The dgrad codes a compiled training call saves: the resident W^T buffers (refreshed before the graph by the
        root's pre-hook), or views of the W codes transposed (``Fp8Config.resident_dgrad_codes=False``). Not for a
        layer without resident W codes (``Fp8Config.resident_weight_codes=False``): that backward quantizes W^T."""
        if self.fp8_config.resident_dgrad_codes:
            return self._fp8_qwt, self._fp8_swt
        return self._fp8_qw.t(), self._fp8_sw.t()

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return (f"{super().extra_repr()}, block={cfg.block_size}, backward={cfg.backward}, gemm={cfg.gemm}, "
                f"pow2={cfg.power_of_two_scales}")


def check_floating_input(layer: nn.Module, x: Tensor) -> None:
    """Refuse a non-floating input as nn.Linear does (RuntimeError): the quantizer would otherwise scale integer or
    bool values and return an integer or bool output. A dtype check: no device work, static under torch.compile."""
    if not x.is_floating_point():
        raise RuntimeError(f"{type(layer).__name__} takes a floating-point input, got {x.dtype} (as nn.Linear, which "
                           f"fails on a non-floating input)")


def linear_sharing_parameters(module: nn.Module) -> nn.Linear:
    """A plain nn.Linear holding ``module``'s weight and bias Parameters (no copy): every FP8 linear's way back."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = module.in_features, module.out_features
    linear.weight, linear.bias = module.weight, module.bias
    linear.train(module.training)
    return linear


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
