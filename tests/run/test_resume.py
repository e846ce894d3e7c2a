"""Crash-safe resume: a checkpoint folder left incomplete by a kill during its save is never resumed from.

One real run saves checkpoint-2 and checkpoint-4 (tiny model, FP8, calibrated clipping; the calibrator state differs
between the two). Each test copies that output folder, damages checkpoint-4 the way a kill at some moment of its
save would leave it, and checks that ``resume_from_checkpoint=True`` resumes from checkpoint-2 with checkpoint-2's
calibrator state, warning about checkpoint-4.
"""

import json
import os
import shutil
import warnings

import pytest
import torch
import transformers
from transformers import TrainerCallback

from calclip.run.checkpoint import CHECKPOINT_FILES_KEY, checkpoint_problem, latest_complete_checkpoint
from calclip.trainers.grpo import CALCLIP_STATE_NAME
from tests.fixtures import tiny_trainer

RUN = dict(
    clip_mode="calibrated", fp8=True, max_steps=4, calibration_interval=2, calibration_ema=0.3,
    save_strategy="steps", save_steps=2, entropy_spike_warmup=2,
)  # fmt: skip
# What a complete save of this run writes (transformers' save_model, optimizer/scheduler, calclip, RNG, state).
EXPECTED_FILES = {
    "model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "chat_template.jinja", "training_args.bin", "optimizer.pt", "scheduler.pt", CALCLIP_STATE_NAME,
    "rng_state.pth", "trainer_state.json",
}  # fmt: skip


class _Resumed(Exception):
    pass


class _StopAtTrainBegin(TrainerCallback):
    """Records the step and calclip state in force when training starts (right after a resume loaded them), then
    stops the run: what the resume chose is all these tests need."""

    def __init__(self, stop=True):
        self.trainer, self.stop, self.step, self.state = None, stop, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step, self.state = state.global_step, self.trainer.calclip_state_dict()
        if self.stop:
            raise _Resumed


def _trainer(output_dir, callback=None, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(output_dir, num_prompts=16, callbacks=[callback] if callback else None,
                               **{**RUN, **overrides})
    if callback is not None:
        callback.trainer = callback.trainer or trainer
    return trainer


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(output_dir).train()
    return output_dir


def _state_without_manifest(folder):
    state = torch.load(os.path.join(folder, CALCLIP_STATE_NAME), weights_only=True)
    state.pop(CHECKPOINT_FILES_KEY, None)
    return state


def _copy(saved_run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(saved_run, target)
    return target


@pytest.mark.slow
def test_a_complete_save_writes_the_expected_files_and_records_them(saved_run):
    for step in (2, 4):
        folder = saved_run / f"checkpoint-{step}"
        assert set(os.listdir(folder)) == EXPECTED_FILES
        assert checkpoint_problem(str(folder)) is None
        # written before RNG state and trainer state: those two (and the file itself) are not in its record
        recorded = torch.load(folder / CALCLIP_STATE_NAME, weights_only=True)[CHECKPOINT_FILES_KEY]
        assert set(recorded) == EXPECTED_FILES - {CALCLIP_STATE_NAME, "rng_state.pth", "trainer_state.json"}
    assert _state_without_manifest(saved_run / "checkpoint-2") != _state_without_manifest(saved_run / "checkpoint-4")
    assert latest_complete_checkpoint(str(saved_run)) == str(saved_run / "checkpoint-4")


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_a_folder_missing_any_file_is_never_chosen(saved_run, tmp_path, name):
    run = _copy(saved_run, tmp_path)
    os.remove(run / "checkpoint-4" / name)
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoint .*checkpoint-4 .*missing"):
        chosen = latest_complete_checkpoint(str(run))
    assert chosen == str(run / "checkpoint-2")
    assert name in checkpoint_problem(str(run / "checkpoint-4"))


@pytest.mark.parametrize("name", [CALCLIP_STATE_NAME, "trainer_state.json"])
def test_a_truncated_state_file_makes_the_folder_incomplete(saved_run, tmp_path, name):
    run = _copy(saved_run, tmp_path)
    path = run / "checkpoint-4" / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match=rf"checkpoint-4 \({name}"):
        assert latest_complete_checkpoint(str(run)) == str(run / "checkpoint-2")


# A kill at several moments of checkpoint-4's save: the files present when it struck, in transformers' save order.
_MODEL_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "training_args.bin"}  # fmt: skip
KILLS = {
    "during_model_save": {"config.json", "generation_config.json"},
    "after_model_save": _MODEL_FILES,
    "after_optimizer": _MODEL_FILES | {"optimizer.pt", "scheduler.pt"},
    "during_calclip_state": _MODEL_FILES | {"optimizer.pt", "scheduler.pt", CALCLIP_STATE_NAME},  # truncated
    "after_rng_state": EXPECTED_FILES - {"trainer_state.json"},
}


@pytest.mark.parametrize("kill", sorted(KILLS))
def test_resume_true_after_a_kill_resumes_the_previous_checkpoint_and_its_calibrator(saved_run, tmp_path, kill):
    run = _copy(saved_run, tmp_path)
    folder = run / "checkpoint-4"
    for name in EXPECTED_FILES - KILLS[kill]:
        os.remove(folder / name)
    if kill == "during_calclip_state":
        data = (folder / CALCLIP_STATE_NAME).read_bytes()
        (folder / CALCLIP_STATE_NAME).write_bytes(data[:100])
    callback = _StopAtTrainBegin()
    trainer = _trainer(run, callback)
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoint .*checkpoint-4"), pytest.raises(_Resumed):
        trainer.train(resume_from_checkpoint=True)
    assert callback.step == 2
    assert callback.state == _state_without_manifest(saved_run / "checkpoint-2")


def test_resume_true_with_every_checkpoint_complete_takes_the_latest(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    callback = _StopAtTrainBegin()
    with pytest.raises(_Resumed), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is skipped, so no warning of ours
        warnings.filterwarnings("ignore", message="(?!resume_from_checkpoint=True: skipping)")
        _trainer(run, callback).train(resume_from_checkpoint=True)
    assert callback.step == 4 and callback.state == _state_without_manifest(saved_run / "checkpoint-4")


def test_resume_true_without_any_complete_checkpoint_fails_naming_the_folder(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    for step in (2, 4):
        os.remove(run / f"checkpoint-{step}" / "trainer_state.json")
    trainer = _trainer(run)
    with pytest.warns(UserWarning, match="skipping"), pytest.raises(ValueError, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.slow
def test_a_killed_run_resumed_with_true_finishes_from_the_previous_checkpoint(saved_run, tmp_path):
    """A run killed mid-save, end to end: trainer_state.json of the newest folder missing, the resumed run trains on."""
    run = _copy(saved_run, tmp_path)
    os.remove(run / "checkpoint-4" / "trainer_state.json")
    callback = _StopAtTrainBegin(stop=False)
    trainer = _trainer(run, callback)
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    assert callback.step == 2 and callback.state == _state_without_manifest(saved_run / "checkpoint-2")
    assert trainer.state.global_step == 4
    assert checkpoint_problem(str(run / "checkpoint-4")) is None  # saved again, completely this time
    history = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2, 3, 4]


def test_resume_from_checkpoint_true_from_yaml_and_command_line(saved_run, tmp_path, monkeypatch):
    """`calclip train` passes resume_from_checkpoint to train() as TRL's scripts do; `true` from YAML (a bool) and
    `--resume_from_checkpoint true` (a string) both mean the latest complete checkpoint."""
    from calclip.cli.arguments import parse_train_args
    from calclip.cli.train import train

    run = _copy(saved_run, tmp_path)
    os.remove(run / "checkpoint-4" / "optimizer.pt")
    received = []
    monkeypatch.setattr(transformers.Trainer, "train", lambda self, resume_from_checkpoint=None, *a, **k:
                        received.append(resume_from_checkpoint))  # fmt: skip
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {run}\nmodel_name_or_path: tiny\nnum_train_examples: 8\nmax_steps: 4\n"
                      "per_device_train_batch_size: 4\nnum_generations: 4\nmax_completion_length: 8\n"
                      "save_final_model: false\n"
                      "report_to: none\nuse_cpu: true\nresume_from_checkpoint: true\n")  # fmt: skip
    for extra in ([], ["--resume_from_checkpoint", "true"], ["--resume_from_checkpoint", "True"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(["--config", str(config), *extra])
    assert received == [str(run / "checkpoint-2")] * 3

    _, args = parse_train_args(["--config", str(config), "--resume_from_checkpoint", "false"])
    assert args.resume_from_checkpoint is None
    _, args = parse_train_args(["--config", str(config), "--resume_from_checkpoint", str(run / "checkpoint-4")])
    assert args.resume_from_checkpoint == str(run / "checkpoint-4")  # an explicit path is used as given


# ------------------------------------------------------------------ an explicit path gets the same check (issue 40)


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_state.pth", "scheduler.pt", CALCLIP_STATE_NAME])
def test_an_explicit_path_missing_a_file_is_refused_before_training(saved_run, tmp_path, name):
    """transformers resumed such a folder silently (a fresh AdamW without optimizer.pt, an INFO line without the RNG
    state) and the run then overwrote the good checkpoint."""
    from calclip.run.checkpoint import CheckpointError

    run = _copy(saved_run, tmp_path)
    os.remove(run / "checkpoint-4" / name)
    callback = _StopAtTrainBegin()
    trainer = _trainer(run, callback)
    with pytest.raises(CheckpointError, match=rf"checkpoint-4' cannot be resumed from: missing .*{name}"):
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    assert callback.step is None  # refused before transformers loaded anything


def test_an_explicit_path_with_a_step_beyond_the_folder_is_refused(saved_run, tmp_path):
    from calclip.run.checkpoint import CheckpointError

    run = _copy(saved_run, tmp_path)
    path = run / "checkpoint-4" / "trainer_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "global_step": 1_000_000, "max_steps": 1_000_000}))
    with pytest.raises(CheckpointError, match="says global_step 1000000 but the folder is checkpoint-4"):
        _trainer(run).train(resume_from_checkpoint=str(run / "checkpoint-4"))


def test_an_explicit_complete_path_resumes_it(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    callback = _StopAtTrainBegin()
    with pytest.raises(_Resumed):
        _trainer(run, callback).train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert callback.step == 2 and callback.state == _state_without_manifest(saved_run / "checkpoint-2")


def test_calclip_train_refuses_a_checkpoint_beyond_max_steps_and_saves_no_model(saved_run, tmp_path):
    """A checkpoint whose step lies beyond max_steps made train() return at once; `calclip train` exited 0 and saved
    the weights it had loaded as the final model."""
    from calclip.cli.train import train
    from calclip.run.checkpoint import CheckpointError

    run = _copy(saved_run, tmp_path)
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--model_name_or_path", "tiny", "--num_train_examples", "8", "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
            "--report_to", "none", "--use_cpu", "true", "--resume_from_checkpoint", str(run / "checkpoint-4")]
    with pytest.raises(CheckpointError, match=r"global_step 4, beyond this run's max_steps 2"):
        train(argv)
    assert not (out / "model.safetensors").exists()


def test_train_refuses_a_checkpoint_beyond_its_max_steps(saved_run, tmp_path):
    from calclip.run.checkpoint import CheckpointError

    run = _copy(saved_run, tmp_path)
    trainer = _trainer(run, max_steps=2)
    for resume in (str(run / "checkpoint-4"), True):  # named, or the newest complete one
        with pytest.raises(CheckpointError, match=r"checkpoint-4'.*global_step 4, beyond this run's max_steps 2"):
            trainer.train(resume_from_checkpoint=resume)
