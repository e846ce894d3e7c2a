"""docs/evidence/reproduce.py on the committed compact data: the numbers docs/evidence.md states for run 4 (as
corrected 2026-12-04), the runs 2-3 out-of-sample table, and a window table equal to the committed report.md."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "docs" / "evidence"


@pytest.fixture(scope="module")
def reproduce():
    spec = importlib.util.spec_from_file_location("evidence_reproduce", EVIDENCE / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run4(reproduce):
    return reproduce.run4_numbers(reproduce.load_runs(reproduce.RUN4))


def test_run4_steps_and_stopped_runs(run4):
    assert (run4["steps_logged"], run4["steps_planned"]) == (1976, 2000)
    assert run4["last_steps"]["fp8_static"] == [92, 100, 92, 96] and run4["last_steps"]["fp8_oracle"][0] == 96
    assert run4["finished"]["fp8_static"] == [1]


def test_run4_degeneration_preregistered_and_as_the_page_counted_it(run4):
    # the pre-registered rule counts finished runs: static has one, and it did not degenerate
    assert run4["degenerated_preregistered"]["fp8_static"] == ([], 1)
    assert run4["degenerated_incl_stopped"]["fp8_static"] == [2, 3]  # the page's deviation
    assert run4["repeat_last_quarter"]["fp8_calibrated"][1] == pytest.approx(0.240, abs=5e-4)  # rule: 0.25
    assert run4["repeat_70_92"]["fp8_calibrated"][1] == pytest.approx(0.21, abs=5e-3)  # the page's old quote


def test_run4_rewards_and_contrasts(run4):
    assert run4["reward_last_quarter_mean_std"]["bf16_static"] == pytest.approx((0.455, 0.032), abs=5e-4)
    assert run4["bf16_lowest"] == pytest.approx(0.430, abs=5e-4)
    # three FP8 seeds did not end below BF16's lowest, not two: TIS 0, static 3 and TIS 2 (0.435)
    assert [(arm, seed) for arm, seed, _ in run4["fp8_not_below_bf16_lowest"]] == [
        ("fp8_static", 3), ("fp8_tis", 0), ("fp8_tis", 2)]
    diff, p = run4["vs_static"]["fp8_calibrated"]
    assert diff == pytest.approx(-0.030, abs=5e-4) and p == pytest.approx(44 / 70)
    diff, p = run4["vs_static"]["fp8_tis"]
    assert diff == pytest.approx(0.071, abs=5e-4) and p == pytest.approx(24 / 70)
    assert run4["smallest_p_4_vs_4"] == pytest.approx(2 / 70)
    # steps 76-92, which every run reached: TIS equals BF16, the oracle trails by 0.039 (p 22/70 = 0.31)
    assert run4["vs_bf16_76_92"]["fp8_tis"][0] == pytest.approx(0.0015, abs=1e-4)
    assert run4["vs_bf16_76_92"]["fp8_oracle"] == pytest.approx((-0.0386, 22 / 70), abs=5e-4)
    assert run4["seeds_for_0.10"]["fp8_calibrated"] == 11


def test_run4_out_of_sample_shares_and_both_floors(run4):
    assert run4["oos_dropped"]["fp8_calibrated"][0] == pytest.approx(0.0456, abs=5e-5)
    assert run4["oos_shadow"]["fp8_calibrated"][0] == pytest.approx(0.0433, abs=5e-5)
    assert run4["oos_dropped"]["fp8_static"][0] == pytest.approx(0.1153, abs=5e-5)
    assert run4["oos_shadow"]["fp8_static"][0] == pytest.approx(0.0164, abs=5e-5)
    assert run4["oos_dropped"]["bf16_static"][0] == pytest.approx(0.0361, abs=5e-5)
    assert run4["excess_removed_vs_bf16_arm"] == pytest.approx(0.88, abs=5e-3)
    assert run4["excess_removed_vs_static_shadow"] == pytest.approx(0.705, abs=5e-3)


def test_runs_2_3_out_of_sample_table(reproduce):
    run2 = reproduce.old_runs_oos(reproduce.load_runs(EVIDENCE / "2026-12-01-smollm2"))
    run3 = reproduce.old_runs_oos(reproduce.load_runs(EVIDENCE / "2026-12-01-smollm2-lr3e-5"))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(run2["fp8_static"]) == pytest.approx(0.0617, abs=5e-5)
    assert mean(run2["bf16_static"]) == pytest.approx(0.0231, abs=5e-5)
    assert run3["fp8_calibrated"] == pytest.approx([0.0780, 0.0670, 0.0345], abs=5e-5)


def test_window_table_equals_the_committed_report(reproduce):
    from calclip.compare.report import Window

    folder = EVIDENCE / "2026-12-01-smollm2-lr3e-5"
    table = reproduce.window_tables(folder, [Window(226, 300)])
    report = (folder / "report.md").read_text()
    for label in ("`reward`", "`completions/mean_length`", "`clip/neg_low_frac_fp8`"):
        drawn = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        section = report[report.index("### steps 226-300"):]
        committed = next(line for line in section.splitlines() if line.startswith(f"| {label} |"))
        assert drawn == committed
