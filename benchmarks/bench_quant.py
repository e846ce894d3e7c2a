"""Quantization kernels vs a device copy moving the same number of bytes.

    python benchmarks/bench_quant.py [--quick] [--configs]

A quantizer reads its input (BF16, 2 bytes/element) and writes FP8 codes (1 byte/element) plus FP32 scales.
The baseline is ``dst.copy_(src)`` on uint8 buffers sized so that copy's traffic (read + write) equals the
quantizer's. GB/s counts read + write bytes. Target (docs/benchmarks.md, Kernels): each kernel >= 90% of copy bandwidth.
The torch reference quantizer is timed at one shape to show what the kernels replace.

--configs: also every config the 1x128 and 128x1 launchers may launch (their autotune tables, the 128x1 candidates
kept off its table, and the division-free twins, the first of which leads each table unless CALCLIP_DIV_FREE=0), each
pinned, at the quick shapes, in two interleaved passes (the faster of the two kept): each config's share of copy
bandwidth and its speed against the table's default, from one run.
"""

from __future__ import annotations

import argparse

import torch

from _common import fmt_ms, header, rotating, safe_bench, table, try_import

TARGET = 0.90
BLOCK = 128


def traffic_bytes(kind: str, shape: tuple[int, ...], in_bytes: int) -> int:
    numel = 1
    for d in shape:
        numel *= d
    rows, cols = (numel // shape[-1], shape[-1])
    n_scales = {"1x128": rows * -(-cols // BLOCK), "128x1": -(-rows // BLOCK) * cols,
                "128x128": -(-rows // BLOCK) * -(-cols // BLOCK)}
    return numel * in_bytes + numel + 4 * n_scales[kind]


CASES = [
    ("1x128", (8192, 4096)), ("1x128", (16384, 4096)), ("1x128", (8192, 14336)), ("1x128", (16384, 14336)),
    ("1x128", (8192, 576)), ("1x128", (8192, 1536)),
    ("128x1", (8192, 4096)), ("128x1", (16384, 4096)), ("128x1", (8192, 14336)), ("128x1", (8192, 576)),
    ("128x1", (8192, 1536)),
    ("128x128", (4096, 4096)), ("128x128", (14336, 4096)), ("128x128", (4096, 14336)), ("128x128", (1536, 576)),
]
QUICK = {("1x128", (8192, 4096)), ("1x128", (8192, 14336)), ("128x1", (8192, 4096)), ("128x1", (8192, 14336)),
         ("128x128", (14336, 4096))}


def inputs_and_copy_ms(kind: str, shape: tuple[int, ...]):
    """(next input: rotating BF16 inputs of ``shape``, the baseline: a device copy moving a ``kind`` quantizer's bytes
    at that shape, ms or None)."""
    traffic = traffic_bytes(kind, shape, in_bytes=2)
    nxt_x = rotating(lambda _: torch.randn(shape, device="cuda", dtype=torch.bfloat16), traffic)
    half = traffic // 2
    nxt_copy = rotating(lambda _: (torch.randint(0, 255, (half,), device="cuda", dtype=torch.uint8),
                                   torch.empty(half, device="cuda", dtype=torch.uint8)), traffic)
    return nxt_x, safe_bench(lambda: (lambda p: p[1].copy_(p[0]))(nxt_copy()))


def config_label(config) -> str:
    """A config as the --configs table names it: its meta-parameters that are set (True or a number), and warps."""
    parts = [k if v is True else f"{k}={v}" for k, v in config.kwargs.items() if v is not False]
    return " ".join([*parts, f"warps={config.num_warps}"])


def pinned_configs(quantize) -> dict[str, list[tuple[str, object, object]]]:
    """kind -> [(label, launcher, config)]: every config a launcher's table holds, then its candidates (configs kept
    off the table) and its division-free twins not already there (on a GPU the first leads the table unless
    CALCLIP_DIV_FREE=0), the table's default first."""
    tables = {"1x128": (quantize._quantize_1x128_tuned, quantize._QUANT_1X128_CONFIGS,
                        quantize._QUANT_1X128_DIV_FREE_TWINS),
              "128x1": (quantize._quantize_128x1_tuned,
                        quantize._QUANT_128X1_CONFIGS + quantize._QUANT_128X1_CANDIDATES,
                        quantize._QUANT_128X1_DIV_FREE_TWINS)}
    out = {}
    for kind, (tuned, configs, twins) in tables.items():
        seen, rows = set(), []
        for config in [*configs, *twins]:
            label = config_label(config)
            if label not in seen:
                seen.add(label)
                rows.append((label, tuned, config))
        out[kind] = rows
    return out


def bench_configs(tk, quantize) -> None:
    """--configs: each pinned config's time at the quick 1x128 / 128x1 shapes, two interleaved passes."""
    rows = []
    for kind, configs in pinned_configs(quantize).items():
        fn = {"1x128": tk.quantize_1x128, "128x1": tk.quantize_128x1}[kind]
        for k_kind, shape in sorted(QUICK):
            if k_kind != kind:
                continue
            nxt_x, t_copy = inputs_and_copy_ms(kind, shape)
            best: dict[str, float] = {}
            for _ in range(2):
                for label, tuned, config in configs:
                    with tuned.pinned(config):
                        t = safe_bench(lambda: fn(nxt_x(), gemm_layout=True))
                    if t is not None:
                        best[label] = min(best.get(label, t), t)
            default = best.get(configs[0][0])
            for label, _, _ in configs:
                t = best.get(label)
                rows.append([kind, "x".join(map(str, shape)), label, fmt_ms(t),
                             "-" if t is None or t_copy is None else f"{100 * t_copy / t:.0f}%",
                             "-" if t is None or default is None else f"{default / t:.3f}x"])
    table(["kind", "shape", "config (pinned)", "kernel ms", "of copy", "vs the default"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", action="store_true", help="also time every 1x128 / 128x1 config, pinned")
    args = parser.parse_args()
    header("bench_quant: quantization kernels vs device copy of the same bytes")
    tk = try_import("calclip.fp8.kernels")
    reference = try_import("calclip.fp8.reference")
    if tk is None:
        return
    fns = {"1x128": tk.quantize_1x128, "128x1": tk.quantize_128x1, "128x128": tk.quantize_128x128}
    rows, worst = [], None
    for kind, shape in CASES:
        if args.quick and (kind, shape) not in QUICK:
            continue
        print(f"-- {kind} {shape}", flush=True)
        traffic = traffic_bytes(kind, shape, in_bytes=2)
        nxt_x, t_copy = inputs_and_copy_ms(kind, shape)
        fn = fns[kind]
        t_q = safe_bench(lambda: fn(nxt_x()))
        t_q_pow2 = safe_bench(lambda: fn(nxt_x(), pow2=True))
        frac = None if t_copy is None or t_q is None else t_copy / t_q
        if frac is not None:
            worst = frac if worst is None else min(worst, frac)

        def gbs(t):
            return "-" if t is None else f"{traffic / t / 1e6:.0f}"

        rows.append([kind, "x".join(map(str, shape)), f"{traffic / 1e6:.0f}", fmt_ms(t_copy), gbs(t_copy),
                     fmt_ms(t_q), gbs(t_q), "-" if frac is None else f"{100 * frac:.0f}%",
                     "-" if t_q_pow2 is None or t_copy is None else f"{100 * t_copy / t_q_pow2:.0f}%"])
    table(["kind", "shape", "MB moved", "copy ms", "copy GB/s", "kernel ms", "kernel GB/s", "of copy",
           "of copy (pow2)"], rows)
    if worst is not None:
        print(f"worst kernel/copy bandwidth: {100 * worst:.0f}%, target >= {100 * TARGET:.0f}% -> "
              f"{'MET' if worst >= TARGET else 'MISSED'}")
    if reference is not None:
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        t_ref = safe_bench(lambda: reference.quantize_1x128(x))
        t_tk = safe_bench(lambda: tk.quantize_1x128(x))
        if t_ref and t_tk:
            print(f"torch reference quantize_1x128 8192x4096 on GPU: {t_ref:.3f} ms, Triton {t_tk:.3f} ms "
                  f"({t_ref / t_tk:.1f}x faster)")
    if args.configs:
        bench_configs(tk, try_import("calclip.fp8.kernels.quantize"))


if __name__ == "__main__":
    main()
