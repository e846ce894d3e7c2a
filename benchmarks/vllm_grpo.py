"""bench_vllm.py's ``grpo`` part: one CalibratedGRPOTrainer step with vLLM colocate rollouts per arm, each arm's
worker in its own process (``grpo_worker``, started as ``bench_vllm.py --grpo-worker ARM``), its timings and probes
(GC pauses, host CPU and steal, DeepGEMM's JIT cache, the CUDA allocator, rollout kernel and host profiles), and the
summary over the runs and rounds (``part_grpo``; ``--grpo-earlier`` pools earlier calls' runs).
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import vllm_common  # noqa: I001  (first: vLLM's environment defaults, before torch is imported)
import torch

import _common
from vllm_common import (ALLOCATOR_EVENTS, MODEL_SPECS, PROCESS_START, allocator_delta, allocator_events, cuda_sync,
                         deep_gemm_cache_files, engine_linear_backend, fmt, host_cpu_ticks,
                         random_llama, recipe_label, save_for_vllm, save_results, steal_share)
from vllm_decode import DECODE_CATEGORIES, decode_split, kernel_profiler, top_kernels

# the entry point a worker process runs (bench_vllm.py --grpo-worker ARM), beside this module
SCRIPT = Path(__file__).resolve().with_name("bench_vllm.py")


def pooled_after(runs: list[dict], key: str, skip: int) -> list[float]:
    """Every run's ``key`` measurements after its first ``skip`` (compilation, graph capture, autotuning), pooled;
    all of a run's when it has no more. ``key="train"``: each such step less its rollout and sync (the training part;
    none when the three lists differ in length)."""
    if key == "train":
        parts = [pooled_after(runs, k, skip) for k in ("step_s", "generate_s", "sync_s")]
        return [t - g - y for t, g, y in zip(*parts)] if len({len(v) for v in parts}) == 1 else []
    return [v for run in runs for v in (run[key][skip:] if len(run[key]) > skip else run[key])]


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


def round_ratios(base_runs: list[dict], arm_runs: list[dict], warmup: int, key: str = "step_s") -> list[float | None]:
    """Round by round (the runs of one round, run back to back), the baseline's median ``key`` (step_s; generate_s: the
    rollouts; train: each step less its rollout and sync) over the arm's: the ratio a round measured on the host as it
    was then, each run's steps taken as the pooled medians take them (``pooled_after``). Runs tagged with their round
    (``"round"``, as part_grpo tags pooled runs: call and round within it) pair by tag, one ratio per baseline round;
    untagged runs pair by position. None where either run failed, has no step, or the arm did not run that round."""
    def median_step(run):
        steps = pooled_after([without_profiled_step(run)], key, warmup) if "error" not in run else []
        return statistics.median(steps) if steps else None

    if all("round" in r for r in [*base_runs, *arm_runs]):
        arm_by_round = {r["round"]: r for r in arm_runs}
        pairs = [(median_step(b), median_step(arm_by_round[b["round"]]) if b["round"] in arm_by_round else None)
                 for b in base_runs]
    else:
        pairs = [(median_step(b), median_step(a)) for b, a in zip(base_runs, arm_runs)]
    return [b / a if b and a else None for b, a in pairs]


def tag_rounds(runs: list[dict], call: int) -> list[dict]:
    """Copies of one call's runs of an arm, each tagged with its round: "<call>.<round within the call>" (1-based)."""
    return [{**run, "round": f"{call}.{index}"} for index, run in enumerate(runs, 1)]


# The options that make two grpo calls' runs the same work (the steps and rounds may differ: each run's steps after
# --grpo-warmup are pooled); --grpo-earlier refuses a file whose run differs in any of them.
GRPO_WORKLOAD = ("grpo_layers", "grpo_completions", "grpo_tokens", "grpo_micro_batches", "grpo_warmup", "logit_std",
                 "gpu_util", "attention_backend", "linear_backend", "kv_cache_dtype", "async_scheduling",
                 "grpo_detokenize", "grpo_capture_size")


def grpo_workload(opts) -> dict:
    """The options that make two calls' grpo runs the same work (``GRPO_WORKLOAD``), as JSON saves them (a tuple reads
    back as a list)."""
    return json.loads(json.dumps({name: getattr(opts, name) for name in GRPO_WORKLOAD}))


def earlier_grpo_runs(opts, device: str | None) -> dict[str, list[dict]]:
    """--grpo-earlier: per arm label, the runs of earlier calls (each file an earlier call's $OUT/bench_vllm.json), in
    the files' order, to pool with this call's. A device call lasts at most 10 minutes, about one round of three arms
    at 8 layers; each run comes tagged "<call>.<round in it>" (``tag_rounds``), by which the round-by-round ratios
    pair an arm's runs with the baseline's of the same call and round. Refused, naming the file and the option: a file
    without grpo runs, a file whose workload (``GRPO_WORKLOAD``) differs from this call's, and files from another device
    than this call's (or, with --grpo-rounds 0 and no GPU here, than the first file's): timings compare only on one kind
    of device. The workload is the one each call saved (``grpo.workload``, its parsed options), so no command line is
    re-parsed."""
    runs: dict[str, list[dict]] = {}
    for call, path in enumerate(opts.grpo_earlier, 1):
        saved = json.loads(Path(path).read_text())
        grpo = saved.get("grpo")
        then = grpo.get("workload") if isinstance(grpo, dict) else None
        if not isinstance(then, dict):
            raise ValueError(f"--grpo-earlier {path}: no grpo runs with their workload (a parent's bench_vllm.json "
                             f"from --parts grpo)")
        for name, now in grpo_workload(opts).items():
            if name not in then or then[name] != now:
                raise ValueError(f"--grpo-earlier {path}: --{name.replace('_', '-')} was "
                                 f"{then.get(name, 'not saved')!r}, this call's is {now!r}: not the same work")
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
            runs.setdefault(label, []).extend(tag_rounds(label_runs, call))
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
    results = vllm_common.RESULTS.setdefault("grpo", {})
    results["workload"] = grpo_workload(opts)  # what a later call's --grpo-earlier checks its own against
    # (label, arm, recipe): every FP8 arm once per --recipes entry, labelled fp8, fp8_rowwise, fp8_reload_tensorwise...
    labelled = [(recipe_label(arm, recipe, "_"), arm, recipe) for arm in opts.grpo_arms
                for recipe in (opts.recipes if arm.startswith("fp8") else ["blockwise"])]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in labelled}
    for round_index in range(opts.grpo_rounds):
        for label, arm, recipe in labelled:
            out = Path(tempfile.mkdtemp()) / f"grpo_{label}.json"
            cmd = [sys.executable, str(SCRIPT), "--grpo-worker", arm, "--grpo-json", str(out),
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
        this_call = len(opts.grpo_earlier) + 1
        pooled = {label: earlier.get(label, []) + tag_rounds(label_runs, this_call)
                  for label, label_runs in runs.items()}
        results["earlier_calls"] = list(opts.grpo_earlier)
        print(f"   pooled with {len(opts.grpo_earlier)} earlier call(s): "
              + ", ".join(f"{label} {len(earlier.get(label, []))} run(s)" for label in runs), flush=True)
    rows, drifted, between = [], {}, {}  # drifted: arm -> its warning; between: arm -> the rounds' spread
    for arm, arm_runs in pooled.items():
        ok = [without_profiled_step(r) for r in arm_runs if "error" not in r]
        if not ok:
            results[arm] = {"error": arm_runs[-1]["error"] if arm_runs else "not run", "runs": runs[arm]}
            continue
        step, gen, sync = (pooled_after(ok, key, opts.grpo_warmup) for key in ("step_s", "generate_s", "sync_s"))
        step_median, gen_median, sync_median = (statistics.median(v) for v in (step, gen, sync))
        # within each run (one worker on the host as it was then) the same rollout, timed again: a spread past
        # ROLLOUT_DRIFT means the machine changed speed mid-run, and that round's ratio does not measure FP8
        # each run's timed rollouts, by its round (1-based, or pooled runs' tag "<call>.<round in it>")
        rollouts = {run.get("round", index): pooled_after([without_profiled_step(run)], "generate_s", opts.grpo_warmup)
                    for index, run in enumerate(arm_runs, 1) if "error" not in run}
        spreads = {r: (min(v), max(v)) for r, v in rollouts.items() if v and max(v) > ROLLOUT_DRIFT * min(v)}
        if spreads:
            lo, hi = min(v[0] for v in spreads.values()), max(v[1] for v in spreads.values())
            tagged = " (call.round)" if any("round" in r for r in arm_runs) else ""
            where, whose = (("this run", "its ratios do") if len(arm_runs) == 1 else
                            (f"round {next(iter(spreads))}{tagged}", "that round's ratios do") if len(spreads) == 1
                            else ("rounds " + ", ".join(map(str, spreads)) + tagged, "those rounds' ratios do"))
            drifted[arm] = (f"   !! {arm}: its timed rollouts took {lo:.3f}-{hi:.3f} s within {where} "
                            f"(x{max(h / f for f, h in spreads.values()):.2f}): the machine's speed changed "
                            f"mid-run, so {whose} not measure FP8; rerun before quoting them")
        medians = [statistics.median(v) for v in rollouts.values() if v]
        if len(medians) > 1 and max(medians) > ROLLOUT_DRIFT * min(medians):  # steady runs on a host that moved
            between[arm] = (f"   ~ {arm}: its runs' median rollouts went from {min(medians):.3f} to "
                            f"{max(medians):.3f} s from round to round (x{max(medians) / min(medians):.2f}): the "
                            f"host's speed moved between rounds, which the pooled medians mix; quote the ratios "
                            f"paired over the rounds")
        stolen = [v for r in ok for v in r.get("steal", [])[opts.grpo_warmup:] if v is not None]
        if stolen and statistics.median(stolen) >= STEAL_WARN:  # steady contention: slow but not drifting
            drifted.setdefault(arm, f"   !! {arm}: the hypervisor took {100 * statistics.median(stolen):.1f}% of the "
                                    f"host's CPU time during its timed rollouts (median; warned from "
                                    f"{100 * STEAL_WARN:.1f}%): it ran on a contended host, so this run's ratios do "
                                    f"not measure FP8; rerun before quoting them")
        # the rest of each step: log-probs, loss, backward, optimizer (one rollout and one sync per step)
        train = pooled_after(ok, "train", opts.grpo_warmup)
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
    results["rollout_between_rounds"] = list(between)
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
            rollout_by_round = round_ratios(pooled[baseline], pooled[label], opts.grpo_warmup, "generate_s")
            train_by_round = round_ratios(pooled[baseline], pooled[label], opts.grpo_warmup, "train")
            results[key + "_rollout_by_round"], results[key + "_train_by_round"] = rollout_by_round, train_by_round
            if len(by_round) > 1:  # how far the rounds agree: the pooled median hides a round the host slowed
                measured_rounds = [r for r in by_round if r is not None]
                per_round.append(f"   step ratio {baseline} / {label} round by round: "
                                 + ", ".join(f"{r:.2f}x" if r else "-" for r in by_round)
                                 + (f" (median {statistics.median(measured_rounds):.2f}x)" if measured_rounds else ""))
                # paired over the rounds: where the host's speed moved between rounds, the rounds' ratios, not the
                # pooled medians, compare the arms; the interval says whether the rounds run can tell
                for part, name, ratios in (("step", "step", by_round), ("rollout", "rollout", rollout_by_round),
                                           ("train", "training", train_by_round)):
                    paired = _common.paired_ratio_interval(ratios)
                    results[f"{key}_{part}_paired"] = paired
                    if paired is not None:
                        per_round.append(f"   {name} ratio {baseline} / {label} paired over {paired['rounds']} rounds: "
                                         f"geometric mean {paired['geomean']:.2f}x, 95% interval "
                                         f"[{paired['low']:.2f}-{paired['high']:.2f}]x")
    save_results(opts)
    print(f"\n### grpo: CalibratedGRPOTrainer step, vLLM colocate rollouts, {opts.grpo_layers}L Llama-3-8B dims, "
          f"{opts.grpo_completions} completions x {opts.grpo_tokens} tokens per step, trained in "
          f"{opts.grpo_micro_batches} micro-batch(es) (median [min-max] of the steps after "
          f"the first {opts.grpo_warmup} of each run, {opts.grpo_rounds} round(s) of the arms in turn"
          + (f", pooled with {len(opts.grpo_earlier)} earlier call(s)" if opts.grpo_earlier else "") + ")")
    _common.table(["arm", "step s", "rollout s", "training s", "weight sync ms", "sync share of step", "FP8 sync path",
                   "steps timed", "startup s"], rows)
    for line in [*per_round, *drifted.values(), *between.values()]:
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
