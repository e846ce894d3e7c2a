"""FP8BlockLinear under torch.compile (CPU, backend aot_eager: the same custom ops, fake implementations and
autograd registration that Inductor and CUDA graphs see on the GPU) and the in-place weight-code refresh that
makes captured graphs read current codes."""

import pytest
import torch
from torch import nn

from calclip.fp8 import (FP8BlockLinear, Fp8Config, frozen_fp8_weights, pop_nonfinite_count, quantize_model,
                         refresh_fp8_weights)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 384), nn.GELU(), nn.Linear(384, 200), nn.GELU(), nn.Linear(200, 256))


def _pair(**options):
    eager, compiled = _model(), _model()
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        quantize_model(m, Fp8Config(keep_patterns=(), **options))
    return eager, compiled


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


# scaled_mm_row_scales changes the GEMM choice on the H200 only; here it checks that the ops carry the flag through
# Dynamo and AOTAutograd (their schemas, the backward's saved options) without changing a bit
@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"scaled_mm_row_scales": True}])
def test_compiled_training_equals_eager_across_optimizer_steps(options):
    """Forward, input and weight gradients bit-equal to eager on every step, while a fused AdamW changes the
    weights between steps (the root pre-hook must refresh the codes the compiled graph reads)."""
    eager, model = _pair(**options)
    compiled = torch.compile(model, backend="aot_eager")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (eager, model)]
    outputs = []
    for step in range(3):
        x = torch.randn(64, 256)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), compiled(xc)
        assert torch.equal(ye, yc), step
        ye.square().sum().backward()
        yc.square().sum().backward()
        assert torch.equal(xe.grad, xc.grad), step
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert torch.equal(pe.grad, pc.grad), (step, name)
        outputs.append(yc.detach())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert not torch.equal(outputs[0], outputs[1])  # the weights did move


def test_compiled_inference_counts_nonfinite_tokens():
    _, model = _pair()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(16, 256)
    x[3, 5] = float("nan")
    with torch.no_grad():
        y = compiled(x)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(16) != 3]).all()
    assert int(pop_nonfinite_count(model)) == 3  # row 3 in each of the three FP8 layers
    with torch.no_grad():
        compiled(torch.randn(16, 256))
    assert int(pop_nonfinite_count(model)) == 0


@pytest.mark.slow
def test_no_graph_break_inside_the_layers():
    """With the codes refreshed, the layers compile as one graph (fullgraph=True raises on any break)."""
    _, model = _pair()
    refresh_fp8_weights(model, for_backward=True)
    body = torch.compile(lambda x: model[4](model[3](model[2](model[1](model[0](x))))), backend="aot_eager",
                         fullgraph=True)
    x = torch.randn(8, 256, requires_grad=True)
    body(x).sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


def test_straight_through_mode_compiles_with_eager_layers():
    """backward='bf16' (a comparison mode without custom ops) still works under compile, layer by layer."""
    eager = quantize_model(_model(), Fp8Config(keep_patterns=(), backward="bf16"))
    model = quantize_model(_model(), Fp8Config(keep_patterns=(), backward="bf16"))
    x = torch.randn(4, 256)
    ye, yc = eager(x), torch.compile(model, backend="aot_eager")(x)
    assert torch.equal(ye, yc)
    ye.sum().backward()
    yc.sum().backward()
    assert torch.equal(eager[0].weight.grad, model[0].weight.grad)


def test_weight_codes_are_refreshed_in_place():
    """Addresses never move (a captured graph keeps reading the current codes), and a backward whose forward
    used codes that a refresh has since overwritten fails instead of computing a wrong gradient."""
    torch.manual_seed(0)
    layer = FP8BlockLinear(256, 256)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = torch.randn(8, 256, requires_grad=True)
    layer(x).sum().backward()
    ptrs = [t.data_ptr() for t in layer.quantized_weight()[:2]]
    opt.step()
    y_stale = layer(x)  # saved the codes of this weight version
    opt.step()  # the weight moves again
    fresh = FP8BlockLinear.from_linear(layer.to_linear())
    assert torch.equal(layer(x), fresh(x))  # re-quantized ...
    assert [t.data_ptr() for t in layer.quantized_weight()[:2]] == ptrs  # ... into the same tensors
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y_stale.sum().backward()


def test_a_layer_compiled_on_its_own_refreshes_its_codes():
    """torch.compile(FP8BlockLinear) alone (no converted root around it): its own pre-hook keeps the codes
    current across optimizer steps, so outputs and gradients equal the eager layer's."""
    torch.manual_seed(0)
    base = nn.Linear(256, 128)
    eager, layer = FP8BlockLinear.from_linear(base), FP8BlockLinear.from_linear(nn.Linear(256, 128))
    layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(layer, backend="aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, layer)]
    for step in range(3):
        x = torch.randn(32, 256)
        ye, yc = eager(x), compiled(x)
        assert torch.equal(ye, yc), step
        ye.square().sum().backward()
        yc.square().sum().backward()
        assert torch.equal(eager.weight.grad, layer.weight.grad), step
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.mark.slow
def test_dynamic_shapes_compile_once_and_equal_eager():
    """torch.compile(dynamic=True): token counts vary (RL batches do) without recompiling, and every size equals
    eager; the layer's per-shape caches are skipped for symbolic sizes while tracing. (Batches of at most 128
    tokens compile once more: their 128x1 scales have a size-1 dim, which Dynamo specializes.)"""
    eager, model = _pair()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    counts = torch._dynamo.utils.counters
    graphs = []
    # all above 128 tokens: at most one 128-token scale group would be a size-1 dim, which Dynamo specializes
    for rows in (160, 300, 520):
        x = torch.randn(rows, 256)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe), compiled(xc)
        assert torch.equal(ye, yc), rows
        ye.sum().backward()
        yc.sum().backward()
        assert torch.equal(xe.grad, xc.grad), rows
        for pe, pc in zip(eager.parameters(), model.parameters()):
            assert torch.equal(pe.grad, pc.grad), rows
            pe.grad = pc.grad = None
        graphs.append(counts["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * 2, graphs  # the later sizes reuse the first graphs


@pytest.mark.slow
def test_dynamic_batch_equal_to_a_scale_dim_is_not_specialized():
    """[batch, tokens, K] inputs whose batch equals a weight-scale dim (K / 128 = 3 here): the weight codes are
    static like parameters, so duck sizing cannot give the batch the scale dim's symbol, which the first graph
    then specialized (batch 3 compiled static, and compiled again at batch 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(384, 384), nn.Linear(384, 128))
    quantize_model(model, Fp8Config(keep_patterns=()))
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    counts = torch._dynamo.utils.counters
    graphs = []
    for batch, tokens in ((3, 160), (4, 210), (5, 330)):
        x = torch.randn(batch, tokens, 384, requires_grad=True)
        y = compiled(x)
        assert torch.equal(y, model(x)), batch
        y.sum().backward()
        graphs.append(counts["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1:] == [graphs[0]] * 2, graphs


def test_layers_inside_a_converted_model_carry_no_hook_of_their_own():
    """The root's pre-hook refreshes every layer before compiled calls, so a converted model's layers drop their
    own (a no-op for them) and take nn.Module's hook-free call path; a bare layer keeps its hook; copies keep
    whichever they had."""
    import copy

    model = quantize_model(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128)))
    layers = [m for m in model if isinstance(m, FP8BlockLinear)]
    assert len(layers) == 2 and all(not m._forward_pre_hooks and m._fp8_refreshed_by_root for m in layers)
    assert len(model._forward_pre_hooks) == 1  # the root's
    bare = FP8BlockLinear(256, 128)
    assert len(bare._forward_pre_hooks) == 1 and not bare._fp8_refreshed_by_root
    twin = copy.deepcopy(model)
    assert all(not m._forward_pre_hooks for m in twin if isinstance(m, FP8BlockLinear))
    assert len(copy.deepcopy(bare)._forward_pre_hooks) == 1
    layers[0]._set_refreshed_by_root(False)  # e.g. taken out of the model: its own hook comes back, once
    layers[0]._set_refreshed_by_root(False)
    assert len(layers[0]._forward_pre_hooks) == 1
    x = torch.randn(4, 256)
    assert torch.equal(model(x), twin(x))


def _count_layer_refreshes(monkeypatch) -> list:
    """The layers whose FP8BlockLinear.refresh ran, in call order (the method still runs)."""
    calls = []
    real = FP8BlockLinear.refresh
    monkeypatch.setattr(FP8BlockLinear, "refresh", lambda self, **kw: (calls.append(self), real(self, **kw))[1])
    return calls


def test_refresh_of_a_model_with_nothing_changed_skips_the_layers(monkeypatch):
    """refresh_fp8_weights returns after one pass over the weights' keys when no weight changed since it last
    refreshed them all, and refreshes (codes equal to a fresh quantization) after anything that changes a weight:
    an optimizer step, an in-place write, an explicit invalidation, a re-conversion; with grad on it builds the
    dgrad codes the no-grad refresh did not (resident_dgrad_codes)."""
    from calclip.fp8 import invalidate_fp8_weight_caches
    from calclip.fp8.reference import quantize_128x128

    model = quantize_model(_model(), Fp8Config(keep_patterns=(), resident_dgrad_codes=True))
    layers = model._calclip_fp8_layers
    calls = _count_layer_refreshes(monkeypatch)

    def refreshes(**kw):
        calls.clear()
        refresh_fp8_weights(model, **kw)
        return len(calls)

    def codes_current():
        return all(torch.equal(layer._fp8_qw.view(torch.uint8), quantize_128x128(layer.weight.detach())[0]
                               .view(torch.uint8)) for layer in layers)

    with torch.no_grad():
        assert refreshes() == 3 and refreshes() == 0 and codes_current()
        layers[1].weight.add_(1.0)  # an in-place write bumps the version
        assert refreshes() == 3 and codes_current() and refreshes() == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    with torch.no_grad():
        assert refreshes() == 3 and codes_current()
    assert all(layer._fp8_qwt is None or layer._fp8_dgrad_key != layer._fp8_key for layer in layers)
    assert refreshes(for_backward=True) == 3 and all(layer._fp8_dgrad_key == layer._fp8_key for layer in layers)
    assert refreshes(for_backward=True) == 0
    with torch.no_grad():
        layers[0].weight.data.mul_(2.0)  # a .data write bumps no version: the documented explicit invalidation
        invalidate_fp8_weight_caches()
        assert refreshes() == 3 and codes_current()
    quantize_model(model, Fp8Config(keep_patterns=()))  # re-conversion: the same layers, their key is reset
    assert "_calclip_codes_key" not in model.__dict__


def test_refresh_without_the_weight_cache_always_refreshes(monkeypatch):
    model = quantize_model(_model(), Fp8Config(keep_patterns=(), cache_weights=False))
    calls = _count_layer_refreshes(monkeypatch)
    with torch.no_grad():
        refresh_fp8_weights(model)
        refresh_fp8_weights(model)
    assert len(calls) == 6


def _graph_breaks(model, *args) -> list[str]:
    """The graph-break reasons of one fresh torch.compile of ``model`` (its __call__, hooks included) on ``args``."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="aot_eager")(*args)
    return list(counters["graph_break"])


@pytest.mark.slow
def test_frozen_weights_compile_without_the_refresh_graph_break():
    """Inside frozen_fp8_weights the root pre-hook's refresh (a graph break in front of every compiled call) is
    skipped; the codes were refreshed on entry, so the compiled call equals eager; outside, the break is back."""
    eager, model = _pair()
    x = torch.randn(8, 256)
    with torch.no_grad():
        breaks = _graph_breaks(model, x)
        assert len(breaks) == 1 and "_refresh_outside_graph" in breaks[0]  # the refresh, run eagerly first
        with frozen_fp8_weights(model) as same:
            assert same is model and model._calclip_frozen
            assert _graph_breaks(model, x) == []
            y = torch.compile(model, backend="aot_eager")(x)
        assert not model._calclip_frozen
        assert torch.equal(y, eager(x))
        assert len(_graph_breaks(model, x)) == 1


def test_frozen_weights_refresh_on_entry_and_refuse_a_weight_changed_inside():
    eager, model = _pair()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 256)
    with torch.no_grad():
        compiled(x)  # codes made (and the graph compiled) for the first weights
        for m in (eager, model):
            m[0].weight.mul_(0.5)  # changed outside: entry refreshes the codes the frozen graph reads
        with frozen_fp8_weights(model):
            assert torch.equal(compiled(x), eager(x))
        with pytest.raises(RuntimeError, match="changed inside frozen_fp8_weights"):
            with frozen_fp8_weights(model):
                model[2].weight.add_(1.0)
        assert not model._calclip_frozen  # left even when it raised


def test_frozen_weights_is_a_no_op_where_it_cannot_freeze():
    plain = _model()
    with frozen_fp8_weights(plain) as same:  # no FP8 layers
        assert same is plain and "_calclip_frozen" not in plain.__dict__
    uncached = quantize_model(_model(), Fp8Config(keep_patterns=(), cache_weights=False))
    with frozen_fp8_weights(uncached):  # re-quantizes on every call anyway
        assert not uncached._calclip_frozen
    _, model = _pair()
    with frozen_fp8_weights(model):
        with frozen_fp8_weights(model):  # nested: the outer block decides
            pass
        assert model._calclip_frozen
    assert not model._calclip_frozen


def _pins_compiled_bit_equal(monkeypatch, devices):
    """Compile _pair()'s model (AOTAutograd, graphs captured) while ``tracing.TRITON_KERNEL_DEVICES`` is ``devices``:
    the output and every gradient bit-equal to eager; returns how many prims.inductor_force_stride_order nodes the
    forward and backward graphs hold."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers the prim counted)
    from torch._dynamo.backends.common import aot_autograd

    from calclip.fp8 import tracing

    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        return gm

    monkeypatch.setattr(tracing, "TRITON_KERNEL_DEVICES", devices)
    torch._dynamo.reset()
    eager, model = _pair()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    x = torch.randn(64, 256)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    ye, yc = eager(xe), compiled(xc)
    assert torch.equal(ye, yc)
    ye.square().sum().backward()
    yc.square().sum().backward()
    assert torch.equal(xe.grad, xc.grad)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(pe.grad, pc.grad), name
    pin = torch.ops.prims.inductor_force_stride_order.default
    return sum(node.target is pin for gm in graphs for node in gm.graph.nodes)


@pytest.mark.slow
def test_a_tensor_both_quantizers_read_is_one_buffer_where_they_are_triton_kernels(monkeypatch):
    """tracing.one_buffer: where the quantizers are Triton kernels (CUDA; CPU traced as CUDA is, here) the compiled
    graphs pin each layer's x (forward: read by its 1x128 and 128x1 quantizers) and dy (backward) with
    prims.inductor_force_stride_order, so Inductor stores a pointwise producer's output once for both instead of once
    per kernel; nothing changes a bit. On CPU as shipped no node is added."""
    assert _pins_compiled_bit_equal(monkeypatch, ("cuda",)) == 0
    # three layers: three inputs in the forward, three output gradients in the backward
    assert _pins_compiled_bit_equal(monkeypatch, ("cuda", "cpu")) == 6


def test_one_buffer_is_switched_off_by_its_environment_variable():
    """CALCLIP_ONE_BUFFER=0 (read at import, part of the compile caches' key): no device pins the quantizers'
    input; unset or 1: CUDA does."""
    from tests.fixtures import printed_under_env

    seen = printed_under_env("CALCLIP_ONE_BUFFER", ("0", "1", None),
                             "import calclip.fp8.tracing as t; print(t.TRITON_KERNEL_DEVICES)")
    assert seen == {"0": "()", "1": "('cuda',)", None: "('cuda',)"}
