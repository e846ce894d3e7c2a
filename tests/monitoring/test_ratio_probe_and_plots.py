"""The moved-policy probe behind `calclip diagnose --plot`, the figure, and the missing-matplotlib message."""

import sys

import pytest
import torch

from calclip.calibration import calibrate_bounds
from calclip.cli.diagnose import diagnose
from calclip.monitoring.ratio_distributions import dropped_shares
from calclip.monitoring.ratio_probe import probe_moved_policy, synthetic_advantages
from tests.fixtures import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="module")
def probe():
    torch.manual_seed(0)
    model = build_tiny_model(build_tiny_tokenizer())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    input_ids = torch.randint(0, model.config.vocab_size, (6, 24), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[5, 20:] = 0  # a padded row: its last tokens do not count
    result = probe_moved_policy(model, input_ids, attention_mask, update_steps=3, lr=1e-3)
    return model, before, result


def test_probe_moves_the_policy_in_the_direction_of_the_advantages(probe):
    model, before, result = probe
    assert any(not torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())
    assert result.advantages.tolist() == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    assert int(result.mask.sum()) == 6 * 23 - 4
    log_fp8 = result.ratio_fp8.log()
    # pushed-up rows gained log-probability on average, pushed-down rows lost it (under FP8 and the shadow)
    for log_ratio in (log_fp8, result.ratio_bf16.log()):
        assert log_ratio[0::2][result.mask[0::2]].mean() > 0 > log_ratio[1::2][result.mask[1::2]].mean()
    assert (log_fp8[result.mask] - result.ratio_bf16.log()[result.mask]).abs().max() > 0  # FP8 noise is visible


def test_probe_calibration_is_calibrate_bounds_on_its_ratios(probe):
    _, _, result = probe
    expected = calibrate_bounds(result.ratio_bf16, result.ratio_fp8, result.advantages, result.mask,
                                eps_low=0.2, eps_high=0.2)
    assert result.calibration == expected
    assert result.samples.fp8_neg.numel() + result.samples.fp8_pos.numel() == int(result.mask.sum())


def test_probe_rejects_a_policy_that_cannot_move():
    model = build_tiny_model(build_tiny_tokenizer())
    with pytest.raises(ValueError, match="update_steps"):
        probe_moved_policy(model, torch.zeros(2, 4, dtype=torch.long), update_steps=0)
    with pytest.raises(ValueError, match="at least 2 rows"):
        synthetic_advantages(1)


def test_plot_writes_a_png_and_returns_the_shares_it_shows(probe, tmp_path):
    pytest.importorskip("matplotlib")
    from calclip.monitoring.plots import plot_ratio_histograms

    _, _, result = probe
    low, high = result.calibration.bounds()
    path = tmp_path / "ratios.png"
    shares = plot_ratio_histograms(result.samples, path, low=low, high=high, eps_low=0.2, eps_high=0.2, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    assert shares == dropped_shares(result.samples, low=low, high=high, eps_low=0.2, eps_high=0.2)


def test_missing_matplotlib_names_the_plot_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r'pip install "calclip\[plot\]"'):
        diagnose(["--plot", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_diagnose_plot_on_tiny_model(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ratios.png"
    report = diagnose(["--plot", str(path), "--seq-len", "32", "--update-steps", "2", "--lr", "1e-3"])
    out = capsys.readouterr().out
    assert path.stat().st_size > 20_000 and f"figure                   {path}" in out
    assert 0.0 < report["plot/low"] <= 1.0 <= report["plot/high"]
    assert report["plot/tokens_neg"] == report["plot/tokens_pos"] == 4 * 31  # 8 rows alternate A = +1 / -1
    assert report["plot/log_ratio_std_fp8"] > 0 and report["plot/log_ratio_std_bf16"] > 0
