"""Trainer callbacks of a `calclip train` run that a supervisor (``calclip compare``, a cluster script) reads from.

- `MetricsFileCallback` writes the metrics file (`run_outputs`) as the trainer logs, so a killed run
  keeps every step it logged; a resumed run first drops the rows after the checkpoint it resumed from.
- `CheckpointOnSigtermCallback`: after SIGTERM, training stops at the next step that ends a generation cycle
  (so the resumed run generates where the uninterrupted one would: TRL does not checkpoint its rollout buffer),
  saves a checkpoint there and exits with `EXIT_STOPPED` instead of saving a final model, so a comparison with a
  time limit loses no work.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from transformers import TrainerCallback

from calclip.run.run_outputs import EXIT_STOPPED, metrics_row, read_metrics, truncate_metrics


class MetricsFileCallback(TrainerCallback):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.handle = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The state is already the checkpoint's when resuming: keep the rows up to its step, continue its clock.
        if state.global_step:
            truncate_metrics(self.path, state.global_step)
        else:
            self.path.unlink(missing_ok=True)
        previous = read_metrics(self.path)
        self.time_offset = previous[-1]["time"] if previous else 0.0
        self.started = time.perf_counter()
        self.handle = self.path.open("a")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.handle is None or not logs:
            return
        row = metrics_row(logs, state.global_step, self.time_offset + time.perf_counter() - self.started)
        if row is not None:
            self.handle.write(json.dumps(row) + "\n")
            self.handle.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class CheckpointOnSigtermCallback(TrainerCallback):
    def __init__(self):
        self.requested = False

    def on_train_begin(self, args, state, control, **kwargs):
        signal.signal(signal.SIGTERM, self._request_stop)

    def _request_stop(self, signum, frame):
        self.requested = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested and ends_generation_cycle(args, state.global_step):
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.requested and state.global_step < state.max_steps:
            raise SystemExit(EXIT_STOPPED)


def ends_generation_cycle(args, global_step: int) -> bool:
    """Whether optimizer step ``global_step`` used the last mini-batch of a generation batch: TRL generates when
    its micro-step count is a multiple of steps_per_generation * num_iterations (a trainer without these fields
    ends a cycle every step)."""
    micro_steps = global_step * getattr(args, "gradient_accumulation_steps", 1)
    every = (getattr(args, "steps_per_generation", None) or 1) * (getattr(args, "num_iterations", None) or 1)
    return micro_steps % every == 0


def train_callbacks(metrics_file: str | None, checkpoint_on_sigterm: bool) -> list[TrainerCallback]:
    callbacks: list[TrainerCallback] = []
    if metrics_file:
        callbacks.append(MetricsFileCallback(metrics_file))
    if checkpoint_on_sigterm:
        callbacks.append(CheckpointOnSigtermCallback())
    return callbacks
