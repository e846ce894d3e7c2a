"""bench_vllm.py's decode parts: ``decode`` (vLLM generate tokens/s per ``--decode-arms`` engine, one engine alive
at a time), ``decode_profile`` (where a decode step's GPU time goes, by kernel category: ``DECODE_CATEGORIES``, also
the grpo part's rollout profile) and ``hf_decode`` (HF ``generate`` of calclip's FP8 policy and BF16, graphed).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from typing import Any

import vllm_common  # noqa: I001  (first: vLLM's environment defaults, before torch is imported)
import torch

import _common
from bench_speed import Arm, build_llama, cell, interleave, paired_ratio, setup_arm, sharing_copy
from vllm_common import _short, config_only_dir, cuda_sync, fmt, make_llm, save_results, shutdown


def part_decode(opts) -> None:
    """One engine at a time: build it, warm up and time every (batch, new tokens) cell over ``--repeats`` rounds,
    shut it down, then the next engine.

    Why not all engines alive at once with interleaved rounds (as before): an engine built later in the same process
    deletes the CUDA graphs of every engine built before it. vLLM 0.24's V1 model runner (the one these config-only
    Llama directories get: no ``architectures`` in config.json, so not Model Runner V2) estimates CUDA-graph memory
    at start-up (``GPUModelRunner.profile_cudagraph_memory``, called from ``gpu_worker.py:453``) and ends that with
    ``CUDAGraphWrapper.clear_all_graphs()`` / ``BreakableCUDAGraphWrapper.clear_all_graphs()``
    (``gpu_model_runner.py:6562-6563``), which walk class-level WeakSets of all wrappers in the process
    (``compilation/cuda_graph.py:170-176``), then ``set_cudagraph_capturing_enabled(False)`` (6561); its own
    ``capture_model`` re-captures only its own graphs and switches capture off again (6614, 6643). The earlier
    engine's dispatcher still routes batches to graph mode, its wrappers find no graph, try to capture at run time,
    and ``validate_cudagraph_capturing_enabled`` (``compilation/monitor.py:90-99``, called at
    ``cuda_graph.py:277`` and ``breakable_cudagraph.py:359``) raises "CUDA graph capturing detected at an
    inappropriate time". Re-enabling capture would make the earlier engine capture lazily inside timed runs (not
    what the product runs). The product is not affected: TRL colocate builds one engine per process."""
    layers = opts.decode_layers
    model_dir = config_only_dir("llama3_8b", layers, tempfile.mkdtemp(prefix="bench_vllm_decode_"))
    max_len = opts.prompt_len + max(opts.new_tokens) + 8
    arms = list(opts.decode_arms)
    if opts.decode_vllm_default:  # the older flag: the vLLM-default FP8 engine right after the first
        arms.insert(1, "fp8_vdef")
    specs = decode_engine_specs(arms)
    opts_dummy = argparse.Namespace(**{**vars(opts), "dummy_bf16": True})
    # one engine alive at a time, but a shut-down engine does not hand all its memory back in-process: the same
    # share as when two engines lived together
    util = opts.decode_gpu_util or 0.4
    cells = [(batch, new_tokens) for batch in opts.batches for new_tokens in opts.new_tokens]
    prompts = {batch: torch.randint(3, 128256, (batch, opts.prompt_len), generator=torch.Generator().manual_seed(batch))
               for batch in opts.batches}
    arms: dict[tuple[int, int], dict[str, Arm]] = {c: {} for c in cells}

    def build(llm, batch, new_tokens):
        from vllm import SamplingParams

        # no per-request seed: vLLM samples seeded requests with per-request generators (slower)
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens,
                                ignore_eos=True, detokenize=False)
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts[batch]]

        def sample():
            cuda_sync()
            start = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            return {"tok_s": tokens / seconds}

        sample()  # warm-up
        return sample

    for name, kwargs in specs:
        try:
            llm = make_llm(model_dir, opts_dummy, max_model_len=max_len, max_num_seqs=max(opts.batches),
                           batches=opts.batches, gpu_util=util, **kwargs)
        except Exception as err:  # noqa: BLE001
            print(f"   !! engine {name}: {_short(err)}", flush=True)
            for c in cells:
                arms[c][name] = Arm(name, error=f"engine: {_short(err)}")
            continue
        for batch, new_tokens in cells:
            print(f"-- decode {layers}L, {name}, batch {batch}, {new_tokens} tokens", flush=True)
            arm = setup_arm(name, lambda llm=llm, b=batch, n=new_tokens: build(llm, b, n))
            if arm.error:
                print(f"   !! {name} setup failed: {arm.error}", flush=True)
            interleave([arm], opts.repeats)
            arms[(batch, new_tokens)][name] = arm
            # printed per engine, so a call cut by its time limit still reports the engines that finished
            print(f"   {name} batch {batch} x {new_tokens}: {cell(arm, 'tok_s', 0)} tok/s", flush=True)
        shutdown(llm)
        del llm
    rows, results = [], vllm_common.RESULTS.setdefault("decode", [])
    for batch, new_tokens in cells:
        by = arms[(batch, new_tokens)]
        row = [str(layers), str(batch), str(new_tokens), *[cell(by.get(n), "tok_s", 0) for n, _ in specs],
               *[paired_ratio(by.get(n), by.get(DECODE_ENGINES["bf16"][0]), "tok_s")
                 for n, _ in specs if n != DECODE_ENGINES["bf16"][0]]]
        rows.append(row)
        results.append({"layers": layers, "batch": batch, "new_tokens": new_tokens, "engines": "one at a time",
                        **{a.name: a.values("tok_s") for a in by.values()},
                        "errors": {a.name: a.error for a in by.values()}})
        print("row: | " + " | ".join(row) + " |", flush=True)
    save_results(opts)
    columns = ["layers", "batch", "new tokens", *[f"{n} tok/s" for n, _ in specs],
               *[f"{n} / BF16" for n, _ in specs if n != DECODE_ENGINES["bf16"][0]]]
    print(f"\n### decode: vLLM generate tokens/s, Llama-3-8B dims, dummy weights, prompt {opts.prompt_len}, "
          f"ignore_eos, temperature 1, CUDA graphs (median [min-max] of {opts.repeats} rounds; one engine alive at a "
          f"time, engines one after another, so ratios pair round i of each engine, not interleaved rounds)")
    _common.table(columns, rows)


def _compressed_fp8(weights: str, activations: str) -> dict:
    """A compressed-tensors W8A8-FP8 quantization_config: ``weights`` strategy "channel" or "tensor" (static, from the
    checkpoint), dynamic ``activations`` strategy "token" or "tensor" (vLLM's per-channel / per-tensor FP8 kernels)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": weights,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": activations,
                                                                "symmetric": True, "dynamic": True}}}}


# Decode engines (``--decode-arms``): name -> (label, make_llm keywords). Block FP8 ("fp8*") starts from dummy weights
# with calclip's block-FP8 quantization_config; "numerics" calclip = ``fp8_engine_numerics_kwargs()`` (the trainer's
# arithmetic: fusion passes off), vllm = vLLM's defaults; a "linear_backend" override picks vLLM's GEMM. "deep_gemm"
# needs DeepGEMM (vLLM's vendored copy); make_llm sets VLLM_USE_DEEP_GEMM_E8M0 per engine (``set_deep_gemm_e8m0``):
# 0 under calclip numerics (DeepGEMM keeps the trainer's FP32 block scales), the starting environment under vLLM's
# defaults (unset: UE8M0, DeepGEMM requantizes the weights to power-of-two scales, as vLLM would for a user).
def _block_qc() -> dict:
    from calclip.fp8.export import block_fp8_quantization_config

    return block_fp8_quantization_config(modules_to_not_convert=["lm_head"])


DECODE_ENGINES: dict[str, tuple[str, Any]] = {
    "bf16": ("vLLM BF16", lambda: {}),
    "fp8": ("vLLM FP8", lambda: dict(quantization_config=_block_qc(), numerics="calclip")),
    "fp8_vdef": ("vLLM FP8 vLLM-default", lambda: dict(quantization_config=_block_qc(), numerics="vllm")),
    "fp8_cutlass_fused": ("FP8 block cutlass+fusions", lambda: dict(
        quantization_config=_block_qc(), numerics="vllm", engine_overrides={"linear_backend": "cutlass"})),
    "fp8_dg": ("FP8 block deep_gemm", lambda: dict(
        quantization_config=_block_qc(), numerics="calclip", engine_overrides={"linear_backend": "deep_gemm"})),
    "fp8_dg_fused": ("FP8 block deep_gemm+fusions", lambda: dict(
        quantization_config=_block_qc(), numerics="vllm", engine_overrides={"linear_backend": "deep_gemm"})),
    "fp8_triton": ("FP8 block triton", lambda: dict(
        quantization_config=_block_qc(), numerics="calclip", engine_overrides={"linear_backend": "triton"})),
    "online": ("vLLM online FP8", lambda: dict(engine_overrides={"quantization": "fp8", "load_format": "dummy"})),
    "rowwise": ("FP8 channel/token", lambda: dict(quantization_config=_compressed_fp8("channel", "token"),
                                                  numerics="vllm")),
    "tensorwise": ("FP8 tensor/tensor", lambda: dict(quantization_config=_compressed_fp8("tensor", "tensor"),
                                                     numerics="vllm")),
}


def decode_engine_specs(names: list[str]) -> list[tuple[str, dict]]:
    """(label, make_llm keywords) per ``--decode-arms`` name, in order, without repeats."""
    out, seen = [], set()
    for name in names:
        if name not in seen:
            seen.add(name)
            label, make = DECODE_ENGINES[name]
            out.append((label, make()))
    return out


# (category, pattern on a CUDA kernel's name), first match wins: vLLM 0.24's block-FP8 linear on Hopper is CUTLASS
# (``cutlass_scaled_mm``, kernels named cutlass*/sm90*), its activation quantizer ``per_token_group_quant_fp8``
# (Triton ``_per_token_group_quant_fp8``, or the CUDA op); BF16 linears are cuBLAS (nvjet_*, *gemm*, *xmma*).
DECODE_CATEGORIES = (
    ("FP8 activation quantizer", r"per_token_group|quant_fp8|_quant_|dynamic_.*quant|scaled_fp8_quant"),
    ("FP8 GEMM (DeepGEMM)", r"deep_?gemm|sm90_fp8_gemm|fp8_gemm_1d"),
    ("FP8 GEMM (CUTLASS)", r"cutlass|scaled_mm|blockwise|fp8"),
    ("attention", r"attn|attention|flash|paged|reshape_and_cache|kv_cache|unified"),
    ("BF16 GEMM", r"nvjet|gemm|xmma|cublas|sm90_|ampere_|splitk"),
    ("sampling / softmax", r"softmax|topk|top_k|sample|argmax|log_softmax|gumbel|exponential"),
    ("norms and activation", r"rms_norm|rmsnorm|silu|act_and_mul|rotary|rope"),
)


def kernel_profiler():
    """torch.profiler recording CUDA kernels (CPU events only where there is no CUDA: the CPU tests, no kernel rows)."""
    activity = torch.profiler.ProfilerActivity
    return torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU])


def top_kernels(times: dict[str, tuple[float, int]], n: int) -> list[tuple[str, float, int]]:
    """The ``n`` kernels of ``_common.kernel_times`` with the most device time: (name, ms, launches)."""
    return sorted(((k, us / 1e3, calls) for k, (us, calls) in times.items()), key=lambda k: -k[1])[:n]


def decode_split(times: dict[str, tuple[float, int]], steps: int) -> dict[str, float]:
    """``_common.kernel_times`` of a profile -> ms per decode step by ``DECODE_CATEGORIES``, and "total"."""
    split = _common.split_by_category(times, steps, DECODE_CATEGORIES)
    split["total"] = sum(us for us, _ in times.values()) / steps / 1e3
    return split


def part_decode_profile(opts) -> None:
    """Where a decode step's GPU time goes in the FP8 and in the BF16 engine (Llama-3-8B dims, ``--decode-layers``
    layers, the first of ``--batches``): each engine alone, without CUDA graphs (``enforce_eager``, so the profiler
    sees every kernel; the kernels are the graphed engine's), one generate of 32 tokens under torch.profiler after a
    warm-up. Tells whether the FP8 engine's small-batch decode (1.02x of BF16 at batch 64, fourteenth session) loses
    in its GEMMs, its activation quantizer or elsewhere."""
    layers, batch, new_tokens = opts.decode_layers, opts.batches[0], 32
    model_dir = config_only_dir("llama3_8b", layers, tempfile.mkdtemp(prefix="bench_vllm_profile_"))
    specs = decode_engine_specs(opts.decode_arms)
    opts_eager = argparse.Namespace(**{**vars(opts), "dummy_bf16": True, "enforce_eager": True})
    prompts = torch.randint(3, 128256, (batch, opts.prompt_len), generator=torch.Generator().manual_seed(batch))
    requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
    splits, tops, results = {}, {}, vllm_common.RESULTS.setdefault("decode_profile", {})
    for name, kwargs in specs:
        try:
            llm = make_llm(model_dir, opts_eager, max_model_len=opts.prompt_len + new_tokens + 8, max_num_seqs=batch,
                           batches=[batch], gpu_util=opts.decode_gpu_util or 0.4, **kwargs)
        except Exception as err:  # noqa: BLE001
            print(f"   !! engine {name}: {_short(err)}", flush=True)
            results[name] = {"error": _short(err)}
            continue
        from vllm import SamplingParams

        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                                detokenize=False)
        llm.generate(requests, params, use_tqdm=False)  # warm-up
        with kernel_profiler() as prof:
            llm.generate(requests, params, use_tqdm=False)
        cuda_sync()
        times = _common.kernel_times(prof)
        splits[name] = decode_split(times, new_tokens)
        tops[name] = top_kernels(times, 10)
        results[name] = {"split_ms_per_step": splits[name], "top": tops[name]}
        save_results(opts)
        shutdown(llm)
        del llm
    categories = [c for c, _ in DECODE_CATEGORIES] + ["other", "total"]
    print(f"\n### decode_profile: GPU ms per decode step (one step = {batch} sequences x 1 token), {layers} layers of "
          f"Llama-3-8B dims, batch {batch}, eager engine (no CUDA graphs), {new_tokens} tokens incl. the prefill")
    rows = [[c, *[fmt(splits.get(n, {}).get(c, 0.0), 3) for n, _ in specs]] for c in categories]
    _common.table(["category", *[n for n, _ in specs]], rows)
    for name, top in tops.items():
        print(f"\n#### {name}: top kernels (ms over the {new_tokens}-token generate, launches)")
        _common.table(["kernel", "ms", "launches"], [[k[:90], fmt(ms, 3), str(n)] for k, ms, n in top])


def part_hf_decode(opts) -> None:
    from calclip.fp8 import Fp8Config, frozen_fp8_weights, quantize_model

    device = torch.device("cuda")
    base = build_llama(opts.hf_layers, 4096, 14336, 128256, device, heads=32, kv_heads=8).eval()
    models = {"HF FP8": quantize_model(sharing_copy(base), Fp8Config()).eval(), "HF BF16": base}
    rows, results = [], vllm_common.RESULTS.setdefault("hf_decode", [])
    for batch in opts.batches:
        prompts = torch.randint(3, 128256, (batch, opts.prompt_len), generator=torch.Generator().manual_seed(batch))
        prompts = prompts.to(device)
        new_tokens = opts.new_tokens[0]
        torch._dynamo.reset()  # each batch size compiles its own static-shape decode step
        print(f"-- hf_decode {opts.hf_layers}L, batch {batch}, {new_tokens} tokens", flush=True)

        def build(name):
            model = models[name]

            def sample():
                frozen = frozen_fp8_weights(model) if name == "HF FP8" else contextlib.nullcontext()
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad(), frozen:
                    out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                         pad_token_id=0, cache_implementation="static")
                torch.cuda.synchronize()
                return {"tok_s": batch * (out.shape[1] - prompts.shape[1]) / (time.perf_counter() - start)}

            for _ in range(2):  # compile + graph recording
                sample()
            return sample

        arms = [setup_arm(name, lambda name=name: build(name)) for name in models]
        interleave(arms, opts.repeats)
        by = {a.name: a for a in arms}
        row = [str(opts.hf_layers), str(batch), str(new_tokens), cell(by["HF FP8"], "tok_s", 0),
               cell(by["HF BF16"], "tok_s", 0), paired_ratio(by["HF FP8"], by["HF BF16"], "tok_s")]
        rows.append(row)
        results.append({"layers": opts.hf_layers, "batch": batch, "new_tokens": new_tokens,
                        **{a.name: a.values("tok_s") for a in arms}, "errors": {a.name: a.error for a in arms}})
        print("row: | " + " | ".join(row) + " |", flush=True)
        save_results(opts)
    print(f"\n### hf_decode: HF generate tokens/s (static cache, compiled decode with CUDA graphs, greedy), "
          f"Llama-3-8B dims, random weights, prompt {opts.prompt_len}")
    _common.table(["layers", "batch", "new tokens", "HF FP8 tok/s", "HF BF16 tok/s", "FP8/BF16"], rows)
