"""Where the time of one FP8BlockLinear forward+backward goes: torch.profiler kernel table, GPU.

    python benchmarks/profile_linear.py [--shapes 8192x4096x14336,8192x576x1536] [--reps 10]

For each M x K x N it warms up (autotuning included), then profiles `reps` forward+backward steps of a BF16
nn.Linear and of FP8BlockLinear, and prints per step: total GPU kernel time, wall time, and the top kernels by
GPU time. Wall time well above kernel time means the step is host-bound (launch overhead), not GPU-bound.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from calclip.fp8 import Fp8Config
from calclip.fp8.linear import FP8BlockLinear


def _step(layer, x, dy):
    y = layer(x)
    y.backward(dy)


def _profile(name, layer, x, dy, reps, top):
    for _ in range(3):
        _step(layer, x, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            _step(layer, x, dy)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_total = sum(e.self_device_time_total for e in events) / reps / 1e3
    print(f"\n## {name}: wall {wall * 1e3:.3f} ms/step, GPU kernels {gpu_total:.3f} ms/step")
    print("| kernel | calls/step | ms/step |")
    print("| --- | --- | --- |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"| {e.key[:90]} | {e.count / reps:.0f} | {e.self_device_time_total / reps / 1e3:.3f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x4096x14336,8192x576x1536")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    opts = parser.parse_args()
    torch.manual_seed(0)
    for shape in opts.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        _profile(f"bf16 nn.Linear M={m} K={k} N={n}", base, x, dy, opts.reps, opts.top)
        fp8 = FP8BlockLinear.from_linear(base, Fp8Config())
        _profile(f"FP8BlockLinear M={m} K={k} N={n}", fp8, x, dy, opts.reps, opts.top)


if __name__ == "__main__":
    main()
