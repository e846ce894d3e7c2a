"""Where does FP8BlockLinear's host time go? cProfile (Python functions) and torch.profiler (ops, self CPU) of
fwd+bwd calls at M=2048, K=N=4096, after warm-up. One-off probe of the layer's host time.

    python benchmarks/probes/host_profile_linear.py
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from calclip.fp8 import FP8BlockLinear  # noqa: E402

layer = FP8BlockLinear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)


def fwd_bwd():
    layer(x).backward(dy)


def fwd():
    with torch.no_grad():
        layer(x)


for _ in range(10):
    fwd_bwd()
torch.cuda.synchronize()
for name, fn in (("fwd_bwd", fwd_bwd), ("fwd no_grad", fwd)):
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    print(f"{name}: host {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms/call", flush=True)
    torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(50):
    fwd_bwd()
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
    for _ in range(20):
        fwd_bwd()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
