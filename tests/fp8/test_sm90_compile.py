"""Every Triton kernel of ``calclip.fp8.kernels`` compiles for sm_90 (H100/H200) on a CPU-only machine, for every
autotune config it can be launched with and every constexpr combination its launchers pass, and the compiled code
fits the GPU and holds the instructions the numerics rely on.

Under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA) nothing is compiled, and the interpreter accepts
code Triton rejects on a GPU; the flag is read when ``@triton.jit`` decorates, so the compiles run in a subprocess
with TRITON_INTERPRET=0 (tests/fp8/_sm90_compile.py, one per kernel; it says how each launch is reproduced). ptxas
ships with the triton wheel, so each case goes down to cubin:

- shared memory: Triton's launcher raises OutOfResources when a kernel's dynamic shared memory exceeds the device's
  opt-in per-block limit (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN); on Hopper that is 227 KB =
  232448 bytes (228 KB per SM less the 1 KB the driver reserves per block; the value torch's Inductor heuristics
  identify an H100 by);
- spills: none, except the (kernel, config) pairs of ``KNOWN_SPILLS``, which spill today and may not spill more;
- instructions: the hardware e4m3 cast, IEEE divisions, Hopper's FP8 wgmma, the counters' atomics.

    python -m pytest -q tests/fp8/test_sm90_compile.py        # CPU: a few minutes the first time (Triton's cache)
"""

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")
pytest.importorskip("triton.backends.nvidia", reason="triton built without the NVIDIA backend")

from calclip.fp8.kernels import (  # noqa: E402
    block_gemm, fused_decode, launch, numerics, producers, quantize, splitk_gemm,
)

ROOT = Path(__file__).resolve().parents[2]
HELPER = Path(__file__).with_name("_sm90_compile.py")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H100_MAX_SHARED_PER_BLOCK = 232448  # bytes: Hopper's opt-in maximum per block (module docstring)

# Every config each kernel can be launched with: its autotune tables (the first entry is the default config the
# interpreter, CALCLIP_TRITON_AUTOTUNE=0 and torch.compile without autotuning launch), the division-free twins (on a
# GPU a twin leads each activation quantizer's table; imported here, under the interpreter, the tables hold the
# dividing tiles only), and the candidates bench_quant.py --configs pins.
TABLES = {
    "_quantize_1x128_kernel": quantize._QUANT_1X128_CONFIGS + quantize._QUANT_1X128_COUNT_CONFIGS
    + quantize._QUANT_1X128_DIV_FREE_TWINS,
    "_zero_token_rows_kernel": quantize._ZERO_ROWS_CONFIGS,
    "_quantize_128x1_kernel": quantize._QUANT_128X1_CONFIGS + quantize._QUANT_128X1_DIV_FREE_TWINS
    + quantize._QUANT_128X1_CANDIDATES,
    "_quantize_128x128_kernel": quantize._QUANT_128X128_CONFIGS,
    "_requantize_128x128_kernel": quantize._QUANT_128X128_CONFIGS,
    "_fp8_block_gemm_kernel": block_gemm._GEMM_CONFIGS,
    "_fp8_splitk_gemm_kernel": splitk_gemm._SPLITK_CONFIGS,
    "_splitk_reduce_kernel": [splitk_gemm._REDUCE_CONFIG],
    "_fp8_linear_fused_quant_kernel": fused_decode._FUSED_CONFIGS,
    "_producer_quantize_kernel": producers._PRODUCER_CONFIGS,
}
QUANTIZERS = {"_quantize_1x128_kernel", "_quantize_128x1_kernel", "_quantize_128x128_kernel",
              "_requantize_128x128_kernel", "_fp8_linear_fused_quant_kernel", "_producer_quantize_kernel"}
FP8_GEMMS = {"_fp8_block_gemm_kernel", "_fp8_splitk_gemm_kernel", "_fp8_linear_fused_quant_kernel"}

# (kernel, config) -> the most spill-store bytes any of its cases had on sm_90 with Triton 3.6 / ptxas 12.8
# (2026-12-04; the block GEMM's rows 2026-12-05, once the wgrad at a ragged token count contracted over whole token
# groups: before, its loads lost their alignment and every config spilled more, the default 512 bytes). Autotune
# candidates the autotuner times and may reject, and two defaults (the block GEMM's 8 bytes at bf16/fp16 output;
# the producer's 12 bytes for a bf16 RMS norm without the 128x1 codes). Whether they cost time is a GPU
# question (benchmarks/), not one a compile answers; the test keeps them from growing and any other config from
# starting to spill.
_GEMM_128 = "BLOCK_M=128 BLOCK_N=128 GROUP_M=8"
KNOWN_SPILLS = {
    ("_fp8_block_gemm_kernel", f"{_GEMM_128} warps=8 stages=4"): 8,
    ("_fp8_block_gemm_kernel", f"{_GEMM_128} warps=4 stages=4"): 828,
    ("_fp8_block_gemm_kernel", "BLOCK_M=128 BLOCK_N=256 GROUP_M=8 warps=8 stages=3"): 1048,
    ("_fp8_block_gemm_kernel", "BLOCK_M=256 BLOCK_N=128 GROUP_M=8 warps=8 stages=3"): 736,
    ("_fp8_linear_fused_quant_kernel", "BLOCK_M=64 BLOCK_N=64 warps=4 stages=4"): 88,
    ("_fp8_linear_fused_quant_kernel", "BLOCK_M=64 BLOCK_N=128 warps=4 stages=3"): 16,
    ("_producer_quantize_kernel", "warps=4 stages=3"): 1646,
    ("_producer_quantize_kernel", "warps=8 stages=3"): 12,
    ("_producer_quantize_kernel", "warps=16 stages=3"): 172,
}


def _config_name(config) -> str:  # the helper's _config_name
    tiles = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{tiles} warps={config.num_warps} stages={config.num_stages}".strip()


@lru_cache(maxsize=None)
def _compiled(kernel: str) -> tuple[dict, ...]:
    """The helper's rows for ``kernel``, compiled in a subprocess without the interpreter."""
    if not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists():
        pytest.skip("the triton wheel ships no ptxas / cuobjdump: nothing to compile to cubin with")
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HELPER), kernel], env=env, capture_output=True, text=True,
                          timeout=850)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = tuple(json.loads(line) for line in done.stdout.splitlines())
    assert rows and all(row["kernel"] == kernel for row in rows), done.stdout[-2000:]
    return rows


def _table(rows) -> str:
    """One line per case: what the report lists (pytest shows it on a failure, -rA / -s print it)."""
    return "\n".join(f"{r['case']:<62} {r['config']:<52} shared={r.get('shared')} regs={r.get('regs')} "
                     f"spill={r.get('spill_stores')}/{r.get('spill_loads')} {r['seconds']}s" for r in rows)


def test_every_launched_kernel_is_covered():
    """The kernels checked below are exactly the ``*_kernel`` JIT functions of calclip.fp8.kernels (the rest are
    helpers they call, compiled inside them), and every kernel a launcher (``launch._Tuned``) holds is among them."""
    modules = (quantize, block_gemm, splitk_gemm, fused_decode, producers, numerics, launch)
    jit_type = type(numerics._abs_max)  # JITFunction, or the interpreter's stand-in
    jitted = {obj for m in modules for obj in vars(m).values() if isinstance(obj, jit_type)}
    kernels = {fn.__name__ for fn in jitted if fn.__name__.endswith("_kernel")}
    assert kernels == set(TABLES)
    tuned = {obj.kernel.__name__ for m in modules for obj in vars(m).values() if isinstance(obj, launch._Tuned)}
    tuned.add(splitk_gemm._fp8_splitk_gemm_kernel.__name__)  # its _Tuned is built per split count, on first use
    assert tuned == kernels


@pytest.mark.slow  # the compiles: about ten minutes in all on the 2-core CPU machine with a cold Triton cache
@pytest.mark.parametrize("kernel", list(TABLES))
def test_kernel_compiles_for_sm90_and_fits_the_h200(kernel):
    """Every case compiles to an sm_90 cubin; every config of the kernel's tables is among them; the dynamic shared
    memory fits Hopper's per-block maximum; no config spills registers but those of KNOWN_SPILLS, by no more."""
    rows = _compiled(kernel)
    print(f"\n{kernel}: {len(rows)} compiles\n{_table(rows)}")
    failed = [(r["case"], r["config"], r["error"]) for r in rows if not r["ok"]]
    assert not failed, failed
    assert {r["config"] for r in rows} == {_config_name(c) for c in TABLES[kernel]}
    too_big = [(r["case"], r["config"], r["shared"]) for r in rows if r["shared"] > H100_MAX_SHARED_PER_BLOCK]
    assert not too_big, too_big
    assert all(r["local"] == 0 for r in rows)  # no local arrays: the stack frame below holds spills only
    spills = [(r["case"], r["config"], r["spill_stores"]) for r in rows
              if r["spill_stores"] > KNOWN_SPILLS.get((kernel, r["config"]), 0)]
    assert not spills, spills
    assert all((r["stack"] > 0) == (r["spill_stores"] > 0) for r in rows)


@pytest.mark.slow
def test_wgrad_at_a_ragged_token_count_compiles_like_an_aligned_one():
    """The weight-gradient GEMM contracts over tokens. With 4093 tokens its operands (the 128x1 codes) arrive padded to
    4096 rows (reference.wgrad_rows), so every config compiles as at 4096 tokens: the same shared memory (the software
    pipeline's stages; with K = 4093 the default lost it, 131,072 -> 32,768 bytes), the same registers and spills."""
    rows = _compiled("_fp8_block_gemm_kernel")
    aligned = {r["config"]: r for r in rows if r["case"] == "wgrad bf16"}
    ragged = [r for r in rows if r["case"].startswith("wgrad bf16 tokens=")]
    assert len(ragged) == len(aligned) == len(TABLES["_fp8_block_gemm_kernel"])
    for r in ragged:
        want = aligned[r["config"]]
        assert (r["shared"], r["regs"], r["spill_stores"]) == (want["shared"], want["regs"], want["spill_stores"]), r


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(QUANTIZERS))
def test_quantizers_use_the_hardware_e4m3_cast_and_ieee_division(kernel):
    """numerics.py: scales and codes are IEEE divisions (tl.math.div_rn, as reference.py divides), never the
    approximate division Triton's `/` compiles to; codes are stored with the hardware round-to-nearest-even,
    saturating e4m3 cast (the one tests/fp8/test_triton.py ties the interpreter's software encoder to)."""
    for r in _compiled(kernel):
        assert r["ptx"]["cvt_e4m3"] > 0 and r["ptx"]["div_rn"] > 0, r
        assert r["ptx"]["div_inexact"] == 0, r


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["_quantize_1x128_kernel", "_quantize_128x1_kernel"])
def test_division_free_twins_spend_three_instructions_per_code(kernel):
    """numerics._codes and _abs_max_lean, the DIV_FREE twins of the two activation quantizers (their defaults on a GPU):
    a twin's amax is one NaN-keeping max per element (max.NaN.f32; no NaN-to-Inf select per element), its codes have
    no clamp (no fp32 min: the e4m3 cast's saturation does it, the quotient being <= 448.0001) and no division per
    code (the scale and its reciprocal only: at most half the dividing config's divisions on the same tile). The
    dividing tiles keep their clamp and per-element select (_scaled_codes)."""
    rows = _compiled(kernel)
    divisions: dict[tuple, dict[bool, int]] = {}
    for r in rows:
        twin = "DIV_FREE=True" in r["config"]
        if twin:
            assert r["ptx"]["max_nan"] > 0 and r["ptx"]["min_f32"] == 0, (r["case"], r["config"], r["ptx"])
        else:
            assert r["ptx"]["max_nan"] == 0 and r["ptx"]["min_f32"] > 0, (r["case"], r["config"], r["ptx"])
        tile = (r["case"], r["config"].replace("DIV_FREE=True", "DIV_FREE=False"))
        divisions.setdefault(tile, {})[twin] = r["ptx"]["div_rn"]
    pairs = {tile: d for tile, d in divisions.items() if len(d) == 2}
    assert pairs, "no DIV_FREE twin shares a tile with a dividing config"
    for tile, d in pairs.items():
        assert 0 < 2 * d[True] <= d[False], (tile, d)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(QUANTIZERS - {"_fp8_linear_fused_quant_kernel"}))
def test_quantizers_store_their_codes_vectorized(kernel):
    """No one-byte global store but the requantizer's non-finite flag: every code store is vectorized, at the ragged
    token count too. The 128x1 codes' row stride is what decides it: with 4093 rows the 128x1 quantizer wrote its
    codes with 32 one-byte stores per thread where 4096 rows take two 16-byte ones; since
    wgrad_rows the stride is a multiple of 128 at every token count."""
    allowed = 1 if kernel == "_requantize_128x128_kernel" else 0  # bad_ptr: one uint8 flag per weight
    for r in _compiled(kernel):
        assert r["ptx"]["st_b8"] <= allowed, (r["case"], r["config"], r["ptx"]["st_b8"])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", sorted(FP8_GEMMS))
def test_fp8_gemms_run_on_hoppers_fp8_wgmma(kernel):
    """Every config's dot is Hopper's FP8 wgmma on e4m3 operands, never mma.sync (a dot below BLOCK_M 64 would be,
    on f16-upcast codes, summing a K block otherwise: fused and unfused outputs would depend on the config)."""
    for r in _compiled(kernel):
        assert r["ptx"]["wgmma_e4m3"] > 0 and r["ptx"]["mma_sync"] == 0, r


@pytest.mark.slow
def test_counters_are_atomic_and_the_split_k_sum_is_not():
    """The non-finite row counts are atomic adds, in exactly the launches that count; the GEMMs and the split-K
    reduction use no atomics (a fixed summation order: deterministic outputs)."""
    for r in _compiled("_quantize_1x128_kernel"):
        assert (r["ptx"]["atom"] > 0) == r["case"].startswith("count"), r
    for r in _compiled("_fp8_linear_fused_quant_kernel"):
        assert (r["ptx"]["atom"] > 0) == ("count=True" in r["case"]), r
    assert all(r["ptx"]["atom"] > 0 for r in _compiled("_producer_quantize_kernel"))
    for kernel in ("_fp8_block_gemm_kernel", "_fp8_splitk_gemm_kernel", "_splitk_reduce_kernel"):
        assert all(r["ptx"]["atom"] == 0 for r in _compiled(kernel)), kernel


@pytest.mark.slow
def test_16_bit_roundings_are_the_hardware_round_to_nearest_even():
    """The producers' bf16 outputs (HF's `.to(bfloat16)` after each fp32 multiply) round to nearest even in hardware:
    cvt.rn for the RMS norm's x * rstd (rstd is fp32), and for products of two bf16 values either cvt.rn or the bf16
    multiply LLVM folds the fp32 multiply and its rounding into (the same bits: the fp32 product of two bf16 is
    exact, so both round it once); never a bf16 add or FMA, and an fp32 output never passes through bf16. The fused
    decode's in-register autocast cast (ROUND 1 / 2) rounds fp32 x to bf16 / fp16 with cvt.rn and back
    (cvt.f32.bf16 / f16), which an fp32 layer's x (ROUND 0) never does."""
    for r in _compiled("_producer_quantize_kernel"):
        ptx = r["ptx"]
        assert ptx["add_fma_bf16"] == 0, r
        if " bf16 " in r["case"]:
            assert ptx["cvt_bf16"] + ptx["mul_bf16"] > 0, r
            assert ptx["cvt_bf16"] > 0 or not r["case"].startswith("rms_norm"), r
        else:
            assert ptx["cvt_bf16"] == ptx["mul_bf16"] == 0, r
    for r in _compiled("_fp8_linear_fused_quant_kernel"):
        if "round=1" in r["case"]:
            assert r["ptx"]["cvt_bf16"] > 0 and r["ptx"]["cvt_from_bf16"] > 0, r
        if "round=2" in r["case"]:
            assert r["ptx"]["cvt_f16"] > 0 and r["ptx"]["cvt_from_f16"] > 0, r
        if "x=fp32 round=0" in r["case"]:
            assert r["ptx"]["cvt_from_bf16"] == r["ptx"]["cvt_from_f16"] == 0, r


@pytest.mark.slow
def test_the_existing_sm90_checks_pass_without_the_interpreter():
    """test_triton.py's and test_fused_decode.py's own sm_90 compile tests skip under the interpreter; run them in a
    subprocess without it, so CI runs their assertions (the software e4m3 path, the requantizer's stores...) too."""
    if not (BIN / "ptxas").exists():
        pytest.skip("the triton wheel ships no ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    tests = ["tests/fp8/test_triton.py::test_kernels_compile_for_sm90_without_a_gpu",
             "tests/fp8/test_fused_decode.py::test_fused_kernel_compiles_for_sm90_without_a_gpu"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=850)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
