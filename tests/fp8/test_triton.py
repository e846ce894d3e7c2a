"""Triton kernels == the torch reference: scales bit for bit, FP8 codes exactly; the block GEMM vs float64.

Runs on CUDA normally. On a CPU machine it runs the same kernels under Triton's interpreter when
``TRITON_INTERPRET=1`` is set and triton is installed (small sizes); otherwise every test skips with the reason.
Under the interpreter the kernels encode e4m3fn bits in software (the interpreter's own fp8 cast truncates,
see ``calclip.fp8.kernels.numerics``' docstring); ``test_software_e4m3_encoder_equals_hardware_cast`` ties that encoder
to the GPU's cast, so interpreter results stand for GPU results.

    TRITON_INTERPRET=1 python -m pytest -q tests/fp8/test_triton.py     # CPU
    python -m pytest -q tests/fp8/test_triton.py                         # CUDA
"""

import importlib
import inspect
import os
import pkgutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None



NO_DEVICE_TESTS = {"test_kernels_compile_for_sm90_without_a_gpu", "test_autotune_timings_persist_unless_turned_off",
                   "test_no_kernel_parameter_has_a_default",
                   "test_every_config_of_a_launcher_names_the_same_meta_parameters"}


@pytest.fixture(autouse=True)
def _needs_device(request):
    """Every test but the compile check runs kernels; without a device they skip with the reason."""
    if DEVICE is None and request.node.originalname not in NO_DEVICE_TESTS:
        pytest.skip("needs CUDA, or TRITON_INTERPRET=1 to run the kernels on CPU")

from calclip.fp8 import reference as ref  # noqa: E402
from calclip.fp8 import kernels as tk  # noqa: E402
from calclip.fp8.kernels import block_gemm, launch, quantize, splitk_gemm  # noqa: E402
from calclip.fp8.config import BLOCK, FP8_DTYPE, FP8_E4M3_MAX  # noqa: E402

from _gemm_bound import assert_within_bound, exact_products, gemm_bound  # noqa: E402

NAN, INF = float("nan"), float("inf")
# GEMM: an fp32 output may differ from the float64 emulation only by accumulation order. On Hopper the FP8 MMA
# accumulates a 128-wide K block with reduced precision (~2**-14 relative, DeepSeek-V3 report), hence the GPU
# bound; the interpreter multiplies in fp32.
GEMM_FP32_RTOL = 1e-6 if INTERPRET else 3e-4
# bf16 output rounding dominates: half an ulp (2**-8 relative) on the GPU; the interpreter's fp32 -> bf16
# cast truncates (a full ulp).
GEMM_BF16_RTOL = 8e-3 if INTERPRET else 4e-3
# Hopper's FP8 MMA keeps ~14 bits of each k32 step's sum: 2**-13 of the magnitudes summed so far per step, four
# steps per 128-wide K block (tests/fp8/test_fused_decode.py derives it); none under the interpreter.
GPU_BLOCK_SUM_RTOL = 0.0 if INTERPRET else (BLOCK // 32) * 2.0**-13


def _codes_equal(q, q_ref):
    """Number of e4m3fn codes that differ, counting any two NaN codes (0x7F / 0xFF) as equal."""
    a, b = q.contiguous().view(torch.uint8), q_ref.contiguous().view(torch.uint8)
    both_nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
    return int(((a != b) & ~both_nan).sum())


def _scales_equal(s, s_ref):
    """True when every scale has the same fp32 bits (NaN == NaN)."""
    s, s_ref = s.contiguous(), s_ref.contiguous()
    same = (s.view(torch.int32) == s_ref.view(torch.int32)) | (s.isnan() & s_ref.isnan())
    return bool(same.all())


def _same_layout(t, t_ref):
    """Same strides on every dim longer than 1 (a size-1 dim's stride is meaningless)."""
    return all(a == b for a, b, n in zip(t.stride(), t_ref.stride(), t.shape) if n > 1)


def _assert_matches_reference(name, x, pow2=False):
    q, s = getattr(tk, name)(x, pow2=pow2)
    q_ref, s_ref = getattr(ref, name)(x.cpu(), pow2=pow2)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert _same_layout(q, q_ref) and _same_layout(s, s_ref), "layout differs from the reference"
    assert _scales_equal(s.cpu(), s_ref), f"{name}: scales differ"
    assert _codes_equal(q.cpu(), q_ref) == 0, f"{name}: {_codes_equal(q.cpu(), q_ref)} codes differ"


def _wide_range(shape, dtype, seed):
    """Random data over 11 decades along the last dim: blocks whose small values hit e4m3 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-8, 3, shape[-1])
    return x.to(dtype).to(DEVICE)


SHAPES_1X128 = [(1, 1), (3, 200), (2, 5, 576), (17, 128), (4, 1536)]
SHAPES_2D = [(1, 1), (200, 70), (128, 128), (300, 130), (130, 576)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES_1X128)
def test_quantize_1x128_matches_reference(shape, dtype, pow2):
    _assert_matches_reference("quantize_1x128", _wide_range(shape, dtype, seed=sum(shape)), pow2)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_quantize_128x1_matches_reference(shape, dtype, pow2):
    x = _wide_range(shape[::-1], dtype, seed=sum(shape)).t()  # wide range along dim 0, the grouped dim
    _assert_matches_reference("quantize_128x1", x.contiguous(), pow2)


_128X1_PINNED = quantize._QUANT_128X1_CONFIGS + quantize._QUANT_128X1_CANDIDATES


@pytest.mark.parametrize("config", _128X1_PINNED, ids=[f"{'-'.join(f'{k}{v}' for k, v in c.kwargs.items())}"
                                                       f"-w{c.num_warps}" for c in _128X1_PINNED])
def test_every_128x1_tile_and_grid_order_matches_reference(config):
    """Each config the autotuner may pick for the 128x1 quantizer, and each candidate, pinned (the interpreter and
    CALCLIP_TRITON_AUTOTUNE=0 launch only the default): every tile width and both grid orders (K_FIRST walks column
    tiles on grid axis 0) give the reference's codes and scales, at ragged rows and columns and on a NaN block."""
    x = _wide_range((200, 300), torch.bfloat16, seed=5).t().contiguous()  # [300, 200]: 3 row groups, 2-7 tiles
    x[140, 7] = float("nan")
    with quantize._quantize_128x1_tuned.pinned(config):  # on a GPU too: this config, not the autotuner's choice
        _assert_matches_reference("quantize_128x1", x)
        q, s = quantize.quantize_128x1(x, gemm_layout=True)
    q_ref, s_ref = ref.quantize_128x1(x.cpu())
    assert _codes_equal(q[:300].cpu(), q_ref) == 0 and not bool(q[300:].cpu().view(torch.uint8).any())
    assert _scales_equal(s.cpu(), s_ref)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_quantize_128x128_matches_reference(shape, dtype, pow2):
    _assert_matches_reference("quantize_128x128", _wide_range(shape, dtype, seed=sum(shape)), pow2)


@pytest.mark.parametrize("name", ["quantize_1x128", "quantize_128x1", "quantize_128x128"])
def test_strided_and_float64_inputs(name):
    base = _wide_range((260, 300), torch.float32, seed=1)
    _assert_matches_reference(name, base.t())  # non-contiguous view
    _assert_matches_reference(name, base[3:200:2, 5:290])  # sliced, odd strides
    _assert_matches_reference(name, base.double())  # fp64 is rounded to fp32 first


def _special_values():
    """[6, 384]: zero blocks, exact saturation, NaN/Inf blocks next to clean ones, tiny and huge amax."""
    x = torch.randn(6, 384)
    x[0, :128] = 0.0  # all-zero block: AMAX_FLOOR scale, zero codes
    x[0, 128:256] = 1e-30  # below AMAX_FLOOR: floored scale, codes from the floored scale
    x[1, 5] = NAN  # NaN block; the row's other blocks stay clean
    x[2, 130] = INF
    x[3, 300] = -INF
    x[4, :128] = 3e38  # near fp32 max: scale stays finite, codes saturate at +-448
    x[4, 7] = -3e38
    x[5, :] = torch.linspace(-1, 1, 384) * FP8_E4M3_MAX  # amax 448 exactly: scale 1, codes are the roundings
    return x


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("name", ["quantize_1x128", "quantize_128x1", "quantize_128x128"])
def test_special_values_match_reference(name, pow2):
    x = _special_values().to(DEVICE)
    _assert_matches_reference(name, x.t().contiguous() if name == "quantize_128x1" else x, pow2)


def _reference_bad_rows(x, weight_bad):
    rows = x.numel() // x.shape[-1]
    return rows if weight_bad else int((~torch.isfinite(x.float())).reshape(rows, -1).any(dim=-1).sum())


@pytest.mark.slow
@pytest.mark.parametrize("weight_bad", [False, True])
# K = 18944 (Qwen2.5-7B's down projection) and 32769 (ragged last group): rows of many chunks of groups.
@pytest.mark.parametrize("shape", [(1, 1), (3, 200), (2, 5, 576), (33, 1536), (70, 128 * 17), (3, 16384), (5, 18944),
                                   (2, 256 * 128 + 1)])
def test_quantize_1x128_counts_nonfinite_rows_in_kernel(shape, weight_bad):
    """The counting launch (the plain launch's grid of row tiles x chunks of groups) gives the plain kernel's codes
    and scales bit for bit, and adds exactly the number of rows holding a NaN/Inf (all rows when the weight is bad)
    to the counter: a row with non-finite values in several chunks counts once."""
    x = _wide_range(shape, torch.bfloat16, seed=sum(shape))
    flat = x.view(-1, shape[-1])
    g = torch.Generator().manual_seed(len(shape))
    for i in torch.randperm(flat.shape[0], generator=g)[: max(1, flat.shape[0] // 3)].tolist():
        flat[i, int(torch.randint(shape[-1], (1,), generator=g))] = [NAN, INF, -INF][i % 3]
    if flat.shape[0] > 1:
        flat[0, :] = NAN  # several bad groups in one row count once
        flat[1, -1], flat[1, shape[-1] // 2] = INF, NAN  # bad in a late chunk and a middle one, not the first
    counter = torch.full((), 5, dtype=torch.int64, device=DEVICE)  # accumulates onto what was there
    bad = torch.tensor(weight_bad, device=DEVICE)
    q, s = tk.quantize_1x128(x, nonfinite_count=counter, weight_bad=bad)
    q_plain, s_plain = tk.quantize_1x128(x)
    assert _scales_equal(s.cpu(), s_plain.cpu()) and _codes_equal(q.cpu(), q_plain.cpu()) == 0
    assert int(counter) == 5 + _reference_bad_rows(x.cpu(), weight_bad)
    tk.quantize_1x128(x, gemm_layout=True, nonfinite_count=counter)  # weight_bad defaults to False
    assert int(counter) == 5 + _reference_bad_rows(x.cpu(), weight_bad) + _reference_bad_rows(x.cpu(), False)


@pytest.mark.slow
@pytest.mark.parametrize("bad_weights", [0, 1, 3])
@pytest.mark.parametrize("shape", [(3, 200), (33, 1536), (5, 18944)])
def test_quantize_1x128_counts_for_the_linears_sharing_x(shape, bad_weights):
    """members=3 (q/k/v reading one x, calclip.fp8.shared_input), weight_bad an int32 count of their bad weights:
    the counter gets what the three linears' own counting calls would add together, and the codes are the plain
    kernel's. The torch path (quant.add_nonfinite_rows) adds the same."""
    from calclip.fp8 import quant

    x = _wide_range(shape, torch.bfloat16, seed=7 + sum(shape))
    x[0, -1], x[shape[0] // 2, 0] = NAN, INF
    x[1, :] = -INF
    bad = torch.tensor(bad_weights, dtype=torch.int32, device=DEVICE)
    counter = torch.full((), 2, dtype=torch.int64, device=DEVICE)
    q, s = tk.quantize_1x128(x, nonfinite_count=counter, weight_bad=bad, members=3)
    alone = sum(_reference_bad_rows(x.cpu(), i < bad_weights) for i in range(3))
    assert int(counter) == 2 + alone
    q_plain, s_plain = tk.quantize_1x128(x)
    assert _scales_equal(s.cpu(), s_plain.cpu()) and _codes_equal(q.cpu(), q_plain.cpu()) == 0
    torch_counter = torch.zeros((), dtype=torch.int64)
    quant.add_nonfinite_rows(torch_counter, s_plain.cpu(), bad.cpu(), 3)
    assert int(torch_counter) == alone
    with pytest.raises(ValueError, match="members must be an int >= 1"):
        tk.quantize_1x128(x, nonfinite_count=counter, weight_bad=bad, members=0)


def test_counting_needs_a_proper_counter():
    x = torch.randn(4, 256, device=DEVICE)
    with pytest.raises(ValueError, match="nonfinite_count must be an int64"):
        tk.quantize_1x128(x, nonfinite_count=torch.zeros((), dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("m,k,out_rows", [(277, 256, 288), (20, 130, 32), (300, 200, 300), (1, 128, 16)])
def test_quantize_1x128_writes_zero_tokens_up_to_out_rows(m, k, out_rows):
    """gemm.operand_rows: the 1x128 operand of a ragged token count over the rows torch._scaled_mm takes is written by
    the quantizer itself (no copy before the GEMM): bit for bit the codes and scales of x with zero rows appended
    (zero codes, an all-zero group's scale), scales column-major over out_rows; the count covers x's rows only."""
    x = _wide_range((m, k), torch.bfloat16, seed=m + k)
    x[m // 2, 3] = NAN
    padded = torch.cat([x.cpu(), torch.zeros(out_rows - m, k, dtype=x.dtype)])
    q_ref, s_ref = ref.quantize_1x128(padded)
    nb = -(-k // BLOCK)
    for weight_bad in (False, True):
        counter = torch.full((), 3, dtype=torch.int64, device=DEVICE)
        q, s = tk.quantize_1x128(x, gemm_layout=True, nonfinite_count=counter,
                                 weight_bad=torch.tensor(weight_bad, device=DEVICE), out_rows=out_rows)
        assert q.shape == (out_rows, k) and q.is_contiguous() and s.shape == (out_rows, nb)
        assert s.stride() == (1, out_rows) or nb == 1
        assert _scales_equal(s.cpu(), s_ref) and _codes_equal(q.cpu(), q_ref) == 0
        assert not q[m:].cpu().view(torch.uint8).any()
        assert int(counter) == 3 + _reference_bad_rows(x.cpu(), weight_bad)
    q, s = tk.quantize_1x128(x, out_rows=out_rows)  # the reference's layout: scales row-major
    assert s.is_contiguous() and _scales_equal(s.cpu(), s_ref) and _codes_equal(q.cpu(), q_ref) == 0
    q, s = tk.quantize_1x128(x, pow2=True, out_rows=out_rows)  # the zero tokens' scale rounded as a zero group's
    q2_ref, s2_ref = ref.quantize_1x128(padded, pow2=True)
    assert _scales_equal(s.cpu(), s2_ref) and _codes_equal(q.cpu(), q2_ref) == 0
    with pytest.raises(ValueError, match="out_rows must satisfy"):
        tk.quantize_1x128(x, out_rows=m - 1)
    with pytest.raises(ValueError, match="needs a 2-D tensor"):
        tk.quantize_1x128(x.view(1, m, k), out_rows=out_rows)


def _assert_zero_padded(q, m):
    """128x1 codes in the wgrad GEMM's layout: [ceil(m/128)*128, K], column-major, rows >= m all code 0x00 (not NaN,
    even in a column whose last group is non-finite)."""
    assert q.shape[0] == -(-m // BLOCK) * BLOCK and q.stride() == (1, q.shape[0]), (tuple(q.shape), q.stride())
    assert not q[m:].cpu().view(torch.uint8).any(), "padding rows hold non-zero codes"


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("name", ["quantize_1x128", "quantize_128x1"])
def test_gemm_layout_changes_strides_only(name, pow2):
    x = _wide_range((300, 260), torch.bfloat16, seed=7)
    q, s = getattr(tk, name)(x, pow2=pow2, gemm_layout=True)
    q_ref, s_ref = getattr(ref, name)(x.cpu(), pow2=pow2)
    want = s_ref.t().contiguous().t() if name == "quantize_1x128" else s_ref.contiguous()
    if name == "quantize_128x1":  # 300 tokens -> 384 code rows, zero past 300
        _assert_zero_padded(q, 300)
        q_ref = ref.pad_128x1_codes(q_ref)
    assert _same_layout(s, want) and _same_layout(q, q_ref)
    assert _scales_equal(s.cpu(), s_ref) and _codes_equal(q.cpu(), q_ref) == 0


@pytest.mark.parametrize("tokens", [1, 77, 200, 256])
def test_wgrad_over_padded_token_rows_equals_the_ragged_contraction(tokens):
    """dW = Q128x1(dy)^T Q128x1(x) from the gemm_layout codes (token rows padded with zero codes, so the GEMM's K is
    a multiple of 128) is the ragged contraction's result bit for bit: both dot products see the same values in every
    K block (a masked load's 0 or a stored zero code)."""
    gen = torch.Generator().manual_seed(tokens)
    dy = (torch.randn(tokens, 192, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    ragged = [tk.quantize_128x1(t) for t in (dy, x)]
    padded = [tk.quantize_128x1(t, gemm_layout=True) for t in (dy, x)]
    for q, _ in padded:
        _assert_zero_padded(q, tokens)

    def wgrad(operands, out_dtype):
        (qdy, sdy), (qx, sx) = operands
        return tk.fp8_block_gemm_triton(qdy.t(), sdy.t(), qx.t(), sx.t(), out_dtype=out_dtype)

    for out_dtype in (torch.float32, torch.bfloat16):
        want = wgrad(ragged, out_dtype)
        got = wgrad(padded, out_dtype)
        assert got.shape == (192, 256) and torch.equal(got, want), out_dtype
    # Against the exact contraction (float64 from the codes): within the summation bound, which on a GPU includes
    # the FP8 MMA's reduced block-sum precision (a fixed rtol of 1e-5 failed there at 77+ tokens; 1 token passed).
    dyd, xd = (q.cpu().double() * s.cpu().double().repeat_interleave(BLOCK, dim=0)[:tokens] for q, s in ragged)
    exact, abs_sum = dyd.t() @ xd, dyd.abs().t() @ xd.abs()
    for out_dtype in (torch.float32, torch.bfloat16):
        bound = gemm_bound(abs_sum, exact.abs(), tokens, out_dtype, truncating=INTERPRET, extra_rtol=GPU_BLOCK_SUM_RTOL)
        assert_within_bound(wgrad(padded, out_dtype), exact, bound, f"wgrad {out_dtype}")


def test_nonfinite_policy_nan_block_only():
    q, s = tk.quantize_1x128(_special_values().to(DEVICE))
    s = s.cpu()
    assert s[1, 0].isnan() and s[2, 1].isnan() and s[3, 2].isnan()
    assert torch.isfinite(s[1, 1:]).all() and torch.isfinite(s[2, [0, 2]]).all() and (s[0, 0] > 0)
    assert q.cpu()[1, :128].float().isnan().all() and not q.cpu()[1, 128:].float().isnan().any()


def test_every_e4m3_value_and_midpoint_rounds_to_nearest_even():
    # amax 448 gives scale 1, so codes are the e4m3 rounding of x itself; every representable magnitude and
    # every midpoint between neighbours (ties go to the even mantissa), both signs, subnormals included.
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448, all finite codes
    mids = (values[:-1] + values[1:]) / 2
    nudged = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])  # just off the ties
    allv = torch.cat([values, mids, nudged])
    allv = torch.cat([allv, -allv])
    rows = -(-allv.numel() // (BLOCK - 1))
    body = torch.zeros(rows * (BLOCK - 1))
    body[: allv.numel()] = allv
    x = torch.cat([torch.full((rows, 1), FP8_E4M3_MAX), body.reshape(rows, BLOCK - 1)], dim=1)
    _assert_matches_reference("quantize_1x128", x.to(DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="compares the software encoder with the GPU's hardware cast")
def test_software_e4m3_encoder_equals_hardware_cast():
    # The interpreter path (SOFT_FP8=True) must equal the hardware cvt.rn.satfinite path bit for bit.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=g) * torch.logspace(-12, 4, 1024)
    x[0, :7] = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 1e-45, FP8_E4M3_MAX])
    x = x.cuda()
    k = x.shape[1]
    q_hw, s_hw = tk.quantize_1x128(x)
    q_sw = torch.empty_like(q_hw)
    s_sw = torch.empty_like(s_hw)
    quantize._quantize_1x128_kernel[(x.shape[0] // 16, 2)](
        x, q_sw.view(torch.uint8), s_sw, x.shape[0], k, k // BLOCK, x.stride(0), s_sw.stride(0), 1, 0,
        s_sw, s_sw,  # count_ptr, weight_bad_ptr: unused with COUNT=False
        POW2=False, SOFT_FP8=True, COUNT=False, BLOCK_R=16, GROUPS=4, GROUP=BLOCK, MEMBERS=1, DIV_FREE=False)
    assert _scales_equal(s_sw, s_hw)
    assert _codes_equal(q_sw, q_hw) == 0


def test_empty_and_rejected_inputs():
    q, s = tk.quantize_1x128(torch.zeros(0, 300, device=DEVICE))
    assert q.shape == (0, 300) and s.shape == (0, 3)
    q, s = tk.quantize_128x128(torch.zeros(5, 0, device=DEVICE))
    assert q.shape == (5, 0) and s.shape == (1, 0)
    with pytest.raises(ValueError, match="block=128"):
        tk.quantize_1x128(torch.zeros(2, 64, device=DEVICE), block=64)
    with pytest.raises(ValueError, match="2-D"):
        tk.quantize_128x128(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        tk.quantize_128x1(torch.zeros(2, 3, 4, device=DEVICE))
    q, s = tk.quantize_128x1(torch.zeros(0, 300, device=DEVICE))
    assert q.shape == (0, 300) and s.shape == (0, 300)
    with pytest.raises(TypeError):
        tk.quantize_1x128(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------------------
# Block GEMM
# ---------------------------------------------------------------------------------------------------------

GEMM_SHAPES = [(1, 1, 1), (64, 64, 128), (100, 130, 200), (129, 257, 576), (5, 300, 70), (256, 192, 640)]


def _gemm_operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.02
    dy = torch.randn(m, n, generator=g) * 1e-3
    return x, w, dy


def _rel_err(y, y_ref):
    return ((y.double().cpu() - y_ref).norm() / y_ref.norm().clamp_min(1e-300)).item()


@pytest.mark.slow
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_three_recipe_layouts_vs_float64(m, n, k):
    x, w, dy = _gemm_operands(m, n, k, seed=m + n + k)
    qx, sx = ref.quantize_1x128(x)
    qw, sw = ref.quantize_128x128(w)
    qdy, sdy = ref.quantize_1x128(dy)
    qdy_t, sdy_t = ref.quantize_128x1(dy)
    qx_t, sx_t = ref.quantize_128x1(x)
    xd, wd = ref.dequantize_1x128(qx, sx).double(), ref.dequantize_128x128(qw, sw).double()
    dyd = ref.dequantize_1x128(qdy, sdy).double()
    dy_t, x_t = ref.dequantize_128x1(qdy_t, sdy_t).double(), ref.dequantize_128x1(qx_t, sx_t).double()
    cases = {
        "forward": ((qx, sx, qw, sw), xd @ wd.t()),
        "dgrad": ((qdy, sdy, qw.t(), sw.t()), dyd @ wd),
        "wgrad": ((qdy_t.t(), sdy_t.t(), qx_t.t(), sx_t.t()), dy_t.t() @ x_t),
    }
    for name, (operands, y_ref) in cases.items():
        operands = [t.to(DEVICE) for t in operands]
        y = tk.fp8_block_gemm_triton(*operands, out_dtype=torch.float32)
        assert y.shape == y_ref.shape and y.dtype == torch.float32 and y.is_contiguous()
        assert _rel_err(y, y_ref) < GEMM_FP32_RTOL, f"{name}: rel err {_rel_err(y, y_ref):.2e}"
        y16 = tk.fp8_block_gemm_triton(*operands, out_dtype=torch.bfloat16)
        assert y16.dtype == torch.bfloat16 and _rel_err(y16, y_ref) < GEMM_BF16_RTOL, name


def test_gemm_nan_scale_poisons_only_its_rows_and_columns():
    x, w, _ = _gemm_operands(130, 140, 300, seed=3)
    x[7, 200] = NAN  # row 7, K block 1
    w[135, 10] = INF  # weight block row 1 (rows 128..139), K block 0
    qx, sx = ref.quantize_1x128(x)
    qw, sw = ref.quantize_128x128(w)
    y = tk.fp8_block_gemm_triton(qx.to(DEVICE), sx.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE),
                                 out_dtype=torch.float32).cpu()
    bad = torch.zeros_like(y, dtype=torch.bool)
    bad[7, :] = True
    bad[:, 128:] = True
    assert y[bad].isnan().all() and torch.isfinite(y[~bad]).all()


def _small_gemm_operands():
    """Zero codes qa [4, 256] (1x128 scales), qb [256, 256] (128x128 scales), unit scales."""
    return (torch.zeros(4, 256, dtype=FP8_DTYPE, device=DEVICE), torch.ones(4, 2, device=DEVICE),
            torch.zeros(256, 256, dtype=FP8_DTYPE, device=DEVICE), torch.ones(2, 2, device=DEVICE))


def test_gemm_rejects_bad_operands():
    qa, sa, qb, sb = _small_gemm_operands()
    with pytest.raises(ValueError, match="sb"):
        tk.fp8_block_gemm_triton(qa, sa, qb, torch.ones(3, 2, device=DEVICE), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="qa"):
        tk.fp8_block_gemm_triton(qa, sa, qb[:, :128], sb[:, :1], out_dtype=torch.float32)
    with pytest.raises(TypeError):
        tk.fp8_block_gemm_triton(qa.float(), sa, qb, sb, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        tk.fp8_block_gemm_triton(qa, sa, qb, sb, out_dtype=torch.int32)
    y = tk.fp8_block_gemm_triton(qa[:0], sa[:0], qb, sb, out_dtype=torch.bfloat16)
    assert y.shape == (0, 256)


SPLITK_SHAPES = [(1, 128, 128, None), (5, 200, 640, None), (64, 256, 1024, 4), (3, 130, 300, 2), (70, 64, 512, 3),
                 (16, 96, 1280, 16)]


@pytest.mark.parametrize("m,n,k,split", SPLITK_SHAPES)
def test_splitk_gemm_matches_the_unfused_gemm_and_float64(m, n, k, split):
    """The split-K GEMM (decode rows) is the unfused GEMM's math: the same K step, the partial sums of the K ranges
    added in a fixed order; any split, ragged K and N, splits that do not divide the K blocks, bf16 and fp32 out.

    Claim: split-K and unfused outputs both within the fp32 accumulation bound of the float64 product of the same
    codes (tests/fp8/_gemm_bound.py), not bit for bit: even with one K range the two kernels' tiles differ, and
    under the interpreter the BLAS sums a tile in an order that depends on its shape and on the CPU. Bit for bit
    only between two runs of the split-K kernel itself (no atomics: deterministic)."""
    x, w, _ = _gemm_operands(m, n, k, seed=m * n + k)
    qx, sx = ref.quantize_1x128(x)
    qw, sw = ref.quantize_128x128(w)
    exact, abs_sum = exact_products(qx, sx, qw, sw)
    operands = [t.to(DEVICE) for t in (qx, sx, qw, sw)]
    y = tk.fp8_splitk_gemm_triton(*operands, out_dtype=torch.float32, split=split)
    assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
    unfused = tk.fp8_block_gemm_triton(*operands, out_dtype=torch.float32)
    for out_dtype in (torch.float32, torch.bfloat16):
        bound = gemm_bound(abs_sum, exact.abs(), k, out_dtype, truncating=INTERPRET, extra_rtol=GPU_BLOCK_SUM_RTOL)
        if out_dtype == torch.float32:
            results = {"split-K": y, "unfused": unfused}
        else:
            results = {"split-K bf16": tk.fp8_splitk_gemm_triton(*operands, out_dtype=out_dtype, split=split)}
            assert results["split-K bf16"].dtype == torch.bfloat16
        for name, result in results.items():
            assert_within_bound(result, exact, bound, name)
    again = tk.fp8_splitk_gemm_triton(*operands, out_dtype=torch.float32, split=split)
    assert torch.equal(y, again)  # deterministic: no atomics


def test_splitk_gemm_strided_operands_and_nan_scales():
    x, w, _ = _gemm_operands(9, 140, 300, seed=5)
    x[4, 200] = NAN  # row 4, K block 1
    w[135, 10] = INF  # weight block row 1 (columns 128..139 of y), K block 0
    qx, sx = ref.quantize_1x128(x)
    qw, sw = ref.quantize_128x128(w)
    qx, sx = qx.to(DEVICE), sx.t().contiguous().t().to(DEVICE)  # column-major scales (the layer's gemm layout)
    qw_t = qw.t().contiguous().to(DEVICE)  # W stored [K, N]: qw_t.t() is a strided [N, K] view
    y = tk.fp8_splitk_gemm_triton(qx, sx, qw_t.t(), sw.to(DEVICE), out_dtype=torch.float32, split=3).cpu()
    bad = torch.zeros_like(y, dtype=torch.bool)
    bad[4, :] = True
    bad[:, 128:] = True
    assert y[bad].isnan().all() and torch.isfinite(y[~bad]).all()
    clean = tk.fp8_block_gemm_triton(qx, sx, qw.to(DEVICE), sw.to(DEVICE), out_dtype=torch.float32).cpu()
    assert ((y[~bad] - clean[~bad]).abs() <= 1e-5 * clean[~bad].abs() + 1e-6).all()


def test_splitk_splits_fill_the_device_and_keep_two_k_blocks_per_range():
    # decode on a 132-SM H200: N=2048 has 32 tiles of 64 x 64 at M=64 -> 4 ranges (128 programs); N=8192: 128 tiles
    assert tk.splitk_splits(64, 2048, 2048, 132) == 4
    assert tk.splitk_splits(64, 2048, 8192, 132) == 4
    assert tk.splitk_splits(64, 8192, 2048, 132) == 1
    assert tk.splitk_splits(1, 576, 1536, 132) == 4  # 9 tiles, 12 K blocks: 3 per range (8 ranges would give 1-2)
    assert tk.splitk_splits(1, 576, 384, 132) == 1  # 3 K blocks: two ranges would leave one block in one of them
    assert tk.splitk_splits(1, 64, 128 * 1000, 132) == tk.SPLITK_MAX_SPLIT
    assert tk.splitk_splits(256, 2048, 2048, 132) == 1


def test_splitk_gemm_rejects_bad_operands():
    qa, sa, qb, sb = _small_gemm_operands()
    with pytest.raises(ValueError, match="sb"):
        tk.fp8_splitk_gemm_triton(qa, sa, qb, torch.ones(256, 2, device=DEVICE), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="sa"):
        tk.fp8_splitk_gemm_triton(qa, torch.ones(1, 2, device=DEVICE), qb, sb, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="split"):
        tk.fp8_splitk_gemm_triton(qa, sa, qb, sb, out_dtype=torch.float32, split=0)
    with pytest.raises(TypeError):
        tk.fp8_splitk_gemm_triton(qa.float(), sa, qb, sb, out_dtype=torch.float32)
    assert tk.fp8_splitk_gemm_triton(qa[:0], sa[:0], qb, sb, out_dtype=torch.bfloat16).shape == (0, 256)
    assert not tk.fp8_splitk_gemm_triton(qa[:, :0], sa[:, :0], qb[:, :0], sb[:, :0],
                                         out_dtype=torch.float32).any()


def test_autotune_timings_persist_unless_turned_off(monkeypatch):
    """Every calclip autotuner keeps its timings in Triton's disk cache (a second process on the machine skips the
    timing runs); CALCLIP_TRITON_AUTOTUNE_CACHE=0 turns that off. (Triton itself ignores cache_results under the
    interpreter, so the flag handed to triton.autotune is what is checked here.)"""
    seen = []
    real = launch.triton.autotune

    def recording_autotune(*args, **kwargs):
        # only the autotuner that times every config; with CALCLIP_TRITON_AUTOTUNE=0 _Tuned also builds a
        # one-config autotuner for torch.compile's tracing, which times nothing
        if kwargs.get("configs") is block_gemm._GEMM_CONFIGS:
            seen.append(kwargs.get("cache_results"))
        return real(*args, **kwargs)

    monkeypatch.setattr(launch.triton, "autotune", recording_autotune)
    launch._Tuned(block_gemm._fp8_block_gemm_kernel, block_gemm._GEMM_CONFIGS, key=["M_BUCKET", "N", "K"])
    monkeypatch.setenv("CALCLIP_TRITON_AUTOTUNE_CACHE", "0")
    launch._Tuned(block_gemm._fp8_block_gemm_kernel, block_gemm._GEMM_CONFIGS, key=["M_BUCKET", "N", "K"])
    assert seen == [True, False]


def _kernel_modules():
    return [importlib.import_module(f"calclip.fp8.kernels.{m.name}") for m in pkgutil.iter_modules(tk.__path__)]


def test_no_kernel_parameter_has_a_default():
    """A kernel parameter with a default breaks the GPU paths the interpreter does not take: Inductor launches a user
    kernel inside a compiled graph with exactly the arguments the launch and the config name, and the fast launch
    binds the constexprs by name from the same two. On an H100 (2026-12-06) the defaulted DIV_FREE failed every
    compiled FP8 layer (Inductor: ``launcher() missing 1 required positional argument``) and every eager launch
    with autotuning off (KeyError 'DIV_FREE'), while the CPU tests passed."""
    kernels = {f"{m.__name__}.{n}": k for m in _kernel_modules() for n, k in vars(m).items()
               if isinstance(k, triton.runtime.jit.KernelInterface)}  # the interpreter's too
    assert "calclip.fp8.kernels.quantize._quantize_128x1_kernel" in kernels
    defaulted = {name: [p.name for p in inspect.signature(k.fn).parameters.values() if p.default is not p.empty]
                 for name, k in kernels.items()}
    assert {name: ps for name, ps in defaulted.items() if ps} == {}


def test_every_config_of_a_launcher_names_the_same_meta_parameters():
    """Each autotune table's configs set the same meta-parameters (a twin that adds one, such as DIV_FREE, has its
    siblings name it too): whichever config the autotuner, the default or torch.compile's trace picks, the kernel gets
    every constexpr it declares."""
    tables = {f"{m.__name__}.{n}": t for m in _kernel_modules() for n, t in vars(m).items()
              if isinstance(t, launch._Tuned)}
    assert "calclip.fp8.kernels.quantize._quantize_128x1_tuned" in tables
    for name, tuned in tables.items():
        assert len({frozenset(c.kwargs) for c in tuned.autotuner.configs}) == 1, name
        assert tuned.traced.configs[0].kwargs == tuned.default.kwargs, name


@pytest.mark.skipif(INTERPRET, reason="the interpreter does not compile")
def test_kernels_compile_for_sm90_without_a_gpu():
    """Compile every kernel to sm_90 cubin (triton ships ptxas): catches Triton-only errors (e.g. non-constexpr
    globals), which the interpreter accepts, on CPU-only machines; checks the hot paths use the instructions
    the design relies on."""
    pytest.importorskip("triton.backends.nvidia", reason="triton built without the NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_ptx(fn, types, constexprs, config):
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t != "i32"}
        constexprs = {**constexprs, **config.kwargs}
        signature = {**types, **{n: "constexpr" for n in constexprs}}
        signature = {n: signature[n] for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    i32 = "i32"
    quant = {"POW2": True, "SOFT_FP8": False, "GROUP": BLOCK}
    plain_extra = {"count_ptr": "*fp32", "weight_bad_ptr": "*fp32"}  # unused when COUNT=False
    ptx = compile_ptx(quantize._quantize_1x128_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                      "R": i32, "K": i32, "NB": i32, "stride_xr": i32, "stride_sr": i32,
                      "stride_sg": i32, "R_BUCKET": i32, **plain_extra}, {**quant, "COUNT": False, "MEMBERS": 1},
                      quantize._QUANT_1X128_DEFAULT)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx
    count_types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "R": i32, "K": i32,
                   "NB": i32, "stride_xr": i32, "stride_sr": i32, "stride_sg": i32, "R_BUCKET": i32,
                   "count_ptr": "*i64", "weight_bad_ptr": "*i1"}
    # the counting launch: the plain table's tiles, plus the rare re-read of earlier groups and the atomic add; no
    # config may spill registers (the whole-row tiles it replaced did, at K = 18944)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    # (and the shared-input count: MEMBERS linears, an int32 number of bad weights; calclip.fp8.shared_input)
    shared_types = {**count_types, "weight_bad_ptr": "*i32"}
    for config in quantize._QUANT_1X128_COUNT_CONFIGS:
        for pow2, members in ((False, 1), (True, 1), (False, 3), (True, 2)):
            ptx = compile_ptx(quantize._quantize_1x128_kernel, count_types if members == 1 else shared_types,
                              {**quant, "POW2": pow2, "COUNT": True, "MEMBERS": members}, config)
            assert "atom.global" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
            if ptxas.exists():
                with tempfile.TemporaryDirectory() as tmp:
                    (Path(tmp) / "k.ptx").write_text(ptx)
                    info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(Path(tmp) / "k.ptx"), "-o",
                                           str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                                          check=True).stderr
                assert " 0 bytes spill stores" in info, (config, info)
    compile_ptx(quantize._quantize_128x1_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": i32,
                "K": i32, "M_CODES": i32, "stride_xm": i32, "stride_xk": i32, "stride_sb": i32, "stride_sk": i32,
                "M_BUCKET": i32},
                quant, quantize._QUANT_128X1_DEFAULT)
    compile_ptx(quantize._quantize_128x128_kernel, {"w_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "N": i32,
                "K": i32, "NBK": i32, "stride_wn": i32, "stride_wk": i32}, quant, quantize._QUANT_128X128_DEFAULT)
    requant_types = {"w_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "bad_ptr": "*u8", "N": i32, "K": i32,
                     "NBK": i32, "stride_wn": i32, "stride_wk": i32}
    ptx = compile_ptx(quantize._requantize_128x128_kernel, requant_types, quant,
                      quantize._QUANT_128X128_DEFAULT)  # refresh
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ptx.count("st.global") > 0
    soft = compile_ptx(quantize._quantize_1x128_kernel, {"x_ptr": "*fp16", "q_ptr": "*u8", "s_ptr": "*fp32", "R": i32,
                       "K": i32, "NB": i32, "stride_xr": i32, "stride_sr": i32, "stride_sg": i32,
                       "R_BUCKET": i32, **plain_extra}, {**quant, "SOFT_FP8": True, "COUNT": False, "MEMBERS": 1},
                       quantize._QUANT_1X128_DEFAULT)
    assert "e4m3x2" not in soft
    gemm_types = {n: ("*fp8e4nv" if n in ("a_ptr", "b_ptr") else "*bf16" if n == "c_ptr" else "*fp32"
                      if n.endswith("_ptr") else i32) for n in block_gemm._fp8_block_gemm_kernel.arg_names[:19]}
    for b_rows in (BLOCK, 1):
        ptx = compile_ptx(block_gemm._fp8_block_gemm_kernel, gemm_types, {"A_SCALE_ROWS": 1, "B_SCALE_ROWS": b_rows,
                          "INTERPRET": False, "BLOCK_K": BLOCK}, block_gemm._GEMM_DEFAULT)
        assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx  # Hopper FP8 tensor cores
    splitk_types = {n: ("*fp8e4nv" if n in ("a_ptr", "b_ptr") else "*bf16" if n == "c_ptr" else "*fp32"
                        if n.endswith("_ptr") else i32) for n in splitk_gemm._fp8_splitk_gemm_kernel.arg_names[:21]}
    for split in (1, 4):  # every config: BLOCK_M 64 keeps the FP8 wgmma the unfused GEMM runs
        for config in splitk_gemm._SPLITK_CONFIGS:
            ptx = compile_ptx(splitk_gemm._fp8_splitk_gemm_kernel, splitk_types, {"SPLIT": split, "INTERPRET": False,
                              "BLOCK_K": BLOCK}, config)
            assert "wgmma.mma_async" in ptx and "e4m3.e4m3" in ptx, (split, config)
    ptx = compile_ptx(splitk_gemm._splitk_reduce_kernel, {"p_ptr": "*fp32", "c_ptr": "*bf16", "MN": i32}, {"SPLIT": 4},
                      splitk_gemm._REDUCE_CONFIG)
    assert "atom" not in ptx  # a fixed-order sum: deterministic


def test_launch_hook_passes_only_hooks_with_something_to_call():
    """_fast_launch hands Triton's C launcher None for an empty HookChain (Triton 3.6 keeps one even when no hook
    was set: building launch metadata and calling two empty chains per launch is host time for nothing), and every
    hook that can do something as it is."""
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.HookChain()
    assert launch._launch_hook(None) is None
    assert launch._launch_hook(chain) is None
    seen = []
    chain.add(seen.append)
    assert launch._launch_hook(chain) is chain
    chain(1)
    assert seen == [1]

    def plain(metadata):  # a bare callable (how older Triton releases took a hook)
        return None

    assert launch._launch_hook(plain) is plain


def test_launch_key_keys_scalars_by_type_and_value_and_refuses_other_arguments_by_name():
    """The direct launch's cache key: an fp32 scalar is keyed by value and type (1.0 and 1 are different kernels;
    a float once crashed every ragged-token forward on the H100), tensors by dtype and alignment, and an argument
    it cannot key is refused with the kernel parameter's name."""
    kernel = quantize._zero_token_rows_kernel
    q, config = torch.zeros(4, 4), {}  # (the key holds the config dict's identity: one per chosen config)

    def key(*tail, s=q):
        return launch._launch_key(kernel, 0, (q, s, 1, 2, 3, 4, 5, *tail), {"BLOCK_K": 8}, config)

    assert key(1.0) == key(1.0) and key(1.0) != key(1) and key(1.0) != key(2.0)
    assert key(1.0) != key(1.0, s=q.to(torch.bfloat16))
    with pytest.raises(TypeError, match=r"argument 7 \(SCALE\) is a str"):
        key("1.0")


def test_fast_launch_runs_each_config_its_own_kernel_when_config_dicts_come_and_go(monkeypatch):
    """A config pinned per call (tests that monkeypatch _Tuned._default_launch, a sweep forcing configs) hands
    the direct launch a new kwargs dict each time; CPython reuses a freed dict's address at once, and the cache key
    holds the dict's id. Until 2026-12-06 the cache did not keep the dict alive, so the second config found the
    first config's compiled kernel under its own key and launched it: on a GPU every config after the first of such
    a sweep or test ran the first one's kernel. Here a fake kernel records how each launch ran and with which CHUNK."""
    ran = []

    class Compiled:
        function = packed_metadata = None

        def run(self, *launch_args):  # (grid x3, stream, function, metadata x2, hooks x2, *args, *constexprs)
            ran.append(("direct", launch_args[-1]))

    class Kernel:
        __name__ = "fake_kernel"
        arg_names = ["x_ptr", "N", "CHUNK"]  # the arguments, then the constexprs, as in calclip's kernels

        def run(self, *args, grid, warmup, **kwargs):  # Triton's JITFunction.run: compiles, then launches
            ran.append(("compiled", kwargs["CHUNK"]))
            return Compiled()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(launch, "_compiled_launches", {})
    kernel, x = Kernel(), torch.zeros(4)
    configs = [triton.Config({"CHUNK": chunk}, num_warps=8) for chunk in (32, 64)]
    for _ in range(5):
        for config in configs:
            launch._fast_launch(kernel, (1,), (x, 4), {}, config.all_kwargs())  # a new dict per launch, then dropped
    assert [chunk for _, chunk in ran] == [32, 64] * 5  # before the fix: [32, 32, 32, ...]
    kept = configs[1].all_kwargs()  # a dict that lives, as _Tuned's do: compiled once, then the direct path
    ran.clear()
    for _ in range(3):
        launch._fast_launch(kernel, (1,), (x, 4), {}, kept)
    assert ran == [("compiled", 64), ("direct", 64), ("direct", 64)]


def _garbage_buffers(n, k, transposed):
    """Code/scale/flag buffers holding stale values (a previous weight's), on the test device."""
    nbn, nbk = -(-n // BLOCK), -(-k // BLOCK)
    q = torch.full((n, k), 3.0).to(FP8_DTYPE).to(DEVICE)
    s = torch.full((nbn, nbk), 7.0, device=DEVICE)
    bad = torch.ones((), dtype=torch.bool, device=DEVICE)  # stale "non-finite" flag: must be cleared
    qt = torch.full((k, n), -2.0).to(FP8_DTYPE).to(DEVICE) if transposed else None
    st = torch.full((nbk, nbn), 5.0, device=DEVICE) if transposed else None
    return q, s, bad, qt, st


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (200, 70), (128, 256), (300, 130)])
def test_requantize_128x128_in_place_matches_reference(shape, dtype, pow2, transposed):
    """The weight refresh writes quantize_128x128's codes and scales into the existing buffers (same
    storage), W^T's when asked (q.t() / s.t(), contiguous), clears a stale non-finite flag, and bumps every
    buffer's autograd version as copy_ would."""
    w = _wide_range(shape, dtype, seed=sum(shape) + 1)
    q, s, bad, qt, st = _garbage_buffers(*shape, transposed)
    buffers = [t for t in (q, s, qt, st) if t is not None]
    ptrs, versions = [t.data_ptr() for t in buffers], [t._version for t in buffers]
    tk.requantize_128x128_(w, q, s, bad, qt=qt, st=st, pow2=pow2)
    q_ref, s_ref = ref.quantize_128x128(w.cpu(), pow2=pow2)
    assert _scales_equal(s.cpu(), s_ref) and _codes_equal(q.cpu(), q_ref) == 0
    assert not bool(bad)
    if transposed:
        assert qt.is_contiguous() and st.is_contiguous()
        assert _scales_equal(st.cpu(), s_ref.t()) and _codes_equal(qt.cpu(), q_ref.t()) == 0
    assert [t.data_ptr() for t in buffers] == ptrs
    assert all(t._version > v for t, v in zip(buffers, versions))


@pytest.mark.parametrize("transposed", [False, True])
def test_requantize_128x128_flags_nonfinite_blocks_and_takes_strided_weights(transposed):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(160, 300, generator=g)).to(DEVICE)
    w[140, 260] = NAN  # block (1, 2): every code NaN, scale NaN
    w[3, 5] = INF      # block (0, 0)
    wt = w.t().contiguous().t()  # the same values, column-major
    q, s, bad, qt, st = _garbage_buffers(160, 300, transposed)
    bad.zero_()  # the flag must be set, not merely left as it was
    tk.requantize_128x128_(wt, q, s, bad, qt=qt, st=st)
    q_ref, s_ref = ref.quantize_128x128(w.cpu())
    assert bool(bad) and int(s_ref.isnan().sum()) == 2
    assert _scales_equal(s.cpu(), s_ref) and _codes_equal(q.cpu(), q_ref) == 0
    if transposed:
        assert _scales_equal(st.cpu(), s_ref.t()) and _codes_equal(qt.cpu(), q_ref.t()) == 0
    w[140, 260], w[3, 5] = 0.5, -0.5  # finite again: the next refresh clears the flag
    tk.requantize_128x128_(w, q, s, bad, qt=qt, st=st)
    assert not bool(bad) and not bool(s.isnan().any())


def test_requantize_128x128_rejects_buffers_it_cannot_fill():
    w = torch.randn(130, 256, device=DEVICE)
    q, s, bad, qt, st = _garbage_buffers(130, 256, True)
    with pytest.raises(ValueError, match="qt and st"):
        tk.requantize_128x128_(w, q, s, bad, qt=qt)
    with pytest.raises(ValueError, match=r"s must be a contiguous torch.float32 \[2, 2\]"):
        tk.requantize_128x128_(w, q, s[:1], bad)
    with pytest.raises(ValueError, match="qt must be a contiguous"):
        tk.requantize_128x128_(w, q, s, bad, qt=qt.t().contiguous().t(), st=st)
    with pytest.raises(ValueError, match="bad must be"):
        tk.requantize_128x128_(w, q, s, torch.zeros(1, dtype=torch.bool, device=DEVICE))
