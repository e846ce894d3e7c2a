"""A checkpoint folder with every file a resume reads, written in transformers' order without training (for tests of
the checkpoint check and compare's resume planning; tests/run/test_resume.py checks the same rule on a real
run's folders)."""

import json
import os

import torch
from safetensors.torch import save_file

from calclip.calibration import ClipCalibrator
from calclip.monitoring.callbacks import EntropySpikeDetector
from calclip.run.checkpoint import CALCLIP_STATE_NAME, TRAINER_STATE_NAME, save_calclip_state

# The files of a complete save, in the order Trainer._save_checkpoint writes them (trainer_state.json last).
MODEL_FILES = ("model.safetensors", "config.json", "training_args.bin")
FILES = (*MODEL_FILES, "optimizer.pt", "scheduler.pt", CALCLIP_STATE_NAME, "rng_state.pth", TRAINER_STATE_NAME)


def calclip_state(calibrator=None) -> dict:
    calibrator = calibrator or ClipCalibrator()
    return {"calibrator": calibrator.state_dict(), "spike_detector": EntropySpikeDetector().state_dict(),
            "settings": {}}  # fmt: skip


def write_checkpoint(folder, step: int, *, max_steps: int = 10, trainer_state: dict | None = None, state=None):
    """A complete checkpoint-``step`` folder under ``folder`` (a run's output_dir); returns its path."""
    path = os.path.join(folder, f"checkpoint-{step}")
    os.makedirs(path)
    save_file({"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump({"model_type": "llama"}, handle)
    torch.save({"seed": 0}, os.path.join(path, "training_args.bin"))
    torch.save({"state": {}, "param_groups": [{"lr": 1e-6}]}, os.path.join(path, "optimizer.pt"))
    torch.save({"last_epoch": step}, os.path.join(path, "scheduler.pt"))
    save_calclip_state(calclip_state() if state is None else state, os.path.join(path, CALCLIP_STATE_NAME))
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(path, "rng_state.pth"))
    content = trainer_state if trainer_state is not None else {"global_step": step, "max_steps": max_steps,
                                                               "log_history": []}
    with open(os.path.join(path, TRAINER_STATE_NAME), "w") as handle:
        json.dump(content, handle)
    return path
