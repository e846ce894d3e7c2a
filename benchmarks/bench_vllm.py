"""vLLM rollouts on calclip's own FP8 codes , measured on one GPU: numerics, decode speed, GRPO step.

    export PYTHONPATH=/tmp/vsite VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
    python benchmarks/bench_vllm.py                      # parts ops,mismatch,decode (estimated 8-10 min cold)
    python benchmarks/bench_vllm.py --parts mismatch --models smollm2 --smollm2-gguf /tmp/smollm2/X.gguf
    python benchmarks/bench_vllm.py --parts decode --decode-layers 32       # the full-depth Llama-3-8B row
    python benchmarks/bench_vllm.py --parts hf_decode                       # HF generate FP8/BF16, graphed
    PYTHONPATH=/tmp/vsite:/tmp/site python benchmarks/bench_vllm.py --parts grpo   # needs trl + datasets

Parts (``--parts``, comma-separated; each prints a Markdown table as it finishes; with $OUT set, every number
goes to $OUT/bench_vllm.json, rewritten after each part so a call cut by its time limit keeps what finished):

ops        vLLM 0.24's own kernels against calclip's on the same inputs: the 1x128 activation quantizer (codes and
           scales bit-equal?), SiLU(gate)*up under Inductor with and without ``emulate_precision_casts`` (BF16
           bits equal to eager?), vLLM's fused SiLU*up+quant kernel (share of codes unlike the trainer's), and the
           block GEMM on identical codes (vLLM CUTLASS vs calclip's GEMM vs an FP32 reference).
mismatch   token-mult-prob-error of each engine's rollout log-probs against the trainer's forward on the same
           tokens: vLLM FP8 with calclip's engine settings (``fp8_engine_numerics_kwargs``) vs calclip's FP8 forward
           on the same codes, vLLM FP8 with vLLM's default settings (the same codes), vLLM BF16 vs the HF BF16
           forward (the control); then ``--steps`` AdamW steps of the FP8 policy, a sync of every engine (FP8:
           ``sync_fp8_weights``, vLLM's layerwise reload; BF16: TRL's per-tensor ``load_weights``), and the same
           again. "floor": the trainer against itself with eager instead of SDPA attention on the same tokens, i.e.
           how far BF16-level noise moves the log-probs through that model. "codes": whether the engine holds
           exactly the trainer's FP8 codes and scales after the sync (``engine_fp8_mismatches``).
decode     generate tokens/s (prompt ``--prompt-len`` random tokens, ignore_eos, sampled at temperature 1) of
           vLLM FP8 (calclip settings), vLLM BF16 and, with ``--decode-vllm-default``, vLLM FP8 with vLLM's
           defaults, on a dummy-weight Llama-3-8B-shaped model of ``--decode-layers`` layers, at each
           ``--batches`` x ``--new-tokens``; CUDA graphs on (vLLM's default compile + graph capture); one engine
           alive at a time (a later in-process engine deletes an earlier one's CUDA graphs: ``part_decode``),
           ``--repeats`` rounds per cell after a warm-up; medians [min-max], ratios of round i to round i.
decode_profile  where a decode step's GPU time goes, FP8 engine vs BF16 engine (``--decode-layers``, the first of
           ``--batches``, eager engines so torch.profiler sees every kernel): FP8 GEMM, activation quantizer,
           attention, BF16 GEMM, sampling, norms, other (``DECODE_CATEGORIES``), and each engine's top kernels.
hf_decode  the same tokens/s for HF ``generate`` (static cache: transformers compiles the decode step with CUDA
           graphs) of calclip's FP8 policy (inside ``frozen_fp8_weights``, as the trainer runs it) and BF16, on
           ``--hf-layers`` layers (compiles once per batch size: ~1 min each).
grpo       one CalibratedGRPOTrainer step with vLLM colocate rollouts, ``fp8`` true vs false, each arm in its own
           process: step wall time, rollout (generate) time, weight-sync time and its share of the step
           (median of the steps after the first), each arm's start; ``--grpo-profile-rollout K``: where the K-th
           rollout's time went (GPU kernels by ``DECODE_CATEGORIES``, the GPU's busy share of the wall);
           ``--grpo-profile-host K``: the K-th rollout under cProfile (the Python functions the host spends the
           rollout in: vLLM's scheduler, input preparation, sampler, output processing, TRL's; with $OUT set, the
           whole profile is saved as $OUT/host_<arm>.pstats). After its run an FP8 arm syncs once more and checks
           the engine against the reference quantizer's codes; an arm whose timed rollouts differ by more than
           ``ROLLOUT_DRIFT`` (the machine changed speed mid-run), or whose timed rollouts ran while the hypervisor
           stole ``STEAL_WARN`` or more of the host's CPU time (a contended host), gets a warning under the table. With
           ``--grpo-rounds`` > 1 the step ratio is also printed round by round (each round's runs ran back to
           back), and each worker's line gives its rollouts' CPU share of their wall and the host's load average.
           ``--grpo-earlier a.json,b.json`` pools earlier calls' runs (their parents' bench_vllm.json) with this
           call's, as rounds in the files' order: rounds beyond one 10-minute device call; ``--grpo-rounds 0``
           summarizes the files alone, on any machine.

Recipes (``--recipes``, comma-separated, default ``blockwise``): the FP8 recipes the mismatch and grpo parts run.
blockwise is calclip's block-FP8 engine (``quantization="fp8"``, 128x128 weight blocks); rowwise and tensorwise are
torchao's, served per channel (``quantization="compressed-tensors"``, the policy's own codes and per-row scales:
calclip.fp8.export). Their rows carry the recipe ("FP8 calclip rowwise", "fp8_tensorwise"); blockwise rows keep
their names. mismatch: one child per model, engine and recipe; every child trains the blockwise FP8 policy over the
same Parameters for the after-sync stage, so every engine is synced from the same weights. decode: ``--decode-arms``
(vLLM 0.24 serves both calclip exports with channel weight scales and per-token activation scales: the "rowwise"
arm's engine).

Engine options (the trainer's ``vllm_kv_cache_dtype`` / ``vllm_async_scheduling``): ``--kv-cache-dtype fp8`` gives the
FP8 engines of mismatch and decode an FP8 KV cache (the BF16 engine stays the control) and every grpo arm's engine
one; ``--async-scheduling on|off`` sets vLLM's async_scheduling on every engine (default: vLLM's choice).

Models (``--models``): ``llama3_8b`` (Llama-3-8B dims: hidden 4096, intermediate 14336, 32 heads, 8 KV heads,
vocab 128256; ``--layers`` layers, random weights), ``issue_probe`` (the dims of the original mismatch probe: 2 layers, hidden 1024,
intermediate 2816, 8 heads / 4 KV, vocab 32000), ``smollm2`` (SmolLM2-135M-Instruct from ``--smollm2-gguf``, a
GGUF file transformers dequantizes; needs the ``gguf`` package). Random models get their LM head redrawn with std
``--logit-std`` / sqrt(hidden), i.e. logits of std ~``--logit-std`` after the final RMSNorm, so the sampled
distributions are sharp enough that log-prob errors show (std-0.02 init gives near-uniform logits). SmolLM2's
hidden size 576 is not a multiple of 128: its FP8 policy keeps what vLLM's block-FP8 linear cannot serve in BF16
(``vllm_keep_patterns``: all but down_proj), for training too.

Environment: vLLM 0.24.0 (the bundle of ../shared/vllm, built with DeepGEMM kept as docs/benchmarks.md says; without
it vLLM's automatic block-FP8 GEMM is CUTLASS; Triton attention, no FlashInfer sampler), torch 2.11, transformers;
``grpo`` also needs trl 1.16 and datasets (with dill, multiprocess, xxhash). Nothing reaches a hub: random models are
built from configs.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROCESS_START = time.perf_counter()  # a grpo worker's startup_s counts from here

# vLLM reads these at import and engine start; the engine runs in this process (what TRL's colocate mode does).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the GPU bundle
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/
import _common  # noqa: E402  (puts the repository root on sys.path)
from bench_speed import Arm, build_llama, cell, interleave, paired_ratio, setup_arm, sharing_copy  # noqa: E402

PARTS = ("ops", "mismatch", "decode", "decode_profile", "hf_decode", "grpo")
DEFAULT_PARTS = ("ops", "mismatch", "decode")
MODEL_SPECS = {  # hidden, intermediate, heads, kv heads, vocab, default layers
    "llama3_8b": (4096, 14336, 32, 8, 128256, None),
    "issue_probe": (1024, 2816, 8, 4, 32000, 2),
}
# the trainer's vllm_kv_cache_dtype values (calclip.trainers.config.VLLM_KV_CACHE_DTYPES; that module imports TRL,
# which the non-grpo parts run without)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
MISMATCH_ARMS = {"calclip": "FP8 calclip", "vllm": "FP8 vLLM-default", "bf16": "BF16"}  # --mismatch-arms
RESULTS: dict = {}


# ---------------------------------------------------------------------------------------------------------------
# small pure helpers (tests/test_bench_vllm.py runs them on CPU)


def mismatch_stats(engine_logp: torch.Tensor, trainer_logp: torch.Tensor) -> dict[str, float]:
    """engine vs trainer log-probs of the same sampled tokens, [B, T] each: token-mult-prob-error (mean of
    exp|d|, calclip.losses.token_mult_prob_error), max |d|, share of tokens with exp|d| > 1.1, mean |d|."""
    from calclip.losses import token_mult_prob_error

    a, b = engine_logp.float().cpu(), trainer_logp.float().cpu()
    diff = (a - b).abs()
    return {"tmpe": float(token_mult_prob_error(b, a, torch.ones_like(a))), "max_abs": float(diff.max()),
            "over_1p1": float((diff.exp() > 1.1).float().mean()), "mean_abs": float(diff.mean()),
            "tokens": int(diff.numel())}


_E8M0_AT_START = os.environ.get("VLLM_USE_DEEP_GEMM_E8M0")  # the environment the benchmark was started with


def engine_linear_backend(backend: str | None, recipe: str) -> str | None:
    """The vLLM linear backend an FP8 engine of ``recipe`` gets for ``--linear-backend``: the same, or "cutlass" where
    vLLM 0.24 has no kernel of that backend for the recipe (deep_gemm / triton and the per-channel recipes: the
    trainer's config refuses those, vLLM would fail after loading the model), with a printed note."""
    from calclip.rollout.vllm_sync import linear_backend_problem

    problem = linear_backend_problem(recipe, backend)
    if problem:
        print(f"   note: the {recipe} engine runs linear_backend 'cutlass', not {backend!r}: {problem}", flush=True)
        return "cutlass"
    return backend


def set_deep_gemm_e8m0(numerics: str, backend: str | None) -> None:
    """Before a block-FP8 engine of calclip's codes starts: with the trainer's numerics, VLLM_USE_DEEP_GEMM_E8M0 as the
    trainer sets it (0 where DeepGEMM may run, so DeepGEMM keeps the FP32 block scales: ``apply_deep_gemm_e8m0``);
    with vLLM's defaults, the value the benchmark started with (unset: vLLM's default 1, under which DeepGEMM
    requantizes the weights to power-of-two scales). In-process decode arms start several engines, so each sets it."""
    from calclip.rollout.vllm_sync import apply_deep_gemm_e8m0, set_deep_gemm_e8m0_env

    if numerics == "calclip":
        apply_deep_gemm_e8m0(backend, False)
    else:
        set_deep_gemm_e8m0_env(_E8M0_AT_START)


def host_cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(stolen, total) clock ticks of all the machine's CPUs so far (``/proc/stat``'s first line: user nice system
    idle iowait irq softirq steal ...), or None where there is no such file or no steal column. On a virtual machine
    the hypervisor's steal is time other guests took from this one's CPUs: a host-bound rollout slows by it although
    its own CPU time and the guest's load average do not show it."""
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time stolen between two ``host_cpu_ticks`` readings (None without both)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def deep_gemm_cache_files(env=os.environ) -> int | None:
    """Files in DeepGEMM's JIT cache (``DG_JIT_CACHE_DIR``, as vLLM sets it: ``$VLLM_CACHE_ROOT/deep_gemm``,
    ``~/.cache/vllm/deep_gemm`` by default), or None where it does not exist. calclip starts DeepGEMM engines with
    ``VLLM_DEEP_GEMM_WARMUP=skip``, so a kernel compiles when a token count first needs it; the prefill's token count
    changes with the prompts, so a timed rollout may compile one (the cache grows while it runs)."""
    cache_root = env.get("VLLM_CACHE_ROOT") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                             "vllm")  # vllm.envs' rule
    root = env.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser(cache_root), "deep_gemm")
    if not os.path.isdir(root):
        return None
    return sum(len(files) for _, _, files in os.walk(root))


# PyTorch's CUDA caching allocator: cudaMalloc and cudaFree calls, allocations retried after it freed its cache, and
# its device-wide synchronizations (torch.cuda.memory_stats' counters). vLLM's sampler and input buffers allocate
# from it in the trainer's process; a trainer that leaves little free memory beside the engine makes those go to the
# driver, and each cudaFree or retry synchronizes the device, stalling a host-bound decode.
ALLOCATOR_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_events(stats: dict | None = None) -> dict[str, int] | None:
    """The caching allocator's ``ALLOCATOR_EVENTS`` so far (from ``stats``, else this process's device), or None
    without CUDA."""
    if stats is None:
        if not torch.cuda.is_available():
            return None
        stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_EVENTS}


def allocator_delta(before: dict | None, after: dict | None) -> dict[str, int] | None:
    """Each counter's growth between two ``allocator_events`` readings (None without both)."""
    if before is None or after is None:
        return None
    return {key: after[key] - before[key] for key in ALLOCATOR_EVENTS}


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def pooled_after(runs: list[dict], key: str, skip: int) -> list[float]:
    """Every run's ``key`` measurements after its first ``skip`` (compilation, graph capture, autotuning), pooled;
    all of a run's when it has no more."""
    return [v for run in runs for v in (run[key][skip:] if len(run[key]) > skip else run[key])]


def capture_sizes(batches: list[int]) -> list[int]:
    """CUDA-graph batch sizes for an engine that decodes exactly ``batches`` (plus small ones for stragglers)."""
    return sorted({1, 2, 4, 8, 16, 32, *batches})


def save_results(opts) -> None:
    """Write what is measured so far: $OUT/bench_vllm.json (the parent, all parts), or, in a child process, its
    --child-json file and $OUT/bench_vllm.<part>[.<model>].json (kept if the call is cut by its time limit)."""
    text = json.dumps(RESULTS, indent=1, default=str)
    child = getattr(opts, "child_json", None)
    if child:
        Path(child).write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        name = "bench_vllm.json"
        if child:
            name = ".".join(["bench_vllm", *opts.parts,
                             *(opts.models + opts.mismatch_arms + opts.recipes if opts.parts == ["mismatch"] else []),
                             "json"])
        Path(out, name).write_text(text)


# ---------------------------------------------------------------------------------------------------------------
# models: random Llama-shaped, SmolLM2 from GGUF; the FP8 policy calclip trains


def random_llama(name: str, layers: int | None, device, logit_std: float, seed: int = 0):
    hidden, inter, heads, kv, vocab, default_layers = MODEL_SPECS[name]
    model = build_llama(layers or default_layers, hidden, inter, vocab, device, seed, heads=heads, kv_heads=kv)
    with torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        model.lm_head.weight.normal_(0.0, logit_std / math.sqrt(hidden), generator=gen)
    return model.eval()


def smollm2(gguf_path: str, device):
    """SmolLM2 from its GGUF file, through calclip's loader: transformers alone leaves the de-quantized model tagged
    as GGUF-quantized, and ``save_pretrained`` (``save_for_vllm``) refuses it (H200, 2026-12-02)."""
    from calclip.models import load_gguf_model

    path = Path(gguf_path)
    model, _ = load_gguf_model(path.parent, path.name, dtype=torch.bfloat16)
    return model.to(device).eval()


def fp8_policy(base, recipe: str = "blockwise"):
    """calclip's FP8 policy of ``recipe`` over ``base``'s own Parameters, with every layer vLLM's FP8 linear for that
    recipe cannot serve kept in BF16 (in training too). Returns (policy, the modules kept for vLLM)."""
    from calclip.fp8 import Fp8Config, quantize_model
    from calclip.fp8.export import fp8_weight_specs, linear_shapes, vllm_fp8_problems, vllm_keep_patterns

    policy = quantize_model(sharing_copy(base), Fp8Config(recipe=recipe))
    problems = vllm_fp8_problems(linear_shapes(policy), fp8_weight_specs(policy))
    if not problems:
        return policy.eval(), []
    keep = vllm_keep_patterns(problems)
    kept_config = Fp8Config(recipe=recipe, keep_patterns=("lm_head", *keep))
    return quantize_model(sharing_copy(base), kept_config).eval(), sorted(problems)


def recipe_label(label: str, recipe: str, sep: str = " ") -> str:
    """A row label of ``recipe``: blockwise keeps the label it always had, the others get the recipe appended."""
    return label if recipe == "blockwise" else f"{label}{sep}{recipe}"


def save_for_vllm(model, directory: str, tokenizer=None) -> str:
    model.save_pretrained(directory)  # safetensors in the model's dtype; vLLM's BF16 engine loads them
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def config_only_dir(name: str, layers: int, directory: str) -> str:
    """A Llama config (no weights) for engines started with load_format='dummy'."""
    from transformers import LlamaConfig

    hidden, inter, heads, kv, vocab, _ = MODEL_SPECS[name]
    LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2).save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------------------------
# engines


def make_llm(model_dir: str, opts, *, policy=None, quantization_config=None, numerics: str = "calclip",
             max_model_len: int, max_num_seqs: int, batches: list[int], gpu_util: float,
             engine_overrides: dict | None = None):
    """A vllm.LLM in this process. FP8 (``policy`` or ``quantization_config`` given): block-FP8 engine started from
    dummy weights as calclip's trainer starts it, then (with ``policy``) synced with ``sync_fp8_weights``;
    ``numerics`` "calclip" merges ``fp8_engine_numerics_kwargs()``, "vllm" keeps vLLM's defaults. BF16 otherwise
    (weights from ``model_dir``, or dummy with ``opts.dummy_bf16``)."""
    from vllm import LLM

    from calclip.rollout.vllm_sync import (fp8_engine_kwargs, fp8_engine_numerics_kwargs, merge_engine_kwargs,
                                           sync_fp8_weights)

    kwargs = dict(model=model_dir, dtype="bfloat16", gpu_memory_utilization=gpu_util, max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs, seed=0, logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
                  enable_prefix_caching=False, attention_backend=opts.attention_backend,
                  compilation_config={"cudagraph_capture_sizes": capture_sizes(batches)})
    fp8 = policy is not None or quantization_config is not None
    if fp8:
        if policy is not None:
            kwargs.update(fp8_engine_kwargs(policy))
        else:
            kwargs.update(quantization=quantization_config["quant_method"],
                          hf_overrides={"quantization_config": quantization_config}, load_format="dummy")
        if numerics == "calclip":  # the trainer's engine numerics, "fastest" resolved for this engine's recipe
            recipe = "blockwise" if kwargs.get("quantization") == "fp8" else "rowwise"
            kwargs = merge_engine_kwargs(kwargs, fp8_engine_numerics_kwargs(
                linear_backend=getattr(opts, "linear_backend", "fastest"), recipe=recipe))
    elif opts.dummy_bf16:
        kwargs["load_format"] = "dummy"
    # last: a decode arm's own linear backend / quantization beats the numerics defaults
    kwargs = merge_engine_kwargs(kwargs, engine_overrides or {})
    if getattr(opts, "enforce_eager", False):  # no torch.compile, no CUDA graphs: rules them in or out of a mismatch
        kwargs["enforce_eager"] = True
    if getattr(opts, "model_impl", "auto") != "auto":  # "transformers": HF's modeling code inside the engine
        kwargs["model_impl"] = opts.model_impl
    block = fp8 and kwargs.get("quantization") == "fp8"  # calclip's block codes (else compressed-tensors, per channel)
    if fp8 and kwargs.get("linear_backend") is not None:  # rowwise and tensorwise: the same per-channel kernels
        kwargs["linear_backend"] = engine_linear_backend(kwargs["linear_backend"], "blockwise" if block else "rowwise")
    if block:
        set_deep_gemm_e8m0(numerics, kwargs.get("linear_backend"))
        # as the trainer does: no minutes-long DeepGEMM warm-up before the first request
        # (vllm_sync.apply_deep_gemm_warmup; kept for the rest of the process, so every later DeepGEMM engine,
        # vLLM-default arms included, starts alike)
        from calclip.rollout.vllm_sync import apply_deep_gemm_warmup

        if apply_deep_gemm_warmup(kwargs.get("linear_backend")):
            print("   VLLM_DEEP_GEMM_WARMUP=skip (DeepGEMM kernels compiled as first used)", flush=True)
    # the trainer's engine options (--kv-cache-dtype: FP8 engines only, vLLM's online FP8 included, so the BF16 engine
    # stays the control)
    from calclip.rollout.vllm_sync import engine_speed_kwargs

    fp8_engine = fp8 or kwargs.get("quantization") == "fp8"
    kwargs.update(engine_speed_kwargs(kv_cache_dtype=getattr(opts, "kv_cache_dtype", "auto") if fp8_engine else "auto",
                                      async_scheduling=getattr(opts, "async_scheduling", None)))
    start = time.perf_counter()
    llm = LLM(**kwargs)
    setup_s = time.perf_counter() - start
    sync_ms = math.nan
    if policy is not None:
        cuda_sync()
        start = time.perf_counter()
        sync_fp8_weights(llm, policy)
        cuda_sync()
        sync_ms = (time.perf_counter() - start) * 1e3
    print(f"   engine {'FP8 ' + numerics if fp8 else 'BF16'} ready in {setup_s:.0f} s"
          + (f" (first sync {sync_ms:.0f} ms)" if policy is not None else ""), flush=True)
    return llm


def shutdown(llm) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync_bf16(llm, base) -> None:
    """TRL 1.16's colocate sync with fp8 off: model.load_weights per parameter, then reset the prefix cache."""
    from calclip.rollout.vllm_sync import vllm_engine_model

    model, _ = vllm_engine_model(llm)
    for name, param in base.named_parameters():
        model.load_weights([(name, param.data)])
    llm.reset_prefix_cache()


def timed_ms(fn) -> float:
    cuda_sync()
    start = time.perf_counter()
    fn()
    cuda_sync()
    return (time.perf_counter() - start) * 1e3


def rollout(llm, prompts: torch.Tensor, new_tokens: int, seed: int):
    """Sample ``new_tokens`` per prompt (temperature 1, ignore_eos) -> (completions [B, T], engine log-probs)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                            logprobs=0, seed=seed, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    ids, lps = [], []
    for out in outs:
        o = out.outputs[0]
        ids.append(list(o.token_ids))
        lps.append([step[tok].logprob for step, tok in zip(o.logprobs, o.token_ids)])
    return torch.tensor(ids), torch.tensor(lps, dtype=torch.float32)


def trainer_logprobs(model, prompts: torch.Tensor, completions: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """log p(completion token) under ``model`` (teacher-forced, one forward over prompt + completion), [B, T] fp32."""
    device = next(model.parameters()).device
    out = []
    p = prompts.shape[1]
    with torch.no_grad():
        for start in range(0, prompts.shape[0], chunk):
            ids = torch.cat([prompts[start:start + chunk], completions[start:start + chunk]], 1).to(device)
            logits = model(input_ids=ids).logits[:, p - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None])[..., 0].cpu())
    return torch.cat(out)


def prompt_logprobs_of(out, ids: list[int]) -> list[float]:
    """The engine's teacher-forced log-probs of ``ids[1:]`` from one vLLM 0.24 ``RequestOutput`` of a request with
    ``SamplingParams(prompt_logprobs=0)`` on ``ids``: ``out.prompt_logprobs`` holds None for the first prompt token,
    then per position a {token id: Logprob} dict (a plain list, or vllm.logprobs.FlatLogprobs, whose ``[i]`` builds
    the same dict) holding at least the prompt token itself. Raises ValueError when the output does not belong to
    ``ids`` (another length, or a position without its token)."""
    plp = out.prompt_logprobs
    if plp is None:
        raise ValueError("no prompt_logprobs in the output (SamplingParams(prompt_logprobs=0) not honoured)")
    if len(plp) != len(ids):
        raise ValueError(f"prompt_logprobs cover {len(plp)} positions, the request has {len(ids)} tokens")
    values = []
    for pos in range(1, len(ids)):
        step = plp[pos]
        if step is None or ids[pos] not in step:
            raise ValueError(f"prompt_logprobs position {pos} lacks the prompt token {ids[pos]}")
        values.append(float(step[ids[pos]].logprob))
    return values


def engine_teacher_forced(llm, ids: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, float]:
    """The engine's own log-probs of every token of ``ids`` [B, L] after the first, teacher-forced (one prefill with
    ``prompt_logprobs=0``, ``max_tokens=1``), [B, L-1] fp32; and the share of requests whose ``prompt_token_ids``
    the engine echoes back unchanged. Chunks of ``chunk`` requests keep the [tokens, vocab] log-softmax small."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, seed=0, detokenize=False)
    rows, echoed = [], 0
    for start in range(0, ids.shape[0], chunk):
        batch = ids[start:start + chunk].tolist()
        outs = llm.generate([{"prompt_token_ids": r} for r in batch], params, use_tqdm=False)
        for out, r in zip(outs, batch):
            echoed += list(getattr(out, "prompt_token_ids", None) or []) == r
            rows.append(prompt_logprobs_of(out, r))
    return torch.tensor(rows, dtype=torch.float32), echoed / ids.shape[0]


def engine_greedy_first(llm, prompts: torch.Tensor) -> torch.Tensor:
    """The engine's greedy (temperature 0) first token after each prompt, [B]."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    return torch.tensor([o.outputs[0].token_ids[0] for o in outs])


def trainer_all_logprobs(model, ids: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s teacher-forced log-probs of every token of ``ids`` [B, L] after the first, [B, L-1] fp32, and its
    argmax at every position, [B, L] (column t: the most likely token after ids[:, :t+1])."""
    device = next(model.parameters()).device
    lps, tops = [], []
    with torch.no_grad():
        for start in range(0, ids.shape[0], chunk):
            part = ids[start:start + chunk].to(device)
            logits = model(input_ids=part).logits.float()
            tops.append(logits.argmax(-1).cpu())
            lps.append(torch.log_softmax(logits[:, :-1], -1).gather(-1, part[:, 1:, None])[..., 0].cpu())
    return torch.cat(lps), torch.cat(tops)


def diagnostic_stats(engine_rollout_lp: torch.Tensor, engine_tf: torch.Tensor, trainer_tf: torch.Tensor,
                     prompt_len: int, engine_greedy: torch.Tensor | None = None,
                     trainer_greedy: torch.Tensor | None = None) -> dict:
    """What tells a wrong comparison from engine and trainer computing different functions.

    engine_rollout_lp [B, T]: the rollout's log-probs of its sampled tokens; engine_tf / trainer_tf [B, P+T-1]:
    teacher-forced log-probs of tokens 1.. of prompt + completion (P = ``prompt_len``) from the engine
    (``prompt_logprobs``) and from the trainer's forward. ``align``: rollout vs the engine's own teacher-forced
    values of the same completion tokens (tmpe ~1: the rollout's tokens and log-probs are extracted and lined up
    right; far from 1: they are not). ``tf_prompt`` / ``tf_completion``: engine vs trainer on the same ids, prompt
    positions (no sampling involved at all) and completion positions. ``greedy_top1_agree``: share of prompts whose
    greedy first token is the same in engine and trainer. ``mean_logp``: the average log-prob each side gives."""
    p = prompt_len
    out = {"align": mismatch_stats(engine_rollout_lp, engine_tf[:, p - 1:]),
           "tf_prompt": mismatch_stats(engine_tf[:, :p - 1], trainer_tf[:, :p - 1]),
           "tf_completion": mismatch_stats(engine_tf[:, p - 1:], trainer_tf[:, p - 1:]),
           "mean_logp": {"engine_rollout": float(engine_rollout_lp.mean()),
                         "engine_tf_completion": float(engine_tf[:, p - 1:].mean()),
                         "trainer_completion": float(trainer_tf[:, p - 1:].mean()),
                         "engine_tf_prompt": float(engine_tf[:, :p - 1].mean()),
                         "trainer_prompt": float(trainer_tf[:, :p - 1].mean())}}
    if engine_greedy is not None and trainer_greedy is not None:
        out["greedy_top1_agree"] = float((engine_greedy.cpu() == trainer_greedy.cpu()).float().mean())
    return out


def engine_runner(llm) -> str:
    """Which vLLM model runner serves ``llm`` (0.24 picks Model Runner V2, ``vllm.v1.worker.gpu.model_runner``, for
    LlamaForCausalLM checkpoints and the V1 ``gpu_model_runner`` otherwise)."""
    try:
        runner = llm.llm_engine.model_executor.driver_worker.model_runner
    except AttributeError:
        return "?"
    return f"{type(runner).__module__}.{type(runner).__name__}"


def engine_weight_mismatches(engine_model: nn.Module, base: nn.Module,
                             packed_modules=None) -> tuple[int, list[str]]:
    """Compare every floating-point (not FP8) parameter of a live vLLM model with ``base``'s, under vLLM's names:
    fused layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj) against their shards stacked along dim 0, a vocab
    table padded by the engine on its first rows. Returns (tensors compared, "name: why" for each that differs or
    has no source). FP8 tensors are ``engine_fp8_mismatches``' job; this catches an engine that never received the
    embeddings, norms or LM head, or that ties or pads them differently."""
    from calclip.fp8.export import LLAMA_PACKED_MODULES

    packed = LLAMA_PACKED_MODULES if packed_modules is None else packed_modules
    source = {n: p.detach() for n, p in base.named_parameters()}
    compared, bad = 0, []
    for name, param in engine_model.named_parameters():
        got = param.detach()
        if not got.is_floating_point() or got.dtype == torch.float8_e4m3fn or got.element_size() < 2:
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, short = module.rpartition(".")
        if name in source:
            want = source[name]
        elif short in packed and all(f"{parent}.{s}.{leaf}" in source for s in packed[short]):
            want = torch.cat([source[f"{parent}.{s}.{leaf}"] for s in packed[short]])
        else:
            if leaf == "weight" and "." in module and got.dim() >= 1:
                bad.append(f"{name}: no source in the trainer model")
            continue
        compared += 1
        if got.shape[1:] != want.shape[1:] or got.shape[0] < want.shape[0]:
            bad.append(f"{name}: engine {tuple(got.shape)}, trainer {tuple(want.shape)}")
            continue
        diff = (got[: want.shape[0]].float() - want.to(got.device).float()).abs().max().item()
        if diff > 0:
            bad.append(f"{name}: max |engine - trainer| {diff:.3g}")
    return compared, bad


def mismatch_diagnostics(llm, reference, prompts: torch.Tensor, tokens: torch.Tensor,
                         engine_lp: torch.Tensor, base: nn.Module | None = None) -> dict:
    """``diagnostic_stats`` for one engine and its trainer-side ``reference`` on one rollout, plus the runner,
    whether the engine echoes the prompts unchanged and (with ``base``) whether it holds ``base``'s BF16 tensors.
    Costs two short prefills and a one-token greedy generate."""
    ids = torch.cat([prompts, tokens], 1)
    engine_tf, echoed = engine_teacher_forced(llm, ids)
    trainer_tf, trainer_top = trainer_all_logprobs(reference, ids)
    greedy = engine_greedy_first(llm, prompts)
    stats = diagnostic_stats(engine_lp, engine_tf, trainer_tf, prompts.shape[1], greedy,
                             trainer_top[:, prompts.shape[1] - 1])
    out = {**stats, "prompt_ids_echoed": echoed, "runner": engine_runner(llm)}
    if base is not None:
        from calclip.rollout.vllm_sync import vllm_engine_model

        compared, bad = engine_weight_mismatches(vllm_engine_model(llm)[0], base)
        out["bf16_tensors"] = {"compared": compared, "differ": len(bad), "first": bad[:4]}
        print(f"   engine BF16 tensors vs the trainer's: {compared} compared, {len(bad)} differ"
              + (f", e.g. {bad[:3]}" if bad else ""), flush=True)
    return out


def train_steps(policy, prompts, completions, steps: int, lr: float, chunk: int = 8) -> list[float]:
    """``steps`` AdamW steps minimizing the NLL of ``completions`` under ``policy`` (its FP8 forward and backward);
    returns the losses. The policy shares its Parameters with the BF16 model, so both move."""
    device = next(policy.parameters()).device
    params = [q for q in policy.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    p = prompts.shape[1]
    losses = []
    policy.train()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, prompts.shape[0], chunk):
            ids = torch.cat([prompts[start:start + chunk], completions[start:start + chunk]], 1).to(device)
            logits = policy(input_ids=ids).logits[:, p - 1:-1].float()
            nll = -torch.log_softmax(logits, -1).gather(-1, ids[:, p:, None]).mean() * ids.shape[0] / prompts.shape[0]
            nll.backward()
            total += float(nll.detach())
        optimizer.step()
        losses.append(total)
    policy.eval()
    return losses


@contextlib.contextmanager
def attention(model, implementation: str):
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


# ---------------------------------------------------------------------------------------------------------------
# part ops: vLLM's kernels vs calclip's on identical inputs


def spread_activations(rows: int, k: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, k // 128, 128, device=device, generator=gen)
    scale = 10.0 ** torch.empty(rows, k // 128, 1, device=device).uniform_(-2, 2, generator=gen)
    return (x * scale).view(rows, k).to(torch.bfloat16)


def share_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return float((a == b).float().mean())


def part_ops(opts) -> None:
    import torch.nn.functional as F

    from calclip.fp8.gemm import emulated_block_gemm, fp8_block_gemm, resolve_backend
    from calclip.fp8.quant import quantize_1x128, quantize_128x128

    device = torch.device("cuda")
    rows, results = [], []

    def record(check: str, shape: str, value: str, **numbers):
        rows.append([check, shape, value])
        results.append({"check": check, "shape": shape, **numbers})

    def attempt(label, fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 — one failing check must not stop the others
            record(label, "-", f"error: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")

    def quantizer():
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        for m, k in ((64, 4096), (4096, 14336)):
            x = spread_activations(m, k, 0, device)
            qv, sv = per_token_group_quant_fp8(x, 128, column_major_scales=True, use_ue8m0=False)
            qc, sc = quantize_1x128(x)
            codes, scales = share_equal(qv, qc), share_equal(sv.contiguous(), sc)
            record("1x128 quantizer: vLLM per_token_group_quant_fp8 = calclip (codes / scales bit-equal)",
                   f"{m}x{k}", f"{codes:.6f} / {scales:.6f}", codes_equal=codes, scales_equal=scales)

    def silu_mul():
        gen = torch.Generator(device=device).manual_seed(1)
        gate = (torch.randn(256, 14336, device=device, generator=gen) * 2).to(torch.bfloat16)
        up = (torch.randn(256, 14336, device=device, generator=gen) * 2).to(torch.bfloat16)
        eager = F.silu(gate) * up
        for emulate in (False, True):
            torch._dynamo.reset()
            with torch._inductor.config.patch(emulate_precision_casts=emulate):
                compiled = torch.compile(lambda g, u: F.silu(g) * u, dynamic=False)(gate, up)
            same = share_equal(compiled, eager)
            record(f"SiLU(gate)*up, Inductor emulate_precision_casts={emulate}: BF16 bits = eager", "256x14336",
                   f"{same:.6f}", equal=same, emulate=emulate)
        q_train, s_train = quantize_1x128(eager)
        out = torch.empty_like(eager, dtype=torch.float8_e4m3fn)
        scales = torch.empty(256, 14336 // 128, device=device)
        torch.ops._C.silu_and_mul_per_block_quant(out, torch.cat([gate, up], -1).contiguous(), scales, 128, None, False)
        codes = share_equal(out, q_train)
        record("vLLM fused SiLU*up+quant codes = calclip's on HF's BF16 product", "256x14336", f"{codes:.6f}",
               codes_equal=codes)

    def gemm():
        for m, k, n in ((64, 4096, 6144), (256, 4096, 28672), (256, 14336, 4096), (2048, 4096, 4096)):
            gen = torch.Generator(device=device).manual_seed(m + n)
            w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
            qw, sw = quantize_128x128(w)
            qx, sx = quantize_1x128(spread_activations(m, k, 2, device))
            ref = emulated_block_gemm(qx, sx, qw, sw, out_dtype=torch.float32)
            from vllm import _custom_ops as ops

            y_vllm = ops.cutlass_scaled_mm(qx, qw.t(), out_dtype=torch.bfloat16,
                                           scale_a=sx.t().contiguous().t(), scale_b=sw.t())
            y_calclip = fp8_block_gemm(qx, sx, qw, sw, out_dtype=torch.bfloat16)
            backend = resolve_backend("auto", qx, qw, out_dtype=torch.bfloat16, a_blocks="1x128", b_blocks="128x128")
            rms = ref.pow(2).mean().sqrt()
            err_v = float((y_vllm.float() - ref).pow(2).mean().sqrt() / rms)
            err_c = float((y_calclip.float() - ref).pow(2).mean().sqrt() / rms)
            same = share_equal(y_vllm, y_calclip)
            record(f"block GEMM, same codes: vLLM CUTLASS = calclip {backend} (bits) | rel rms err vs fp32 ref",
                   f"{m}x{k}x{n}", f"{same:.4f} | {err_v:.2e} vs {err_c:.2e}", bits_equal=same, vllm_rel_err=err_v,
                   calclip_rel_err=err_c, calclip_backend=backend)

    for label, fn in (("quantizer", quantizer), ("silu_mul", silu_mul), ("gemm", gemm)):
        attempt(label, fn)
    print("\n### ops: vLLM 0.24 kernels vs calclip on identical inputs")
    _common.table(["check", "shape", "value"], rows)
    RESULTS["ops"] = results


# ---------------------------------------------------------------------------------------------------------------
# part mismatch


def part_mismatch(opts) -> None:
    from calclip.rollout.vllm_sync import engine_fp8_mismatches, vllm_engine_model

    device = torch.device(opts.device)
    rows, diag_rows, results = [], [], RESULTS.setdefault("mismatch", [])
    for name in opts.models:
        t0 = time.perf_counter()
        print(f"-- mismatch: {name}", flush=True)
        if name == "smollm2":
            if not opts.smollm2_gguf:
                print("   skipped: --smollm2-gguf not given", flush=True)
                continue
            base = smollm2(opts.smollm2_gguf, device)
        else:
            base = random_llama(name, opts.layers, device, opts.logit_std)
        policy, kept = fp8_policy(base)  # blockwise: the policy the after-sync stage trains (every recipe's engine
        # then syncs the same Parameters)
        if kept:
            print(f"   kept in BF16 for vLLM (and training): {len(kept)} linears, e.g. {kept[0]}", flush=True)
        policies = {"blockwise": policy}
        for recipe in opts.recipes:
            if recipe not in policies and {"calclip", "vllm"} & set(opts.mismatch_arms):
                policies[recipe], kept_r = fp8_policy(base, recipe)
                if kept_r:
                    print(f"   {recipe}: kept in BF16 for vLLM (and training): {len(kept_r)} linears", flush=True)
        model_dir = save_for_vllm(base, tempfile.mkdtemp(prefix=f"bench_vllm_{name}_"))
        vocab = base.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (opts.mismatch_prompts, opts.prompt_len), generator=gen)
        max_len = opts.prompt_len + opts.mismatch_tokens + 8
        engines: dict[str, object] = {}
        specs = [(recipe_label(MISMATCH_ARMS[key], recipe), dict(policy=policies[recipe], numerics=numerics))
                 for recipe in opts.recipes for key, numerics in (("calclip", "calclip"), ("vllm", "vllm"))
                 if key in opts.mismatch_arms]
        specs += [(MISMATCH_ARMS["bf16"], {})] if "bf16" in opts.mismatch_arms else []
        arm_policy = {arm: kwargs.get("policy", base) for arm, kwargs in specs}
        for arm, kwargs in specs:
            try:
                engines[arm] = make_llm(model_dir, opts, max_model_len=max_len, max_num_seqs=opts.mismatch_prompts,
                                        batches=[opts.mismatch_prompts], gpu_util=opts.gpu_util, **kwargs)
            except Exception as err:  # noqa: BLE001
                print(f"   !! engine {arm}: {_short(err)}", flush=True)
                results.append({"model": name, "arm": arm, "error": _short(err)})
        samples = {}
        for stage in ("initial", f"after {opts.steps} steps + sync"):
            sync_ms: dict[str, float] = {}
            if stage != "initial":
                # the FP8 engine's samples (with --mismatch-arms bf16 alone: the BF16 engine's)
                first = recipe_label("FP8 calclip", opts.recipes[0])
                fp8_tokens = samples.get(first, next(iter(samples.values()), None))
                if fp8_tokens is None:
                    break
                losses = train_steps(policy, prompts, fp8_tokens, opts.steps, opts.lr)
                print(f"   {opts.steps} AdamW steps (lr {opts.lr}) on the FP8 policy: NLL {losses[0]:.3f} -> "
                      f"{losses[-1]:.3f}", flush=True)
                from calclip.rollout.vllm_sync import sync_fp8_weights

                for arm, llm in engines.items():
                    sync = (lambda llm=llm: sync_bf16(llm, base)) if arm == "BF16" else (
                        lambda llm=llm, arm=arm: sync_fp8_weights(llm, arm_policy[arm]))
                    sync_ms[arm] = timed_ms(sync)
            for arm, llm in engines.items():
                fp8 = arm != "BF16"
                reference = arm_policy[arm]
                codes = "-"
                if fp8:
                    bad = engine_fp8_mismatches(vllm_engine_model(llm)[0], reference)
                    codes = "yes" if not bad else f"NO ({len(bad)}: {bad[0]})"
                tokens, engine_lp = rollout(llm, prompts, opts.mismatch_tokens, seed=len(samples))
                samples[arm] = tokens
                stats = mismatch_stats(engine_lp, trainer_logprobs(reference, prompts, tokens))
                floor = {}
                if not arm.startswith("FP8 vLLM-default"):
                    with attention(reference, "eager"):
                        eager_lp = trainer_logprobs(reference, prompts, tokens)
                    floor = mismatch_stats(eager_lp, trainer_logprobs(reference, prompts, tokens))
                try:
                    diag = mismatch_diagnostics(llm, reference, prompts, tokens, engine_lp, base=base)
                except Exception as err:  # noqa: BLE001 — the row stands without its diagnostics
                    diag = {"error": _short(err)}
                    print(f"   !! diagnostics {arm}: {diag['error']}", flush=True)
                degenerate = is_degenerate(diag)
                if degenerate:
                    print(f"   !! {arm} {stage}: degenerate row (the policy puts ~all its mass on its own samples: "
                          f"mean completion log-prob {diag['mean_logp']['trainer_completion']:.3f}); lower --lr",
                          flush=True)
                row = {"model": name, "stage": stage, "arm": arm, "model_impl": opts.model_impl, **stats,
                       "degenerate": degenerate,
                       "floor_tmpe": floor.get("tmpe"),
                       "floor_max_abs": floor.get("max_abs"), "engine_holds_trainer_codes": codes,
                       "sync_ms": sync_ms.get(arm), "diag": diag}
                results.append(row)
                diag_rows.append(diagnostic_row(name, stage, arm, diag))
                print("diag: | " + " | ".join(diag_rows[-1]) + " |", flush=True)
                rows.append([name, stage + (" (degenerate)" if degenerate else ""), arm, fmt(stats["tmpe"], 4),
                             fmt(stats["max_abs"]), fmt(stats["over_1p1"]),
                             fmt(floor.get("tmpe"), 4), codes[:40], fmt(sync_ms.get(arm), 0)])
                print("row: | " + " | ".join(rows[-1]) + " |", flush=True)
            add_control_differences(RESULTS)
            save_results(opts)
        for llm in list(engines.values()):
            shutdown(llm)
        engines.clear()
        del base, policy, policies, arm_policy
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"   {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n### mismatch: token-mult-prob-error, engine rollout log-probs vs the trainer's forward on the same "
          f"tokens ({opts.mismatch_prompts} prompts x {opts.prompt_len} random tokens, {opts.mismatch_tokens} "
          f"sampled tokens, temperature 1)")
    _common.table(["model", "stage", "engine", "tmpe", "max |d|", "share exp|d|>1.1", "floor tmpe",
                   "engine holds trainer codes", "sync ms"], rows)
    print("FP8 engines are compared with calclip's FP8 forward (same codes), BF16 with the HF BF16 forward. floor: "
          "the trainer model with eager vs SDPA attention on the same tokens (BF16-level noise through the model). "
          "Target (docs/vllm.md): FP8 calclip tmpe minus BF16 tmpe <= 0.01.", flush=True)
    for r in results:
        if r.get("minus_bf16_control") is not None:
            print(f"   {r['model']} {r['stage']} {r['arm']}: minus BF16 control = {r['minus_bf16_control']:+.4f}")
    print("\n### mismatch diagnostics: the engine's teacher-forced prompt log-probs (prompt_logprobs=0 on prompt + "
          "completion) against its rollout log-probs (align) and against the trainer's forward on the same ids "
          "(prompt / completion positions), greedy first-token agreement, mean log-prob per side")
    _common.table(DIAGNOSTIC_COLUMNS, diag_rows)
    print("Read: align ~1 and TF tmpe ~ floor: the engine serves the trainer's model and the comparison is right. "
          "align ~1 but TF prompt tmpe huge and top-1 agree ~0: engine and trainer compute different functions "
          "(weights / config / engine state), sampling not involved. align far from 1: the rollout's tokens and "
          "log-probs are not lined up (extraction).", flush=True)


DIAGNOSTIC_COLUMNS = ["model", "stage", "engine", "runner", "prompt ids echoed", "align tmpe", "align max |d|",
                      "TF prompt tmpe", "TF prompt mean |d|", "TF completion tmpe", "greedy top-1 agree",
                      "mean logp engine/trainer (completion)", "mean logp engine/trainer (prompt)"]


def diagnostic_row(model: str, stage: str, arm: str, diag: dict) -> list[str]:
    """One row of the diagnostics table (``DIAGNOSTIC_COLUMNS``) from ``mismatch_diagnostics``' dict."""
    if "error" in diag:
        return [model, stage, arm, diag["error"][:60], *["-"] * (len(DIAGNOSTIC_COLUMNS) - 4)]
    m = diag["mean_logp"]
    runner = diag.get("runner", "?")
    runner = "V2" if ".worker.gpu." in runner else "V1" if "gpu_model_runner" in runner else runner[-30:]
    return [model, stage, arm, runner, fmt(diag.get("prompt_ids_echoed"), 2), fmt(diag["align"]["tmpe"], 4),
            fmt(diag["align"]["max_abs"]), fmt(diag["tf_prompt"]["tmpe"], 4), fmt(diag["tf_prompt"]["mean_abs"]),
            fmt(diag["tf_completion"]["tmpe"], 4), fmt(diag.get("greedy_top1_agree"), 3),
            f"{m['engine_tf_completion']:.2f} / {m['trainer_completion']:.2f}",
            f"{m['engine_tf_prompt']:.2f} / {m['trainer_prompt']:.2f}"]


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


# ---------------------------------------------------------------------------------------------------------------
# part decode (vLLM) and hf_decode (transformers generate)


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
    rows, results = [], RESULTS.setdefault("decode", [])
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
    print(f"\n### decode: vLLM generate tokens/s, Llama-3-8B dims, dummy weights, prompt {opts.prompt_len}, ignore_eos, "
          f"temperature 1, CUDA graphs (median [min-max] of {opts.repeats} rounds; one engine alive at a time, engines "
          f"one after another, so ratios pair round i of each engine, not interleaved rounds)")
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
    splits, tops, results = {}, {}, RESULTS.setdefault("decode_profile", {})
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
    rows, results = [], RESULTS.setdefault("hf_decode", [])
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


# ---------------------------------------------------------------------------------------------------------------
# part grpo: one process per arm (each owns a colocated engine)


def check_grpo_profiles(opts) -> None:
    """--grpo-profile-rollout and --grpo-profile-host may not name the same rollout (each profiler slows the
    other's measurement)."""
    profile_at, host_at = getattr(opts, "grpo_profile_rollout", 0), getattr(opts, "grpo_profile_host", 0)
    if profile_at and profile_at == host_at:
        raise ValueError(f"--grpo-profile-rollout {profile_at} and --grpo-profile-host {host_at}: profile different "
                         f"rollouts (each profiler slows the other's)")


def grpo_worker(arm: str, opts, *, device: str = "cuda", dims: tuple[int, int, int, int] = (4096, 14336, 32, 8),
                progress: Callable[[dict], None] | None = None) -> dict:
    """Runs in its own process: CalibratedGRPOTrainer with vLLM colocate rollouts; returns per-step timings, and
    ``startup_s`` (process start to the trainer built: model, FP8 conversion, the engine's start).
    dims: hidden, intermediate, heads, KV heads (Llama-3-8B's by default; tests/test_bench_vllm.py runs it on CPU
    with a tiny model and a recorded engine). progress: called with the timings after every step (the worker
    writes them out, so a run stopped by --grpo-timeout still reports the steps it finished)."""
    from transformers import TrainerCallback

    check_grpo_profiles(opts)
    from calclip.models.tiny import build_tiny_tokenizer
    from calclip.trainers import CalibratedGRPOConfig, CalibratedGRPOTrainer
    from tests.fixtures import digit_share_reward, tiny_prompt_dataset

    device = torch.device(device)
    tokenizer = build_tiny_tokenizer()
    # Llama-3-8B layer dims; the vocabulary is the test tokenizer's (TRL decodes completions with it).
    MODEL_SPECS["grpo"] = (*dims, len(tokenizer), opts.grpo_layers)
    base = random_llama("grpo", opts.grpo_layers, device, opts.logit_std)
    base.config.pad_token_id, base.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    base.config.bos_token_id = tokenizer.bos_token_id
    # One directory per arm and model, the same in every round and run (the weights are seeded): vLLM's compile cache
    # is keyed on the model's path and config, so a fresh temporary directory per worker made every engine start
    # compile cold, which a user's second run with the same model does not.
    model_dir = Path(tempfile.gettempdir()) / (f"bench_vllm_grpo_{arm}_{opts.grpo_layers}L_" + "x".join(map(str, dims))
                                               + f"_std{opts.logit_std:g}")
    model_dir.mkdir(exist_ok=True)
    model_dir = save_for_vllm(base, str(model_dir), tokenizer)
    base.config._name_or_path = model_dir  # TRL's colocated LLM(model=model.name_or_path)
    completions, micro = opts.grpo_completions, getattr(opts, "grpo_micro_batches", 1)
    if completions % micro or (completions // micro) % 8:
        raise ValueError(f"--grpo-micro-batches {micro}: --grpo-completions {completions} must split into that many "
                         f"micro-batches of whole groups of 8 generations")
    on_gpu = device.type == "cuda"
    args = CalibratedGRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to="none", bf16=on_gpu, use_cpu=not on_gpu, **grpo_arm_settings(arm),
        vllm_fp8_linear_backend=engine_linear_backend(getattr(opts, "linear_backend", "fastest"),
                                                      getattr(opts, "grpo_recipe", None) or "blockwise"),
        use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=opts.gpu_util, clip_mode="static",
        # --grpo-micro-batches: the same rollout of `completions` per optimizer step, trained in that many
        # micro-batches (one generation per step: steps_per_generation = gradient_accumulation_steps)
        per_device_train_batch_size=completions // micro, num_generations=8, gradient_accumulation_steps=micro,
        steps_per_generation=micro, max_completion_length=opts.grpo_tokens, max_steps=opts.grpo_steps,
        learning_rate=1e-5, logging_steps=1, save_strategy="no", seed=0, gradient_checkpointing=False,
        generation_kwargs={"min_tokens": opts.grpo_tokens},
        # --grpo-detokenize: the trainer's vllm_detokenize (auto: its default, off; on: vLLM's per-step
        # detokenization, which TRL never reads, as before 2026-12-05)
        vllm_detokenize={"auto": None, "on": True, "off": False}[getattr(opts, "grpo_detokenize", "auto")],
        check_dataset=False,
        fp8_recipe=getattr(opts, "grpo_recipe", None) or "blockwise",
        vllm_kv_cache_dtype=getattr(opts, "kv_cache_dtype", "auto"),
        vllm_async_scheduling=getattr(opts, "async_scheduling", None),
        vllm_max_cudagraph_capture_size=getattr(opts, "grpo_capture_size", None))
    timings = {"step_s": [], "generate_s": [], "sync_s": [], "gc_ms": [], "gc_collections": [], "rollout_cpu_s": [],
               "load1": [], "steal": [], "deep_gemm_new": [], "allocator": [], "step_graphs": [], "step_gc_ms": []}
    gc_clock, step_gc = GcClock(), GcClock()

    class StepClock(TrainerCallback):
        """Each optimizer step's wall time, and what may make one step slower than its neighbours: the graphs Dynamo
        compiled in it (a new sequence length under bucketed layers, a guard that failed) and the collector's pauses
        in it (every generation; the rollout's own are ``gc_ms``)."""

        def on_step_begin(self, *a, **k):
            cuda_sync()
            self.graphs = dynamo_graphs()
            step_gc.__enter__()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            cuda_sync()
            timings["step_s"].append(time.perf_counter() - self.start)
            step_gc.__exit__(None, None, None)
            timings["step_graphs"].append(dynamo_graphs() - self.graphs)
            timings["step_gc_ms"].append(step_gc.pause_ms)
            if progress is not None:
                progress(timings)

    # TRL builds LLM(...) with its own arguments; the attention backend is added to them in both arms (the GPU
    # bundle was checked with Triton attention; vLLM 0.24 has no environment variable for it).
    import trl.generation.vllm_generation as trl_vllm_generation

    from calclip.rollout.vllm_sync import merged_call_kwargs

    backend = {"attention_backend": opts.attention_backend} if opts.attention_backend else {}
    with merged_call_kwargs(trl_vllm_generation, "LLM", backend):
        trainer = CalibratedGRPOTrainer(model=base, reward_funcs=digit_share_reward, args=args,
                                        train_dataset=tiny_prompt_dataset(completions // 8 * opts.grpo_steps),
                                        processing_class=tokenizer, callbacks=[StepClock()])
    timings["startup_s"] = time.perf_counter() - PROCESS_START
    generation = trainer.vllm_generation
    profile_at, host_at = getattr(opts, "grpo_profile_rollout", 0), getattr(opts, "grpo_profile_host", 0)  # 1-based
    for method, key in (("sync_weights", "sync_s"), ("generate", "generate_s")):
        original = getattr(generation, method)

        def timed(*a, _original=original, _key=key, **k):
            # which profiler this call runs under: only a rollout (never a sync) whose 1-based number was asked
            rollout = len(timings["generate_s"]) + 1 if _key == "generate_s" else None
            kind = "rollout_profile" if rollout == profile_at else "host_profile" if rollout == host_at else None
            profiler = {"rollout_profile": kernel_profiler, "host_profile": cProfile.Profile}.get(
                kind, contextlib.nullcontext)()
            cuda_sync()
            # the probes' own readings (a file, a walk of DeepGEMM's cache) before the clocks start
            ticks, jit_files = host_cpu_ticks(), deep_gemm_cache_files() if _key == "generate_s" else None
            allocated = allocator_events()
            start, cpu_start = time.perf_counter(), time.process_time()
            with profiler, (gc_clock if _key == "generate_s" else contextlib.nullcontext()):
                out = _original(*a, **k)
                cuda_sync()
            timings[_key].append(time.perf_counter() - start)
            if _key == "generate_s":
                timings["gc_ms"].append(gc_clock.pause_ms)
                timings["gc_collections"].append(list(gc_clock.collections))
                # the rollout's CPU time (every thread of this process: the engine runs in it), the machine's
                # 1-minute load average and the CPU time the hypervisor stole during it: a host-bound decode slowed
                # by other work on a shared host shows in one of them
                timings["rollout_cpu_s"].append(time.process_time() - cpu_start)
                timings["load1"].append(os.getloadavg()[0])
                timings["steal"].append(steal_share(ticks, host_cpu_ticks()))
                # files DeepGEMM's JIT cache gained during the rollout: kernels compiled inside it (None: no cache)
                after = deep_gemm_cache_files()
                timings["deep_gemm_new"].append(None if after is None else after - (jit_files or 0))
                timings["allocator"].append(allocator_delta(allocated, allocator_events()))
            if kind is not None:
                summarize = rollout_profile if kind == "rollout_profile" else host_profile
                timings[kind] = summarize(profiler, timings[_key][-1], step=rollout - 1)
                if kind == "host_profile" and os.environ.get("OUT"):  # the whole profile, for pstats' callers view
                    profiler.dump_stats(os.path.join(os.environ["OUT"], f"host_{arm}.pstats"))
            return out

        setattr(generation, method, timed)
    trainer.train()
    timings["async_scheduling"] = engine_async_scheduling(generation.llm)
    # the training part's compilation (compile_layers; its auto rule left torchao's recipes eager until f95dd4b)
    timings["layers_compiled"] = getattr(trainer, "_layers_compiled", None)
    direct = getattr(generation, "_direct_sync", None)  # FP8: whether the syncs after the first were in place
    timings["direct_sync"] = None if direct is None else {"verified": direct.verified, "reason": direct.reason}
    if args.fp8:  # one more sync (the last step's update), then the engine against the reference quantizer
        from calclip.rollout.vllm_sync import engine_fp8_mismatches, vllm_engine_model

        type(generation).sync_weights(generation)  # not the timed wrapper: the steps' syncs are what was timed
        timings["engine_mismatches"] = engine_fp8_mismatches(vllm_engine_model(generation.llm)[0], trainer.model)
    return timings


def dynamo_graphs() -> int:
    """Frames Dynamo has compiled in this process so far (its ``frames.ok`` counter)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["frames"]["ok"])


def engine_async_scheduling(llm) -> bool | None:
    """Whether the engine resolved vLLM's async_scheduling on (the host schedules step N+1 while the GPU runs step
    N): what the trainer's ``vllm_async_scheduling: null`` left to vLLM. None: an engine without that config."""
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "scheduler_config", None)
    value = getattr(config, "async_scheduling", None)
    return None if value is None else bool(value)


class GcClock:
    """The garbage collector's pauses inside a ``with`` block, from ``gc.callbacks``: ``pause_ms`` (the time
    between each collection's start and stop) and ``collections`` (how many of generation 0, 1, 2), reset on entry.
    A grpo worker wraps every rollout in it: the Python heap of a trainer process with an engine in it is large,
    and a rollout allocates per token."""

    def __init__(self):
        self.pause_ms, self.collections, self._start = 0.0, [0, 0, 0], None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pause_ms += (time.perf_counter() - self._start) * 1e3
            self.collections[info["generation"]] += 1
            self._start = None

    def __enter__(self):
        self.pause_ms, self.collections, self._start = 0.0, [0, 0, 0], None
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        return False


def rollout_profile(prof, wall_s: float, *, step: int) -> dict:
    """Where one profiled rollout's time went: its wall time, the GPU kernel time summed (over every stream: the
    share of the wall the GPU was busy, when kernels do not overlap), that time by ``DECODE_CATEGORIES``, the
    kernel launches, and the top kernels. ``step``: the 0-based step it belongs to (its timings are left out of the
    medians: the profiler slows it)."""
    times = _common.kernel_times(prof)
    split = decode_split(times, 1)  # the whole rollout as one "step"
    kernel_ms, wall_ms = split.pop("total"), wall_s * 1e3
    idle = _common.gpu_idle(prof.events())
    calls = _common.host_times(prof, ("cudaGraphLaunch", *_common.LAUNCH_CALLS))
    return {"step": step, "wall_ms": wall_ms, "kernel_ms": kernel_ms, "busy_share": kernel_ms / wall_ms,
            "launches": sum(n for _, n in times.values()), "split_ms": split, "top": top_kernels(times, 12),
            # the host side: CUDA-graph replays against kernels launched one by one (outside any graph), and where
            # the GPU idled, charged to the host code that launched the kernel after each gap
            "graph_launches": calls["cudaGraphLaunch"][1],
            "launch_calls": sum(calls[call][1] for call in _common.LAUNCH_CALLS),
            "idle_ms": idle["idle_us"] / 1e3,
            "idle_top": [(source, us / 1e3, n) for source, (us, n) in
                         sorted(idle["gaps"].items(), key=lambda kv: -kv[1][0])[:8]]}


def _function_label(key: tuple[str, int, str]) -> str:
    """A pstats key (file, line, function) as 'vllm/v1/core/sched/scheduler.py:240(schedule)': the path from its
    package root (after site-packages, or the last three parts), or '<built-in method ...>' as pstats names it."""
    file, line, name = key
    if file == "~":
        return name
    parts = Path(file).parts
    tail = parts[parts.index("site-packages") + 1:] if "site-packages" in parts else parts[-3:]
    return f"{'/'.join(tail)}:{line}({name})"


def host_profile(prof: cProfile.Profile, wall_s: float, *, step: int, n: int = 30) -> dict:
    """Where one rollout's host time went, from cProfile (``--grpo-profile-host``): its wall time under the
    profiler, and the ``n`` functions with the most cumulative and the most own time (label, own ms, cumulative
    ms, calls). A function waiting on the GPU (a synchronize, ``.tolist()`` of a CUDA tensor) holds that wait as
    its own time. ``step``: the 0-based step (left out of the medians: cProfile slows Python severalfold)."""
    rows = [(_function_label(key), own * 1e3, cumulative * 1e3, calls)
            for key, (_, calls, own, cumulative, _) in pstats.Stats(prof).stats.items()]
    return {"step": step, "wall_ms": wall_s * 1e3,
            "top_cumulative": sorted(rows, key=lambda r: -r[2])[:n], "top_own": sorted(rows, key=lambda r: -r[1])[:n]}


def worker_summary(run: dict, warmup: int) -> str:
    """One grpo worker's run in a line, printed as it ends (a call cut short by its time limit keeps it): its
    steps, the medians after ``warmup``, its first step and start-up, and its rollout profile's GPU share."""
    def median(key):
        values = run.get(key, [])[warmup:]
        return fmt(statistics.median(values)) if values else "-"

    steps = run.get("step_s", [])
    text = (f"{len(steps)} step(s); after the first {warmup}: step {median('step_s')} s, rollout "
            f"{median('generate_s')} s, sync {median('sync_s')} s; first step "
            f"{fmt(steps[0]) if steps else '-'} s, start-up {fmt(run.get('startup_s'))} s")
    if run.get("layers_compiled") is not None:
        text += f"; trainer layers {'compiled' if run['layers_compiled'] else 'eager'}"
    if run.get("async_scheduling") is not None:
        text += f"; engine async_scheduling {'on' if run['async_scheduling'] else 'off'}"
    if run.get("gc_ms"):  # GcClock: the collector's pauses inside each rollout
        last = run["gc_collections"][-1]
        text += (f"; GC pauses per rollout {median('gc_ms')} ms (the last rollout's collections of generations "
                 f"0/1/2: {last[0]}/{last[1]}/{last[2]})")
    if run.get("rollout_cpu_s") and run.get("generate_s"):  # older worker files have no such lists
        shares = [c / g for c, g in zip(run["rollout_cpu_s"][warmup:], run["generate_s"][warmup:]) if g > 0]
        if shares:
            # CUDA's synchronizations spin by default, so a process waiting on the GPU burns CPU too: ~100% says only
            # that the rollout was never descheduled, not that it was host-bound
            text += (f"; rollout CPU time {100 * statistics.median(shares):.0f}% of its wall (spin-waits included), "
                     f"host load average {median('load1')}")
    stolen = [v for v in run.get("steal", [])[warmup:] if v is not None]
    if stolen:
        text += f", CPU stolen by the hypervisor {100 * statistics.median(stolen):.1f}% (max {100 * max(stolen):.1f}%)"
    if run.get("step_graphs"):  # every step, the first ones included: where the compiles went
        text += (f"; Dynamo graphs compiled per step {run['step_graphs']}, GC pauses per step (rollout included) "
                 f"{[round(v) for v in run['step_gc_ms']]} ms")
    compiled = [v for v in run.get("deep_gemm_new", [])[warmup:] if v is not None]
    if any(compiled):
        text += (f"; DeepGEMM's JIT cache grew by {sum(compiled)} file(s) during {sum(v > 0 for v in compiled)} of the "
                 f"{len(compiled)} timed rollouts (kernels compiled inside them: their times include the compiles)")
    allocated = [v for v in run.get("allocator", [])[warmup:] if v is not None]
    if allocated:  # medians per timed rollout; all zero when the engine's allocations stayed in PyTorch's cache
        events = {key: statistics.median(v[key] for v in allocated) for key in ALLOCATOR_EVENTS}
        text += (f"; CUDA allocator per rollout {events['num_device_alloc']:g} cudaMalloc / "
                 f"{events['num_device_free']:g} cudaFree, {events['num_alloc_retries']:g} retries, "
                 f"{events['num_sync_all_streams']:g} device syncs (medians)")
    profile = run.get("rollout_profile")
    if profile:
        text += (f"; profiled rollout (step {profile['step'] + 1}): GPU kernels {fmt(profile['kernel_ms'], 1)} of "
                 f"{fmt(profile['wall_ms'], 1)} ms ({100 * profile['busy_share']:.0f}% busy)")
    host = run.get("host_profile")
    if host and host["top_own"]:
        label, own, _, _ = host["top_own"][0]
        text += (f"; host-profiled rollout (step {host['step'] + 1}): {fmt(host['wall_ms'], 1)} ms, most own time "
                 f"in {label} ({fmt(own, 1)} ms)")
    return text


# a grpo worker's lists with one entry per step (each step runs one rollout and one sync)
PER_ROLLOUT_KEYS = ("step_s", "generate_s", "sync_s", "gc_ms", "gc_collections", "rollout_cpu_s", "load1",
                    "steal", "deep_gemm_new", "allocator", "step_graphs", "step_gc_ms")


def without_profiled_step(run: dict) -> dict:
    """A worker's timings with its profiled steps (``rollout_profile["step"]``, ``host_profile["step"]``) left out
    of every per-step list."""
    steps = {run[key]["step"] for key in ("rollout_profile", "host_profile") if key in run}
    if not steps:
        return run
    return {**run, **{key: [v for i, v in enumerate(run[key]) if i not in steps]
                      for key in PER_ROLLOUT_KEYS if key in run}}


GRPO_ARMS = ("fp8", "fp8_reload", "bf16", "bf16_eager", "fp8_gcon", "bf16_gcon", "fp8_dynamic", "bf16_bucketed")
# the BF16 configurations an FP8 arm's ratio is taken against (the fastest of those measured in the run): BF16 compiled
# by layer (the trainer's compile_layers default, "bf16"), the same on bucketed static graphs ("bf16_bucketed", as
# torchao's recipes are compiled) and eager ("bf16_eager"), all with the collector paused
# Within one arm every timed step's rollout is the same work (same prompts, lengths forced by min_tokens): a spread
# wider than this means the machine changed speed mid-run (seen on a shared H100: one BF16 arm's rollouts went from
# 1.10 to 1.64-1.67 s), and the part prints a warning instead of letting the ratio pass for a measurement.
ROLLOUT_DRIFT = 1.25
# The hypervisor's steal, as a share of every CPU's time, during an arm's timed rollouts (median over them): at or above
# this the rollout, host-bound at 8 layers, ran on a contended host even when it ran steadily slow (no drift to see).
# Seen on a shared H100 (2026-12-07): an FP8 arm's rollouts ran steadily at 2.05 s (median; spread under
# ROLLOUT_DRIFT, so no warning) at 0.8% steal, where two runs of the same arm took 1.09-1.19 s at 0.0% minutes later.
STEAL_WARN = 0.003
GRPO_BF16_BASELINES = ("bf16", "bf16_eager", "bf16_bucketed")


def round_ratios(base_runs: list[dict], arm_runs: list[dict], warmup: int) -> list[float | None]:
    """Round by round (run i of each arm, run back to back), the baseline's step median over the arm's: the ratio
    a round measured on the host as it was then, each run's steps taken as the pooled medians take them
    (``pooled_after``). None where either run failed or has no step."""
    def median_step(run):
        steps = pooled_after([without_profiled_step(run)], "step_s", warmup) if "error" not in run else []
        return statistics.median(steps) if steps else None

    pairs = [(median_step(b), median_step(a)) for b, a in zip(base_runs, arm_runs)]
    return [b / a if b and a else None for b, a in pairs]


# The options that make two grpo calls' runs the same work (the steps and rounds may differ: each run's steps after
# --grpo-warmup are pooled); --grpo-earlier refuses a file whose run differs in any of them.
GRPO_WORKLOAD = ("grpo_layers", "grpo_completions", "grpo_tokens", "grpo_micro_batches", "grpo_warmup", "logit_std",
                 "gpu_util", "attention_backend", "linear_backend", "kv_cache_dtype", "async_scheduling",
                 "grpo_detokenize", "grpo_capture_size")


def drop_options(argv: list[str], *options: str) -> list[str]:
    """``argv`` without ``options`` and their values (``--opt value`` or ``--opt=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{option}=" for option in options)):
            out.append(arg)
    return out


def earlier_grpo_runs(opts, device: str | None) -> dict[str, list[dict]]:
    """--grpo-earlier: per arm label, the runs of earlier calls (each file an earlier call's $OUT/bench_vllm.json), in
    the files' order, to pool with this call's. A device call lasts at most 10 minutes, about one round of three arms
    at 8 layers; calls that each run every arm once, in one order, pool into rounds that the round-by-round ratios
    pair as one run would. Refused, naming the file and the option: a file without grpo runs, a file whose workload
    (``GRPO_WORKLOAD``) differs from this call's, and files from another device than this call's (or, with
    --grpo-rounds 0 and no GPU here, than the first file's): timings compare only on one kind of device."""
    runs: dict[str, list[dict]] = {}
    for path in opts.grpo_earlier:
        saved = json.loads(Path(path).read_text())
        grpo, argv = saved.get("grpo"), saved.get("argv")
        if not isinstance(grpo, dict) or argv is None:
            raise ValueError(f"--grpo-earlier {path}: no grpo runs with their command line (a parent's "
                             f"bench_vllm.json from --parts grpo)")
        # its own --grpo-earlier files (pooled into its summary, not into its saved runs) need not exist here
        then = parse_args(drop_options(argv, "--grpo-earlier"))
        for name in GRPO_WORKLOAD:
            if getattr(then, name) != getattr(opts, name):
                raise ValueError(f"--grpo-earlier {path}: --{name.replace('_', '-')} was {getattr(then, name)!r}, "
                                 f"this call's is {getattr(opts, name)!r}: not the same work")
        found = {label: result["runs"] for label, result in grpo.items()
                 if isinstance(result, dict) and isinstance(result.get("runs"), list) and result["runs"]}
        if not found:
            continue  # a summary of other files (--grpo-rounds 0) ran nothing of its own
        ran_on = saved.get("env", {}).get("device")
        if device is None:
            device = ran_on
        elif ran_on != device:
            raise ValueError(f"--grpo-earlier {path}: ran on {ran_on!r}, not {device!r}: compare timings on one kind "
                             f"of device")
        for label, label_runs in found.items():
            runs.setdefault(label, []).extend(label_runs)
    return runs


def grpo_arm_settings(arm: str) -> dict:
    """The CalibratedGRPOConfig fields that make ``arm`` what its name says: FP8 or BF16, the FP8 sync in place or
    through vLLM's reload (``fp8_reload``), the collector paused during rollouts or on (``*_gcon``), the policy's
    layers compiled (the default: compile_layers auto, on for BF16 and FP8 on CUDA) or eager (``bf16_eager``), their
    shapes the recipe's choice (compile_layers_shapes auto: bucketed for torchao's recipes, dynamic for blockwise and
    BF16), symbolic (``fp8_dynamic``: what a torchao recipe's bucketed layers bought) or bucketed for BF16 too
    (``bf16_bucketed``: a baseline compiled as the torchao arm is; the fastest BF16 arm run is the ratio's base)."""
    if arm not in GRPO_ARMS:
        raise ValueError(f"grpo arm {arm!r}: choose from {GRPO_ARMS}")
    return {"fp8": arm.startswith("fp8"), "vllm_fp8_direct_sync": arm != "fp8_reload",
            "vllm_pause_gc": not arm.endswith("_gcon"), "compile_layers": False if arm == "bf16_eager" else None,
            "compile_layers_shapes": {"fp8_dynamic": "dynamic", "bf16_bucketed": "bucketed"}.get(arm)}


def part_grpo(opts) -> None:
    """Each arm in its own process (one engine per process, as TRL's colocate mode), the arm list run
    ``--grpo-rounds`` times in turn (A B A B), every arm's steps after its ``--grpo-warmup`` first ones pooled over the
    rounds (FP8's second step still autotunes the backward's kernels)."""
    results = RESULTS.setdefault("grpo", {})
    # (label, arm, recipe): every FP8 arm once per --recipes entry, labelled fp8, fp8_rowwise, fp8_reload_tensorwise...
    labelled = [(recipe_label(arm, recipe, "_"), arm, recipe) for arm in opts.grpo_arms
                for recipe in (opts.recipes if arm.startswith("fp8") else ["blockwise"])]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in labelled}
    for round_index in range(opts.grpo_rounds):
        for label, arm, recipe in labelled:
            out = Path(tempfile.mkdtemp()) / f"grpo_{label}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--grpo-worker", arm, "--grpo-json", str(out),
                   "--grpo-layers", str(opts.grpo_layers), "--grpo-steps", str(opts.grpo_steps),
                   "--grpo-tokens", str(opts.grpo_tokens), "--grpo-completions", str(opts.grpo_completions),
                   "--grpo-micro-batches", str(opts.grpo_micro_batches),
                   "--grpo-profile-rollout", str(opts.grpo_profile_rollout),
                   "--grpo-profile-host", str(opts.grpo_profile_host),
                   "--gpu-util", str(opts.gpu_util), "--logit-std", str(opts.logit_std),
                   "--attention-backend", opts.attention_backend, "--linear-backend", opts.linear_backend]
            if recipe != "blockwise":
                cmd += ["--grpo-recipe", recipe]
            if opts.kv_cache_dtype != "auto":
                cmd += ["--kv-cache-dtype", opts.kv_cache_dtype]
            if opts.async_scheduling is not None:
                cmd += ["--async-scheduling", "on" if opts.async_scheduling else "off"]
            if opts.grpo_detokenize != "auto":
                cmd += ["--grpo-detokenize", opts.grpo_detokenize]
            if opts.grpo_capture_size is not None:
                cmd += ["--grpo-capture-size", str(opts.grpo_capture_size)]
            print(f"-- grpo {label}, round {round_index + 1}/{opts.grpo_rounds}: {' '.join(cmd[2:])}", flush=True)
            start = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.grpo_timeout)
            except subprocess.TimeoutExpired as err:  # keep the worker's output: where did its time go?
                said = "".join(b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                               for b in (err.stdout, err.stderr))[-3000:]
                print(f"   !! grpo {label} timed out after {opts.grpo_timeout} s (--grpo-timeout); last output:\n"
                      f"{said}", flush=True)
                finished = json.loads(out.read_text()) if out.exists() else {}
                if len(finished.get("step_s", ())) > opts.grpo_warmup:  # the steps it finished still count
                    print(f"   {len(finished['step_s'])} step(s) finished before the timeout count", flush=True)
                    run = {**finished, "timed_out_after_s": opts.grpo_timeout}
                else:
                    run = {"error": f"timed out after {opts.grpo_timeout} s: {said[-400:]}"}
            else:
                print(f"   exit {proc.returncode} after {time.perf_counter() - start:.0f} s", flush=True)
                if proc.returncode != 0 or not out.exists():
                    tail = (proc.stdout + proc.stderr)[-3000:]
                    print(f"   !! grpo {label} failed; last output:\n{tail}", flush=True)
                    run = {"error": tail[-500:]}
                else:
                    run = json.loads(out.read_text())
            runs[label].append(run)
            if "error" not in run:
                print(f"   {worker_summary(without_profiled_step(run), opts.grpo_warmup)}", flush=True)
            results.setdefault("workers", {})[label] = runs[label]  # kept if the whole call is cut short
            save_results(opts)
    results.pop("workers", None)
    # the summary's runs: this call's, after those of --grpo-earlier's calls; results keep this call's own runs only,
    # so that a later call's --grpo-earlier reads each run once
    pooled = runs
    if opts.grpo_earlier:
        device = torch.cuda.get_device_name() if opts.grpo_rounds and torch.cuda.is_available() else None
        earlier = earlier_grpo_runs(opts, device)
        pooled = {label: earlier.get(label, []) + label_runs for label, label_runs in runs.items()}
        results["earlier_calls"] = list(opts.grpo_earlier)
        print(f"   pooled with {len(opts.grpo_earlier)} earlier call(s): "
              + ", ".join(f"{label} {len(earlier.get(label, []))} run(s)" for label in runs), flush=True)
    rows, drifted = [], {}  # drifted: arm -> its warning
    for arm, arm_runs in pooled.items():
        ok = [without_profiled_step(r) for r in arm_runs if "error" not in r]
        if not ok:
            results[arm] = {"error": arm_runs[-1]["error"] if arm_runs else "not run", "runs": runs[arm]}
            continue
        step, gen, sync = (pooled_after(ok, key, opts.grpo_warmup) for key in ("step_s", "generate_s", "sync_s"))
        step_median, gen_median, sync_median = (statistics.median(v) for v in (step, gen, sync))
        if max(gen) > ROLLOUT_DRIFT * min(gen):  # the same rollout, timed again: the host changed speed
            drifted[arm] = (f"   !! {arm}: its timed rollouts took {min(gen):.3f}-{max(gen):.3f} s "
                            f"(x{max(gen) / min(gen):.2f}): the machine's speed changed within the arm, so this run's "
                            f"ratios do not measure FP8; rerun before quoting them")
        stolen = [v for r in ok for v in r.get("steal", [])[opts.grpo_warmup:] if v is not None]
        if stolen and statistics.median(stolen) >= STEAL_WARN:  # steady contention: slow but not drifting
            drifted.setdefault(arm, f"   !! {arm}: the hypervisor took {100 * statistics.median(stolen):.1f}% of the "
                                    f"host's CPU time during its timed rollouts (median; warned from "
                                    f"{100 * STEAL_WARN:.1f}%): it ran on a contended host, so this run's ratios do "
                                    f"not measure FP8; rerun before quoting them")
        # the rest of each step: log-probs, loss, backward, optimizer (one rollout and one sync per step)
        train = [t - g - y for t, g, y in zip(step, gen, sync)] if len(step) == len(gen) == len(sync) else []
        train_median = statistics.median(train) if train else None
        startup = [r["startup_s"] for r in ok if "startup_s" in r]
        results[arm] = {"runs": runs[arm], "timed_steps": len(step), "step_median_s": step_median,
                        "train_median_s": train_median,
                        "startup_median_s": statistics.median(startup) if startup else None,
                        "step_range_s": [min(step), max(step)], "generate_median_s": gen_median,
                        "sync_median_s": sync_median, "sync_share": sync_median / step_median}
        directs = [r.get("direct_sync") for r in ok]
        paths = {"-" if d is None else "in place" if d["verified"] else f"reload ({d['reason'] or 'off'})"
                 for d in directs}
        # after the run: does the engine hold the reference quantizer's codes of the trained policy?
        checked = [r["engine_mismatches"] for r in ok if "engine_mismatches" in r]
        if checked:
            differ = next((bad for bad in checked if bad), None)
            paths = {f"{p}, {'codes = reference' if differ is None else 'CODES DIFFER: ' + str(differ[:1])}"
                     for p in paths}
        rows.append([arm, f"{fmt(step_median)} [{fmt(min(step))}-{fmt(max(step))}]", fmt(gen_median),
                     fmt(train_median), fmt(sync_median * 1e3, 0), f"{100 * sync_median / step_median:.1f}%",
                     ", ".join(sorted(paths))[:60],
                     str(len(step)), fmt(statistics.median(startup)) if startup else "-"])
        save_results(opts)
    # the baseline: the fastest BF16 configuration measured in this run (by step median), never a slower one
    measured = [b for b in GRPO_BF16_BASELINES if "step_median_s" in results.get(b, {})]
    baseline = min(measured, key=lambda b: results[b]["step_median_s"]) if measured else None
    results["bf16_baseline"] = baseline
    results["rollout_drift"] = list(drifted)
    per_round = []
    for recipe in opts.recipes:
        label = recipe_label("fp8", recipe, "_")
        if "step_median_s" in results.get(label, {}) and baseline is not None:
            bf16, fp8, key = results[baseline], results[label], recipe_label("bf16_over_fp8", recipe, "_")
            ratios = {part: bf16[f"{part}_median_s"] / fp8[f"{part}_median_s"] if bf16.get(f"{part}_median_s")
                      and fp8.get(f"{part}_median_s") else None for part in ("step", "generate", "train")}
            results[key + "_step"] = ratios["step"]
            results[key + "_rollout"], results[key + "_train"] = ratios["generate"], ratios["train"]
            rows.append([recipe_label(f"{baseline} (fastest BF16) / FP8", recipe),
                         *(f"{r:.2f}x" if r else "-" for r in ratios.values()), "", "", "", "", ""])
            by_round = round_ratios(pooled[baseline], pooled[label], opts.grpo_warmup)
            results[key + "_step_by_round"] = by_round
            if len(by_round) > 1:  # how far the rounds agree: the pooled median hides a round the host slowed
                measured_rounds = [r for r in by_round if r is not None]
                per_round.append(f"   step ratio {baseline} / {label} round by round: "
                                 + ", ".join(f"{r:.2f}x" if r else "-" for r in by_round)
                                 + (f" (median {statistics.median(measured_rounds):.2f}x)" if measured_rounds else ""))
    save_results(opts)
    print(f"\n### grpo: CalibratedGRPOTrainer step, vLLM colocate rollouts, {opts.grpo_layers}L Llama-3-8B dims, "
          f"{opts.grpo_completions} completions x {opts.grpo_tokens} tokens per step, trained in "
          f"{opts.grpo_micro_batches} micro-batch(es) (median [min-max] of the steps after "
          f"the first {opts.grpo_warmup} of each run, {opts.grpo_rounds} round(s) of the arms in turn"
          + (f", pooled with {len(opts.grpo_earlier)} earlier call(s)" if opts.grpo_earlier else "") + ")")
    _common.table(["arm", "step s", "rollout s", "training s", "weight sync ms", "sync share of step", "FP8 sync path",
                   "steps timed", "startup s"], rows)
    for line in [*per_round, *drifted.values()]:
        print(line)
    print_rollout_profiles(runs)
    print_host_profiles(runs)


def print_rollout_profiles(runs: dict[str, list[dict]]) -> None:
    """--grpo-profile-rollout's table: each arm's profiled rollout (its first run's), ms by kernel category."""
    profiles = {arm: next((r["rollout_profile"] for r in arm_runs if "rollout_profile" in r), None)
                for arm, arm_runs in runs.items()}
    profiles = {arm: p for arm, p in profiles.items() if p is not None}
    if not profiles:
        return
    categories = [c for c, _ in DECODE_CATEGORIES] + ["other"]
    steps = ", ".join(str(p["step"] + 1) for p in profiles.values())
    print(f"\n### grpo rollout profile: each arm's profiled rollout (step {steps}), GPU kernel ms by category "
          "(profiler on: slower than the timed rollouts)")
    rows = [[c, *[fmt(p["split_ms"].get(c, 0.0), 1) for p in profiles.values()]] for c in categories]
    rows += [["GPU kernels, total", *[fmt(p["kernel_ms"], 1) for p in profiles.values()]],
             ["rollout wall", *[fmt(p["wall_ms"], 1) for p in profiles.values()]],
             ["GPU busy share of the wall", *[f"{100 * p['busy_share']:.0f}%" for p in profiles.values()]],
             ["kernel launches", *[str(p["launches"]) for p in profiles.values()]],
             # older worker files have no host side
             ["CUDA graph replays (cudaGraphLaunch)", *[str(p.get("graph_launches", "-")) for p in profiles.values()]],
             ["kernels launched outside graphs", *[str(p.get("launch_calls", "-")) for p in profiles.values()]],
             ["GPU idle between kernels", *[fmt(p.get("idle_ms"), 1) for p in profiles.values()]]]
    _common.table(["ms per rollout", *profiles], rows)
    for arm, profile in profiles.items():
        print(f"\n#### {arm}: top kernels of the profiled rollout (ms, launches)")
        _common.table(["kernel", "ms", "launches"], [[k[:90], fmt(ms, 2), str(n)] for k, ms, n in profile["top"]])
        if profile.get("idle_top"):
            print(f"\n#### {arm}: where its GPU idled (gaps >= 20 us, charged to the code that launched the next "
                  "kernel)")
            _common.table(["launched from", "idle ms", "gaps"],
                          [[source[:100], fmt(ms, 1), str(n)] for source, ms, n in profile["idle_top"]])


def print_host_profiles(runs: dict[str, list[dict]]) -> None:
    """--grpo-profile-host's tables: each arm's host-profiled rollout (its first run's), the Python functions with
    the most cumulative time and the most own time, as shares of that rollout's wall (under cProfile)."""
    for arm, arm_runs in runs.items():
        host = next((r["host_profile"] for r in arm_runs if "host_profile" in r), None)
        if host is None:
            continue
        wall = host["wall_ms"]
        for kind, key in (("cumulative", "top_cumulative"), ("own", "top_own")):
            print(f"\n#### {arm}: host profile of rollout {host['step'] + 1} (cProfile, {fmt(wall, 1)} ms wall under "
                  f"the profiler), by {kind} time")
            _common.table(["function", "own ms", "cumulative ms", f"{kind} share of wall", "calls"],
                          [[label[:100], fmt(own, 1), fmt(cum, 1),
                            f"{100 * (cum if kind == 'cumulative' else own) / wall:.1f}%" if wall else "-", str(calls)]
                           for label, own, cum, calls in host[key]])


# ---------------------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, of {PARTS}")
    parser.add_argument("--models", default="llama3_8b", help="mismatch part: llama3_8b,issue_probe,smollm2")
    parser.add_argument("--layers", type=int, default=4, help="mismatch: layers of llama3_8b (issue_probe: 2)")
    parser.add_argument("--smollm2-gguf", default=None, help="path of SmolLM2-135M-Instruct's .gguf file")
    parser.add_argument("--logit-std", type=float, default=4.0)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--mismatch-prompts", type=int, default=32)
    parser.add_argument("--mismatch-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1, help="mismatch: AdamW steps before the second measurement")
    parser.add_argument("--lr", type=float, default=1e-5,
                        help="mismatch: AdamW lr. 1e-4 collapsed the 4-layer llama3_8b policy onto its own samples "
                             "in one step on the H200 (completion log-probs ~0 on both sides, so the after-sync row "
                             "read a trivial 1.0; such rows are now flagged 'degenerate'); on CPU, issue_probe dims, "
                             "one step moved the mean log-prob of the policy's own samples -3.84 -> -1.25 at 1e-4, "
                             "-> -3.74 at 1e-5, and not measurably at 1e-6 (BF16 masters round small steps away)")
    parser.add_argument("--no-vllm-default-arm", dest="vllm_default_arm", action="store_false",
                        help="mismatch: leave out the FP8 engine with vLLM's default settings")
    parser.add_argument("--mismatch-arms", default=",".join(MISMATCH_ARMS),
                        help="mismatch: engines built in the process, of calclip,vllm,bf16 (e.g. 'bf16' alone: one "
                             "engine per process, as the product runs)")
    parser.add_argument("--batches", type=_ints, default=[64, 128, 256])
    parser.add_argument("--new-tokens", type=_ints, default=[128, 512], help="decode; hf_decode uses the first")
    parser.add_argument("--decode-layers", type=int, default=4)
    parser.add_argument("--linear-backend", default="fastest",
                        help="vLLM's GEMM for the FP8 engines of the mismatch and grpo parts (calclip settings): "
                             "fastest (the trainer's default: deep_gemm for blockwise where it runs, else cutlass), "
                             "cutlass, deep_gemm, triton")
    parser.add_argument("--decode-arms", default="fp8,bf16",
                        help=f"decode / decode_profile: engines, comma-separated, of {sorted(DECODE_ENGINES)}")
    parser.add_argument("--decode-vllm-default", action="store_true",
                        help="decode: add the FP8 engine with vLLM's default settings (the cost of calclip's)")
    parser.add_argument("--hf-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-util", type=float, default=0.25,
                        help="vLLM gpu_memory_utilization per engine (mismatch holds up to 3 at once; grpo: one)")
    parser.add_argument("--decode-gpu-util", type=float, default=None,
                        help="decode: per engine (default 0.4)")
    parser.add_argument("--attention-backend", default="TRITON_ATTN")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="engines without torch.compile and CUDA graphs (vLLM's enforce_eager): with --parts "
                             "mismatch, tells a graph or compile problem from a model one")
    parser.add_argument("--model-impl", default="auto", choices=("auto", "vllm", "transformers"),
                        help="vLLM's model_impl for the engines (TRL: vllm_model_impl). 'transformers' runs HF's "
                             "modeling code with vLLM's linears and attention; decode parts only: it patches the "
                             "transformers class in-process, which breaks the trainer-side model of mismatch and grpo")
    parser.add_argument("--grpo-layers", type=int, default=4)
    parser.add_argument("--grpo-steps", type=int, default=6)
    parser.add_argument("--grpo-warmup", type=int, default=2,
                        help="grpo: first steps of each run left out of the medians (FP8's second still autotunes)")
    parser.add_argument("--grpo-rounds", type=int, default=1, help="grpo: times the arm list runs, in turn (A B A B)")
    parser.add_argument("--grpo-earlier", default="",
                        help="grpo: earlier calls' $OUT/bench_vllm.json files, comma-separated, whose runs are pooled "
                             "with this call's (same workload and device, checked): rounds over several device calls. "
                             "With --grpo-rounds 0 nothing runs and the files alone are summarized (no GPU needed)")
    parser.add_argument("--grpo-tokens", type=int, default=128)
    parser.add_argument("--grpo-completions", type=int, default=64)
    parser.add_argument("--grpo-micro-batches", type=int, default=1,
                        help="grpo: micro-batches per optimizer step (gradient accumulation over one rollout of "
                             "--grpo-completions; 2 fits the 128 x 256 row's BF16 arm on an 80 GB H100)")
    parser.add_argument("--grpo-profile-rollout", type=int, default=0,
                        help="grpo: run each worker's K-th rollout (1-based) under torch.profiler and report where its "
                             "time went (GPU kernels by category, busy share of the wall, top kernels); that step is "
                             "left out of the medians. 0 (default): none")
    parser.add_argument("--grpo-profile-host", type=int, default=0,
                        help="grpo: run each worker's K-th rollout (1-based, not --grpo-profile-rollout's) under "
                             "cProfile and report the host's time by Python function (own and cumulative); that step "
                             "is left out of the medians. 0 (default): none")
    parser.add_argument("--grpo-detokenize", default="auto", choices=("auto", "on", "off"),
                        help="grpo: the trainer's vllm_detokenize, vLLM's detokenization of every sequence (and its "
                             "log-prob tokens) at every step, which TRL reads nothing of: auto (default) the trainer's "
                             "default (off); on: as TRL alone leaves it (the rows before 2026-12-05)")
    parser.add_argument("--grpo-capture-size", type=int, default=None,
                        help="grpo: the engines' vllm_max_cudagraph_capture_size (default: the trainer's, the rollout "
                             "batch; vLLM's own default is twice that, at most 512)")
    parser.add_argument("--grpo-timeout", type=int, default=600,
                        help="grpo: seconds each arm's worker may run (default 600). A cold FP8 worker on a fresh "
                             "machine compiles calclip's kernels, vLLM's graphs and DeepGEMM's GEMMs: on an H100 at "
                             "16 layers (2026-12-06) its engine loaded weights 217 s in, and the former default of "
                             "280 s ran out before its first step; a BF16 worker started in ~80 s")
    parser.add_argument("--grpo-arms", default="fp8,bf16",
                        help=f"grpo: arms, comma-separated, of {GRPO_ARMS} (fp8_reload: FP8 with vllm_fp8_direct_sync "
                             "off, every sync through vLLM's layerwise reload; *_gcon: vllm_pause_gc off, the "
                             "garbage collector running during rollouts as before 2026-12-05; bf16_eager: BF16 with "
                             "compile_layers off; fp8_dynamic / bf16_bucketed: compile_layers_shapes dynamic / "
                             "bucketed. FP8 arms' ratios are against the fastest of bf16 / bf16_eager / bf16_bucketed "
                             "run)")
    parser.add_argument("--recipes", default="blockwise",
                        help="mismatch, grpo: FP8 recipes, comma-separated, of blockwise,rowwise,tensorwise "
                             "(rowwise / tensorwise: torchao's, served per channel by vLLM's compressed-tensors path)")
    parser.add_argument("--grpo-worker", choices=GRPO_ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--grpo-recipe", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the engines' KV cache (the trainer's vllm_kv_cache_dtype): auto (off), fp8, fp8_e4m3, "
                             "fp8_e5m2; mismatch and decode: FP8 engines only (the BF16 engine stays the control); "
                             "grpo: every arm")
    parser.add_argument("--async-scheduling", default="vllm", choices=("vllm", "on", "off"),
                        help="the engines' async_scheduling (the trainer's vllm_async_scheduling): vllm = its choice")
    parser.add_argument("--grpo-json", help=argparse.SUPPRESS)
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    parser.add_argument("--in-process", action="store_true",
                        help="run every part in this process (default: one child process per part and model)")
    opts = parser.parse_args(argv)
    opts.parts = [p for p in opts.parts.split(",") if p]
    unknown = set(opts.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    opts.models = [m for m in opts.models.split(",") if m]
    unknown = set(opts.models) - {*MODEL_SPECS, "smollm2"}
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {sorted({*MODEL_SPECS, 'smollm2'})}")
    opts.grpo_arms = [a for a in opts.grpo_arms.split(",") if a]
    if not opts.grpo_arms or set(opts.grpo_arms) - set(GRPO_ARMS):
        parser.error(f"--grpo-arms: unknown or none {sorted(set(opts.grpo_arms) - set(GRPO_ARMS))}; choose from "
                     f"{list(GRPO_ARMS)}")
    try:
        check_grpo_profiles(opts)
    except ValueError as err:
        parser.error(str(err))
    opts.decode_arms = [a for a in opts.decode_arms.split(",") if a]
    unknown = set(opts.decode_arms) - set(DECODE_ENGINES)
    if unknown or not opts.decode_arms:
        parser.error(f"--decode-arms: unknown or none {sorted(unknown)}; choose from {sorted(DECODE_ENGINES)}")
    opts.mismatch_arms = [a for a in opts.mismatch_arms.split(",") if a]
    unknown = set(opts.mismatch_arms) - set(MISMATCH_ARMS)
    if unknown or not opts.mismatch_arms:
        parser.error(f"--mismatch-arms: unknown or none {sorted(unknown)}; choose from {list(MISMATCH_ARMS)}")
    if not opts.vllm_default_arm:
        opts.mismatch_arms = [a for a in opts.mismatch_arms if a != "vllm"]
    if opts.model_impl == "transformers" and {"mismatch", "grpo"} & set(opts.parts):
        parser.error("--model-impl transformers cannot run the mismatch or grpo parts: vLLM's Transformers backend "
                     "patches the transformers model class in this process, and the trainer-side model built from "
                     "that class then fails (H200, vLLM 0.24.0: 'LlamaModel' object has no attribute "
                     "'do_not_compile'); CalibratedGRPOConfig refuses vllm_model_impl='transformers' in colocate mode "
                     "for the same reason")
    from calclip.fp8.config import fp8_recipe_names

    opts.recipes = [r for r in opts.recipes.split(",") if r]
    unknown = set(opts.recipes) - set(fp8_recipe_names())
    if unknown or not opts.recipes or len(set(opts.recipes)) != len(opts.recipes):
        parser.error(f"--recipes: unknown, repeated or none {sorted(unknown)}; choose from {list(fp8_recipe_names())}")
    opts.grpo_earlier = [f for f in opts.grpo_earlier.split(",") if f]
    missing = [f for f in opts.grpo_earlier if not Path(f).is_file()]
    if missing:
        parser.error(f"--grpo-earlier: no such file {missing}")
    if opts.grpo_rounds < 0 or (opts.grpo_rounds == 0 and not opts.grpo_earlier):
        parser.error(f"--grpo-rounds {opts.grpo_rounds}: at least 1, or 0 with --grpo-earlier (summarize its files)")
    opts.async_scheduling = {"vllm": None, "on": True, "off": False}[opts.async_scheduling]
    opts.dummy_bf16 = False
    opts.device = "cuda"  # tests/test_bench_vllm.py runs the mismatch part on CPU against a stand-in engine
    return opts


def child_argv(argv: list[str], part: str, model: str | None, result_json: str, arm: str | None = None) -> list[str]:
    """``argv`` without its --parts / --models / --mismatch-arms (and their values), for one part (and one model,
    one mismatch arm) in a child. A mismatch arm ``<arm>@<recipe>`` (``child_runs``) runs that one recipe; a plain
    arm runs blockwise (FP8) or none (bf16), so --recipes is dropped for every mismatch arm."""
    drop = ("--parts", "--models", "--mismatch-arms") + (("--recipes",) if arm is not None else ())
    out = drop_options(argv, *drop) + ["--parts", part, "--child-json", result_json]
    if model is not None:
        out += ["--models", model]
    if arm is not None:
        arm, _, recipe = arm.partition("@")
        out += ["--mismatch-arms", arm] + (["--recipes", recipe] if recipe else [])
    return out


def child_runs(opts) -> list[tuple[str, str | None, str | None]]:
    """(part, model, mismatch arm) of each child process: one per part; mismatch one per model and engine. vLLM 0.24
    engines built in one process share state: measured on the H200 (2026-12-02), three engines in one process
    all disagreed with their trainer forward at token-mult-prob-error ~5e7, each engine alone in its process at
    1.03-1.45 (docs/vllm.md). TRL's colocate mode runs one engine per process, as these children do."""
    runs = []
    for part in opts.parts:
        if part != "mismatch":
            runs.append((part, None, None))
            continue
        # the BF16 control first: a call cut by its time limit keeps the row every FP8 row is read against
        arms = sorted(opts.mismatch_arms, key=lambda arm: arm != "bf16")
        runs += [(part, model, recipe_label(arm, recipe, "@")) for model in opts.models for arm in arms
                 for recipe in (opts.recipes if arm != "bf16" else ["blockwise"])]
    return runs


DEGENERATE_LOGP = -0.05  # mean completion log-prob above this: the policy samples ~deterministically


def is_degenerate(diag: dict) -> bool:
    """A row whose policy puts almost all its mass on its own samples (mean completion log-prob > -0.05 on the
    trainer side): every log-prob is ~0 on both sides and the tmpe is a trivial ~1.0, not a measurement."""
    logp = diag.get("mean_logp", {}).get("trainer_completion") if isinstance(diag, dict) else None
    return logp is not None and logp > DEGENERATE_LOGP


def add_control_differences(results: dict) -> None:
    """``minus_bf16_control`` of every FP8 mismatch row: its tmpe minus the BF16 row's of the same model and stage
    (rows from separate child processes, so filled in after they merge); None without such a BF16 row, or where
    either row is degenerate (``is_degenerate``)."""
    rows = results.get("mismatch", [])
    control = {(r.get("model"), r.get("stage")): r for r in rows
               if r.get("arm") == "BF16" and r.get("tmpe") is not None}
    for r in rows:
        if r.get("arm", "").startswith("FP8") and r.get("tmpe") is not None:
            base = control.get((r.get("model"), r.get("stage")))
            usable = base is not None and not base.get("degenerate") and not r.get("degenerate")
            r["minus_bf16_control"] = r["tmpe"] - base["tmpe"] if usable else None


def merge(into: dict, child: dict) -> None:
    for key, value in child.items():
        if key == "env":
            into.setdefault("env", value)
        elif isinstance(value, list):
            into.setdefault(key, []).extend(value)
        elif isinstance(value, dict):
            into.setdefault(key, {}).update(value)
        else:
            into[key] = value


def run_in_process(opts) -> None:
    parts = {"ops": part_ops, "mismatch": part_mismatch, "decode": part_decode,
             "decode_profile": part_decode_profile, "hf_decode": part_hf_decode, "grpo": part_grpo}
    for part in opts.parts:
        try:
            parts[part](opts)
        except Exception as err:  # noqa: BLE001 — later parts still run
            import traceback

            traceback.print_exc(limit=6)
            RESULTS.setdefault("errors", {})[part] = _short(err)
        save_results(opts)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    if opts.grpo_worker:
        out = Path(opts.grpo_json)
        timings = grpo_worker(opts.grpo_worker, opts,
                              progress=lambda so_far: out.write_text(json.dumps({**so_far, "partial": True})))
        out.write_text(json.dumps(timings))
        return 0
    if opts.child_json:  # one part (one model) in this process
        RESULTS["env"] = {"vllm": _common.package_version("vllm"), "torch": torch.__version__,
                          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                          "commit": _common.git_commit()}
        run_in_process(opts)
        save_results(opts)
        return 0
    summary_only = opts.parts == ["grpo"] and opts.grpo_rounds == 0  # --grpo-earlier's files, nothing run
    _common.header("bench_vllm: vLLM rollouts on calclip's FP8 codes", needs_gpu=not summary_only)
    print(f"vllm {_common.package_version('vllm')}  trl {_common.package_version('trl')}  transformers "
          f"{_common.package_version('transformers')}  calclip {_common.git_commit()}  calclip switches "
          f"{_common.dispatch_switches()}", flush=True)
    RESULTS["argv"] = argv
    if opts.in_process:
        run_in_process(opts)
        return 0
    # Each part (each model and engine of mismatch) in a child process: vLLM engines do not give all their GPU
    # memory back in-process, and engines sharing a process disagree with their model (child_runs).
    for part, model, arm in child_runs(opts):
        start = time.perf_counter()
        label = "/".join(x for x in (part, model, arm) if x)
        result_json = str(Path(tempfile.mkdtemp()) / "part.json")
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()),
                               *child_argv(argv, part, model, result_json, arm)])
        if Path(result_json).exists():
            merge(RESULTS, json.loads(Path(result_json).read_text()))
        if proc.returncode != 0:
            RESULTS.setdefault("errors", {})[label] = f"exit {proc.returncode}"
        add_control_differences(RESULTS)
        print(f"== {label}: {time.perf_counter() - start:.0f} s (exit {proc.returncode})", flush=True)
        save_results(opts)
    for r in RESULTS.get("mismatch", []):
        if r.get("minus_bf16_control") is not None:
            print(f"   {r['model']} {r['stage']} {r['arm']}: tmpe {r['tmpe']:.4f}, minus BF16 control "
                  f"{r['minus_bf16_control']:+.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
