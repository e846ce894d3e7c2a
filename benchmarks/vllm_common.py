"""bench_vllm.py's shared ground: the environment vLLM reads at import (set here, before torch is imported), the
results every part writes (``RESULTS``, ``save_results``), the models (random Llama-shaped, SmolLM2 from GGUF, the FP8
policy calclip trains), the engines (``make_llm`` and its FP8 settings, ``shutdown``, ``rollout``, the BF16 sync) and
the small helpers the parts share (host steal, allocator and DeepGEMM-cache probes, ``fmt``, ``drop_options``).

Imported from benchmarks/ (bench_vllm.py puts it on sys.path); every part module imports this one before torch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
from pathlib import Path

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

import _common  # noqa: E402, F401  (puts the repository root on sys.path)
from bench_speed import build_llama, sharing_copy  # noqa: E402

MODEL_SPECS = {  # hidden, intermediate, heads, kv heads, vocab, default layers
    "llama3_8b": (4096, 14336, 32, 8, 128256, None),
    "issue_probe": (1024, 2816, 8, 4, 32000, 2),
}
RESULTS: dict = {}  # every part's results; save_results writes them (tests replace it: look it up here)


# ---------------------------------------------------------------------------------------------------------------
# small helpers (tests/test_bench_vllm.py runs them on CPU)


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


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


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
