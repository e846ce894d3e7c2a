"""FP8 vs BF16 CalibratedGRPOTrainer step time on one GPU (the trainer-step row of docs/benchmarks.md).

A randomly initialized Llama whose linear dims are multiples of 512 (so the forward and dgrad GEMMs take the
torch._scaled_mm path), the character-level test tokenizer and the offline arithmetic prompts. Three runs of
the same config differing only in the precision flow:

    bf16_static       fp8=False, clip_mode=static      (the baseline a TRL user has today)
    fp8_static        fp8=True,  clip_mode=static      (FP8 cost alone)
    fp8_calibrated    fp8=True,  clip_mode=calibrated  (FP8 + shadow calibration every interval)

Per run it reports the median wall time of an optimizer step (generation rounds included: TRL generates
inside training_step every steps_per_generation mini-batches) after warm-up steps, and separately the median
time of one policy forward+backward on a fixed [B, T] batch, which is what FP8 accelerates. Ratios are
BF16 / FP8 (> 1 means FP8 is faster), all measured in this one process.

    python benchmarks/bench_trainer_step.py [--layers 8 --hidden 2048 --steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Run as `python benchmarks/bench_trainer_step.py`: the repository root on sys.path for calclip and tests.fixtures.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_timer(times: list[float]):
    """A TrainerCallback appending the wall time of every optimizer step (synchronized) to ``times``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            times.append(time.perf_counter() - self._t0)

    return StepTimer()


# The runs compared, differing only in the precision flow (module docstring).
RUNS = {
    "bf16_static": dict(fp8=False, clip_mode="static"),
    "fp8_static": dict(fp8=True, clip_mode="static"),
    "fp8_calibrated": dict(fp8=True, clip_mode="calibrated", calibration_interval=2),
}


def model_builder(tokenizer, *, layers: int, hidden: int, intermediate: int):
    """A zero-argument function building the benchmark's random Llama (BF16 weights, head dim 128)."""
    from calclip.models.tiny import build_tiny_model

    def model_fn():
        return build_tiny_model(
            tokenizer,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 128),
            num_key_value_heads=max(1, hidden // 128),
            dtype=torch.bfloat16,
        )
    return model_fn


def timed_steps(trainer_cls, config_cls, *, model_fn, tokenizer, dataset, reward, overrides, steps, warmup,
                completion_length, warmup_times: list[float] | None = None):
    """Train ``steps + warmup`` optimizer steps; return (the last ``steps`` step times, last logged metrics, model).
    ``overrides`` are config fields and win over the defaults below (e.g. ``bf16=False`` on CPU); the warm-up steps'
    times are appended to ``warmup_times`` when given."""
    times: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        fields = dict(
            output_dir=out,
            report_to="none",
            bf16=True,
            per_device_train_batch_size=16,
            num_generations=8,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            max_completion_length=completion_length,
            max_steps=steps + warmup,
            learning_rate=1e-6,
            logging_steps=1,
            save_strategy="no",
            seed=0,
            use_cpu=not torch.cuda.is_available(),
        )
        args = config_cls(**{**fields, **overrides})
        trainer = trainer_cls(
            model=model_fn(),
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[step_timer(times)],
        )
        trainer.train()
        step_logs = [log for log in trainer.state.log_history if "entropy" in log]
        metrics = {k: v for k, v in step_logs[-1].items() if isinstance(v, (int, float))}
    if warmup_times is not None:
        warmup_times.extend(times[:warmup])
    return times[warmup:], metrics, trainer.model


def _fwd_bwd_time(model, vocab, batch, seq, reps=10):
    ids = torch.randint(0, vocab, (batch, seq), device=model.device)
    for _ in range(3):
        model(input_ids=ids).logits.float().mean().backward()
    _sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(input_ids=ids).logits.float().mean().backward()
        _sync()
        samples.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--fwd-seq", type=int, default=1024)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    from calclip.models.tiny import build_tiny_tokenizer
    from calclip.trainers import CalibratedGRPOConfig, CalibratedGRPOTrainer
    from tests.fixtures import digit_share_reward, tiny_prompt_dataset

    tokenizer = build_tiny_tokenizer()
    dataset = tiny_prompt_dataset(256)
    model_fn = model_builder(tokenizer, layers=opts.layers, hidden=opts.hidden, intermediate=opts.intermediate)
    results = {}
    for name, overrides in RUNS.items():
        step_times, metrics, model = timed_steps(
            CalibratedGRPOTrainer, CalibratedGRPOConfig, model_fn=model_fn, tokenizer=tokenizer, dataset=dataset,
            reward=digit_share_reward, overrides=overrides, steps=opts.steps, warmup=opts.warmup,
            completion_length=opts.completion_length,
        )
        fb = _fwd_bwd_time(model, len(tokenizer), batch=16, seq=opts.fwd_seq)
        results[name] = dict(step_s=statistics.median(step_times), steps=step_times, fwd_bwd_s=fb,
                             peak_mem_gib=(torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available()
                                           else None),
                             last_log=metrics)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        print(f"{name}: median step {results[name]['step_s']:.3f} s, "
              f"fwd+bwd [16x{opts.fwd_seq}] {fb * 1e3:.1f} ms", flush=True)

    base = results["bf16_static"]
    print(f"\nLlama {opts.layers} layers, hidden {opts.hidden}, intermediate {opts.intermediate}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}, torch {torch.__version__}")
    print(f"| run | median step (s) | step ratio BF16/run | fwd+bwd 16x{opts.fwd_seq} (ms) | fwd+bwd ratio BF16/run |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['step_s']:.3f} | {base['step_s'] / r['step_s']:.2f}x | {r['fwd_bwd_s'] * 1e3:.1f} | "
              f"{base['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x |")
    keys = ("calib/low", "calib/high", "clip/neg_low_frac_fp8", "mismatch/token_mult_prob_error", "entropy")
    for name, r in results.items():
        print(name, {k: r["last_log"].get(k) for k in keys})
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
