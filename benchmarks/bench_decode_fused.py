"""Fused decode (``Fp8Config.decode_fused_max_m``): one launch per FP8 linear instead of two, as Markdown tables.

    python benchmarks/bench_decode_fused.py                      # H200: both sections (~5-8 min with cold caches)
    python benchmarks/bench_decode_fused.py --only layer         # per-linear rows only
    python benchmarks/bench_decode_fused.py --tiny               # CPU check that every path runs (times meaningless)

Sections (``--only``):

- ``layer``: one no-grad forward of a linear at decode sizes, M in {1, 16, 64, 256} rows, for SmolLM2-135M's
  (K, N) = (576, 576), (576, 1536), (1536, 576), (576, 192) and the 8-layer h2048 model's (2048, 2048),
  (2048, 8192), (8192, 2048). Arms: BF16 ``F.linear``; calclip FP8 unfused (``FP8BlockLinear`` with
  ``decode_fused_max_m=0``: 1x128 quantizer launch + the split-K GEMM, two launches, three when it splits K); FP8
  fused (the same layer with ``decode_fused_max_m=256``: one launch); cuBLAS (unfused with ``gemm="scaled_mm"``).
  Each arm rotates over enough distinct weights (up to 512) that they do not sit in the H200's 50 MB L2, as the
  weights of a real decode step do not. Per call: ``eager`` wall time of a pass over all weights (synchronized
  once at the end) and its host time; ``graphed``: the same pass captured once in a CUDA graph and replayed
  (device time without host gaps: what a GPU shared by many processes spends per call); ``kernels``: CUDA
  kernels per call (torch.profiler, one pass).
- ``decode``: HF ``generate`` (eager, dynamic cache), greedy, prompt 32 random tokens, ``--new-tokens`` new
  tokens, batch 64 and 256, on a random-weight 8-layer h2048 i8192 Llama and a random SmolLM2-135M-shaped one
  (30 layers, h576 i1536, 9 heads / 3 KV heads): BF16 vs FP8 (field off) vs FP8 fused (field on). Decode
  tokens/s between CUDA events after the first and the last token (prefill excluded; bench_speed's clock), and
  the share of generated tokens where the two FP8 arms agree (greedy; they differ only by fp32 rounding order).
  Settings (``--settings``): ``eager`` (dynamic cache) and ``graphed`` (``cache_implementation="static"``:
  transformers compiles the decode step with CUDA graphs; the fused arm's linears are then the triton op
  ``calclip::fp8_linear_decode``), and ``graphed_reuse`` (graphed with one StaticCache passed to every call: a
  fresh cache per call moves its addresses, and the CUDA-graph trees re-record every decode step; see
  ``calclip.rollout.generation_cache``). ``--models`` picks the models (``8L``, ``smollm``). More arms (``--arms``):
  ``grouped`` (fused with ``decode_group_siblings``, eager only) and ``frozen`` (FP8's two launches with ``generate``
  inside ``frozen_fp8_weights``, as calclip's trainer calls it: no refresh graph break in front of the compiled
  decode step; graphed only), ``frozen_cublas`` (frozen with ``gemm="scaled_mm"``: cuBLAS' blockwise GEMM at every M
  instead of the split-K Triton GEMM that decode rows get by default; graphed only).

Method: arms interleaved (A B C A B C ...) over ``--repeats`` rounds after a warm-up; medians with [min-max];
ratio columns are medians of per-round ratios, time of the denominator arm over the fused arm (> 1: fused is
faster). Needs torch with CUDA and triton (H200: torch 2.11, triton 3.6; transformers for ``decode``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import ROTATE_BYTES, git_commit, package_version, table
from bench_speed import (build_llama, cell, compiled_warmup, free_memory, interleave, paired_ratio, setup_arm,
                         sharing_copy, short_error, step_clock, sync, watch_recompiles)

SECTIONS = ("layer", "decode")
# (K, N): SmolLM2-135M's q/o, gate/up, down, k/v; then the 8-layer h2048 i8192 model's.
LAYER_SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 192), (2048, 2048), (2048, 8192), (8192, 2048))
LAYER_MS = (1, 16, 64, 256)
TINY_LAYER_SHAPES = ((576, 192), (130, 100))
TINY_LAYER_MS = (1, 16)
# (name, layers, hidden, intermediate, heads, kv heads, vocab)
MODELS = {"8L": ("8L h2048 i8192", 8, 2048, 8192, 16, 16, 32000),
          "smollm": ("SmolLM2-135M shape", 30, 576, 1536, 9, 3, 49152)}
TINY_MODELS = (("tiny h192", 1, 192, 320, 2, 1, 512),)
DECODE_BATCHES, TINY_DECODE_BATCHES = (64, 256), (2, 4)
FUSED_MAX_M = 256  # covers every M and batch above
MAX_WEIGHT_SETS = 512


def _sets(k: int, n: int, tiny: bool) -> int:
    """Distinct weights per arm: BF16 bytes beyond the L2 (ROTATE_BYTES), at most MAX_WEIGHT_SETS."""
    if tiny:
        return 2
    return max(2, min(MAX_WEIGHT_SETS, math.ceil(ROTATE_BYTES / (2 * k * n))))


# ---------------------------------------------------------------------------------------------------------------
# layer


def kernels_per_call(calls) -> float:
    """CUDA kernels launched per call over one pass (torch.profiler); NaN on CPU or when the profiler fails."""
    if not torch.cuda.is_available():
        return math.nan
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for call in calls:
                call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        return len(kernels) / len(calls)
    except Exception as err:  # noqa: BLE001 — a missing count must not stop the timing
        print(f"   !! kernel count failed: {short_error(err)}", flush=True)
        return math.nan


def capture(calls):
    """A CUDA graph of one pass over ``calls`` (warmed up on a side stream first, as CUDA graphs require)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def layer_arm(name: str, calls, device: torch.device, replays: int, kernels: dict[str, float]):
    """Build: warm up (autotuning included), count kernels (into ``kernels[name]``), capture; sample: one eager
    pass + graph replays."""
    def build():
        with torch.no_grad():
            for call in calls:  # first calls: weight codes, autotuning, Triton compilation
                call()
            sync(device)
            kernels[name] = kernels_per_call(calls)
            graph = capture(calls) if device.type == "cuda" else None

        def sample() -> dict[str, float]:
            with torch.no_grad():
                sync(device)
                t0 = time.perf_counter()
                for call in calls:
                    call()
                host = time.perf_counter() - t0
                sync(device)
                wall = time.perf_counter() - t0
            out = {"eager_us": wall / len(calls) * 1e6, "host_us": host / len(calls) * 1e6}
            if graph is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                out["graph_us"] = start.elapsed_time(end) * 1e3 / (replays * len(calls))
            return out
        return sample
    return setup_arm(name, build)


def layer_section(opts) -> None:
    from calclip.fp8 import FP8BlockLinear, Fp8Config

    device = torch.device(opts.device)
    off, on = Fp8Config(decode_fused_max_m=0), Fp8Config(decode_fused_max_m=FUSED_MAX_M)
    cublas = Fp8Config(decode_fused_max_m=0, gemm="scaled_mm")  # cuBLAS' blockwise GEMM at every M
    rows = []
    for k, n in opts.layer_shapes:
        sets = _sets(k, n, opts.tiny)
        torch.manual_seed(0)
        bases = [nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16) for _ in range(sets)]
        fp8 = [FP8BlockLinear.from_linear(b, off) for b in bases]
        fused = [FP8BlockLinear.from_linear(b, on) for b in bases]
        fp8_cublas = [FP8BlockLinear.from_linear(b, cublas) for b in bases]
        for m in opts.layer_ms:
            print(f"-- layer M={m} K={k} N={n} ({sets} weights per arm)", flush=True)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            kernels: dict[str, float] = {}
            arms = {
                "BF16": layer_arm("BF16", [lambda b=b: F.linear(x, b.weight) for b in bases], device, opts.replays,
                                  kernels),
                "FP8": layer_arm("FP8", [lambda lin=lin: lin(x) for lin in fp8], device, opts.replays, kernels),
                "fused": layer_arm("fused", [lambda lin=lin: lin(x) for lin in fused], device, opts.replays, kernels),
                "cuBLAS": layer_arm("cuBLAS", [lambda lin=lin: lin(x) for lin in fp8_cublas], device, opts.replays,
                                    kernels),
            }
            interleave(list(arms.values()), opts.repeats)
            check = _same_output(fp8[0], fused[0], x)
            rows.append([str(m), str(k), str(n)]
                        + ["/".join(_count(kernels.get(a, math.nan)) for a in arms)]
                        + [cell(arms[a], "eager_us", 1) for a in arms]
                        + [cell(arms[a], "graph_us", 1) for a in arms]
                        + [paired_ratio(arms["FP8"], arms["fused"], "eager_us"),
                           paired_ratio(arms["FP8"], arms["fused"], "graph_us"),
                           paired_ratio(arms["BF16"], arms["fused"], "graph_us"),
                           paired_ratio(arms["cuBLAS"], arms["FP8"], "graph_us"),
                           paired_ratio(arms["BF16"], arms["FP8"], "graph_us"),
                           "/".join(cell(arms[a], "host_us", 1) for a in arms), check])
            print("row: | " + " | ".join(rows[-1]) + " |", flush=True)  # kept if a time limit cuts the call
            del arms
            free_memory()
        del bases, fp8, fused, fp8_cublas
        free_memory()
    print(f"\n### layer: one no-grad forward per call, us (median [min-max] of {opts.repeats} rounds)")
    table(["M", "K", "N", "kernels BF16/FP8/fused/cuBLAS", "BF16 eager", "FP8 eager", "fused eager", "cuBLAS eager",
           "BF16 graphed", "FP8 graphed", "fused graphed", "cuBLAS graphed", "FP8/fused eager", "FP8/fused graphed",
           "BF16/fused graphed", "cuBLAS/FP8 graphed", "BF16/FP8 graphed", "host us BF16/FP8/fused/cuBLAS",
           "fused vs FP8 output"], rows)
    print("FP8: the layer's default unfused path (quantizer + GEMM; at these M the split-K Triton GEMM, "
          "calclip.fp8.gemm.SPLITK_MAX_M); cuBLAS: the same with gemm='scaled_mm' (torch._scaled_mm at every M). "
          "eager: wall time per call of a pass over all weights (one sync at the end); graphed: the pass replayed "
          "from a CUDA graph (device time, no host gaps); ratios > 1: the second-named arm is faster. 'fused vs FP8 "
          "output': max |difference| / max |FP8 output| on the first weight: fp32 rounding order only (0 where the "
          "unfused GEMM is calclip's Triton GEMM; --tiny: the interpreter's fp32->bf16 cast truncates, ~1 bf16 "
          "ulp against the emulated GEMM's rounding).", flush=True)


def _count(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:g}"


def _same_output(fp8_layer: nn.Module, fused_layer: nn.Module, x: torch.Tensor) -> str:
    with torch.no_grad():
        a, b = fp8_layer(x).float(), fused_layer(x).float()
    scale = float(a.abs().max())
    return f"{float((a - b).abs().max()) / scale:.1e}" if scale > 0 else "-"


# ---------------------------------------------------------------------------------------------------------------
# decode (HF generate)


# graphed_reuse: graphed with one StaticCache passed to every generate call (calclip.rollout.generation_cache, what
# the trainer's compile_generation does), so the CUDA graphs recorded in the warm-up replay instead of re-recording
# every decode step of every call
SETTINGS = {"eager": {}, "graphed": {"cache_implementation": "static"},
            "graphed_reuse": {"cache_implementation": "static"}}
ARMS = ("BF16", "FP8", "fused", "grouped", "frozen", "frozen_cublas")


def decode_section(opts) -> None:
    import transformers
    from transformers import LogitsProcessorList

    from calclip.fp8 import Fp8Config, frozen_fp8_weights, quantize_model
    from calclip.rollout.generation_cache import KeptStaticCache

    transformers.logging.set_verbosity_error()
    device = torch.device(opts.device)
    rows = []
    fp32_masters = opts.masters == "fp32"
    # fp32 masters + bf16 autocast, as calclip's own configs train: the residual stream stays fp32, which the
    # fused kernel rounds in registers (no cast launch). Graphed generate crashes with fp32 masters under autocast
    # (transformers' static cache takes the prefill's fp32 keys; docs/benchmarks-log.md), so only eager runs then.
    settings = [s for s in opts.settings if not (fp32_masters and SETTINGS[s])]
    if len(settings) < len(opts.settings):
        print("-- decode: --masters fp32 runs the eager setting only (graphed generate refuses fp32 masters under "
              "autocast)", flush=True)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if fp32_masters else contextlib.nullcontext
    for name, *shape, vocab in opts.models:
        free_memory()
        layers, hidden, inter, heads, kv_heads = shape
        base = build_llama(layers, hidden, inter, vocab, device, heads=heads, kv_heads=kv_heads,
                           dtype=torch.float32 if fp32_masters else torch.bfloat16).eval()
        models = {"BF16": base, "FP8": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=0)).eval(),
                  "fused": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=FUSED_MAX_M)).eval(),
                  # q/k/v and gate/up as one launch each (eager only: compiled calls run each linear)
                  "grouped": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=FUSED_MAX_M,
                                                                          decode_group_siblings=True)).eval(),
                  # FP8's two launches with generate inside frozen_fp8_weights, as calclip's trainer runs it: the
                  # compiled decode step without the refresh graph break (graphed only: eager is FP8's path)
                  "frozen": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=0)).eval(),
                  # frozen with cuBLAS' blockwise GEMM at every M (gemm="scaled_mm"): the path before the split-K GEMM
                  "frozen_cublas": quantize_model(sharing_copy(base), Fp8Config(decode_fused_max_m=0,
                                                                                gemm="scaled_mm")).eval()}
        models = {arm: model for arm, model in models.items() if arm in opts.arms}
        for batch in opts.decode_batches:
            gen = torch.Generator(device="cpu").manual_seed(batch)
            prompt = torch.randint(3, vocab, (batch, opts.prompt), generator=gen).to(device)
            mask = torch.ones_like(prompt)
            for setting in settings:
                print(f"-- decode {name}, batch {batch}, {setting}", flush=True)
                extra = SETTINGS[setting]
                if extra:  # this batch's decode step compiles with static shapes, as in a run with one batch size
                    torch._dynamo.reset()
                last: dict[str, torch.Tensor] = {}

                def arm_of(arm: str, model: nn.Module):
                    reuse = KeptStaticCache() if setting == "graphed_reuse" else None

                    def generate_once() -> dict[str, float]:
                        clock = step_clock()
                        frozen = (frozen_fp8_weights(model) if arm.startswith("frozen")
                                  else contextlib.nullcontext())
                        kept = reuse.attached(model) if reuse else contextlib.nullcontext()
                        with torch.no_grad(), autocast(), frozen, kept:
                            out = model.generate(input_ids=prompt, attention_mask=mask,
                                                 max_new_tokens=opts.new_tokens, min_new_tokens=opts.new_tokens,
                                                 do_sample=False, pad_token_id=0,
                                                 logits_processor=LogitsProcessorList([clock]), **extra)
                        seconds, steps = clock.decode_seconds()
                        last[arm] = out[:, opts.prompt:]  # noqa: F821
                        return {"tok_s": batch * steps / seconds, "ms_step": seconds / steps * 1e3}

                    def build():
                        if extra and device.type == "cuda":  # compile + record the CUDA graphs
                            compiled_warmup(f"{arm} {setting} b{batch}", lambda: [generate_once() for _ in range(2)])
                            return watch_recompiles(f"{arm} {setting} b{batch}", generate_once)
                        generate_once()  # warm-up: codes, autotuning, Triton compilation
                        return generate_once
                    return build

                # graphed: the grouped model runs as fused does; eager: the frozen one as FP8 does
                arms = {arm: setup_arm(arm, arm_of(arm, model)) for arm, model in models.items()
                        if not (extra and arm == "grouped") and not (not extra and arm.startswith("frozen"))}
                interleave(list(arms.values()), opts.repeats)

                def agree(a: str, b: str) -> str:
                    return (f"{float((last[a] == last[b]).float().mean()) * 100:.1f}%"  # noqa: F821
                            if a in last and b in last else "-")  # noqa: F821

                def ratio(a: str, b: str) -> str:
                    return paired_ratio(arms[a], arms[b], "tok_s") if a in arms and b in arms else "-"  # noqa: F821

                rows.append([name, str(batch), setting]
                            + [cell(arms[a], "tok_s", 0) if a in arms else "-" for a in ARMS]
                            + [cell(arms[a], "ms_step", 2) if a in arms else "-" for a in ARMS]
                            + [ratio("fused", "FP8"), ratio("fused", "BF16"), ratio("grouped", "fused"),
                               ratio("grouped", "BF16"), ratio("frozen", "FP8"), ratio("frozen", "BF16"),
                               ratio("frozen", "frozen_cublas"), ratio("frozen_cublas", "BF16"),
                               agree("FP8", "fused"), agree("fused", "grouped"), agree("FP8", "frozen")])
                # Each row as soon as it is measured: a device call cut by its time limit keeps the rows done.
                print("row: | " + " | ".join(rows[-1]) + " |", flush=True)
                # ruff checks the closures above as if they ran after this del: their noqa F821 (astral-sh/ruff#9858)
                del arms, last
        del models, base
        free_memory()
    print(f"\n### decode: HF generate, {opts.masters} masters{' + bf16 autocast' if fp32_masters else ''}, "
          f"prompt {opts.prompt}, {opts.new_tokens} new tokens, greedy "
          f"(median [min-max] of {opts.repeats} rounds)")
    table(["model", "batch", "setting", *[f"{a} tok/s" for a in ARMS], *[f"{a} ms/step" for a in ARMS],
           "fused/FP8 tok/s", "fused/BF16 tok/s", "grouped/fused tok/s", "grouped/BF16 tok/s", "frozen/FP8 tok/s",
           "frozen/BF16 tok/s", "frozen/frozen_cublas tok/s", "frozen_cublas/BF16 tok/s", "FP8 = fused tokens",
           "fused = grouped tokens", "FP8 = frozen tokens"], rows)
    print("tok/s over the decode steps after the first token; fused = FP8 with decode_fused_max_m="
          f"{FUSED_MAX_M}; grouped = fused with decode_group_siblings (q/k/v and gate/up one launch each; eager "
          "only); frozen = FP8 with generate inside frozen_fp8_weights (graphed only; its GEMMs at decode rows are "
          "the split-K Triton GEMM), frozen_cublas = frozen with gemm='scaled_mm' (cuBLAS at every M); graphed = "
          "cache_implementation='static' (transformers compiles the decode step, mode "
          "reduce-overhead, on CUDA only; a new cache per call); graphed_reuse = graphed with one StaticCache kept "
          "across calls. 'FP8 = fused tokens': share of generated tokens equal in the last "
          "round (greedy; the arms differ by fp32 rounding order at most; --tiny: the interpreter's fp32->bf16 cast "
          "truncates, so near-ties flip).", flush=True)


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU (Triton interpreter for the fused kernel), tiny shapes: checks that every path runs")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds per arm (default 5; 1 --tiny)")
    parser.add_argument("--replays", type=int, default=20, help="CUDA-graph replays per round (layer)")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; 4 --tiny)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32; 5 --tiny)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"decode models, of {tuple(MODELS)}")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"decode settings, of {tuple(SETTINGS)}")
    parser.add_argument("--masters", choices=("bf16", "fp32"), default="bf16",
                        help="decode: model weights in bf16, or fp32 run under bf16 autocast (calclip's configs)")
    parser.add_argument("--batches", default=None, help="decode batch sizes, e.g. 64,256 (default; 2,4 --tiny)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"decode arms, of {ARMS}")
    parser.add_argument("--layer-shapes", default=None,
                        help="layer (K, N) pairs as KxN, comma-separated, e.g. 2048x2048,8192x2048 (default: all)")
    parser.add_argument("--layer-ms", default=None, help="layer rows M, e.g. 64,256 (default 1,16,64,256)")
    opts = parser.parse_args(argv)
    opts.sections = [s.strip() for s in opts.only.split(",") if s.strip()]
    bad = [s for s in opts.sections if s not in SECTIONS]
    if bad or not opts.sections:
        parser.error(f"--only: unknown section(s) {bad}; choose from {SECTIONS}")
    for name, gpu, tiny in (("repeats", 5, 1), ("new_tokens", 64, 4), ("prompt", 32, 5)):
        if getattr(opts, name) is None:
            setattr(opts, name, tiny if opts.tiny else gpu)
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if opts.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode time is taken between the first and the last token)")
    opts.device = "cpu" if opts.tiny else "cuda"
    shapes_text, ms_text = opts.layer_shapes, opts.layer_ms
    opts.layer_shapes = TINY_LAYER_SHAPES if opts.tiny else LAYER_SHAPES
    opts.layer_ms = TINY_LAYER_MS if opts.tiny else LAYER_MS
    try:
        if shapes_text:
            opts.layer_shapes = tuple(tuple(int(v) for v in pair.lower().split("x")) for pair in shapes_text.split(","))
        if ms_text:
            opts.layer_ms = tuple(int(v) for v in ms_text.split(","))
    except ValueError:
        parser.error(f"--layer-shapes / --layer-ms: KxN pairs and ints, got {shapes_text!r} / {ms_text!r}")
    if any(len(p) != 2 or min(p) < 1 for p in opts.layer_shapes) or min(opts.layer_ms) < 1:
        parser.error(f"--layer-shapes / --layer-ms: positive KxN pairs and ints, got {shapes_text!r} / {ms_text!r}")
    for name, allowed in (("models", MODELS), ("settings", SETTINGS), ("arms", ARMS)):
        chosen = [v.strip() for v in getattr(opts, name).split(",") if v.strip()]
        if not chosen or any(v not in allowed for v in chosen):
            parser.error(f"--{name}: choose from {tuple(allowed)}, got {getattr(opts, name)!r}")
        setattr(opts, name, chosen)
    opts.models = list(TINY_MODELS) if opts.tiny else [MODELS[m] for m in opts.models]
    try:
        batches = tuple(int(b) for b in opts.batches.split(",")) if opts.batches else None
    except ValueError:
        batches = ()
    if batches is not None and (not batches or min(batches) < 1 or max(batches) > FUSED_MAX_M):
        parser.error(f"--batches: positive ints up to {FUSED_MAX_M}, got {opts.batches!r}")
    opts.decode_batches = batches or (TINY_DECODE_BATCHES if opts.tiny else DECODE_BATCHES)
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if opts.tiny:
        # The fused kernel runs on CPU tensors only under Triton's interpreter (set before triton is imported).
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("triton is already imported without TRITON_INTERPRET=1: the fused arm falls back to the FP8 path")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --tiny for the CPU check")
        return 2
    device = (f"{torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})" if not opts.tiny
              else "CPU (--tiny: fused kernel under the Triton interpreter, FP8 emulated; times meaningless)")
    print(f"bench_decode_fused {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  commit {git_commit()}  torch "
          f"{torch.__version__} (cuda {torch.version.cuda})  triton {package_version('triton')}  transformers "
          f"{package_version('transformers')}  device {device}  repeats {opts.repeats}", flush=True)
    sections = {"layer": layer_section, "decode": decode_section}
    failed, started = [], time.perf_counter()
    for name in opts.sections:
        t0 = time.perf_counter()
        print(f"\n## {name}", flush=True)
        try:
            sections[name](opts)
        except Exception as err:  # noqa: BLE001 — the other section still runs
            failed.append(name)
            print(f"!! section {name} failed: {short_error(err)}")
            traceback.print_exc(limit=4, file=sys.stdout)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s, total {time.perf_counter() - started:.0f} s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
