"""W&B histograms of the calibration ratios: logged on shadow-calibration steps only, absent without W&B."""

import warnings

import pytest
import torch

from calclip.monitoring.ratio_distributions import split_ratios
from calclip.monitoring.ratio_histograms import RatioHistogramCallback, histogram_keys
from tests.fixtures import tiny_trainer


def make_trainer(tmp_path, **overrides):
    return tiny_trainer(tmp_path, clip_mode="calibrated", fp8=True, **overrides)


def test_no_callback_without_wandb(tmp_path):
    trainer = make_trainer(tmp_path, report_to="none")
    assert trainer._ratio_histograms is None
    assert not any(isinstance(cb, RatioHistogramCallback) for cb in trainer.callback_handler.callbacks)


def test_merged_concatenates_the_step_micro_batches():
    callback = RatioHistogramCallback()
    mask = torch.ones(2, 2)
    callback.record(split_ratios(torch.tensor([[0.5, 1.0], [2.0, 4.0]]), torch.ones(2, 2), torch.tensor([-1.0, 1.0]),
                                 mask))
    callback.record(split_ratios(torch.tensor([[0.25, 1.0]]), torch.ones(1, 2), torch.tensor([-1.0]), torch.ones(1, 2)))
    merged = callback.merged()
    assert sorted(merged) == sorted(histogram_keys())
    log2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert torch.allclose(merged["train/ratio_hist/fp8/neg_adv"], torch.stack([-log2, 0 * log2, -2 * log2, 0 * log2]))
    assert torch.allclose(merged["train/ratio_hist/fp8/pos_adv"], torch.stack([log2, 2 * log2]))
    assert merged["train/ratio_hist/bf16/neg_adv"].abs().max() == 0


@pytest.mark.slow
def test_histograms_logged_on_calibration_steps(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    from wandb.sdk.wandb_run import Run

    logged = []
    real_log = Run.log

    def recording_log(run, data, *args, **kwargs):
        logged.append(dict(data))
        return real_log(run, data, *args, **kwargs)

    # wandb.init rebinds the module's `wandb.log` to the new run's method: record at the class
    monkeypatch.setattr(Run, "log", recording_log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_trainer(tmp_path, report_to="wandb", max_steps=2, calibration_interval=2)
        assert isinstance(trainer._ratio_histograms, RatioHistogramCallback)
        try:
            trainer.train()
        finally:
            wandb.finish()
            wandb.teardown()  # wandb's process-wide settings (WANDB_DIR: this test's tmp_path) must not outlive it
    histogram_logs = [entry for entry in logged if any(key in entry for key in histogram_keys())]
    calibration_steps = [e["step"] for e in trainer.state.log_history if "clip/neg_low_frac_bf16" in e]
    assert calibration_steps  # the run did calibrate
    assert [entry["train/global_step"] for entry in histogram_logs] == calibration_steps
    for entry in histogram_logs:
        for key in histogram_keys():
            assert isinstance(entry[key], wandb.Histogram)
            assert sum(entry[key].histogram) > 0
