"""Where one HF decode step's GPU time goes, per kernel, BF16 against calclip FP8 (the decode row of docs/benchmarks.md).

The decode row (8L h2048 i8192, CUDA-graphed, batch 64) is 0.68x: FP8 3.80 ms per step against BF16's 2.56
(docs/benchmarks-log.md, fifth session), and what the 1.2 ms are made of was estimated, not measured. This probe runs
HF ``generate`` under torch.profiler and sums CUDA kernel time by kernel name, per decode step:

    python benchmarks/profile_decode.py                      # H200: 8L, batch 64, eager and graphed
    python benchmarks/profile_decode.py --settings eager --batch 256 --top 25
    python benchmarks/profile_decode.py --tiny               # CPU check that it runs (no kernels)
    python benchmarks/profile_decode.py --settings graphed --arms "BF16,FP8 two launches" --host-top 25
    python benchmarks/profile_decode.py --settings graphed --arms "BF16,FP8 two launches" --py-top 30
    python benchmarks/profile_decode.py --settings graphed --reuse-cache --counters   # no re-recording

Arms: BF16; FP8 with two launches per linear (``decode_fused_max_m=0``, what graphed decode runs); FP8 fused (one
launch, the eager default). Settings: ``eager`` (dynamic cache) and ``graphed`` (``cache_implementation="static"``:
transformers compiles the decode step with CUDA graphs; CUPTI still reports the kernels inside the graphs). Per arm:
wall ms per decode step, summed kernel ms per decode step (their ratio says how host-bound the step is), then the
top kernels by GPU time. One warm-up generate per arm (compilation, autotuning), then one profiled generate; a
probe, not a benchmark: arms are not interleaved and there is one round.
"""  # noqa: E501 - line 1 is argparse's description (__doc__.splitlines()[0])
from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (bench_speed's helpers)

import torch  # noqa: E402

import _common  # noqa: E402,F401  (puts the repository root on sys.path)
from bench_speed import build_llama, free_memory, sharing_copy  # noqa: E402

SETTINGS = {"eager": {}, "graphed": {"cache_implementation": "static"}}


def _kernel_times(prof) -> tuple[dict[str, float], int, dict[str, float]]:
    """(kernel name -> summed device us, number of kernel events, host op name -> summed self CPU us) from a
    finished profiler."""
    times: dict[str, float] = collections.defaultdict(float)
    host: dict[str, float] = collections.defaultdict(float)
    count = 0
    for event in prof.events():
        if _common.is_device_work(event):
            times[event.name] += event.device_time
            count += 1
        elif event.device_type != torch.autograd.DeviceType.CUDA:
            host[event.name] += event.self_cpu_time_total
            host["calls\0" + event.name] += 1
    return times, count, host


def _python_times(generate, tokens: int) -> dict[str, float]:
    """function -> own (tottime) us spent in one ``generate(tokens)`` under cProfile: the Python-level host work
    (HF's loop, dynamo's frame evaluation, the CUDA-graph trees' replay), which torch.profiler does not name."""
    profiler = cProfile.Profile()
    profiler.enable()
    generate(tokens)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    return {f"{Path(file).name}:{line}({func})": tottime * 1e6 for (file, line, func), (_, _, tottime, _, _)
            in stats.items()}


def profile_arm(model, prompt, new_tokens: int, extra: dict, device: torch.device, python: bool = False,
                reuse: bool = False):
    import contextlib

    from transformers import MaxLengthCriteria, StoppingCriteriaList

    from calclip.rollout.generation_cache import KeptStaticCache

    mask = torch.ones_like(prompt)
    kept = KeptStaticCache() if reuse and extra else None

    def generate(tokens: int):
        # stops after ``tokens`` new tokens while max_new_tokens stays the same, so the short reference call builds
        # a static cache of the long one's length (no new graphs for it)
        stop = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + tokens)])
        with torch.no_grad(), (kept.attached(model) if kept else contextlib.nullcontext()):
            return model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, stopping_criteria=stop,
                                  **extra)

    generate(new_tokens)  # warm-up: codes, autotuning, compilation and CUDA graphs
    generate(new_tokens)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    # The prefill's kernels are in the profile too: a 1-token generate measures them, and is subtracted.
    spans = {}
    for tokens in (1, new_tokens):
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            generate(tokens)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        spans[tokens] = (wall, *_kernel_times(prof))
    (wall_1, k_1, n_1, h_1), (wall_n, k_n, n_n, h_n) = spans[1], spans[new_tokens]
    steps = new_tokens - 1
    per_step = {name: (k_n.get(name, 0.0) - k_1.get(name, 0.0)) / steps for name in k_n}
    host_per_step = {name: (h_n.get(name, 0.0) - h_1.get(name, 0.0)) / steps for name in h_n}
    python_per_step = {}
    if python:
        p_1, p_n = _python_times(generate, 1), _python_times(generate, new_tokens)
        python_per_step = {name: (p_n[name] - p_1.get(name, 0.0)) / steps for name in p_n}
    return {"wall_ms": (wall_n - wall_1) / steps * 1e3, "kernel_ms": sum(per_step.values()) / 1e3,
            "kernels_per_step": (n_n - n_1) / steps, "per_kernel_us": per_step, "per_host_op_us": host_per_step,
            "per_python_us": python_per_step}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=17, help="the decode steps profiled are this minus 1")
    parser.add_argument("--settings", default="eager,graphed")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--host-top", type=int, default=0, help="also list this many host ops by self CPU time")
    parser.add_argument("--py-top", type=int, default=0,
                        help="also list this many Python functions by own time per step (cProfile, one more generate)")
    parser.add_argument("--reuse-cache", action="store_true",
                        help="graphed: pass one StaticCache to every generate (else transformers builds one per call, "
                             "and the CUDA graphs re-record every step)")
    parser.add_argument("--counters", action="store_true",
                        help="print dynamo/Inductor counters per arm (graph breaks, CUDA-graph skips and partitions)")
    parser.add_argument("--arms", default="BF16,FP8 two launches,FP8 fused", help="comma-separated arm names")
    parser.add_argument("--tiny", action="store_true", help="CPU check: a 1-layer h192 model, eager only")
    opts = parser.parse_args(argv)
    from calclip.fp8 import Fp8Config, quantize_model

    device = torch.device("cpu" if opts.tiny else "cuda")
    if opts.tiny:
        opts.layers, opts.hidden, opts.intermediate, opts.batch, opts.new_tokens, opts.settings = 1, 192, 320, 2, 3, \
            "eager"
    heads = max(1, opts.hidden // 128)
    base = build_llama(opts.layers, opts.hidden, opts.intermediate, 512 if opts.tiny else 32000, device,
                       heads=heads, kv_heads=heads, dtype=torch.bfloat16).eval()
    arms = {"BF16": base,
            "FP8 two launches": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=0)).eval(),
            "FP8 fused": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=256)).eval()}
    arms = {name: model for name, model in arms.items() if name in opts.arms.split(",")}
    prompt = torch.randint(3, 500, (opts.batch, 32), generator=torch.Generator().manual_seed(0)).to(device)
    print(f"profile_decode: {opts.layers}L h{opts.hidden} i{opts.intermediate}, batch {opts.batch}, "
          f"{opts.new_tokens - 1} decode steps profiled, torch {torch.__version__}, "
          f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    for setting in opts.settings.split(","):
        extra = SETTINGS[setting]
        for name, model in arms.items():
            if extra and device.type == "cuda":
                torch._dynamo.reset()
            try:
                result = profile_arm(model, prompt, opts.new_tokens, extra, device, python=opts.py_top > 0,
                                     reuse=opts.reuse_cache)
            except Exception as error:  # one arm failing (e.g. a compile error) still prints the others
                print(f"\n### {setting}, {name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            print(f"\n### {setting}, {name}: wall {result['wall_ms']:.3f} ms/step, GPU kernels "
                  f"{result['kernel_ms']:.3f} ms/step, {result['kernels_per_step']:.0f} kernels/step", flush=True)
            print("| us/step | kernel |\n|---|---|")
            top = sorted(result["per_kernel_us"].items(), key=lambda kv: -kv[1])[:opts.top]
            for kernel, us in top:
                print(f"| {us:.1f} | `{kernel[:110]}` |")
            if opts.host_top:
                # where the host's time per step goes (self CPU time of profiled ops and Python-level record
                # functions: dynamo's guards and CUDA-graph replays show up here as named ranges)
                per_op = result["per_host_op_us"]
                times = {op: us for op, us in per_op.items() if not op.startswith("calls\0")}
                host = sorted(times.items(), key=lambda kv: -kv[1])[:opts.host_top]
                print(f"\nhost, self CPU us/step (profiled ops; {sum(times.values()):.0f} in all)")
                print("| us/step | calls/step | host op |\n|---|---|---|")
                for op, us in host:
                    print(f"| {us:.1f} | {per_op.get('calls' + chr(0) + op, 0.0):.1f} | `{op[:110]}` |")
            if opts.py_top:
                # cProfile's own inflation included: compare arms, not absolute numbers
                rows = sorted(result["per_python_us"].items(), key=lambda kv: -kv[1])[:opts.py_top]
                print(f"\nPython, own us/step under cProfile ({sum(result['per_python_us'].values()):.0f} in all)")
                print("| us/step | function |\n|---|---|")
                for func, us in rows:
                    print(f"| {us:.1f} | `{func[:110]}` |")
            if opts.counters:
                # what dynamo/Inductor did for this arm: graph breaks, CUDA-graph skips and partitions, recordings
                from torch._dynamo.utils import counters
                for group in ("graph_break", "inductor", "stats"):
                    found = {k: v for k, v in counters[group].items()
                             if group != "inductor" or "cudagraph" in k or "partition" in k}
                    print(f"counters[{group!r}]: {dict(sorted(found.items()))}")
                counters.clear()
            sys.stdout.flush()
        free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
