"""FP8BlockLinear forward + backward (all quantization included) vs BF16 nn.Linear.

    python benchmarks/bench_linear.py [--quick]

One timed call = y = layer(x); y.backward(dy) with x.requires_grad (forward GEMM, dgrad and wgrad, the
activation / gradient quantizations, bias off). "fp8" reuses the cached quantized weight (training: one
weight quantization per optimizer step, amortised over gradient-accumulation micro-batches); "fp8+wq" drops
the cache before every call (the weight is re-quantized each time: the worst case, no accumulation).
Target (docs/benchmarks.md, Kernels): >= 1.35x BF16 at M=8192, K=4096, N=14336. Also prints the backend each GEMM
resolves to. If calclip.fp8.linear cannot be imported, the same three FP8 GEMMs + quantizations are timed from the
kernels directly ("kernels" column) so the hardware numbers still come out.
"""

from __future__ import annotations

import argparse

import torch

from _common import fmt_ms, header, ratio, rotating, safe_bench, table, tflops, try_import

TARGET = 1.35
TARGET_SHAPE = (8192, 4096, 14336)
SHAPES = [(8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 4096), (2048, 4096, 14336),
          (16384, 4096, 14336), (16384, 14336, 4096), (8192, 576, 1536), (8192, 1536, 576)]


def _resolved_backends(gemm, tk, m, k, n, backend="auto"):
    """Which backend each of the layer's three GEMMs runs (fwd / dgrad / wgrad)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qx, _ = tk.quantize_1x128(x)
    qw, _ = tk.quantize_128x128(w)
    qdy, _ = tk.quantize_1x128(dy)
    qdy_t, _ = tk.quantize_128x1(dy, gemm_layout=True)  # as the layer makes them: token rows padded (wgrad_rows)
    qx_t, _ = tk.quantize_128x1(x, gemm_layout=True)
    out = []
    for qa, qb, blocks in ((qx, qw, ("1x128", "128x128")), (qdy, qw.t(), ("1x128", "128x128")),
                           (qdy_t.t(), qx_t.t(), ("1x128", "1x128"))):
        out.append(gemm.resolve_backend(backend, qa, qb, out_dtype=torch.bfloat16, a_blocks=blocks[0],
                                        b_blocks=blocks[1]))
    return "/".join(out)


def _kernels_only_step(tk, gemm_fn):
    """The FP8 layer's work without the module: quantize x and dy (1x128 + 128x1 each), three GEMMs; dgrad
    reads W^T codes made contiguous once, as the module's weight cache does. Quantization as the module does it:
    the two kernels, scales in scaled_mm's strides."""
    def both(t):
        return (*tk.quantize_1x128(t, gemm_layout=True), *tk.quantize_128x1(t, gemm_layout=True))

    def step(d):
        qx, sx, qx_t, sx_t = both(d["x"])
        y = gemm_fn(qx, sx, d["qw"], d["sw"], "128x128")
        qdy, sdy, qdy_t, sdy_t = both(d["dy"])
        dx = gemm_fn(qdy, sdy, d["qwt"], d["swt"], "128x128")
        dw = gemm_fn(qdy_t.t(), sdy_t.t(), qx_t.t(), sx_t.t(), "1x128")
        return y, dx, dw
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the target shape and its transpose only")
    args = parser.parse_args()
    header("bench_linear: FP8BlockLinear fwd+bwd vs BF16 nn.Linear")
    fp8 = try_import("calclip.fp8")
    linear_mod = try_import("calclip.fp8.linear")
    gemm = try_import("calclip.fp8.gemm")
    tk = try_import("calclip.fp8.kernels")
    shapes = SHAPES[:2] if args.quick else SHAPES
    rows, target_ratio = [], None
    for m, k, n in shapes:
        flop = 3 * 2.0 * m * n * k  # forward + dgrad + wgrad
        print(f"-- M={m} K={k} N={n}", flush=True)
        torch.manual_seed(0)
        bf16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        nxt = rotating(lambda _: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_(),
                                  torch.randn(m, n, device="cuda", dtype=torch.bfloat16)), 2 * (m * k + m * n))

        def fwd_bwd(layer, drop_cache=False):
            def run():
                x, dy = nxt()
                if drop_cache:
                    layer._weight_cache = None
                layer(x).backward(dy)
            return run

        t_bf16 = safe_bench(fwd_bwd(bf16), grad_to_none=[bf16.weight])
        t_fp8 = t_fp8_wq = t_kern = None
        backends = "-"
        if linear_mod is not None and fp8 is not None:
            layer = linear_mod.FP8BlockLinear.from_linear(bf16, fp8.Fp8Config())
            t_fp8 = safe_bench(fwd_bwd(layer), grad_to_none=[layer.weight])
            t_fp8_wq = safe_bench(fwd_bwd(layer, drop_cache=True), grad_to_none=[layer.weight])
        if tk is not None:
            if gemm is not None:
                backends = _resolved_backends(gemm, tk, m, k, n)

            def gemm_fn(qa, sa, qb, sb, b_blocks):
                if gemm is not None:
                    return gemm.fp8_block_gemm(qa, sa, qb, sb, out_dtype=torch.bfloat16, backend="auto",
                                               a_blocks="1x128", b_blocks=b_blocks)
                return tk.fp8_block_gemm_triton(qa, sa, qb, sb, out_dtype=torch.bfloat16)

            qw, sw = tk.quantize_128x128(bf16.weight.detach())
            qwt, swt = qw.t().contiguous(), sw.t().contiguous()
            step = _kernels_only_step(tk, gemm_fn)

            def run_kernels():
                x, dy = nxt()
                return step({"qw": qw, "sw": sw, "qwt": qwt, "swt": swt, "x": x.detach(), "dy": dy})

            t_kern = safe_bench(run_kernels)
        rows.append([str(m), str(k), str(n), fmt_ms(t_bf16), tflops(flop, t_bf16), fmt_ms(t_fp8),
                     tflops(flop, t_fp8), ratio(t_bf16, t_fp8), ratio(t_bf16, t_fp8_wq), ratio(t_bf16, t_kern),
                     backends])
        if (m, k, n) == TARGET_SHAPE and t_bf16 and t_fp8:
            target_ratio = t_bf16 / t_fp8
        del bf16
        torch.cuda.empty_cache()
    table(["M", "K", "N", "bf16 ms", "bf16 TF/s", "fp8 ms", "fp8 TF/s", "fp8 x", "fp8+wq x", "kernels x",
           "fwd/dgrad/wgrad backend"], rows)
    print("x = BF16 time / FP8 time for forward+backward. 'kernels': the same quantizations + GEMMs called directly.")
    if target_ratio is not None:
        print(f"target shape M={TARGET_SHAPE[0]} K={TARGET_SHAPE[1]} N={TARGET_SHAPE[2]}: {target_ratio:.2f}x, "
              f"target >= {TARGET}x -> {'MET' if target_ratio >= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
