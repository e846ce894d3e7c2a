"""Dynamo's guards on a compiled decoder forward, BF16 against calclip FP8: how many, of which kind, and how long
one guard check takes (the CUDA-graphed FP8 decode step is host-bound, ~1.2 ms slower per step than BF16's
on the H200 while its kernels differ by 0.4 ms; docs/benchmarks-log.md, seventh session).

Every compiled call evaluates the guards of its cache entry before it runs the graph (or replays the CUDA graph).
This probe compiles a random Llama's ``__call__`` (as transformers' ``generate`` does for its decode step), calls it,
takes the cache entry of the model's ``forward`` and times ``guard_manager.check`` on the same arguments:

    python benchmarks/probes/probe_compile_guards.py                   # CPU, 8 layers h256 (guard counts do not
    python benchmarks/probes/probe_compile_guards.py --device cuda     # depend on the widths), backend aot_eager

A probe, not a benchmark: one process, the CPU it runs on.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (bench_speed's helpers)

import torch  # noqa: E402

import _common  # noqa: E402,F401  (puts the repository root on sys.path)
from bench_speed import build_llama, sharing_copy  # noqa: E402


def guard_profile(model, input_ids: torch.Tensor, backend: str, checks: int) -> tuple[collections.Counter, float]:
    """(guard kinds -> count, us per guard check) of the compiled forward's first cache entry."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    compiled = torch.compile(model.__call__, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            compiled(input_ids=input_ids)
        forward = type(model).forward
        entries = _debug_get_cache_entry_list(forward.__code__)
        if not entries:
            raise RuntimeError(f"no compiled entry for {forward.__qualname__}")
        manager = entries[0].guard_manager
        # the frame's locals as dynamo sees them: the (decorated) forward's arguments and closure cells
        code = forward.__code__
        frame_locals = {name: cell.cell_contents for name, cell in zip(code.co_freevars, forward.__closure__ or ())}
        if code.co_varnames[:2] == ("args", "kwargs"):
            frame_locals.update(args=(model,), kwargs={"input_ids": input_ids})
        else:
            frame_locals.update(self=model, input_ids=input_ids)
        if not manager.check(frame_locals):
            raise RuntimeError(f"the guards fail on the probe's arguments: {manager.check_verbose(frame_locals)}")
        start = time.perf_counter()
        for _ in range(checks):
            manager.check(frame_locals)
        us = (time.perf_counter() - start) / checks * 1e6
    kinds = collections.Counter(m.group(1) for line in str(manager).splitlines()
                                if (m := re.search(r"\+- ([A-Z_]+)[:\s]", line)))
    return kinds, us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--checks", type=int, default=3000)
    parser.add_argument("--recursive-dict-tags", action="store_true",
                        help="torch._dynamo.config.use_recursive_dict_tags_for_guards = True (off by default in torch)")
    opts = parser.parse_args(argv)
    torch._dynamo.config.use_recursive_dict_tags_for_guards = opts.recursive_dict_tags
    from calclip.fp8 import Fp8Config, quantize_model

    device = torch.device(opts.device)
    base = build_llama(opts.layers, opts.hidden, opts.intermediate, 512, device, heads=max(1, opts.hidden // 128),
                       kv_heads=max(1, opts.hidden // 128), dtype=torch.bfloat16).eval()
    fp8 = quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=0)).eval()
    input_ids = torch.randint(3, 500, (4, 1), generator=torch.Generator().manual_seed(0)).to(device)
    results = {name: guard_profile(model, input_ids, opts.backend, opts.checks)
               for name, model in (("BF16", base), ("FP8", fp8))}
    linears = sum(1 for m in fp8.modules() if type(m).__name__ == "FP8BlockLinear")
    print(f"probe_compile_guards: {opts.layers}L h{opts.hidden}, {linears} FP8 linears, device {device}, backend "
          f"{opts.backend}, torch {torch.__version__}, recursive dict tags {opts.recursive_dict_tags}\n")
    print("| arm | us per guard check | guards | TENSOR_MATCH | NO_TENSOR_ALIASING | DIMENSION_DYNAMIC_MARKING_GUARD |")
    print("|---|---|---|---|---|---|")
    for name, (kinds, us) in results.items():
        print(f"| {name} | {us:.1f} | {sum(kinds.values())} | {kinds['TENSOR_MATCH']} | {kinds['NO_TENSOR_ALIASING']} "
              f"| {kinds['DIMENSION_DYNAMIC_MARKING_GUARD']} |")
    (bf16_kinds, bf16_us), (fp8_kinds, fp8_us) = results["BF16"], results["FP8"]
    print(f"\nFP8 - BF16: {fp8_us - bf16_us:.1f} us per call, {(fp8_us - bf16_us) / linears:.2f} us per FP8 linear; "
          "guard kinds FP8 adds: " + ", ".join(f"{k} +{fp8_kinds[k] - bf16_kinds[k]}" for k in fp8_kinds
                                               if fp8_kinds[k] > bf16_kinds[k]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
