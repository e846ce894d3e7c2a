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

Models (``--models``): ``llama3_8b`` (Llama-3-8B dims: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab
128256; ``--layers`` layers, random weights), ``issue_probe`` (the dims of the original mismatch probe: 2 layers,
hidden 1024, intermediate 2816, 8 heads / 4 KV, vocab 32000), ``smollm2`` (SmolLM2-135M-Instruct from
``--smollm2-gguf``, a GGUF file transformers dequantizes; needs the ``gguf`` package). Random models get their LM
head redrawn with std ``--logit-std`` / sqrt(hidden), i.e. logits of std ~``--logit-std`` after the final RMSNorm, so
the sampled distributions are sharp enough that log-prob errors show (std-0.02 init gives near-uniform logits).
SmolLM2's hidden size 576 is not a multiple of 128: its FP8 policy keeps what vLLM's block-FP8 linear cannot serve in
BF16 (``vllm_keep_patterns``: all but down_proj), for training too.

Environment: vLLM 0.24.0 (the bundle of ../shared/vllm, built with DeepGEMM kept as docs/benchmarks.md says; without
it vLLM's automatic block-FP8 GEMM is CUTLASS; Triton attention, no FlashInfer sampler), torch 2.11, transformers;
``grpo`` also needs trl 1.16 and datasets (with dill, multiprocess, xxhash). Nothing reaches a hub: random models are
built from configs.

Code: this file is the command line, the child processes (one per part, model and engine) and their merged results;
the parts live beside it in vllm_mismatch.py (ops, mismatch), vllm_decode.py (decode, decode_profile, hf_decode) and
vllm_grpo.py (grpo), all built on vllm_common.py (the environment vLLM reads at import, models, engines, shared
helpers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the part modules, _common, bench_speed
import vllm_common  # noqa: E402, I001  (first: vLLM's environment defaults, set before torch is imported)
import torch  # noqa: E402

import _common  # noqa: E402  (puts the repository root on sys.path)
from vllm_common import MODEL_SPECS, _short, drop_options, recipe_label, save_results  # noqa: E402
from vllm_decode import DECODE_ENGINES, part_decode, part_decode_profile, part_hf_decode  # noqa: E402
from vllm_grpo import GRPO_ARMS, check_grpo_profiles, grpo_worker, part_grpo  # noqa: E402
from vllm_mismatch import MISMATCH_ARMS, add_control_differences, part_mismatch, part_ops  # noqa: E402

# Re-exported: the tests and docs name these as bench_vllm.NAME. A test that replaces one (monkeypatch) replaces it in
# the module whose code looks it up (vllm_decode.make_llm for part_decode, vllm_common.RESULTS for every part).
from vllm_common import (ALLOCATOR_EVENTS, allocator_delta, allocator_events, capture_sizes,  # noqa: E402, F401
                         config_only_dir, cuda_sync, deep_gemm_cache_files, engine_linear_backend, fmt, fp8_policy,
                         host_cpu_ticks, make_llm, random_llama, rollout, save_for_vllm, shutdown, smollm2,
                         steal_share, sync_bf16)
from vllm_decode import (DECODE_CATEGORIES, _compressed_fp8, decode_engine_specs,  # noqa: E402, F401
                         decode_split, kernel_profiler, top_kernels)
from vllm_grpo import (GRPO_BF16_BASELINES, GRPO_WORKLOAD, ROLLOUT_DRIFT, STEAL_WARN, GcClock,  # noqa: E402, F401
                       earlier_grpo_runs, engine_async_scheduling, grpo_arm_settings, grpo_workload, pooled_after,
                       rollout_profile, round_ratios, without_profiled_step, worker_summary)
from vllm_mismatch import (DIAGNOSTIC_COLUMNS, attention, diagnostic_row, diagnostic_stats,  # noqa: E402, F401
                           engine_weight_mismatches, is_degenerate, mismatch_stats, prompt_logprobs_of, train_steps,
                           trainer_all_logprobs, trainer_logprobs)

PARTS = ("ops", "mismatch", "decode", "decode_profile", "hf_decode", "grpo")
DEFAULT_PARTS = ("ops", "mismatch", "decode")
# the trainer's vllm_kv_cache_dtype values (calclip.trainers.config.VLLM_KV_CACHE_DTYPES; that module imports TRL,
# which the non-grpo parts run without)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


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
            vllm_common.RESULTS.setdefault("errors", {})[part] = _short(err)
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
        vllm_common.RESULTS["env"] = {"vllm": _common.package_version("vllm"), "torch": torch.__version__,
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
    vllm_common.RESULTS["argv"] = argv
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
            merge(vllm_common.RESULTS, json.loads(Path(result_json).read_text()))
        if proc.returncode != 0:
            vllm_common.RESULTS.setdefault("errors", {})[label] = f"exit {proc.returncode}"
        add_control_differences(vllm_common.RESULTS)
        print(f"== {label}: {time.perf_counter() - start:.0f} s (exit {proc.returncode})", flush=True)
        save_results(opts)
    for r in vllm_common.RESULTS.get("mismatch", []):
        if r.get("minus_bf16_control") is not None:
            print(f"   {r['model']} {r['stage']} {r['arm']}: tmpe {r['tmpe']:.4f}, minus BF16 control "
                  f"{r['minus_bf16_control']:+.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
