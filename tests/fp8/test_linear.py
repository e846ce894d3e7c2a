"""FP8BlockLinear (emulated on CPU) against nn.Linear and against an independent float64 recipe."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from calclip.fp8 import quant
from calclip.fp8.config import Fp8Config
from calclip.fp8.linear import FP8BlockLinear, pop_nonfinite_count
from calclip.fp8.reference import (
    dequantize_1x128,
    dequantize_128x1,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
)
from calclip.fp8.shadow import bf16_shadow, in_bf16_shadow

from _sqnr import sqnr_db

# Measured on this CPU (seed 0, M=300 tokens, K=576, N=320, Gaussian data): ~28.8 dB on output, input grad and
# weight grad (e4m3 has 3 mantissa bits: ~31 dB per quantized operand, two operands per GEMM).
SQNR_FLOOR_DB = 27.0
SQNR_FLOOR_POW2_DB = 25.0  # power-of-two scales waste up to one bit of range


def _pair(dtype, bias=True, cfg=None, k=576, n=320):
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=bias, dtype=dtype)
    fp8 = FP8BlockLinear.from_linear(nn.Linear(k, n, bias=bias, dtype=dtype), cfg)
    fp8.load_state_dict(ref.state_dict())
    return ref, fp8


def _fwd_bwd(mod, x, dy):
    x = x.detach().clone().requires_grad_()
    y = mod(x)
    y.backward(dy)
    return y.detach(), x.grad, mod.weight.grad, None if mod.bias is None else mod.bias.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pow2", [False, True])
def test_sqnr_vs_nn_linear(dtype, pow2):
    ref, fp8 = _pair(dtype, cfg=Fp8Config(power_of_two_scales=pow2))
    x = torch.randn(3, 100, 576, dtype=dtype)
    dy = torch.randn(3, 100, 320, dtype=dtype)
    want = _fwd_bwd(ref, x, dy)
    got = _fwd_bwd(fp8, x, dy)
    floor = SQNR_FLOOR_POW2_DB if pow2 else SQNR_FLOOR_DB
    for name, w, g in zip(("y", "dx", "dW"), want[:3], got[:3]):
        assert g.dtype == dtype and g.shape == w.shape
        assert sqnr_db(w, g) > floor, (name, sqnr_db(w, g))
    torch.testing.assert_close(got[3], want[3])  # bias grad is exact: sum of dy


def test_matches_float64_recipe_exactly():
    """forward Q1x128(x)Q(W)^T + b, dgrad Q1x128(dy)Q(W), wgrad Q128x1(dy)^T Q128x1(x), computed here in float64."""
    _, fp8 = _pair(torch.float32, k=300, n=200)
    torch.manual_seed(1)
    x, dy = torch.randn(130, 300), torch.randn(130, 200)
    y, dx, dw, db = _fwd_bwd(fp8, x, dy)
    d = lambda t: t.double()  # noqa: E731
    w_dq = d(dequantize_128x128(*quantize_128x128(fp8.weight.detach())))
    torch.testing.assert_close(d(y), d(dequantize_1x128(*quantize_1x128(x))) @ w_dq.t() + d(fp8.bias.detach()),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d(dx), d(dequantize_1x128(*quantize_1x128(dy))) @ w_dq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d(dw),
                               d(dequantize_128x1(*quantize_128x1(dy))).t() @ d(dequantize_128x1(*quantize_128x1(x))),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(db, dy.sum(0))


def test_bf16_backward_finite_differences():
    """backward="bf16" is straight-through: dx = dy W_dq, dW = dy^T x. Check both against central finite
    differences (float64) of the surrogate linear maps x -> x W_dq^T and W -> x W^T."""
    torch.manual_seed(2)
    m, k, n = 5, 140, 7
    fp8 = FP8BlockLinear(k, n, dtype=torch.float64, config=Fp8Config(backward="bf16"))
    x = torch.randn(m, k, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.float64)
    fp8(x).backward(dy)
    w_dq = dequantize_128x128(*quantize_128x128(fp8.weight.detach())).double()
    w = fp8.weight.detach().clone()
    b = fp8.bias.detach()
    eps = 1e-6

    def fd(fun, p):
        """Central differences along every coordinate of p at once (vmap over the basis)."""
        basis = torch.eye(p.numel(), dtype=p.dtype).view(-1, *p.shape) * eps
        diff = torch.vmap(fun)(p + basis) - torch.vmap(fun)(p - basis)  # [numel, m, n]
        return ((diff * dy).sum(dim=(1, 2)) / (2 * eps)).view_as(p)

    xs = x.detach()
    gx = fd(lambda v: F.linear(v, w_dq, b), xs)
    torch.testing.assert_close(x.grad, gx, rtol=1e-6, atol=1e-7)
    gw = fd(lambda v: F.linear(xs, v, b), w)
    torch.testing.assert_close(fp8.weight.grad, gw, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fp8.bias.grad, dy.sum(0))


def test_saves_activations_in_fp8():
    """The autograd graph holds x as FP8 codes + fp32 scales (~1.03 B/element), never a float copy of x."""
    _, fp8 = _pair(torch.bfloat16, k=576, n=320)
    x = torch.randn(256, 576, dtype=torch.bfloat16, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = fp8(x)
    qw, sw, _ = fp8.quantized_weight()
    activation = [t for t in packed if t.data_ptr() not in (qw.data_ptr(), sw.data_ptr())]
    assert {t.dtype for t in activation} == {torch.float8_e4m3fn, torch.float32}
    act_bytes = sum(t.numel() * t.element_size() for t in activation)
    bf16_bytes = x.numel() * 2
    assert act_bytes == 256 * 576 + 2 * 576 * 4  # codes + one scale per 128 tokens per feature
    assert act_bytes / bf16_bytes < 0.52
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and fp8.weight.grad.dtype == torch.bfloat16


class _Counter:
    def __init__(self, monkeypatch, name):
        self.calls = 0
        original = getattr(quant, name)

        def counted(*args, **kw):
            self.calls += 1
            return original(*args, **kw)

        monkeypatch.setattr(quant, name, counted)


def test_weight_cache_invalidation(monkeypatch):
    wq = _Counter(monkeypatch, "quantize_128x128")
    _, fp8 = _pair(torch.float32, k=256, n=128)
    x = torch.randn(4, 256)
    y0 = fp8(x)
    fp8(x)
    assert wq.calls == 1
    opt = torch.optim.SGD(fp8.parameters(), lr=0.1)
    y0.sum().backward()
    opt.step()
    y1 = fp8(x)
    assert wq.calls == 2 and not torch.equal(y0, y1)
    fp8(x)
    assert wq.calls == 2
    fp8.load_state_dict({k: torch.randn_like(v) for k, v in fp8.state_dict().items()})
    y2 = fp8(x)
    assert wq.calls == 3 and not torch.equal(y1, y2)
    ref = FP8BlockLinear(256, 128, config=Fp8Config(cache_weights=False))
    ref.load_state_dict(fp8.state_dict())
    assert torch.equal(ref(x), y2)  # cached codes == freshly quantized codes
    calls = wq.calls
    ref(x)
    ref(x)
    assert wq.calls == calls + 2  # without a cache every forward quantizes
    assert "_weight_cache" not in str(list(fp8.state_dict()))


def test_emulated_gemm_dequantizes_each_weight_version_once(monkeypatch):
    """The CPU emulation keeps a weight's fp32 dequantization while its codes are unchanged (forward and dgrad
    share it); an optimizer step re-quantizes the codes in place and the next call dequantizes the new ones,
    so results equal a layer without any cache."""
    from calclip.fp8 import gemm

    calls = {"n": 0}
    original = gemm.dequantize_128x128

    def counted(*args, **kw):
        calls["n"] += 1
        return original(*args, **kw)

    monkeypatch.setattr(gemm, "dequantize_128x128", counted)
    _, fp8 = _pair(torch.float32, k=256, n=384)
    ref = FP8BlockLinear(256, 384, config=Fp8Config(cache_weights=False))
    ref.load_state_dict(fp8.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (fp8, ref)]
    x, dy = torch.randn(8, 256), torch.randn(8, 384)
    for step in range(3):
        before = calls["n"]
        got, want = _fwd_bwd(fp8, x, dy), _fwd_bwd(ref, x, dy)
        for g, w in zip(got, want):
            assert torch.equal(g, w), step
        assert calls["n"] - before == 2, step  # once per layer: the dgrad reuses the forward's
        fp8(x)  # the same weight version: nothing new
        assert calls["n"] - before == 2, step
        ref(x)  # cache_weights=False re-quantizes the codes in place (a new version): dequantized again
        assert calls["n"] - before == 3, step
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_no_grad_forward_saves_nothing(monkeypatch):
    counters = {name: _Counter(monkeypatch, name) for name in ("quantize_1x128", "quantize_128x1")}
    _, fp8 = _pair(torch.float32, k=256, n=128, cfg=Fp8Config())
    x = torch.randn(4, 256, requires_grad=True)
    with torch.no_grad():
        y = fp8(x)
    assert not y.requires_grad
    assert counters["quantize_128x1"].calls == 0  # nothing saved
    fp8(x).sum().backward()
    calls = {name: c.calls for name, c in counters.items()}
    # x in the forward, dy in the backward: each quantized both ways
    assert calls == {"quantize_1x128": 3, "quantize_128x1": 2}, calls


@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_backward_quantizes_dy_once_per_needed_layout(monkeypatch, needs):
    """Each tensor is quantized once per layout a GEMM needs: x 1x128 (forward) and 128x1 (if dW); dy 1x128
    (if dx) and 128x1 (if dW)."""
    x_grad, w_grad = needs
    counters = {name: _Counter(monkeypatch, name) for name in ("quantize_1x128", "quantize_128x1")}
    _, fp8 = _pair(torch.float32, k=256, n=128, cfg=Fp8Config())
    fp8.weight.requires_grad_(w_grad)
    x = torch.randn(130, 256, requires_grad=x_grad)
    fp8(x).sum().backward()
    calls = {name: c.calls for name, c in counters.items()}
    rows = 1 + x_grad  # x always, dy if dx is needed
    cols = w_grad * 2  # x and dy if dW is needed
    assert calls == {"quantize_1x128": rows, "quantize_128x1": cols}, calls
    assert (x.grad is not None) == x_grad and (fp8.weight.grad is not None) == w_grad


def test_state_dict_matches_nn_linear():
    ref, fp8 = _pair(torch.float32)
    fp8(torch.randn(2, 576))
    assert list(fp8.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert [n for n, _ in fp8.named_buffers()] == []
    back = fp8.to_linear()
    assert type(back) is nn.Linear and back.weight is fp8.weight and back.bias is fp8.bias


def test_nonfinite_rows_are_counted():
    _, fp8 = _pair(torch.float32, k=300, n=64)
    x = torch.randn(6, 300)
    x[1, 250] = float("nan")
    x[4, 3] = float("inf")
    y = fp8(x)
    bad = ~torch.isfinite(y).all(dim=-1)
    assert bad.tolist() == [False, True, False, False, True, False]
    assert fp8.nonfinite_count.item() == 2
    fp8(x[:2])
    container = nn.Sequential(fp8)
    assert pop_nonfinite_count(container).item() == 3 and fp8.nonfinite_count.item() == 0
    with torch.no_grad():
        fp8.weight[0, 0] = float("nan")
    fp8(torch.randn(5, 300))
    assert fp8.nonfinite_count.item() == 5


def test_bf16_shadow_is_plain_linear_nested_and_exception_safe():
    ref, fp8 = _pair(torch.bfloat16)
    x = torch.randn(7, 576, dtype=torch.bfloat16)
    model = nn.Sequential(fp8)
    fp8_y = fp8(x)
    with bf16_shadow(model):
        assert torch.equal(fp8(x), ref(x)) and in_bf16_shadow(model)
        with bf16_shadow(model):
            assert torch.equal(fp8(x), ref(x))
        assert torch.equal(fp8(x), ref(x))
    assert not in_bf16_shadow(model) and torch.equal(fp8(x), fp8_y)
    with pytest.raises(RuntimeError):
        with bf16_shadow(model):
            raise RuntimeError("boom")
    assert fp8.bf16_shadow_depth == 0 and torch.equal(fp8(x), fp8_y)


def test_autocast_output_dtype():
    _, fp8 = _pair(torch.float32, k=256, n=128)
    x = torch.randn(3, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and fp8.weight.grad.dtype == torch.float32


def test_dispatch_gemm_layout_changes_strides_not_values():
    """The CPU (reference) dispatch honours gemm_layout like the kernels: 1x128 scales column-major, 128x1
    scales row-major — the strides torch._scaled_mm reads — and 128x1 codes padded with zero codes to whole token
    groups (300 -> 384 rows, column-major), with the reference's values."""
    x = torch.randn(300, 260, dtype=torch.bfloat16)
    plain = (*quant.quantize_1x128(x), *quant.quantize_128x1(x))
    gemm = (*quant.quantize_1x128(x, gemm_layout=True), *quant.quantize_128x1(x, gemm_layout=True))
    assert gemm[1].stride() == (1, 300) and gemm[3].stride() == (260, 1)
    assert gemm[2].shape == (384, 260) and gemm[2].stride() == (1, 384)
    assert not gemm[2][300:].view(torch.uint8).any()
    for a, b in zip(plain, (gemm[0], gemm[1], gemm[2][:300], gemm[3])):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert quant.quantize_1x128(x, gemm_layout=True)[1].stride() == (1, 300)
    q128x1, s128x1 = quant.quantize_128x1(x, gemm_layout=True)
    assert s128x1.stride() == (260, 1) and torch.equal(q128x1.view(torch.uint8), gemm[2].view(torch.uint8))


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),  # transformers' default adamw_torch_fused
    lambda params: torch.optim.SGD(params, lr=1e-1, fused=True),
    lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
])
def test_weight_cache_follows_every_optimizer_step(make_optimizer):
    """Fused optimizers update the weight without bumping Tensor._version (nor data_ptr): the cache must still
    be rebuilt, or the FP8 forward keeps the first step's weights while the BF16 master weights train on."""
    torch.manual_seed(0)
    fp8 = FP8BlockLinear(256, 256)
    opt = make_optimizer(fp8.parameters())
    x = torch.randn(8, 256)
    for _ in range(2):
        fp8(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        fresh = FP8BlockLinear.from_linear(fp8.to_linear())  # same Parameters, empty cache
        assert torch.equal(fp8(x), fresh(x))


def test_data_writes_need_an_explicit_invalidation():
    from calclip.fp8 import invalidate_fp8_weight_caches

    torch.manual_seed(0)
    fp8 = FP8BlockLinear(256, 128)
    x = torch.randn(4, 256)
    before = fp8(x)
    version = fp8.weight._version
    fp8.weight.data.mul_(2.0)  # EMA / weight-sync style write: _version unchanged
    assert fp8.weight._version == version
    invalidate_fp8_weight_caches()
    assert torch.equal(fp8(x), FP8BlockLinear.from_linear(fp8.to_linear())(x))
    assert not torch.equal(fp8(x), before)


def test_first_forward_under_inference_mode_does_not_break_training():
    torch.manual_seed(0)
    fp8 = FP8BlockLinear(256, 128)
    x = torch.randn(4, 256)
    with torch.inference_mode():
        y_inf = fp8(x)
    y = fp8(x)  # counter and weight cache were built as inference tensors
    y.sum().backward()
    assert torch.equal(y.detach(), y_inf) and fp8.weight.grad is not None
    with torch.inference_mode():
        fp8(x)
    fp8(x).sum().backward()  # and again after the counter existed


def test_output_can_be_modified_in_place_like_nn_linear():
    torch.manual_seed(0)
    fp8 = FP8BlockLinear(256, 128)
    for shape in ((4, 256), (2, 3, 256)):
        x = torch.randn(*shape, requires_grad=True)
        y = fp8(x)
        y.mul_(2.0)
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("transposed", [False, True])
def test_requantize_dispatch_refreshes_buffers_in_place(transposed):
    """quant.requantize_128x128_ off CUDA (the reference path; the Triton launch is tests/fp8/test_triton.py's):
    the buffers get quantize_128x128's codes and scales, W^T's when asked, the non-finite flag, and new versions."""
    w = torch.randn(200, 300)
    w[150, 290] = float("nan")
    q_ref, s_ref = quantize_128x128(w)
    q = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    s, bad = torch.zeros(2, 3), torch.zeros((), dtype=torch.bool)
    qt, st = torch.zeros(300, 200, dtype=torch.float8_e4m3fn), torch.zeros(3, 2)
    buffers = (q, s, bad, qt, st) if transposed else (q, s, bad)
    versions, ptrs = [t._version for t in buffers], [t.data_ptr() for t in buffers]
    quant.requantize_128x128_(w, q, s, bad, transposed=(qt, st) if transposed else None)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.nan_to_num(-1.0), s_ref.nan_to_num(-1.0)) and bool(bad)
    if transposed:
        assert torch.equal(qt.view(torch.uint8), q_ref.t().contiguous().view(torch.uint8))
        assert torch.equal(st.nan_to_num(-1.0), s_ref.t().nan_to_num(-1.0))
    else:
        assert not bool(st.any())
    assert all(t._version > v for t, v in zip(buffers, versions)) and [t.data_ptr() for t in buffers] == ptrs


def test_optimizer_steps_refresh_the_layers_codes_in_place():
    """After each optimizer step the codes are the new weight's, in the same tensors (graphs and saved-tensor checks
    see one storage), and a backward whose forward saw the old codes raises."""
    torch.manual_seed(0)
    layer = FP8BlockLinear(256, 384, bias=False)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(16, 256, requires_grad=True)  # dx needed: the forward saves the (W^T) codes
    layer(x).sum().backward()
    buffers = (layer._fp8_qw, layer._fp8_sw, layer._fp8_bad)
    ptrs = [t.data_ptr() for t in buffers]
    for _ in range(2):
        opt.step()
        opt.zero_grad(set_to_none=True)
        y = layer(x)
        q_ref, s_ref = quantize_128x128(layer.weight.detach())
        assert torch.equal(layer._fp8_qw.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(layer._fp8_sw, s_ref) and not bool(layer._fp8_bad)
        assert [t.data_ptr() for t in (layer._fp8_qw, layer._fp8_sw, layer._fp8_bad)] == ptrs
        y.sum().backward()
    y_stale = layer(x)
    opt.step()
    layer(x)  # refreshes the codes the stale forward saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y_stale.sum().backward()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize("shadow", [False, True])
def test_a_non_floating_input_raises_like_nn_linear(dtype, shadow):
    """The quantizer scaled integer / bool inputs and returned an integer or bool output where nn.Linear raises."""
    fp8 = FP8BlockLinear(256, 128)
    x = torch.ones(4, 256).to(dtype)
    with pytest.raises(RuntimeError):
        nn.Linear(256, 128)(x)
    with pytest.raises(RuntimeError, match=rf"FP8BlockLinear takes a floating-point input, got {dtype}"):
        if shadow:
            with bf16_shadow(fp8):
                fp8(x)
        else:
            fp8(x)


def test_padded_128x1_codes_are_provably_16_aligned_under_dynamic_token_counts():
    """Under torch.compile with dynamic token counts (the trainer's compile_layers), Inductor marks an int argument of
    a user-defined Triton kernel 16-divisible only when it can prove it (torch/_inductor/codegen/triton_utils.py,
    config_of), and Triton vectorizes and pipelines on that mark. The 128x1 codes' row stride, the wgrad GEMM's K,
    is wgrad_rows(M) = 128 * ceil(M / 128): provably a multiple of 16, where M itself is not."""
    from torch._inductor.sizevars import SizeVarAllocator

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: quant.quantize_128x1(x, gemm_layout=True)[0], backend=backend,
                       dynamic=True)
    q = fn(torch.randn(4093, 256, dtype=torch.bfloat16))
    assert q.shape == (4096, 256) and q.stride() == (1, 4096)
    (out,) = [n for n in graphs[0].graph.nodes if n.op == "output"]
    val = out.args[0][0].meta["example_value"]
    sizes = SizeVarAllocator(val.shape[0].node.shape_env)
    tokens = [n.meta["example_value"] for n in graphs[0].graph.nodes if n.op == "placeholder"][0]
    assert isinstance(tokens, torch.SymInt) and not sizes.statically_known_multiple_of(tokens.node.expr, 16)
    assert sizes.statically_known_multiple_of(val.shape[0].node.expr, 128)
    assert sizes.statically_known_multiple_of(val.stride(1).node.expr, 16)


def test_wgrad_dispatch_of_padded_codes_guards_nothing_on_a_symbolic_token_count():
    """The wgrad GEMM's backend choice (gemm.scaled_mm_supports: cuBLAS needs K % 128 == 0) read the token count M;
    under compile_layers' dynamic shapes that installed a guard on M mod 128, one more recompile class per layer. Over
    wgrad_rows(M) rows K is provably a multiple of 128: no guard, and cuBLAS stays eligible at every count."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from calclip.fp8.gemm import scaled_mm_supports
    from calclip.fp8.reference import wgrad_rows

    for padded in (False, True):
        env = ShapeEnv()
        tokens = env.create_symintnode(env.create_symbol(4093, source=ConstantSource("tokens"),
                                                         dynamic_dim=DimDynamic.DYNAMIC), hint=4093)
        k = wgrad_rows(tokens) if padded else tokens
        assert scaled_mm_supports("1x128", "1x128", 512, 3584, k, torch.bfloat16) == padded
        assert [str(g.expr) for g in env.guards] == ([] if padded else [f"Ne(Mod({tokens.node.expr}, 128), 0)"])
