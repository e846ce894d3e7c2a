"""W&B histograms of the FP8 and BF16-shadow log ratios on shadow-calibration steps.

The distributions of ``calclip diagnose --plot`` (`calclip.monitoring.ratio_distributions`), logged while training so a
user sees them move: on every optimizer step that ran a BF16 shadow calibration, four ``wandb.Histogram`` of log r
over the main process's completion tokens of that step (all its calibrated micro-batches), at the step's
``train/global_step`` (the x-axis transformers' WandbCallback sets), next to the scalar ``calib/low`` /
``calib/high``:

    train/ratio_hist/fp8/neg_adv    train/ratio_hist/bf16/neg_adv
    train/ratio_hist/fp8/pos_adv    train/ratio_hist/bf16/pos_adv

It exists only when W&B is a reporter of the run (`attach_ratio_histograms`): otherwise the trainer holds None
and pays nothing. When on, a calibration step copies its ratios to the CPU once (a host sync on those steps only).
Other processes record nothing: the histograms show rank 0's tokens, the bounds are global (docs/DESIGN.md step 7).
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import TrainerCallback

from calclip.monitoring.ratio_distributions import RatioSamples

HISTOGRAM_PREFIX = "train/ratio_hist/"
NUM_BINS = 64  # wandb.Histogram's limit is 512; 64 keeps a run's history small and the shape readable


def histogram_keys() -> list[str]:
    """The four W&B keys, in the order of the panel layout in docs/usage.md."""
    return [f"{HISTOGRAM_PREFIX}{precision}/{side}" for side in ("neg_adv", "pos_adv") for precision in ("fp8", "bf16")]


class RatioHistogramCallback(TrainerCallback):
    """Collects a step's calibration ratios (`record`) and logs them as W&B histograms at the step's end."""

    def __init__(self) -> None:
        self._pending: list[RatioSamples] = []

    def record(self, samples: RatioSamples) -> None:
        self._pending.append(samples)

    def merged(self) -> dict[str, torch.Tensor]:
        """The pending micro-batches' log ratios, concatenated per key (`histogram_keys`)."""
        per_batch = [samples.log_ratios() for samples in self._pending]
        return {f"{HISTOGRAM_PREFIX}{name}": torch.cat([logs[name] for logs in per_batch]) for name in per_batch[0]}

    def on_step_end(self, args, state, control, **kwargs):
        if not self._pending:
            return
        import wandb

        run = wandb.run  # WandbCallback starts it in on_train_begin; log to it, not through the module's global
        if run is not None:
            payload = {
                key: wandb.Histogram(values.numpy(), num_bins=NUM_BINS)
                for key, values in self.merged().items()
                if values.numel()
            }
            if payload:
                run.log({**payload, "train/global_step": state.global_step})
        self._pending.clear()


def attach_ratio_histograms(trainer) -> RatioHistogramCallback | None:
    """Add the callback to ``trainer`` when W&B reports this run on this (main) process; return it, else None."""
    report_to = trainer.args.report_to or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    if "wandb" not in report_to and "all" not in report_to:
        return None
    if importlib.util.find_spec("wandb") is None or not trainer.accelerator.is_main_process:
        return None
    callback = RatioHistogramCallback()
    trainer.add_callback(callback)
    return callback
