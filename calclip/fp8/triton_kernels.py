"""Triton kernels for the FP8 block recipe: three quantizers and the block-scaled FP8 GEMM.

Every quantizer has the signature of its plain-torch twin in ``calclip.fp8.reference`` and reproduces it
EXACTLY: the same fp32 scales bit for bit and the same e4m3fn codes (NaN blocks: NaN scale and NaN codes).
The numerics contract (IEEE ``div_rn`` for both the scale and ``x / s``, ``AMAX_FLOOR``, exact power-of-two
round-up, clamp before the cast, NaN for blocks with a non-finite element) is written out once, in
``reference.py``'s module docstring; the kernels below follow it step by step.

Each op is a pair: a small ``@triton.jit`` kernel and a launcher that checks its inputs, allocates outputs,
builds the grid and launches. Kernels read every input once (no separate amax pass): a program loads a tile
of whole 128-element groups into registers, reduces it, and writes codes and scales.

On CUDA the launchers autotune the tile shapes over a few configs (keyed on the inner dim and a bucket of the
outer one, so a new sequence length does not retune); set ``CALCLIP_TRITON_AUTOTUNE=0`` to use the default
config only. The timings are kept on disk in Triton's cache (``triton.autotune(cache_results=True)``, keyed by the
Triton version, the GPU target, the kernel source, the key and the configs), so a second process on the machine
reuses them instead of re-timing every config; ``CALCLIP_TRITON_AUTOTUNE_CACHE=0`` turns that off. On CPU tensors
the kernels run under ``TRITON_INTERPRET=1`` (tests only): the interpreter's own fp32 -> fp8 cast truncates
instead of rounding and cannot produce NaN, so in that mode the kernels encode the e4m3fn bits in software
(``_e4m3fn_bits``) and store them through a uint8 view. The GPU tests check that this software encoder equals
the hardware ``cvt.rn.satfinite.e4m3x2.f32`` on every fp32 input they try.

This module imports triton at the top; ``calclip.fp8.quant`` / ``gemm`` import it lazily, only on CUDA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton import knobs
from torch import Tensor
from torch.library import wrap_triton

from calclip.fp8.config import BLOCK, FP8_DTYPE, FP8_E4M3_MAX
from calclip.fp8.quant import is_traced, size_hint
from calclip.fp8.reference import AMAX_FLOOR

__all__ = [
    "quantize_1x128",
    "quantize_128x1",
    "quantize_128x128",
    "requantize_128x128_",
    "quantize_1x128_and_128x1",
    "fp8_block_gemm_triton",
    "fp8_splitk_gemm_triton",
    "fp8_linear_fused_quant_gemm",
    "fp8_linear_decode_unchecked",
]

# Constants used inside kernels must be tl.constexpr globals (Triton rejects plain Python globals in @jit code).
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
# fp32 bit fields for the exact power-of-two round-up of a scale (reference.round_scale_up_to_pow2).
_FP32_MANTISSA_MASK = tl.constexpr(0x007FFFFF)
_FP32_EXPONENT_MASK = tl.constexpr(0x7F800000)
_FP32_EXPONENT_ONE = tl.constexpr(0x00800000)
# e4m3fn: 3 mantissa bits, exponent bias 7; smallest normal 2**-6; subnormal step 2**-9; NaN code 0x7F.
_E4M3_MANTISSA_BITS = tl.constexpr(3)
_E4M3_BIAS = tl.constexpr(7)
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEPS = tl.constexpr(2.0**9)  # 1 / subnormal step
_E4M3_NAN_CODE = tl.constexpr(0x7F)
# Adding then subtracting 1.5 * 2**23 rounds an fp32 in [0, 2**22) to the nearest integer, ties to even.
_RNE_MAGIC = tl.constexpr(12582912.0)

_AUTOTUNE = os.environ.get("CALCLIP_TRITON_AUTOTUNE", "1") != "0"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """Plain-Python next power of two (triton.next_power_of_2 is a constexpr function: slow to call on the host)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _bucket(n: int) -> int:
    """Autotune key for an outer (token) dim: next power of two, capped, so varying lengths reuse a tuning.
    A symbolic size (torch.compile with dynamic shapes) is passed through: Inductor tunes the kernels itself."""
    if type(n) is not int:
        return n
    return min(_next_pow2(max(n, 1)), 1 << 16)


def _check_block(block: int) -> None:
    if block != BLOCK:
        raise ValueError(f"the Triton kernels support block={BLOCK} only, got block={block}")


def _check_device(*tensors: Tensor) -> bool:
    """Return True when the kernels must encode fp8 in software (CPU tensors under TRITON_INTERPRET=1)."""
    device = tensors[0].device
    if len(tensors) > 1 and any(t.device != device for t in tensors[1:]):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if device.type == "cuda":
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        return True
    raise ValueError(f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}")


def _counter_operands(x: Tensor, nonfinite_count: Tensor, weight_bad: Tensor | None) -> tuple[bool, Tensor]:
    """(soft_fp8, weight_bad) for a kernel that adds x's non-finite rows to ``nonfinite_count`` (int64 [] on x's
    device; checked here) — every row when ``weight_bad`` (bool [], default False) is set."""
    if weight_bad is None:
        weight_bad = torch.zeros((), dtype=torch.bool, device=nonfinite_count.device)
    soft_fp8 = _check_device(x, nonfinite_count, weight_bad)
    if nonfinite_count.dtype != torch.int64 or nonfinite_count.numel() != 1:
        raise ValueError(f"nonfinite_count must be an int64 [] tensor, got {nonfinite_count.dtype} "
                         f"{tuple(nonfinite_count.shape)}")
    return soft_fp8, weight_bad


def _as_float_input(x: Tensor) -> Tensor:
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"expected a bf16/fp16/fp32/fp64 tensor, got {x.dtype}")
    return x.float() if x.dtype == torch.float64 else x  # fp64 is rounded to fp32 first, as the reference does


# ----------------------------------------------------------------------------------------------------------
# Shared pieces: one scale per block, and codes from a block and its scale.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _abs_max(x, axis: tl.constexpr):
    """max |x| along ``axis``, +Inf if any element is NaN or +-Inf: one reduction gives both the amax and the
    non-finite test (``amax == inf``). NaN is mapped to Inf first because a max reduction may drop NaN."""
    return tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=axis)


@triton.jit
def _block_scale(amax, nonfinite, POW2: tl.constexpr):
    """amax (from _abs_max), nonfinite (amax == inf), per block -> fp32 dequantization scale, NaN for
    non-finite blocks.

    s = max(amax, AMAX_FLOOR) / FP8_E4M3_MAX with IEEE division; POW2 rounds s up to a power of two exactly.
    """
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
    if POW2:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = bits & _FP32_EXPONENT_MASK
        has_mantissa = (bits & _FP32_MANTISSA_MASK) != 0
        scale = tl.where(has_mantissa, exponent + _FP32_EXPONENT_ONE, exponent).to(tl.float32, bitcast=True)
    return tl.where(nonfinite, float("nan"), scale)


@triton.jit
def _scaled_codes(x, scale, nonfinite):
    """x fp32, scale and nonfinite broadcastable to x -> fp32 values on the fp8 grid's range [-448, 448] or NaN."""
    codes = tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX, _FP8_MAX)
    return tl.where(nonfinite, float("nan"), codes)  # explicit: clamp's NaN behaviour is unspecified


@triton.jit
def _e4m3fn_bits(v):
    """fp32 in [-448, 448] or NaN -> e4m3fn bit pattern (int32 in [0, 255]), round to nearest even.

    The software twin of the hardware cast, used only under the interpreter (see the module docstring).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    is_nan = v != v
    mag = tl.where(is_nan, 0.0, tl.abs(v))  # NaN is encoded at the end; keep it out of the integer casts
    # Subnormals (|v| < 2**-6) count steps of 2**-9; the carry to 8 is the smallest normal's code.
    sub_code = ((mag * _E4M3_SUBNORMAL_STEPS + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)
    # Normals: round the fp32 mantissa to 3 bits, ties to even; a carry ripples into the exponent.
    mag_bits = mag.to(tl.int32, bitcast=True)
    drop = 23 - _E4M3_MANTISSA_BITS
    mag_bits = mag_bits + ((1 << (drop - 1)) - 1) + ((mag_bits >> drop) & 1)
    normal_code = (mag_bits >> drop) - ((127 - _E4M3_BIAS) << _E4M3_MANTISSA_BITS)
    code = tl.where(mag < _E4M3_MIN_NORMAL, sub_code, normal_code) | sign
    return tl.where(is_nan, _E4M3_NAN_CODE, code)


@triton.jit
def _store_codes(q_ptrs, codes, mask, SOFT_FP8: tl.constexpr):
    """Store fp32 codes as e4m3fn: hardware cast, or software bits through a uint8 pointer (interpreter)."""
    if SOFT_FP8:
        tl.store(q_ptrs, _e4m3fn_bits(codes).to(tl.uint8), mask=mask)
    else:
        tl.store(q_ptrs, codes.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _codes_out(q: Tensor, soft_fp8: bool) -> Tensor:
    return q.view(torch.uint8) if soft_fp8 else q


class _Tuned:
    """A kernel, its autotune configs and the config chosen per autotune key.

    The first call with a new key runs Triton's autotuner (it times every config, then launches the best);
    later calls look the config up in a dict and launch the plain kernel with it, so a steady-state call pays
    one dict lookup instead of the autotuner's per-call argument dicts and key building. The interpreter and
    ``CALCLIP_TRITON_AUTOTUNE=0`` always use the first (default) config.

    The timings persist in Triton's on-disk cache (``cache_results``; off with ``CALCLIP_TRITON_AUTOTUNE_CACHE=0``):
    in the first H200 comparison (docs/benchmarks.md, 2026-12-01) every FP8 process spent ~190 s more than BF16 on
    its first step, twelve processes compiling and timing the same configs at once.
    """

    def __init__(self, kernel, configs: list[triton.Config], key: list[str],
                 restore_value: list[str] | None = None) -> None:
        if not configs:  # a config table filtered to nothing for some shape: say so here, not as an IndexError
            raise ValueError(f"{kernel.__name__}: no autotune config to launch with")
        self.kernel = kernel
        self.default = configs[0]
        # restore_value: arguments the kernel accumulates into (a counter), restored after each timing run
        cache_results = os.environ.get("CALCLIP_TRITON_AUTOTUNE_CACHE", "1") != "0"
        self.autotuner = triton.autotune(configs=configs, key=key, restore_value=restore_value,
                                         cache_results=cache_results)(kernel)
        self.chosen: dict[tuple, tuple[dict, dict]] = {}  # key -> (config.kwargs, all launch kwargs)
        self._default_launch = (self.default.kwargs, self.default.all_kwargs())
        # what torch.compile records (wrap_triton): the configs to tune over, or the default alone
        self.traced = self.autotuner if _AUTOTUNE else triton.autotune(
            configs=[self.default], key=key, restore_value=restore_value)(kernel)

    def launch(self, grid, key: tuple, soft_fp8: bool, *args, **kwargs) -> None:
        """grid: meta-parameter dict -> launch grid; key: the autotune key values plus the input dtypes.
        ``args``: every non-constexpr kernel parameter, positionally; ``kwargs``: the constexpr ones.
        Under torch.compile's tracing (calclip's triton ops, linear.py) the launch is recorded through
        ``wrap_triton``, so Inductor launches the kernel from its own generated code."""
        if is_traced(args[0]):
            wrap_triton(self.traced)[grid](*args, **kwargs)
            return
        launch = self._default_launch if soft_fp8 or not _AUTOTUNE else self.chosen.get(key)
        if launch is None:
            self.autotuner[grid](*args, **kwargs)
            best = self.autotuner.best_config
            self.chosen[key] = (best.kwargs, best.all_kwargs())
            return
        meta, config_kwargs = launch
        if soft_fp8 or not _FAST_LAUNCH:
            self.kernel[grid(meta)](*args, **kwargs, **config_kwargs)
            return
        _fast_launch(self.kernel, grid(meta), args, kwargs, config_kwargs)


# Triton's JITFunction.run re-binds and re-specializes every argument, looks the kernel up and checks globals on
# every call: tens of microseconds of host time per launch, the largest part of FP8BlockLinear's host time on the
# H200 host (issue 8). Once a launch has compiled, later launches with the same specialization call the compiled
# kernel's C launcher directly. The key holds everything Triton specializes on: each tensor's dtype and 16-byte
# alignment, each int's ==1 / %16 / 64-bit class, the constexpr values and the launch options.
_FAST_LAUNCH = os.environ.get("CALCLIP_TRITON_FAST_LAUNCH", "1") != "0"
_compiled_launches: dict[tuple, tuple] = {}


_MAX_LAUNCH_ENTRIES = 1 << 14  # one per distinct argument tuple (shapes, strides); cleared when full


def _launch_hook(hook):
    """A Triton launch hook, or None when there is none to call. Triton 3.6 keeps each hook in a ``HookChain`` that
    exists even when empty, and its own launch path then builds the launch metadata and calls both empty chains from
    C on every launch; calclip's passes None instead, as Triton does where no hook was ever set."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


def _fast_launch(kernel, grid: tuple, args: tuple, kwargs: dict, config_kwargs: dict) -> None:
    device = torch.cuda.current_device()  # Triton launches on the current device too
    # The exact int arguments (shapes, strides) and each tensor's dtype and address mod 16: a finer key than
    # Triton's specialization (==1, %16), so a hit always means Triton would have picked this very kernel.
    key = (kernel, device, id(config_kwargs), *kwargs.values(),
           *[a if type(a) is int else (a.dtype, a.data_ptr() & 15) for a in args])
    entry = _compiled_launches.get(key)
    if entry is None:
        if len(_compiled_launches) >= _MAX_LAUNCH_ENTRIES:
            _compiled_launches.clear()
        compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs, **config_kwargs)  # compiles and launches
        names = kernel.arg_names[len(args):]  # constexpr parameters come last in every kernel of this module
        merged = {**kwargs, **config_kwargs}
        _compiled_launches[key] = (compiled, tuple(merged[n] for n in names))
        return
    compiled, constexprs = entry
    enter, leave = _launch_hook(knobs.runtime.launch_enter_hook), _launch_hook(knobs.runtime.launch_exit_hook)
    stream = torch._C._cuda_getCurrentRawStream(device)
    hooked = enter is not None or leave is not None
    metadata = compiled.launch_metadata(grid, stream, *args, *constexprs) if hooked else None
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                 *args, *constexprs)


# ----------------------------------------------------------------------------------------------------------
# 1x128: groups of 128 along the last dim (activations, output gradients).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_1x128_groups(x_ptr, q_ptr, s_ptr, rows, first_group, R, K, NB, stride_xr, stride_sr, stride_sg,
                           POW2: tl.constexpr, SOFT_FP8: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """Quantize the groups [first_group, first_group + GROUPS) of ``rows`` [BLOCK_R] (int64), loaded once as a
    [BLOCK_R, GROUPS, GROUP] tile -> int32 [BLOCK_R]: 1 where a row has a non-finite group among them."""
    groups = first_group + tl.arange(0, GROUPS)
    cols = groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (rows[:, None, None] < R) & (cols < K)  # ragged last group and ragged last row tile
    x = tl.load(x_ptr + rows[:, None, None] * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    amax = _abs_max(x, 2)  # [BLOCK_R, GROUPS]
    nonfinite = amax == float("inf")
    scale = _block_scale(amax, nonfinite, POW2)
    codes = _scaled_codes(x, scale[:, :, None], nonfinite[:, :, None])
    _store_codes(q_ptr + rows[:, None, None] * K + cols, codes, mask, SOFT_FP8)
    s_mask = (rows[:, None] < R) & (groups[None, :] < NB)
    tl.store(s_ptr + rows[:, None] * stride_sr + groups[None, :] * stride_sg, scale, mask=s_mask)
    return tl.max(nonfinite.to(tl.int32), axis=1)  # padded groups and rows are finite zeros


@triton.jit
def _quantize_1x128_kernel(
    x_ptr, q_ptr, s_ptr,  # x [R, K] (last dim contiguous), q [R, K] contiguous, s [R, NB] any strides
    R, K, NB, stride_xr, stride_sr, stride_sg,
    R_BUCKET,  # autotune key only
    count_ptr, weight_bad_ptr,  # COUNT only: int64 [] counter += bad rows; bool [] "the weight has a NaN block"
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr, COUNT: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
):
    """One program: BLOCK_R rows x GROUPS groups of GROUP elements, loaded once as a [BLOCK_R, GROUPS, GROUP] tile.

    COUNT (launched with one program per BLOCK_R rows): the program walks its rows' groups GROUPS at a time, so it
    holds whole rows however wide they are, and adds to ``count_ptr`` the number of its rows that have a non-finite
    group (every valid row when ``weight_bad_ptr`` is set) — the FP8BlockLinear non-finite token count, from
    registers this kernel already holds, one atomic per program with bad rows."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    if COUNT:
        row_bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
        if SOFT_FP8:  # the interpreter passes NB as a 1-element array (see _fp8_block_gemm_kernel)
            g0 = 0
            while g0 < NB:
                row_bad = tl.maximum(row_bad, _quantize_1x128_groups(
                    x_ptr, q_ptr, s_ptr, rows, g0, R, K, NB, stride_xr, stride_sr, stride_sg,
                    POW2, SOFT_FP8, GROUPS, GROUP))
                g0 += GROUPS
        else:
            for g0 in range(0, NB, GROUPS):
                row_bad = tl.maximum(row_bad, _quantize_1x128_groups(
                    x_ptr, q_ptr, s_ptr, rows, g0, R, K, NB, stride_xr, stride_sr, stride_sg,
                    POW2, SOFT_FP8, GROUPS, GROUP))
        valid = rows < R
        weight_bad = tl.load(weight_bad_ptr).to(tl.int32)
        n_bad = tl.where(weight_bad != 0, tl.sum(valid.to(tl.int32), axis=0), tl.sum(row_bad, axis=0))
        tl.atomic_add(count_ptr, n_bad.to(tl.int64), mask=n_bad > 0)
    else:
        _quantize_1x128_groups(x_ptr, q_ptr, s_ptr, rows, tl.program_id(1) * GROUPS, R, K, NB, stride_xr, stride_sr,
                               stride_sg, POW2, SOFT_FP8, GROUPS, GROUP)


_QUANT_1X128_DEFAULT = triton.Config({"BLOCK_R": 16, "GROUPS": 4}, num_warps=8)
_QUANT_1X128_CONFIGS = [
    _QUANT_1X128_DEFAULT,
    triton.Config({"BLOCK_R": 8, "GROUPS": 4}, num_warps=4),
    triton.Config({"BLOCK_R": 32, "GROUPS": 2}, num_warps=8),
    triton.Config({"BLOCK_R": 16, "GROUPS": 8}, num_warps=8),
    triton.Config({"BLOCK_R": 4, "GROUPS": 8}, num_warps=4),
    triton.Config({"BLOCK_R": 1, "GROUPS": 8}, num_warps=4),  # decode: a handful of rows
]
_quantize_1x128_tuned = _Tuned(_quantize_1x128_kernel, _QUANT_1X128_CONFIGS, key=["K", "R_BUCKET"])


def _scales_out(rows: int, nb: int, column_major: bool, device: torch.device) -> Tensor:
    """fp32 [rows, nb], row-major, or column-major (the transpose of a contiguous [nb, rows])."""
    if column_major:
        return torch.empty(nb, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, nb, dtype=torch.float32, device=device)


# Counting launches: one program per BLOCK_R rows, which walks its rows' groups GROUPS at a time (the kernel's
# loop), so it holds whole rows at any K. Rows of up to _COUNT_ONE_PASS_GROUPS groups (K <= 16384) take one pass:
# GROUPS = next_pow2(NB), tiles of about 2K-16K elements (the configs the H200 ran since counting moved into the
# kernel). Wider rows (Qwen2.5-7B's down projection, K = 18944; Llama-3-70B's, K = 28672) walk chunks: a whole
# row of next_pow2(NB) = 256 groups in one tile spills registers on sm_90 (ptxas: 2 KB of spill stores at 16 warps,
# 312 bytes at 32) and, at NB = 148, leaves 42% of its lanes masked; a chunk of 16-64 groups does neither (ptxas:
# 101-216 registers, no spills, for every config of _COUNT_CHUNK_CONFIGS with and without POW2; 2 rows x 64 groups at
# 16 warps spilled, so it is not one of them).
_COUNT_ELEMENTS = (2048, 16384)
_COUNT_ONE_PASS_GROUPS = _COUNT_ELEMENTS[1] // BLOCK
_COUNT_CHUNK_DEFAULT = triton.Config({"BLOCK_R": 1, "GROUPS": 32}, num_warps=8)
_COUNT_CHUNK_CONFIGS = [
    _COUNT_CHUNK_DEFAULT,
    triton.Config({"BLOCK_R": 1, "GROUPS": 32}, num_warps=4),
    triton.Config({"BLOCK_R": 2, "GROUPS": 32}, num_warps=8),
    triton.Config({"BLOCK_R": 4, "GROUPS": 16}, num_warps=8),
    triton.Config({"BLOCK_R": 1, "GROUPS": 64}, num_warps=8),
    triton.Config({"BLOCK_R": 1, "GROUPS": 64}, num_warps=16),
    triton.Config({"BLOCK_R": 4, "GROUPS": 32}, num_warps=16),
]
_count_tuned: dict[int, _Tuned] = {}  # one per one-pass group count; key 0: the chunked launches


def _counting_configs(groups: int) -> list[triton.Config]:
    """Autotune configs of the counting launch for rows of NB <= ``groups`` groups (``groups`` = next_pow2(NB)).
    Never empty: a one-pass table always holds a single-row config, and wider rows take the chunked table."""
    if groups > _COUNT_ONE_PASS_GROUPS:
        return list(_COUNT_CHUNK_CONFIGS)
    configs = []
    for block_r in (max(1, 4096 // (groups * BLOCK)), 1, 2, 4, 8, 16, 32):
        elements = block_r * groups * BLOCK
        if elements <= _COUNT_ELEMENTS[1] and (elements >= _COUNT_ELEMENTS[0] or block_r == 1):
            for warps in (4, 8) if elements <= 4096 else (8, 16):
                config = triton.Config({"BLOCK_R": block_r, "GROUPS": groups}, num_warps=warps)
                if all(c.kwargs != config.kwargs or c.num_warps != warps for c in configs):
                    configs.append(config)
    return configs


def _counting_kernel(groups: int) -> _Tuned:
    """The 1x128 kernel tuned for counting launches over rows of NB <= ``groups`` = next_pow2(NB) groups."""
    table = groups if groups <= _COUNT_ONE_PASS_GROUPS else 0
    tuned = _count_tuned.get(table)
    if tuned is None:
        tuned = _count_tuned[table] = _Tuned(_quantize_1x128_kernel, _counting_configs(groups), key=["K", "R_BUCKET"],
                                             restore_value=["count_ptr"])
    return tuned


def quantize_1x128(x: Tensor, *, block: int = BLOCK, pow2: bool = False, gemm_layout: bool = False,
                   nonfinite_count: Tensor | None = None,
                   weight_bad: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Quantize in groups of 128 along the last dim (activations, output gradients). Matches the reference.

    x: [..., K] bf16/fp16/fp32 (fp64 rounded to fp32), any leading dims, K ragged allowed
    -> (q float8_e4m3fn [..., K] contiguous, s float32 [..., ceil(K / 128)], x ~= q * s)
    s is contiguous like the reference's; ``gemm_layout=True`` makes it column-major over the flattened rows
    (the strides torch._scaled_mm demands of a 1x128 operand's scale, so gemm.py's re-layout is a no-op).
    nonfinite_count: int64 [] tensor on x's device; when given, the kernel adds the number of rows (tokens)
    with a non-finite group to it — every row when ``weight_bad`` (bool [], optional) is set — without a sync
    or another launch, at any K. Codes and scales are the same with or without it.
    """
    _check_block(block)
    count = nonfinite_count is not None
    soft_fp8, weight_bad = _counter_operands(x, nonfinite_count, weight_bad) if count else (_check_device(x), None)
    if x.dim() < 1:
        raise ValueError("quantize_1x128 needs at least one dim")
    x = _as_float_input(x)
    k, nb = x.shape[-1], _ceil_div(x.shape[-1], block)
    r = x.numel() // k if k else 0
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    s2 = _scales_out(r, nb, gemm_layout, x.device)
    s = s2.view(*x.shape[:-1], nb)
    if x.numel() == 0:
        return q, s
    x2 = x.reshape(r, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if count:
        groups = _next_pow2(nb)
        _counting_kernel(groups).launch(
            lambda meta: (_ceil_div(r, meta["BLOCK_R"]), 1), (k, _bucket(r), x2.dtype, groups), soft_fp8,
            x2, _codes_out(q, soft_fp8), s2, r, k, nb, x2.stride(0), s2.stride(0), s2.stride(1), _bucket(r),
            nonfinite_count, weight_bad, POW2=pow2, SOFT_FP8=soft_fp8, COUNT=True, GROUP=block)
        return q, s
    _quantize_1x128_tuned.launch(
        lambda meta: (_ceil_div(r, meta["BLOCK_R"]), _ceil_div(nb, meta["GROUPS"])),
        (k, _bucket(r), x2.dtype), soft_fp8,
        x2, _codes_out(q, soft_fp8), s2, r, k, nb, x2.stride(0), s2.stride(0), s2.stride(1), _bucket(r),
        s2, s2, POW2=pow2, SOFT_FP8=soft_fp8, COUNT=False, GROUP=block)
    return q, s


# ----------------------------------------------------------------------------------------------------------
# 128x1: groups of 128 rows along dim 0, one per column (the token axis of the weight-gradient GEMM).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_128x1_kernel(
    x_ptr, q_ptr, s_ptr,  # x [M, K] any strides; q^T [K, M] contiguous; s [NB, K] any strides
    M, K, stride_xm, stride_xk, stride_sb, stride_sk,
    M_BUCKET,  # autotune key only
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: one group of GROUP rows x BLOCK_K columns; reduces over rows, stores codes transposed."""
    pid_m = tl.program_id(0)
    rows = (pid_m * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)  # ragged last row group and column tile
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = _abs_max(x, 0)  # [BLOCK_K]
    nonfinite = amax == float("inf")
    scale = _block_scale(amax, nonfinite, POW2)
    codes = _scaled_codes(x, scale[None, :], nonfinite[None, :])
    _store_codes(q_ptr + cols[None, :] * M + rows[:, None], codes, mask, SOFT_FP8)
    tl.store(s_ptr + pid_m * stride_sb + cols * stride_sk, scale, mask=cols < K)


_QUANT_128X1_DEFAULT = triton.Config({"BLOCK_K": 64}, num_warps=8)
_QUANT_128X1_CONFIGS = [
    _QUANT_128X1_DEFAULT,
    triton.Config({"BLOCK_K": 32}, num_warps=4),
    triton.Config({"BLOCK_K": 64}, num_warps=4),
    triton.Config({"BLOCK_K": 128}, num_warps=8),
    triton.Config({"BLOCK_K": 128}, num_warps=16),
]
_quantize_128x1_tuned = _Tuned(_quantize_128x1_kernel, _QUANT_128X1_CONFIGS, key=["K", "M_BUCKET"])


def _check_2d(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} needs a 2-D tensor, got shape {tuple(x.shape)}")


def quantize_128x1(x: Tensor, *, block: int = BLOCK, pow2: bool = False,
                   gemm_layout: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D tensor in groups of 128 rows along dim 0, one group per column. Matches the reference.

    x: [M, K] bf16/fp16/fp32, any strides, M and K ragged allowed
    -> (q float8_e4m3fn [M, K], s float32 [ceil(M / 128), K]); like the reference, q is the transpose of a
       contiguous [K, M] tensor (column-major), the layout a GEMM contracting over M reads, and so is s;
       ``gemm_layout=True`` makes s row-major instead (contiguous [ceil(M/128), K]: then the wgrad operands'
       scales s.t() are already column-major, as torch._scaled_mm demands, and gemm.py copies nothing).
    """
    _check_block(block)
    soft_fp8 = _check_device(x)
    _check_2d("quantize_128x1", x)
    x = _as_float_input(x)
    m, k = x.shape
    nb = _ceil_div(m, block)
    q_t = torch.empty(k, m, dtype=FP8_DTYPE, device=x.device)
    s = _scales_out(nb, k, not gemm_layout, x.device)
    if x.numel() == 0:
        return q_t.t(), s
    _quantize_128x1_tuned.launch(
        lambda meta: (nb, _ceil_div(k, meta["BLOCK_K"])), (k, _bucket(m), x.dtype), soft_fp8,
        x, _codes_out(q_t, soft_fp8), s, m, k, x.stride(0), x.stride(1), s.stride(0), s.stride(1), _bucket(m),
        POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    return q_t.t(), s


# ----------------------------------------------------------------------------------------------------------
# 1x128 and 128x1 from one read: the two quantizations FP8BlockLinear needs of x (forward) and dy (backward).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_1x128_and_128x1_kernel(
    x_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr,
    # x [M, K] any strides; q_row [M, K] contiguous, s_row [M, NBK] any strides;
    # q_col^T [K, M] contiguous, s_col [NBM, K] any strides
    M, K, stride_xm, stride_xk, stride_srm, stride_srk, stride_scm, stride_sck,
    K_BUCKET, M_BUCKET,  # autotune key only
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr, GROUP: tl.constexpr,
):
    """One program: a [GROUP, GROUP] tile of x, loaded once. Its row amaxes are the scales of GROUP 1x128
    groups, its column amaxes those of GROUP 128x1 groups; both code sets are written from the same registers."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    cols = (pid_k * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)  # ragged edges: masked elements are 0, amax unchanged
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)

    row_amax = _abs_max(x, 1)  # [GROUP]: one 1x128 group per row
    row_nonfinite = row_amax == float("inf")
    row_scale = _block_scale(row_amax, row_nonfinite, POW2)
    row_codes = _scaled_codes(x, row_scale[:, None], row_nonfinite[:, None])
    _store_codes(q_row_ptr + rows[:, None] * K + cols[None, :], row_codes, mask, SOFT_FP8)
    tl.store(s_row_ptr + rows * stride_srm + pid_k * stride_srk, row_scale, mask=rows < M)

    col_amax = _abs_max(x, 0)  # [GROUP]: one 128x1 group per column
    col_nonfinite = col_amax == float("inf")
    col_scale = _block_scale(col_amax, col_nonfinite, POW2)
    col_codes = _scaled_codes(x, col_scale[None, :], col_nonfinite[None, :])
    _store_codes(q_col_ptr + cols[None, :] * M + rows[:, None], col_codes, mask, SOFT_FP8)
    tl.store(s_col_ptr + pid_m * stride_scm + cols * stride_sck, col_scale, mask=cols < K)


_QUANT_DUAL_DEFAULT = triton.Config({}, num_warps=8)
_QUANT_DUAL_CONFIGS = [
    _QUANT_DUAL_DEFAULT,
    triton.Config({}, num_warps=4),
    triton.Config({}, num_warps=16),
]
_quantize_dual_tuned = _Tuned(_quantize_1x128_and_128x1_kernel, _QUANT_DUAL_CONFIGS, key=["K_BUCKET", "M_BUCKET"])


def quantize_1x128_and_128x1(x: Tensor, *, block: int = BLOCK, pow2: bool = False,
                             gemm_layout: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``quantize_1x128(x) + quantize_128x1(x)`` from one read of x: the same codes and scales bit for bit.

    x: [M, K] bf16/fp16/fp32, any strides, M and K ragged allowed
    -> (q_row float8_e4m3fn [M, K] contiguous, s_row float32 [M, ceil(K / 128)],
        q_col float8_e4m3fn [M, K] column-major, s_col float32 [ceil(M / 128), K])
    Scale layouts are the reference's (s_row row-major, s_col column-major); ``gemm_layout=True`` flips both
    (see quantize_1x128 / quantize_128x1), which is what FP8BlockLinear asks for.
    """
    _check_block(block)
    soft_fp8 = _check_device(x)
    _check_2d("quantize_1x128_and_128x1", x)
    x = _as_float_input(x)
    m, k = x.shape
    nbm, nbk = _ceil_div(m, block), _ceil_div(k, block)
    q_row = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    q_col_t = torch.empty(k, m, dtype=FP8_DTYPE, device=x.device)
    s_row = _scales_out(m, nbk, gemm_layout, x.device)
    s_col = _scales_out(nbm, k, not gemm_layout, x.device)
    if x.numel() == 0:
        return q_row, s_row, q_col_t.t(), s_col
    _quantize_dual_tuned.launch(
        lambda meta: (nbm, nbk), (_bucket(k), _bucket(m), x.dtype), soft_fp8,
        x, _codes_out(q_row, soft_fp8), s_row, _codes_out(q_col_t, soft_fp8), s_col, m, k,
        x.stride(0), x.stride(1), s_row.stride(0), s_row.stride(1), s_col.stride(0), s_col.stride(1),
        _bucket(k), _bucket(m), POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    return q_row, s_row, q_col_t.t(), s_col


# ----------------------------------------------------------------------------------------------------------
# 128x128: square weight blocks.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _weight_tile(w_ptr, N, K, stride_wn, stride_wk, POW2: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """This program's GROUP rows x GROUPS blocks of GROUP columns of w, a [GROUP, GROUPS, GROUP] tile, quantized:
    (rows, groups, cols, mask, codes, scales [GROUPS], non-finite blocks [GROUPS])."""
    pid_n = tl.program_id(0)
    rows = (pid_n * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (rows[:, None, None] < N) & (cols < K)  # ragged edge blocks: real elements only
    w = tl.load(w_ptr + rows[:, None, None] * stride_wn + cols * stride_wk, mask=mask, other=0.0)
    w = w.to(tl.float32)
    amax = tl.max(_abs_max(w, 2), axis=0)  # [GROUPS]
    nonfinite = amax == float("inf")
    scale = _block_scale(amax, nonfinite, POW2)
    codes = _scaled_codes(w, scale[None, :, None], nonfinite[None, :, None])
    return rows, groups, cols, mask, codes, scale, nonfinite


@triton.jit
def _quantize_128x128_kernel(
    w_ptr, q_ptr, s_ptr,  # w [N, K] any strides; q [N, K] contiguous; s [NBN, NBK] contiguous
    N, K, NBK, stride_wn, stride_wk,
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):
    """One program: GROUP rows x GROUPS blocks of GROUP columns, a [GROUP, GROUPS, GROUP] tile."""
    rows, groups, cols, mask, codes, scale, nonfinite = _weight_tile(w_ptr, N, K, stride_wn, stride_wk, POW2, GROUP,
                                                                     GROUPS)
    _store_codes(q_ptr + rows[:, None, None] * K + cols, codes, mask, SOFT_FP8)
    tl.store(s_ptr + tl.program_id(0) * NBK + groups, scale, mask=groups < NBK)


@triton.jit
def _requantize_128x128_kernel(
    w_ptr, q_ptr, s_ptr, bad_ptr,  # w [N, K] any strides; q [N, K], s [NBN, NBK] contiguous; bad: one byte, zeroed
    N, K, NBK, stride_wn, stride_wk,  # by the caller, set to 1 by a NaN/Inf block
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):
    """_quantize_128x128_kernel into existing buffers, also setting the "weight has a non-finite block" flag.

    W^T's codes are a second launch of this kernel on w.t() (a 128x128 block's codes and scale do not depend on
    the order of its elements). Writing them from this launch's registers, through a pointer contiguous along the
    tile's first axis, gave wrong codes on the H200 whenever N was a multiple of 16 (Triton 3.6, 2026-12-01; the
    interpreter got them right), so the transposing store is left to the layout the other stores already use."""
    rows, groups, cols, mask, codes, scale, nonfinite = _weight_tile(w_ptr, N, K, stride_wn, stride_wk, POW2, GROUP,
                                                                     GROUPS)
    _store_codes(q_ptr + rows[:, None, None] * K + cols, codes, mask, SOFT_FP8)
    real = groups < NBK
    tl.store(s_ptr + tl.program_id(0) * NBK + groups, scale, mask=real)
    tl.store(bad_ptr + groups * 0, tl.full([GROUPS], 1, tl.uint8), mask=nonfinite & real)


_QUANT_128X128_DEFAULT = triton.Config({"GROUPS": 1}, num_warps=8)
_QUANT_128X128_CONFIGS = [
    _QUANT_128X128_DEFAULT,
    triton.Config({"GROUPS": 1}, num_warps=4),
    triton.Config({"GROUPS": 1}, num_warps=16),
    triton.Config({"GROUPS": 2}, num_warps=16),
]
_quantize_128x128_tuned = _Tuned(_quantize_128x128_kernel, _QUANT_128X128_CONFIGS, key=["N", "K"])


def quantize_128x128(w: Tensor, *, block: int = BLOCK, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D tensor (a weight [N, K]) in 128x128 tiles. Matches the reference.

    w: [N, K] bf16/fp16/fp32, any strides, ragged N and K allowed
    -> (q float8_e4m3fn [N, K] contiguous, s float32 [ceil(N / 128), ceil(K / 128)] contiguous)
    """
    _check_block(block)
    soft_fp8 = _check_device(w)
    _check_2d("quantize_128x128", w)
    w = _as_float_input(w)
    n, k = w.shape
    nbn, nbk = _ceil_div(n, block), _ceil_div(k, block)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(nbn, nbk, dtype=torch.float32, device=w.device)
    if w.numel() == 0:
        return q, s
    _quantize_128x128_tuned.launch(
        lambda meta: (nbn, _ceil_div(nbk, meta["GROUPS"])), (n, k, w.dtype), soft_fp8,
        w, _codes_out(q, soft_fp8), s, n, k, nbk, w.stride(0), w.stride(1),
        POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    return q, s


_requantize_128x128_tuned = _Tuned(_requantize_128x128_kernel, _QUANT_128X128_CONFIGS, key=["N", "K"])


def requantize_128x128_(w: Tensor, q: Tensor, s: Tensor, bad: Tensor, *, qt: Tensor | None = None,
                        st: Tensor | None = None, block: int = BLOCK, pow2: bool = False) -> None:
    """Re-quantize a weight into existing buffers, in place: one launch writes the codes and scales
    ``quantize_128x128(w)`` returns and ``bad`` (bool []) = whether a scale is NaN (after the flag's zeroing); when
    given, a second launch on ``w.t()`` writes W^T's codes ``qt`` [K, N] and scales ``st`` [NBK, NBN] (``q.t()`` /
    ``s.t()``, contiguous). Every buffer's autograd version is bumped, as ``copy_`` would: a backward that saved the
    old codes raises instead of using the new ones.

    w: [N, K] bf16/fp16/fp32, any strides; q [N, K] e4m3fn, s [ceil(N/128), ceil(K/128)] fp32, contiguous.
    """
    _check_block(block)
    transposed = qt is not None or st is not None
    if transposed and (qt is None or st is None):
        raise ValueError("requantize_128x128_ needs both qt and st, or neither")
    tensors = (w, q, s, bad, qt, st) if transposed else (w, q, s, bad)
    soft_fp8 = _check_device(*tensors)
    _check_2d("requantize_128x128_", w)
    w = _as_float_input(w)
    n, k = w.shape
    nbn, nbk = _ceil_div(n, block), _ceil_div(k, block)
    wanted = [("q", q, (n, k), FP8_DTYPE), ("s", s, (nbn, nbk), torch.float32), ("bad", bad, (), torch.bool)]
    if transposed:
        wanted += [("qt", qt, (k, n), FP8_DTYPE), ("st", st, (nbk, nbn), torch.float32)]
    for name, t, shape, dtype in wanted:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"requantize_128x128_: {name} must be a contiguous {dtype} {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)} (strides {t.stride()})")
    bad.zero_()
    if w.numel():
        flag = bad.view(torch.uint8)
        for src, codes, scales, rows, cols in ((w, q, s, n, k), (w.t(), qt, st, k, n))[:2 if transposed else 1]:
            nb_rows, nb_cols = _ceil_div(rows, block), _ceil_div(cols, block)
            _requantize_128x128_tuned.launch(
                lambda meta, nb_rows=nb_rows, nb_cols=nb_cols: (nb_rows, _ceil_div(nb_cols, meta["GROUPS"])),
                (rows, cols, w.dtype), soft_fp8,
                src, _codes_out(codes, soft_fp8), scales, flag, rows, cols, nb_cols, src.stride(0), src.stride(1),
                POW2=pow2, SOFT_FP8=soft_fp8, GROUP=block)
    for t in (q, s, qt, st) if transposed else (q, s):
        if not t.is_inference():  # inference tensors keep no version (nor can autograd have saved them)
            torch.autograd.graph.increment_version(t)


# ----------------------------------------------------------------------------------------------------------
# Block-scaled FP8 GEMM: y = (qa * sa) @ (qb * sb)^T, scales applied per 128-wide K chunk in fp32.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                         stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += (a_blk @ b_blk) * sa x sb for the K block starting at k0 (a multiple of BLOCK_K).

    a_ptrs [BLOCK_M, 1] / b_ptrs [1, BLOCK_N] point at column 0 of their rows; sa_ptrs / sb_ptrs at scale column 0.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K  # ragged last K block: masked codes are zero and contribute nothing
    a = tl.load(a_ptrs + offs_k[None, :] * stride_ak, mask=k_mask[None, :], other=0.0)
    b = tl.load(b_ptrs + offs_k[:, None] * stride_bk, mask=k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
    sa = tl.load(sa_ptrs + (k0 // BLOCK_K) * stride_sak)
    sb = tl.load(sb_ptrs + (k0 // BLOCK_K) * stride_sbk)
    return acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr,  # a [M, K], b [N, K] e4m3fn, c [M, N]; sa [M or M/128, KB], sb [N or N/128, KB]
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    M_BUCKET,  # autotune key only
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,  # rows sharing one scale: 1 (1x128) or 128 (128x128)
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] tile of c. BLOCK_K is the quantization block (128): every K step's
    partial product is exact in fp32 up to accumulation order, then scaled by sa (per row) x sb (per column)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share their B column tiles while those are hot in L2.
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    # Rows/columns past M/N wrap around (in bounds, never stored), so only K needs a load mask.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am  # [BLOCK_M, 1]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    sa_ptrs = sa_ptr + (offs_m // A_SCALE_ROWS) * stride_sam
    sb_ptrs = sb_ptr + (offs_n // B_SCALE_ROWS) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter passes K as a 1-element array, which numpy >= 2.4 will not turn into an int
        k0 = 0
        while k0 < K:
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


_GEMM_DEFAULT = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=4)
_GEMM_CONFIGS = [
    _GEMM_DEFAULT,
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8}, num_warps=4, num_stages=5),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),  # small M (decode)
]
_fp8_block_gemm_tuned = _Tuned(_fp8_block_gemm_kernel, _GEMM_CONFIGS, key=["M_BUCKET", "N", "K"])

_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _scale_rows(rows: int, s: Tensor, kb: int, name: str) -> int:
    """Rows of an operand sharing one scale: 1 for per-row (1x128) scales [rows, KB], 128 for [ceil(rows/128), KB]."""
    if s.dim() != 2 or s.dtype != torch.float32 or s.shape[1] != kb:
        raise ValueError(f"{name} must be float32 [{rows} or {_ceil_div(rows, BLOCK)}, {kb}], got "
                         f"{s.dtype} {tuple(s.shape)}")
    if s.shape[0] == rows:
        return 1  # when rows <= 1 both readings coincide
    if s.shape[0] == _ceil_div(rows, BLOCK):
        return BLOCK
    raise ValueError(f"{name} has {s.shape[0]} rows; expected {rows} (1x128) or {_ceil_div(rows, BLOCK)} (128x128)")


def _checked_gemm_operands(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor,
                           out_dtype: torch.dtype) -> tuple[bool, int, int, int, int]:
    """(soft_fp8, M, N, K, K blocks) of a GEMM's codes qa [M, K], qb [N, K] (scales: checked by the caller)."""
    soft_fp8 = _check_device(qa, sa, qb, sb)
    if qa.dtype != FP8_DTYPE or qb.dtype != FP8_DTYPE:
        raise TypeError(f"qa and qb must be {FP8_DTYPE}, got {qa.dtype} and {qb.dtype}")
    if qa.dim() != 2 or qb.dim() != 2 or qa.shape[1] != qb.shape[1]:
        raise ValueError(f"need qa [M, K] and qb [N, K], got {tuple(qa.shape)} and {tuple(qb.shape)}")
    if out_dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_GEMM_OUT_DTYPES}, got {out_dtype}")
    (m, k), n = qa.shape, qb.shape[0]
    kb = _ceil_div(k, BLOCK)
    return soft_fp8, m, n, k, kb


def fp8_block_gemm_triton(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype) -> Tensor:
    """y = dequant(qa, sa) @ dequant(qb, sb)^T with per-128-K-chunk scaling and fp32 accumulation.

    qa: [M, K] float8_e4m3fn, any strides;   sa: float32 [M, ceil(K/128)] (1x128) or [ceil(M/128), ceil(K/128)]
    qb: [N, K] float8_e4m3fn, any strides;   sb: float32 [ceil(N/128), ceil(K/128)] (128x128) or [N, ceil(K/128)]
    -> y [M, N] out_dtype (bf16/fp16/fp32), contiguous. Scales may have any strides. M, N, K ragged allowed.

    The recipe's three GEMMs: forward y = x W^T: (qx, sx, qw, sw); dgrad dx = dy W: (qdy, sdy, qw.t(), sw.t());
    wgrad dW = dy^T x with 128x1 quantization along tokens: (qdy.t(), sdy.t(), qx.t(), sx.t()) — all views,
    no copies. Fastest when both operands are K-contiguous (Hopper's FP8 MMA reads K-major operands; other
    layouts cost a transpose in shared memory).
    """
    soft_fp8, m, n, k, kb = _checked_gemm_operands(qa, sa, qb, sb, out_dtype)
    a_rows, b_rows = _scale_rows(m, sa, kb, "sa"), _scale_rows(n, sb, kb, "sb")
    y = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()

    bucket = _bucket(m)
    _fp8_block_gemm_tuned.launch(
        lambda meta: (_ceil_div(m, meta["BLOCK_M"]) * _ceil_div(n, meta["BLOCK_N"]),),
        (bucket, n, k, out_dtype, a_rows, b_rows), soft_fp8,
        qa, qb, y, sa, sb, m, n, k,
        qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1), y.stride(0), y.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), bucket,
        A_SCALE_ROWS=a_rows, B_SCALE_ROWS=b_rows, INTERPRET=soft_fp8, BLOCK_K=BLOCK)
    return y


# ----------------------------------------------------------------------------------------------------------
# Small-M forward GEMM, split along K: enough programs to stream the weight at decode's few rows.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_splitk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, p_ptr, sa_ptr, sb_ptr,  # a [M, K], b [N, K] e4m3fn; c [M, N]; p [SPLIT, M, N] fp32
    M, N, K, KB_PER_SPLIT,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbn, stride_sbk,
    M_BUCKET,  # autotune key only
    SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: the K blocks [pid_s * KB_PER_SPLIT, (pid_s + 1) * KB_PER_SPLIT) of a [BLOCK_M, BLOCK_N] tile of
    c = (a * sa) @ (b * sb)^T, a 1x128-scaled (sa [M, KB]), b 128x128-scaled (sb [N/128, KB]). Each K step is
    _fp8_block_gemm_step, the unfused GEMM's. SPLIT == 1 stores c; else the fp32 partial sum goes to p[pid_s] and
    _splitk_reduce_kernel adds the SPLIT partials in a fixed order (deterministic: no atomics)."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # rows/columns past M/N wrap (in bounds, never stored)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    sa_ptrs = sa_ptr + offs_m * stride_sam
    sb_ptrs = sb_ptr + (offs_n // BLOCK_K) * stride_sbn
    k_first = pid_s * KB_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(k_first + KB_PER_SPLIT * BLOCK_K, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter passes ints as 1-element arrays (see _fp8_block_gemm_kernel)
        k0 = k_first
        while k0 < k_end:
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)
            k0 += BLOCK_K
    else:
        for k0 in range(k_first, k_end, BLOCK_K):
            acc = _fp8_block_gemm_step(acc, a_ptrs, b_ptrs, sa_ptrs, sb_ptrs, k0, K,
                                       stride_ak, stride_bk, stride_sak, stride_sbk, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT == 1:
        c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = p_ptr + (pid_s * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(p_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """c (contiguous [M, N], MN elements) = sum over s = 0 .. SPLIT-1 of p[s] (fp32, in that order), cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# BLOCK_M 64 in every config, as in _FUSED_CONFIGS: a BLOCK_M >= 64 FP8 dot runs on Hopper's FP8 wgmma, like every
# config of the unfused GEMM, so a K block's partial product is summed the same way whichever config runs.
_SPLITK_DEFAULT = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=4)
_SPLITK_CONFIGS = [
    _SPLITK_DEFAULT,
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=6),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=6),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=4),
]
_splitk_tuned: dict[int, _Tuned] = {}
_REDUCE_CONFIG = triton.Config({"BLOCK": 1024}, num_warps=4)
_splitk_reduce = _Tuned(_splitk_reduce_kernel, [_REDUCE_CONFIG], key=["MN"])
SPLITK_MAX_SPLIT = 16
_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 8 for CPU tensors under the interpreter (tests), and the
    H200's 132 for a trace on fake CUDA tensors where no CUDA runtime exists (nothing can run there anyway)."""
    if device.type != "cuda":
        return 8
    if not torch.cuda.is_available():
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def splitk_splits(m: int, n: int, k: int, sms: int) -> int:
    """How many K ranges the small-M GEMM splits into: doubled (up to SPLITK_MAX_SPLIT, at least two K blocks per
    range) while the programs of 64 x 64 tiles still fit on the device's ``sms`` multiprocessors at once. Decode
    shapes give few output tiles (N = 2048 at M = 64: 32), too few programs to stream the weight at full bandwidth."""
    tiles = _ceil_div(m, 64) * _ceil_div(n, 64)
    kb = _ceil_div(k, BLOCK)
    split = 1
    while split * 2 <= SPLITK_MAX_SPLIT and tiles * split * 2 <= sms and kb >= split * 4:
        split *= 2
    return split


def _splitk_kernel(split: int) -> _Tuned:
    tuned = _splitk_tuned.get(split)
    if tuned is None:
        tuned = _splitk_tuned[split] = _Tuned(_fp8_splitk_gemm_kernel, _SPLITK_CONFIGS, key=["M_BUCKET", "N", "K"])
    return tuned


def fp8_splitk_gemm_triton(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype,
                           split: int | None = None) -> Tensor:
    """The forward GEMM y = (qa * sa) @ (qb * sb)^T for few rows (decode): fp8_block_gemm_triton's math (the same
    K step), with K split into ``split`` ranges (default ``splitk_splits`` for the device) whose fp32 partial sums
    a second launch adds in a fixed order. Same values as fp8_block_gemm_triton up to fp32 summation order.

    qa: [M, K] float8_e4m3fn, sa: float32 [M, ceil(K/128)] (1x128), any strides
    qb: [N, K] float8_e4m3fn, sb: float32 [ceil(N/128), ceil(K/128)] (128x128), any strides
    -> y [M, N] out_dtype (bf16/fp16/fp32), contiguous. Extra memory: split x M x N fp32 while it runs (split > 1).
    """
    soft_fp8, m, n, k, kb = _checked_gemm_operands(qa, sa, qb, sb, out_dtype)
    for name, s, want in (("sa", sa, (m, kb)), ("sb", sb, (_ceil_div(n, BLOCK), kb))):
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"{name} must be float32 {want}, got {s.dtype} {tuple(s.shape)}")
    if split is None:  # symbolic sizes (torch.compile, dynamic shapes) by their hints: any split is correct
        split = splitk_splits(*(size_hint(d) or 1 for d in (m, n, k)), sm_count(qa.device))
    if type(split) is not int or not 1 <= split <= SPLITK_MAX_SPLIT:
        raise ValueError(f"split must be an int in [1, {SPLITK_MAX_SPLIT}], got {split!r}")
    y = torch.empty(m, n, dtype=out_dtype, device=qa.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    per = _ceil_div(kb, split)  # K blocks per range; the ranges cover every block at any (symbolic) K
    if type(per) is int:
        split = _ceil_div(kb, per)  # no empty K range
    partial = torch.empty(split, m, n, dtype=torch.float32, device=qa.device) if split > 1 else y
    bucket = _bucket(m)
    _splitk_kernel(split).launch(
        lambda meta: (_ceil_div(n, meta["BLOCK_N"]), split, _ceil_div(m, meta["BLOCK_M"])),
        (bucket, n, k, out_dtype), soft_fp8,
        qa, qb, y, partial, sa, sb, m, n, k, per,
        qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1), y.stride(0), y.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), bucket,
        SPLIT=split, INTERPRET=soft_fp8, BLOCK_K=BLOCK)
    if split > 1:
        mn = m * n
        _splitk_reduce.launch(lambda meta: (_ceil_div(mn, meta["BLOCK"]),), (mn,), soft_fp8,
                              partial, y, mn, SPLIT=split)
    return y


# ----------------------------------------------------------------------------------------------------------
# Small-M forward with the activation quantization in the GEMM's prologue: one launch per linear (decode).
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _e4m3fn_in_registers(codes, SOFT_FP8: tl.constexpr):
    """fp32 codes from _scaled_codes -> e4m3fn values for tl.dot: the very cast _store_codes stores (hardware
    round-to-nearest-even cast, or under the interpreter the software bits reinterpreted as e4m3fn)."""
    if SOFT_FP8:
        a = _e4m3fn_bits(codes).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        a = codes.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return a


@triton.jit
def _rounded_to_16_bits(x, ROUND: tl.constexpr, SOFT_FP8: tl.constexpr):
    """fp32 x -> the fp32 value of x rounded to bf16 (ROUND 1) or fp16 (ROUND 2), round-to-nearest-even with
    overflow to inf, as torch's x.to(bf16 / fp16) rounds; ROUND 0: x. Under the interpreter (SOFT_FP8) the bf16
    rounding is done on the bits, since the interpreter's own cast truncates (its fp16 cast is numpy's, RTNE)."""
    if ROUND == 1:
        if SOFT_FP8:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            x = tl.where(x != x, x, rounded)  # NaN stays NaN (the carry could make it inf)
        else:
            x = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    elif ROUND == 2:
        if SOFT_FP8:
            x = x.to(tl.float16).to(tl.float32)
        else:
            x = x.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    return x


@triton.jit
def _fused_quant_gemm_step(acc, row_bad, x_ptrs, row_mask, b_ptrs, sb_ptrs, k0, K, stride_bk, stride_sbk,
                           POW2: tl.constexpr, SOFT_FP8: tl.constexpr, BLOCK_K: tl.constexpr,
                           ROUND: tl.constexpr):
    """One K block (= one 1x128 group of every row): quantize the x tile as _quantize_1x128_kernel does, then
    ``acc += (codes @ b_blk) * sx x sb`` exactly as _fp8_block_gemm_step does. row_bad [BLOCK_M] int32 |= the
    rows whose group is non-finite. x_ptrs [BLOCK_M, 1] / b_ptrs [1, BLOCK_N] point at column 0. ROUND: fp32 x
    rounded to bf16 / fp16 first (`_rounded_to_16_bits`), the autocast cast done in registers."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K  # ragged last group: masked x are 0 (amax unchanged), masked weight codes are 0
    valid = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptrs + offs_k[None, :], mask=valid, other=0.0).to(tl.float32)
    x = _rounded_to_16_bits(x, ROUND, SOFT_FP8)
    amax = _abs_max(x, 1)  # [BLOCK_M]
    nonfinite = amax == float("inf")
    sa = _block_scale(amax, nonfinite, POW2)
    # The masked elements (padding rows of a decode tile, a ragged group's tail) divide 1 instead of 0 and their
    # code is then set to 0, the code 0 / scale gives. A zero dividend over the floor scale takes the IEEE
    # division's slow path, and at decode's M << BLOCK_M nearly every element of the tile is padding: on the H200
    # M=1 ran slower than M=64 before (55 vs 27 us per call at K=N=576), 15 vs 22 us after (docs/benchmarks.md).
    codes = _scaled_codes(tl.where(valid, x, 1.0), sa[:, None], nonfinite[:, None])
    a = _e4m3fn_in_registers(tl.where(valid, codes, 0.0), SOFT_FP8)
    b = tl.load(b_ptrs + offs_k[:, None] * stride_bk, mask=k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
    sb = tl.load(sb_ptrs + (k0 // BLOCK_K) * stride_sbk)
    acc = acc + tl.dot(a, b) * (sa[:, None] * sb[None, :])
    return acc, tl.maximum(row_bad, nonfinite.to(tl.int32))


@triton.jit
def _fp8_linear_fused_quant_kernel(
    x_ptr, b_ptr, c_ptr, sb_ptr,  # x [M, K] (last dim contiguous), b [N, K] e4m3fn, c [M, N], sb [N/128, K/128]
    count_ptr, weight_bad_ptr,  # COUNT only: int64 [] counter += bad rows; bool [] "the weight has a NaN block"
    M, N, K,
    stride_xm, stride_bn, stride_bk, stride_cm, stride_cn, stride_sbn, stride_sbk,
    M_BUCKET,  # autotune key only
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr, COUNT: tl.constexpr, ROUND: tl.constexpr, MEMBERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] tile of c = Q1x128(x) Q128x128(W)^T. Each program quantizes its rows'
    groups itself, so no codes go through memory; every N tile redoes that work, which on the H200 made this
    kernel's GPU time higher than quantize + GEMM at every decode shape (see _FUSED_CONFIGS).

    COUNT: the programs of the first N tile (they hold every K group of their rows) add the number of their
    rows with a non-finite group (every valid row when ``weight_bad_ptr`` is set) to ``count_ptr``: each row
    once, as quantize_1x128's counting kernel does. MEMBERS > 1: b holds the codes of that many sibling linears
    that read the same x (q/k/v, gate/up; siblings.py), ``weight_bad_ptr`` the number of them whose weight has a
    NaN block (int32 []), and the count is what the siblings' own calls would add together."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M  # masked rows load zeros: finite, never stored, never counted
    # Weight columns past N wrap around (in bounds, never stored), as in _fp8_block_gemm_kernel.
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    sb_ptrs = sb_ptr + (offs_n // BLOCK_K) * stride_sbn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_bad = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if SOFT_FP8:  # the interpreter passes K as a 1-element array (see _fp8_block_gemm_kernel)
        k0 = 0
        while k0 < K:
            acc, row_bad = _fused_quant_gemm_step(acc, row_bad, x_ptrs, row_mask, b_ptrs, sb_ptrs, k0, K,
                                                  stride_bk, stride_sbk, POW2, SOFT_FP8, BLOCK_K, ROUND)
            k0 += BLOCK_K
    else:
        for k0 in range(0, K, BLOCK_K):
            acc, row_bad = _fused_quant_gemm_step(acc, row_bad, x_ptrs, row_mask, b_ptrs, sb_ptrs, k0, K,
                                                  stride_bk, stride_sbk, POW2, SOFT_FP8, BLOCK_K, ROUND)

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < N))
    if COUNT:
        bad_members = tl.load(weight_bad_ptr).to(tl.int32)  # one linear: its flag, 0 or 1
        n_bad = (bad_members * tl.sum(row_mask.to(tl.int32), axis=0)
                 + (MEMBERS - bad_members) * tl.sum(row_bad, axis=0))
        tl.atomic_add(count_ptr, n_bad.to(tl.int64), mask=(n_bad > 0) & (pid_n == 0))


# BLOCK_M is 64 in every config, although decode has fewer rows: on sm_90 Triton runs a BLOCK_M >= 64 FP8 dot on
# Hopper's FP8 wgmma (like every config of the unfused GEMM) but a BLOCK_M 16/32 one on mma.sync with the codes
# upcast to f16, which sums a K block with other rounding; one MMA family keeps the outputs independent of which
# config the autotuner picks, and equal to the unfused path's. Masked rows cost no memory traffic, but every program
# quantizes its BLOCK_M x 128 x tile per K step (an IEEE division per element): on the H200 the first configs (4
# warps) took 1.5-31x the GPU time of quantize + GEMM (docs/benchmarks.md), so 8-warp configs share that work among
# more warps; the kernel stays slower than the two launches on the GPU and pays only where the host's time decides.
# BLOCK_N 32 gives narrow layers (SmolLM2's k/v, N = 192) more programs.
_FUSED_DEFAULT = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=3)
_FUSED_CONFIGS = [
    _FUSED_DEFAULT,
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256}, num_warps=8, num_stages=2),
]
_fp8_linear_fused_quant_tuned = _Tuned(_fp8_linear_fused_quant_kernel, _FUSED_CONFIGS, key=["M_BUCKET", "N", "K"],
                                       restore_value=["count_ptr"])


_ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def fp8_linear_fused_quant_gemm(x2: Tensor, qw: Tensor, sw: Tensor, *, out_dtype: torch.dtype,
                                nonfinite_count: Tensor | None = None, weight_bad: Tensor | None = None,
                                pow2: bool = False, round_to: torch.dtype | None = None) -> Tensor:
    """y = Q1x128(x2) Q128x128(W)^T in ONE launch: the 1x128 activation groups are quantized in the GEMM's
    prologue, in registers, never stored. Made for small M (decode); large M re-quantizes x once per N tile.

    x2: [M, K] bf16/fp16/fp32 (fp64 rounded to fp32), last dim contiguous (else copied), M and K ragged allowed
    qw: [N, K] float8_e4m3fn, any strides;   sw: float32 [ceil(N/128), ceil(K/128)], any strides
    -> y [M, N] out_dtype (bf16/fp16/fp32), contiguous.
    Bit for bit ``fp8_block_gemm_triton(*quantize_1x128(x2, pow2=pow2), qw, sw, out_dtype=out_dtype)``: the same
    codes and scales (the quantizer's jit helpers), the same per-K-block products and accumulation order.
    ``nonfinite_count`` / ``weight_bad``: as in quantize_1x128 (the same number is added, inside the kernel).
    ``round_to`` (bf16 / fp16, fp32 x2 only): x2 is first rounded to that dtype in registers, so the result is
    bit for bit that of ``x2.to(round_to)``: the autocast cast of an fp32 activation without its own launch.
    """
    if round_to is not None and (round_to not in _ROUND_CODES or x2.dtype != torch.float32):
        raise ValueError(f"round_to must be torch.bfloat16 or torch.float16 with an fp32 x2, got {round_to} with "
                         f"{x2.dtype}")
    soft_fp8 = _check_device(x2, qw, sw)
    _check_2d("fp8_linear_fused_quant_gemm", x2)
    x2 = _as_float_input(x2)
    if qw.dtype != FP8_DTYPE or qw.dim() != 2 or qw.shape[1] != x2.shape[1]:
        raise ValueError(f"qw must be {FP8_DTYPE} [N, {x2.shape[1]}], got {qw.dtype} {tuple(qw.shape)}")
    if out_dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_GEMM_OUT_DTYPES}, got {out_dtype}")
    (m, k), n = x2.shape, qw.shape[0]
    kb = _ceil_div(k, BLOCK)
    want = (_ceil_div(n, BLOCK), kb)
    if sw.dtype != torch.float32 or tuple(sw.shape) != want:
        raise ValueError(f"sw must be float32 {want} (128x128 blocks of qw), got {sw.dtype} {tuple(sw.shape)}")
    count = nonfinite_count is not None
    if count:
        _, weight_bad = _counter_operands(x2, nonfinite_count, weight_bad)
        if weight_bad.dtype != torch.bool or weight_bad.numel() != 1:
            raise ValueError(f"weight_bad must be a bool [] tensor, got {weight_bad.dtype} {tuple(weight_bad.shape)}")
    y = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0 or k == 0:  # nothing to count either: quantize_1x128 of an empty x adds nothing
        return y.zero_()
    if n == 0:  # no output to fuse into; the rows are still counted as the unfused layer counts them
        if count:
            quantize_1x128(x2 if round_to is None else x2.to(round_to), pow2=pow2, nonfinite_count=nonfinite_count,
                           weight_bad=weight_bad)
        return y
    _launch_fused_quant_gemm(x2, qw, sw, y, nonfinite_count, weight_bad, pow2, round_to, soft_fp8)
    return y


def _launch_fused_quant_gemm(x2: Tensor, qw: Tensor, sw: Tensor, y: Tensor, nonfinite_count: Tensor | None,
                             weight_bad: Tensor | None, pow2: bool, round_to: torch.dtype | None,
                             soft_fp8: bool, members: int = 1) -> None:
    """The launch of fp8_linear_fused_quant_gemm for checked operands with M, N, K >= 1, into y [M, N]."""
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    count = nonfinite_count is not None
    if not count:
        nonfinite_count = weight_bad = sw  # unused (COUNT=False); any pointer will do
    (m, k), n = x2.shape, qw.shape[0]
    bucket = _bucket(m)
    _fp8_linear_fused_quant_tuned.launch(
        lambda meta: (_ceil_div(m, meta["BLOCK_M"]), _ceil_div(n, meta["BLOCK_N"])),
        (bucket, n, k, x2.dtype, y.dtype, count, round_to, members), soft_fp8,
        x2, qw, y, sw, nonfinite_count, weight_bad, m, n, k,
        x2.stride(0), qw.stride(0), qw.stride(1), y.stride(0), y.stride(1), sw.stride(0), sw.stride(1), bucket,
        POW2=pow2, SOFT_FP8=soft_fp8, COUNT=count, ROUND=_ROUND_CODES[round_to], MEMBERS=members, BLOCK_K=BLOCK)


def fp8_linear_decode_unchecked(x2: Tensor, qw: Tensor, sw: Tensor, *, out_dtype: torch.dtype,
                                nonfinite_count: Tensor, weight_bad: Tensor, pow2: bool = False,
                                round_to: torch.dtype | None = None, members: int = 1) -> Tensor:
    """fp8_linear_fused_quant_gemm for FP8BlockLinear's eager decode, without the argument checks: they cost ~4 us
    of host time per call (decode calls every linear once per token; benchmarks/probes/host_path_fused_decode.py).
    The caller guarantees what the checks would: x2 [M, K] bf16/fp16/fp32 with M >= 1, on the device of the layer's
    own qw [N, K] e4m3fn (K >= 1, N >= 1) and sw [ceil(N/128), ceil(K/128)] fp32, counter int64 [] and flag bool [];
    round_to only with an fp32 x2; out_dtype bf16/fp16/fp32. ``members`` > 1: qw/sw are the stacked codes of that
    many sibling linears (siblings.py) and ``weight_bad`` the int32 [] number of them with a NaN block."""
    y = torch.empty(x2.shape[0], qw.shape[0], dtype=out_dtype, device=x2.device)
    _launch_fused_quant_gemm(x2, qw, sw, y, nonfinite_count, weight_bad, pow2, round_to, _check_device(x2), members)
    return y
