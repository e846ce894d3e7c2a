"""Shared inputs (calclip.fp8.shared_input, Fp8Config.share_sibling_inputs): a decoder layer's q/k/v and gate/up
quantize the x they read once, eager and compiled, with the same outputs, gradients and non-finite count total as
each linear quantizing it alone, fewer quantizer calls and one saved copy of x's 128x1 codes instead of three."""

import copy

import pytest
import torch
from torch import nn

from calclip.fp8 import Fp8Config, pop_nonfinite_count, quantize_model, refresh_fp8_weights
from calclip.fp8 import linear_math, quant
from calclip.fp8.linear import FP8BlockLinear
from calclip.fp8.shared_input import SharedInput
from _decoder_block import DecoderBlock

NAN = float("nan")


def _pair(seed=0, **options):
    """The same two-layer model converted with and without shared inputs."""
    torch.manual_seed(seed)
    base = nn.Sequential(DecoderBlock(), DecoderBlock())
    shared = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), **options))
    alone = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), share_sibling_inputs=False, **options))
    return shared, alone


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_groups_q_k_v_and_gate_up_by_default():
    shared, alone = _pair()
    groups = {id(m._fp8_share): m._fp8_share for m in shared.modules() if isinstance(m, FP8BlockLinear)
              and m._fp8_share is not None}
    assert len(groups) == 4 and all(isinstance(g, SharedInput) for g in groups.values())
    assert sorted(len(g.members) for g in groups.values()) == [2, 2, 3, 3]
    assert shared[0].self_attn.o_proj._fp8_share is None and shared[0].mlp.down_proj._fp8_share is None
    assert all(m._fp8_share is None for m in alone.modules() if isinstance(m, FP8BlockLinear))
    # not for sharded weights (cache_weights=False) nor the straight-through backward
    for options in ({"cache_weights": False}, {"backward": "bf16"}):
        model = quantize_model(copy.deepcopy(nn.Sequential(DecoderBlock())), Fp8Config(keep_patterns=(), **options))
        assert all(m._fp8_share is None for m in model.modules() if isinstance(m, FP8BlockLinear)), options
    with pytest.raises(ValueError, match="share_sibling_inputs must be a bool"):
        Fp8Config(share_sibling_inputs="yes")


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"power_of_two_scales": True}])
def test_eager_training_equals_each_linear_alone(monkeypatch, options):
    """Outputs, input and weight gradients bit for bit over two AdamW steps; per forward 4 input quantizations per
    layer instead of 7 (1x128 launches, counted), and the same non-finite count in total."""
    shared, alone = _pair(**options)
    calls = []
    real = quant.quantize_1x128
    monkeypatch.setattr(quant, "quantize_1x128", lambda *a, **k: calls.append(1) or real(*a, **k))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (shared, alone)]
    for step in range(2):
        x = torch.randn(3, 40, 200)
        x[1, 7, 3] = NAN  # one non-finite token: counted by every linear that reads it
        ys, ya = [], []
        for model, out in ((shared, ys), (alone, ya)):
            xi = x.clone().requires_grad_()
            calls.clear()
            y = model(xi)
            out.append((y, len([c for c in calls])))
            y.nan_to_num().square().sum().backward()
            out.append(xi.grad)
        (y_s, n_s), gx_s = ys
        (y_a, n_a), gx_a = ya
        assert torch.equal(y_s.nan_to_num(), y_a.nan_to_num()) and torch.equal(y_s.isnan(), y_a.isnan()), step
        assert torch.equal(gx_s.nan_to_num(), gx_a.nan_to_num()), step
        for gs, ga in zip(_grads(shared), _grads(alone)):
            assert torch.equal(gs.nan_to_num(), ga.nan_to_num()), step
        # forward: 2 layers x (4 against 7) input quantizations; backward: 7 dy quantizations per layer either way
        assert n_s == 2 * 4 and n_a == 2 * 7, (n_s, n_a)
        assert int(pop_nonfinite_count(shared)) == int(pop_nonfinite_count(alone)) > 0
        for opt in opts:
            torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
            for p in opt.param_groups[0]["params"]:
                p.grad.nan_to_num_()
            opt.step()
            opt.zero_grad()


def test_a_weight_with_a_nan_block_counts_as_it_does_alone():
    """A non-finite weight block makes every row of that member's output count: the group's one count adds it for
    that member only, as its own call would."""
    shared, alone = _pair()
    for model in (shared, alone):
        with torch.no_grad():
            model[0].self_attn.k_proj.weight[5, 5] = NAN
            model[1].mlp.up_proj.weight[0, 0] = float("inf")
    x = torch.randn(2, 9, 200)
    x[0, 3, 0] = NAN
    with torch.no_grad():  # 18 rows: more than the fused decode's automatic limit only on CUDA; CPU: the usual path
        shared(x), alone(x)
    n_shared, n_alone = int(pop_nonfinite_count(shared)), int(pop_nonfinite_count(alone))
    assert n_shared == n_alone and n_alone > 18


@pytest.mark.slow
def test_saved_for_backward_once_per_group():
    """The 128x1 codes of x that q/k/v save for their weight gradients are one tensor, not three copies."""
    shared, alone = _pair()
    counts = {}
    for name, model in (("shared", shared), ("alone", alone)):
        ptrs = set()

        def pack(t):
            if t.dtype == torch.float8_e4m3fn and tuple(t.shape) == (128, 200):  # x's codes, not a W^T
                ptrs.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(2, 64, 200, requires_grad=True)).sum().backward()
        counts[name] = len(ptrs)
    # per layer: q/k/v's x and gate/up's x (shared) against five (alone)
    assert counts == {"shared": 2 * 2, "alone": 2 * 5}, counts


def test_an_in_place_change_between_siblings_quantizes_again():
    """Eager: the same tensor object changed in place after q_proj read it is a new input for k_proj."""
    shared, alone = _pair()
    outputs = []
    x0 = torch.randn(130, 200)
    for model in (shared, alone):
        attn = model[0].self_attn
        x = x0.clone()
        q = attn.q_proj(x)
        x.mul_(3.0)
        outputs.append((q, attn.k_proj(x), attn.v_proj(x)))
    for got, want in zip(*outputs):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_frozen_weights_need_no_128x1_codes(monkeypatch):
    """Weights that need no gradient (a LoRA base): the group quantizes x 1x128 only, and dx still flows."""
    shared, alone = _pair()
    for model in (shared, alone):
        model.requires_grad_(False)
    seen = []
    real = linear_math._quantize_input
    monkeypatch.setattr("calclip.fp8.shared_input._quantize_input",
                        lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    xs = [torch.randn(2, 64, 200, requires_grad=True) for _ in range(2)]
    xs[1].data.copy_(xs[0].data)
    ys = [m(x) for m, x in zip((shared, alone), xs)]
    for y in ys:
        y.square().sum().backward()
    assert seen == [False] * 4 and torch.equal(ys[0], ys[1]) and torch.equal(xs[0].grad, xs[1].grad)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_training_equals_eager_and_quantizes_once_per_group():
    """torch.compile (aot_eager: the custom ops, fakes and autograd Inductor sees): one graph, no break; the group's
    first member records fp8_quantize_input and every member fp8_linear_forward_codes; bit-equal to the eager
    shared model (and so to each linear alone) over AdamW steps, with the same non-finite count."""
    from torch._dynamo.testing import CompileCounterWithBackend

    shared, alone = _pair()
    model = copy.deepcopy(shared)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (shared, model)]
    for step in range(3):
        x = torch.randn(2, 64, 200)
        x[0, 1, 2] = NAN
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = shared(xe), compiled(xc)
        assert torch.equal(ye.nan_to_num(), yc.nan_to_num()), step
        ye.nan_to_num().square().sum().backward()
        yc.nan_to_num().square().sum().backward()
        assert torch.equal(xe.grad.nan_to_num(), xc.grad.nan_to_num()), step
        for (name, pe), pc in zip(shared.named_parameters(), model.parameters()):
            assert torch.equal(pe.grad.nan_to_num(), pc.grad.nan_to_num()), (step, name)
        assert int(pop_nonfinite_count(shared)) == int(pop_nonfinite_count(model)) > 0
        for opt in opts:
            for p in opt.param_groups[0]["params"]:
                p.grad.nan_to_num_()
            opt.step()
            opt.zero_grad()
    assert counter.frame_count == 1
    ops = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert ops.count("calclip.fp8_quantize_input") == 4
    assert ops.count("calclip.fp8_linear_forward_codes") == 10
    assert ops.count("calclip.fp8_linear_forward") == 4  # o_proj and down_proj alone
    assert all(g._pending is None for g in {m._fp8_share for m in model.modules()
                                            if isinstance(m, FP8BlockLinear) and m._fp8_share is not None})


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_no_grad_forward_shares_too():
    """A compiled no-grad forward of many rows (old log-probs) shares the quantized input as well."""
    from torch._dynamo.testing import CompileCounterWithBackend

    shared, _ = _pair()
    refresh_fp8_weights(shared, for_backward=False)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(copy.deepcopy(shared), backend=counter)
    x = torch.randn(2, 300, 200)
    with torch.no_grad():
        assert torch.equal(compiled(x), shared(x))
    ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count("calclip.fp8_quantize_input") == 4 and ops.count("calclip.fp8_linear_infer") == 4


def _llama_pair(**options):
    """A tiny transformers Llama (ragged 192-wide blocks) converted with and without shared inputs."""
    from calclip.models.tiny import build_tiny_model

    base = build_tiny_model(hidden_size=192, intermediate_size=320, num_hidden_layers=2)
    shared = quantize_model(copy.deepcopy(base), Fp8Config(**options))
    alone = quantize_model(copy.deepcopy(base), Fp8Config(share_sibling_inputs=False, **options))
    return shared, alone


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_transformers_llama_with_gradient_checkpointing_equals_each_linear_alone(use_reentrant):
    """HF gradient checkpointing recomputes each decoder layer in the backward: the recomputed forward quantizes the
    shared input again and the loss and every gradient stay those of each linear alone."""
    shared, alone = _llama_pair()
    ids = torch.randint(0, shared.config.vocab_size, (2, 24))
    grads = []
    for model in (shared, alone):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.config.use_cache = False
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_s, g_s), (loss_a, g_a) = grads
    assert torch.equal(loss_s, loss_a) and g_s.keys() == g_a.keys() and len(g_s) > 10
    for name in g_s:
        assert torch.equal(g_s[name], g_a[name]), name


def test_fp32_model_under_bf16_autocast_shares_the_cast_input(monkeypatch):
    """Under autocast each member casts x to bf16 (a new tensor per call): the key is the caller's x and the compute
    dtype, so q/k/v still quantize once, and the outputs are each linear's own."""
    shared, alone = _llama_pair()
    calls = []
    real = quant.quantize_1x128
    monkeypatch.setattr(quant, "quantize_1x128", lambda x, *a, **k: calls.append(x.dtype) or real(x, *a, **k))
    ids = torch.randint(0, shared.config.vocab_size, (2, 24))
    logits, counts = [], []
    for model in (shared, alone):
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits.append(model(input_ids=ids).logits)
        counts.append(len(calls))
        assert set(calls) == {torch.bfloat16}
    assert torch.equal(logits[0], logits[1])
    assert counts == [2 * 4, 2 * 7], counts


def _pad_operand_rows_everywhere(monkeypatch):
    """Make every forward/dgrad 1x128 operand go over torch._scaled_mm's rows, as on an H200 (gemm.operand_rows pads
    only sm_90 CUDA tensors); returns the list of out_rows the quantizers were asked for."""
    from calclip.fp8 import gemm

    asked = []
    monkeypatch.setattr(linear_math, "operand_rows",
                        lambda backend, a, out_dtype, row_scales=False: gemm.scaled_mm_rows(a.shape[0]))
    real = quant.quantize_1x128
    monkeypatch.setattr(quant, "quantize_1x128", lambda *a, **k: asked.append(k.get("out_rows")) or real(*a, **k))
    return asked


def test_operand_rows_written_by_the_quantizers_change_nothing(monkeypatch):
    """gemm.operand_rows: at a token count torch._scaled_mm does not take (279 = 3 x 93, not a multiple of 16) every
    forward and dgrad 1x128 operand is quantized over 288 rows, zero tokens past 279, by the quantizer itself (no
    copy before the GEMM); each GEMM's first 279 rows are kept. Outputs, gradients and the non-finite count equal the
    unpadded run's bit for bit, shared inputs included (a group's padded codes serve every member)."""
    shared, alone = _pair()
    x = torch.randn(3, 93, 200)
    x[1, 7, 3] = NAN
    results = []
    for model, pad in ((alone, False), (shared, True)):
        with monkeypatch.context() as patch:
            asked = _pad_operand_rows_everywhere(patch) if pad else []
            xi = x.clone().requires_grad_()
            y = model(xi)
            y.nan_to_num().square().sum().backward()
        results.append((y, xi.grad, _grads(model), int(pop_nonfinite_count(model))))
        if pad:  # forward: 4 input quantizations per layer; backward: 7 dy quantizations per layer, every one over
            # 288 rows
            assert len(asked) == 2 * 4 + 2 * 7 and set(asked) == {288}, asked
    (y_a, gx_a, gw_a, n_a), (y_p, gx_p, gw_p, n_p) = results
    assert torch.equal(y_p.nan_to_num(), y_a.nan_to_num()) and torch.equal(y_p.isnan(), y_a.isnan())
    assert torch.equal(gx_p.nan_to_num(), gx_a.nan_to_num())
    assert all(torch.equal(p.nan_to_num(), a.nan_to_num()) for p, a in zip(gw_p, gw_a))
    assert n_p == n_a > 0


@pytest.mark.slow
def test_compiled_operand_rows_written_by_the_quantizers_change_nothing(monkeypatch):
    """The same under torch.compile (aot_eager): the triton ops' fake implementations give the padded codes' shapes,
    the graph keeps each GEMM's first rows, and outputs, gradients and the count equal the eager unpadded run."""
    from torch._dynamo.testing import CompileCounterWithBackend

    shared, _ = _pair()
    model = copy.deepcopy(shared)
    x = torch.randn(3, 93, 200)
    x[0, 1, 2] = NAN
    xe = x.clone().requires_grad_()
    ye = shared(xe)
    ye.nan_to_num().square().sum().backward()
    asked = _pad_operand_rows_everywhere(monkeypatch)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    xc = x.clone().requires_grad_()
    yc = torch.compile(model, backend=counter)(xc)
    yc.nan_to_num().square().sum().backward()
    assert counter.frame_count == 1 and 288 in asked
    assert torch.equal(ye.nan_to_num(), yc.nan_to_num()) and torch.equal(xe.grad.nan_to_num(), xc.grad.nan_to_num())
    for (name, pe), pc in zip(shared.named_parameters(), model.parameters()):
        assert torch.equal(pe.grad.nan_to_num(), pc.grad.nan_to_num()), name
    assert int(pop_nonfinite_count(shared)) == int(pop_nonfinite_count(model)) > 0
