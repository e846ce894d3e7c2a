"""FP8BlockLinear fwd+bwd with the fused 1x128+128x1 quantizer vs the two separate quantizer kernels, GPU.

    python benchmarks/probes/bench_linear_quant_paths.py

bench_quant.py measured the fused kernel at ~25% of copy bandwidth, slower than the two separate kernels at
8192x14336; this times the whole layer both ways in one run (the separate path is patched in for the second
measurement) against BF16 nn.Linear, so the production choice rests on the layer, not on one kernel. The
layers are built with Fp8Config(fused_quantizer=True / False); the H200 run of 2026-11-30 made False the default.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
import _common  # noqa: E402,F401  (puts the repository root on sys.path)

from calclip.fp8 import Fp8Config  # noqa: E402
from calclip.fp8.linear import FP8BlockLinear  # noqa: E402

SHAPES = ((8192, 4096, 14336), (8192, 14336, 4096), (16384, 4096, 14336), (8192, 4096, 4096), (8192, 576, 1536))


def _time(layer, x, dy):
    def step():
        x.grad = None
        layer(x).backward(dy)

    return do_bench(step, warmup=25, rep=100, return_mode="median")


def main():
    torch.manual_seed(0)
    print("| M | K | N | bf16 ms | fp8 fused ms | x | fp8 two-kernel ms | x |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        t_bf16 = _time(base, x, dy)
        t_fused = _time(FP8BlockLinear.from_linear(base, Fp8Config(fused_quantizer=True)), x, dy)
        t_two = _time(FP8BlockLinear.from_linear(base, Fp8Config(fused_quantizer=False)), x, dy)
        print(f"| {m} | {k} | {n} | {t_bf16:.3f} | {t_fused:.3f} | {t_bf16 / t_fused:.2f}x | {t_two:.3f} | "
              f"{t_bf16 / t_two:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
