"""Peak GPU memory of forward + backward through a stack of linear layers: FP8BlockLinear vs BF16 nn.Linear.

    python benchmarks/bench_memory.py [--tokens 8192] [--layers 8]

The stack alternates Linear(4096 -> 14336) and Linear(14336 -> 4096) (an MLP's shapes, no nonlinearity, so
only the linear layers' own saved tensors differ). Each layer saves its input for the weight gradient:
BF16 keeps it in BF16 (2 bytes/element); FP8BlockLinear keeps FP8 128x1 codes + scales (~1.03 bytes) and
lets the BF16 input go. Columns (MiB): "resident" = parameters + the cached FP8 weights, before the step;
"after fwd" = growth during the forward (saved activations + the output); "peak" = the highest point of
forward + backward above resident (includes weight gradients).
"""

from __future__ import annotations

import argparse
import gc

import torch

from _common import header, table, try_import

MIB = 2**20


def build(n_layers: int, hidden: int, inner: int) -> torch.nn.Sequential:
    dims = [(hidden, inner) if i % 2 == 0 else (inner, hidden) for i in range(n_layers)]
    return torch.nn.Sequential(*[torch.nn.Linear(a, b, bias=False, device="cuda", dtype=torch.bfloat16)
                                 for a, b in dims])


def measure(model: torch.nn.Module, tokens: int, hidden: int) -> dict[str, float]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, hidden if len(model) % 2 == 0 else model[-1].out_features, device="cuda",
                     dtype=torch.bfloat16)
    model(x).backward(dy)  # warm-up: kernels compiled/autotuned, FP8 weight caches filled
    model.zero_grad(set_to_none=True)
    x.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = model(x)
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated() - base
    y.backward(dy)
    del y
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"resident": base, "after_fwd": after_fwd, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inner", type=int, default=14336)
    args = parser.parse_args()
    header("bench_memory: forward+backward peak memory, FP8 vs BF16 linear stack")
    fp8 = try_import("calclip.fp8")
    print(f"{args.layers} layers alternating {args.hidden}->{args.inner}->{args.hidden}, {args.tokens} tokens, "
          f"bf16 parameters")
    variants = {"bf16 nn.Linear": None}
    if fp8 is not None:
        variants["fp8 (backward=fp8)"] = fp8.Fp8Config()
        variants["fp8 (backward=bf16)"] = fp8.Fp8Config(backward="bf16")
    results = {}
    for name, config in variants.items():
        gc.collect()
        torch.cuda.empty_cache()
        model = build(args.layers, args.hidden, args.inner)
        if config is not None:
            for i, layer in enumerate(model):
                model[i] = fp8.FP8BlockLinear.from_linear(layer, config)
        try:
            results[name] = measure(model, args.tokens, args.hidden)
        except Exception as err:  # noqa: BLE001
            print(f"!! {name}: {type(err).__name__}: {err}")
        del model
    base = results.get("bf16 nn.Linear")
    rows = []
    for name, r in results.items():
        rel = "-" if base is None else f"{r['after_fwd'] / base['after_fwd']:.2f} / {r['peak'] / base['peak']:.2f}"
        rows.append([name, f"{r['resident'] / MIB:.0f}", f"{r['after_fwd'] / MIB:.0f}", f"{r['peak'] / MIB:.0f}",
                     rel])
    table(["variant", "resident MiB", "after fwd MiB", "peak MiB", "vs bf16 (fwd / peak)"], rows)


if __name__ == "__main__":
    main()
