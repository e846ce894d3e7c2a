"""Forward GEMM path: FP8 block GEMM (scaled_mm and Triton backends) vs BF16 F.linear, measured side by side.

    python benchmarks/bench_gemm.py            # M in {2048, 8192, 16384}, (K, N) in {4096, 14336}^2
    python benchmarks/bench_gemm.py --quick    # M = 8192 only

Columns: BF16 F.linear(x, W); FP8 GEMM alone on pre-quantized operands (the weight is quantized once and
cached in training, so this is the GEMM's own speed); FP8 GEMM + the 1x128 activation quantization of x (what
the forward of FP8BlockLinear pays per call). Ratios are BF16 time / FP8 time (> 1 is faster). Target
(docs/benchmarks.md, Kernels): forward GEMM path >= 1.45x BF16.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from _common import (fmt_ms, header, ratio, rotating, safe_bench, scaled_mm_forward, table, tflops,
                     try_import)

TARGET = 1.45


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="M = 8192 only")
    args = parser.parse_args()
    header("bench_gemm: forward GEMM, FP8 block vs BF16")

    tk = try_import("calclip.fp8.kernels")
    gemm = try_import("calclip.fp8.gemm")
    if tk is None:
        print("!! no Triton kernels: nothing FP8 to measure")
    ms_list = [8192] if args.quick else [2048, 8192, 16384]
    kn_list = list(itertools.product([4096, 14336], repeat=2))
    rows, fwd_ratios = [], []
    for m, (k, n) in itertools.product(ms_list, kn_list):
        flop = 2.0 * m * n * k
        print(f"-- M={m} K={k} N={n}", flush=True)
        torch.manual_seed(0)

        def make(_):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            entry = {"x": x, "w": w}
            if tk is not None:
                entry["qx"], entry["sx"] = tk.quantize_1x128(x)
                entry["qw"], entry["sw"] = tk.quantize_128x128(w)
            return entry

        bytes_per_set = 2 * (m * k + n * k) + (m * k + n * k if tk is not None else 0)
        nxt = rotating(make, bytes_per_set)
        t_bf16 = safe_bench(lambda: (lambda d: F.linear(d["x"], d["w"]))(nxt()))
        times: dict[str, float | None] = {}
        chosen = "-"
        if tk is not None:
            def sm_gemm(d):
                if gemm is not None:
                    return gemm.fp8_block_gemm(d["qx"], d["sx"], d["qw"], d["sw"], out_dtype=torch.bfloat16,
                                               backend="scaled_mm")
                return scaled_mm_forward(d["qx"], d["sx"], d["qw"], d["sw"])

            def tr_gemm(d):
                return tk.fp8_block_gemm_triton(d["qx"], d["sx"], d["qw"], d["sw"], out_dtype=torch.bfloat16)

            if gemm is not None:
                d0 = nxt()
                chosen = gemm.resolve_backend("scaled_mm", d0["qx"], d0["qw"], out_dtype=torch.bfloat16,
                                              a_blocks="1x128", b_blocks="128x128")

            def with_quant(fn):
                def run(d):
                    qx, sx = tk.quantize_1x128(d["x"])
                    return fn({**d, "qx": qx, "sx": sx})
                return run

            times["scaled_mm"] = safe_bench(lambda: sm_gemm(nxt()))
            times["triton"] = safe_bench(lambda: tr_gemm(nxt()))
            times["scaled_mm+q"] = safe_bench(lambda: with_quant(sm_gemm)(nxt()))
            times["triton+q"] = safe_bench(lambda: with_quant(tr_gemm)(nxt()))
        row = [str(m), str(k), str(n), fmt_ms(t_bf16), tflops(flop, t_bf16)]
        for key in ("scaled_mm", "triton", "scaled_mm+q", "triton+q"):
            t = times.get(key)
            row += [tflops(flop, t), ratio(t_bf16, t)]
        row.append(chosen)
        rows.append(row)
        best = [times.get(key) for key in ("scaled_mm+q", "triton+q") if times.get(key)]
        if t_bf16 and best:
            fwd_ratios.append((m, k, n, t_bf16 / min(best)))
    table(["M", "K", "N", "bf16 ms", "bf16 TF/s", "scaled_mm TF/s", "x", "triton TF/s", "x",
           "scaled_mm+q TF/s", "x", "triton+q TF/s", "x", "scaled_mm req. ->"], rows)
    print("x = BF16 time / FP8 time. '+q' includes the 1x128 activation quantization (weights pre-quantized).")
    print("'scaled_mm req. ->': the backend gemm.fp8_block_gemm actually runs when scaled_mm is requested.")
    if fwd_ratios:
        worst = min(r for *_, r in fwd_ratios)
        print(f"forward GEMM path incl. activation quantization, best backend per shape: min {worst:.2f}x, "
              f"target >= {TARGET}x -> {'MET' if worst >= TARGET else 'MISSED'}")


if __name__ == "__main__":
    main()
