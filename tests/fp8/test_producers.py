"""Quantization fused into its producers (calclip.fp8.producers, kernels/producers.py, Fp8Config.fuse_producers).

The kernels against the separate quantizers and the plain-torch twins (outputs, codes and scales bit for bit, the
non-finite count), the producers' backward against autograd's, and whole tiny transformers models (Llama, Qwen2) with
the switch on and off: logits, loss, every gradient and the count bit for bit, with fewer quantizer calls.

Runs the kernels on CUDA, or on CPU under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA):

    python -m pytest -q tests/fp8/test_producers.py
"""

import copy
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 to run the kernels on CPU")

from calclip.fp8 import Fp8Config, dequantize_model, quant, quantize_model  # noqa: E402
from calclip.fp8 import producers as P  # noqa: E402
from calclip.fp8.kernels import producers as KP  # noqa: E402
from calclip.fp8.kernels import quantize as KQ  # noqa: E402
from calclip.fp8.linear import pop_nonfinite_count  # noqa: E402

NAN, INF = float("nan"), float("inf")


def _bits(t):
    """The tensor's bits as integers, every NaN as one pattern (NaN payloads are not part of the contract)."""
    t = t.contiguous()
    if t.dtype == torch.float8_e4m3fn:
        b = t.view(torch.uint8).to(torch.int32)
        return torch.where((b & 0x7F) == 0x7F, -1, b)
    if not t.is_floating_point():
        return t
    b = t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype]).to(torch.int64)
    return torch.where(torch.isnan(t), -1, b)


def _strides(t):
    return [st for st, n in zip(t.stride(), t.shape) if n > 1]  # a size-1 dim's stride addresses nothing


def _same(a, b):
    """Same shape, layout (the GEMMs read the strides) and bits."""
    return a.shape == b.shape and _strides(a) == _strides(b) and torch.equal(_bits(a), _bits(b))


def _rms_inputs(m, k, dtype, nonfinite):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = torch.randn(k, generator=g).to(dtype)
    if nonfinite and m > 9:
        x[3, 20 % k] = NAN  # the whole row's rstd: every column tile of row 3 non-finite, counted once
        x[9, k - 1] = INF
        w[k - 1] = INF  # the last column tile non-finite in every row
    rstd = P.rms_norm_rstd(x.to(DEVICE), 1e-6)
    return x.to(DEVICE), rstd, w.to(DEVICE)


def _mul_inputs(m, k, dtype, nonfinite):
    g = torch.Generator().manual_seed(m * 1000 + k + 1)
    a, b = (torch.randn(m, k, generator=g) * 2).to(dtype), torch.randn(m, k, generator=g).to(dtype)
    if nonfinite and m > 9:
        a[3, 0], a[3, k - 1] = NAN, INF  # the first and last tile of one row: counted once
        b[7, k - 1] = -INF  # only a later tile
        a[9, 130 % k], b[9, 130 % k] = 1e30, 1e30  # fp32: finite inputs whose product overflows
    return a.to(DEVICE), b.to(DEVICE)


SHAPES = [(1, 1), (5, 128), (130, 200), (257, 384)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["rms_norm", "mul"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_fused_equals_the_separate_quantizers_and_the_torch_twin(shape, dtype, kind, nonfinite):
    m, k = shape
    bad = torch.tensor(1, dtype=torch.int32, device=DEVICE) if nonfinite else \
        torch.zeros((), dtype=torch.int32, device=DEVICE)
    members = 3
    for pow2 in (False, True):
        if kind == "rms_norm":
            x, rstd, w = _rms_inputs(m, k, dtype, nonfinite)
            fused = KP.rms_norm_quantize(x, rstd, w, bad, members=members, pow2=pow2)
            twin = P.rms_norm_quantize_reference(x, rstd, w, bad, members=members, pow2=pow2)
            y_torch = w * (x.float() * rstd).to(dtype)  # HF's last two ops
        else:
            a, b = _mul_inputs(m, k, dtype, nonfinite)
            fused = KP.mul_quantize(a, b, bad, members=members, pow2=pow2)
            twin = P.mul_quantize_reference(a, b, bad, members=members, pow2=pow2)
            y_torch = a * b
        y = fused[0]
        assert _same(y, y_torch)
        for got, want in zip(fused, twin):
            assert _same(got, want)
        # the separate Triton quantizers on the same output: the codes and count the unfused path produces
        count = torch.zeros((), dtype=torch.int64, device=DEVICE)
        q, s = KQ.quantize_1x128(y, pow2=pow2, gemm_layout=True, nonfinite_count=count, weight_bad=bad,
                                 members=members)
        qt, st = KQ.quantize_128x1(y, pow2=pow2, gemm_layout=True)
        for got, want in zip(fused[1:5], (q, s, qt, st)):
            assert _same(got, want)
        # the count worked by hand: every row per bad weight, the rows with a non-finite value per healthy one
        bad_rows = int((~torch.isfinite(y.float())).any(dim=1).sum())
        expected = int(bad) * m + (members - int(bad)) * bad_rows
        assert int(fused[5]) == int(count) == expected
        if nonfinite and m > 9:
            assert bad_rows >= 2


def test_without_a_weight_gradient_only_the_1x128_codes():
    x, rstd, w = _rms_inputs(130, 200, torch.bfloat16, False)
    bad = torch.zeros((), dtype=torch.int32, device=DEVICE)
    y, q, s, qt, st, count = KP.rms_norm_quantize(x, rstd, w, bad, need_t=False)
    assert qt.numel() == 0 and st.numel() == 0 and int(count) == 0
    assert _same(q, KQ.quantize_1x128(y, gemm_layout=True)[0])


def test_bad_operands_are_named():
    x, rstd, w = _rms_inputs(5, 128, torch.bfloat16, False)
    bad = torch.zeros((), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        KP.rms_norm_quantize(x, rstd, w.float(), bad)
    with pytest.raises(ValueError, match="rstd must be"):
        KP.rms_norm_quantize(x, rstd[:2], w, bad)
    with pytest.raises(TypeError, match="bf16 or fp32"):
        KP.mul_quantize(x.half(), x.half(), bad)
    with pytest.raises(ValueError, match="weight_bad must be an int32"):
        KP.mul_quantize(x, x, bad.bool())
    with pytest.raises(ValueError, match="b must be"):
        KP.mul_quantize(x, x[:, :64], bad)


def _hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(2, 70, 192), (300, 200), (1, 1)])
def test_the_ops_backward_is_autograds_for_hf_modules(shape):
    """Gradients through the fused ops (eager) == autograd through HF's RMSNorm and through a * b, bit for bit."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(torch.bfloat16).to(DEVICE)
    dy = torch.randn(*shape, generator=g).to(torch.bfloat16).to(DEVICE)
    bad = torch.zeros((), dtype=torch.int32, device=DEVICE)
    grads = []
    for fused in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            y = torch.ops.calclip.fp8_rms_norm_quantize(xi.reshape(-1, shape[-1]), wi, 1e-6, bad, 1, True,
                                                        False)[0].view(shape)
        else:
            y = _hf_rms_norm(xi, wi, 1e-6)
        y.backward(dy)
        grads.append((y.detach(), xi.grad, wi.grad))
    for got, want in zip(*grads):
        assert _same(got, want)
    gate, up = x.clone().requires_grad_(), (x * 0.5).detach().requires_grad_()
    y = torch.ops.calclip.fp8_silu_mul_quantize(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]), bad, 1,
                                                True, False)[0]
    y.view(shape).backward(dy)
    gate_ref, up_ref = x.clone().requires_grad_(), (x * 0.5).detach().requires_grad_()
    y_ref = torch.nn.functional.silu(gate_ref) * up_ref  # HF's act_fn(gate_proj(x)) * up_proj(x)
    y_ref.backward(dy)
    assert _same(y.view(shape), y_ref.detach())
    assert _same(gate.grad, gate_ref.grad) and _same(up.grad, up_ref.grad)


# ----------------------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------------------


def _tiny(arch, dtype=torch.bfloat16):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=192, intermediate_size=300, num_hidden_layers=2, num_attention_heads=3,
                  num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=64, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "phi3":
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, **common))
    else:
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=64, **common))
    return model.to(dtype).to(DEVICE)


def _groups(model):
    groups = {id(g): g for m in model.modules() for g in (getattr(m, "_fp8_share", None),
                                                          getattr(m, "_fp8_producer_group", None)) if g is not None}
    assert groups
    return groups.values()


class _QuantizerCalls:
    """Counts the activation quantizer calls of the FP8 linears (quant's dispatchers) and the fused producers."""

    def __init__(self, monkeypatch):
        self.calls = {}
        self.out_rows = set()  # the 1x128 rows asked of the quantizers and producers (gemm.operand_rows)
        for module, names in ((quant, ("quantize_1x128", "quantize_128x1")),
                              (KP, ("rms_norm_quantize", "mul_quantize"))):
            for name in names:
                monkeypatch.setattr(module, name, self._counted(name, getattr(module, name)))

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name != "quantize_128x1":
                self.out_rows.add(kwargs.get("out_rows"))
            return fn(*args, **kwargs)
        return counted


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_model_bit_equal_with_fewer_quantizer_calls(arch, monkeypatch):
    base = _tiny(arch)
    with torch.no_grad():  # a non-finite token: its rows are counted, on every layer, the same either way
        base.model.embed_tokens.weight[5, 7] = NAN
    on = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True))
    off = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=False))
    assert sum("forward" in m.__dict__ for m in on.modules()) == 3 * 2  # two norms and the MLP, per layer
    assert not any("forward" in m.__dict__ for m in off.modules())
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    clean = ids.clone()
    clean[clean == 5] = 6
    ids[0, 3] = 5
    counter = _QuantizerCalls(monkeypatch)
    results = []
    for model in (on, off):
        counter.calls.clear()
        out = model(input_ids=clean, labels=clean)
        forward_calls = dict(counter.calls)
        out.loss.backward()
        with torch.no_grad():
            eval_logits = model(input_ids=ids).logits  # no weight gradient: 1x128 codes only
        results.append((out.logits, out.loss, eval_logits, forward_calls, int(pop_nonfinite_count(model))))
        assert all(g._pending is None for g in _groups(model))  # every member took the codes
    (logits_on, loss_on, eval_on, calls_on, count_on), (logits_off, loss_off, eval_off, calls_off, count_off) = results
    assert _same(logits_on, logits_off) and _same(loss_on, loss_off) and _same(eval_on, eval_off)
    for (name, p_on), p_off in zip(on.named_parameters(), off.parameters()):
        assert p_on.grad is not None and _same(p_on.grad, p_off.grad), name
    # the eval forward's non-finite token: at least its own row in each of 7 linears x 2 layers (causal attention
    # spreads NaN to later tokens); the head is kept in BF16
    assert count_on == count_off >= 2 * 7
    # per layer: o_proj's two quantizations remain, against q/k/v, gate/up, o_proj and down_proj's eight
    layers = 2
    assert calls_off == {"quantize_1x128": 4 * layers, "quantize_128x1": 4 * layers}
    assert calls_on == {"quantize_1x128": layers, "quantize_128x1": layers, "rms_norm_quantize": 2 * layers,
                        "mul_quantize": layers}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["phi3", "gemma"])
def test_unrecognised_architectures_keep_todays_path(arch, monkeypatch):
    """Phi-3 (fused qkv_proj / gate_up_proj) and Gemma (1 + weight norms, GeGLU): nothing fused, same results."""
    base = _tiny(arch)
    on = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True))
    off = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=False))
    assert P.fuse_producers(on) == 0
    assert not any("forward" in m.__dict__ for m in on.modules())
    counter = _QuantizerCalls(monkeypatch)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        assert _same(on(input_ids=ids).logits, off(input_ids=ids).logits)
    assert "rms_norm_quantize" not in counter.calls and "mul_quantize" not in counter.calls


@pytest.mark.slow
def test_autocast_and_the_bf16_shadow_take_the_modules_own_forward(monkeypatch):
    from calclip.fp8.shadow import bf16_shadow

    base = _tiny("llama")
    # decode_fused_max_m=0: on CUDA a no-grad eager forward of <= 256 rows otherwise takes the fused decode kernel,
    # which quantizes x inside the GEMM and calls no quantizer (found on the H100: the count below was empty)
    model = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True, decode_fused_max_m=0))
    counter = _QuantizerCalls(monkeypatch)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        with bf16_shadow(model):
            assert _same(model(input_ids=ids).logits, base(input_ids=ids).logits)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            model(input_ids=ids)
    assert "rms_norm_quantize" not in counter.calls and "mul_quantize" not in counter.calls
    # autocast: each group quantized its input as without fusion (q/k/v, gate/up, o_proj, down_proj), per layer
    assert counter.calls["quantize_1x128"] == 4 * 2
    assert all(g._pending is None for g in _groups(model))  # down_proj's group of one keeps nothing past its call


def test_config_and_dequantize():
    with pytest.raises(ValueError, match="fuse_producers must be a bool"):
        Fp8Config(fuse_producers="yes")
    assert Fp8Config().fuse_producers is False  # off by default until its kernels have run on a GPU
    model = _tiny("llama")
    quantize_model(model, Fp8Config(fuse_producers=True))
    layer = model.model.layers[0]
    down = layer.mlp.down_proj
    assert down._fp8_share is None and down._fp8_producer_group.members == [down]  # apart from the sibling groups
    assert P.fuse_producers(model) == 0  # fused already
    dequantize_model(model)
    assert not any("forward" in m.__dict__ or "_calclip_consumers" in m.__dict__ for m in model.modules())
    assert down._fp8_producer_group is None  # the FP8 layer dequantize_model replaced
    off = quantize_model(_tiny("llama"), Fp8Config(fuse_producers=False))
    assert off.model.layers[0].mlp.down_proj._fp8_producer_group is None


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_layers_record_the_producer_ops_and_equal_eager():
    """compile_repeated_blocks (aot_eager: the ops, their fakes and registered backward as Inductor sees them): each
    layer's graph records the two norm ops and the multiply op, q/k/v, gate/up and down_proj take the registered codes
    (fp8_linear_forward_codes) and nothing quantizes them again; logits and gradients equal the eager unfused
    model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from calclip.fp8 import compile_repeated_blocks

    base = _tiny("llama")
    compiled = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True))
    eager = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=False))
    counter = CompileCounterWithBackend("aot_eager")
    compile_repeated_blocks(compiled, backend=counter)
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    outs = []
    for model in (compiled, eager):
        out = model(input_ids=ids, labels=ids, use_cache=False)  # a KV cache's state would recompile the layers
        out.loss.backward()
        outs.append(out)
    assert _same(outs[0].logits, outs[1].logits) and _same(outs[0].loss, outs[1].loss)
    for (name, p_c), p_e in zip(compiled.named_parameters(), eager.parameters()):
        assert _same(p_c.grad, p_e.grad), name
    ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    layers_traced = ops.count("calclip.fp8_silu_mul_quantize")
    assert layers_traced >= 1
    assert ops.count("calclip.fp8_rms_norm_quantize") == 2 * layers_traced
    assert ops.count("calclip.fp8_linear_forward_codes") == 6 * layers_traced
    assert ops.count("calclip.fp8_linear_forward") == layers_traced  # o_proj alone
    assert ops.count("calclip.fp8_quantize_input") == 0
    graphs = len(counter.graphs)
    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # same guards: nothing recompiles
    assert len(counter.graphs) == graphs
    assert all(g._pending is None for g in _groups(compiled))


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_layers_with_operand_rows_padded_equal_eager(monkeypatch):
    """The producer ops' out_rows under compile_repeated_blocks (aot_eager, an odd token count, padding forced as on an
    H200): the ops' fakes give the padded codes' shapes, the consumers keep their GEMMs' first rows, and logits, loss
    and every gradient equal the eager unfused, unpadded model's bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from calclip.fp8 import compile_repeated_blocks, gemm, linear_math

    base = _tiny("llama")
    compiled = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True))
    eager = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=False))
    ids = torch.randint(0, 97, (3, 93), generator=torch.Generator().manual_seed(1)).to(DEVICE)  # 279 tokens
    out_e = eager(input_ids=ids, labels=ids, use_cache=False)
    out_e.loss.backward()
    asked = []
    monkeypatch.setattr(linear_math, "operand_rows", lambda backend, x, out_dtype, row_scales=False:
                        asked.append(x.shape[0]) or gemm.scaled_mm_rows(x.shape[0]))
    counter = CompileCounterWithBackend("aot_eager")
    compile_repeated_blocks(compiled, backend=counter)
    out_c = compiled(input_ids=ids, labels=ids, use_cache=False)
    out_c.loss.backward()
    from calclip.fp8.tracing import size_hint

    assert asked and {size_hint(m) for m in asked} == {279}  # (symbolic token counts under dynamic shapes)
    assert _same(out_c.logits, out_e.logits) and _same(out_c.loss, out_e.loss)
    for (name, p_c), p_e in zip(compiled.named_parameters(), eager.parameters()):
        assert _same(p_c.grad, p_e.grad), name
    ops = [str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count("calclip.fp8_silu_mul_quantize") >= 1


def test_out_rows_write_zero_tokens_past_m():
    """gemm.operand_rows: a producer writes its 1x128 codes over the rows torch._scaled_mm runs a ragged token count
    on, zero tokens past M, as quantize_1x128(out_rows=) does (no copy before the consumers' GEMMs); y, the 128x1
    codes and the count are those of M rows. The torch twin agrees."""
    m, k, rows = 277, 200, 288
    bad = torch.zeros((), dtype=torch.int32, device=DEVICE)
    x, rstd, w = _rms_inputs(m, k, torch.bfloat16, True)
    a, b = _mul_inputs(m, k, torch.bfloat16, True)
    for fused, twin, plain in (
            (KP.rms_norm_quantize(x, rstd, w, bad, members=2, out_rows=rows),
             P.rms_norm_quantize_reference(x, rstd, w, bad, members=2, out_rows=rows),
             KP.rms_norm_quantize(x, rstd, w, bad, members=2)),
            (KP.mul_quantize(a, b, bad, members=2, out_rows=rows),
             P.mul_quantize_reference(a, b, bad, members=2, out_rows=rows), KP.mul_quantize(a, b, bad, members=2))):
        for got, want in zip(fused, twin):
            assert _same(got, want)
        y, q, s = fused[:3]
        q_want, s_want = KQ.quantize_1x128(y, gemm_layout=True, out_rows=rows)
        assert q.shape == (rows, k) and _same(q, q_want) and _same(s, s_want)
        for got, want in zip((y, *fused[3:]), (plain[0], *plain[3:])):  # y, 128x1 codes, count: M rows' own
            assert _same(got, want)
        assert int(fused[5]) > 0
    with pytest.raises(ValueError, match="out_rows must satisfy 277 <= out_rows <= 384"):
        KP.mul_quantize(a, b, bad, out_rows=385)


@pytest.mark.slow
def test_whole_model_with_operand_rows_padded_equals_unpadded(monkeypatch):
    """A tiny Llama with fused producers at 279 tokens, every 1x128 operand padded to 288 rows as on an H200
    (gemm.operand_rows forced on CPU): logits, loss, every gradient and the count equal the unpadded run's."""
    from calclip.fp8 import gemm, linear_math

    base = _tiny("llama")
    ids = torch.randint(0, 97, (3, 93), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for pad in (False, True):
        model = quantize_model(copy.deepcopy(base), Fp8Config(fuse_producers=True))
        with monkeypatch.context() as patch:
            if pad:
                patch.setattr(linear_math, "operand_rows",
                              lambda backend, x, out_dtype, row_scales=False: gemm.scaled_mm_rows(x.shape[0]))
            calls = _QuantizerCalls(patch)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        results.append((out.logits, out.loss, [p.grad for p in model.parameters()], int(pop_nonfinite_count(model)),
                        calls.calls, calls.out_rows))
    (l0, loss0, g0, n0, c0, r0), (l1, loss1, g1, n1, c1, r1) = results
    assert c1 == c0 and c1["rms_norm_quantize"] == 4 and c1["mul_quantize"] == 2  # the fused path both times
    assert r0 == {None} and r1 == {288}  # every 1x128 operand of the padded run over 288 rows
    assert _same(l1, l0) and _same(loss1, loss0) and n1 == n0
    assert all(_same(a, b) for a, b in zip(g1, g0))
