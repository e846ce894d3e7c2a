"""`calclip compare` end to end on the tiny model: one comparison (two arms and a failing one, one seed, two steps)
shared by every assertion, then a resume, a refused config and a redraw on the same folder."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from calclip.compare import command, report, runner
from calclip.run import run_outputs as metrics

pytestmark = pytest.mark.slow  # three `calclip train` processes (~5-10 s each on the 2-core machine), then one more

ROOT = Path(__file__).resolve().parents[2]
TRAIN_FLAGS = [
    "--model_name_or_path", "tiny", "--max_steps", "2", "--max_completion_length", "8", "--num_train_examples", "16",
    "--report_to", "none", "--save_strategy", "steps", "--save_steps", "1",
]
GOOD_ARMS = "bf16_static,fp8_calibrated"


def _compare(folder: Path, *extra: str) -> int:
    return command.main(["--config", str(ROOT / "configs" / "demo.yaml"), "--seeds", "0", "--output-dir", str(folder),
                         *extra, *TRAIN_FLAGS])


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    no_prompts = tmp / "no_prompts.jsonl"  # valid file, no 'prompt' column: fails inside the run, not at parse
    no_prompts.write_text("".join(json.dumps({"question": f"{i}+1", "answer": i + 1}) + "\n" for i in range(8)))
    folder = tmp / "cmp"
    code = _compare(folder, "--arms", f"{GOOD_ARMS},broken", "--arm", f"broken:dataset_path={no_prompts}",
                    "--parallel", "2")
    return folder, code


def _table_cells(report_text: str, window_title: str) -> dict[str, dict[str, str]]:
    """{metric: {arm header: cell}} of one window table of report.md."""
    block = report_text.split(f"### {window_title}\n", 1)[1].split("\n\n", 1)[0]
    lines = block.strip().splitlines()
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    cells = {}
    for line in lines[2:]:
        parts = [cell.strip() for cell in line.strip("|").split("|")]
        cells[parts[0].strip("`")] = dict(zip(headers, parts[1:]))
    return cells


def test_the_good_arms_finish_and_the_failing_one_is_reported(comparison, capsys):
    folder, code = comparison
    assert code == command.EXIT_FAILED_RUNS
    assert runner.read_status(folder / "bf16_static" / "seed0")["status"] == "finished"
    assert runner.read_status(folder / "fp8_calibrated" / "seed0")["status"] == "finished"
    broken = runner.read_status(folder / "broken" / "seed0")
    assert broken["status"] == "failed" and broken["returncode"] not in (0, runner.EXIT_STOPPED)
    assert any("prompt" in line for line in broken["error_tail"])  # the run's own error, not a generic one
    text = (folder / "report.md").read_text()
    assert "broken (n=0) seed 0 FAILED" in text and "| broken | 0 | failed |" in text


def test_metrics_files_hold_every_step_with_the_trainer_metrics(comparison):
    folder, _ = comparison
    bf16 = metrics.read_metrics(folder / "bf16_static" / "seed0" / "metrics.jsonl")
    fp8 = metrics.read_metrics(folder / "fp8_calibrated" / "seed0" / "metrics.jsonl")
    for rows in (bf16, fp8):
        assert [row["step"] for row in rows] == [1, 2]
        assert all(list(row) == list(metrics.FIELD_NAMES) for row in rows)
        assert all(math.isfinite(row["entropy"]) and row["step_time"] > 0 for row in rows)
        assert rows[0]["reward"] is not None and rows[0]["completions/mean_length"] > 0  # a generating step
        assert rows[0]["time"] < rows[1]["time"]
    # The arms differ as their fields say: static bounds 1 -+ 0.2 against calibrated initial bounds; the BF16-shadow
    # share exists only under FP8 (the shadow is FP8 switched off).
    assert [(row["calib/low"], row["calib/high"]) for row in bf16] == [(0.8, 1.2)] * 2
    assert [(row["calib/low"], row["calib/high"]) for row in fp8] == [(0.6, 1.8)] * 2
    assert all(row["clip/neg_low_frac_bf16"] is None for row in bf16)
    assert any(row["clip/neg_low_frac_bf16"] is not None for row in fp8)
    assert any(row["mismatch/fp8_bf16_token_mult_prob_error"] not in (None, 1.0) for row in fp8)


def test_table_numbers_equal_the_metrics_files(comparison):
    folder, _ = comparison
    text = (folder / "report.md").read_text()
    for title, (first, last) in [("steps 1-2 (all)", (1, 2)), ("steps 2-2 (last 1 steps)", (2, 2))]:
        cells = _table_cells(text, title)
        assert set(cells) == set(report.TABLE_METRICS) | set(report.POOLED_SHARES)
        for arm in GOOD_ARMS.split(","):
            rows = metrics.read_metrics(folder / arm / "seed0" / "metrics.jsonl")
            window = [row for row in rows if first <= row["step"] <= last]
            for name, (numerator, denominator, _) in report.POOLED_SHARES.items():
                # one seed: the window's summed numerator over its summed denominator
                pairs = [(row[numerator], row[denominator]) for row in window
                         if row[numerator] is not None and row[denominator] is not None]
                total = sum(d for _, d in pairs)
                cell = cells[name][f"{arm} (n=1)"]
                if total == 0:
                    assert cell == "-", (name, arm)
                else:
                    assert float(cell) == pytest.approx(sum(n for n, _ in pairs) / total, rel=5e-4), (name, arm)
            for metric, by_arm in cells.items():
                if metric in report.POOLED_SHARES:
                    continue
                values = [row[metric] for row in rows if first <= row["step"] <= last and row[metric] is not None]
                cell = by_arm[f"{arm} (n=1)"]
                if not values:
                    assert cell == "-", (metric, arm)
                else:  # one seed: the cell is the window mean, printed to 4 significant digits
                    assert float(cell) == pytest.approx(sum(values) / len(values), rel=5e-4, abs=1e-12), (metric, arm)
            assert cells["reward"]["broken (n=0) seed 0 FAILED"] == "failed"
            assert all(cells[name]["broken (n=0) seed 0 FAILED"] == "failed" for name in report.POOLED_SHARES)


def test_per_seed_numbers_equal_the_metrics_files(comparison):
    folder, _ = comparison
    text = (folder / "report.md").read_text().split("## Per seed\n", 1)[1]
    block = text.split("### steps 1-2 (all)\n", 1)[1].split("\n\n", 1)[0].strip().splitlines()
    headers = [cell.strip().strip("`") for cell in block[0].strip("|").split("|")]
    assert headers == ["arm", "seed", *report.PER_SEED_METRICS]
    rows = [dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|")))) for line in block[2:]]
    assert [(row["arm"], row["seed"]) for row in rows] == [(arm, "0") for arm in GOOD_ARMS.split(",")]  # no failed run
    for row in rows:
        logged = metrics.read_metrics(folder / row["arm"] / "seed0" / "metrics.jsonl")
        for metric in report.PER_SEED_METRICS:
            values = [r[metric] for r in logged if 1 <= r["step"] <= 2 and r[metric] is not None]
            if not values:
                assert row[metric] == "-", (metric, row["arm"])
            else:
                assert float(row[metric]) == pytest.approx(sum(values) / len(values), rel=5e-4, abs=1e-12)


def test_figure_is_a_png(comparison):
    pytest.importorskip("matplotlib")
    folder, _ = comparison
    data = (folder / "figure.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # 12 panels, not an empty canvas
    assert "![comparison](figure.png)" in (folder / "report.md").read_text()


def test_plot_only_redraws_the_same_report(comparison):
    folder, _ = comparison
    before = (folder / "report.md").read_text()
    (folder / "report.md").unlink()
    (folder / "figure.png").unlink(missing_ok=True)
    code = command.main(["--plot-only", str(folder)])
    assert (folder / "report.md").read_text() == before
    has_matplotlib = report.MATPLOTLIB_MISSING not in before
    assert (folder / "figure.png").exists() == has_matplotlib and code == (0 if has_matplotlib else 1)


def test_a_different_config_is_refused_naming_the_field(comparison, capsys):
    folder, _ = comparison
    assert _compare(folder, "--arms", GOOD_ARMS, "--learning_rate", "3e-5") == command.EXIT_USAGE
    error = capsys.readouterr().err
    assert "holds runs of a different config" in error and "learning_rate: 1e-05 in the folder, 3e-05 now" in error
    assert "fp8_calibrated" in error


def test_finished_runs_are_skipped_and_a_killed_run_resumes(comparison, capsys):
    folder, _ = comparison
    killed = folder / "bf16_static" / "seed0"  # the cheaper arm to re-run (no FP8 emulation)
    fp8_log = (folder / "fp8_calibrated" / "seed0" / "train.log").read_text()
    # Killed after its step-1 checkpoint, while writing step 2's (no trainer_state.json yet).
    (killed / "checkpoint-2" / "trainer_state.json").unlink()
    (killed / "status.json").write_text(json.dumps({"status": "running", "pid": 999999999, "wall_s": 1.0}))
    step1 = metrics.read_metrics(killed / "metrics.jsonl")[0]
    capsys.readouterr()
    assert _compare(folder, "--arms", GOOD_ARMS) == command.EXIT_OK
    out = capsys.readouterr().out
    assert ("1 of 2 runs already finished: skipped" in out
            and "started bf16_static/seed0 (resume from checkpoint-1)" in out)
    assert (folder / "fp8_calibrated" / "seed0" / "train.log").read_text() == fp8_log  # not run again
    attempts = re.findall(r"=== attempt .*: (.*) ===", (killed / "train.log").read_text())
    assert attempts == ["start", "resume from checkpoint-1"]
    rows = metrics.read_metrics(killed / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and rows[0] == step1  # step 1 kept, step 2 re-run
    assert (runner.read_status(killed)["status"] == "finished"
            and (killed / "checkpoint-2" / "trainer_state.json").exists())


def test_a_folder_brought_back_without_checkpoints_takes_more_seeds_elsewhere(comparison, tmp_path, capsys):
    """Run 5's single-GPU schedule (docs/evidence/run5/plan.md, amendment 1): a wave's folder comes back without its
    checkpoints, is copied to another path on another machine, and the next wave adds its seeds there: the finished
    run is skipped (not re-run, its metrics kept), the new seed runs, and the report counts both seeds."""
    folder, _ = comparison
    moved = tmp_path / "run5"
    shutil.copytree(folder, moved, ignore=shutil.ignore_patterns("checkpoint-*", ".compare.lock"))
    kept = (moved / "bf16_static" / "seed0" / "metrics.jsonl").read_text()
    capsys.readouterr()
    code = command.main(["--config", str(ROOT / "configs" / "demo.yaml"), "--seeds", "0,1", "--arms", "bf16_static",
                         "--output-dir", str(moved), *TRAIN_FLAGS])
    out = capsys.readouterr().out
    assert code == command.EXIT_OK, out
    assert "1 of 2 runs already finished: skipped" in out
    assert (moved / "bf16_static" / "seed0" / "metrics.jsonl").read_text() == kept
    assert runner.read_status(moved / "bf16_static" / "seed1")["status"] == "finished"
    assert json.loads((moved / "comparison.json").read_text())  # still one comparison, readable
    assert "bf16_static (n=2)" in (moved / "report.md").read_text()
