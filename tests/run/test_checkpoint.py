"""Calibrator and spike-detector state travel with every checkpoint and come back on resume_from_checkpoint."""

import os
import warnings

import pytest
import torch
from transformers import TrainerCallback

from calclip.run.checkpoint import CHECKPOINT_FILES_KEY
from calclip.trainers.grpo import CALCLIP_STATE_NAME
from tests.fixtures import tiny_trainer

# Two generation rounds of 2 optimizer steps; calibration every 2 steps, so steps 2 and 4 calibrate on their
# moved mini-batches and the checkpoint at step 2 holds a calibrated, non-initial state.
RUN = dict(
    clip_mode="calibrated", fp8=True, max_steps=4, calibration_interval=2, calibration_ema=0.3,
    save_strategy="steps", save_steps=2, entropy_spike_warmup=2,
)  # fmt: skip


class _StateAtTrainBegin(TrainerCallback):
    """Records the trainer's calclip state when training starts, i.e. right after a resume loaded it."""

    def __init__(self):
        self.trainer, self.state = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = self.trainer.calclip_state_dict()


def _trainer(tmp_path, callback=None):
    trainer = tiny_trainer(tmp_path, num_prompts=16, callbacks=[callback] if callback else None, **RUN)
    if callback is not None:
        callback.trainer = trainer
    return trainer


@pytest.mark.slow
def test_checkpoint_and_resume_restore_bounds_and_calibrator_state(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uninterrupted = _trainer(tmp_path)
        uninterrupted.train()
    checkpoint = tmp_path / "checkpoint-2"
    saved = torch.load(checkpoint / CALCLIP_STATE_NAME, weights_only=True)  # plain values only
    # the folder's files at the time of writing (crash-safe resume, tests/run/test_resume.py), not state
    assert "optimizer.pt" in saved.pop(CHECKPOINT_FILES_KEY)
    assert os.path.exists(tmp_path / "checkpoint-4" / CALCLIP_STATE_NAME)  # every checkpoint carries it

    # the step-2 checkpoint holds a calibrated state, different from the initial one and from the final one
    calibrator = saved["calibrator"]
    assert calibrator["num_calibrations"] == 1 and calibrator["last_calibration_step"] == 1
    assert (calibrator["low"], calibrator["high"]) != (0.6, 1.8)
    assert saved["spike_detector"]["num_steps"] == 2 and len(saved["spike_detector"]["entropy"]) == 2
    final = uninterrupted.calclip_state_dict()
    assert final["calibrator"]["num_calibrations"] == 2 and final != saved

    callback = _StateAtTrainBegin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = _trainer(tmp_path / "resumed", callback)
        assert resumed.calibrator.bounds == (0.6, 1.8)  # fresh before the resume
        resumed.train(resume_from_checkpoint=str(checkpoint))

    # exactly the checkpointed state was in force when the resumed run started
    assert callback.state == saved
    # so the first resumed step (step 3, on-policy: no calibration) applies the uninterrupted run's bounds
    def bounds_at(trainer, step):
        (entry,) = [e for e in trainer.state.log_history if e.get("step") == step and "calib/low" in e]
        return entry["calib/low"], entry["calib/high"]

    saved_bounds = (saved["calibrator"]["low"], saved["calibrator"]["high"])
    assert bounds_at(resumed, 3) == bounds_at(uninterrupted, 3) == saved_bounds
    # step 4 recalibrates on the resumed run's own (re-generated) batch, building on the restored state
    assert resumed.calibrator.state_dict()["num_calibrations"] == 2
    assert resumed.spike_detector.num_steps == 4


@pytest.mark.slow
def test_missing_state_file_warns_and_starts_fresh(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp_path)
        trainer.train()
    os.remove(tmp_path / "checkpoint-2" / CALCLIP_STATE_NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = _trainer(tmp_path / "fresh")
    fresh.create_optimizer_and_scheduler(num_training_steps=4)
    with pytest.warns(UserWarning, match="start fresh"):
        fresh._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-2"))
    assert fresh.calibrator.bounds == (0.6, 1.8)


@pytest.mark.slow
def test_state_file_is_in_the_checkpoint_before_push_and_rotation(tmp_path, monkeypatch):
    """The hub push and the rotation of old checkpoints both see calclip_state.pt already in the folder."""
    import transformers.trainer

    seen = []

    def record(event, folder):
        seen.append((event, os.path.basename(folder), os.path.exists(os.path.join(folder, CALCLIP_STATE_NAME))))

    rotate = transformers.trainer.rotate_checkpoints

    def recording_rotate(output_dir, **kwargs):
        record("rotate", os.path.join(output_dir, f"checkpoint-{trainer.state.global_step}"))
        return rotate(output_dir=output_dir, **kwargs)

    monkeypatch.setattr(transformers.trainer, "rotate_checkpoints", recording_rotate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp_path)
        trainer.args.push_to_hub = True  # after __init__, so no hub repository is created
        monkeypatch.setattr(trainer, "_push_from_checkpoint", lambda folder: record("push", folder))
        monkeypatch.setattr(trainer, "_finish_current_push", lambda: None, raising=False)
        trainer.train()
    assert seen == [(event, f"checkpoint-{step}", True) for step in (2, 4) for event in ("push", "rotate")]
