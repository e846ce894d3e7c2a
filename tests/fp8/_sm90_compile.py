"""Compile calclip's Triton kernels to sm_90 (H100/H200) cubin on a machine without a GPU, one JSON line per compile.

    TRITON_INTERPRET=0 PYTHONPATH=. python tests/fp8/_sm90_compile.py [KERNEL ...]   # every kernel when none given

tests/fp8/test_sm90_compile.py runs this in a subprocess: ``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates,
and the test process (tests/conftest.py) runs the kernels under the interpreter, which compiles nothing.

Each case is one launch a launcher in ``calclip.fp8.kernels`` makes: the kernel's arguments as the launcher passes
them (placeholder tensors of the launcher's dtypes, the ints of a representative shape), its constexprs and one
autotune config. The arguments go through Triton's own binder for the sm_90 backend, so the specialization (ints
equal to 1 become constexprs, 16-divisible ints and pointers get ``tt.divisibility``) is the one a launch on an H200
would compile; ``triton.compile`` then runs the whole pipeline down to ptxas, which the triton wheel ships.

Each line: kernel, case, config, ok (or error), seconds, shared (the dynamic shared memory Triton's launcher checks
against the device's opt-in limit), regs and stack (registers and stack-frame bytes per thread in the cubin: Triton's
n_regs, and the spill space behind its n_spills), spill_stores / spill_loads (ptxas -v) and counts of the PTX
instructions the tests assert on (``PTX_PATTERNS``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("run with TRITON_INTERPRET=0: the interpreter compiles nothing")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

from calclip.fp8.config import BLOCK  # noqa: E402
from calclip.fp8.kernels import block_gemm, fused_decode, producers, quantize, splitk_gemm  # noqa: E402
from calclip.fp8.kernels.launch import _bucket, _ceil_div  # noqa: E402
from calclip.fp8.reference import wgrad_rows  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200: compute capability 9.0 (Triton compiles sm_90a)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
CUOBJDUMP, PTXAS = BIN / "cuobjdump", BIN / "ptxas"
SM_ARCH = "sm_90a"  # what Triton's CUDA backend compiles capability 90 for (wgmma needs the "a" features)

# PTX facts the tests check: regex -> count of matching lines
PTX_PATTERNS = {
    "cvt_e4m3": r"cvt\.rn\.satfinite\.e4m3x2\.f32",  # hardware fp32 -> e4m3fn, round to nearest even, saturating
    "div_rn": r"div\.rn\.f32",  # IEEE division (numerics._block_scale / _scaled_codes: tl.math.div_rn)
    "div_inexact": r"div\.(full|approx)\.f32",  # what Triton's plain `/` gives: not the reference's division
    "max_nan": r"\bmax\.NaN\.f32",  # a max that keeps NaN (numerics._abs_max's reduction)
    "min_f32": r"\bmin(\.\w+)*\.f32",  # an fp32 min: a clamp (tl.clamp lowers to a min and a max)
    "wgmma_e4m3": r"wgmma\.mma_async\.\S*\.e4m3\.e4m3",  # Hopper FP8 tensor cores
    "mma_sync": r"\bmma\.sync",  # the pre-Hopper MMA (an FP8 dot below BLOCK_M 64 upcasts to f16 on it)
    "atom": r"\batom\.global",  # the non-finite counters' atomic add
    "st_b8": r"\bst\.global(\.\w+)*\.b8\b",  # a one-byte global store: codes written unvectorized (an unaligned stride)
    "st_shared_b8": r"\bst\.shared(\.\w+)*\.b8\b",  # a one-byte shared store: codes transposed a byte at a time
    "cvt_bf16": r"cvt\.rn\.bf16(x2)?\.f32",  # fp32 -> bf16, round to nearest even (one value or a pair)
    "cvt_f16": r"cvt\.rn\.f16(x2)?\.f32",  # fp32 -> fp16, round to nearest even
    # bf16 arithmetic: LLVM turns fptrunc(fmul(fpext a, fpext b)) of bf16 a, b into a bf16 multiply (the same bits:
    # fp32 holds the product of two bf16 exactly); an add or FMA in bf16 would be a rounding calclip never asked for
    "mul_bf16": r"\bmul(\.rn)?\.bf16(x2)?\b",
    "add_fma_bf16": r"\b(add|sub|fma)(\.rn)?\.bf16(x2)?\b",
    "cvt_from_bf16": r"cvt\.f32\.bf16",  # bf16 -> fp32 (exact)
    "cvt_from_f16": r"cvt\.f32\.f16",  # fp16 -> fp32 (exact)
}

F8, F32, BF16, F16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16
I64, I32, BOOL, U8 = torch.int64, torch.int32, torch.bool, torch.uint8
DTYPE_NAMES = {BF16: "bf16", F16: "fp16", F32: "fp32"}


def _t(dtype):
    """A pointer argument of ``dtype``: Triton's placeholder tensor, 16-byte aligned like every torch allocation."""
    return MockTensor(dtype)


# Representative shapes (rows M, inner K, outputs N). Qwen2.5-1.5B's MLP: K = 1536, N = 8960; training and rollout
# scoring see token totals of any size (4093: odd, not a multiple of 16), decode few rows (1: Triton turns M == 1
# into a constexpr; 7; 64).
TRAIN, RAGGED = 4096, 4093
K_IN, N_OUT = 1536, 8960


# ------------------------------------------------------------------------------------------------------------
# One builder per launcher: (args, constexprs) exactly as the launcher passes them.
# ------------------------------------------------------------------------------------------------------------


def _gemm_rows(m):
    """The 1x128 rows linear_math quantizes m tokens over on the H200 (gemm.operand_rows: torch._scaled_mm's multiple
    of 16 from 257 rows, written by the quantizer)."""
    return _ceil_div(m, 16) * 16 if m >= 257 else m


def _quantize_1x128(x, r, k, pow2, count, members):
    """quantize_1x128(x, gemm_layout=True, out_rows=_gemm_rows(r)[, nonfinite_count, weight_bad, members]): s
    column-major [rows, nb], the kernel writing x's r rows (the launcher fills the rest)."""
    nb = _ceil_div(k, BLOCK)
    counter = (_t(I64), _t(BOOL if members == 1 else I32)) if count else (_t(F32), _t(F32))  # else s2, unused
    args = (_t(x), _t(F8), _t(F32), r, k, nb, k, 1, _gemm_rows(r), _bucket(r), *counter)
    return args, dict(POW2=pow2, SOFT_FP8=False, COUNT=count, MEMBERS=members, GROUP=BLOCK)


def _zero_token_rows(r, k, column_major):
    """quantize_1x128(out_rows=_gemm_rows(r))'s second launch: rows r.. of codes [rows, k] and scales [rows, nb]
    (column-major with gemm_layout, as linear_math asks; row-major otherwise), an all-zero group's fp32 scale."""
    rows, nb = _gemm_rows(r), _ceil_div(k, BLOCK)
    strides = (1, rows) if column_major else (nb, 1)
    return (_t(F8), _t(F32), r, k, nb, *strides, 1e-12 / 448), dict(GROUP=BLOCK)


def _quantize_128x1(x, m, k, pow2):
    """quantize_128x1(x, gemm_layout=True): codes [k, wgrad_rows(m)], s row-major [ceil(m/128), k]."""
    args = (_t(x), _t(F8), _t(F32), m, k, wgrad_rows(m), k, 1, k, 1, _bucket(m))
    return args, dict(POW2=pow2, SOFT_FP8=False, GROUP=BLOCK)


def _quantize_128x128(w, n, k, pow2):
    args = (_t(w), _t(F8), _t(F32), n, k, _ceil_div(k, BLOCK), k, 1)
    return args, dict(POW2=pow2, SOFT_FP8=False, GROUP=BLOCK)


def _requantize_128x128(w, n, k, pow2, transposed):
    """requantize_128x128_'s two launches: on w [n, k], and (qt/st given) on w.t() [k, n], strides (1, k)."""
    rows, cols, strides = (k, n, (1, k)) if transposed else (n, k, (k, 1))
    args = (_t(w), _t(F8), _t(F32), _t(U8), rows, cols, _ceil_div(cols, BLOCK), *strides)
    return args, dict(POW2=pow2, SOFT_FP8=False, GROUP=BLOCK)


def _block_gemm(out, m, n, k, a_rows, b_rows):
    """fp8_block_gemm_triton as linear_math calls it. (1, 128): forward (qx, sx, qw, sw) and dgrad (qdy, sdy, qwt,
    swt), both operands K-contiguous, 1x128 scales column-major, 128x128 ones row-major. (1, 1): wgrad
    (qdyt.t(), sdyt.t(), qxt.t(), sxt.t()): the 128x1 codes transposed back to K-contiguous [n, m] / [k, m] (here K
    is the token axis, padded to reference.wgrad_rows(tokens) by the quantizers), their scales [rows, ceil(K/128)]
    with stride 1 along rows."""
    kb = _ceil_div(k, BLOCK)
    if b_rows == BLOCK:
        scale_strides = (1, m, kb, 1)
    else:
        scale_strides = (1, m, 1, n)
    args = (_t(F8), _t(F8), _t(out), _t(F32), _t(F32), m, n, k, k, 1, k, 1, n, 1, *scale_strides, _bucket(m))
    return args, dict(A_SCALE_ROWS=a_rows, B_SCALE_ROWS=b_rows, INTERPRET=False, BLOCK_K=BLOCK)


def _splitk_gemm(out, m, n, k, split):
    """fp8_splitk_gemm_triton: forward operands; partial fp32 [split, m, n] (y itself when split == 1)."""
    kb = _ceil_div(k, BLOCK)
    per = _ceil_div(kb, split)
    args = (_t(F8), _t(F8), _t(out), _t(F32 if split > 1 else out), _t(F32), _t(F32), m, n, k, per,
            k, 1, k, 1, n, 1, 1, m, kb, 1, _bucket(m))
    return args, dict(SPLIT=split, INTERPRET=False, BLOCK_K=BLOCK)


def _splitk_reduce(out, m, n, split):
    return (_t(F32), _t(out), m * n), dict(SPLIT=split)


def _fused_decode(x, out, m, n, k, pow2, count, members, round_code):
    """_launch_fused_quant_gemm: x2 [m, k] K-contiguous; counter and flag (int32 for stacked siblings), or the
    scales pointer twice when not counting."""
    kb = _ceil_div(k, BLOCK)
    counter = (_t(I64), _t(BOOL if members == 1 else I32)) if count else (_t(F32), _t(F32))
    args = (_t(x), _t(F8), _t(out), _t(F32), *counter, m, n, k, k, k, 1, n, 1, kb, 1, _bucket(m))
    return args, dict(POW2=pow2, SOFT_FP8=False, COUNT=count, ROUND=round_code, MEMBERS=members, BLOCK_K=BLOCK)


def _producer(kind, dtype, m, k, need_t, pow2, members):
    """kernels.producers._launch: RMS norm (kind 0: weight [k], rstd fp32 [m]) or mul (kind 1: b [m, k], r = a);
    q_row / s_row over _gemm_rows(m) rows, s_row column-major; without need_t the 128x1 pointers are q_row / s_row
    again and their strides 0."""
    b_stride = 1 if kind == 0 else k
    r = _t(F32) if kind == 0 else _t(dtype)
    col_strides = (k, 1) if need_t else (0, 0)
    rows = _gemm_rows(m)
    args = (_t(dtype), _t(dtype), r, _t(dtype), _t(F8), _t(F32), _t(F8), _t(F32), _t(I64), _t(I32),
            m, k, wgrad_rows(m), k, b_stride, 1, rows, *col_strides, rows, _bucket(k), _bucket(m))
    return args, dict(KIND=kind, OUT_BF16=dtype == BF16, NEED_T=need_t, POW2=pow2, SOFT_FP8=False, MEMBERS=members,
                      GROUP=BLOCK)


# ------------------------------------------------------------------------------------------------------------
# The cases: every autotune config of each kernel's table, for every constexpr combination production launches
# (at the first shape listed), and every config at the other shapes with the commonest combination.
# ------------------------------------------------------------------------------------------------------------

X_DTYPES = (BF16, F16, F32)  # what _as_float_input lets through (fp64 arrives as fp32)
POW2S = (False, True)


def _cases_quantize_1x128_kernel():
    for pow2 in POW2S:
        for x in X_DTYPES:
            # (the division-free twins: each table's default on a GPU)
            for config in quantize._QUANT_1X128_CONFIGS + quantize._QUANT_1X128_DIV_FREE_TWINS:
                yield f"plain {DTYPE_NAMES[x]} pow2={pow2}", config, _quantize_1x128(x, TRAIN, K_IN, pow2, False, 1)
            # counting launches (FP8BlockLinear's forward): one linear (bool flag) or a shared input's members
            # (calclip.fp8.shared_input: gate/up 2, q/k/v 3; an int32 number of bad weights)
            for members in (1, 2, 3):
                for config in quantize._QUANT_1X128_COUNT_CONFIGS + quantize._QUANT_1X128_DIV_FREE_TWINS:
                    yield (f"count members={members} {DTYPE_NAMES[x]} pow2={pow2}", config,
                           _quantize_1x128(x, TRAIN, K_IN, pow2, True, members))
    for rows in (1, 7, RAGGED):  # decode and ragged token totals
        for config in quantize._QUANT_1X128_CONFIGS:
            yield f"plain bf16 rows={rows}", config, _quantize_1x128(BF16, rows, K_IN, False, False, 1)
        for config in quantize._QUANT_1X128_COUNT_CONFIGS:
            yield f"count members=1 bf16 rows={rows}", config, _quantize_1x128(BF16, rows, K_IN, False, True, 1)


def _cases_zero_token_rows_kernel():
    for column_major in (True, False):
        for k in (K_IN, 18944, 200):  # the model row's K, Qwen2.5-7B's down projection, a ragged last group
            for config in quantize._ZERO_ROWS_CONFIGS:
                yield f"rows={RAGGED} k={k} column_major={column_major}", config, _zero_token_rows(RAGGED, k,
                                                                                                  column_major)


def _dtype_pow2_and_ragged_cases(configs, build):
    """Every config at every input dtype and pow2 (TRAIN rows), then every config at the ragged token total."""
    for pow2 in POW2S:
        for x in X_DTYPES:
            for config in configs:
                yield f"{DTYPE_NAMES[x]} pow2={pow2}", config, build(x, TRAIN, K_IN, pow2)
    for config in configs:
        yield f"bf16 rows={RAGGED}", config, build(BF16, RAGGED, K_IN, False)


def _cases_quantize_128x1_kernel():
    configs = quantize._QUANT_128X1_CONFIGS + quantize._QUANT_128X1_DIV_FREE_TWINS + quantize._QUANT_128X1_CANDIDATES
    yield from _dtype_pow2_and_ragged_cases(configs, _quantize_128x1)


def _cases_quantize_128x128_kernel():
    for pow2 in POW2S:
        for w in X_DTYPES:
            for config in quantize._QUANT_128X128_CONFIGS:
                yield f"{DTYPE_NAMES[w]} pow2={pow2}", config, _quantize_128x128(w, N_OUT, K_IN, pow2)


def _cases_requantize_128x128_kernel():
    for transposed in (False, True):
        for pow2 in POW2S:
            for w in X_DTYPES:
                for config in quantize._QUANT_128X128_CONFIGS:
                    yield (f"{'W^T' if transposed else 'W'} {DTYPE_NAMES[w]} pow2={pow2}", config,
                           _requantize_128x128(w, N_OUT, K_IN, pow2, transposed))


GEMMS = {"forward/dgrad": (1, BLOCK), "wgrad": (1, 1)}


def _cases_fp8_block_gemm_kernel():
    for name, (a_rows, b_rows) in GEMMS.items():
        for out in X_DTYPES:
            for config in block_gemm._GEMM_CONFIGS:
                m, n, k = (TRAIN, N_OUT, K_IN) if b_rows == BLOCK else (N_OUT, K_IN, TRAIN)
                yield f"{name} {DTYPE_NAMES[out]}", config, _block_gemm(out, m, n, k, a_rows, b_rows)
    for config in block_gemm._GEMM_CONFIGS:  # ragged token totals: the forward's M, the wgrad's K (whole groups)
        yield f"forward/dgrad bf16 M={RAGGED}", config, _block_gemm(BF16, RAGGED, N_OUT, K_IN, 1, BLOCK)
        yield (f"wgrad bf16 tokens={RAGGED} K={wgrad_rows(RAGGED)}", config,
               _block_gemm(BF16, N_OUT, K_IN, wgrad_rows(RAGGED), 1, 1))


def _cases_fp8_splitk_gemm_kernel():
    for split in (1, 2, 4, 8, 16):  # splitk_splits: powers of two up to SPLITK_MAX_SPLIT
        for out in X_DTYPES:
            for config in splitk_gemm._SPLITK_CONFIGS:
                yield f"split={split} {DTYPE_NAMES[out]} M=64", config, _splitk_gemm(out, 64, 2048, K_IN, split)
    for rows in (1, 7):
        for config in splitk_gemm._SPLITK_CONFIGS:
            yield f"split=4 bf16 M={rows}", config, _splitk_gemm(BF16, rows, 2048, K_IN, 4)


def _cases_splitk_reduce_kernel():
    for split in (2, 4, 8, 16):
        for out in X_DTYPES:
            yield f"split={split} {DTYPE_NAMES[out]}", splitk_gemm._REDUCE_CONFIG, _splitk_reduce(out, 64, 2048, split)


# (x dtype, ROUND, output dtype): a bf16 / fp16 / fp32 layer, and fp32 activations under bf16 / fp16 autocast
# (round_to: the cast done in registers)
DECODE_DTYPES = ((BF16, 0, BF16), (F16, 0, F16), (F32, 0, F32), (F32, 1, BF16), (F32, 2, F16))


def _cases_fp8_linear_fused_quant_kernel():
    for x, round_code, out in DECODE_DTYPES:
        for pow2 in POW2S:
            # the layer counts (one linear: bool flag; stacked siblings q/k/v, gate/up: int32); the public
            # fp8_linear_fused_quant_gemm may not
            for count, members in ((True, 1), (True, 2), (True, 3), (False, 1)):
                for config in fused_decode._FUSED_CONFIGS:
                    yield (f"x={DTYPE_NAMES[x]} round={round_code} out={DTYPE_NAMES[out]} pow2={pow2} count={count} "
                           f"members={members} M=7", config,
                           _fused_decode(x, out, 7, N_OUT, K_IN, pow2, count, members, round_code))
    for rows in (1, 64):
        for config in fused_decode._FUSED_CONFIGS:
            yield (f"x=bf16 round=0 out=bf16 pow2=False count=True members=1 M={rows}", config,
                   _fused_decode(BF16, BF16, rows, N_OUT, K_IN, False, True, 1, 0))


def _cases_producer_quantize_kernel():
    # kind 0: the RMSNorm before q/k/v (3 members) or gate/up (2), or one fused linear (1); kind 1: SiLU(gate) * up
    # before down_proj (1). bf16 is what the layer's forwards fuse; the ops take fp32 as well.
    for kind, members_list in ((0, (1, 2, 3)), (1, (1,))):
        for dtype in producers.PRODUCER_DTYPES:
            for need_t in (True, False):
                for pow2 in POW2S:
                    for members in members_list:
                        for config in producers._PRODUCER_CONFIGS:
                            yield (f"{('rms_norm', 'mul')[kind]} {DTYPE_NAMES[dtype]} need_t={need_t} pow2={pow2} "
                                   f"members={members}", config,
                                   _producer(kind, dtype, TRAIN, K_IN, need_t, pow2, members))
    for kind in (0, 1):
        for rows in (1, RAGGED):
            for config in producers._PRODUCER_CONFIGS:
                yield (f"{('rms_norm', 'mul')[kind]} bf16 need_t={rows > 1} pow2=False members=1 M={rows}", config,
                       _producer(kind, BF16, rows, K_IN, rows > 1, False, 1))


KERNELS = {
    "_quantize_1x128_kernel": (quantize._quantize_1x128_kernel, _cases_quantize_1x128_kernel),
    "_zero_token_rows_kernel": (quantize._zero_token_rows_kernel, _cases_zero_token_rows_kernel),
    "_quantize_128x1_kernel": (quantize._quantize_128x1_kernel, _cases_quantize_128x1_kernel),
    "_quantize_128x128_kernel": (quantize._quantize_128x128_kernel, _cases_quantize_128x128_kernel),
    "_requantize_128x128_kernel": (quantize._requantize_128x128_kernel, _cases_requantize_128x128_kernel),
    "_fp8_block_gemm_kernel": (block_gemm._fp8_block_gemm_kernel, _cases_fp8_block_gemm_kernel),
    "_fp8_splitk_gemm_kernel": (splitk_gemm._fp8_splitk_gemm_kernel, _cases_fp8_splitk_gemm_kernel),
    "_splitk_reduce_kernel": (splitk_gemm._splitk_reduce_kernel, _cases_splitk_reduce_kernel),
    "_fp8_linear_fused_quant_kernel": (fused_decode._fp8_linear_fused_quant_kernel,
                                       _cases_fp8_linear_fused_quant_kernel),
    "_producer_quantize_kernel": (producers._producer_quantize_kernel, _cases_producer_quantize_kernel),
}


def _config_name(config) -> str:
    tiles = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{tiles} warps={config.num_warps} stages={config.num_stages}".strip()


def _resources(compiled, options) -> dict:
    """Registers and stack-frame bytes per thread of the cubin's kernel (cuobjdump --dump-resource-usage; a spill
    lives in the stack frame, which Triton's launcher reports in n_spills); when the frame is not empty, the spill
    stores and loads from ptxas -v on the same PTX with the flags Triton's make_cubin passes."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp) / "k.cubin", Path(tmp) / "k.ptx"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}
        found = {"regs": fields["REG"], "stack": fields["STACK"], "local": fields["LOCAL"],
                 "spill_stores": 0, "spill_loads": 0}
        if fields["STACK"] or fields["LOCAL"]:
            ptx.write_text(compiled.asm["ptx"])
            fmad = [] if options.enable_fp_fusion else ["--fmad=false"]
            log = subprocess.run([str(PTXAS), "-lineinfo", *fmad, "-v", f"--gpu-name={SM_ARCH}", str(ptx), "-o",
                                  str(Path(tmp) / "k.o")], capture_output=True, text=True, check=True).stderr
            stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
            regs = int(re.search(r"Used (\d+) registers", log).group(1))
            if regs != fields["REG"]:  # the rerun must be the compile Triton made
                raise RuntimeError(f"ptxas -v rerun used {regs} registers, the cubin {fields['REG']}")
            found.update(spill_stores=int(stores), spill_loads=int(loads))
    return found


def compile_case(backend, fn, args, constexprs, config) -> dict:
    """Bind the arguments as JITFunction.run does for the sm_90 backend, then compile to cubin."""
    kwargs = {**constexprs, **config.all_kwargs(), "debug": False, "instrumentation_mode": ""}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    ptx = compiled.asm["ptx"]
    return {"shared": compiled.metadata.shared, **_resources(compiled, options),
            "ptx": {name: len(re.findall(pattern, ptx)) for name, pattern in PTX_PATTERNS.items()}}


def main(names: list[str]) -> None:
    backend = make_backend(TARGET)
    for name in names or list(KERNELS):
        fn, cases = KERNELS[name]
        for case, config, (args, constexprs) in cases():
            row = {"kernel": name, "case": case, "config": _config_name(config), "num_warps": config.num_warps}
            start = time.perf_counter()
            try:
                row.update(ok=True, **compile_case(backend, fn, args, constexprs, config))
            except Exception as err:  # reported per case: the test lists every failure at once
                row.update(ok=False, error=f"{type(err).__name__}: {err}"[-2000:], trace=traceback.format_exc()[-2000:])
            row["seconds"] = round(time.perf_counter() - start, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
