"""The one checkpoint check every resume runs (calclip.run.checkpoint.checkpoint_problem), on folders written
file by file without training: every file a resume reads present and whole, trainer_state.json's fields, its step
against the folder name, calclip's state against that step. (On a real run's folders, through the trainer:
test_resume.py.)"""

import os
import re

import pytest
import torch

from calclip.calibration import ClipCalibrator
from calclip.run.checkpoint import (
    CALCLIP_STATE_NAME,
    TRAINER_STATE_NAME,
    CheckpointError,
    check_resume_checkpoint,
    check_resume_step,
    checkpoint_problem,
    latest_complete_checkpoint,
    save_calclip_state,
)
from tests.checkpoint_folders import FILES, calclip_state, write_checkpoint


def test_a_complete_folder_passes(tmp_path):
    path = write_checkpoint(tmp_path, 4)
    assert sorted(os.listdir(path)) == sorted(FILES)
    assert checkpoint_problem(path) is None
    assert check_resume_checkpoint(path) == path


@pytest.mark.parametrize("name", FILES)
def test_every_file_a_resume_reads_is_required(tmp_path, name):
    path = write_checkpoint(tmp_path, 4)
    os.remove(os.path.join(path, name))
    problem = checkpoint_problem(path)
    assert problem is not None and name in problem
    with pytest.raises(CheckpointError, match=rf"{path}.*{name}"):
        check_resume_checkpoint(path)


def test_a_folder_without_optimizer_or_calclip_state_is_not_resumable(tmp_path):
    """Both removed looks like a save_only_model checkpoint; transformers would resume it with a fresh optimizer."""
    path = write_checkpoint(tmp_path, 4)
    for name in ("optimizer.pt", CALCLIP_STATE_NAME):
        os.remove(os.path.join(path, name))
    assert checkpoint_problem(path) == "missing optimizer.pt"


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin",
                                  "model.safetensors"])  # fmt: skip
@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_a_file_cut_short_is_found(tmp_path, name, keep):
    path = write_checkpoint(tmp_path, 4)
    file = os.path.join(path, name)
    data = open(file, "rb").read()
    open(file, "wb").write(data[: int(len(data) * keep)])
    problem = checkpoint_problem(path)
    assert problem is not None and problem.startswith(name) and ("cut short" in problem or "corrupt" in problem)


def test_an_empty_file_is_found(tmp_path):
    path = write_checkpoint(tmp_path, 4)
    open(os.path.join(path, "config.json"), "w").close()
    assert checkpoint_problem(path) == "config.json is empty"


@pytest.mark.parametrize(("content", "expected"), [
    ('{"global_step": "4", "max_steps": 10}', r"'global_step' must be an integer >= 0, got '4'"),
    ('{"global_step": true, "max_steps": 10}', r"'global_step' must be an integer >= 0, got True"),
    ('{"global_step": -4, "max_steps": 10}', r"'global_step' must be an integer >= 0, got -4"),
    ('{"global_step": 4.0, "max_steps": 10}', r"'global_step' must be an integer >= 0, got 4.0"),
    ('{"max_steps": 10}', r"'global_step' must be an integer >= 0, got None"),
    ('{"global_step": 4, "max_steps": "ten"}', r"'max_steps' must be an integer >= 0, got 'ten'"),
    ('{"global_step": 4, "max_steps": 2}', r"'global_step' 4 exceeds its own 'max_steps' 2"),
    ('[4]', r"must hold a JSON object, got list"),
    ('{"global_step": 4, "max_st', r"cannot be read \(JSONDecodeError"),
    (b'\xff\xfe{', r"cannot be read \(UnicodeDecodeError"),
])  # fmt: skip
def test_trainer_state_errors_name_the_file_and_the_field(tmp_path, content, expected):
    path = write_checkpoint(tmp_path, 4)
    file = os.path.join(path, TRAINER_STATE_NAME)
    with open(file, "wb") as handle:
        handle.write(content if isinstance(content, bytes) else content.encode())
    problem = checkpoint_problem(path)
    assert problem.startswith(TRAINER_STATE_NAME)
    assert re.search(expected, problem), problem
    with pytest.raises(CheckpointError, match=rf"resume_from_checkpoint='{path}' cannot be resumed from: "):
        check_resume_checkpoint(path)


def test_a_step_that_disagrees_with_the_folder_name_is_refused(tmp_path):
    path = write_checkpoint(tmp_path, 4, trainer_state={"global_step": 1_000_000, "max_steps": 1_000_000})
    assert checkpoint_problem(path) == (
        f"{TRAINER_STATE_NAME} says global_step 1000000 but the folder is checkpoint-4 (saved at step 4): the file "
        "belongs to another checkpoint or was edited"
    )


def test_a_calibrator_fitted_after_the_checkpoint_step_is_refused(tmp_path):
    calibrator = ClipCalibrator(min_tokens=1)
    ratios = torch.exp(0.2 * torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
    calibrator.calibrate(ratios, ratios * 0.9, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, 16), step=900)
    path = write_checkpoint(tmp_path, 4, state=calclip_state(calibrator))
    problem = checkpoint_problem(path)
    assert problem.startswith(CALCLIP_STATE_NAME) and "'last_calibration_step' 900" in problem
    assert "global_step 4" in problem
    # the same state in the checkpoint of the step it was fitted at passes
    assert checkpoint_problem(write_checkpoint(tmp_path, 900, max_steps=1000, state=calclip_state(calibrator))) is None


def test_a_path_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        check_resume_checkpoint(str(tmp_path / "checkpoint-9"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a folder"):
        check_resume_checkpoint(str(tmp_path / "file"))


def test_resume_true_skips_a_folder_with_a_wrong_step_for_the_previous_one(tmp_path):
    good = write_checkpoint(tmp_path, 2)
    write_checkpoint(tmp_path, 4, trainer_state={"global_step": "4", "max_steps": 10})
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoint .*checkpoint-4 \(trainer_state.json: "
                                         r"'global_step' must be an integer"):
        assert latest_complete_checkpoint(str(tmp_path)) == good


def test_a_checkpoint_beyond_the_runs_max_steps_is_refused(tmp_path):
    path = write_checkpoint(tmp_path, 8, max_steps=8)
    with pytest.raises(CheckpointError, match=r"global_step 8, beyond this run's max_steps 4; training would stop "
                                              r"at once"):
        check_resume_step(path, 4)
    with pytest.warns(UserWarning, match="nothing is left to train"):
        assert check_resume_step(path, 8) == 8
    assert check_resume_step(path, 12) == 8
    assert check_resume_step(path, -1) == 8  # epoch-based runs: transformers works out the steps


def test_the_state_file_record_of_the_folder_is_still_checked(tmp_path):
    """calclip_state.pt records the folder's files when it was written; one of them gone makes the folder incomplete,
    whatever it is (here the tokenizer, which no other rule requires)."""
    path = write_checkpoint(tmp_path, 4)
    (tmp_path / "checkpoint-4" / "tokenizer.json").write_text("{}")
    save_calclip_state(calclip_state(), os.path.join(path, CALCLIP_STATE_NAME))  # records tokenizer.json
    assert checkpoint_problem(path) is None
    os.remove(os.path.join(path, "tokenizer.json"))
    assert checkpoint_problem(path) == "missing tokenizer.json"
