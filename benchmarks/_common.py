"""Shared pieces of the calclip benchmarks: environment header, timing, rotating inputs, tables.

Timing: ``triton.testing.do_bench`` median (it clears the L2 cache before every call and times only the call).
Inputs additionally rotate over several sets whose total size exceeds the H200's 50 MB L2, so no call reads
operands a previous call left in cache. Data is random normal (never zeros: FP8 kernels and clock boosting
behave differently on zeros).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

# Benchmarks run from a checkout: `python benchmarks/bench_x.py` puts benchmarks/ on sys.path, not the root.
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

L2_BYTES = 50 * 2**20  # H200
ROTATE_BYTES = 4 * L2_BYTES  # each timed call touches fresh memory
MAX_SETS = 8


def package_version(name: str) -> str:
    """``name``'s installed version, or 'MISSING' (imports nothing)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "MISSING"


def git_commit() -> str:
    """Short commit of the checkout, '+dirty' when tracked files differ from it; '?' outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def header(title: str, needs_gpu: bool = True) -> None:
    """The run's versions and device; without CUDA, exits unless the run ``needs_gpu`` not (a summary of saved
    results)."""
    print(f"== {title} ==")
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S')}  python {platform.python_version()}  torch {torch.__version__}"
          f"  cuda {torch.version.cuda}", end="")
    try:
        import triton

        print(f"  triton {triton.__version__}")
    except ImportError:
        print("  triton MISSING")
    if torch.cuda.is_available():
        print(f"device {torch.cuda.get_device_name()}  capability {torch.cuda.get_device_capability()}")
    elif needs_gpu:
        print("device: no CUDA — benchmarks need a GPU")
        sys.exit(0)
    else:
        print("device: no CUDA (summarizing saved results)")


def try_import(module: str):
    """Import ``module`` or print why not and return None (benchmarks still run what they can)."""
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001 — report any failure, keep benchmarking the kernels
        print(f"!! cannot import {module}:")
        traceback.print_exc(limit=3, file=sys.stdout)
        return None


def n_sets(bytes_per_set: int) -> int:
    return max(2, min(MAX_SETS, -(-ROTATE_BYTES // max(bytes_per_set, 1))))


def rotating(make, bytes_per_set: int):
    """Build ``n_sets`` input sets with ``make(i)``; return a callable giving the next set on every call."""
    sets = [make(i) for i in range(n_sets(bytes_per_set))]
    cycle = itertools.cycle(sets)
    return lambda: next(cycle)


def bench_ms(fn, *, warmup: int = 25, rep: int = 100, grad_to_none=None) -> float:
    """Median milliseconds of ``fn()`` (triton do_bench; L2 cleared between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                         return_mode="median"))


def safe_bench(fn, **kwargs) -> float | None:
    """bench_ms, or None after printing the error (one failing variant must not stop a table)."""
    try:
        fn()  # compile / autotune outside the timed region
        torch.cuda.synchronize()
        return bench_ms(fn, **kwargs)
    except Exception as err:  # noqa: BLE001
        print(f"   !! {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
        return None


def tflops(flop: float, ms: float | None) -> str:
    return "-" if ms is None else f"{flop / ms / 1e9:.0f}"


def ratio(base_ms: float | None, ms: float | None) -> str:
    return "-" if base_ms is None or ms is None else f"{base_ms / ms:.2f}x"


# Student's t, two-sided 95% (the 0.975 quantile), for 1 to 30 degrees of freedom; beyond, the normal's 1.96
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_ratio_interval(ratios: list[float | None]) -> dict | None:
    """Rounds of a paired comparison (each ratio baseline / arm, the two run back to back on the host as it was then):
    the geometric mean of the ratios and its two-sided 95% interval, a t interval on their logarithms (rounds taken
    as independent, log-ratios as roughly normal). Where the host changes speed between rounds, this pairs what the
    pooled medians mix; its width says how many rounds a claimed ratio needs. None with fewer than two ratios.
    Missing rounds (None) are left out; a ratio <= 0 is refused (a time cannot be zero or negative)."""
    measured = [r for r in ratios if r is not None]
    if any(not r > 0 for r in measured):
        raise ValueError(f"paired_ratio_interval: ratios must be > 0, got {measured}")
    if len(measured) < 2:
        return None
    logs = [math.log(r) for r in measured]
    mean, n = statistics.fmean(logs), len(logs)
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * statistics.stdev(logs) / math.sqrt(n)
    return {"geomean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "rounds": n}


def fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


def table(columns: list[str], rows: list[list[str]]) -> None:
    """Print a Markdown table (pastes straight into docs/benchmarks-log.md)."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for r in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |")
    sys.stdout.flush()


def scaled_mm_forward(qx, sx, qw, sw, out_dtype=torch.bfloat16):
    """Direct torch._scaled_mm forward (used when calclip.fp8.gemm cannot be imported). Layouts measured in
    docs/scaled_mm_layouts.md: 1x128 scales column-major (M, K/128); weight scales sw.t() of contiguous
    (N/128, K/128). Correct only when K/128 is a multiple of 4."""
    return torch._scaled_mm(qx, qw.t(), scale_a=sx.t().contiguous().t(), scale_b=sw.t(), out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Kernel profiles: a profiler's CUDA kernels by category (profile_model_step.py, bench_vllm.py decode_profile)


def kernel_category(kernel: str, categories) -> str:
    """The first (category, regex) of ``categories`` whose pattern is found in a CUDA kernel's name (case
    insensitive); "other" when none is."""
    import re

    for name, pattern in categories:
        if re.search(pattern, kernel, re.IGNORECASE):
            return name
    return "other"


def is_device_work(event) -> bool:
    """A profiler event that is work on the GPU (a kernel, copy or fill): a CUDA event that is not a user annotation.
    A ``record_function`` range (the optimizer's ``Optimizer.step#AdamW.step``, a probe's own ranges) also comes
    back as a CUDA event spanning the kernels it launched; counted as a kernel it adds its span a second time (the
    profiles up to 2026-12-07 did: 4.4-8.2 ms per step under "optimizer", GPU kernels > wall) and hides the GPU's
    idle gaps inside it."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def kernel_times(prof) -> dict[str, tuple[float, int]]:
    """kernel name -> (summed device us, launches) over a finished profiler's GPU work (``is_device_work``)."""
    import collections

    times: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if is_device_work(event):
            entry = times[event.name]
            entry[0] += event.device_time
            entry[1] += 1
    return {name: (us, n) for name, (us, n) in times.items()}


# CUDA runtime / driver calls that launch a kernel, as torch.profiler names them on the CPU side.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def host_times(prof, names) -> dict[str, tuple[float, int]]:
    """name -> (summed CPU us, calls) of a finished profiler's CPU events named in ``names`` (record_function
    ranges, CUDA runtime calls); every name present, (0.0, 0) when it never ran."""
    times = {name: [0.0, 0] for name in names}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU and event.name in times:
            entry = times[event.name]
            entry[0] += event.cpu_time_total
            entry[1] += 1
    return {name: (us, n) for name, (us, n) in times.items()}


# CUDA runtime calls that hold the host until the GPU catches up (a sync, a copy to or from pageable memory) or that
# may (the allocator's cudaMalloc / cudaFree): where the GPU idles inside a step although the launches keep ahead.
WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "cudaHostAlloc")

# CPU ops too generic to name where a launch came from (the profiler's own ranges, the launch calls themselves).
_GENERIC_OPS = ("ProfilerStep", "cuda", "cu")


def _launch_source(launch) -> str:
    """'outermost > innermost' of the CPU ops enclosing a launch call (by ``cpu_parent``), the generic ones skipped:
    the step's region (a compiled graph, autograd's backward of one, the optimizer, a calclip range) and the op
    whose launch it was."""
    names = []
    event = getattr(launch, "cpu_parent", None)
    while event is not None:
        if not event.name.startswith(_GENERIC_OPS):
            names.append(event.name)
        event = getattr(event, "cpu_parent", None)
    if not names:
        return "(top level)"
    inner, outer = names[0][:60], names[-1][:60]
    return outer if inner == outer else f"{outer} > {inner}"


def gpu_idle(events, min_gap_us: float = 20.0) -> dict:
    """Where the GPU waited for the host, from a finished profiler's events (``prof.events()``).

    The device events (kernels, copies, fills), in start order, leave gaps where nothing ran; summed, they are the
    idle time between the first and the last. Each gap of at least ``min_gap_us`` is charged to the host code that
    launched the event after it (the launch call with the same correlation id, its enclosing ops by
    ``_launch_source``): the GPU was idle because that launch came late. Returns {"span_us", "busy_us", "idle_us",
    "gaps": {source: [us, count]} for the gaps >= min_gap_us}. (The host calls that wait, ``WAIT_CALLS``, are
    ``host_times``'.)"""
    cpu = torch.autograd.DeviceType.CPU
    device = sorted((e for e in events if is_device_work(e)), key=lambda e: e.time_range.start)
    # a runtime / driver call: the launch of the device event with its id
    launches = {e.id: e for e in events if e.device_type == cpu and e.name.startswith("cu")}
    out = {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": {}}
    if not device:
        return out
    end = device[0].time_range.end
    out["busy_us"] = device[0].time_range.end - device[0].time_range.start
    for event in device[1:]:
        start, stop = event.time_range.start, event.time_range.end
        gap = start - end
        if gap > 0:
            out["idle_us"] += gap
            if gap >= min_gap_us:
                launch = launches.get(event.id)
                source = _launch_source(launch) if launch is not None else "(launch not found)"
                entry = out["gaps"].setdefault(source, [0.0, 0])
                entry[0] += gap
                entry[1] += 1
        out["busy_us"] += max(0.0, stop - max(start, end))
        end = max(end, stop)
    out["span_us"] = end - device[0].time_range.start
    return out


def split_by_category(times: dict[str, tuple[float, int]], steps: int, categories) -> dict[str, float]:
    """category -> ms per step, every category of ``categories`` (and "other") present."""
    split = dict.fromkeys([*(name for name, _ in categories), "other"], 0.0)
    for kernel, (us, _) in times.items():
        split[kernel_category(kernel, categories)] += us / steps / 1e3
    return split


def dispatch_switches(env=os.environ) -> str:
    """calclip's dispatch switches set in ``env`` (``compile_cache.DISPATCH_ENV``: autotune, one_buffer, ...), or
    "default", for a benchmark's header: a row measured with one of them set says so (the H100 model rows of
    2026-12-05/06 ran with CALCLIP_TRITON_AUTOTUNE=0; the product's default autotunes)."""
    from calclip.fp8.compile_cache import DISPATCH_ENV

    chosen = [f"{name}={env[name]}" for name in DISPATCH_ENV if name in env]
    return " ".join(chosen) if chosen else "default"
