"""Run 5's pre-registered scripts (docs/evidence/run5/): the power calculation on run 4's committed data, the
analysis on a hand-worked comparison, and the config `calclip compare` reads."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from calclip.compare.report import Run

ROOT = Path(__file__).resolve().parents[1]
RUN5 = ROOT / "docs" / "evidence" / "run5"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"run5_{name}", RUN5 / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_power_on_run4_sizes_run5_at_fourteen_seeds():
    power = _module("power")
    sds = power.run4_sds()
    assert sds["fp8_static"] == pytest.approx(0.0777, abs=5e-5) and sds["fp8_tis"] == pytest.approx(0.0999, abs=5e-5)
    result = power.design(sds)
    # TIS is the noisier stand-in: sqrt((0.0999^2 + 0.0777^2) / 2) = 0.0895; 2 * 0.0895^2 * 7.849 / 0.01 + 0.96 =
    # 12.58 + 0.96 -> 14. The calibrated stand-in alone (0.0797) would need 11.
    assert result["primary_sd"] == pytest.approx(0.0895, abs=5e-5)
    assert result["stand_ins"]["fp8_calibrated"]["seeds"] == 11
    assert result["seeds_per_arm"] == 14
    plan = (RUN5 / "plan.md").read_text()
    assert "14 seeds per arm" in plan and "--seeds 0,1,2,3,4,5,6,7,8,9,10,11,12,13" in plan


def _run(arm, seed, reward, status="finished", length=12.0):
    rows = [{"step": step, "reward": (0.0 if step < 76 else reward), "completions/mean_length": length,
             "completions/repeat_ngram_frac": 0.0} for step in range(1, 101)]
    return Run(arm, seed, status, [] if status == "failed" else rows)


def test_analysis_hand_worked():
    analysis = _module("analysis")
    runs = [_run("bf16_static", s, r) for s, r in enumerate((0.50, 0.60, 0.70))]
    runs += [_run("fp8_static", 0, 0.20), _run("fp8_static", 1, 0.30), _run("fp8_static", 2, None, "failed")]
    runs += [_run("fp8_tis", s, r) for s, r in enumerate((0.40, 0.45, 0.50))]
    runs += [_run("fp8_calibrated_tis", 0, 0.55, length=40.0), _run("fp8_calibrated_tis", 1, 0.60),
             _run("fp8_calibrated_tis", 2, 0.65)]
    result = analysis.analyse(runs)
    # the failed static seed takes the lowest endpoint of the comparison (0.20) and counts as degenerated
    assert result["endpoints"]["fp8_static"] == pytest.approx([0.20, 0.30, 0.20])
    assert result["degenerated"] == {"bf16_static": [], "fp8_static": [2], "fp8_tis": [], "fp8_calibrated_tis": [0]}
    # static - BF16 = 0.2333 - 0.6 with complete separation: p = 2/20 (3 vs 3) misses 0.05, but 1 of 3 static seeds
    # degenerated (>= a quarter) against 0 BF16: static fails by the degeneration branch
    assert result["regime"]["p"] == pytest.approx(0.1) and result["static_fails"]
    primary = result["primary"]
    assert primary["difference"] == pytest.approx(0.60 - 0.70 / 3) and primary["p"] == pytest.approx(0.1)
    assert result["verdict"].startswith("no separation")
    # secondary p: TIS - static 0.1, calTIS - TIS 0.1 (both complete separation), calTIS - BF16 1.0 (equal means);
    # Holm: 3 * 0.1 = 0.3, max(0.3, 2 * 0.1) = 0.3, max(0.3, 1.0) = 1.0
    holm = [c["p_holm"] for c in result["secondary"].values()]
    assert holm == pytest.approx([0.3, 0.3, 1.0])
    assert "calibrated_tis - fp8_static" in analysis.render(result)


def test_analysis_refuses_unfinished_runs_unless_reported():
    analysis = _module("analysis")
    runs = [_run(arm, s, 0.1 * (s + 1)) for arm in analysis.ARMS for s in range(2)]
    runs[0] = Run("bf16_static", 0, "interrupted", runs[0].rows[:92])
    with pytest.raises(ValueError, match="1 run\\(s\\) have not finished"):
        analysis.analyse(runs)
    result = analysis.analyse(runs, allow_incomplete=True)
    assert result["unfinished"] == [("bf16_static", 0, "interrupted", 92)]
    assert "**Deviation:**" in analysis.render(result)


def test_holm_by_hand():
    analysis = _module("analysis")
    # sorted 0.01, 0.02, 0.04 -> 3 * 0.01 = 0.03, 2 * 0.02 = 0.04, 1 * 0.04 = 0.04
    assert analysis.holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])


def test_run5_config_is_run4s_regime_and_parses():
    from calclip.cli.arguments import parse_train_args

    run4 = yaml.safe_load((ROOT / "configs" / "compare_smollm2_tensorwise.yaml").read_text())
    run5 = yaml.safe_load((RUN5 / "config.yaml").read_text())
    assert {k: v for k, v in run5.items() if k != "output_dir"} == {k: v for k, v in run4.items() if k != "output_dir"}
    _, args = parse_train_args(["--config", str(RUN5 / "config.yaml"), "--report_to", "none"])
    assert args.max_steps == 100 and args.calibration_min_tokens == 256 and args.learning_rate == 3e-5
