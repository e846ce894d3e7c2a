"""Host (Python) time of one eager training FP8BlockLinear forward + backward, without a GPU.

The layer's CUDA code path runs on CPU tensors: the quantizer dispatch picks calclip's Triton wrappers for every
tensor, the wrappers believe the tensors are CUDA ones (``kernels.launch._check_device``), calclip's launch path
(``_fast_launch``) runs up to the compiled kernel's C launcher, which is a no-op, every autotuned kernel uses its
default config, and the GEMM backend is calclip's
Triton GEMM (as for SmolLM2's K=576, which ``torch._scaled_mm``'s blockwise path cannot take). Outputs are
uninitialised memory: what is timed is calclip's Python and torch's dispatch, autograd included, from the module
call to the last launch of the backward, per layer of a chain of ``--layers`` (one ``backward()`` per chain, as in
a model). A chain of nn.Linear at 8 x 128 x 128 (its CPU matmuls take a few us) is printed beside it: roughly
what a BF16 layer costs the host. Not a benchmark of the kernels; the numbers are this CPU's (docs/benchmarks-log.md).

    python benchmarks/probes/host_path_train.py [--m 256] [--k 576] [--n 576] [--dtype bf16] [--layers 8] [--profile]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from calclip.fp8 import FP8BlockLinear, Fp8Config, gemm, linear_math, quant, reference  # noqa: E402
from calclip.fp8.weight_codes import invalidate_fp8_weight_caches  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(20, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(3):  # best of three batches: this CPU is shared
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def stub_launches() -> object:
    tk = quant.triton_kernels()
    if tk is None:
        raise SystemExit("needs triton importable")
    from calclip.fp8.kernels import block_gemm, fused_decode, launch, quantize, splitk_gemm

    modules = (launch, quantize, block_gemm, splitk_gemm, fused_decode)
    for module in modules:  # each kernel module holds its own reference to the check
        if hasattr(module, "_check_device"):
            module._check_device = lambda *tensors: False  # "CUDA": the hardware-fp8 launch path

    # _fast_launch runs as on a GPU (its cache key, hooks and stream lookup are timed); only the compiled kernel's C
    # launcher, the one call that would reach CUDA, is a no-op.
    class CompiledStub:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

        @staticmethod
        def launch_metadata(*args):  # Triton's own builds a LazyDict here (~1.5 us more, not timed)
            return None

    class EveryKernelCompiled(dict):
        def get(self, key, default=None):
            return (CompiledStub, ())

    launch._compiled_launches = EveryKernelCompiled()
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: 0

    class DefaultChoice(dict):
        def __init__(self, tuned):
            super().__init__()
            self.tuned = tuned

        def get(self, key, default=None):
            return self.tuned._default_launch

    for value in [v for module in modules for v in vars(module).values()]:
        if isinstance(value, launch._Tuned):
            value.chosen = DefaultChoice(value)

    def impl(x, name, block):  # every tensor takes the Triton wrapper, as CUDA tensors do
        return getattr(tk, name, None) or getattr(reference, name)

    quant._impl = impl

    def requantize(w, q, s, bad, *, transposed=None, block=128, pow2=False):  # the weight refresh's CUDA path
        qt, st = transposed if transposed is not None else (None, None)
        tk.requantize_128x128_(w, q, s, bad, qt=qt, st=st, block=block, pow2=pow2)

    quant.requantize_128x128_ = requantize
    forced = lambda backend, *args, **kwargs: "triton"  # noqa: E731
    gemm.resolve_backend = forced
    linear_math.resolve_backend = forced
    linear_math._gemm_choice.clear()
    return tk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=256, help="tokens per call")
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=576)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8, help="layers chained per timed forward + backward")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions of the chain")
    opts = parser.parse_args()
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    tk = stub_launches()
    if opts.k != opts.n and opts.layers > 1:
        raise SystemExit("--layers > 1 chains the layers: needs --k == --n")
    torch.manual_seed(0)
    config = Fp8Config(decode_fused_max_m=0)
    chain = [FP8BlockLinear(opts.k, opts.n, bias=False, dtype=dtype, config=config) for _ in range(opts.layers)]
    layer = chain[0]
    x = torch.randn(opts.m, opts.k, dtype=dtype, requires_grad=True)
    # the BF16 reference's dispatch without its CPU matmul cost: the same chain of nn.Linear at 8 x 128 x 128, fp32
    small = [torch.nn.Linear(128, 128, bias=False) for _ in range(opts.layers)]
    xs = torch.randn(8, 128, requires_grad=True)

    dy = torch.randn(opts.m, opts.n, dtype=dtype)
    dys = torch.randn(8, 128)

    def run(modules, inp, grad_out):
        for module in modules:  # set_to_none, as trainers zero grads: AccumulateGrad then keeps dW, no CPU add
            module.weight.grad = None
        inp.grad = None
        y = inp
        for module in modules:
            y = module(y)
        y.backward(grad_out)

    def fp8_step():
        run(chain, x, dy)

    def fp8_forward_no_grad():
        with torch.no_grad():
            layer(x)

    def linear_step():
        run(small, xs, dys)

    fp8_step()  # builds the weight and dgrad codes once
    if opts.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            fp8_step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    qw, sw, bad, count = layer._fp8_qw, layer._fp8_sw, layer._fp8_bad, layer.nonfinite_count
    x2 = x.detach()

    def refresh():
        invalidate_fp8_weight_caches()
        layer._refresh_weight_codes()
    qx, sx = quant.quantize_1x128(x2, gemm_layout=True)
    rows = {
        "FP8 layer forward + backward (per layer of the chain)": per_call_us(fp8_step, opts.calls) / opts.layers,
        "nn.Linear forward + backward, 8x128x128 fp32 (per layer)": per_call_us(linear_step, opts.calls) / opts.layers,
        "FP8 layer forward, no grad (two launches)": per_call_us(fp8_forward_no_grad, opts.calls),
        "  quantize_1x128 + count (wrapper)": per_call_us(lambda: quant.quantize_1x128(
            x2, gemm_layout=True, nonfinite_count=count, weight_bad=bad), opts.calls * 5),
        "  quantize_1x128 (wrapper)": per_call_us(lambda: quant.quantize_1x128(x2, gemm_layout=True), opts.calls * 5),
        "  quantize_128x1 (wrapper)": per_call_us(lambda: quant.quantize_128x1(x2, gemm_layout=True), opts.calls * 5),
        "  GEMM (linear_math._gemm, Triton wrapper)": per_call_us(lambda: linear_math._gemm(
            qx, sx, qw, sw, dtype, "auto", "1x128", "128x128"), opts.calls * 5),
        "  weight-staleness check": per_call_us(layer._refresh_weight_codes, opts.calls * 5),
        "  weight refresh after a weight change (2 launches)": per_call_us(refresh, opts.calls * 5),
        "  torch.empty of one output": per_call_us(lambda: torch.empty(opts.m, opts.n, dtype=dtype), opts.calls * 5),
    }
    print(f"host us per call, M={opts.m} K={opts.k} N={opts.n} {opts.dtype}, {opts.layers} layers chained "
          f"(Triton's C launcher stubbed out)")
    for name, us in rows.items():
        print(f"  {name:50s} {us:7.1f}")
    del tk


if __name__ == "__main__":
    main()
