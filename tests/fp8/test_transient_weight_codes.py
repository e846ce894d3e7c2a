"""Fp8Config.resident_weight_codes=False: no layer keeps its W codes between calls. Each forward quantizes the
weight it reads, the backward quantizes it again from the weight it saved (then transposes the codes), and only the
non-finite flag stays resident; inside ``frozen_fp8_weights`` (generation) the codes are held for the block and freed
after it. Same outputs, gradients and non-finite counts bit for bit as resident codes, eager and compiled, with shared
inputs and fused producers; on CUDA (marked gpu) the step's peak lower by the codes."""

import copy
import os

import pytest
import torch
from torch import nn

from calclip.fp8 import Fp8Config, frozen_fp8_weights, pop_nonfinite_count, quantize_model, refresh_fp8_weights
from calclip.fp8 import quant
from calclip.fp8.linear import FP8BlockLinear
from calclip.fp8.reference import quantize_128x128
from _decoder_block import DecoderBlock

NAN, INF = float("nan"), float("inf")


def _pair(seed=0, device="cpu", dtype=torch.float32, **options):
    """The same two-block model converted with resident codes (the default) and without."""
    torch.manual_seed(seed)
    base = nn.Sequential(DecoderBlock(o_bias=True), DecoderBlock(o_bias=True)).to(device, dtype)
    resident = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), **options))
    transient = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), resident_weight_codes=False,
                                                              **options))
    return resident, transient


def _layers(model):
    return [m for m in model.modules() if isinstance(m, FP8BlockLinear)]


def _codes_held(model):
    return [m for m in _layers(model) if any(t is not None for t in (m._fp8_qw, m._fp8_sw, m._fp8_qwt, m._fp8_swt))]


def _train(models, calls=None, steps=3, device="cpu", dtype=torch.float32):
    """AdamW steps on the same inputs; every step's outputs, input gradients and parameter gradients equal."""
    calls = calls or models
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        x = torch.randn(3, 50, 200, device=device, dtype=dtype)
        results = []
        for call in calls:
            xi = x.clone().requires_grad_()
            y = call(xi)
            y.float().square().mean().backward()
            results.append((y.detach(), xi.grad))
        for (y0, g0), (y1, g1) in zip(results, results[1:]):
            assert torch.equal(y0, y1) and torch.equal(g0, g1), step
        for params in zip(*(m.parameters() for m in models)):
            assert all(torch.equal(params[0].grad, p.grad) for p in params[1:]), step
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_training_steps_equal_resident_codes_and_keep_none():
    resident, transient = _pair()
    _train([resident, transient])
    assert len(_codes_held(resident)) == 14 and _codes_held(transient) == []
    # the flag is still made, current for the weight after the last optimizer step
    assert all(m._fp8_bad is not None and not bool(m._fp8_bad) for m in _layers(transient))
    refresh_fp8_weights(transient, for_backward=True)  # what the root's hook does before compiled calls: no codes
    assert _codes_held(transient) == []


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_steps_equal_eager_resident_codes():
    resident, transient = _pair()
    compiled = torch.compile(transient, backend="aot_eager")
    _train([resident, transient], calls=[resident, compiled])
    assert _codes_held(transient) == []
    with torch.no_grad():  # a compiled no-grad call (old log-probs) quantizes in the graph too
        x = torch.randn(2, 9, 200)
        assert torch.equal(compiled(x), resident(x))
    assert _codes_held(transient) == []


def test_a_weight_changed_between_forward_and_backward_raises():
    """The backward quantizes W^T from the weight the forward saved: an in-place change between them is refused by
    autograd's version check, as the resident codes' refresh is."""
    _, transient = _pair()
    y = transient(torch.randn(4, 200))
    with torch.no_grad():
        transient[1].self_attn.o_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_non_finite_weight_flag_and_counts_match_resident_codes():
    resident, transient = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.0) for m in (resident, transient)]
    x = torch.randn(2, 30, 200)
    for model, opt in zip((resident, transient), opts):
        model(x).sum().backward()  # flags made for clean weights
        with torch.no_grad():
            model[1].mlp.up_proj.weight[5, 150] = INF  # a shared-input member: the group's count covers it
            model[0].self_attn.o_proj.weight[0, 0] = NAN
        opt.step()  # no change by the step itself; the in-place writes above bumped the versions
    counts = []
    for model in (resident, transient):
        pop_nonfinite_count(model)
        with torch.no_grad():
            model(x)
        counts.append(int(pop_nonfinite_count(model)))
        assert bool(model[1].mlp.up_proj._fp8_bad) and bool(model[0].self_attn.o_proj._fp8_bad)
        assert not bool(model[1].mlp.gate_proj._fp8_bad)
    assert counts[0] == counts[1] > 0
    assert _codes_held(transient) == []


def test_frozen_block_holds_the_codes_and_frees_them_after():
    resident, transient = _pair()
    x = torch.randn(1, 3, 200)
    with torch.no_grad(), frozen_fp8_weights(transient):
        held = _codes_held(transient)
        assert len(held) == 14
        for layer in held:  # current codes, as the resident layers keep them
            assert torch.equal(layer._fp8_qw.view(torch.uint8), quantize_128x128(layer.weight)[0].view(torch.uint8))
        y_inside = transient(x)
    assert _codes_held(transient) == [] and "_calclip_codes_key" not in transient.__dict__
    with torch.no_grad():
        assert torch.equal(y_inside, resident(x)) and torch.equal(transient(x), y_inside)
    with pytest.raises(ZeroDivisionError), torch.no_grad(), frozen_fp8_weights(transient):
        1 / 0  # an error inside the block frees them too
    assert _codes_held(transient) == [] and not any(m._fp8_hold_codes for m in _layers(transient))
    _train([resident, transient], steps=1)  # and training after generation still equals resident codes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_weight_flag_equals_the_quantizers_nan_scale(device):
    cases = []
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        w = torch.randn(130, 257, dtype=dtype, device=device)
        cases.append(w)
        for value in (NAN, INF, -INF):
            bad = w.clone()
            bad[129, 256] = value  # the ragged corner block
            cases.append(bad)
    big = torch.randn(64, 64, dtype=torch.float64, device=device)
    big[3, 3] = 1e39  # finite in fp64, Inf once rounded to fp32 (numerics, step 1)
    cases.append(big)
    cases.append(torch.empty(0, 128, device=device))
    for w in cases:
        expected = torch.isnan(quant.quantize_128x128(w)[1]).any()
        assert bool(quant.weight_has_nonfinite_block(w)) == bool(expected), (w.dtype, expected)
    assert sum(bool(quant.weight_has_nonfinite_block(w)) for w in cases) == 10


def test_options_that_keep_resident_codes_are_refused():
    assert Fp8Config().resident_weight_codes is True  # the default until measured on a GPU
    with pytest.raises(ValueError, match="resident_weight_codes must be a bool"):
        Fp8Config(resident_weight_codes=0)
    with pytest.raises(ValueError, match="cache_weights=False"):
        Fp8Config(resident_weight_codes=False, cache_weights=False)
    with pytest.raises(ValueError, match="decode_group_siblings=True"):
        Fp8Config(resident_weight_codes=False, decode_group_siblings=True)


_NEEDS_KERNELS = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available(),
                                    reason="fused producers run calclip's Triton kernels: CUDA, or TRITON_INTERPRET=1 "
                                           "on CPU")


def _tiny_llama(layers):
    """A random bf16 transformers Llama whose layers the fused producers recognise, and the device it is on."""
    transformers = pytest.importorskip("transformers")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=192, intermediate_size=300, num_hidden_layers=layers, num_attention_heads=3,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=64))
    return model.to(torch.bfloat16).to(device), device


@pytest.mark.slow
@_NEEDS_KERNELS
def test_tiny_llama_with_fused_producers_equals_resident_codes():
    """Fused producers read every member's flag before any member quantizes its weight: the resident flag."""
    base, device = _tiny_llama(layers=2)
    with torch.no_grad():
        base.model.layers[1].mlp.down_proj.weight[3, 17] = NAN  # a bad weight: counted the same either way
    models = [quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True, resident_weight_codes=resident))
              for resident in (True, False)]
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for model in models:
        out = model(input_ids=ids, labels=ids)
        out.logits.float().nan_to_num().square().mean().backward()
        results.append((out.logits, int(pop_nonfinite_count(model)), [p.grad for p in model.parameters()]))
    (l0, c0, g0), (l1, c1, g1) = results
    assert torch.equal(l0.nan_to_num(), l1.nan_to_num()) and c0 == c1 > 0
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(g0, g1))
    assert _codes_held(models[1]) == [] and sum("forward" in m.__dict__ for m in models[1].modules()) == 6


@_NEEDS_KERNELS
def test_compiled_calls_keep_the_fused_producers(monkeypatch):
    """A compiled call's producer plan asks for the members' flags, which exist without resident codes: the fused
    RMSNorm / SiLU-multiply stay in the compiled graph (found in review: the plan checked the W codes instead)."""
    from calclip.fp8 import producers

    model, device = _tiny_llama(layers=1)
    model = quantize_model(model, Fp8Config(fuse_producers=True, resident_weight_codes=False))
    refresh_fp8_weights(model, for_backward=True)  # what the root's pre-hook does before a compiled call
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    norm = model.model.layers[0].input_layernorm
    plan = producers._plan(norm._calclip_consumers, torch.randn(2, 5, 192, dtype=torch.bfloat16, device=device),
                           (torch.bfloat16,))
    assert plan is not None and _codes_held(model) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_peak_lower_by_the_codes_with_the_same_gradients():
    resident, transient = _pair(device="cuda", dtype=torch.bfloat16)
    code_bytes = sum(m.weight.numel() for m in _layers(resident))  # 1 byte per parameter (scales aside)
    x = torch.randn(4, 256, 200, device="cuda", dtype=torch.bfloat16)
    grads = []
    for model in (resident, transient):  # codes, flags and workspaces made; the gradients compared
        model(x.clone().requires_grad_()).float().square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(g0, g1) for g0, g1 in zip(*grads))
    del grads
    peaks = {}
    for name, model in (("resident", resident), ("transient", transient)):
        for p in (*resident.parameters(), *transient.parameters()):
            p.grad = None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()  # both models' parameters, and the resident one's codes
        torch.cuda.reset_peak_memory_stats()
        model(x.clone().requires_grad_()).float().square().mean().backward()
        torch.cuda.synchronize()
        held = sum(t.untyped_storage().nbytes() for m in _codes_held(model) for t in (m._fp8_qw, m._fp8_sw))
        # what this model's step holds at its peak: the step's own bytes and the codes it keeps resident
        peaks[name] = torch.cuda.max_memory_allocated() - before + held
    assert _codes_held(transient) == []
    assert peaks["resident"] - peaks["transient"] >= code_bytes // 2, (peaks, code_bytes)
