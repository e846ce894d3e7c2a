"""FP8 activation quantization fused into the ops that produce the activations (``Fp8Config.fuse_producers``).

In a Llama / Qwen2 / Qwen3 / Mistral decoder layer three tensors feed FP8 linears:

    input_layernorm(h)            -> q_proj, k_proj, v_proj      (one shared-input group)
    post_attention_layernorm(h)   -> gate_proj, up_proj          (one shared-input group)
    act_fn(gate) * up             -> down_proj                   (a group of one)

Without fusion each is written in BF16 by its producer, then read again by a quantizer (1x128 for the forward GEMM,
128x1 saved for the weight-gradient GEMM). Fused, the producer's last elementwise ops run in one Triton kernel
(``kernels.producers``) that writes the BF16 output AND its codes and scales, and registers those codes for its
output tensor in the consumers' ``SharedInput`` (``shared_input.py``): the group finds the input quantized already,
exactly as when its first member quantized it. Codes, scales, outputs and every gradient are what they are
without fusion, bit for bit:

- the producer's output is HF's: the norm's variance and rsqrt and the SiLU stay the same torch ops; the kernel does
  only single fp32 multiplies rounded once to bf16, which is what torch's bf16 elementwise ops compute;
- the codes are those of ``quantize_1x128`` / ``quantize_128x1`` of that output (same numerics helpers);
- the producer's backward is HF's autograd formula, op for op (``rms_norm_backward``; the multiply's two products),
  so its gradients are those autograd computes for HF's module (the MLP's op saves gate and up and recomputes
  silu(gate) in its backward, where autograd keeps silu(gate) too: one [tokens, intermediate] tensor less per layer);
- the non-finite count is what the group's members add (``quantize_1x128``'s ``members`` rule), added to its first
  member's counter.

Recognised (``fuse_producers``): decoder layers of the classes in ``DECODER_LAYERS`` whose norms are the plain
RMSNorm (``RMS_NORMS``: HF's ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``) and whose MLP is
``down(silu(gate(x)) * up(x))`` (``MLPS``, SiLU activation), with FP8 q/k/v and gate/up grouped by
``share_sibling_inputs``. Anything else keeps today's path: Phi-3 (fused qkv / gate_up: no group to feed), Gemma
(``1 + weight`` norms, GeGLU, post-norms), any layer kept in BF16. The norm fuses for bf16 models only (in an fp32
model the norm's input is its own fp32 copy, so autograd would sum the residual's gradient in another order); the
multiply for bf16 and fp32. A call the kernels cannot serve (autocast on, the BF16 shadow, a no-grad call the fused
decode takes, a device without the kernels) runs the module's own forward.

Eager and compiled: the kernels run inside the torch.library triton ops ``calclip::fp8_rms_norm_quantize`` and
``calclip::fp8_silu_mul_quantize`` (their fake implementations are the same code on FakeTensors), each with its backward
registered; the group bookkeeping is traced like the shared input's.
"""

from __future__ import annotations

import os
import types

import torch
from torch import Tensor, nn

from calclip.fp8 import linear_math, quant, reference
from calclip.fp8.linear_math import _fused_decode_applies
from calclip.fp8.tracing import is_traced

DECODER_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
SILU = ("SiLUActivation", "SiLU")  # transformers' ACT2FN["silu"], and torch's nn.SiLU


def _impl(x: Tensor, name: str):
    """``kernels.producers``' ``name`` for a CUDA x, and for a CPU x in eager calls under TRITON_INTERPRET=1 (tests);
    else its torch twin (a compiled CPU call: the interpreter's kernels cannot be recorded, as for the quantizers)."""
    if x.is_cuda or not is_traced(x):
        from calclip.fp8.kernels import producers

        return getattr(producers, name)
    return _REFERENCES[name]


# ----------------------------------------------------------------------------------------------------------
# Plain-torch twins of the kernels (kernels.producers): what a fused call must return, and the backward formulas.
# ----------------------------------------------------------------------------------------------------------


def _quantize_output(y: Tensor, weight_bad: Tensor, members: int, need_t: bool, pow2: bool,
                     out_rows=None) -> tuple[Tensor, ...]:
    m = y.shape[0]
    # zero tokens past M (quant.quantize_1x128's out_rows), at most the rows the kernel's 128-row tiles cover
    padded = y if out_rows is None else reference.zero_rows_appended(y, out_rows, "producer", reference.wgrad_rows(m))
    q, s = reference.quantize_1x128(padded, pow2=pow2)
    count = torch.zeros((), dtype=torch.int64, device=y.device)
    quant.add_nonfinite_rows(count, s.narrow(0, 0, m), weight_bad, members)
    s = s.t().contiguous().t()  # gemm_layout: column-major
    if need_t:
        qt, st = reference.quantize_128x1(y, pow2=pow2)
        qt, st = reference.pad_128x1_codes(qt), st.contiguous()  # gemm_layout: padded token rows, s row-major
    else:
        qt = torch.empty(0, 0, dtype=q.dtype, device=y.device).t()
        st = torch.empty(0, 0, dtype=torch.float32, device=y.device)
    return q, s, qt, st, count


def rms_norm_quantize_reference(x: Tensor, rstd: Tensor, weight: Tensor, weight_bad: Tensor, *, members: int = 1,
                                need_t: bool = True, pow2: bool = False, out_rows=None) -> tuple[Tensor, ...]:
    """``kernels.producers.rms_norm_quantize`` in torch: HF's two last RMSNorm ops, then the reference quantizers."""
    y = weight * (x.to(torch.float32) * rstd.reshape(-1, 1)).to(x.dtype)
    return (y, *_quantize_output(y, weight_bad, members, need_t, pow2, out_rows))


def mul_quantize_reference(a: Tensor, b: Tensor, weight_bad: Tensor, *, members: int = 1, need_t: bool = True,
                           pow2: bool = False, out_rows=None) -> tuple[Tensor, ...]:
    """``kernels.producers.mul_quantize`` in torch."""
    y = a * b
    return (y, *_quantize_output(y, weight_bad, members, need_t, pow2, out_rows))


_REFERENCES = {"rms_norm_quantize": rms_norm_quantize_reference, "mul_quantize": mul_quantize_reference}


def rms_norm_rstd(x2: Tensor, eps: float) -> Tensor:
    """fp32 [M, 1]: HF RMSNorm's ``torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)``, the same ops."""
    return torch.rsqrt(x2.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_backward(dy: Tensor, x2: Tensor, weight: Tensor, rstd: Tensor, need_dx: bool,
                      need_dw: bool) -> tuple[Tensor | None, Tensor | None]:
    """The gradients autograd computes for HF's RMSNorm (bf16 x, bf16 weight), each op as its derivative formula:

        h = x.float(); v = h.pow(2).mean(-1, keepdim); r = rsqrt(v + eps); n = h * r; y = w * n.to(bf16)

    mul: grad * other (summed over the broadcast rows for w); to(): the grad cast back; rsqrt: -0.5 * grad * r^3;
    mean: grad expanded / K; pow(2): grad * (2.0 * h.pow(1.0)); h's two gradients summed (commutative: exact)."""
    h = x2.to(torch.float32)
    dx = dw = None
    if need_dw:
        dw = (dy * (h * rstd).to(x2.dtype)).sum(0).to(weight.dtype)
    if need_dx:
        dn = (dy * weight).to(torch.float32)
        dr = (dn * h).sum(-1, keepdim=True)
        dp = (-0.5 * dr * rstd.pow(3)).expand(h.shape) / h.shape[-1]
        dx = (dn * rstd + dp * (2.0 * h.pow(1.0))).to(x2.dtype)
    return dx, dw


# ----------------------------------------------------------------------------------------------------------
# The triton ops (eager and compiled), with their backward.
# ----------------------------------------------------------------------------------------------------------


@torch.library.triton_op("calclip::fp8_rms_norm_quantize", mutates_args=())
def _rms_norm_quantize_op(x2: Tensor, weight: Tensor, eps: float, weight_bad: Tensor, members: int, need_t: bool,
                          pow2: bool, out_rows: int | None = None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """HF's RMSNorm of x2 [M, K] and its codes -> (y [M, K], rstd [M, 1] fp32, qx, sx (over out_rows rows: zero tokens
    past M, gemm.operand_rows), qxt, sxt, count)."""
    rstd = rms_norm_rstd(x2, eps)
    y, *codes = _impl(x2, "rms_norm_quantize")(x2, rstd, weight, weight_bad, members=members, need_t=need_t,
                                             pow2=pow2, out_rows=out_rows)
    return y, rstd, *codes


def _rms_setup_context(ctx, inputs, output) -> None:
    x2, weight = inputs[:2]
    ctx.save_for_backward(x2, weight, output[1])


def _rms_backward(ctx, dy, *_):
    x2, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, x2, weight, rstd, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    return dx, dw, None, None, None, None, None, None


_rms_norm_quantize_op.register_autograd(_rms_backward, setup_context=_rms_setup_context)


@torch.library.triton_op("calclip::fp8_silu_mul_quantize", mutates_args=())
def _silu_mul_quantize_op(gate: Tensor, up: Tensor, weight_bad: Tensor, members: int, need_t: bool,
                          pow2: bool, out_rows: int | None = None
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """silu(gate) * up ([M, K]; torch's silu, the kernel's multiply) and its codes -> (y, qx, sx, qxt, sxt, count);
    qx, sx over out_rows rows (zero tokens past M)."""
    a = torch.nn.functional.silu(gate)
    return tuple(_impl(a, "mul_quantize")(a, up, weight_bad, members=members, need_t=need_t, pow2=pow2,
                                          out_rows=out_rows))


def _silu_mul_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])  # gate and up: silu(gate) is recomputed, not kept


def _silu_mul_backward(ctx, dy, *_):
    gate, up = ctx.saved_tensors
    # autograd's formulas for HF's act_fn(gate) * up: mul's grad * other, then silu's silu_backward(grad, gate)
    d_gate = torch.ops.aten.silu_backward(dy * up, gate) if ctx.needs_input_grad[0] else None
    d_up = dy * torch.nn.functional.silu(gate) if ctx.needs_input_grad[1] else None
    return d_gate, d_up, None, None, None, None, None


_silu_mul_quantize_op.register_autograd(_silu_mul_backward, setup_context=_silu_mul_setup_context)


# ----------------------------------------------------------------------------------------------------------
# The producers' forwards, installed on recognised modules.
# ----------------------------------------------------------------------------------------------------------


def _kernels_serve(x: Tensor) -> bool:
    if x.is_cuda:
        return quant.triton_kernels() is not None
    return x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1" and \
        quant.triton_kernels() is not None


def _plan(group, x: Tensor, dtypes: tuple[torch.dtype, ...]) -> tuple | None:
    """(weight_bad, members, need_t, pow2, compiled, rows) for quantizing ``group``'s input x in its producer (its 1x128
    codes over ``rows``, ``gemm.operand_rows``, or None: x's rows), or None when this call keeps the module's own
    forward (then the group quantizes as it always did)."""
    if x.dtype not in dtypes or x.dim() < 1 or x.numel() == 0:
        return None
    members = group.members
    first = members[0]
    cfg = first.fp8_config
    if not cfg.fuse_producers or any(m.bf16_shadow_depth > 0 for m in members):
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None
    compiled = torch.compiler.is_compiling()
    if not torch.is_grad_enabled():
        x2 = x.reshape(-1, x.shape[-1])
        if _fused_decode_applies(x2, cfg, compiled=compiled) and (x.is_cuda or not compiled):
            return None  # the members take the fused decode, which reads x itself
    if not _kernels_serve(x) or first.weight.device != x.device:
        return None
    if compiled:
        if first._fp8_bad is None:  # not refreshed yet (the flag exists with or without resident codes)
            return None  # the linears raise their own error
        from calclip.fp8.siblings import bad_weight_count

        bad = bad_weight_count(members)
    else:
        bad = group._bad_weights()  # refreshes the members' codes first
    need_t = torch.is_grad_enabled() and any(m.weight.requires_grad for m in members)
    rows = linear_math._out_rows(cfg.gemm, x.reshape(-1, x.shape[-1]), x.dtype, cfg.row_scales)
    return bad, len(members), need_t, cfg.power_of_two_scales, compiled, rows


def _offer(group, y: Tensor, outputs: tuple[Tensor, ...], need_t: bool, compiled: bool) -> None:
    qx, sx, qxt, sxt, count = (t.detach() for t in outputs)
    group.members[0].nonfinite_count.add_(count)
    if not need_t and not compiled:
        qxt = sxt = None  # the eager Function's "no 128x1 codes"
    group.offer(y, (qx, sx, qxt, sxt), compiled=compiled)


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """A recognised RMSNorm's forward: HF's output, its codes registered for the q/k/v or gate/up group."""
    group = self._calclip_consumers
    plan = _plan(group, hidden_states, (torch.bfloat16,)) if self.weight.dtype == hidden_states.dtype else None
    if plan is None:
        return type(self).forward(self, hidden_states)
    bad, members, need_t, pow2, compiled, rows = plan
    x2 = hidden_states.reshape(-1, hidden_states.shape[-1])
    y2, _, *outputs = torch.ops.calclip.fp8_rms_norm_quantize(x2, self.weight, float(self.variance_epsilon), bad,
                                                              members, need_t, pow2, rows)
    y = y2.view(hidden_states.shape)
    _offer(group, y, outputs, need_t, compiled)
    return y


def _mlp_forward(self, x: Tensor) -> Tensor:
    """A recognised MLP's forward: down(silu(gate(x)) * up(x)), the product's codes registered for down_proj. The
    fused op keeps gate and up for its backward, as autograd keeps gate for SiLU, not silu(gate) as well."""
    gate = self.gate_proj(x)
    up = self.up_proj(x)
    group = self.down_proj._fp8_producer_group
    plan = _plan(group, gate, (torch.bfloat16, torch.float32)) if (
        group is not None and gate.dtype == up.dtype and gate.shape == up.shape) else None
    if plan is None:
        return self.down_proj(self.act_fn(gate) * up)
    bad, members, need_t, pow2, compiled, rows = plan
    k = gate.shape[-1]
    y2, *outputs = torch.ops.calclip.fp8_silu_mul_quantize(gate.reshape(-1, k), up.reshape(-1, k), bad, members,
                                                           need_t, pow2, rows)
    y = y2.view(gate.shape)
    _offer(group, y, outputs, need_t, compiled)
    return self.down_proj(y)


# ----------------------------------------------------------------------------------------------------------
# Installation.
# ----------------------------------------------------------------------------------------------------------


def _group_of(linears: list[nn.Module]):
    """The SharedInput grouping exactly ``linears``, or None."""
    from calclip.fp8.linear import FP8BlockLinear

    if not all(type(m) is FP8BlockLinear for m in linears):
        return None
    group = linears[0]._fp8_share
    if group is None or group.members != linears or not linears[0].fp8_config.fuse_producers:
        return None
    return group


def _install(module: nn.Module, forward, consumers=None) -> bool:
    if "forward" in module.__dict__:  # fused already, or a forward someone else set on the instance
        return False
    module.forward = types.MethodType(forward, module)
    module._calclip_fused_producer = True
    if consumers is not None:
        module._calclip_consumers = consumers
    return True


def _plain_rms_norm(norm: nn.Module) -> bool:
    weight = norm._parameters.get("weight")
    return (type(norm).__name__ in RMS_NORMS and weight is not None and weight.dim() == 1
            and isinstance(getattr(norm, "variance_epsilon", None), float))


def fuse_producers(model: nn.Module) -> int:
    """Fuse the input quantization of ``model``'s FP8 linears into their producers where recognised (module
    docstring; needs ``share_sibling_inputs`` groups, i.e. run after it); returns how many producers were fused.
    down_proj gets a shared-input group of its own (``_fp8_producer_group``), which its MLP's product feeds."""
    from calclip.fp8.linear import FP8BlockLinear
    from calclip.fp8.shared_input import SharedInput

    fused = 0
    for layer in model.modules():
        if type(layer).__name__ not in DECODER_LAYERS:
            continue
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        for norm, parent, names in ((norms[0], attn, ("q_proj", "k_proj", "v_proj")),
                                    (norms[1], mlp, ("gate_proj", "up_proj"))):
            if norm is None or parent is None or not _plain_rms_norm(norm):
                continue
            group = _group_of([parent._modules.get(name) for name in names])
            if group is not None:
                fused += _install(norm, _rms_norm_forward, group)
        if mlp is None or type(mlp).__name__ not in MLPS or type(getattr(mlp, "act_fn", None)).__name__ not in SILU:
            continue
        down = mlp._modules.get("down_proj")
        if type(down) is not FP8BlockLinear or _group_of([mlp._modules.get("gate_proj"),
                                                          mlp._modules.get("up_proj")]) is None:
            continue
        cfg = down.fp8_config
        if not (cfg.fuse_producers and cfg.share_sibling_inputs and cfg.cache_weights and cfg.backward == "fp8"):
            continue
        if down._fp8_share is None and down._fp8_producer_group is None:
            down._fp8_producer_group = SharedInput([down])  # its index in the group: 0, as every layer's default
        if down._fp8_producer_group is not None:
            fused += _install(mlp, _mlp_forward)
    return fused


def unfuse_producers(model: nn.Module) -> int:
    """Give every producer ``fuse_producers`` fused its own forward back; returns how many."""
    count = 0
    for module in model.modules():
        if module.__dict__.pop("_calclip_fused_producer", False):
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_calclip_consumers", None)
            down = module._modules.get("down_proj")
            if getattr(down, "_fp8_producer_group", None) is not None:
                down._fp8_producer_group = None
            count += 1
    return count
