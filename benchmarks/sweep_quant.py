"""Why is the fused 1x128+128x1 quantizer slow? Sweep its configs and time experimental variants of it.

    python benchmarks/sweep_quant.py [--budget 75]   # GPU; optional points stop after --budget s; tables + a conclusion
    python benchmarks/sweep_quant.py --smoke         # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script runs
    python benchmarks/sweep_quant.py --compile-sm90  # CPU, no GPU: compiles every variant to sm_90 PTX/cubin

Shapes 8192x14336 (dy) and 8192x4096 (x) of FP8BlockLinear at M=8192, K=4096, N=14336; bf16 random normal
inputs rotating over sets > L2; ``triton.testing.do_bench`` median. Rows (variant column):

  copy            ``dst.copy_(src)`` of uint8 buffers moving the same bytes as the job (the bandwidth ceiling)
  (a) prod        ``calclip.fp8.quant.quantize_1x128_and_128x1(x, gemm_layout=True)``, as FP8BlockLinear calls it
                  on CUDA (its _Tuned autotunes on the first call; the config it chose is printed)
  (b) C{C} w{W}s{S}  the production kernel through its own launcher (the arguments FP8BlockLinear passes, whatever
                  the kernel's signature) with autotuning off and one config: column chunks of C, num_warps W,
                  num_stages S
  (x) ctrl        this script's copy of the production kernel (exact div_rn); must time like (a)/(b)
  (c) recip       codes = x * (1/s) (1/s with div_rn once per block) instead of div_rn(x, s) per element
  (c) approx      codes = x / s with Triton's default (approximate, div.full.f32) division
  (c) markstein   y = 1/s with div_rn once per block, q0 = x*y, codes = fma(fma(-s, q0, x), y, q0) with x's
                  sign: Markstein's correction gives RN(x / s) itself (checked here in exact arithmetic on 1.9e9
                  pairs, 2026-12-02: every fp32 quotient equal but for subnormal x, whose codes are 0 anyway, and
                  every e4m3 code equal), so the codes stay exact at two FMAs per element instead of a div.rn
  (c) nodiv       no div.rn at all: s = max(amax, floor) * (1/448) and codes = x / s approximate (scales may
                  differ by an ulp too: the check counts them). The compile check shows the column pass runs
                  div_rn for its scales once per element-column a thread holds (not once per block), so
                  recip/approx alone cannot remove every division; nodiv does
  (d) rows        1x128 codes + scales only (no column pass, no transposed store)
  (d) cols        128x1 codes + scales only (no row pass)
  (d) cols-noT    both passes, but the 128x1 codes are stored row-major [M, K] (WRONG layout, same bytes):
                  the cost of the transposed store (its check compares values against the reference's q_col)
  (f) nomath      both passes, amaxes/scales stored, codes = clamp(x) cast without any scaling: the floor of
                  the memory pattern + reductions (codes are wrong by construction; check column says so)
  (g) kfast       ctrl with the grid order swapped (program id 0 walks K first)
  (e) two         production quantize_1x128 + quantize_128x1 (two kernels, x read twice)

Columns: ms = median time; GB/s(job) = the fused job's bytes (read x once + write both code sets + both scale
sets) / time, so rows that do less work are still comparable as "time for the job"; GB/s(own) = bytes the
variant really moves / time; %copy = GB/s(own) / copy GB/s; regs / spills / smem = the compiled kernel's
registers per thread, spilled bytes, shared memory bytes (direct launches only); check = exact codes and
scale bits vs the torch reference on a ragged check tensor with NaN/Inf blocks ("exact", or "N codes differ
(p%)"; "n/a" where the variant writes other values by design).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for _common
from _common import fmt_ms, header, rotating, table  # noqa: E402  (also puts the repo root on sys.path)

from calclip.fp8 import quant  # noqa: E402
from calclip.fp8 import reference as ref  # noqa: E402
from calclip.fp8 import kernels as tk  # noqa: E402
from calclip.fp8.kernels import launch, numerics, quantize  # noqa: E402

BLOCK = 128
BUDGET_S = 75.0  # default --budget: optional sweep points stop after this many seconds
T0 = time.perf_counter()

# ----------------------------------------------------------------------------------------------------------
# Experimental copy of quantize._quantize_1x128_and_128x1_kernel with switches. MATH: 0 exact div_rn (production),
# 1 multiply by a per-block reciprocal, 2 approximate '/', 3 no scaling at all, 4 no IEEE division at all (scale
# by a multiply, codes by approximate '/'), 5 the reciprocal plus one FMA correction (Markstein). ROW: do the 1x128
# half.
# COL: 0 no 128x1 half, 1 transposed store (production), 2 row-major store (wrong layout). K_FASTEST: grid
# axis 0 walks K tiles. Production helpers (_abs_max, _block_scale, _store_codes) are reused unchanged.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _codes(x, scale, nonfinite, MATH: tl.constexpr):
    if MATH == 0:
        c = tl.math.div_rn(x, scale)
    elif MATH == 1:
        c = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    elif MATH == 2 or MATH == 4:
        c = x / scale
    elif MATH == 5:  # Markstein: the per-block reciprocal, then one FMA-corrected step to RN(x / s)
        y = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q0 = x * y
        c = tl.fma(tl.fma(-scale, q0, x), y, q0)
        # x = -0 gives +0 through the FMAs; the quotient carries x's sign (copysign by bits)
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        c = ((c.to(tl.int32, bitcast=True) & 2147483647) | sign).to(tl.float32, bitcast=True)
    else:
        c = x
    c = tl.clamp(c, -numerics._FP8_MAX, numerics._FP8_MAX)
    return tl.where(nonfinite, float("nan"), c)


@triton.jit
def _scale(amax, nonfinite, POW2: tl.constexpr, MATH: tl.constexpr):
    if MATH == 4:  # no IEEE division anywhere: scale = amax * (1/448) (not exact: counted by the check)
        return tl.where(nonfinite, float("nan"), tl.maximum(amax, numerics._AMAX_FLOOR) * (1.0 / numerics._FP8_MAX))
    return numerics._block_scale(amax, nonfinite, POW2)


@triton.jit
def _exp_dual_kernel(
    x_ptr, q_row_ptr, s_row_ptr, q_col_ptr, s_col_ptr,
    M, K, stride_xm, stride_xk, stride_srm, stride_srk, stride_scm, stride_sck,
    POW2: tl.constexpr, SOFT_FP8: tl.constexpr, GROUP: tl.constexpr,
    MATH: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, K_FASTEST: tl.constexpr,
):
    if K_FASTEST:
        pid_k, pid_m = tl.program_id(0), tl.program_id(1)
    else:
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    cols = (pid_k * GROUP + tl.arange(0, GROUP)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if ROW:
        row_amax = numerics._abs_max(x, 1)
        row_nonfinite = row_amax == float("inf")
        row_scale = _scale(row_amax, row_nonfinite, POW2, MATH)
        row_codes = _codes(x, row_scale[:, None], row_nonfinite[:, None], MATH)
        numerics._store_codes(q_row_ptr + rows[:, None] * K + cols[None, :], row_codes, mask, SOFT_FP8)
        tl.store(s_row_ptr + rows * stride_srm + pid_k * stride_srk, row_scale, mask=rows < M)
    if COL != 0:
        col_amax = numerics._abs_max(x, 0)
        col_nonfinite = col_amax == float("inf")
        col_scale = _scale(col_amax, col_nonfinite, POW2, MATH)
        col_codes = _codes(x, col_scale[None, :], col_nonfinite[None, :], MATH)
        if COL == 1:
            numerics._store_codes(q_col_ptr + cols[None, :] * M + rows[:, None], col_codes, mask, SOFT_FP8)
        else:
            numerics._store_codes(q_col_ptr + rows[:, None] * K + cols[None, :], col_codes, mask, SOFT_FP8)
        tl.store(s_col_ptr + pid_m * stride_scm + cols * stride_sck, col_scale, mask=cols < K)


# name -> (MATH, ROW, COL, K_FASTEST, label, check mode). check: "exact" must match; "count" reports the diff;
# "values" compares q_col values of a row-major store; "na" only reports.
EXPERIMENTS = {
    "ctrl": (0, True, 1, False, "(x) ctrl: script copy of prod", "exact"),
    "recip": (1, True, 1, False, "(c) recip: x*(1/s)", "count"),
    "approx": (2, True, 1, False, "(c) approx: x/s div.full", "count"),
    "nodiv": (4, True, 1, False, "(c) nodiv: s=amax*(1/448), x/s", "count"),
    "markstein": (5, True, 1, False, "(c) markstein: x*(1/s) + fma step", "exact"),
    "rows": (0, True, 0, False, "(d) rows: 1x128 half only", "exact"),
    "cols": (0, False, 1, False, "(d) cols: 128x1 half only", "exact"),
    "cols-noT": (0, True, 2, False, "(d) cols-noT: q_col row-major", "values"),
    "nomath": (3, True, 1, False, "(f) nomath: no scaling", "na"),
    "kfast": (0, True, 1, True, "(g) kfast: grid K-fastest", "exact"),
}


# ----------------------------------------------------------------------------------------------------------
# Launch helpers: outputs preallocated per input set (gemm_layout=True strides, as FP8BlockLinear on CUDA).
# ----------------------------------------------------------------------------------------------------------


def make_outputs(x: torch.Tensor, col_row_major: bool = False) -> dict:
    m, k = x.shape
    nbm, nbk = -(-m // BLOCK), -(-k // BLOCK)
    soft = x.device.type == "cpu"
    q_row = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    q_col_t = torch.empty((m, k) if col_row_major else (k, m), dtype=torch.float8_e4m3fn, device=x.device)
    s_row = torch.empty(nbk, m, dtype=torch.float32, device=x.device).t()  # gemm_layout: column-major
    s_col = torch.empty(nbm, k, dtype=torch.float32, device=x.device)  # gemm_layout: row-major
    view = (lambda q: q.view(torch.uint8)) if soft else (lambda q: q)
    return {"x": x, "q_row": q_row, "q_col_t": q_col_t, "s_row": s_row, "s_col": s_col, "soft": soft,
            "q_row_k": view(q_row), "q_col_k": view(q_col_t), "grid": (nbm, nbk)}


def _args(o: dict) -> list:
    x, s_row, s_col = o["x"], o["s_row"], o["s_col"]
    m, k = x.shape
    return [x, o["q_row_k"], s_row, o["q_col_k"], s_col, m, k, x.stride(0), x.stride(1),
            s_row.stride(0), s_row.stride(1), s_col.stride(0), s_col.stride(1)]


def prod_configs(chunks, warps, stages) -> list:
    """The (b) sweep's launch configs of the production kernel."""
    return [triton.Config({"CHUNK": c}, num_warps=w, num_stages=s) for c in chunks for w in warps for s in stages]


def config_label(config) -> str:
    return f"C{config.kwargs['CHUNK']} w{config.num_warps}s{config.num_stages}"


_FORCED_LAUNCHES: dict[str, tuple] = {}  # config label -> its launch, made once: the direct launch keys its dict's id


@contextlib.contextmanager
def forced_prod_config(config):
    """quantize_1x128_and_128x1's launcher with autotuning off and ``config`` as its launch, as
    tests/fp8/test_triton.py pins one config. One launch dict per config for the whole run, so every timed call after
    the first takes the direct launch path, as the product's launches do."""
    tuned = quantize._quantize_dual_tuned
    saved = launch._AUTOTUNE, tuned._default_launch
    forced = _FORCED_LAUNCHES.setdefault(config_label(config), (config.kwargs, config.all_kwargs()))
    launch._AUTOTUNE, tuned._default_launch = False, forced
    try:
        yield
    finally:
        launch._AUTOTUNE, tuned._default_launch = saved


_PROD_KERNELS: dict[str, object] = {}  # config label -> the compiled kernel its first launch made (for regs / smem)


def _compiled_prod_kernels() -> list:
    caches = getattr(quantize._quantize_1x128_and_128x1_kernel, "device_caches", {})  # none under the interpreter
    return [kernel for cache in caches.values() for kernel in cache[0].values()]


def launch_prod(x: torch.Tensor, config, pow2: bool = False) -> tuple:
    """The production fused quantizer on x with ``config`` (gemm_layout=True, as FP8BlockLinear calls it on CUDA)
    -> (q_row, s_row, q_col, s_col)."""
    before = {id(k) for k in _compiled_prod_kernels()}
    with forced_prod_config(config):
        out = tk.quantize_1x128_and_128x1(x, pow2=pow2, gemm_layout=True)
    new = [k for k in _compiled_prod_kernels() if id(k) not in before]
    if new:
        _PROD_KERNELS.setdefault(config_label(config), new[-1])
    return out


def launch_exp(o: dict, name: str, warps: int, stages: int = 1, pow2: bool = False):
    math_, row, col, kfast = EXPERIMENTS[name][:4]
    grid = o["grid"][::-1] if kfast else o["grid"]
    return _exp_dual_kernel[grid](*_args(o), POW2=pow2, SOFT_FP8=o["soft"], GROUP=BLOCK,
                                  MATH=math_, ROW=row, COL=col, K_FASTEST=kfast, num_warps=warps, num_stages=stages)


def job_bytes(m: int, k: int) -> int:
    """Read x (bf16) once, write both code sets (1 B each) and both scale sets (fp32)."""
    nbm, nbk = -(-m // BLOCK), -(-k // BLOCK)
    return 2 * m * k + 2 * m * k + 4 * (m * nbk + nbm * k)


def own_bytes(name: str, m: int, k: int) -> int:
    nbm, nbk = -(-m // BLOCK), -(-k // BLOCK)
    if name == "rows":
        return 2 * m * k + m * k + 4 * m * nbk
    if name == "cols":
        return 2 * m * k + m * k + 4 * nbm * k
    if name == "two":
        return 2 * (2 * m * k) + 2 * m * k + 4 * (m * nbk + nbm * k)
    return job_bytes(m, k)


# ----------------------------------------------------------------------------------------------------------
# Correctness against the torch reference (CPU), NaN-aware like tests/fp8/test_triton.py.
# ----------------------------------------------------------------------------------------------------------


def _code_diffs(q: torch.Tensor, q_ref: torch.Tensor) -> int:
    a, b = q.contiguous().view(torch.uint8), q_ref.contiguous().view(torch.uint8)
    both_nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
    return int(((a != b) & ~both_nan).sum())


def _scale_diffs(s: torch.Tensor, s_ref: torch.Tensor) -> int:
    s, s_ref = s.contiguous(), s_ref.contiguous()
    same = (s.view(torch.int32) == s_ref.view(torch.int32)) | (s.isnan() & s_ref.isnan())
    return int((~same).sum())


def check_tensor(device: str) -> torch.Tensor:
    """Ragged in both dims, random normal bf16, one NaN block and one Inf block per direction."""
    m, k = (200, 328) if SMOKE else (2112 + 40, 4096 + 72)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x[5, 7] = float("nan")
    x[m - 3, k - 9] = float("inf")
    return x.to(device)


def compare(cpu_ref: tuple, outs: dict, row: bool, col: bool, col_values: bool = False) -> tuple[int, int, int]:
    """-> (code diffs, scale diffs, codes compared) over the halves the variant computes."""
    q_row_ref, s_row_ref, q_col_ref, s_col_ref = cpu_ref
    dq = ds = n = 0
    if row:
        dq += _code_diffs(outs["q_row"].cpu(), q_row_ref)
        ds += _scale_diffs(outs["s_row"].cpu(), s_row_ref)
        n += q_row_ref.numel()
    if col:
        q_col = outs["q_col_t"].cpu() if col_values else outs["q_col_t"].cpu().t()
        dq += _code_diffs(q_col, q_col_ref)
        ds += _scale_diffs(outs["s_col"].cpu(), s_col_ref)
        n += q_col_ref.numel()
    return dq, ds, n


def gemm_layout_verdict(cpu_ref: tuple, q_row, s_row, q_col, s_col) -> str:
    """"exact" verdict of production outputs with ``gemm_layout=True``: the 128x1 codes span reference.wgrad_rows(M)
    token rows; the first M are compared with the reference, the rest must be zero codes (each non-zero one counts
    as a differing code)."""
    m = cpu_ref[0].shape[0]
    padding_diffs = int(q_col[m:].cpu().view(torch.uint8).ne(0).sum())
    dq, ds, n = compare(cpu_ref, {"q_row": q_row, "s_row": s_row, "q_col_t": q_col[:m].t(), "s_col": s_col},
                        True, True)
    return verdict(dq + padding_diffs, ds, n, "exact")


def verdict(dq: int, ds: int, n: int, mode: str) -> str:
    if mode == "na":
        return f"n/a ({dq} codes differ by design)"
    text = "exact" if dq == 0 and ds == 0 else f"{dq} codes ({100 * dq / max(n, 1):.3f}%), {ds} scales differ"
    if mode in ("exact", "values") and (dq or ds):
        text = "FAIL " + text
    return text


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


def time_ms(fn, warmup: int, rep: int) -> float | None:
    try:
        fn()
        if SMOKE:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except Exception as err:  # noqa: BLE001 — one failing variant must not stop the table
        print(f"   !! {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}", flush=True)
        return None


def kernel_info(handle) -> tuple[str, str, str]:
    if handle is None:
        return "-", "-", "-"
    regs = getattr(handle, "n_regs", None)
    spills = getattr(handle, "n_spills", None)
    smem = getattr(getattr(handle, "metadata", None), "shared", None)
    return tuple("-" if v is None else str(v) for v in (regs, spills, smem))  # type: ignore[return-value]


def over_budget() -> bool:
    return time.perf_counter() - T0 > BUDGET_S


# ----------------------------------------------------------------------------------------------------------
# sm_90 compile check (CPU, no GPU)
# ----------------------------------------------------------------------------------------------------------


def compile_sm90() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _exp_dual_kernel
    types = {"x_ptr": "*bf16", "q_row_ptr": "*fp8e4nv", "s_row_ptr": "*fp32", "q_col_ptr": "*fp8e4nv",
             "s_col_ptr": "*fp32", **{n: "i32" for n in fn.arg_names[5:13]}}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t != "i32"}
    for name, (math_, row, col, kfast, label, _) in EXPERIMENTS.items():
        constexprs = {"POW2": False, "SOFT_FP8": False, "GROUP": BLOCK, "MATH": math_, "ROW": row, "COL": col,
                      "K_FASTEST": kfast}
        signature = {n: (types[n] if n in types else "constexpr") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        t = time.perf_counter()
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
        ptx = out.asm["ptx"]
        n_div_rn, n_div_full = ptx.count("div.rn.f32"), ptx.count("div.full.f32")
        print(f"{name:9s} sm_90 ok ({time.perf_counter() - t:.1f}s, cubin {len(out.asm['cubin'])} B): "
              f"div.rn.f32 x{n_div_rn}, div.full.f32 x{n_div_full}, e4m3x2 cvt {'e4m3x2' in ptx}  — {label}")


# ----------------------------------------------------------------------------------------------------------



class Checker:
    """Checks each (kernel, config) once on the check tensor, just before it is first timed; caches verdicts."""

    def __init__(self, xc: torch.Tensor, cpu_ref: tuple) -> None:
        self.xc, self.cpu_ref, self.cache = xc, cpu_ref, {}

    def prod(self, config) -> str:
        key = ("prod", config_label(config))
        if key not in self.cache:
            try:
                self.cache[key] = gemm_layout_verdict(self.cpu_ref, *launch_prod(self.xc, config))
            except Exception as err:  # noqa: BLE001
                self.cache[key] = f"ERROR {type(err).__name__}"
        return self.cache[key]

    def exp(self, name: str, w: int) -> str:
        key = (name, w)
        if key not in self.cache:
            math_, row, col, kfast, label, mode = EXPERIMENTS[name]
            try:
                o = make_outputs(self.xc, col_row_major=(col == 2))
                launch_exp(o, name, w)
                self.cache[key] = verdict(*compare(self.cpu_ref, o, row, col != 0, col_values=(col == 2)), mode)
            except Exception as err:  # noqa: BLE001
                self.cache[key] = f"ERROR {type(err).__name__}"
        return self.cache[key]


class Shape:
    """One benchmark shape: rotating inputs (with preallocated outputs), its table rows and timings."""

    def __init__(self, m: int, k: int, device: str, bench) -> None:
        self.m, self.k, self.bench = m, k, bench
        self.jb = job_bytes(m, k)
        per_set = 2 * m * k + self.jb
        mk = lambda col_row_major: make_outputs(  # noqa: E731
            torch.randn(m, k, device=device, dtype=torch.bfloat16), col_row_major)
        self.nxt_x = rotating(lambda _: mk(False), per_set)
        self._nxt_xT = None
        self._make_xT = lambda: rotating(lambda _: mk(True), per_set)  # noqa: E731
        half = self.jb // 2
        self.nxt_copy = rotating(lambda _: (torch.randint(0, 255, (half,), device=device, dtype=torch.uint8),
                                            torch.empty(half, device=device, dtype=torch.uint8)), self.jb)
        self.rows: list[list[str]] = []
        self.res: dict[str, float | None] = {}

    def nxt_xT(self):
        if self._nxt_xT is None:
            self._nxt_xT = self._make_xT()
        return self._nxt_xT()

    def add(self, key: str, label: str, t: float | None, check: str, info=("-", "-", "-"), name: str = "") -> None:
        self.res[key] = t
        own = own_bytes(name or key, self.m, self.k)
        t_copy = self.res.get("copy")
        copy_gbs = None if not t_copy else self.jb / t_copy / 1e6
        gbs_job = "-" if t is None else f"{self.jb / t / 1e6:.0f}"
        gbs_own = "-" if t is None else f"{own / t / 1e6:.0f}"
        pct = "-" if t is None or not copy_gbs else f"{100 * own / t / 1e6 / copy_gbs:.0f}%"
        self.rows.append([label, fmt_ms(t), gbs_job, gbs_own, pct, *info, check])

    def skip(self, label: str) -> bool:
        if over_budget():
            self.rows.append([label, "skipped (time budget)", *["-"] * 7])
            return True
        return False

    def exp_point(self, name: str, w: int, checker: "Checker", optional: bool = True) -> None:
        label = f"{EXPERIMENTS[name][4]} w{w}"
        if optional and self.skip(label):
            return
        check = checker.exp(name, w)
        src = self.nxt_xT if EXPERIMENTS[name][2] == 2 else self.nxt_x
        try:
            info = kernel_info(launch_exp(src(), name, w))
        except Exception:  # noqa: BLE001 — time_ms below prints the error
            info = ("-", "-", "-")
        t = self.bench(lambda: launch_exp(src(), name, w))
        self.add(f"{name}@{w}", label, t, check, info, name)

    def prod_point(self, config, checker: "Checker") -> None:
        label = f"(b) prod kernel {config_label(config)}"
        if self.skip(label):
            return
        check = checker.prod(config)
        t = self.bench(lambda: launch_prod(self.nxt_x()["x"], config))
        self.add(f"b:{config_label(config)}", label, t, check, kernel_info(_PROD_KERNELS.get(config_label(config))),
                 "b")


def main() -> None:
    global BUDGET_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes (script check only)")
    parser.add_argument("--compile-sm90", action="store_true", help="compile the variants for sm_90 and exit")
    parser.add_argument("--warmup", type=int, default=5, help="do_bench warmup (ms)")
    parser.add_argument("--rep", type=int, default=30, help="do_bench rep (ms)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds after which the optional sweep points are skipped (the essentials always run)")
    args = parser.parse_args()
    BUDGET_S = args.budget
    if args.compile_sm90:
        compile_sm90()
        return
    if SMOKE:
        print("== sweep_quant --smoke: TRITON_INTERPRET=1 on CPU; times are meaningless ==")
        device, shapes = "cpu", [(256, 384), (200, 328)]
        prod_cfgs, exp_warps = prod_configs((32,), (8,), (1,)) + prod_configs((128,), (8,), (2,)), [8, 4]
    else:
        header("sweep_quant: why the fused 1x128+128x1 quantizer runs below copy bandwidth")
        device, shapes = "cuda", [(8192, 14336), (8192, 4096)]
        prod_cfgs = prod_configs((32, 64, 128), (4, 8, 16), (1, 3))
        exp_warps = [8, 4, 16]  # first one for every variant, the others while the budget lasts

    # ---- correctness first, on one ragged check tensor (CPU reference) --------------------------------
    xc = check_tensor(device)
    cpu_ref = ref.quantize_1x128_and_128x1(xc.cpu())
    cpu_ref_p2 = ref.quantize_1x128_and_128x1(xc.cpu(), pow2=True)
    checks: dict[str, str] = {}
    # (a) goes through calclip's dispatch on CUDA; on CPU that dispatch picks the torch reference, so the smoke
    # run calls the Triton launcher directly
    fused = quant.quantize_1x128_and_128x1 if device == "cuda" else tk.quantize_1x128_and_128x1
    checks["prod"] = gemm_layout_verdict(cpu_ref, *fused(xc, gemm_layout=True))
    checker = Checker(xc, cpu_ref)
    for name in EXPERIMENTS:  # the (b) configs and other warps are checked just before they are timed
        checks[name] = checker.exp(name, exp_warps[0])
    checks["two"] = gemm_layout_verdict(cpu_ref, *tk.quantize_1x128(xc, gemm_layout=True),
                                        *tk.quantize_128x1(xc, gemm_layout=True))
    # the price of the reciprocal with power-of-two scales (1/s exact there: expected 0 differences)
    oo = make_outputs(xc)
    launch_exp(oo, "recip", exp_warps[0], pow2=True)
    recip_pow2 = verdict(*compare(cpu_ref_p2, oo, True, True), "count")
    print(f"check tensor {tuple(xc.shape)} bf16 randn + NaN/Inf blocks, vs CPU reference:")
    for key, v in checks.items():
        print(f"  {key:9s} {v}")
    print(f"  recip with pow2=True scales: {recip_pow2}", flush=True)

    # ---- timing: the essential rows of both shapes first, then the optional sweep while the budget lasts ----
    bench = lambda fn: time_ms(fn, args.warmup, args.rep)  # noqa: E731
    ctxs = [Shape(m, k, device, bench) for m, k in shapes]
    for c in ctxs:
        print(f"-- {c.m}x{c.k} essentials (t={time.perf_counter() - T0:.0f}s)", flush=True)
        c.add("copy", "copy (same bytes)", bench(lambda: (lambda p: p[1].copy_(p[0]))(c.nxt_copy())), "-")
        t_a = bench(lambda: fused(c.nxt_x()["x"], gemm_layout=True))
        chosen = [cfg for key, cfg in quantize._quantize_dual_tuned.chosen.items()
                  if key[:2] == (launch._bucket(c.k), launch._bucket(c.m))]
        # _Tuned.chosen values are (config.kwargs, all launch kwargs): warps and stages are in the second dict
        chosen_s = ", ".join(f"C{kw.get('CHUNK')} w{kw.get('num_warps')}s{kw.get('num_stages')}"
                             for _, kw in chosen) or "default"
        c.add("a", f"(a) prod via calclip [{chosen_s}]", t_a, checks["prod"])
        two = lambda: (lambda x: (tk.quantize_1x128(x, gemm_layout=True),  # noqa: E731
                                  tk.quantize_128x1(x, gemm_layout=True)))(c.nxt_x()["x"])
        c.add("two", "(e) two prod kernels", bench(two), checks["two"])
        for name in EXPERIMENTS:  # every variant at the production default warps
            c.exp_point(name, exp_warps[0], checker, optional=False)
    print(f"-- (b) config sweep (t={time.perf_counter() - T0:.0f}s)", flush=True)
    for config in prod_cfgs:
        for c in ctxs:
            c.prod_point(config, checker)
    print(f"-- experimental variants at other warps (t={time.perf_counter() - T0:.0f}s)", flush=True)
    for w in exp_warps[1:]:
        for name in EXPERIMENTS:
            for c in ctxs:
                c.exp_point(name, w, checker)
    results = {}
    for c in ctxs:
        print(f"\n{c.m}x{c.k} bf16: job {job_bytes(c.m, c.k) / 1e6:.0f} MB")
        table(["variant", "ms", "GB/s(job)", "GB/s(own)", "%copy", "regs", "spills", "smem", "check"], c.rows)
        results[(c.m, c.k)] = c.res
    conclude(results, checks, recip_pow2)
    print(f"total {time.perf_counter() - T0:.0f}s")


def _best(res: dict, prefix: str) -> tuple[str | None, float | None]:
    pts = [(t, key) for key, t in res.items() if key.startswith(prefix) and t is not None]
    if not pts:
        return None, None
    t, key = min(pts)
    return key, t


def conclude(results: dict, checks: dict, recip_pow2: str) -> None:
    """One paragraph per shape, from the numbers: the gap to copy, and what each factor saves of it."""
    print("\nCONCLUSION")
    verdicts = []
    for (m, k), res in results.items():
        t_copy, t_a = res.get("copy"), res.get("a")
        if t_copy is None or t_a is None:
            print(f"{m}x{k}: missing copy or production time, no conclusion")
            continue
        gap = t_a - t_copy
        best = {name: _best(res, f"{name}@")[1] for name in EXPERIMENTS}
        _, t_ctrl = _best(res, "ctrl@")
        b_key, t_b = _best(res, "b:")
        savings = {}  # factor -> ms saved against the best exact-division baseline of the same code
        if t_b is not None:
            savings[f"launch config (best {b_key[2:]})"] = t_a - t_b
        if t_ctrl is not None:
            for name, what in (("recip", "exact division -> reciprocal multiply"),
                               ("markstein", "exact division -> reciprocal + FMA correction (exact codes)"),
                               ("approx", "exact division -> approximate '/'"),
                               ("nodiv", "every IEEE division (scales too)"),
                               ("cols-noT", "transposed 128x1 store"), ("kfast", "grid order"),
                               ("nomath", "all per-element scaling math")):
                if best[name] is not None:
                    savings[what] = t_ctrl - best[name]
            if best["rows"] is not None:
                # a memory-bound column half would cost its share of the bytes; report the excess over that
                share = 1 - own_bytes("rows", m, k) / job_bytes(m, k)
                savings["column half, beyond its share of bytes"] = (t_ctrl - best["rows"]) - share * t_ctrl
        ranked = sorted(savings.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{what} {ms:+.3f} ms ({100 * ms / gap:.0f}% of the gap)" for what, ms in ranked) \
            if gap > 0 else "no gap"
        t_two = res.get("two")
        print(f"{m}x{k}: production {t_a:.3f} ms = {100 * t_copy / t_a:.0f}% of copy bandwidth "
              f"(copy {t_copy:.3f} ms, gap {gap:.3f} ms); two separate kernels "
              f"{'-' if t_two is None else f'{t_two:.3f} ms'}. Time saved per factor (each measured alone, not "
              f"additive): {parts}.")
        if ranked and gap > 0:
            verdicts.append((m, k, ranked[0][0], ranked[0][1] / gap))
    if verdicts:
        lines = "; ".join(f"{m}x{k}: '{what}' ({100 * frac:.0f}% of the gap)" for m, k, what, frac in verdicts)
        print(f"Dominant factor — {lines}. Price of the reciprocal at pow2=False: {checks['recip']}; "
              f"at pow2=True: {recip_pow2}. Floor of the memory pattern (no scaling math) is the 'nomath' row: "
              f"if it is near copy speed the kernel is compute/latency-bound, otherwise the access pattern "
              f"(tile shape, transposed store) is the limit.")


if __name__ == "__main__":
    main()
