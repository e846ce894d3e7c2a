"""One-off H200 probe for the first commit of FP8BlockLinear's fast host path: is the new FP8BlockLinear right and fast on the GPU,
and do torch.compile (Inductor) and HF's CUDA-graphed static-cache decode work with it?

    python benchmarks/probes/fp8_fastpath_probe.py [--skip-model] [--skip-decode]

Prints per section: layer fwd+bwd wall / host time per call (BF16 vs FP8 eager vs FP8 compiled), compiled vs
eager agreement, model fwd+bwd+AdamW step (eager and compiled), HF generate decode ms/step (eager vs static
cache). Arms interleaved, medians of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from calclip.fp8 import Fp8Config, quantize_model  # noqa: E402


def sync():
    torch.cuda.synchronize()


def timed(fn, calls):
    """(wall ms per call synchronized at the end, host ms per call to issue without sync)"""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    sync()
    wall = (time.perf_counter() - t0) / calls
    return wall * 1e3, host * 1e3


def interleave(arms: dict, rounds: int, calls: int):
    for fn in arms.values():  # warm-up (autotune, compile)
        for _ in range(3):
            fn()
    res = {k: [] for k in arms}
    for _ in range(rounds):
        for k, fn in arms.items():
            res[k].append(timed(fn, calls))
    return {k: (statistics.median(w for w, _ in v), statistics.median(h for _, h in v)) for k, v in res.items()}


def layer_section(rounds):
    print("\n## layer fwd+bwd (bf16), ms per call: wall / host", flush=True)
    print("| M,K,N | bf16 | fp8 eager | fp8 compiled | x eager | x compiled |")
    print("|---|---|---|---|---|---|")
    for m, k, n in ((2048, 4096, 4096), (8192, 2048, 2048), (8192, 4096, 14336), (64, 2048, 8192)):
        torch.manual_seed(0)
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = quantize_model(nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)))
        fp8c = quantize_model(nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)))
        comp = torch.compile(fp8c)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

        def step(mod):
            return lambda: mod(x).backward(dy)

        arms = {"bf16": step(lin), "fp8": step(fp8), "fp8c": step(comp)}
        try:
            r = interleave(arms, rounds, 20)
        except Exception:
            traceback.print_exc()
            arms.pop("fp8c")
            r = interleave(arms, rounds, 20)
            r["fp8c"] = (float("nan"), float("nan"))
        b = r["bf16"][0]
        print(f"| {m},{k},{n} | {r['bf16'][0]:.3f} / {r['bf16'][1]:.3f} | {r['fp8'][0]:.3f} / {r['fp8'][1]:.3f} | "
              f"{r['fp8c'][0]:.3f} / {r['fp8c'][1]:.3f} | {b / r['fp8'][0]:.2f}x | {b / r['fp8c'][0]:.2f}x |",
              flush=True)
        # compiled == eager on the same weights
        fp8c[0].weight.data.copy_(fp8[0].weight.data)
        from calclip.fp8 import invalidate_fp8_weight_caches
        invalidate_fp8_weight_caches()
        with torch.no_grad():
            ye, yc = fp8(x), comp(x)
        print(f"   compiled vs eager forward: equal={torch.equal(ye, yc)} max|d|={(ye - yc).abs().max().item():.3g}")


def llama(layers, hidden, inter, vocab=32000):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, vocab_size=vocab,
                      max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def model_section(rounds):
    print("\n## model fwd+bwd+AdamW(fused), 8x2048 tokens, ms per step", flush=True)
    for layers, hidden, inter in ((8, 2048, 8192), (4, 4096, 14336)):
        ids = torch.randint(0, 32000, (8, 2048), device="cuda")
        arms = {}
        for name in ("bf16", "fp8", "bf16c", "fp8c"):
            model = llama(layers, hidden, inter)
            if name.startswith("fp8"):
                quantize_model(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            fwd = torch.compile(model) if name.endswith("c") else model

            def step(fwd=fwd, opt=opt):
                out = fwd(input_ids=ids, labels=ids)
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            arms[name] = step
        try:
            r = interleave(arms, rounds, 3)
        except Exception:
            traceback.print_exc()
            continue
        w = {k: v[0] for k, v in r.items()}
        print(f"{layers}L h{hidden} i{inter}: bf16 {w['bf16']:.1f} fp8 {w['fp8']:.1f} ({w['bf16'] / w['fp8']:.2f}x) | "
              f"compiled bf16 {w['bf16c']:.1f} fp8 {w['fp8c']:.1f} ({w['bf16c'] / w['fp8c']:.2f}x) | "
              f"host fp8 eager {r['fp8'][1]:.1f}", flush=True)
        del arms
        torch.cuda.empty_cache()


def decode_section(rounds):
    print("\n## HF generate decode, 8L h2048 i8192, 128 new tokens, ms per decode step", flush=True)
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
            return scores

    models = {"bf16": llama(8, 2048, 8192), "fp8": quantize_model(llama(8, 2048, 8192))}
    for batch in (64, 256):
        prompt = torch.randint(0, 32000, (batch, 32), device="cuda")
        results = {}
        for setting in ("eager", "static"):
            for name, model in models.items():
                results[(name, setting)] = []
        tokens = {}
        for rnd in range(rounds + 1):
            for setting in ("eager", "static"):
                for name, model in models.items():
                    stamp = Stamp()
                    kw = {"cache_implementation": "static"} if setting == "static" else {}
                    try:
                        with torch.no_grad():
                            out = model.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False,
                                                 logits_processor=LogitsProcessorList([stamp]), pad_token_id=0, **kw)
                    except Exception:
                        traceback.print_exc()
                        continue
                    sync()
                    ms = stamp.events[0].elapsed_time(stamp.events[-1]) / (len(stamp.events) - 1)
                    tokens[(name, setting)] = out
                    if rnd:  # round 0 is warm-up / compile
                        results[(name, setting)].append(ms)
        med = {k: statistics.median(v) if v else float("nan") for k, v in results.items()}
        line = " | ".join(f"{n} {s} {med[(n, s)]:.2f}" for s in ("eager", "static") for n in models)
        print(f"batch {batch}: {line} | x eager {med[('bf16', 'eager')] / med[('fp8', 'eager')]:.2f} "
              f"x static {med[('bf16', 'static')] / med[('fp8', 'static')]:.2f} "
              f"x best {min(med[('bf16', 'eager')], med[('bf16', 'static')]) / min(med[('fp8', 'eager')], med[('fp8', 'static')]):.2f}",
              flush=True)
        if ("fp8", "eager") in tokens and ("fp8", "static") in tokens:
            agree = (tokens[("fp8", "eager")] == tokens[("fp8", "static")]).float().mean().item()
            print(f"   fp8 static vs eager token agreement {agree:.3f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    a = p.parse_args()
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}", flush=True)
    for skip, fn in ((a.skip_layer, layer_section), (a.skip_model, model_section), (a.skip_decode, decode_section)):
        if not skip:
            try:
                fn(a.rounds)
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    main()
