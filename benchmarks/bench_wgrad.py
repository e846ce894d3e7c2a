"""Weight-gradient path at ragged token counts: the 128x1 codes padded to whole token groups vs the unpadded layout.

    python benchmarks/bench_wgrad.py                                  # Qwen2.5-7B's MLP and attention shapes
    python benchmarks/bench_wgrad.py --tokens 4096,4093,4000 --shapes 18944x3584 --rounds 5
    python benchmarks/bench_wgrad.py --quick                          # 4096 and 4093 tokens, gate/up only
    python benchmarks/bench_wgrad.py --smoke                          # CPU check, TRITON_INTERPRET=1, tiny shapes
                                                                      # (Triton GEMM direct; times meaningless)

A linear's backward quantizes dy and (in the forward) x along the token axis (128x1) and runs
dW [N, K] = Q128x1(dy)^T Q128x1(x), contracting over the M tokens. Since 2026-12-05 the quantizers lay those codes out
over ``reference.wgrad_rows(M)`` rows (zero codes past M), so the GEMM's K is a multiple of 128: calclip's Triton GEMM
keeps its aligned, pipelined loads (the sm_90 compile lost them at a token count not a multiple of 16) and
``gemm="auto"`` may hand it to torch._scaled_mm. This script measures what that bought, per (shape, tokens):

    unpadded   the previous layout: codes [M, K] with row stride M (a copy of the padded codes' first M rows)
    padded     the current layout: codes [wgrad_rows(M), K]
    q128x1     the 128x1 quantizer of dy alone, unpadded vs padded (what the extra zero rows cost it)

Both GEMM arms get the same scales and dispatch through ``calclip.fp8.gemm.fp8_block_gemm(backend="auto")``, as the
layer does; the backend each one resolves to is printed. Arms are interleaved (A B A B) for ``--rounds`` rounds;
medians of the rounds; ratio = unpadded / padded (> 1: padding is faster). Needs a CUDA GPU with the Triton kernels.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import _common  # noqa: E402,F401  (puts the repository root on sys.path)
from _common import bench_ms, git_commit, header, table  # noqa: E402


def _shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",") if part]  # type: ignore[misc]


def _unpadded(q: torch.Tensor, m: int) -> torch.Tensor:
    """The first m token rows of padded 128x1 codes in the previous layout: column-major with row stride m."""
    return q[:m].t().contiguous().t()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4096,4093,4000,2047,1000", help="token counts M, comma-separated")
    parser.add_argument("--shapes", default="18944x3584,3584x18944,3584x3584,512x3584",
                        help="NxK of the weight (out x in): Qwen2.5-7B gate/up, down, q/o, k/v")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4096 and 4093 tokens at the gate/up shape only")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check under the Triton interpreter: 256 / 200 / 77 tokens, one 192x256 weight")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.shapes = "4096,4093", "18944x3584"
    from calclip.fp8 import kernels as tk
    from calclip.fp8.gemm import fp8_block_gemm, resolve_backend
    from calclip.fp8.reference import wgrad_rows

    if args.smoke:
        print(f"== bench_wgrad --smoke: TRITON_INTERPRET=1 on CPU, times meaningless (commit {git_commit()}) ==")
        args.tokens, args.shapes, args.rounds, device = "256,200,77", "192x256", 1, "cpu"

        def timed_ms(fn, **_):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        def gemm(ops):  # calclip's Triton GEMM itself: on CPU "auto" would resolve to the float32 emulation
            return tk.fp8_block_gemm_triton(*ops, out_dtype=torch.bfloat16)

        def backend_of(ops):
            return "triton (interpreter)"
    else:
        header(f"bench_wgrad: wgrad GEMM over padded vs unpadded token rows (commit {git_commit()})")
        if not torch.cuda.is_available():
            raise SystemExit("bench_wgrad needs a CUDA GPU")
        device, timed_ms = "cuda", bench_ms

        def gemm(ops):
            return fp8_block_gemm(*ops, out_dtype=torch.bfloat16, backend="auto", a_blocks="1x128",
                                  b_blocks="1x128")

        def backend_of(ops):
            return resolve_backend("auto", ops[0], ops[2], out_dtype=torch.bfloat16, a_blocks="1x128",
                                   b_blocks="1x128")

    rows = []
    for (n, k) in _shapes(args.shapes):
        for m in (int(v) for v in args.tokens.split(",")):
            torch.manual_seed(m)
            dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            qdy, sdy = tk.quantize_128x1(dy, gemm_layout=True)
            qx, sx = tk.quantize_128x1(x, gemm_layout=True)
            assert qdy.shape[0] == wgrad_rows(m)
            padded = (qdy.t(), sdy.t(), qx.t(), sx.t())
            unpadded = (_unpadded(qdy, m).t(), sdy.t(), _unpadded(qx, m).t(), sx.t())

            backends = [backend_of(ops) for ops in (unpadded, padded)]
            # the same backend on both layouts must give the same dW (zero codes add exact zeros)
            same = torch.equal(gemm(padded), gemm(unpadded)) if backends[0] == backends[1] else None
            arms = {
                "gemm unpadded": lambda: gemm(unpadded),
                "gemm padded": lambda: gemm(padded),
                "q128x1 unpadded": lambda: tk.quantize_128x1(dy, gemm_layout=False),
                "q128x1 padded": lambda: tk.quantize_128x1(dy, gemm_layout=True),
            }
            for fn in arms.values():  # autotune / first launch outside the timed rounds
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times: dict[str, list[float]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, fn in arms.items():
                    times[name].append(timed_ms(fn, warmup=5, rep=40))
            med = {name: statistics.median(v) for name, v in times.items()}
            rows.append([f"{n}x{k}", str(m), str(wgrad_rows(m)), f"{backends[0]} / {backends[1]}",
                         f"{med['gemm unpadded']:.3f}", f"{med['gemm padded']:.3f}",
                         f"{med['gemm unpadded'] / med['gemm padded']:.2f}x",
                         f"{med['q128x1 unpadded']:.3f}", f"{med['q128x1 padded']:.3f}",
                         "-" if same is None else ("yes" if same else "NO")])
            print(" | ".join(rows[-1]), flush=True)
    table(["NxK", "tokens", "code rows", "backend unpadded / padded", "gemm unpadded ms", "gemm padded ms",
           "unpadded/padded", "q128x1 unpadded ms", "q128x1 padded ms", "bit-equal (same backend)"], rows)


if __name__ == "__main__":
    main()
