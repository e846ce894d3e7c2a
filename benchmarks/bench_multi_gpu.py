"""Calibrated FP8 GRPO under accelerate's three multi-GPU launch modes (DDP, FSDP2, DeepSpeed ZeRO-3) vs one GPU.

Each mode trains the same random-weight Llama (default ``1b``: Llama-3.2-1B's decoder shape, ~1.0B parameters in
the decoder layers; fp32 master weights, bf16 autocast) with FP8 + Calibrated Clipping (every_step schedule, so the
bounds move on every moved mini-batch) through ``accelerate launch --config_file configs/accelerate/<mode>.yaml``
over NCCL; the one-GPU run uses the same global batch (per-device batch x GPUs on one device). Per mode it records
from every rank, and this script checks and prints as a Markdown table:

- identical calib/low and calib/high on every rank at every micro-batch and every logged step (asserted);
- loss and bounds per step vs the one-GPU run (sampling draws differ per rank, so these are comparable, not equal),
  and vs DDP on the same GPUs (same per-rank draws: close; measured on CPU, ZeRO-3 vs DDP agreed to ~1e-4);
- seconds per optimizer step and tokens/s (prompt + completion tokens of all ranks, TRL's num_tokens) over the
  steps after warm-up, and the speed-up vs one GPU;
- peak memory per GPU (torch.cuda.max_memory_allocated; the largest rank);
- that FSDP2 really holds DTensor shards and ZeRO-3 partitions, and that the FP8 weight-code cache is off there.

    python benchmarks/bench_multi_gpu.py                         # all GPUs of the host, modes single ddp fsdp2 zero3
    python benchmarks/bench_multi_gpu.py --num-gpus 2 --modes single ddp fsdp2
    python benchmarks/bench_multi_gpu.py --dry-run               # CPU: tiny shape, single, ddp, zero3 over gloo
    # one mode per call (each well under 10 min), then the table over all of them:
    for m in single ddp fsdp2 zero3; do python benchmarks/bench_multi_gpu.py --out runs/mgpu --resume --modes $m; done
    python benchmarks/bench_multi_gpu.py --out runs/mgpu --resume

Needs on the GPU machine: torch, transformers, accelerate (present on the H200 image) plus the wheels of trl 1.16,
datasets (and its dependencies), and deepspeed for zero3 (``pip install deepspeed``; its ops are not needed: the
trainer's optimizer is torch AdamW). No hub access: the tokenizer is calclip.models.tiny's character tokenizer and the
weights are random. NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set for every launch (NVLink
multicast is not available on the lent machines).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Decoder shapes (the LM head and embeddings are small: the character tokenizer has ~50 tokens).
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),  # Llama-3.2-1B's decoder
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),  # Llama-3.2-3B's decoder
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}  # fmt: skip
DISTRIBUTED_TYPE = {"single": "NO", "ddp": "MULTI_GPU", "fsdp2": "FSDP", "zero3": "DEEPSPEED"}
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# ---------------------------------------------------------------------------------------------------- worker


def _sharding(model) -> str:
    from torch.distributed.tensor import DTensor

    from calclip.fp8 import FP8BlockLinear

    weights = [m.weight for m in model.modules() if isinstance(m, FP8BlockLinear)]
    if weights and all(isinstance(w, DTensor) for w in weights):
        return "fsdp2"
    if weights and all(hasattr(w, "ds_tensor") and w.ds_tensor.numel() < w.ds_numel for w in weights):
        return "zero3"
    return "none"


def run_worker(args) -> None:
    """One rank (or the single process): train, record per-rank results as JSON in args.out."""
    import torch
    from transformers import TrainerCallback

    from calclip.fp8 import FP8BlockLinear
    from calclip.models.tiny import build_tiny_model, build_tiny_tokenizer
    from calclip.trainers.config import CalibratedGRPOConfig
    from calclip.trainers.grpo import CalibratedGRPOTrainer
    from tests.fixtures import digit_share_reward, tiny_prompt_dataset

    cuda = torch.cuda.is_available() and not args.dry_run
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, **SHAPES[args.shape], dtype=torch.float32)
    num_parameters = sum(p.numel() for p in model.parameters())
    config = CalibratedGRPOConfig(
        output_dir=str(Path(args.out) / "run"), report_to="none", disable_tqdm=True, save_strategy="no",
        use_cpu=not cuda, bf16=cuda, gradient_checkpointing=False, dataloader_num_workers=0, seed=0,
        per_device_train_batch_size=args.per_device_batch, num_generations=args.num_generations,
        gradient_accumulation_steps=2, steps_per_generation=4, max_completion_length=args.completion_length,
        max_steps=args.steps, learning_rate=1e-5, logging_steps=1, loss_type="dapo",
        fp8=True, clip_mode="calibrated", calibration_schedule="every_step", calibration_interval=2,
    )  # fmt: skip
    trainer = CalibratedGRPOTrainer(
        model=model, reward_funcs=digit_share_reward, args=config,
        train_dataset=tiny_prompt_dataset(4096), processing_class=tokenizer,
    )  # fmt: skip
    bounds_in_force: dict[str, list[float]] = {"calib/low": [], "calib/high": []}
    log = trainer.log

    def recording_log(logs, *log_args, **log_kwargs):
        # TRL averages and clears its per-micro-batch metric lists in log(): keep them first
        for name in bounds_in_force:
            bounds_in_force[name].extend(trainer._metrics["train"].get(name, []))
        log(logs, *log_args, **log_kwargs)

    trainer.log = recording_log
    step_ends: list[float] = []
    facts: dict = {}

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    class Timing(TrainerCallback):
        def on_train_begin(self, *cb_args, **cb_kwargs):
            policy = trainer.accelerator.unwrap_model(trainer.model)
            layers = [m for m in policy.modules() if isinstance(m, FP8BlockLinear)]
            facts.update(sharding=_sharding(policy), fp8_layers=len(layers),
                         cache_weights=sorted({m.fp8_config.cache_weights for m in layers}))  # fmt: skip
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            step_ends.append(now())

        def on_step_end(self, *cb_args, **cb_kwargs):
            step_ends.append(now())

    trainer.add_callback(Timing())
    trainer.train()

    history = trainer.state.log_history
    result = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        **facts,
        "bounds_in_force": bounds_in_force,
        "step_times": [b - a for a, b in zip(step_ends, step_ends[1:])],
        "loss": [h["loss"] for h in history if "loss" in h],
        "calib_low": [h["calib/low"] for h in history if "calib/low" in h],
        "calib_high": [h["calib/high"] for h in history if "calib/high" in h],
        "num_tokens": [[h["step"], h["num_tokens"]] for h in history if "num_tokens" in h],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "parameters": num_parameters,
    }
    Path(args.out, f"rank{result['rank']}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(mode: str, args, out: Path) -> tuple[list[dict] | None, str]:
    """Run one mode; return (per-rank results or None, the output tail)."""
    out.mkdir(parents=True, exist_ok=True)
    gpus = 1 if mode == "single" else args.num_gpus
    per_device = args.per_device_batch * (args.num_gpus if mode == "single" else 1)  # same global batch
    worker = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--shape", args.shape,
              "--steps", str(args.steps), "--per-device-batch", str(per_device),
              "--num-generations", str(args.num_generations), "--completion-length", str(args.completion_length)]
    if args.dry_run:
        worker.append("--dry-run")
    env = {**os.environ, **MULTI_GPU_ENV, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if mode == "single":
        command = [sys.executable, *worker]
        if not args.dry_run:  # one device: with several visible, transformers' Trainer would use nn.DataParallel
            env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch",
                   "--config_file", str(ROOT / "configs/accelerate" / f"{mode}.yaml"),
                   "--num_processes", str(gpus), "--main_process_port", str(_free_port()), *worker]  # fmt: skip
        if args.dry_run:
            command[3:3] = ["--mixed_precision", "no"]
    print(f"-- {mode}: {' '.join(command)}", flush=True)
    try:
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        return None, f"timed out after {args.timeout} s\n{(err.stdout or b'')[-3000:]!r}"
    tail = (proc.stdout + proc.stderr)[-4000:]
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return None, tail
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(gpus)]
    return results, tail


# ---------------------------------------------------------------------------------------------------- report


def check_mode(mode: str, results: list[dict], args) -> list[str]:
    """Assertions on one mode's per-rank records; returns the problems found (empty: all good)."""
    problems = []
    expected_type = DISTRIBUTED_TYPE[mode] if not (args.dry_run and mode == "ddp") else "MULTI_CPU"
    for r in results:
        if r["distributed_type"] != expected_type:
            problems.append(f"rank {r['rank']}: distributed_type {r['distributed_type']}, expected {expected_type}")
    first = results[0]
    for r in results[1:]:
        for key in ("bounds_in_force", "calib_low", "calib_high", "loss"):
            if r[key] != first[key]:
                problems.append(f"rank {r['rank']} {key} differs from rank 0: {r[key]} vs {first[key]}")
    if len(first["bounds_in_force"]["calib/low"]) != 2 * args.steps:
        problems.append(f"{len(first['bounds_in_force']['calib/low'])} micro-batch bounds, expected {2 * args.steps}")
    if len(set(first["calib_low"])) < 2:
        problems.append(f"calib/low never moved: {first['calib_low']}")
    sharding = {"fsdp2": "fsdp2", "zero3": "zero3"}.get(mode, "none")
    if first["sharding"] != sharding or first["cache_weights"] != [sharding == "none"]:
        problems.append(f"sharding {first['sharding']} (expected {sharding}), cache_weights {first['cache_weights']}")
    return problems


def throughput(result: dict, warmup: int) -> tuple[float, float]:
    """(seconds per optimizer step, tokens/s) over the steps after warm-up (whole generation rounds)."""
    times = result["step_times"][warmup:]
    tokens = result["num_tokens"]
    before = max((n for step, n in tokens if step <= warmup), default=0)
    after = tokens[-1][1] if tokens else 0
    seconds = sum(times)
    return (seconds / len(times) if times else float("nan")), ((after - before) / seconds if seconds else float("nan"))


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _warmup_steps(steps: int) -> int:
    """One generation round (2 optimizer steps: steps_per_generation 4 / accumulation 2) when there are more."""
    return 2 if steps >= 4 else 0


def _max_bound_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["calib_low"] + a["calib_high"], b["calib_low"] + b["calib_high"]))


def table(all_results: dict, failures: dict, args) -> str:
    warmup = _warmup_steps(args.steps)
    single = all_results.get("single")
    base_tps = throughput(single[0], warmup)[1] if single else None
    rows = ["| mode | GPUs | s/step | tokens/s | vs 1 GPU | peak GiB/GPU (max rank) | loss (last)"
            " | max abs d loss vs 1 GPU"
            " | calib/low, high (last) | max abs d bound vs 1 GPU | max abs d bound vs ddp"
            " | checks (bounds equal on all ranks, sharding) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode in args.modes:
        if mode in failures:
            rows.append(f"| {mode} | | failed: {failures[mode]} | | | | | | | | | |")
            continue
        results = all_results[mode]
        r0 = results[0]
        sec, tps = throughput(r0, warmup)
        peaks = [r["peak_memory_gib"] for r in results if r["peak_memory_gib"] is not None]
        d_loss = d_bound = None
        if single and mode != "single":
            ref = single[0]
            d_loss = max(abs(a - b) for a, b in zip(r0["loss"], ref["loss"]))
            d_bound = _max_bound_diff(r0, ref)
        ddp = all_results.get("ddp")
        d_ddp = _max_bound_diff(r0, ddp[0]) if ddp and mode not in ("single", "ddp") else None
        equal = "(1 rank)" if len(results) == 1 else ("yes" if not check_mode(mode, results, args) else "NO")
        cells = [mode, str(r0["world_size"]), f"{sec:.3f}", f"{tps:,.0f}",
                 _fmt(tps / base_tps if base_tps else None, ".2f") + ("x" if base_tps else ""),
                 _fmt(max(peaks) if peaks else None, ".1f"), f"{r0['loss'][-1]:.4g}", _fmt(d_loss, ".3g"),
                 f"{r0['calib_low'][-1]:.4f}, {r0['calib_high'][-1]:.4f}", _fmt(d_bound, ".3g"), _fmt(d_ddp, ".3g"),
                 equal]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--modes", nargs="+", default=["single", "ddp", "fsdp2", "zero3"],
                        choices=["single", "ddp", "fsdp2", "zero3"])  # fmt: skip
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs per multi-GPU mode (default: all)")
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (a generation every 2 steps)")
    parser.add_argument("--per-device-batch", type=int, default=16, help="completions per GPU per micro-batch")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--timeout", type=int, default=540, help="seconds per mode")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the modes an earlier run with the same --out finished (run modes in several calls)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shape, 4 steps, modes single, ddp and (with deepspeed) zero3 over gloo")
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    import torch

    if args.dry_run:
        args.shape, args.steps, args.num_gpus = "tiny", 4, 2
        # FSDP2 cannot run on CPU through accelerate (it silently becomes DDP there); ZeRO-3 can, with deepspeed
        cpu_modes = ("single", "ddp", "zero3") if importlib.util.find_spec("deepspeed") else ("single", "ddp")
        args.modes = [m for m in args.modes if m in cpu_modes]
        args.per_device_batch, args.num_generations, args.completion_length = 4, 4, 8
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run on a machine with >= 2 GPUs, or pass --dry-run on CPU")
        args.num_gpus = args.num_gpus or torch.cuda.device_count()
        if args.num_gpus < 2 and set(args.modes) - {"single"}:
            sys.exit(f"{args.num_gpus} GPU(s) visible: the multi-GPU modes need >= 2")
    if (args.per_device_batch * args.num_gpus) % args.num_generations:
        sys.exit("per-device batch x GPUs must be a multiple of --num-generations (TRL's global batch rule)")
    out_root = Path(args.out or ROOT / "runs" / f"bench_multi_gpu_{time.strftime('%Y%m%d_%H%M%S')}")
    print(f"== bench_multi_gpu: shape {args.shape}, {args.num_gpus} GPUs, modes {args.modes}, steps {args.steps}, "
          f"per-device batch {args.per_device_batch}, completion length {args.completion_length}; logs in {out_root}")
    print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))

    all_results, failures, problems = {}, {}, {}
    for mode in args.modes:
        started = time.perf_counter()
        done = out_root / mode / "done.json"
        if args.resume and done.exists():  # an earlier invocation with the same --out ran this mode
            results, tail = json.loads(done.read_text()), "(reused)"
            print(f"-- {mode}: reusing {done}")
        else:
            results, tail = launch(mode, args, out_root / mode)
            if results is not None:
                done.write_text(json.dumps(results))
        print(f"   {mode}: {time.perf_counter() - started:.0f} s", flush=True)
        if results is None:
            failures[mode] = tail.strip().splitlines()[-1][:200] if tail.strip() else "no output"
            print(tail)
            continue
        all_results[mode] = results
        problems[mode] = check_mode(mode, results, args)
        for problem in problems[mode]:
            print(f"!! {mode}: {problem}")
        r0 = results[0]
        print(f"   {mode}: loss {['%.4g' % v for v in r0['loss']]}")
        print(f"   {mode}: calib/low {['%.4f' % v for v in r0['calib_low']]}  calib/high "
              f"{['%.4f' % v for v in r0['calib_high']]}")
    print()
    print(table(all_results, failures, args))
    (out_root / "results.json").write_text(json.dumps({"args": vars(args), "results": all_results,
                                                       "failures": failures, "problems": problems}))  # fmt: skip
    bad = {mode: p for mode, p in problems.items() if p}
    if failures or bad:
        sys.exit(f"FAILED: {sorted(failures)} failed to run, {sorted(bad)} failed checks")


if __name__ == "__main__":
    main()
