"""Host (Python) time of one eager fused-decode FP8BlockLinear call, without a GPU.

The layer takes its CUDA path on CPU tensors by pretending they are CUDA (``kernels.launch._check_device``) and
stubbing out Triton's C launcher (``_fast_launch``), with the autotune choice fixed to the default config: what is
timed is calclip's Python from the module call to the launch, broken down by wrapper (docs/benchmarks-log.md, fourth
session of 2026-12-01). Not a benchmark of the kernel; the numbers are this CPU's.

    python benchmarks/probes/host_path_fused_decode.py [--m 64] [--k 576] [--n 576]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets the layer pick the fused path for CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from calclip.fp8 import FP8BlockLinear, Fp8Config, quant, quantize_model  # noqa: E402


def per_call_us(fn, calls: int = 3000) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=576)
    opts = parser.parse_args()
    tk = quant.triton_kernels()
    if tk is None:
        raise SystemExit("needs triton importable")
    from calclip.fp8.kernels import fused_decode, launch

    for module in (launch, fused_decode):  # each kernel module holds its own reference to the check
        module._check_device = lambda *tensors: False  # "CUDA": the hardware-fp8 launch path
    launch._fast_launch = lambda *args, **kwargs: None  # Triton's C launcher is not timed
    tuned = fused_decode._fp8_linear_fused_quant_tuned

    class DefaultChoice(dict):
        def get(self, key, default=None):
            return tuned._default_launch

    tuned.chosen = DefaultChoice()
    layer = FP8BlockLinear(opts.k, opts.n, bias=False, config=Fp8Config(decode_fused_max_m=opts.m))
    x = torch.randn(opts.m, 1, opts.k)
    with torch.no_grad():
        layer(x)
        qw, sw, bad, count = layer._fp8_qw, layer._fp8_sw, layer._fp8_bad, layer.nonfinite_count
        x2 = x.reshape(-1, opts.k)
        inside = quantize_model(torch.nn.Sequential(torch.nn.Linear(opts.k, opts.n, bias=False)),
                                Fp8Config(decode_fused_max_m=opts.m))[0]  # no pre-hook of its own
        inside(x)
        rows = {
            "module call (layer(x)), bare layer": per_call_us(lambda: layer(x)),
            "module call, layer of a converted model": per_call_us(lambda: inside(x)),
            "layer.forward(x)": per_call_us(lambda: layer.forward(x)),
            "fp8_linear_fused_quant_gemm": per_call_us(lambda: tk.fp8_linear_fused_quant_gemm(
                x2, qw, sw, out_dtype=torch.float32, nonfinite_count=count, weight_bad=bad)),
            "fp8_linear_decode_unchecked (the layer's)": per_call_us(lambda: tk.fp8_linear_decode_unchecked(
                x2, qw, sw, out_dtype=torch.float32, nonfinite_count=count, weight_bad=bad)),
            "torch.empty of the output": per_call_us(lambda: torch.empty(opts.m, opts.n)),
        }
    print(f"host us per call, M={opts.m} K={opts.k} N={opts.n} (Triton's C launcher stubbed out)")
    for name, us in rows.items():
        print(f"  {name:44s} {us:6.1f}")


if __name__ == "__main__":
    main()
