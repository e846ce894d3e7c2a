"""Where an FP8 training step's time should go at a model row's dims: an account from the shapes and calclip's own
dispatch rules, to read beside bench_speed's model rows and to check against profile_model_step.py's kernel times.

    python benchmarks/model_step_budget.py                          # bench_speed's default rows
    python benchmarks/model_step_budget.py --models qwen2.5-1.5b --row-scales

For every linear of one decoder layer (q, k, v, o, gate, up, down) and each of its three GEMMs (forward, dgrad with
the W^T codes, wgrad over the tokens) it asks ``calclip.fp8.gemm.scaled_mm_supports`` whether cuBLAS
(``torch._scaled_mm``) takes it or the Triton block GEMM does (as ``resolve_backend`` decides on the H200; with
``--row-scales``, Fp8Config.scaled_mm_row_scales' rule too), and counts the bytes the quantizers move per step:
x in 1x128 and 128x1 for each linear that reads it (q, k and v each quantize the same x today), dy likewise, and
every weight twice (W and W^T codes) since the weights change every step. Then it prices them with throughputs
measured on the H200 (docs/benchmarks-log.md; change them with the flags): BF16 GEMMs, cuBLAS blockwise FP8 GEMMs,
the Triton block GEMM, and the quantizers' share of copy bandwidth. Everything else (attention, norms, the
optimizer) is taken as equal in both arms. Not a measurement: the profile says what is true.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/, for bench_speed's rows
from bench_speed import parse_model_rows  # noqa: E402

from calclip.fp8.gemm import scaled_mm_supports  # noqa: E402

QUANT_BYTES_PER_ELEMENT = 3  # one quantizer pass: read bf16 (2 B), write e4m3 (1 B); scales ~1/128 of that


@dataclass
class Budget:
    gemm_flops: dict[str, float]  # "cublas" / "triton" -> FP8 GEMM flops per step
    quant_bytes: dict[str, float]  # "x" / "dy" / "weights" -> bytes per step
    triton_gemms: list[str]
    sibling_bytes: float  # bytes of the x quantizations that q/k/v and gate/up repeat


def layer_linears(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple]:
    """(in_features, out_features) of a Llama decoder layer's seven linears."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden), "gate": (hidden, intermediate),
            "up": (hidden, intermediate), "down": (intermediate, hidden)}


def cublas_takes(a_blocks: str, b_blocks: str, m: int, n: int, k: int, row_scales: bool) -> bool:
    if scaled_mm_supports(a_blocks, b_blocks, m, n, k, torch.bfloat16):
        return True
    # Fp8Config.scaled_mm_row_scales: a 128x128 weight's scales repeated per row make it a 1x128 operand
    return row_scales and b_blocks == "128x128" and scaled_mm_supports(a_blocks, "1x128", m, n, k, torch.bfloat16)


def budget(row, tokens: int, row_scales: bool = False) -> Budget:
    flops = {"cublas": 0.0, "triton": 0.0}
    qbytes = {"x": 0.0, "dy": 0.0, "weights": 0.0}
    triton_gemms: list[str] = []
    linears = layer_linears(row.hidden, row.intermediate, row.heads, row.kv_heads,
                            row.head_dim or row.hidden // row.heads)
    for name, (k_in, n_out) in linears.items():
        gemms = {"fwd": (tokens, n_out, k_in, "1x128", "128x128"),
                 "dgrad": (tokens, k_in, n_out, "1x128", "128x128"),
                 "wgrad": (n_out, k_in, tokens, "1x128", "1x128")}
        for kind, (m, n, k, a, b) in gemms.items():
            where = "cublas" if cublas_takes(a, b, m, n, k, row_scales) else "triton"
            flops[where] += 2.0 * m * n * k * row.layers
            if where == "triton":
                triton_gemms.append(f"{name}.{kind}")
        qbytes["x"] += 2 * QUANT_BYTES_PER_ELEMENT * tokens * k_in * row.layers  # 1x128 + 128x1
        qbytes["dy"] += 2 * QUANT_BYTES_PER_ELEMENT * tokens * n_out * row.layers
        qbytes["weights"] += 2 * QUANT_BYTES_PER_ELEMENT * k_in * n_out * row.layers  # W and W^T codes
    # q/k/v read one x and gate/up another: quantizing each once would save these passes
    sibling = 2 * QUANT_BYTES_PER_ELEMENT * tokens * row.hidden * (2 + 1) * row.layers
    return Budget(flops, qbytes, triton_gemms, sibling)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-7b,llama3-8b", help="bench_speed.py --models syntax")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--row-scales", action=argparse.BooleanOptionalAction, default=True,
                        help="with Fp8Config.scaled_mm_row_scales (on by default since 2026-12-02, as in Fp8Config)")
    parser.add_argument("--bf16-tflops", type=float, default=735.0, help="BF16 cuBLAS (H200: 676-794)")
    parser.add_argument("--fp8-tflops", type=float, default=1120.0, help="blockwise cuBLAS FP8 (H200: 1084-1155)")
    parser.add_argument("--triton-tflops", type=float, default=560.0,
                        help="calclip's Triton block GEMM (H200, bench_gemm runs 1-2: 527-606 at K, N in {4096, "
                             "14336}, i.e. slower than BF16; not measured at K = 8960)")
    parser.add_argument("--quant-tbps", type=float, default=2.6,
                        help="quantizer throughput, TB/s of bytes moved (H200: 53-85%% of ~4 TB/s copy)")
    opts = parser.parse_args(argv)
    rows = parse_model_rows(opts.models)
    print("| model | tokens | FP8 GEMM flops on the Triton block GEMM | which | BF16 GEMMs ms | FP8 GEMMs ms | "
          "quantizers ms (x / dy / weights) | q/k/v, gate/up x repeats ms | FP8 - BF16 ms (linear layers) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        tokens = (row.batch or 8) * opts.seq
        b = budget(row, tokens, opts.row_scales)
        total = sum(b.gemm_flops.values())
        bf16_ms = total / (opts.bf16_tflops * 1e12) * 1e3
        fp8_ms = (b.gemm_flops["cublas"] / (opts.fp8_tflops * 1e12) + b.gemm_flops["triton"]
                  / (opts.triton_tflops * 1e12)) * 1e3
        q_ms = {key: v / (opts.quant_tbps * 1e12) * 1e3 for key, v in b.quant_bytes.items()}
        sibling_ms = b.sibling_bytes / (opts.quant_tbps * 1e12) * 1e3
        print(f"| {row.label} | {tokens} | {b.gemm_flops['triton'] / total:.0%} | "
              f"{', '.join(sorted(set(b.triton_gemms))) or '-'} | {bf16_ms:.1f} | {fp8_ms:.1f} | "
              f"{sum(q_ms.values()):.1f} ({q_ms['x']:.1f} / {q_ms['dy']:.1f} / {q_ms['weights']:.1f}) | "
              f"{sibling_ms:.1f} | {fp8_ms + sum(q_ms.values()) - bf16_ms:+.1f} |")
    print("FP8 - BF16: what the linear layers' GEMMs and quantizers add or save per step at these throughputs; the "
          "measured step difference minus this is what the account leaves out (casts, copies, launches, the "
          "compiled graph's fusions around the custom ops).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
