"""calclip_state.pt is read without executing code, and an unreadable one fails naming the file and the ways out."""

import os
import warnings

import pytest
import torch

from calclip.calibration import ClipCalibrator
from calclip.monitoring.callbacks import EntropySpikeDetector
from calclip.run.checkpoint import CalclipStateError, load_calclip_state
from calclip.trainers.grpo import CALCLIP_STATE_NAME
from tests.fixtures import tiny_trainer


class _CreatesMarker:
    """Unpickling this object calls Path.touch(marker): a stand-in for arbitrary code in a crafted checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _trainer(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_trainer(tmp_path / "out", num_prompts=4, clip_mode="calibrated")


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("safety"))


def _checkpoint_with(tmp_path, payload) -> str:
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    torch.save(payload, folder / CALCLIP_STATE_NAME)
    return str(folder)


def test_crafted_pickle_in_state_file_does_not_run_on_resume(trainer, tmp_path):
    marker = tmp_path / "pwned"
    real = trainer.calclip_state_dict()
    payload = {**real, "calibrator": {**real["calibrator"], "alpha": _CreatesMarker(str(marker))}}
    folder = _checkpoint_with(tmp_path, payload)
    path = os.path.join(folder, CALCLIP_STATE_NAME)
    # the file is a live exploit: a plain unpickling runs it
    with open(path, "rb") as handle:
        torch.load(handle, weights_only=False)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CalclipStateError) as caught:
        trainer._load_optimizer_and_scheduler(folder)
    assert not marker.exists()
    message = str(caught.value)
    assert path in message and "earlier checkpoint" in message and f"delete {path}" in message


def test_real_state_round_trips_with_weights_only(trainer, tmp_path):
    # A calibrated, non-initial state with every kind of value the two objects hold (None, floats, ints, tuples).
    # The trainer's own calibrator settings (a state saved under other settings is not applied: test below), with
    # a pool in flight.
    calibrator = ClipCalibrator(**{**trainer.calibrator.settings, "schedule": "every_step", "upper": "quantile"})
    trainer.calibrator = ClipCalibrator(**calibrator.settings)
    calibrator.needs_calibration(3)
    generator = torch.Generator().manual_seed(0)
    ratios = torch.exp(0.2 * torch.randn(4, 16, generator=generator))
    calibrator.calibrate(ratios, ratios * 1.01, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, 16))
    calibrator.observe(ratios, ratios * 0.99, torch.tensor([0.5, -1.0, 0.5, -0.5]), torch.ones(4, 16))
    detector = EntropySpikeDetector(window=4, warmup=2)
    for step, value in enumerate([1.0, 1.1, 0.9]):
        detector.update(value, value / 2, step=step)
    import numpy as np

    detector.update(np.float64(1.05), torch.tensor(0.5).item(), step=3)  # a numpy float: stored as a plain float
    state = {"calibrator": calibrator.state_dict(), "spike_detector": detector.state_dict(),
             "settings": trainer._calibration_settings()}
    folder = _checkpoint_with(tmp_path, state)
    loaded = torch.load(os.path.join(folder, CALCLIP_STATE_NAME), weights_only=True)
    assert loaded == state and loaded["calibrator"]["alpha"] is not None
    assert loaded["calibrator"]["pool"]["batches"] == 1

    trainer.state.global_step = 3  # the checkpoint's step, which the calibrator's counters are checked against
    trainer._load_optimizer_and_scheduler(folder)
    assert trainer.calibrator.state_dict() == calibrator.state_dict()
    assert trainer.spike_detector.state_dict()["entropy"] == [1.0, 1.1, 0.9, 1.05]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not_a_dict", "missing_keys"])
def test_unreadable_state_file_names_the_file_and_the_ways_out(trainer, tmp_path, damage):
    folder = _checkpoint_with(tmp_path, trainer.calclip_state_dict())
    path = os.path.join(folder, CALCLIP_STATE_NAME)
    data = open(path, "rb").read()
    if damage == "truncated":
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "garbage":
        open(path, "wb").write(b"not a torch file, not a pickle\n" * 20)
    elif damage == "empty":
        open(path, "wb").close()
    elif damage == "not_a_dict":
        torch.save([1, 2, 3], path)
    else:
        torch.save({"calibrator": {"low": 0.5}, "spike_detector": {}}, path)
    with pytest.raises(CalclipStateError) as caught:
        trainer._load_optimizer_and_scheduler(folder)
    message = str(caught.value)
    assert path in message and "earlier checkpoint" in message and f"delete {path}" in message


def test_load_calclip_state_is_weights_only_for_any_caller(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"calibrator": {}, "spike_detector": _CreatesMarker(str(marker))}, tmp_path / "state.pt")
    with pytest.raises(CalclipStateError, match="state.pt"):
        load_calclip_state(str(tmp_path / "state.pt"))
    assert not marker.exists()


def _fitted_trainer_state(trainer):
    trainer.calibrator = trainer._build_calibrator()
    # a detector of no steps: another test may have loaded one of more steps than the checkpoint this stands for
    trainer.spike_detector = EntropySpikeDetector(window=trainer.args.entropy_spike_window,
                                                  warmup=trainer.args.entropy_spike_warmup)
    ratios = torch.exp(0.2 * torch.randn(4, 16, generator=torch.Generator().manual_seed(1)))
    trainer.calibrator.calibrate(ratios, ratios * 0.9, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, 16),
                                 step=2)  # fmt: skip
    assert trainer.calibrator.calibrated
    trainer.state.global_step = 2  # the step of the checkpoint it stands for (a state is checked against it)
    return trainer.calclip_state_dict()


@pytest.mark.parametrize(("field", "value"), [("low", float("nan")), ("alpha", 5.0), ("step", -3),
                                              ("pending_recalibration", "yes")])
def test_a_state_that_loads_but_is_invalid_is_refused_naming_file_and_field(trainer, tmp_path, field, value):
    """A file torch.load(weights_only=True) accepts can still hold NaN bounds (which would switch clipping off for
    the rest of the run), an alpha of 5 or a string flag: refused before anything is applied."""
    state = _fitted_trainer_state(trainer)
    state["calibrator"][field] = value
    folder = _checkpoint_with(tmp_path, state)
    before = trainer.calibrator.state_dict()
    with pytest.raises(CalclipStateError) as caught:
        trainer._load_optimizer_and_scheduler(folder)
    message = str(caught.value)
    assert os.path.join(folder, CALCLIP_STATE_NAME) in message and f"'{field}'" in message
    assert trainer.calibrator.state_dict() == before


@pytest.mark.parametrize(("section", "name", "value"), [
    ("calibrator", "eps_low", 0.3), ("calibrator", "upper", "quantile"), ("calibrator", "min_tokens", 7),
    ("trainer", "fp8", False), ("trainer", "clip_mode", "static"), ("trainer", "fp8_recipe", "tensorwise"),
])  # fmt: skip
def test_a_state_saved_under_other_clip_settings_starts_a_fresh_calibration(trainer, tmp_path, section, name, value):
    state = _fitted_trainer_state(trainer)
    settings = state["calibrator"]["settings"] if section == "calibrator" else state["settings"]
    settings[name] = value
    folder = _checkpoint_with(tmp_path, state)
    with pytest.warns(UserWarning, match=rf"changed calibration settings \[.*'{name}'.*discarded"):
        trainer._load_optimizer_and_scheduler(folder)
    assert (not trainer.calibrator.calibrated
            and trainer.calibrator.bounds == tuple(trainer.args.calibration_init_bounds))
    assert trainer.calibrator.needs_calibration(state["calibrator"]["step"])  # a calibration is due at once


def test_a_state_saved_under_another_cadence_keeps_its_bounds(trainer, tmp_path):
    state = _fitted_trainer_state(trainer)
    state["calibrator"]["settings"]["interval"] += 5
    folder = _checkpoint_with(tmp_path, state)
    with pytest.warns(UserWarning, match=r"\['interval'\].*kept under the new cadence"):
        trainer._load_optimizer_and_scheduler(folder)
    assert trainer.calibrator.calibrated and trainer.calibrator.bounds == (state["calibrator"]["low"],
                                                                           state["calibrator"]["high"])


# ------------------------------------------------------------------ the state against the run it resumes (issue 40)
# tiny_trainer: steps_per_generation 4 (a generation round of 4 micro-batches) over gradient_accumulation_steps 2,
# 4 completions of at most 8 tokens a micro-batch, one process, calibration_min_tokens 1; the checkpoint is at step 2.
# A round looks ahead at most (4 - 1) // 2 + 1 = 2 optimizer steps; 2 steps are 4 micro-batches, one round, so at
# most 4 // 4 + 1 = 2 commits; a pool holds at most 8 * 1 - 1 tokens kept by a commit plus 4 * 4 * 8 of one round.
_AHEAD = [("step", 4, 5), ("num_calibrations", 2, 3), ("num_refits", 2, 3), ("last_calibration_step", 2, 3)]


@pytest.mark.parametrize(("field", "allowed", "refused"), _AHEAD)
def test_a_state_ahead_of_the_checkpoint_step_is_refused_naming_the_field(trainer, tmp_path, field, allowed, refused):
    """A state whose counters are ahead of the trainer's step passed, and calibration never ran again (the bounds
    frozen until the trainer reached that step, with no warning)."""
    for value, ok in ((allowed, True), (refused, False)):
        state = _fitted_trainer_state(trainer)
        state["calibrator"][field] = value
        state["calibrator"]["step"] = max(state["calibrator"]["step"], state["calibrator"]["last_calibration_step"])
        if field == "step":
            state["calibrator"]["step"] = value
        (tmp_path / f"{field}-{value}").mkdir()
        folder = _checkpoint_with(tmp_path / f"{field}-{value}", state)
        if ok:
            trainer._load_optimizer_and_scheduler(folder)
            assert trainer.calibrator.state_dict()[field] == value
            continue
        before = trainer.calibrator.state_dict()
        with pytest.raises(CalclipStateError) as caught:
            trainer._load_optimizer_and_scheduler(folder)
        assert f"'{field}' ({refused})" in str(caught.value) and CALCLIP_STATE_NAME in str(caught.value)
        assert trainer.calibrator.state_dict() == before


def test_a_pool_larger_than_the_run_can_hold_between_commits_is_refused(trainer, tmp_path):
    limit = 8 * 1 - 1 + 4 * 4 * 8
    for count, ok in ((limit, True), (limit + 1, False)):
        state = _fitted_trainer_state(trainer)
        state["calibrator"]["pool"] = {"ratio_bf16": [1.0] * count, "ratio_fp8": [1.0] * count,
                                       "advantages": [-1.0] * count, "batches": 3}  # fmt: skip
        (tmp_path / str(count)).mkdir()
        folder = _checkpoint_with(tmp_path / str(count), state)
        if ok:
            trainer._load_optimizer_and_scheduler(folder)
            assert trainer.calibrator.pool_counts() == (count, 0)
        else:
            with pytest.raises(CalclipStateError, match=rf"'pool' holds {count} tokens, more than the {limit}"):
                trainer._load_optimizer_and_scheduler(folder)


@pytest.mark.parametrize("field", ["num_steps", "last_spike_step"])
def test_a_spike_detector_ahead_of_the_checkpoint_step_is_refused(trainer, tmp_path, field):
    """The detector updates once per optimizer step: a spike after the checkpoint's step (2), or more updates than
    its steps (one spare for either numbering), are another run's."""
    allowed = 3 if field == "num_steps" else 2
    for value, ok in ((allowed, True), (allowed + 1, False)):
        state = _fitted_trainer_state(trainer)
        detector = state["spike_detector"]
        detector["num_steps"] = value if field == "num_steps" else 3
        if field == "last_spike_step":
            detector["num_spikes"], detector["last_spike_step"] = 1, value
        (tmp_path / f"{field}-{value}").mkdir()
        folder = _checkpoint_with(tmp_path / f"{field}-{value}", state)
        if ok:
            trainer._load_optimizer_and_scheduler(folder)
            assert trainer.spike_detector.state_dict()[field] == value
        else:
            with pytest.raises(CalclipStateError, match=rf"spike_detector.{field} \({value}\) is beyond the "
                                                        r"checkpoint's global_step \(2\)"):
                trainer._load_optimizer_and_scheduler(folder)
