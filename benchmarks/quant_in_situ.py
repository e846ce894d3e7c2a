"""The FP8 quantizer calls of one model-row training step, each timed alone as the layer makes it, summed per step.

    python benchmarks/quant_in_situ.py                        # H200: the Qwen2.5-1.5B row (8 layers, 8 x 2048)
    python benchmarks/quant_in_situ.py --model llama3-8b:3:4  # bench_speed.py's --models syntax
    python benchmarks/quant_in_situ.py --tiny                 # CPU: the call list and the arithmetic only

Why: the fourteenth session's profile of the 1.5B row (docs/benchmarks.md, "Where the time goes") found the
quantizers at 20.9 ms per compiled step, 112 launches of each activation layout, i.e. ~1.5 TB/s for the 1x128
kernel and ~2.0 TB/s for the 128x1 one, where bench_quant.py measured them at 74-85% of a device copy in isolation.
This probe times each of the step's quantizer calls (its shape, ``gemm_layout=True``, the non-finite counter where
the forward passes it) back to back on rotating inputs, next to a device copy of the same bytes, and sums them with
their launch counts. If the sum is near the profile's, the kernels are slow at these shapes (configs, narrow
widths: k/v's 256 columns); if it is far below, the time is lost in the compiled step itself (Inductor's launches,
cache traffic between kernels). ``--variants`` adds the same calls without the non-finite counter; a run with
``CALCLIP_TRITON_AUTOTUNE=0`` prices the default configs against the autotuned ones.

A probe, not a benchmark: one process, medians of ``_common.bench_ms``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/

import torch  # noqa: E402

import _common  # noqa: E402,F401  (puts the repository root on sys.path)
from _common import fmt_ms, table  # noqa: E402
from bench_quant import traffic_bytes  # noqa: E402

@dataclass(frozen=True)
class Call:
    """One quantizer call of the step: ``kind`` 1x128 or 128x1, on a [tokens, width] tensor, ``count`` times per
    layer; ``counted``: the forward's 1x128 call, which also counts non-finite rows."""

    what: str
    kind: str
    width: int
    count: int
    counted: bool = False


def step_calls(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int | None = None, *,
               shared: bool = True) -> list[Call]:
    """Every activation quantizer call of one decoder layer's forward + backward in FP8BlockLinear
    (calclip.fp8.linear_math: forward 1x128 of x with the counter, 128x1 of x for the wgrad; backward 1x128 and
    128x1 of dy), grouped by shape. q, k, v read the same x (hidden wide), so do gate and up: with ``shared``
    (Fp8Config.share_sibling_inputs, the default) each group quantizes it once, else each linear does."""
    head_dim = head_dim or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    shared_x = [("q/k/v input x", hidden, 1), ("gate/up input x", hidden, 1)] if shared else \
        [("q/k/v/gate/up input x", hidden, 5)]
    inputs = [*shared_x, ("o input (attention output)", q, 1), ("down input (SiLU(gate)*up)", intermediate, 1)]
    grads = [("dy of q", q, 1), ("dy of k, v", kv, 2), ("dy of o", hidden, 1), ("dy of gate, up", intermediate, 2),
             ("dy of down", hidden, 1)]
    calls = [Call(f"fwd {w}", "1x128", n, c, counted=True) for w, n, c in inputs]
    calls += [Call(f"wgrad {w}", "128x1", n, c) for w, n, c in inputs]
    calls += [Call(f"dgrad {w}", "1x128", n, c) for w, n, c in grads]
    calls += [Call(f"wgrad {w}", "128x1", n, c) for w, n, c in grads]
    return calls


def traffic(kind: str, tokens: int, width: int) -> int:
    """Bytes one call moves: bf16 in, e4m3 codes out, fp32 scales out (``bench_quant.traffic_bytes``)."""
    return traffic_bytes(kind, (tokens, width), in_bytes=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", help="bench_speed.py --models syntax (one model)")
    parser.add_argument("--variants", action="store_true",
                        help="also without the counter (the default configs: a separate run with "
                        "CALCLIP_TRITON_AUTOTUNE=0)")
    parser.add_argument("--tiny", action="store_true", help="CPU: print the call list and the bytes, time nothing")
    opts = parser.parse_args(argv)
    import bench_speed

    (row,) = bench_speed.parse_model_rows(opts.model)
    tokens = (row.batch or 8) * 2048
    calls = step_calls(row.hidden, row.intermediate, row.heads, row.kv_heads, row.head_dim)
    launches = sum(c.count for c in calls) * row.layers
    moved = sum(traffic(c.kind, tokens, c.width) * c.count for c in calls) * row.layers
    print(f"quant_in_situ: {row.label}, {tokens} tokens, {row.layers} layers: {launches} quantizer launches per step "
          f"(1x128: {sum(c.count for c in calls if c.kind == '1x128') * row.layers}, 128x1: "
          f"{sum(c.count for c in calls if c.kind == '128x1') * row.layers}), {moved / 1e9:.2f} GB moved")
    if opts.tiny or not torch.cuda.is_available():
        table(["call", "kind", "shape", "per layer", "MB per call"],
              [[c.what, c.kind, f"{tokens}x{c.width}", str(c.count), f"{traffic(c.kind, tokens, c.width) / 1e6:.1f}"]
               for c in calls])
        if not opts.tiny:
            print("no CUDA device: nothing timed")
            return 2
        return 0

    from _common import rotating, safe_bench

    from calclip.fp8 import quant

    device = torch.device("cuda")
    counter = torch.zeros((), dtype=torch.int64, device=device)
    weight_bad = torch.zeros((), dtype=torch.bool, device=device)

    def timed(call: Call, counted: bool) -> float | None:
        size = traffic(call.kind, tokens, call.width)
        nxt = rotating(lambda _: torch.randn(tokens, call.width, device=device, dtype=torch.bfloat16), size)
        if call.kind == "1x128":
            extra = dict(nonfinite_count=counter, weight_bad=weight_bad) if counted else {}
            return safe_bench(lambda: quant.quantize_1x128(nxt(), gemm_layout=True, **extra))
        return safe_bench(lambda: quant.quantize_128x1(nxt(), gemm_layout=True))

    def copy_ms(size: int) -> float | None:
        half = size // 2
        nxt = rotating(lambda _: (torch.randint(0, 255, (half,), device=device, dtype=torch.uint8),
                                  torch.empty(half, device=device, dtype=torch.uint8)), size)
        return safe_bench(lambda: (lambda p: p[1].copy_(p[0]))(nxt()))

    variants = [("as the layer calls it", True)] + ([("without the counter", False)] if opts.variants else [])
    rows, totals = [], {name: 0.0 for name, _ in variants}
    total_copy = 0.0
    for call in calls:
        size = traffic(call.kind, tokens, call.width)
        t_copy = copy_ms(size)
        cells, first = [], None
        for name, counted in variants:
            t = timed(call, counted and call.counted)
            first = t if first is None else first
            totals[name] += (t or 0.0) * call.count * row.layers
            cells += [fmt_ms(t), "-" if t is None else f"{size / t / 1e6:.0f}"]
        total_copy += (t_copy or 0.0) * call.count * row.layers
        rows.append([call.what, call.kind, f"{tokens}x{call.width}", str(call.count), fmt_ms(t_copy), *cells,
                     "-" if not t_copy or first is None else f"{100 * t_copy / first:.0f}%"])
    columns = ["call", "kind", "shape", "per layer", "copy ms"]
    for name, _ in variants:
        columns += [f"ms ({name})", "GB/s"]
    table([*columns, "of copy"], rows)
    for name, total in totals.items():
        print(f"per step, {name}: {total:.2f} ms over {launches} launches ({moved / total / 1e6:.0f} GB/s); a device "
              f"copy of the same bytes: {total_copy:.2f} ms")
    if opts.variants:
        print("(the default-config variant is a separate run: CALCLIP_TRITON_AUTOTUNE=0 is read at import)")
    print("compare: the profile's 'FP8 quantize' row (profile_model_step.py), 20.9 ms at the 1.5B row on 2026-12-02")
    return 0


if __name__ == "__main__":
    sys.exit(main())
