"""Reference block quantizers against hand-worked blocks, and the emulated block GEMM against float64."""

import math

import pytest
import torch

from calclip.fp8 import gemm, quant
from calclip.fp8.config import FP8_E4M3_MAX, Fp8Config
from calclip.fp8.reference import (
    AMAX_FLOOR,
    dequantize_1x128,
    dequantize_128x1,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x1,
    quantize_128x128,
    round_scale_up_to_pow2,
)

NAN, INF = float("nan"), float("inf")


def test_hand_worked_block_exact_codes():
    # amax 4 -> s = 4/448 = 1/112; x / s = 112 x: 1 -> 112, -2 -> -224, 0.5 -> 56, 4 -> 448 (all e4m3 values);
    # 0.3 -> 33.6, between e4m3 neighbours 32 and 36 (step 4 in [32, 64)): nearest is 32.
    x = torch.zeros(1, 128)
    x[0, :5] = torch.tensor([1.0, -2.0, 0.5, 4.0, 0.3])
    q, s = quantize_1x128(x)
    assert s.shape == (1, 1) and s.dtype == torch.float32
    assert s.item() == torch.tensor(4.0) / FP8_E4M3_MAX  # fp32 division, bit-exact
    assert q[0, :5].float().tolist() == [112.0, -224.0, 56.0, 448.0, 32.0]
    assert torch.all(q[0, 5:].float() == 0)


def test_round_to_nearest_even_ties():
    # amax 448 -> s = 1 exactly, so codes are the e4m3 rounding of x itself. 34 is halfway between 32
    # (mantissa 000) and 36 (001): ties-to-even gives 32; 38 between 36 (001) and 40 (010) gives 40.
    x = torch.tensor([[448.0, 34.0, 38.0, -34.0, 0.0] + [0.0] * 123])
    q, s = quantize_1x128(x)
    assert s.item() == 1.0
    assert q[0, :4].float().tolist() == [448.0, 32.0, 40.0, -32.0]


def test_ragged_edges_use_real_elements_only():
    x = torch.zeros(2, 200)  # blocks [0, 128) and [128, 200): the second has 72 real elements
    x[:, 0] = 1.0
    x[0, 199] = -7.0
    x[1, 130] = 3.5
    q, s = quantize_1x128(x)
    assert s.shape == (2, 2)
    assert s[0, 1].item() == torch.tensor(7.0) / FP8_E4M3_MAX and s[1, 1].item() == torch.tensor(3.5) / FP8_E4M3_MAX
    assert q[0, 199].item() == -FP8_E4M3_MAX and q[1, 130].item() == FP8_E4M3_MAX
    w = torch.zeros(200, 300)  # 2 x 3 blocks; block (1, 2) covers rows 128..199, cols 256..299
    w[150, 290] = 5.0
    w[5, 5] = 2.0
    qw, sw = quantize_128x128(w)
    assert sw.shape == (2, 3)
    assert sw[1, 2].item() == torch.tensor(5.0) / FP8_E4M3_MAX and sw[0, 0].item() == torch.tensor(2.0) / FP8_E4M3_MAX
    assert qw[150, 290].item() == FP8_E4M3_MAX
    floor = torch.tensor(AMAX_FLOOR) / FP8_E4M3_MAX
    assert sw[0, 1].item() == floor.item() and sw[1, 0].item() == floor.item()


def test_zero_blocks_get_finite_positive_scale_and_zero_codes():
    for quantize, shape in ((quantize_1x128, (3, 256)), (quantize_128x1, (256, 3)), (quantize_128x128, (256, 256))):
        q, s = quantize(torch.zeros(shape))
        assert torch.all(torch.isfinite(s)) and torch.all(s > 0)
        assert s.min().item() >= torch.finfo(torch.float32).tiny  # normal: survives flush-to-zero on GPUs
        assert torch.all(q.float() == 0)


def test_saturation_clamps_to_e4m3_max():
    torch.manual_seed(0)
    x = torch.randn(64, 1024) * torch.logspace(-6, 6, 64)[:, None]
    q, s = quantize_1x128(x)
    qf = q.float()
    assert torch.all(torch.isfinite(qf)) and qf.abs().max().item() == FP8_E4M3_MAX
    # the element with the block's amax maps to +-448 exactly, whatever x / s rounded to
    blocks = x.reshape(64, 8, 128)
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    assert torch.all(torch.gather(qf.reshape(64, 8, 128), -1, idx).abs() == FP8_E4M3_MAX)


def test_power_of_two_scales():
    v = torch.tensor([3.0 / 448, 2.0**-4, 1e-3, 0.7, 2.0**-20 * 1.5, 1.0])
    got = round_scale_up_to_pow2(v)
    want = [2.0 ** math.ceil(math.log2(float(t))) for t in v.double()]
    assert got.tolist() == want
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 1] = 3.0, 1.0  # amax 3: s = 3/448 -> 2^-7; codes 384 and 128 (no saturation)
    x[0, 128] = 28.0  # amax 28 = 448 * 2^-4: already a power of two, kept
    q, s = quantize_1x128(x, pow2=True)
    assert s[0].tolist() == [2.0**-7, 2.0**-4]
    assert q[0, :2].float().tolist() == [384.0, 128.0] and q[0, 128].item() == FP8_E4M3_MAX


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_block_gets_nan_scale_and_codes(bad):
    torch.manual_seed(1)
    x = torch.randn(3, 300)
    clean_q, clean_s = quantize_1x128(x)
    x[1, 140] = bad
    q, s = quantize_1x128(x)
    assert torch.isnan(s[1, 1]) and torch.all(torch.isnan(q[1, 128:256].float()))
    mask = torch.ones_like(s, dtype=torch.bool)
    mask[1, 1] = False
    assert torch.equal(s[mask], clean_s[mask])
    keep = torch.ones(3, 300, dtype=torch.bool)
    keep[1, 128:256] = False
    assert torch.equal(q.float()[keep], clean_q.float()[keep])
    assert torch.isnan(dequantize_1x128(q, s)[1, 128:256]).all()
    w = torch.randn(200, 300)
    w[130, 10] = bad
    qw, sw = quantize_128x128(w)
    assert torch.isnan(sw[1, 0]) and torch.isnan(sw).sum() == 1
    assert torch.isnan(qw[128:200, :128].float()).all() and not torch.isnan(qw[:128].float()).any()
    qt, st = quantize_128x1(w)
    assert torch.isnan(st[1, 10]) and torch.isnan(st).sum() == 1


def test_roundtrip_error_bound_and_layout_consistency():
    torch.manual_seed(2)
    x = torch.randn(2, 37, 333) * 3
    q, s = quantize_1x128(x)
    assert q.shape == x.shape and s.shape == (2, 37, 3)
    deq = dequantize_1x128(q, s)
    s_full = s.repeat_interleave(128, -1)[..., :333]
    # e4m3: relative half-ulp 2^-4 for normals, absolute half-step 2^-10 * s for subnormals
    bound = torch.maximum(x.abs() * 2.0**-4, s_full * 2.0**-10) * (1 + 1e-6)
    assert torch.all((deq - x).abs() <= bound)
    # leading dims are independent rows
    q2, s2 = quantize_1x128(x.reshape(-1, 333))
    assert torch.equal(q2.view(torch.uint8), q.reshape(-1, 333).view(torch.uint8)) and torch.equal(s2, s.reshape(-1, 3))
    # 128x1 is the transposed 1x128 quantization
    m = torch.randn(300, 70)
    qt, st = quantize_128x1(m)
    qr, sr = quantize_1x128(m.t())
    assert st.shape == (3, 70) and torch.equal(st, sr.t())
    assert torch.equal(qt.view(torch.uint8), qr.t().view(torch.uint8))
    assert torch.all((dequantize_128x1(qt, st) - m).abs()
                     <= m.abs() * 2.0**-4 + st.repeat_interleave(128, 0)[:300] * 2.0**-10)
    # a 128x128 block's scale is the largest 1x128 scale of its rows (same amax, monotone rounding)
    w = torch.randn(260, 390)
    _, sw = quantize_128x128(w)
    _, srow = quantize_1x128(w)
    pad = torch.nn.functional.pad(srow, (0, 0, 0, 384 - 260))
    assert torch.equal(sw, pad.reshape(3, 128, 4).amax(1))
    s_full = sw.repeat_interleave(128, 0).repeat_interleave(128, 1)[:260, :390]
    assert torch.all((dequantize_128x128(*quantize_128x128(w)) - w).abs()
                     <= torch.maximum(w.abs() * 2.0**-4, s_full * 2.0**-10))


def test_bf16_input_matches_fp32_upcast():
    torch.manual_seed(3)
    x = torch.randn(4, 256).bfloat16()
    q1, s1 = quantize_1x128(x)
    q2, s2 = quantize_1x128(x.float())
    assert torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


@pytest.mark.parametrize("m,n,k", [(33, 70, 200), (128, 256, 384), (1, 5, 130)])
def test_emulated_gemm_all_layouts_vs_float64(m, n, k):
    torch.manual_seed(4)
    x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
    qx, sx = quantize_1x128(x)
    qw, sw = quantize_128x128(w)
    qdy, sdy = quantize_1x128(dy)
    qdyt, sdyt = quantize_128x1(dy)
    qxt, sxt = quantize_128x1(x)
    d = lambda t: t.double()  # noqa: E731
    cases = [
        ((qx, sx, qw, sw, "1x128", "128x128"), d(dequantize_1x128(qx, sx)) @ d(dequantize_128x128(qw, sw)).t()),
        ((qdy, sdy, qw.t(), sw.t(), "1x128", "128x128"), d(dequantize_1x128(qdy, sdy)) @ d(dequantize_128x128(qw, sw))),
        ((qdyt.t(), sdyt.t(), qxt.t(), sxt.t(), "1x128", "1x128"),
         d(dequantize_128x1(qdyt, sdyt)).t() @ d(dequantize_128x1(qxt, sxt))),
    ]
    for (qa, sa, qb, sb, ga, gb), ref in cases:
        for backend in gemm.BACKENDS:  # on CPU every backend resolves to the emulation
            assert (gemm.resolve_backend(backend, qa, qb, out_dtype=torch.float32, a_blocks=ga, b_blocks=gb)
                    == "emulated")
        y = gemm.fp8_block_gemm(qa, sa, qb, sb, out_dtype=torch.float32, backend="auto", a_blocks=ga, b_blocks=gb)
        assert y.shape == ref.shape and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_splitk_gemm_applies_where_the_output_has_too_few_tiles():
    """"auto"/"triton" route a forward-layout GEMM to the split-K kernel only where it splits K (few output tiles
    for the device's multiprocessors: the H200 measured it faster than cuBLAS there and slower elsewhere), for plain
    int sizes of at most SPLITK_MAX_M rows."""
    pytest.importorskip("triton")
    from calclip.fp8 import kernels as tk

    cuda = torch.device("cuda")
    sms = tk.sm_count(cuda)  # 132 (an H200's) on a machine without CUDA
    applies = lambda m, n, k, blocks=("1x128", "128x128"): gemm.splitk_applies(*blocks, m, n, k,  # noqa: E731
                                                                                torch.bfloat16, cuda)
    assert applies(64, 2048, 2048) == (tk.splitk_splits(64, 2048, 2048, sms) > 1)
    if sms >= 128:  # an H100/H200-sized GPU, or none: decode's q/k/v/o and down projections split, gate/up do not
        assert applies(64, 2048, 2048) and applies(64, 2048, 8192) and not applies(64, 8192, 2048)
        assert not applies(256, 2048, 2048)  # 128 tiles of 64 x 64 fill the device without a split
    assert not applies(gemm.SPLITK_MAX_M + 1, 64, 1 << 16)
    assert not applies(64, 2048, 2048, ("1x128", "1x128"))  # wgrad layout: cuBLAS
    assert not applies(0, 2048, 2048)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    assert not applies(64, env.create_unbacked_symint(), 2048)  # a symbolic size without a hint
    from torch._dynamo.source import ConstantSource

    backed = env.create_symintnode(env.create_symbol(2048, ConstantSource("n")), hint=2048)
    assert applies(64, backed, 2048) == applies(64, 2048, 2048)  # one with a hint: chosen as eager chooses it
    assert not env.guards  # and without a guard


def test_gemm_rejects_bad_operands():
    qa, sa = quantize_1x128(torch.randn(8, 256))
    qb, sb = quantize_128x128(torch.randn(16, 256))
    with pytest.raises(ValueError, match="backend"):
        gemm.fp8_block_gemm(qa, sa, qb, sb, out_dtype=torch.float32, backend="cublas")
    with pytest.raises(ValueError, match="sb"):
        gemm.fp8_block_gemm(qa, sa, qb, sb, out_dtype=torch.float32, b_blocks="1x128")
    with pytest.raises(ValueError, match="contraction"):
        gemm.fp8_block_gemm(qa, sa, qb[:, :128], sb[:, :1], out_dtype=torch.float32)
    assert not gemm.scaled_mm_supports("128x128", "1x128", 256, 256, 512, torch.bfloat16)  # unverified pair
    # K/128 = 3: torch accepts the call but returns garbage (docs/scaled_mm_layouts.md)
    assert not gemm.scaled_mm_supports("1x128", "128x128", 256, 256, 384, torch.bfloat16)
    assert gemm.scaled_mm_supports("1x128", "1x128", 256, 256, 512, torch.bfloat16)  # wgrad, probed correct
    assert gemm.scaled_mm_supports("1x128", "128x128", 256, 256, 512, torch.bfloat16)
    assert not gemm.scaled_mm_supports("1x128", "128x128", 256, 256, 576, torch.bfloat16)  # ragged K


@pytest.mark.parametrize("rows,k", [(256, 8960), (200, 256), (1, 128), (1536, 896)])
def test_row_scales_repeat_each_block_scale_per_row_in_scaled_mm_layout(rows, k):
    """Fp8Config.scaled_mm_row_scales hands cuBLAS a weight's 128x128 scales as one scale per row: the dequantized
    weight is the same bit for bit (so the GEMM's products are), and the scale is column-major [rows, K/128] (its
    transpose contiguous), the layout torch._scaled_mm demands of a 1x128 b operand."""
    torch.manual_seed(rows + k)
    w = torch.randn(rows, k) * torch.logspace(-3, 3, rows)[:, None]
    w[rows // 2, 5] = float("nan")  # a NaN block: NaN scale on each of its rows
    q, s = quantize_128x128(w)
    per_row = gemm.row_scales_of(s, rows)
    assert per_row.shape == (rows, -(-k // 128)) and per_row.t().is_contiguous()
    same = dequantize_1x128(q, per_row).view(torch.int32) == dequantize_128x128(q, s).view(torch.int32)
    assert bool(same.all())  # NaN elements have the same bits too: the same NaN scale times the same code


def test_row_scales_option_needs_a_scaled_mm_backend():
    assert Fp8Config(scaled_mm_row_scales=True, gemm="scaled_mm").scaled_mm_row_scales
    for gemm_name in ("triton", "emulated"):
        with pytest.raises(ValueError, match="scaled_mm_row_scales"):
            Fp8Config(scaled_mm_row_scales=True, gemm=gemm_name)
    with pytest.raises(ValueError, match="Fp8Config.scaled_mm_row_scales must be a bool"):
        Fp8Config(scaled_mm_row_scales=1)


def test_row_scales_default_is_on_exactly_where_it_applies_and_replace_stays_valid():
    """None (the default) resolves to on for the blockwise recipe with gemm "auto"/"scaled_mm" (the H200 measured
    it 1.10x on the Qwen2.5-1.5B-dims row) and off elsewhere, without raising for the gemms that rule it out."""
    import dataclasses

    assert Fp8Config().scaled_mm_row_scales is None and Fp8Config().row_scales is True
    assert Fp8Config(gemm="scaled_mm").row_scales is True
    for gemm_name in ("triton", "emulated"):
        assert Fp8Config(gemm=gemm_name).row_scales is False
        assert dataclasses.replace(Fp8Config(), gemm=gemm_name).row_scales is False
    assert Fp8Config(scaled_mm_row_scales=False).row_scales is False
    assert dataclasses.replace(Fp8Config(gemm="triton"), gemm="auto").row_scales is True


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("power_of_two_scales", 1), ("backward", "fp16"), ("gemm", "cublas"),
    ("keep_first_n_layers", -1), ("keep_last_n_layers", 1.5), ("keep_last_fraction", 1.0),
    ("keep_patterns", "lm_head"), ("keep_patterns", ("(",)), ("cache_weights", "yes"),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"Fp8Config.{field}"):
        Fp8Config(**{field: value})


def test_config_defaults_and_frozen():
    cfg = Fp8Config(keep_patterns=["lm_head", r"\.mlp\."])
    assert cfg.keep_patterns == ("lm_head", r"\.mlp\.") and cfg.block_size == 128 and cfg.backward == "fp8"
    with pytest.raises(Exception):
        cfg.backward = "bf16"


@pytest.mark.parametrize("m,k", [(277, 256), (4093, 384), (1000, 128), (300, 200)])
def test_pad_1x128_rows_appends_zero_rows_in_scaled_mm_layout(m, k):
    """torch._scaled_mm takes a multiple of 16 rows: a ragged 1x128 operand gets zero codes and zero scales appended
    (gemm.pad_1x128_rows). The first M rows are the same bytes, the rest dequantize to exact zeros (0 x 0: no NaN
    from stale memory), and the scales come back column-major, the layout the GEMM reads."""
    torch.manual_seed(m + k)
    x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
    q, s = quantize_1x128(x)
    rows = gemm.scaled_mm_rows(m)
    assert rows % 16 == 0 and m < rows < m + 16
    qp, sp = gemm.pad_1x128_rows(q, s.t().contiguous().t(), rows)
    assert qp.shape == (rows, k) and qp.dtype == q.dtype and qp.is_contiguous()
    assert sp.shape == (rows, s.shape[1]) and sp.t().is_contiguous()
    assert torch.equal(qp[:m].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:m], s)
    assert not qp[m:].view(torch.uint8).any() and not sp[m:].any()
    deq = dequantize_1x128(qp, sp)
    assert torch.equal(deq[:m], dequantize_1x128(q, s)) and not deq[m:].any()
    qp2, sp2 = gemm.pad_1x128_rows(q, s, rows)  # row-major scales in: the same values, column-major out
    assert torch.equal(sp2, sp) and sp2.t().is_contiguous()


def test_torch_quantizers_write_zero_tokens_up_to_out_rows():
    """quant.quantize_1x128(out_rows=) on the torch path (CPU, the kernels' twin): the codes and scales of x with zero
    rows appended, in the GEMM's layout, the non-finite count of x's rows only (every row of x, not of out_rows, for a
    bad weight)."""
    m, k, rows = 277, 300, 288
    x = torch.randn(m, k) * torch.logspace(-3, 3, k)
    x[5, 7] = float("nan")
    want_q, want_s = quantize_1x128(torch.cat([x, torch.zeros(rows - m, k)]))
    for weight_bad, bad_rows in ((torch.tensor(False), 1), (torch.tensor(True), m)):
        counter = torch.zeros((), dtype=torch.int64)
        q, s = quant.quantize_1x128(x, gemm_layout=True, nonfinite_count=counter, weight_bad=weight_bad,
                                    out_rows=rows)
        assert q.shape == (rows, k) and s.shape == (rows, 3) and s.t().is_contiguous()
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s.nan_to_num(-1.0), want_s.nan_to_num(-1.0))
        assert not q[m:].view(torch.uint8).any() and int(counter) == bad_rows
    with pytest.raises(ValueError, match="out_rows must satisfy 277 <= out_rows"):
        quant.quantize_1x128(x, out_rows=276)
    with pytest.raises(ValueError, match="needs a 2-D tensor"):
        quant.quantize_1x128(x.view(1, m, k), out_rows=rows)


def test_scaled_mm_takes_any_row_count_on_padded_rows_and_the_switch_restores_the_old_rule(monkeypatch):
    """On an H200 "auto" sends a forward/dgrad GEMM of M % 16 != 0 rows (a micro-batch of B x L tokens, L odd) to
    cuBLAS over scaled_mm_rows(M) rows instead of the Triton GEMM (half cuBLAS' throughput at 7B dims);
    CALCLIP_SCALED_MM_PAD_ROWS=0 (gemm.PAD_ROWS) is the measured control. The rows' own rule is unchanged: a
    K / 128 not a multiple of 4 still stays off cuBLAS."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(gemm, "_is_sm90", lambda device: True)
    monkeypatch.setattr(gemm, "SPLITK_MAX_M", 0)  # no split-K: this test is about the cuBLAS rule
    with FakeTensorMode(allow_non_fake_inputs=True):
        def choose(m, n, k, **kw):
            qa = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
            qb = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="cuda")
            return gemm.resolve_backend("auto", qa, qb, out_dtype=torch.bfloat16, a_blocks="1x128",
                                        b_blocks="128x128", **kw)

        for m in (4093, 4000, 257, 4096, 256, 64):
            assert choose(m, 1024, 4096) == "scaled_mm", m
        for m in (255, 77, 1):  # decode-sized rows keep their kernels (gemm.SCALED_MM_PAD_MIN_ROWS)
            assert choose(m, 1024, 4096) == "triton", m
        assert choose(4093, 1024, 1152) == "triton"  # K / 128 = 9: garbage on cuBLAS, padded or not
        assert choose(4093, 1024, 1152, row_scales=True) == "scaled_mm_rows"  # ... unless the weight's go per row
        assert choose(4093, 1000, 4096) == "triton"  # N % 16: no padding of M helps
        monkeypatch.setattr(gemm, "PAD_ROWS", False)
        assert choose(4093, 1024, 4096) == "triton" and choose(4096, 1024, 4096) == "scaled_mm"
        assert gemm.scaled_mm_rows(4093) == 4093


def test_operand_rows_pads_exactly_where_the_gemm_may_take_cublas(monkeypatch):
    """gemm.operand_rows, asked before quantizing: the forward/dgrad 1x128 operand is quantized over scaled_mm_rows(M)
    rows wherever resolve_backend may choose torch._scaled_mm for it (so the quantizer, not a copy, writes the rows
    cuBLAS reads), and over M rows elsewhere (no wasted rows): checked against resolve_backend's choice over token
    counts, contraction lengths, row scales, backends, output dtypes, the switch and a CPU tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(gemm, "_is_sm90", lambda device: True)
    monkeypatch.setattr(gemm, "SPLITK_MAX_M", 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for m in (4093, 4096, 1000, 257, 256, 77):
            for k in (3584, 1152, 200):
                for backend in ("auto", "scaled_mm", "triton", "emulated"):
                    for out_dtype in (torch.bfloat16, torch.float32):
                        for row_scales in (False, True):
                            x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
                            qb = torch.empty(1024, k, dtype=torch.float8_e4m3fn, device="cuda")
                            rows = gemm.operand_rows(backend, x, out_dtype, row_scales)
                            chosen = gemm.resolve_backend(backend, x, qb, out_dtype=out_dtype, a_blocks="1x128",
                                                          b_blocks="128x128", row_scales=row_scales)
                            cublas = chosen in ("scaled_mm", "scaled_mm_rows")
                            case = (m, k, backend, out_dtype, row_scales, chosen)
                            assert rows == (gemm.scaled_mm_rows(m) if cublas else m), case
        assert gemm.operand_rows("auto", torch.empty(4093, 3584, dtype=torch.bfloat16, device="cuda"),
                                 torch.bfloat16) == 4096
        monkeypatch.setattr(gemm, "PAD_ROWS", False)
        assert gemm.operand_rows("auto", torch.empty(4093, 3584, dtype=torch.bfloat16, device="cuda"),
                                 torch.bfloat16) == 4093
    monkeypatch.setattr(gemm, "PAD_ROWS", True)
    assert gemm.operand_rows("auto", torch.empty(4093, 3584, dtype=torch.bfloat16), torch.bfloat16) == 4093  # CPU


def test_padded_rows_of_a_symbolic_token_count_are_provably_aligned():
    """Under compile_layers' dynamic shapes the backend is chosen while tracing: scaled_mm_rows(M) must be provably
    a multiple of 16, so choosing cuBLAS installs no guard on M (the guard on M % 16 that decides whether to copy is
    the layer's, linear_math._gemm)."""
    from torch._dynamo.source import ConstantSource
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    tokens = env.create_symintnode(env.create_symbol(4093, source=ConstantSource("tokens"),
                                                     dynamic_dim=DimDynamic.DYNAMIC), hint=4093)
    rows = gemm.scaled_mm_rows(tokens)
    assert SizeVarAllocator(env).statically_known_multiple_of(rows.node.expr, 16)
    assert gemm.scaled_mm_supports("1x128", "128x128", rows, 1024, 4096, torch.bfloat16)
    assert not env.guards
