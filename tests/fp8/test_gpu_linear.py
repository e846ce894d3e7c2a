"""GPU checks of calclip.fp8 at LLM shapes: Triton quantizers bit-exact vs the reference, every GEMM backend vs
the float32 emulation, and FP8BlockLinear vs nn.Linear by SQNR floors. CUDA only; skipped otherwise.

    python -m pytest -q tests/fp8/test_gpu_linear.py
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from calclip.fp8 import reference as ref  # noqa: E402
from calclip.fp8 import kernels as tk  # noqa: E402
from calclip.fp8.gemm import fp8_block_gemm, resolve_backend, splitk_applies  # noqa: E402

from _sqnr import sqnr_db  # noqa: E402

pytestmark = pytest.mark.gpu

# FP8 E4M3 with 1x128 / 128x128 scales rounds each operand to 3 mantissa bits: ~29 dB per product on random
# data (measured on CPU with the emulation: 28.8 dB for output, dgrad and wgrad). The floor leaves ~4 dB margin.
SQNR_FLOOR_DB = 25.0
# Same codes and scales, different accumulation order (Hopper FP8 MMA: ~2**-14 within a K block) + bf16 output.
BACKEND_VS_EMULATED_RTOL = 5e-3
IS_SM90 = torch.cuda.get_device_capability()[0] == 9


def _rel_err(y, y_ref):
    y, y_ref = y.double(), y_ref.double()
    return ((y - y_ref).norm() / y_ref.norm()).item()


def _codes_differ(q, q_ref):
    a, b = q.contiguous().view(torch.uint8), q_ref.contiguous().view(torch.uint8)
    both_nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
    return int(((a != b) & ~both_nan).sum())


def _scales_equal(s, s_ref):
    s, s_ref = s.contiguous(), s_ref.contiguous()
    return bool(((s.view(torch.int32) == s_ref.view(torch.int32)) | (s.isnan() & s_ref.isnan())).all())


def _llm_like(shape, seed, dtype=torch.bfloat16):
    """Activations with outlier channels (a few columns 30x larger), like a transformer's residual stream."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda")
    cols = torch.randint(0, shape[-1], (max(1, shape[-1] // 256),), generator=g, device="cuda")
    x[..., cols] *= 30.0
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Quantizers: Triton == reference, bit for bit, at LLM shapes (incl. SmolLM2's ragged 576 / 1536).
# ---------------------------------------------------------------------------------------------------------

QUANT_CASES = [
    ("quantize_1x128", (8192, 4096)),
    ("quantize_1x128", (4, 2048, 576)),
    ("quantize_1x128", (3000, 1536)),
    ("quantize_1x128", (7, 14336)),
    ("quantize_128x1", (8192, 4096)),
    ("quantize_128x1", (3000, 576)),
    ("quantize_128x1", (1000, 1536)),
    ("quantize_128x128", (14336, 4096)),
    ("quantize_128x128", (1536, 576)),
    ("quantize_128x128", (576, 1536)),
    ("quantize_128x128", (49152, 576)),
]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("name,shape", QUANT_CASES)
def test_triton_quantizers_bit_exact_at_llm_shapes(name, shape, pow2):
    x = _llm_like(shape, seed=sum(shape))
    if name == "quantize_128x1":
        x[:200] *= 1e-4  # some token groups with tiny values (subnormal codes)
    q, s = getattr(tk, name)(x, pow2=pow2)
    q_ref, s_ref = getattr(ref, name)(x, pow2=pow2)  # the reference runs on the GPU too
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert _scales_equal(s, s_ref)
    assert _codes_differ(q, q_ref) == 0


def test_triton_quantizers_fp32_input_and_nonfinite_at_scale():
    x = torch.randn(4096, 1536, device="cuda") * 100
    x[17, 1000] = float("nan")
    x[2000, 3] = float("inf")
    for name in ("quantize_1x128", "quantize_128x1", "quantize_128x128"):
        q, s = getattr(tk, name)(x)
        q_ref, s_ref = getattr(ref, name)(x)
        assert _scales_equal(s, s_ref), name
        assert _codes_differ(q, q_ref) == 0, name
        assert s.isnan().any(), name


# ---------------------------------------------------------------------------------------------------------
# GEMM backends vs the float32 emulation (same codes and scales).
# ---------------------------------------------------------------------------------------------------------

# (m, n, k): aligned LLM shapes, SmolLM2's ragged ones, and K=384/640 where scaled_mm must NOT be chosen
# (docs/scaled_mm_layouts.md: it returns garbage unless K/128 is a multiple of 4).
GEMM_SHAPES = [(2048, 4096, 4096), (1024, 14336, 4096), (1024, 4096, 14336), (1000, 1536, 576),
               (1000, 576, 1536), (256, 512, 384), (256, 512, 640), (33, 4096, 4096)]


def _recipe_operands(m, n, k, seed):
    x = _llm_like((m, k), seed)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    dy = (torch.randn(m, n, device="cuda") * 1e-3).to(torch.bfloat16)
    qx, sx = tk.quantize_1x128(x)
    qw, sw = tk.quantize_128x128(w)
    qdy, sdy = tk.quantize_1x128(dy)
    qdy_t, sdy_t = tk.quantize_128x1(dy)
    qx_t, sx_t = tk.quantize_128x1(x)
    return {
        "forward": ((qx, sx, qw, sw), ("1x128", "128x128")),
        "dgrad": ((qdy, sdy, qw.t(), sw.t()), ("1x128", "128x128")),
        "wgrad": ((qdy_t.t(), sdy_t.t(), qx_t.t(), sx_t.t()), ("1x128", "1x128")),
    }


@pytest.mark.parametrize("backend", ["triton", "scaled_mm", "auto"])
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_backends_match_emulation(m, n, k, backend):
    for name, (operands, (a_blocks, b_blocks)) in _recipe_operands(m, n, k, seed=m + n + k).items():
        chosen = resolve_backend(backend, operands[0], operands[2], out_dtype=torch.bfloat16,
                                 a_blocks=a_blocks, b_blocks=b_blocks)
        if backend == "triton":
            # "triton" runs a Triton GEMM: the block kernel, or the split-K one for a forward-layout GEMM of at most
            # SPLITK_MAX_M rows with too few output tiles (calclip.fp8.gemm.splitk_applies)
            (rows, contraction), cols = operands[0].shape, operands[2].shape[0]
            splitk = splitk_applies(a_blocks, b_blocks, rows, cols, contraction, torch.bfloat16, operands[0].device)
            assert chosen == ("splitk" if splitk else "triton"), f"{name}: {chosen}"
        if chosen == "scaled_mm" and b_blocks == "128x128":
            contraction = operands[0].shape[1]
            assert contraction % 512 == 0, f"{name}: scaled_mm chosen for K={contraction} (wrong results there)"
        y_emu = fp8_block_gemm(*operands, out_dtype=torch.float32, backend="emulated", a_blocks=a_blocks,
                               b_blocks=b_blocks)
        y = fp8_block_gemm(*operands, out_dtype=torch.bfloat16, backend=backend, a_blocks=a_blocks,
                           b_blocks=b_blocks)
        assert y.dtype == torch.bfloat16 and y.shape == y_emu.shape
        err = _rel_err(y, y_emu)
        assert err < BACKEND_VS_EMULATED_RTOL, f"{name} via {chosen}: rel err {err:.2e}"


@pytest.mark.skipif(not IS_SM90, reason="torch._scaled_mm blockwise scaling is sm_90 only")
def test_triton_and_scaled_mm_agree_on_forward():
    ops = _recipe_operands(4096, 4096, 4096, seed=5)["forward"][0]
    y_t = tk.fp8_block_gemm_triton(*ops, out_dtype=torch.float32)
    y_s = fp8_block_gemm(*ops, out_dtype=torch.bfloat16, backend="scaled_mm")
    assert _rel_err(y_s, y_t) < BACKEND_VS_EMULATED_RTOL


@pytest.mark.skipif(not IS_SM90, reason="torch._scaled_mm blockwise scaling is sm_90 only")
@pytest.mark.parametrize("m", [4093, 1000, 300])
def test_scaled_mm_runs_a_row_count_not_a_multiple_of_16_on_padded_rows(m):
    """Forward and dgrad of M % 16 != 0 tokens go to cuBLAS on zero rows appended (gemm.pad_1x128_rows), not to
    Triton; the result has M rows and matches the emulation like any cuBLAS GEMM."""
    for name, (operands, (a_blocks, b_blocks)) in _recipe_operands(m, 4096, 4096, seed=m).items():
        if name == "wgrad":  # its first operand's rows are the weight's
            continue
        assert resolve_backend("scaled_mm", operands[0], operands[2], out_dtype=torch.bfloat16, a_blocks=a_blocks,
                               b_blocks=b_blocks) == "scaled_mm", name
        y_emu = fp8_block_gemm(*operands, out_dtype=torch.float32, backend="emulated", a_blocks=a_blocks,
                               b_blocks=b_blocks)
        y = fp8_block_gemm(*operands, out_dtype=torch.bfloat16, backend="scaled_mm", a_blocks=a_blocks,
                           b_blocks=b_blocks)
        assert y.shape == (m, 4096) and y.is_contiguous()
        err = _rel_err(y, y_emu)
        assert err < BACKEND_VS_EMULATED_RTOL, f"{name} at M={m}: rel err {err:.2e}"


@pytest.mark.skipif(not IS_SM90, reason="torch._scaled_mm blockwise scaling is sm_90 only")
def test_layer_at_a_ragged_token_count_quantizes_over_the_gemms_rows_without_a_copy(monkeypatch):
    """gemm.operand_rows on the H200: at 4093 tokens the forward and dgrad 1x128 operands are written over 4096 rows
    by their quantizer (its zero-token kernel), so gemm.pad_1x128_rows never runs;
    output and gradients equal the old copy path's bit for bit (the same codes and GEMM, only who writes the rows)."""
    from calclip.fp8 import Fp8Config, FP8BlockLinear, gemm, linear_math

    torch.manual_seed(0)
    layer = FP8BlockLinear(3584, 2048, bias=True, device="cuda", dtype=torch.bfloat16,
                           config=Fp8Config())
    x = _llm_like((1, 4093, 3584), seed=1)
    dy = (torch.randn(1, 4093, 2048, device="cuda") * 1e-2).to(torch.bfloat16)
    copies = []
    real_pad = gemm.pad_1x128_rows
    monkeypatch.setattr(gemm, "pad_1x128_rows", lambda *a, **k: copies.append(a[0].shape) or real_pad(*a, **k))
    y, dx, dw, _ = _run(layer, x, dy)
    assert copies == []
    layer.weight.grad = layer.bias.grad = None
    monkeypatch.setattr(linear_math, "operand_rows", lambda backend, a, out_dtype, row_scales=False: a.shape[0])
    y_copy, dx_copy, dw_copy, _ = _run(layer, x, dy)  # M rows quantized, the GEMM appends the rows by a copy
    assert len(copies) == 2 and all(shape[0] == 4093 for shape in copies)
    assert torch.equal(y, y_copy) and torch.equal(dx, dx_copy) and torch.equal(dw, dw_copy)


# ---------------------------------------------------------------------------------------------------------
# FP8BlockLinear on the GPU vs nn.Linear.
# ---------------------------------------------------------------------------------------------------------


def _linear_pair(k, n, gemm, backward, seed):
    from calclip.fp8 import FP8BlockLinear, Fp8Config

    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    fp8 = FP8BlockLinear(k, n, bias=True, device="cuda", dtype=torch.bfloat16,
                         config=Fp8Config(gemm=gemm, backward=backward))
    with torch.no_grad():
        fp8.weight.copy_(lin.weight)
        fp8.bias.copy_(lin.bias)
    return lin, fp8


def _run(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


LINEAR_SHAPES = [(2, 1024, 576, 1536), (2, 1024, 1536, 576), (1, 4096, 4096, 4096), (1, 2048, 4096, 14336),
                 (3, 333, 640, 384), (1, 1021, 1024, 2048)]


@pytest.mark.parametrize("backward", ["fp8", "bf16"])
@pytest.mark.parametrize("gemm", ["auto", "triton"])
@pytest.mark.parametrize("b,t,k,n", LINEAR_SHAPES)
def test_fp8_linear_vs_nn_linear_sqnr(b, t, k, n, gemm, backward):
    lin, fp8 = _linear_pair(k, n, gemm, backward, seed=k + n)
    x = _llm_like((b, t, k), seed=t)
    dy = (torch.randn(b, t, n, device="cuda") * 1e-2).to(torch.bfloat16)
    # The reference is nn.Linear in fp32 on the same bf16 values: it measures the FP8 error alone.
    ref_lin = torch.nn.Linear(k, n, device="cuda")
    with torch.no_grad():
        ref_lin.weight.copy_(lin.weight.float())
        ref_lin.bias.copy_(lin.bias.float())
    y_ref, dx_ref, dw_ref, db_ref = _run(ref_lin, x.float(), dy.float())
    y, dx, dw, db = _run(fp8, x, dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.bfloat16
    results = {"output": sqnr_db(y_ref, y), "dgrad": sqnr_db(dx_ref, dx), "wgrad": sqnr_db(dw_ref, dw)}
    floors = {"output": SQNR_FLOOR_DB, "dgrad": SQNR_FLOOR_DB if backward == "fp8" else SQNR_FLOOR_DB + 3,
              "wgrad": SQNR_FLOOR_DB if backward == "fp8" else 40.0}  # bf16 wgrad sees unquantized x and dy
    for key, value in results.items():
        assert value > floors[key], f"{key}: SQNR {value:.1f} dB <= {floors[key]} dB ({results})"
    assert _rel_err(db, db_ref) < 1e-2  # bias grad is a plain bf16 sum


@pytest.mark.parametrize("b,t,k,n", LINEAR_SHAPES[:3])
def test_fp8_linear_gpu_backends_match_emulated(b, t, k, n):
    # Same quantizers (bit-exact), so the GPU GEMMs may differ from the emulation only by accumulation order.
    _, fast = _linear_pair(k, n, "auto", "fp8", seed=1)
    _, emu = _linear_pair(k, n, "emulated", "fp8", seed=1)
    x = _llm_like((b, t, k), seed=2)
    dy = (torch.randn(b, t, n, device="cuda") * 1e-2).to(torch.bfloat16)
    for got, want, name in zip(_run(fast, x, dy), _run(emu, x, dy), ("output", "dgrad", "wgrad", "bias")):
        assert _rel_err(got, want) < BACKEND_VS_EMULATED_RTOL, name


def test_fast_launch_reuses_kernels_only_for_the_same_specialization():
    """The direct C-launcher path (kernels.launch._fast_launch) must give the reference's codes on every call:
    new data at one shape, then shapes and views that change Triton's specialization (odd sizes, 2-byte offsets)."""
    base = torch.randn(4096 + 8, 1536, device="cuda", dtype=torch.bfloat16)
    for x in (base[:4096], base[8:4104], base[:4096] * 3, base[1:4098], base[:4096, 1:1535], base[:7, :200]):
        for name in ("quantize_1x128", "quantize_128x1"):
            q, s = getattr(tk, name)(x)
            q_ref, s_ref = getattr(ref, name)(x.cpu())
            assert torch.equal(s.cpu(), s_ref) and _codes_differ(q.cpu(), q_ref) == 0, (name, tuple(x.shape))
        counter = torch.zeros((), dtype=torch.int64, device="cuda")
        tk.quantize_1x128(x, nonfinite_count=counter)
        assert int(counter) == 0


def test_fast_launch_still_calls_registered_launch_hooks():
    """With no hook registered the fast path passes None (kernels.launch._launch_hook); a hook added to Triton's
    launch_enter_hook chain must still see every launch of calclip's kernels, with the kernel's name."""
    from triton import knobs

    x = torch.randn(256, 576, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # autotuned, then compiled and cached by _fast_launch: the next calls take its fast path
        tk.quantize_1x128(x)
        tk.quantize_128x1(x)
    names = []

    def record(metadata):
        names.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(record)
    try:
        tk.quantize_1x128(x)
        tk.quantize_128x1(x)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(record)
    assert len(names) == 2 and "quantize_1x128" in names[0] and "quantize_128x1" in names[1], names
    tk.quantize_1x128(x)
    assert len(names) == 2


def test_weight_refresh_writes_codes_and_dgrad_codes_in_place():
    """After an optimizer step the layer's refresh writes the new weight's codes, scales, non-finite flag and W^T
    codes (kernels.requantize_128x128_, two launches) into the same buffers: equal to the reference's, W^T
    current without the next backward's copies, and a backward of a forward that saw the old codes raises."""
    from calclip.fp8 import FP8BlockLinear, Fp8Config

    torch.manual_seed(0)
    layer = FP8BlockLinear(576, 1536, bias=False, device="cuda", dtype=torch.float32,  # fp32 masters
                           config=Fp8Config(resident_dgrad_codes=True))  # the resident W^T codes' refresh
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    x = torch.randn(256, 576, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    buffers = lambda: (layer._fp8_qw, layer._fp8_sw, layer._fp8_bad, layer._fp8_qwt, layer._fp8_swt)  # noqa: E731
    ptrs = [t.data_ptr() for t in buffers()]
    for _ in range(3):
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        assert layer._fp8_dgrad_key == layer._fp8_key  # W^T came with the refresh, not from the backward's copies
        q_ref, s_ref = ref.quantize_128x128(layer.weight.detach().cpu())
        assert torch.equal(layer._fp8_sw.cpu(), s_ref) and _codes_differ(layer._fp8_qw.cpu(), q_ref) == 0
        assert torch.equal(layer._fp8_swt.cpu(), s_ref.t()) and _codes_differ(layer._fp8_qwt.cpu(), q_ref.t()) == 0
        assert not bool(layer._fp8_bad) and [t.data_ptr() for t in buffers()] == ptrs
        y.float().sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_stale = layer(x)
    opt.step()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x)  # refreshes the codes y_stale saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y_stale.float().sum().backward()


def test_sibling_groups_equal_each_linear_alone_on_the_gpu():
    """decode_group_siblings on CUDA: q/k/v (ragged widths, SmolLM2's 576/192) in one fused launch give the bits and
    non-finite counts of each linear's own fused call, with fp32 masters under bf16 autocast (the in-register
    rounding), and again after an optimizer step refreshed the stacked codes in place."""
    import copy

    from torch import nn

    from calclip.fp8 import Fp8Config, pop_nonfinite_count, quantize_model

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(576, 576), nn.Linear(576, 192), nn.Linear(576, 192)

        def forward(self, x):
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    torch.manual_seed(0)
    base = nn.Sequential(Attention()).cuda()
    plain = quantize_model(copy.deepcopy(base), Fp8Config(decode_fused_max_m=64))
    grouped = quantize_model(copy.deepcopy(base), Fp8Config(decode_fused_max_m=64, decode_group_siblings=True))
    assert grouped[0].q_proj._fp8_group is not None
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (plain, grouped)]
    for _ in range(2):
        x = torch.randn(48, 576, device="cuda")
        x[7, 100] = float("nan")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            y_plain, y_grouped = plain(x), grouped(x)
        assert torch.equal(y_plain.view(torch.int16), y_grouped.view(torch.int16))
        assert int(pop_nonfinite_count(plain)) == int(pop_nonfinite_count(grouped)) == 3
        x_train = torch.randn(8, 576, device="cuda")  # one batch for both models, so their weights stay equal
        for model, opt in zip((plain, grouped), opts):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(x_train).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
