"""The one-launch small-M forward (``fp8_linear_fused_quant_gemm``: 1x128 quantization of x in the GEMM's
prologue) and its opt-in wiring (``Fp8Config.decode_fused_max_m``).

Two kinds of claims, each test's docstring says which it makes:

- bit for bit, where both sides run the same arithmetic op for op: the same kernel reached through two entries
  (checked vs unchecked, fp32 rounded in registers vs cast first), or the same unfused launches (the training
  forward vs the layer without the fused path);
- within the fp32 accumulation bound of the float64 product of the same FP8 codes (tests/fp8/_gemm_bound.py),
  where the fused and the unfused kernels sum the same products in different orders: their tile shapes differ,
  and even under Triton's interpreter, whose dot is a numpy matmul, the BLAS picks a kernel (and so a summation
  order) per tile shape and per CPU: bit equality held on one CI machine and failed on another. Non-finite
  outputs (NaN rows, NaN weight blocks) and the non-finite count are checked exactly, as before.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it); on a GPU the bound also allows FP8
wgmma's block-sum precision (see GPU_BLOCK_SUM_RTOL).

    python -m pytest -q tests/fp8/test_fused_decode.py                        # CPU (interpreter) or CUDA
    TRITON_INTERPRET=0 python -m pytest -q tests/fp8/test_fused_decode.py     # CPU: the sm_90 compile check
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
NO_DEVICE_TESTS = {"test_fused_kernel_compiles_for_sm90_without_a_gpu", "test_config_field_validation",
                   "test_automatic_limit_is_eager_cuda_blockwise_only",
                   "test_compiled_decode_op_records_one_fused_kernel"}


@pytest.fixture(autouse=True)
def _needs_device(request):
    if DEVICE is None and request.node.originalname not in NO_DEVICE_TESTS:
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1 to run the kernels on CPU")


from calclip.fp8 import FP8BlockLinear, Fp8Config, bf16_shadow, gemm, linear_math, quantize_model  # noqa: E402
from calclip.fp8 import reference as ref  # noqa: E402
from calclip.fp8 import kernels as tk  # noqa: E402
from calclip.fp8.weight_codes import fp8_layers  # noqa: E402
from calclip.fp8.config import BLOCK, DECODE_FUSED_AUTO_MAX_M, blockwise_only_options  # noqa: E402

from _gemm_bound import assert_within_bound, exact_linear, exact_products, gemm_bound  # noqa: E402

NAN, INF = float("nan"), float("inf")
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _same_bits(a, b):
    """Bit-equal tensors of one float dtype (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(_INT_VIEW[a.dtype]), b.view(_INT_VIEW[b.dtype]))


# On sm_90 both kernels run FP8 wgmma (m64 x BLOCK_N x k32, every config:
# test_fused_kernel_compiles_for_sm90_without_a_gpu), whose block sums keep ~14 bits: each k32 MMA adds its
# products to the accumulator with an error of at most 2**-13 of the magnitudes summed so far (DeepSeek-V3
# report), so a 128-wide block (four k32 steps) is within 4 * 2**-13 = 2**-11 of sum |x w|, on top of the fp32
# bound. (2**-12, this constant's first value, was below that: on the H200 one output reached 1.01x.)
GPU_BLOCK_SUM_RTOL = 0.0 if INTERPRET else (BLOCK // 32) * 2.0**-13


def _assert_near_exact(y, x, qw, sw, pow2=False, bias=None, what="y"):
    """y (a linear's output for input x and the FP8 weight qw/sw, plus ``bias`` when given) vs the float64 product
    of the reference quantizer's codes of x: the same non-finite outputs, the rest within the fp32 accumulation
    bound (tests/fp8/_gemm_bound.py). A bias is cast to y's dtype and added in it: two more roundings, each at
    most half a unit of the last place (torch rounds to nearest)."""
    exact, abs_sum = exact_linear(x, qw, sw, pow2=pow2)
    bound = gemm_bound(abs_sum, exact.abs(), x.shape[-1], y.dtype, truncating=INTERPRET,
                       extra_rtol=GPU_BLOCK_SUM_RTOL)
    if bias is not None:
        b = bias.detach().double().cpu()
        ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[y.dtype]
        bound = bound + 0.5 * ulp * (b.abs() + (exact.abs() + bound + b.abs())) * 1.01
        exact = exact + b
    assert_within_bound(y, exact, bound, what)


def _x(m, k, dtype, seed, bad_rows=()):
    """Random rows over 9 decades along K (small groups reach e4m3 subnormals); ``bad_rows``: (row, col, value)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, k)
    for row, col, value in bad_rows:
        x[row, col] = value
    return x.to(dtype).to(DEVICE)


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEVICE)
    return tk.quantize_128x128(w)


def _unfused(x, qw, sw, out_dtype, pow2, weight_bad=None):
    """What FP8BlockLinear's forward computes with the triton GEMM backend: two launches, and its counter."""
    count = torch.zeros((), dtype=torch.int64, device=DEVICE)
    qx, sx = tk.quantize_1x128(x, pow2=pow2, gemm_layout=True, nonfinite_count=count, weight_bad=weight_bad)
    return tk.fp8_block_gemm_triton(qx, sx, qw, sw, out_dtype=out_dtype), count


def _fused(x, qw, sw, out_dtype, pow2, weight_bad=None):
    count = torch.zeros((), dtype=torch.int64, device=DEVICE)
    y = tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=out_dtype, nonfinite_count=count, weight_bad=weight_bad,
                                       pow2=pow2)
    return y, count


# (M, K, N, input dtype, pow2, bad elements): ragged and aligned M/N/K, SmolLM2's K=576 and 1536, M=1/7/64.
CASES = [
    (1, 576, 100, torch.bfloat16, False, ()),
    (7, 576, 192, torch.bfloat16, True, ((2, 575, NAN), (5, 0, -INF))),  # ragged last group holds the NaN
    (64, 128, 100, torch.float32, False, ((63, 7, INF),)),
    (7, 1536, 64, torch.float32, True, ((0, 1000, NAN), (0, 3, INF))),  # one row, two bad groups: counted once
    (17, 130, 576, torch.bfloat16, False, ()),
    (1, 128, 1536, torch.float16, True, ()),
    (64, 130, 100, torch.bfloat16, True, ((1, 129, NAN), (40, 64, INF))),
]


@pytest.mark.parametrize("m,k,n,dtype,pow2,bad", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-{c[3]}-pow2={c[4]}-bad={len(c[5])}"
                                                              for c in CASES])
def test_fused_and_unfused_triton_both_within_the_fp32_bound(m, k, n, dtype, pow2, bad):
    """Claim: within the fp32 accumulation bound, not bit for bit (the two kernels' tiles sum in different orders).
    Fused and unfused outputs both lie within it of the float64 product of the reference codes, with NaN rows
    exactly where the input rows hold a NaN or an infinity, and the same non-finite row count."""
    x = _x(m, k, dtype, seed=m * k + n, bad_rows=bad)
    qw, sw = _weight(n, k, seed=n)
    out_dtype = dtype
    y_fused, count_fused = _fused(x, qw, sw, out_dtype, pow2)
    y_ref, count_ref = _unfused(x, qw, sw, out_dtype, pow2)
    assert y_fused.dtype == y_ref.dtype == out_dtype and y_fused.shape == y_ref.shape == (m, n)
    _assert_near_exact(y_fused, x, qw, sw, pow2, what="fused")
    _assert_near_exact(y_ref, x, qw, sw, pow2, what="unfused")
    expected_bad = int((~torch.isfinite(x.float())).any(dim=1).sum())  # worked out without any quantizer
    assert expected_bad == len({row for row, _, _ in bad})
    assert int(count_fused) == int(count_ref) == expected_bad
    assert torch.equal(y_fused.isnan().all(dim=1).cpu(), (~torch.isfinite(x.float())).any(dim=1).cpu())


@pytest.mark.parametrize("m,k,n,dtype,pow2,bad", CASES[:4], ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in CASES[:4]])
def test_the_layers_unchecked_entry_equals_the_checked_one(m, k, n, dtype, pow2, bad):
    """Claim: bit for bit (one kernel, op for op). fp8_linear_decode_unchecked (the layer's entry: no argument
    checks) launches what fp8_linear_fused_quant_gemm does: the same output bits and count, with a weight flag, and
    with the in-register autocast rounding."""
    x = _x(m, k, dtype, seed=m + k + n, bad_rows=bad)
    qw, sw = _weight(n, k, seed=n + 1)
    for weight_bad in (False, True):
        flag = torch.tensor(weight_bad, device=DEVICE)
        y_checked, count_checked = _fused(x, qw, sw, dtype, pow2, weight_bad=flag)
        count = torch.zeros((), dtype=torch.int64, device=DEVICE)
        y = tk.fp8_linear_decode_unchecked(x, qw, sw, out_dtype=dtype, nonfinite_count=count, weight_bad=flag,
                                           pow2=pow2)
        assert _same_bits(y, y_checked) and int(count) == int(count_checked) == (m if weight_bad else len(
            {row for row, _, _ in bad}))
    if dtype == torch.float32:
        flag = torch.tensor(False, device=DEVICE)
        count = torch.zeros((), dtype=torch.int64, device=DEVICE)
        y = tk.fp8_linear_decode_unchecked(x, qw, sw, out_dtype=torch.bfloat16, nonfinite_count=count,
                                           weight_bad=flag, pow2=pow2, round_to=torch.bfloat16)
        y_cast, _ = _fused(x.to(torch.bfloat16), qw, sw, torch.bfloat16, pow2)
        assert _same_bits(y, y_cast)


def test_a_call_the_unchecked_kernel_cannot_serve_takes_the_usual_path(monkeypatch):
    """The layer hands the kernel its operands unchecked, so it checks the input's width itself: a wrong width
    never reaches the kernel and fails as the unfused layer fails."""
    calls = _CallCounter(monkeypatch)
    off, on = _layer_pair(256, 128, max_m=64, seed=2)
    with torch.no_grad():
        on(_x(4, 256, torch.float32, seed=1))
        assert calls.calls == 1
        for layer in (off, on):
            with pytest.raises((ValueError, RuntimeError)):
                layer(_x(4, 384, torch.float32, seed=1))
    assert calls.calls == 1


@pytest.mark.parametrize("m,k,n", [(7, 576, 300), (64, 130, 192)])
def test_weight_with_a_nan_block_counts_every_row(m, k, n):
    """Claim: the NaN pattern and the counts exactly; the finite outputs within the fp32 accumulation bound (fused
    and unfused sum in different orders). A NaN in the last weight block makes its output columns NaN on every row,
    the input's bad row NaN on every column, and every row counts."""
    x = _x(m, k, torch.bfloat16, seed=1, bad_rows=((3, 4, NAN),))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    w[n - 1, k - 1] = NAN  # the last (ragged) weight block: its 128 output columns and the token count go bad
    qw, sw = tk.quantize_128x128(w)
    weight_bad = torch.isnan(sw).any()
    y_fused, count_fused = _fused(x, qw, sw, torch.float32, False, weight_bad)
    y_ref, count_ref = _unfused(x, qw, sw, torch.float32, False, weight_bad)
    _assert_near_exact(y_fused, x, qw, sw, what="fused")
    _assert_near_exact(y_ref, x, qw, sw, what="unfused")
    assert int(count_fused) == int(count_ref) == m
    expected_nan = torch.zeros(m, n, dtype=torch.bool)  # worked out by hand: bad row 3, bad last weight block
    expected_nan[3, :] = True
    expected_nan[:, (n - 1) // BLOCK * BLOCK:] = True
    assert torch.equal(y_fused.isnan().cpu(), expected_nan) and torch.equal(y_ref.isnan().cpu(), expected_nan)


def test_counts_add_up_over_calls_and_n_tiles():
    """Many N tiles (N = 1536 is 24 tiles of 64): each bad row is still added once per call."""
    x = _x(3, 128, torch.bfloat16, seed=3, bad_rows=((1, 0, INF),))
    qw, sw = _weight(1536, 128, seed=3)
    count = torch.full((), 5, dtype=torch.int64, device=DEVICE)
    for _ in range(2):
        tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=torch.bfloat16, nonfinite_count=count)
    assert int(count) == 5 + 2


@pytest.mark.parametrize("m,k,n,out_dtype", [(7, 576, 100, torch.float32), (64, 130, 192, torch.float32),
                                             (1, 1536, 64, torch.bfloat16)])
def test_fused_matches_float64_dequantized_reference(m, k, n, out_dtype):
    """Claim: within the fp32 accumulation bound (tests/fp8/_gemm_bound.py) of (dequant Q1x128(x)) @ (dequant
    Q128x128(W))^T in float64, built from calclip.fp8.reference's quantizers alone (the kernel's own weight codes
    are checked against them too).

    Products of two e4m3 codes are exact in fp32; each output is a sum of K of them in 128-wide blocks, with two
    roundings more per block (the scale product and its multiply) and one add per block, so
    |fl(y) - y| <= gamma_n sum |x_k w_k|, n = 127 + 2 + ceil(K/128), in every accumulation order; it scales with
    sum |x_k w_k|, so it is tight, not a blanket tolerance (an FP8 code off by one step would exceed it by orders of
    magnitude). bf16 output adds its own rounding (the interpreter truncates: one bf16 ulp, 2**-7 relative); on a
    GPU, FP8 wgmma's block sums add theirs."""
    x = _x(m, k, torch.float32, seed=4)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05)
    qw, sw = tk.quantize_128x128(w.to(DEVICE))
    qw_ref, sw_ref = ref.quantize_128x128(w)
    assert torch.equal(qw.cpu().view(torch.uint8), qw_ref.view(torch.uint8)) and torch.equal(sw.cpu(), sw_ref)
    y = tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=out_dtype)
    exact, abs_sum = exact_products(*ref.quantize_1x128(x.cpu()), qw_ref, sw_ref)
    bound = gemm_bound(abs_sum, exact.abs(), k, out_dtype, truncating=INTERPRET, extra_rtol=GPU_BLOCK_SUM_RTOL)
    assert_within_bound(y, exact, bound)


def test_empty_and_invalid_inputs():
    qw, sw = _weight(100, 576, seed=6)
    x = _x(4, 576, torch.bfloat16, seed=6)
    count = torch.zeros((), dtype=torch.int64, device=DEVICE)
    y = tk.fp8_linear_fused_quant_gemm(x[:0], qw, sw, out_dtype=torch.bfloat16, nonfinite_count=count)
    assert y.shape == (0, 100) and int(count) == 0
    y = tk.fp8_linear_fused_quant_gemm(x[:, :0], qw[:, :0], sw[:, :0], out_dtype=torch.float32)
    assert y.shape == (4, 100) and not bool(y.any())
    with pytest.raises(ValueError, match="qw must be"):
        tk.fp8_linear_fused_quant_gemm(x, qw.float(), sw, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="qw must be"):
        tk.fp8_linear_fused_quant_gemm(x[:, :512], qw, sw, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sw must be float32"):
        tk.fp8_linear_fused_quant_gemm(x, qw, sw[:, :4], out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="nonfinite_count must be an int64"):
        tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=torch.bfloat16, nonfinite_count=count.int())
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        tk.fp8_linear_fused_quant_gemm(x.to(torch.int32), qw, sw, out_dtype=torch.bfloat16)


@pytest.mark.skipif(INTERPRET, reason="the interpreter does not compile (run with TRITON_INTERPRET=0)")
def test_fused_kernel_compiles_for_sm90_without_a_gpu():
    """Every autotune config compiles to sm_90 (the interpreter accepts code Triton would reject) with the
    hardware e4m3 cast, exact divisions, the counter's atomic and Hopper's FP8 wgmma, the MMA every config of
    the unfused GEMM uses (a BLOCK_M below 64 would compile to mma.sync on f16-upcast codes: other sums)."""
    pytest.importorskip("triton.backends.nvidia", reason="triton built without the NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from calclip.fp8.kernels import fused_decode

    fn = fused_decode._fp8_linear_fused_quant_kernel
    types = {"x_ptr": "*bf16", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "sb_ptr": "*fp32", "count_ptr": "*i64",
             "weight_bad_ptr": "*i1", **{name: "i32" for name in fn.arg_names[6:17]}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t != "i32"}
    for config in fused_decode._FUSED_CONFIGS:
        constexprs = {"POW2": True, "SOFT_FP8": False, "COUNT": True, "ROUND": 0, "MEMBERS": 1, "BLOCK_K": BLOCK,
                      **config.kwargs}
        signature = {**types, **{n: "constexpr" for n in constexprs}}
        src = ASTSource(fn=fn, signature={n: signature[n] for n in fn.arg_names}, constexprs=constexprs, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": config.num_warps, "num_stages": config.num_stages}).asm["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx
        assert "atom.global" in ptx and "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx and "mma.sync" not in ptx
    # fp32 x rounded to bf16 in registers (ROUND 1): the hardware round-to-nearest-even conversion.
    types32 = {**types, "x_ptr": "*fp32"}
    constexprs = {"POW2": True, "SOFT_FP8": False, "COUNT": True, "ROUND": 1, "MEMBERS": 1, "BLOCK_K": BLOCK,
                  **fused_decode._FUSED_DEFAULT.kwargs}
    # siblings' stacked codes (q/k/v: MEMBERS 3) count with an int32 number of bad weights
    group_constexprs = {**constexprs, "ROUND": 0, "MEMBERS": 3}
    group_signature = {**types, "weight_bad_ptr": "*i32", **{n: "constexpr" for n in group_constexprs}}
    group_src = ASTSource(fn=fn, signature={n: group_signature[n] for n in fn.arg_names}, constexprs=group_constexprs,
                          attrs=attrs)
    assert "atom.global" in triton.compile(group_src, target=GPUTarget("cuda", 90, 32),
                                           options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    signature = {**types32, **{n: "constexpr" for n in constexprs}}
    src = ASTSource(fn=fn, signature={n: signature[n] for n in fn.arg_names}, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    assert "cvt.rn.bf16" in ptx and "wgmma.mma_async" in ptx


def _rounding_edge_cases(dtype):
    """fp32 values at the edges of rounding to ``dtype``: exact ties (round to even), values that round up past the
    largest finite value (-> inf), NaNs whose payload sits in the low bits (a carry must not turn them into inf),
    infinities, subnormals and signed zeros, then random values over 60 decades."""
    g = torch.Generator().manual_seed(11)
    if dtype == torch.bfloat16:
        bits = torch.randint(0, 2**31 - 1, (96,), generator=g, dtype=torch.int64)
        ties = ((bits & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32)  # exactly half a bf16 ulp
        special = torch.tensor([3.3961e38, 3.4e38, -3.4e38, 1e-40, -1e-45, -0.0, 0.0, INF, -INF])
        nans = torch.tensor([0x7F800001, 0x7FC00000, 0x7F80FFFF], dtype=torch.int32).view(torch.float32)
    else:
        base = torch.randn(96, generator=g).to(torch.float16).double()
        ulp = torch.tensor(base.numpy()).abs() * 2.0**-10  # about one fp16 ulp: a half-ulp offset is near a tie
        ties = (base + 0.5 * ulp).float()
        special = torch.tensor([65504.0, 65519.0, 65520.0, -65520.0, 1e-8, 6e-8, -0.0, INF, -INF])
        nans = torch.tensor([0x7FC00000, 0x7F800001], dtype=torch.int32).view(torch.float32)
    rand = torch.randn(64, generator=g) * torch.logspace(-30, 30, 64)
    return torch.cat([ties, special, nans, rand])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_equals_casting_first_bit_for_bit(dtype):
    """round_to rounds fp32 x to bf16/fp16 in registers exactly as x.to(dtype) does, so output and count equal
    those of the cast-first call on every edge case (ties, overflow to inf, NaN payloads, subnormals). Each edge
    value leads its own 1x128 group (its largest magnitude, so a rounding difference moves the group's scale and
    every code of it); the rest of the group are fractions of it, rounded too."""
    leaders = _rounding_edge_cases(dtype)
    g = torch.Generator().manual_seed(5)
    fractions = torch.rand(leaders.numel(), BLOCK, generator=g) * 1.8 - 0.9
    groups = torch.where(leaders.isfinite()[:, None], leaders[:, None] * fractions, torch.ones(1))
    groups[:, 0] = leaders
    if groups.shape[0] % 2:
        groups = torch.cat([groups, torch.ones(1, BLOCK)])
    x = groups.reshape(-1, 2 * BLOCK).to(DEVICE)  # two groups per row: K = 256
    qw, sw = _weight(64, 2 * BLOCK, seed=3)
    for pow2 in (False, True):
        count_round = torch.zeros((), dtype=torch.int64, device=DEVICE)
        count_cast = torch.zeros((), dtype=torch.int64, device=DEVICE)
        y_round = tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=dtype, nonfinite_count=count_round,
                                                 pow2=pow2, round_to=dtype)
        y_cast = tk.fp8_linear_fused_quant_gemm(x.to(dtype), qw, sw, out_dtype=dtype, nonfinite_count=count_cast,
                                                pow2=pow2)
        assert _same_bits(y_round, y_cast)
        assert int(count_round) == int(count_cast) > int(torch.isinf(x).any(-1).sum() + torch.isnan(x).any(-1).sum())
    with pytest.raises(ValueError, match="round_to"):
        tk.fp8_linear_fused_quant_gemm(x.to(dtype), qw, sw, out_dtype=dtype, round_to=dtype)  # not fp32
    with pytest.raises(ValueError, match="round_to"):
        tk.fp8_linear_fused_quant_gemm(x, qw, sw, out_dtype=dtype, round_to=torch.float64)


# ----------------------------------------------------------------------------------------------------------
# Wiring: Fp8Config.decode_fused_max_m
# ----------------------------------------------------------------------------------------------------------


def test_config_field_validation():
    assert Fp8Config().decode_fused_max_m is None  # automatic
    assert Fp8Config(decode_fused_max_m=64).decode_fused_max_m == 64
    assert Fp8Config(decode_fused_max_m=0).decode_fused_max_m == 0
    for bad in (-1, 1.5, True, "64"):
        with pytest.raises(ValueError, match=r"Fp8Config.decode_fused_max_m must be None \(automatic\) or an int"):
            Fp8Config(decode_fused_max_m=bad)
    with pytest.raises(ValueError, match=r"decode_fused_max_m=8 .* needs block_size=128"):
        Fp8Config(decode_fused_max_m=8, block_size=64)
    with pytest.raises(ValueError, match=r"decode_fused_max_m=8 .* gemm='emulated'"):
        Fp8Config(decode_fused_max_m=8, gemm="emulated")
    with pytest.raises(ValueError, match=r"cannot honour decode_fused_max_m=8"):
        Fp8Config(decode_fused_max_m=8, recipe="rowwise")
    # The automatic default conflicts with nothing: it resolves to "off" wherever the kernel does not apply.
    assert blockwise_only_options("rowwise") == [] and blockwise_only_options("rowwise", decode_fused_max_m=0) == []
    Fp8Config(block_size=64), Fp8Config(gemm="emulated")


def test_automatic_limit_is_eager_cuda_blockwise_only():
    """None resolves to DECODE_FUSED_AUTO_MAX_M for eager CUDA calls whose GEMM would be calclip's (auto/triton),
    to 0 everywhere else; an explicit limit is the limit everywhere."""
    auto = Fp8Config()
    assert auto.fused_decode_max_m(cuda=True, compiled=False) == DECODE_FUSED_AUTO_MAX_M == 256
    assert Fp8Config(gemm="triton").fused_decode_max_m(cuda=True, compiled=False) == 256
    assert auto.fused_decode_max_m(cuda=True, compiled=True) == 0  # CUDA graphs: the two-launch path was faster
    assert auto.fused_decode_max_m(cuda=False, compiled=False) == 0  # CPU: the interpreter would be slow
    for cfg in (Fp8Config(gemm="scaled_mm"), Fp8Config(gemm="emulated"), Fp8Config(block_size=64)):
        assert cfg.fused_decode_max_m(cuda=True, compiled=False) == 0, cfg
    for value in (0, 64):
        cfg = Fp8Config(decode_fused_max_m=value)
        assert {cfg.fused_decode_max_m(cuda=c, compiled=k) for c in (True, False) for k in (True, False)} == {value}


def test_automatic_limit_leaves_cpu_calls_unfused(monkeypatch):
    """With the default config a CPU no-grad forward never launches the fused kernel, even under the interpreter
    (tests run with TRITON_INTERPRET=1), while an explicit limit does; on CUDA both do."""
    calls = _CallCounter(monkeypatch)
    x = _x(4, 256, torch.bfloat16, seed=11)
    for max_m, expected in ((None, int(x.is_cuda)), (8, 1)):
        layer = FP8BlockLinear(256, 128, bias=False, config=Fp8Config(decode_fused_max_m=max_m)).to(DEVICE)
        with torch.no_grad():
            layer(x)
        assert calls.calls == expected, (max_m, calls.calls)
        calls.calls = 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs CUDA")
def test_automatic_limit_leaves_a_cuda_graph_capture_unfused(monkeypatch):
    """An eager call captured into a CUDA graph takes the two launches under the automatic limit (in graphs their
    GPU time measured lower), and the graph replays the same output; outside the capture the call is fused."""
    calls = _CallCounter(monkeypatch)
    x = _x(16, 256, torch.bfloat16, seed=12).to("cuda")
    torch.manual_seed(12)
    auto = FP8BlockLinear(256, 384, bias=False, dtype=torch.bfloat16, device="cuda", config=Fp8Config())
    unfused = FP8BlockLinear(256, 384, bias=False, dtype=torch.bfloat16, device="cuda",
                             config=Fp8Config(decode_fused_max_m=0))
    unfused.weight.data.copy_(auto.weight.data)
    with torch.no_grad():
        expected = unfused(x)  # also tunes the two-launch kernels before the capture
        auto(x)
        assert calls.calls == 1  # eager, outside a capture: fused
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = auto(x)
        assert calls.calls == 1  # the capture took the two launches
        graph.replay()
        torch.cuda.synchronize()
    assert _same_bits(y, expected)


class _CallCounter:
    """Counts calls of kernels.fp8_linear_decode_unchecked, the fused kernel's entry for the layer (it looks
    it up on every call)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = tk.fp8_linear_decode_unchecked

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(tk, "fp8_linear_decode_unchecked", counted)


@pytest.fixture
def triton_gemm_everywhere(monkeypatch):
    """Run the unfused layer's GEMM on calclip's Triton kernel on CPU too (interpreter), as on a GPU whose K is
    not a multiple of 512: the path the fused kernel must equal bit for bit. (The quantizers on CPU are the
    reference, whose codes and scales the Triton quantizers equal bit for bit: tests/fp8/test_triton.py.)"""
    forced = lambda backend, *args, **kwargs: "triton"  # noqa: E731
    monkeypatch.setattr(gemm, "resolve_backend", forced)
    monkeypatch.setattr(linear_math, "resolve_backend", forced)
    monkeypatch.setattr(linear_math, "_gemm_choice", {})


def _layer_pair(k, n, max_m, seed=0):
    torch.manual_seed(seed)
    base = torch.nn.Linear(k, n, device=DEVICE)
    # off: the two launches, named (the automatic default fuses eager CUDA calls, which would make off fused too)
    off = FP8BlockLinear.from_linear(base, Fp8Config(keep_patterns=(), decode_fused_max_m=0))
    on = FP8BlockLinear.from_linear(base, Fp8Config(keep_patterns=(), decode_fused_max_m=max_m))
    return off, on


def test_layer_takes_the_fused_path_only_for_small_no_grad_calls(monkeypatch, triton_gemm_everywhere):
    calls = _CallCounter(monkeypatch)
    off, on = _layer_pair(576, 100, max_m=8)
    x = _x(2 * 4, 576, torch.bfloat16, seed=7, bad_rows=((1, 5, NAN), (6, 575, INF))).reshape(2, 4, 576)
    with torch.no_grad():
        y_off, y_on = off(x), on(x)
    assert calls.calls == 1
    assert y_on.shape == (2, 4, 100)
    # fused vs unfused: two summation orders, both within the fp32 bound (bias added in bf16: two roundings more)
    _assert_near_exact(y_on, x, on._fp8_qw, on._fp8_sw, bias=on.bias, what="fused")
    _assert_near_exact(y_off, x, off._fp8_qw, off._fp8_sw, bias=off.bias, what="unfused")
    assert int(on.nonfinite_count) == int(off.nonfinite_count) == 2
    with torch.no_grad():
        on(_x(9, 576, torch.bfloat16, seed=8))  # M = 9 > 8: the usual two launches
    assert calls.calls == 1
    xg = x.detach().requires_grad_()
    y_train = on(xg)  # grad enabled: the training forward, whose backward needs the saved codes
    assert calls.calls == 1 and _same_bits(y_train.detach(), y_off)
    y_train.float().nan_to_num().sum().backward()
    assert on.weight.grad is not None and xg.grad is not None
    with torch.no_grad():
        on.weight[0, 0] = NAN  # a weight block with a NaN (its _version moves: codes refresh): every row counts
        before = int(on.nonfinite_count)
        on(x)
    assert calls.calls == 2 and int(on.nonfinite_count) == before + 8


def test_layer_under_autocast_rounds_fp32_inputs_in_the_kernel(monkeypatch, triton_gemm_everywhere):
    """An fp32 activation under bf16 autocast (fp32 master weights leave the residual stream fp32) takes the fused
    kernel uncast: the same bits and count as casting it first, without the cast's launch; grad-enabled and
    larger calls cast as before."""
    calls = _CallCounter(monkeypatch)
    _, on = _layer_pair(576, 100, max_m=8)
    x = _x(2 * 3, 576, torch.float32, seed=9, bad_rows=((2, 100, NAN),)).reshape(2, 3, 576)
    seen = []
    real = tk.fp8_linear_decode_unchecked

    def recording(x2, *args, **kwargs):
        seen.append((x2.dtype, kwargs.get("round_to")))
        return real(x2, *args, **kwargs)

    monkeypatch.setattr(tk, "fp8_linear_decode_unchecked", recording)
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        y_uncast = on(x)
        count_uncast = int(on.nonfinite_count)
        y_cast = on(x.to(torch.bfloat16))
    assert seen == [(torch.float32, torch.bfloat16), (torch.bfloat16, None)]
    assert y_uncast.dtype == torch.bfloat16 and y_uncast.shape == (2, 3, 100) and _same_bits(y_uncast, y_cast)
    assert count_uncast == 1 and int(on.nonfinite_count) == 2
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y_train = on(x)  # grad enabled: cast, then the training forward
    assert len(seen) == 2 and _same_bits(y_train.detach(), y_cast)
    del calls


def _generate(model, prompt, mask):
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=2, min_new_tokens=2,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.skipif(not INTERPRET, reason="CPU test (the GPU path is covered by the kernel tests above)")
def _record_linear_calls(model, records):
    """Forward hooks on every FP8 linear of ``model`` appending (layer, input, output) to ``records``."""
    hooks = [layer.register_forward_hook(lambda mod, args, out: records.append((mod, args[0].detach(), out.detach())))
             for layer in fp8_layers(model)]
    return hooks


@pytest.mark.slow
def test_generate_with_the_fused_decode_matches_the_unfused_model(monkeypatch):
    """A tiny Llama (hidden 192: ragged blocks) converted with quantize_model generates greedily under no_grad:
    with decode_fused_max_m the decode steps' linears take the fused kernel (prefill, 15 rows, does not).

    Claim: within the fp32 accumulation bound, not bit for bit (fused and unfused kernels sum in different
    orders). Every FP8 linear call of both models, fused or not, lies within the bound of the float64 product of
    its own input's reference codes (tests/fp8/_gemm_bound.py); the greedy tokens are equal across the fused, the
    unfused Triton and the default CPU backend (emulated: one fp32 matmul per linear), and every step's top-1
    margin is far above the logits' differences, so the equality follows from the bound, not from luck."""
    pytest.importorskip("transformers")
    from tests.fixtures import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    models = {}
    for name, max_m in (("off", 0), ("on", 4)):
        model = build_tiny_model(tokenizer, hidden_size=192, intermediate_size=320, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, seed=0).to(DEVICE).eval()
        models[name] = quantize_model(model, Fp8Config(decode_fused_max_m=max_m))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, len(tokenizer), (3, 5), generator=g).to(DEVICE)
    mask = torch.ones_like(prompt)
    seq_emulated, logits_emulated = _generate(models["off"], prompt, mask)  # the default CPU GEMM backend

    records = {"off": [], "on": []}
    with monkeypatch.context() as patch:
        patch.setattr(gemm, "resolve_backend", lambda backend, *a, **kw: "triton")
        patch.setattr(linear_math, "resolve_backend", lambda backend, *a, **kw: "triton")
        patch.setattr(linear_math, "_gemm_choice", {})
        calls = _CallCounter(patch)
        hooks = [h for name in models for h in _record_linear_calls(models[name], records[name])]
        try:
            seq_off, logits_off = _generate(models["off"], prompt, mask)
            assert calls.calls == 0
            seq_on, logits_on = _generate(models["on"], prompt, mask)
        finally:
            for hook in hooks:
                hook.remove()
    fp8_linears = 7  # q, k, v, o, gate, up, down; the LM head stays BF16
    assert calls.calls == fp8_linears  # the decode step's 3 rows; the 15-row prefill is not fused
    for name in models:
        assert len(records[name]) == 2 * fp8_linears  # prefill and one decode step
        for layer, x, y in records[name]:
            _assert_near_exact(y, x, layer._fp8_qw, layer._fp8_sw, bias=layer.bias, what=f"{name}: {x.shape}")
    assert torch.equal(seq_on, seq_off) and torch.equal(seq_on, seq_emulated)
    # The logits of the three runs differ only through fp32 summation order (each linear within ~1e-5 of its
    # sum |x w| by the bound above); 1e-5 of the largest logit covers that, while FP8 itself (the same model
    # unquantized, bf16_shadow) moves the logits far more, and no greedy choice is closer than the differences.
    with bf16_shadow(models["off"]):
        _, logits_unquantized = _generate(models["off"], prompt, mask)
    tolerance = 1e-5 * float(logits_emulated.abs().max())
    for logits in (logits_on, logits_off):
        assert float((logits - logits_emulated).abs().max()) <= tolerance
    assert float((logits_unquantized - logits_emulated).abs().max()) > 100 * tolerance
    top2 = logits_emulated.topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 10 * tolerance
    for name in models:
        counts = [int(m.nonfinite_count) for m in fp8_layers(models[name])]
        assert counts == [0] * fp8_linears


@pytest.mark.skipif(not INTERPRET, reason="CPU test (compiled CUDA calls record the fused op: the tests below)")
def test_compiled_cpu_calls_stay_unfused(monkeypatch):
    """Under torch.compile on CPU the fused kernel cannot be recorded (under the interpreter wrap_triton hands back
    the raw kernel, which cannot run on the stand-in tensors), so compiled CPU calls keep calclip's unfused ops and
    equal the eager unfused layer; on CUDA they record calclip::fp8_linear_decode (the two tests below)."""
    calls = _CallCounter(monkeypatch)
    off, on = _layer_pair(256, 128, max_m=64, seed=1)
    x = _x(16, 256, torch.float32, seed=9)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(on, backend="aot_eager")
        with torch.no_grad():
            y_compiled, y_off = compiled(x), off(x)
    finally:
        torch._dynamo.reset()
    assert calls.calls == 0 and torch.equal(y_compiled, y_off)


# AOTAutograd's decomposition of a calclip op (what Inductor compiles) traced on fake CUDA tensors: runs without a
# GPU, in a fresh process because the kernels must be compiled-mode Triton functions, not the interpreter's. Prints
# the names of the Triton kernels the traced graph launches and of every other op in it.
_TRACE_OP = """
import sys
import torch
from torch._functorch.aot_autograd import aot_function
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table, triton_kernel_wrapper_functional
from torch._subclasses.fake_tensor import FakeTensorMode
import calclip.fp8.linear  # registers the ops

kernels, others = [], []
def record(gm, inputs):
    for node in gm.graph.nodes:
        if node.target is triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            kernels.append(getattr(kernel, "fn", kernel).__name__)
        elif node.op == "call_function":
            others.append(str(node.target))
    return gm

def call(x, qw, sw, bad, counter):
    return CALL

with FakeTensorMode():
    args = (torch.empty(ROWS, 576, dtype=torch.bfloat16, device="cuda"),
            torch.empty(192, 576, dtype=torch.float8_e4m3fn, device="cuda"),
            torch.empty(2, 5, device="cuda"), torch.empty((), dtype=torch.bool, device="cuda"),
            torch.zeros((), dtype=torch.int64, device="cuda"))
    try:
        with torch.no_grad():
            aot_function(call, fw_compiler=record)(*args)
    except RuntimeError as err:  # running the traced graph needs CUDA; the trace is what is checked
        print("run:", str(err).splitlines()[0], file=sys.stderr)
print("KERNELS", ",".join(kernels))
print("OTHERS", ",".join(others))
"""


def _traced_op(call: str, rows: int = 64) -> tuple[list[str], list[str]]:
    """(Triton kernels, other ops) of ``call`` (an expression of x [rows, 576], qw [192, 576], sw, bad, counter)
    traced as above."""
    pytest.importorskip("triton.backends.nvidia", reason="triton built without the NVIDIA backend")
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _TRACE_OP.replace("CALL", call).replace("ROWS", str(rows))], env=env,
                          capture_output=True, text=True, timeout=300)
    found = {}
    for line in done.stdout.splitlines():
        head, _, rest = line.partition(" ")
        found[head] = [name for name in rest.split(",") if name]
    assert done.returncode == 0 and "KERNELS" in found, done.stderr[-3000:]
    return found["KERNELS"], found["OTHERS"]


def _counting_ops(ops: list[str]) -> list[str]:
    return [op for op in ops if "add" in op or "zeros" in op or "full" in op or "isnan" in op]


@pytest.mark.slow
def test_compiled_decode_op_records_one_fused_kernel():
    """The op that compiled no-grad calls take on CUDA decomposes into exactly the fused kernel, one launch, which
    adds to the layer's counter itself: no zeroed count, no add (what the op returned and the layer added before)."""
    kernels, others = _traced_op("torch.ops.calclip.fp8_linear_decode(x, qw, sw, bad, counter, True, torch.bfloat16)")
    assert kernels == ["_fp8_linear_fused_quant_kernel"]
    assert not _counting_ops(others), others


@pytest.mark.slow
@pytest.mark.parametrize("rows, gemm, gemm_kernels", [
    (64, "auto", ["_fp8_splitk_gemm_kernel", "_splitk_reduce_kernel"]),  # decode rows: the split-K GEMM
    (300, "triton", ["_fp8_block_gemm_kernel"]),  # more than SPLITK_MAX_M rows
])
def test_compiled_no_grad_forward_counts_inside_the_quantizer(rows, gemm, gemm_kernels):
    """The unfused no-grad op (compiled decode above decode_fused_max_m, and every compiled no-grad call by
    default) is the counting 1x128 quantizer and the GEMM: the count needs no kernel of its own."""
    kernels, others = _traced_op(
        f"torch.ops.calclip.fp8_linear_infer(x, qw, sw, bad, counter, False, {gemm!r}, torch.bfloat16)", rows)
    assert kernels == ["_quantize_1x128_kernel", *gemm_kernels]
    assert not _counting_ops(others), others


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled calls fuse on CUDA only")
def test_gpu_compiled_decode_takes_the_fused_op_and_matches_eager():
    off, on = _layer_pair(576, 192, max_m=64, seed=2)
    x = _x(16, 576, torch.bfloat16, seed=10, bad_rows=((3, 7, NAN),))
    ops = []

    def backend(gm, inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes)
        from torch._inductor.compile_fx import compile_fx  # what backend="inductor" runs

        return compile_fx(gm, inputs)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(on, backend=backend)
        with torch.no_grad():
            y_eager = on(x)
            before = int(on.nonfinite_count)
            y_compiled = compiled(x)
            after = int(on.nonfinite_count)
            y_training_shape = compiled(_x(65, 576, torch.bfloat16, seed=11))  # M > 64: the unfused op
    finally:
        torch._dynamo.reset()
    assert any("fp8_linear_decode" in op for op in ops) and any("fp8_linear_infer" in op for op in ops)
    assert after == before + 1 and y_training_shape.shape == (65, 192)
    _assert_near_exact(y_compiled, x, on._fp8_qw, on._fp8_sw, bias=on.bias, what="compiled")
    _assert_near_exact(y_eager, x, on._fp8_qw, on._fp8_sw, bias=on.bias, what="eager")
