"""The quantizers' division-free codes (``numerics._codes`` with DIV_FREE, twins of the 1x128 and 128x1 kernels'
training tiles, the first of which is each table's default) == the reference, bit for bit, on the inputs where a
one-ulp quotient error would show: values on e4m3 rounding midpoints times the block scale and 1-3 fp32 ulps either
side, -0.0, quotients in e4m3's subnormal range and fp32 subnormals, NaN/Inf blocks, floored and near-fp32-max scales,
power-of-two scales.

Each DIV_FREE config is launched through the production launcher (``quantize_1x128`` / ``quantize_128x1``, the
config set as the launcher's default). On CUDA the FMAs are the hardware's. Triton's interpreter computes
``tl.fma(a, b, c)`` as ``a * b + c`` in fp32, rounding twice, which is not the instruction the GPU runs (and which
breaks Markstein's exact residual), so on CPU the interpreter is given a correctly rounded fp32 FMA: the product is
exact in float64, the sum's error is recovered with TwoSum and the one rounding to fp32 is resolved from it
(``benchmarks/check_markstein.py``'s ``two_sum`` / ``rn32``, which that script checks against the exact quotient).
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 to run the kernels on CPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from check_markstein import e4m3_midpoints, rn32, two_sum  # noqa: E402

from calclip.fp8 import reference as ref  # noqa: E402
from calclip.fp8.config import FP8_DTYPE, FP8_E4M3_MAX  # noqa: E402
from calclip.fp8.kernels import quantize  # noqa: E402

TUNED = {"quantize_1x128": quantize._quantize_1x128_tuned, "quantize_1x128 counting":
         quantize._quantize_1x128_counting_tuned, "quantize_128x1": quantize._quantize_128x1_tuned}
TABLES = {"quantize_1x128": quantize._QUANT_1X128_CONFIGS,
          "quantize_1x128 counting": quantize._QUANT_1X128_COUNT_CONFIGS,
          "quantize_128x1": quantize._QUANT_128X1_CONFIGS}
TWINS = {"quantize_1x128": quantize._QUANT_1X128_DIV_FREE_TWINS,
         "quantize_1x128 counting": quantize._QUANT_1X128_DIV_FREE_TWINS,
         "quantize_128x1": quantize._QUANT_128X1_DIV_FREE_TWINS}
CANDIDATES = {"quantize_128x1": quantize._QUANT_128X1_CANDIDATES}
DIV_FREE = [(name, config) for name, twins in TWINS.items() for config in twins]


@pytest.fixture
def exact_fma(monkeypatch):
    """Under the interpreter: tl.fma rounds once, as the GPU's fma.rn.f32 does."""
    if not INTERPRET:
        return
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        a, b, c = (np.asarray(v.data, dtype=np.float64) for v in (x, y, z))
        return interpreter.TensorHandle(rn32(*two_sum(a * b, c)).astype(np.float32), z.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)


def _blocks_on_midpoints(rows: int, seed: int) -> torch.Tensor:
    """fp32 [rows, 512]: per 128-block an amax (log-uniform over 1e-30..1e38, so some blocks floor the scale) at
    one position, the rest e4m3 rounding midpoints times the block's scale, moved 0-3 fp32 ulps either way, with
    signs and a few -0.0 and fp32 subnormals."""
    rng = np.random.default_rng(seed)
    mids = e4m3_midpoints()
    x = np.empty((rows, 4, 128), np.float32)
    amax = (10 ** rng.uniform(-30, 38, (rows, 4))).astype(np.float32)
    s = (np.maximum(amax.astype(np.float64), ref.AMAX_FLOOR) / FP8_E4M3_MAX).astype(np.float32)
    on_mid = (rng.choice(mids, x.shape) * s[..., None].astype(np.float64)).astype(np.float32)
    steps = rng.integers(-3, 4, x.shape)
    for k in range(1, 4):
        for sign in (1, -1):
            on_mid = np.where(steps * sign >= k, np.nextafter(on_mid, np.inf * sign, dtype=np.float32), on_mid)
    x[:] = np.minimum(on_mid, amax[..., None]) * rng.choice([-1, 1], x.shape).astype(np.float32)
    x[..., 0] = amax * rng.choice([-1, 1], amax.shape).astype(np.float32)  # the block's amax itself
    x[:, :, 5] = -0.0
    x[:, :, 6] = np.float32(1e-40)  # an fp32 subnormal
    return torch.from_numpy(x.reshape(rows, 512))


def _special(rows: int) -> torch.Tensor:
    x = torch.randn(rows, 512) * torch.logspace(-8, 3, 512)  # small values land in e4m3 subnormals
    x[0, :128] = 0.0
    x[1, 130] = float("nan")
    x[2, 300] = float("inf")
    x[3, 400] = -float("inf")
    x[4, :128] = 3e38
    x[5, 256:384] = torch.linspace(-1, 1, 128) * FP8_E4M3_MAX
    return x


def _quantize(name: str, x: torch.Tensor, pow2: bool):
    if name == "quantize_128x1":
        return quantize.quantize_128x1(x, pow2=pow2, gemm_layout=True), ref.quantize_128x1(x.cpu(), pow2=pow2)
    count = torch.zeros((), dtype=torch.int64, device=x.device) if name.endswith("counting") else None
    got = quantize.quantize_1x128(x, pow2=pow2, gemm_layout=True, nonfinite_count=count)
    return got, ref.quantize_1x128(x.cpu(), pow2=pow2)


def test_a_twin_leads_each_table_and_the_rest_divide():
    """Measured faster on an H100 (2026-12-07: the 128x1 quantizer 1.31x, the 1x128 1.01-1.04x; quantize.py), a
    division-free twin is each table's default (first: what autotune-off launches) unless CALCLIP_DIV_FREE=0 or
    under Triton's interpreter; the other tiles, and the 128x1 candidates, divide (their twins are untimed). Each
    twin is a training tile of its table (or of its candidates, bench_quant.py --configs), the same meta-parameters
    with DIV_FREE set."""
    for name, table in TABLES.items():
        tiles = table[1:] if quantize.DIV_FREE_DEFAULT else table
        if quantize.DIV_FREE_DEFAULT:
            assert table[0] is TWINS[name][0], name
        assert not any(c.kwargs["DIV_FREE"] for c in [*tiles, *CANDIDATES.get(name, [])]), name
        plain = {(tuple(sorted((k, v) for k, v in c.kwargs.items() if k != "DIV_FREE")), c.num_warps)
                 for c in [*tiles, *CANDIDATES.get(name, [])]}
        for twin in TWINS[name]:
            assert twin.kwargs["DIV_FREE"] is True, (name, twin)
            tile = tuple(sorted((k, v) for k, v in twin.kwargs.items() if k != "DIV_FREE"))
            assert (tile, twin.num_warps) in plain, (name, twin)


@pytest.mark.parametrize("interpreted", ["0", "1"])
def test_the_environment_switch_leaves_the_dividing_tiles_alone(monkeypatch, interpreted):
    """CALCLIP_DIV_FREE (read at import, part of the compile caches' key): unset or 1, each training default's twin
    leads its table, one config more than the dividing tiles, the counting table's default still the plain one's;
    0: the dividing defaults lead. Under Triton's interpreter (whose tl.fma rounds twice) the dividing defaults lead
    whatever the switch says."""
    from tests.fixtures import printed_under_env

    monkeypatch.setenv("TRITON_INTERPRET", interpreted)
    probe = ("from calclip.fp8.kernels import quantize as q; "
             "print(q._QUANT_1X128_CONFIGS[0].kwargs.get('DIV_FREE', False), "
             "q._QUANT_128X1_CONFIGS[0].kwargs.get('DIV_FREE', False), "
             "q._quantize_1x128_counting_tuned.default is q._quantize_1x128_tuned.default, "
             "len(q._QUANT_1X128_CONFIGS), len(q._QUANT_128X1_CONFIGS))")
    seen = printed_under_env("CALCLIP_DIV_FREE", ("1", "0", None), probe)
    lead = 1 if quantize.DIV_FREE_DEFAULT else 0
    sizes = f"{len(quantize._QUANT_1X128_CONFIGS) - lead} {len(quantize._QUANT_128X1_CONFIGS) - lead}"
    more = f"{len(quantize._QUANT_1X128_CONFIGS) - lead + 1} {len(quantize._QUANT_128X1_CONFIGS) - lead + 1}"
    dividing, twin = f"False False True {sizes}", f"True True True {more}"
    if interpreted == "1":
        assert seen == {"1": dividing, "0": dividing, None: dividing}
    else:
        assert seen == {"1": twin, "0": dividing, None: twin}
    from calclip.fp8.compile_cache import DISPATCH_ENV

    assert "CALCLIP_DIV_FREE" in DISPATCH_ENV


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("data", ["midpoints", pytest.param("special", marks=pytest.mark.slow),
                                  pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name,config", DIV_FREE, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in c.kwargs.items())}"
                                                       f"-w{c.num_warps}" for n, c in DIV_FREE])
def test_division_free_codes_equal_the_reference(name, config, data, pow2, exact_fma):
    x = {"midpoints": lambda: _blocks_on_midpoints(256, seed=int(pow2)), "special": lambda: _special(256),
         "bf16": lambda: (torch.randn(256, 512) * 3).to(torch.bfloat16)}[data]()
    if name == "quantize_128x1":
        x = x.t().contiguous()  # its blocks run down the columns: the same adversarial values per block
    with TUNED[name].pinned(config):  # on a GPU too: launch this config, not the autotuner's choice
        (q, s), (q_ref, s_ref) = _quantize(name, x.to(DEVICE), pow2)
    q = q[: q_ref.shape[0]] if name == "quantize_128x1" else q  # gemm_layout pads the 128x1 codes' rows
    assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape and s.shape == s_ref.shape
    same_s = (s.cpu().contiguous().view(torch.int32) == s_ref.contiguous().view(torch.int32)) | \
        (s.cpu().isnan() & s_ref.isnan())
    assert bool(same_s.all()), "scales differ"
    a, b = q.cpu().contiguous().view(torch.uint8), q_ref.contiguous().view(torch.uint8)
    differ = (a != b) & ~(((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F))  # any two NaN codes count as equal
    assert int(differ.sum()) == 0, f"{int(differ.sum())} of {a.numel()} codes differ"


def test_the_interpreters_own_fma_would_not_do():
    """Why the fixture: with the interpreter's twice-rounded fma the division-free codes differ from the reference
    on the midpoint blocks (so the test above, on CPU, checks the GPU's arithmetic, not the interpreter's)."""
    if not INTERPRET:
        pytest.skip("the interpreter's fma only")
    name, config = next((n, c) for n, c in DIV_FREE if n == "quantize_1x128")
    x = _blocks_on_midpoints(256, seed=0)
    with quantize._quantize_1x128_tuned.pinned(config):
        (q, _), (q_ref, _) = _quantize(name, x, False)
    assert int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum()) > 0
