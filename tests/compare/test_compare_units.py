"""calclip.compare pieces without training: arms, resume planning, fingerprint, table. (The metrics file and the
callbacks that write it: tests/run/test_run_outputs.py, test_run_callbacks.py.)"""

import json
import os
import statistics
from pathlib import Path

import pytest

from calclip.compare import arms, command, folder, report, runner
from calclip.run import run_outputs as metrics
from tests.checkpoint_folders import write_checkpoint


# ---------------------------------------------------------------------------------------------------- arms


def test_presets_set_only_arm_fields_and_differ_as_documented():
    assert arms.preset_names() == tuple(arms.PRESETS)
    assert set(arms.DEFAULT_ARMS) <= set(arms.PRESETS)
    assert arms.PRESETS["bf16_static"].overrides == {"fp8": False, "clip_mode": "static", "tis_mode": "none"}
    assert arms.PRESETS["fp8_tis"].overrides == {"fp8": True, "clip_mode": "static", "tis_mode": "token_truncate"}
    assert arms.PRESETS["fp8_calibrated"].train_flags() == [
        "--fp8=true", "--clip_mode=calibrated", "--tis_mode=none"]
    # Every preset sets the same fields, so the shared config decides everything else for all of them.
    assert len({tuple(sorted(arm.overrides)) for arm in arms.PRESETS.values()}) == 1


def test_the_presets_values_are_valid_config_values():
    from calclip.trainers.config import CLIP_MODES, TIS_MODES

    for arm in arms.PRESETS.values():
        assert arm.overrides["clip_mode"] in CLIP_MODES and arm.overrides["tis_mode"] in TIS_MODES


def test_user_arm_spec():
    arm = arms.parse_arm_spec("ema05:clip_mode=calibrated, calibration_ema=0.5,calibration_init_bounds=0.5 2.0")
    assert arm.name == "ema05"
    assert arm.overrides == {"clip_mode": "calibrated", "calibration_ema": "0.5",
                             "calibration_init_bounds": ["0.5", "2.0"]}
    assert arm.train_flags() == ["--clip_mode=calibrated", "--calibration_ema=0.5",
                                 "--calibration_init_bounds", "0.5", "2.0"]
    for bad, fragment in [("noColon", "NAME:field=value"), ("x:", "NAME:field=value"), ("x:fp8", "not field=value"),
                          ("x:fp8=true,fp8=false", "given twice"), ("bad name:fp8=true", "arm name"),
                          ("x:seed=3", "sets seed")]:
        with pytest.raises(ValueError, match=fragment):
            arms.parse_arm_spec(bad)


def test_an_arm_value_never_becomes_extra_flags():
    """A value that smuggles a flag in (split on spaces into a list whose items argparse reads as flags) is refused;
    a single value is passed as one argument, so even one starting with '-' stays a value."""
    for spec in ("x:fp8=true --resume_from_checkpoint /elsewhere/checkpoint-9",
                 "x:calibration_init_bounds=0.5 2 --seed 7", "x:tis_cap=2 -x"):
        with pytest.raises(ValueError, match=r"arm 'x': .* holds '-.*', which `calclip train` would read as a flag"):
            arms.parse_arm_spec(spec)
    arm = arms.parse_arm_spec("neg:learning_rate=-1e-5,top_k=-1,calibration_init_bounds=-0.5 2")
    assert arm.train_flags() == ["--learning_rate=-1e-5", "--top_k=-1", "--calibration_init_bounds", "-0.5", "2"]
    assert arms.looks_like_a_flag("-inf") and not arms.looks_like_a_flag("-0.5") and not arms.looks_like_a_flag("x")


def test_resolve_arms_names_the_valid_ones_on_a_typo():
    with pytest.raises(ValueError) as error:
        arms.resolve_arms(["bf16_static", "fp8_calibrted"])
    message = str(error.value)
    assert "'fp8_calibrted'" in message and all(name in message for name in arms.PRESETS)
    mine = arms.parse_arm_spec("mine:tis_cap=1.5")
    assert [arm.name for arm in arms.resolve_arms(["mine", "fp8_tis"], [mine])] == ["mine", "fp8_tis"]
    with pytest.raises(ValueError, match="already a preset"):
        arms.resolve_arms(["fp8_tis"], [arms.parse_arm_spec("fp8_tis:tis_cap=3")])
    with pytest.raises(ValueError, match="listed twice"):
        arms.resolve_arms(["fp8_tis", "fp8_tis"])


# ---------------------------------------------------------------------------------------------------- resume planning


def _spec(directory: Path, steps: int = 10) -> runner.RunSpec:
    return runner.RunSpec("fp8_static", 0, directory, ["--config", "x.yaml"], steps)


def test_attempt_resumes_from_the_last_complete_checkpoint(tmp_path):
    for step, complete in [(2, True), (4, True), (6, False)]:  # checkpoint-6 was being written when killed
        write_checkpoint(tmp_path, step)
        if not complete:
            os.remove(tmp_path / f"checkpoint-{step}" / "trainer_state.json")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    argv, action = runner.attempt_argv(_spec(tmp_path))
    assert argv == ["--config", "x.yaml", "--resume_from_checkpoint", str(tmp_path / "checkpoint-4")]
    assert action == "resume from checkpoint-4"
    assert not (tmp_path / "checkpoint-6").exists() and (tmp_path / "checkpoint-2").exists()
    assert [row["step"] for row in metrics.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize(("damage", "reason"), [
    ("calclip_state", "calclip_state.pt cannot be read as calclip state"),
    ("optimizer", "missing optimizer.pt"),
    ("rng_state", "missing rng_state.pth"),
    ("step", "trainer_state.json says global_step 40 but the folder is checkpoint-4"),
    ("truncated_weights", "model.safetensors is cut short"),
])  # fmt: skip
def test_attempt_falls_back_past_a_checkpoint_the_trainer_would_refuse(tmp_path, damage, reason):
    """compare's resume uses the trainer's checkpoint check: a newest folder holding trainer_state.json but a corrupt
    calclip_state.pt (or any other fault) is skipped for the previous one, not resumed (and failed) on every rerun."""
    write_checkpoint(tmp_path, 2)
    newest = Path(write_checkpoint(tmp_path, 4))
    if damage == "calclip_state":
        (newest / "calclip_state.pt").write_bytes(b"garbage")
    elif damage == "optimizer":
        os.remove(newest / "optimizer.pt")
    elif damage == "rng_state":
        os.remove(newest / "rng_state.pth")
    elif damage == "step":
        (newest / "trainer_state.json").write_text(json.dumps({"global_step": 40, "max_steps": 40}))
    else:
        data = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(data[:-8])
    argv, action, skipped = runner.attempt_plan(_spec(tmp_path))
    assert argv == ["--config", "x.yaml", "--resume_from_checkpoint", str(tmp_path / "checkpoint-2")]
    assert action == "resume from checkpoint-2"
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped {newest}: {reason}")
    assert not newest.exists()  # the resumed run saves step 4 again


def test_attempt_without_checkpoint_starts_over(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    argv, action = runner.attempt_argv(_spec(tmp_path))
    assert argv == ["--config", "x.yaml"] and action == "start"
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoint-3").exists()


def test_finished_is_read_from_the_status_file(tmp_path):
    assert not runner.is_finished(tmp_path)
    (tmp_path / runner.STATUS_FILE).write_text(json.dumps({"status": "stopped"}))
    assert not runner.is_finished(tmp_path)
    (tmp_path / runner.STATUS_FILE).write_text(json.dumps({"status": "finished"}))
    assert runner.is_finished(tmp_path)


def test_error_tail_shows_the_last_attempt_without_progress_redraws(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n=== attempt 1: start ===\nold failure\n\n=== attempt 2: start ===\n"
                   " 10%|#  \r 20%|##  \rTraceback (most recent call last):\n  File x\nKeyError: 'prompt'\n\n")
    assert runner.error_tail(log) == ["Traceback (most recent call last):", "  File x", "KeyError: 'prompt'"]


def test_child_environment_groups_wandb_runs_and_imports_this_calclip(tmp_path, monkeypatch):
    import calclip

    monkeypatch.delenv("WANDB_DIR", raising=False)
    env = runner.child_environment(_spec(tmp_path), group="cmp-7", gpu="1", threads=2)
    assert env["WANDB_RUN_GROUP"] == "cmp-7" and env["WANDB_DIR"] == str(tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(calclip.__file__).resolve().parents[1])


def test_format_seconds():
    assert [runner.format_seconds(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]


# ---------------------------------------------------------------------------------------------------- fingerprint


def _record(configs: dict, overrides: dict) -> dict:
    return {"format": folder.FORMAT_VERSION, "arms": {name: {"overrides": overrides[name], "config": config}
                                                      for name, config in configs.items()}, "seeds": [0]}


def test_config_differences_name_the_fields():
    base = {"learning_rate": 1e-5, "max_steps": 300, "tis_mode": "none", "clip_mode": "static"}
    stored = _record({"fp8_static": base}, {"fp8_static": arms.PRESETS["fp8_static"].overrides})
    same = {"fp8_static": dict(base)}
    assert folder.config_differences(stored, [arms.PRESETS["fp8_static"]], same) == []
    changed = {"fp8_static": dict(base, learning_rate=2e-5)}
    assert folder.config_differences(stored, [arms.PRESETS["fp8_static"]], changed) == [
        "learning_rate: 1e-05 in the folder, 2e-05 now (arms: fp8_static)"]
    # A new arm is compared on the fields no arm sets: its own clip_mode is not a difference, max_steps is.
    new_arm = {"fp8_calibrated": dict(base, clip_mode="calibrated", max_steps=500)}
    assert folder.config_differences(stored, [arms.PRESETS["fp8_calibrated"]], new_arm) == [
        "max_steps: 300 in the folder, 500 now (arms: fp8_calibrated)"]


def test_a_field_added_since_the_folder_was_made_counts_only_off_its_default():
    base = {"learning_rate": 1e-5, "tis_mode": "none", "clip_mode": "static"}
    stored = _record({"fp8_static": base}, {"fp8_static": arms.PRESETS["fp8_static"].overrides})
    preset = [arms.PRESETS["fp8_static"]]
    at_default = {"fp8_static": dict(base, fp8_recipe="blockwise")}
    assert folder.config_differences(stored, preset, at_default, {"fp8_recipe": "blockwise"}) == []
    assert folder.config_differences(stored, preset, at_default) == [  # without defaults every new field counts
        'fp8_recipe: "<unset>" in the folder, "blockwise" now (arms: fp8_static)']
    changed = {"fp8_static": dict(base, fp8_recipe="rowwise")}
    assert folder.config_differences(stored, preset, changed, {"fp8_recipe": "blockwise"}) == [
        'fp8_recipe: "<unset>" in the folder, "rowwise" now (arms: fp8_static)']
    # The defaults the command passes come from the dataclasses, normalized like the folder's configs.
    defaults = command._field_defaults()
    assert defaults["fp8_recipe"] == "blockwise" and defaults["clip_mode"] == "calibrated" and defaults["fp8"] is True
    assert "mismatch_dump_threshold" not in defaults  # where outliers are written is not compared at all
    assert "fp8_decode_fused_max_m" not in defaults  # one decode launch or two: the same codes, not compared


def test_comparable_drops_run_and_output_fields():
    config = {"seed": 3, "output_dir": "x", "run_name": "r", "report_to": ["wandb"], "save_steps": 5,
              "learning_rate": 1e-5, "calibration_init_bounds": (0.6, 1.8)}
    assert folder.comparable(config) == {"learning_rate": 1e-5, "calibration_init_bounds": [0.6, 1.8]}


def test_folder_lock_refuses_a_live_holder(tmp_path):
    import socket

    host = socket.gethostname()
    (tmp_path / folder.LOCK_FILE).write_text(f"{os.getppid()} {host}\n")  # a live process that is not this one
    with pytest.raises(RuntimeError, match="another calclip compare"):
        with folder.FolderLock(tmp_path):
            pass
    for stale in (f"999999999 {host}", f"{os.getppid()} another-machine"):  # gone; or a folder copied over
        (tmp_path / folder.LOCK_FILE).write_text(stale + "\n")
        with folder.FolderLock(tmp_path):
            assert (tmp_path / folder.LOCK_FILE).read_text().split() == [str(os.getpid()), host]
        assert not (tmp_path / folder.LOCK_FILE).exists()


# ---------------------------------------------------------------------------------------------------- table


def _run(arm, seed, status, values):
    return report.Run(arm, seed, status, [{"step": step, "reward": value} for step, value in values])


def test_window_means_and_std_over_seeds_hand_worked():
    window = report.Window(2, 3)
    seed0 = _run("a", 0, "finished", [(1, 10.0), (2, 1.0), (3, 2.0)])  # window mean 1.5
    seed1 = _run("a", 1, "finished", [(1, 10.0), (2, 3.0), (3, None)])  # None: not logged -> mean 3.0
    failed = _run("a", 2, "failed", [(2, 100.0)])  # a failed seed is not averaged
    assert report.window_mean(seed0.rows, "reward", window) == 1.5
    assert report.window_mean(seed1.rows, "reward", window) == 3.0
    mean, std, n = report.arm_summary([seed0, seed1, failed], "reward", window)
    assert (mean, n) == (2.25, 2) and std == pytest.approx(statistics.stdev([1.5, 3.0]), rel=1e-12)
    assert report.format_cell((mean, std, n)) == "2.25 ± 1.1"
    assert report.format_cell(report.arm_summary([seed0], "reward", window)) == "1.5"
    assert report.arm_summary([seed0], "reward", report.Window(5, 9)) is None
    assert report.arm_header("a", [seed0, seed1, failed]) == "a (n=2) seed 2 FAILED"


def test_table_marks_an_arm_without_finished_runs():
    record = {"arms": {"good": {}, "bad": {}}, "seeds": [0]}
    runs = [_run("good", 0, "finished", [(1, 0.5)]), _run("bad", 0, "failed", [])]
    table = report.markdown_tables(record, runs, [report.Window(1, 1, "all")])
    reward_line = next(line for line in table.splitlines() if line.startswith("| `reward`"))
    assert reward_line == "| `reward` | 0.5 | failed |"


def test_per_seed_tables_show_each_counted_runs_window_mean():
    record = {"arms": {"a": {}, "b": {}}, "seeds": [0, 1]}
    runs = [_run("a", 0, "finished", [(1, 1.0), (2, 2.0)]), _run("a", 1, "failed", [(1, 9.0)]),
            _run("b", 0, "stopped", [(1, 4.0)]), _run("b", 1, "finished", [(1, 0.25), (2, None)])]
    window = report.Window(1, 2, "all")
    lines = report.per_seed_tables(record, runs, [window]).splitlines()
    assert lines[0] == "### steps 1-2 (all)"
    rows = [line.split(" | ")[:3] for line in lines[4:] if line]
    assert rows == [["| a", "0", "1.5"], ["| b", "1", "0.25"]]  # failed and unfinished runs are left out
    partial = report.per_seed_tables(record, runs, [report.Window(1, 1)], partial=True).splitlines()
    assert [line.split(" | ")[:3] for line in partial[4:] if line] == [["| a", "0", "1"], ["| b", "0", "4"],
                                                                       ["| b", "1", "0.25"]]


def test_windows():
    assert report.default_windows(300) == [report.Window(1, 300, "all"), report.Window(226, 300, "last 75 steps")]
    assert report.default_windows(1) == [report.Window(1, 1, "all")]
    assert report.parse_windows("1-64, 237-300") == [report.Window(1, 64), report.Window(237, 300)]
    for bad in ("5", "0-3", "9-2", "a-b"):
        with pytest.raises(ValueError, match="--windows"):
            report.parse_windows(bad)


def test_curve_mean_and_band_over_finished_seeds():
    runs = [_run("a", 0, "finished", [(1, 1.0), (2, 3.0)]), _run("a", 1, "finished", [(1, 2.0), (2, None)]),
            _run("a", 2, "running", [(1, 50.0)])]
    assert report.curve(runs, "reward") == ([1, 2], [1.5, 3.0], [1.0, 3.0], [2.0, 3.0])
    # Trailing moving average of 2 logged values per seed: seed 0 becomes 1.0, 2.0.
    assert report.curve(runs, "reward", smooth=2) == ([1, 2], [1.5, 2.0], [1.0, 2.0], [2.0, 2.0])


def test_partial_counts_unfinished_runs_only_for_the_windows_they_reach():
    window = report.Window(1, 2)
    finished = _run("a", 0, "finished", [(1, 1.0), (2, 3.0), (3, 5.0)])  # window mean 2.0
    stopped = _run("a", 1, "stopped", [(1, 4.0), (2, 6.0)])  # reaches step 2: window mean 5.0
    short = _run("a", 2, "interrupted", [(1, 100.0)])  # never reaches step 2
    failed = _run("a", 3, "failed", [(1, 7.0), (2, 7.0), (3, 7.0)])  # never counted, even with partial
    runs = [finished, stopped, short, failed]
    assert report.arm_summary(runs, "reward", window) == (2.0, None, 1)  # default: finished seeds only
    mean, std, n = report.arm_summary(runs, "reward", window, partial=True)
    assert (mean, n) == (3.5, 2) and std == pytest.approx(statistics.stdev([2.0, 5.0]), rel=1e-12)
    assert report.arm_summary(runs, "reward", report.Window(1, 1), partial=True)[:3:2] == (35.0, 3)
    assert report.arm_header("a", runs, window, partial=True) == (
        "a (n=2) seed 1 to step 2 (stopped); seed 2 interrupted at step 1; seed 3 FAILED")
    assert report.arm_header("a", runs, window) == (
        "a (n=1) seed 1 stopped at step 2; seed 2 interrupted at step 1; seed 3 FAILED")
    # The figure draws a partial run up to its last step; a failed one never.
    assert report.curve(runs, "reward", partial=True) == ([1, 2, 3], [35.0, 4.5, 5.0], [1.0, 3.0, 5.0],
                                                          [100.0, 6.0, 5.0])
    assert report.curve(runs, "reward") == ([1, 2, 3], [1.0, 3.0, 5.0], [1.0, 3.0, 5.0], [1.0, 3.0, 5.0])


def test_table_cells_of_an_arm_whose_runs_did_not_get_there():
    record = {"arms": {"done": {}, "short": {}, "none": {}}, "seeds": [0]}
    runs = [_run("done", 0, "finished", [(1, 0.5), (2, 0.7)]), _run("short", 0, "stopped", [(1, 0.25)]),
            _run("none", 0, "not started", [])]
    windows = [report.Window(1, 1), report.Window(1, 2)]
    lines = [line for line in report.markdown_tables(record, runs, windows, partial=True).splitlines()
             if line.startswith("| `reward`")]
    assert lines == ["| `reward` | 0.5 | 0.25 | not run |", "| `reward` | 0.6 | not reached | not run |"]
    lines = [line for line in report.markdown_tables(record, runs, windows[:1]).splitlines()
             if line.startswith("| `reward`")]
    assert lines == ["| `reward` | 0.5 | unfinished | not run |"]


def _synthetic_folder(root: Path, runs: dict) -> None:
    """A comparison folder as `calclip compare` leaves it: record, per-run status and metrics files."""
    record = {"format": folder.FORMAT_VERSION, "created": "2026-12-01 00:00:00", "group": "g",
              "config_path": "configs/x.yaml", "seeds": sorted({seed for _, seed in runs}),
              "arms": {arm: {"overrides": {}, "description": "", "config": {"max_steps": 4}}
                       for arm, _ in runs}}
    root.mkdir(parents=True)
    (root / folder.COMPARISON_FILE).write_text(json.dumps(record))
    for (arm, seed), (status, rewards) in runs.items():
        directory = folder.run_directory(root, arm, seed)
        directory.mkdir(parents=True)
        (directory / runner.STATUS_FILE).write_text(json.dumps({"status": status, "pid": 1, "wall_s": 0.0}))
        with (directory / metrics.METRICS_FILE).open("w") as handle:
            for step, reward in enumerate(rewards, start=1):
                handle.write(json.dumps({"step": step, "time": float(step), "reward": reward}) + "\n")


def test_a_running_status_with_no_live_compare_reads_as_interrupted(tmp_path):
    root = tmp_path / "cmp"
    _synthetic_folder(root, {("a", 0): ("running", [1.0, 2.0])})
    assert [run.status for run in report.load_runs(root)[1]] == ["interrupted"]
    (root / folder.LOCK_FILE).write_text(f"{os.getpid()} {__import__('socket').gethostname()}\n")
    assert [run.status for run in report.load_runs(root)[1]] == ["running"]  # a live compare holds the folder
    (root / folder.LOCK_FILE).write_text(f"{os.getpid()} some-other-host\n")  # a folder copied off a machine
    assert [run.status for run in report.load_runs(root)[1]] == ["interrupted"]


def test_plot_only_partial_reports_the_metrics_files_numbers(tmp_path, capsys):
    root = tmp_path / "cmp"
    _synthetic_folder(root, {("a", 0): ("finished", [1.0, 2.0, 3.0, 4.0]), ("a", 1): ("finished", [3.0, 4.0, 5.0, 6.0]),
                             ("b", 0): ("running", [0.5, 1.5, 2.5]), ("b", 1): ("running", [1.5, 0.5])})
    assert command.main(["--plot-only", str(root), "--windows", "1-2,1-3", "--partial"]) in (
        command.EXIT_OK, command.EXIT_FAILED_RUNS)  # the latter without matplotlib (no figure)
    text = (root / report.REPORT_FILE).read_text()
    reward = [line for line in text.splitlines() if line.startswith("| `reward`")]
    # steps 1-2: a = mean(1.5, 3.5) +- stdev; b = mean(1.0, 1.0) over both interrupted seeds. Steps 1-3: b seed 1
    # stops at step 2, so only seed 0 (mean 1.5) counts.
    assert reward == [f"| `reward` | 2.5 ± {statistics.stdev([1.5, 3.5]):.2g} | 1 ± 0 |",
                      f"| `reward` | 3 ± {statistics.stdev([2.0, 4.0]):.2g} | 1.5 |"]
    assert "b (n=1) seed 0 to step 3 (interrupted); seed 1 interrupted at step 2" in text
    assert "`--partial`" in text
    command.main(["--plot-only", str(root), "--windows", "1-2"])  # without --partial: interrupted runs left out
    reward = [line for line in (root / report.REPORT_FILE).read_text().splitlines() if line.startswith("| `reward`")]
    assert reward == [f"| `reward` | 2.5 ± {statistics.stdev([1.5, 3.5]):.2g} | unfinished |"]


def _with_commands(root: Path, argv_of) -> None:
    """command.json of every run of a _synthetic_folder: ``argv_of(arm, seed)``."""
    record = json.loads((root / folder.COMPARISON_FILE).read_text())
    for arm in record["arms"]:
        for seed in record["seeds"]:
            directory = folder.run_directory(root, arm, seed)
            (directory / folder.COMMAND_FILE).write_text(json.dumps({"train_argv": argv_of(arm, seed)}))


def _argv(arm, seed, lr="1e-5"):
    directory = f"/runs/cmp/{arm}/seed{seed}"
    overrides = {"a": ["--fp8", "true"], "b": ["--fp8=false"]}[arm]  # old-style and new-style flags parse alike
    return ["--config", "/configs/x.yaml", "--learning_rate", lr, *overrides, "--seed", str(seed), "--output_dir",
            directory, "--run_name", f"{arm}-seed{seed}", "--metrics_file", f"{directory}/metrics.jsonl",
            "--checkpoint_on_sigterm", "true"]


def test_plot_only_refuses_runs_whose_command_differs_from_the_comparison(tmp_path, capsys):
    root = tmp_path / "cmp"
    _synthetic_folder(root, {(arm, seed): ("finished", [1.0, 2.0]) for arm in "ab" for seed in (0, 1)})
    record = json.loads((root / folder.COMPARISON_FILE).read_text())
    record["arms"]["a"]["overrides"], record["arms"]["b"]["overrides"] = {"fp8": True}, {"fp8": False}
    (root / folder.COMPARISON_FILE).write_text(json.dumps(record))
    _with_commands(root, _argv)
    assert folder.command_differences(root, record) == []
    assert command.main(["--plot-only", str(root)]) in (command.EXIT_OK, command.EXIT_FAILED_RUNS)
    capsys.readouterr()
    cases = [  # (run, its argv, what the refusal names)
        (("b", 1), _argv("b", 1, lr="3e-4"), r"b/seed1/command.json: shared flags differ from .*a/seed0/command.json: "
                                             r"--learning_rate 3e-4 vs 1e-5"),
        (("a", 1), _argv("b", 1), r"a/seed1/command.json: --fp8 false, the comparison's a seed 1 has true"),
        (("a", 1), _argv("a", 0), r"a/seed1/command.json: --seed 0, the comparison's a seed 1 has 1"),
        (("b", 0), [*_argv("b", 0), "--resume_from_checkpoint", "/x"], None),  # a run field: resumes differ
    ]
    for (arm, seed), argv, match in cases:
        _with_commands(root, _argv)
        path = folder.run_directory(root, arm, seed) / folder.COMMAND_FILE
        path.write_text(json.dumps({"train_argv": argv}))
        code = command.main(["--plot-only", str(root)])
        err = capsys.readouterr().err
        if match is None:
            assert code in (command.EXIT_OK, command.EXIT_FAILED_RUNS), err
        else:
            assert code == command.EXIT_USAGE and "recorded command differs from the comparison" in err
            assert __import__("re").search(match, err), err
    path.write_text("{not json")
    assert command.main(["--plot-only", str(root)]) == command.EXIT_USAGE
    assert "b/seed0/command.json: not a command file calclip compare wrote" in capsys.readouterr().err


@pytest.mark.parametrize("lines, match", [
    (['{"step": 1, "reward": 1.0}', "garbage", '{"step": 3, "reward": 3.0}'], r"metrics.jsonl:2: not a JSON line"),
    (['{"step": 1, "reward": 1.0}', '{"step": 2, "reward": "0.5"}'], r"metrics.jsonl:2: 'reward' must be a number "
                                                                     r"or null, got '0.5' \(str\)"),
    (['{"step": 1, "reward": true}'], r"metrics.jsonl:1: 'reward' must be a number or null, got True"),
    (['{"step": "1", "reward": 1.0}'], r"metrics.jsonl:1: 'step' must be an integer >= 0, got '1'"),
    (['[1, 2]'], r"metrics.jsonl:1: a row must be a JSON object, got list"),
])
def test_bad_metrics_lines_are_named_with_file_and_line(tmp_path, capsys, lines, match):
    """A middle line that is not JSON, or a value that is not a number, is an error naming the file and line (a
    killed writer's unterminated last line is still ignored: test_read_last_step_and_truncate)."""
    root = tmp_path / "cmp"
    _synthetic_folder(root, {("a", 0): ("finished", [1.0, 2.0])})
    path = folder.run_directory(root, "a", 0) / metrics.METRICS_FILE
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(metrics.MetricsFileError, match=match):
        metrics.read_metrics(path)
    assert command.main(["--plot-only", str(root)]) == command.EXIT_USAGE
    assert __import__("re").search(match, capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------------- command errors


def test_command_refuses_bad_input_before_running(tmp_path, capsys):
    config = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    cases = [
        (["--arms", "bf16_static,fp8_stattic"], "unknown arm(s) 'fp8_stattic'; valid arms: bf16_static"),
        (["--arms", "fp8_static", "--clip_mode", "calibrated"], "--clip_mode is an arm field (set by fp8_static)"),
        (["--arms", "fp8_static", "--output_dir", "x"],
         "--output_dir is set by calclip compare per run (use --output-dir)"),
        (["--arms", "fp8_static", "--seeds", "0,x"], "--seeds: 'x' is not an integer"),
        (["--arms", "fp8_static", "--parallel", "0"], "--parallel must be >= 1"),
        # abbreviations and dashed spellings of the fields compare sets per run pass no guard
        (["--arms", "fp8_static", "--resume_from_check", "x"], "--resume_from_check is not a `calclip train` field"),
        (["--arms", "fp8_static", "--resume-from-checkpoint", "x"], "--resume_from_checkpoint is set by calclip "
                                                                     "compare per run"),
        (["--arms", "fp8_static", "--clip-mode", "static"], "--clip_mode is an arm field"),
        (["--arms", "fp8_static", "--max_step", "3"], "--max_step is not a `calclip train` field"),
        (["--arms", "x", "--arm", "x:fp8=true --resume_from_checkpoint y"], "would read as a flag"),
    ]
    for extra, expected in cases:
        assert command.main(["--config", config, "--output-dir", str(tmp_path / "c"), *extra]) == command.EXIT_USAGE
        assert expected in capsys.readouterr().err
    assert command.main(["--config", str(tmp_path / "none.yaml")]) == command.EXIT_USAGE
    assert "no such file" in capsys.readouterr().err
    assert command.main(["--plot-only", str(tmp_path)]) == command.EXIT_USAGE
    assert "no comparison.json" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # nothing was created


def test_an_arm_can_name_an_fp8_recipe():
    """Speed and dropout of the granularities side by side, one arm per recipe."""
    pytest.importorskip("torchao", reason="the rowwise recipe converts through torchao (calclip[torchao])")
    root = Path(__file__).resolve().parents[2]
    arm = arms.parse_arm_spec("rowwise_static:fp8=true,fp8_recipe=rowwise,clip_mode=static,tis_mode=none")
    config = command._resolve(arm, str(root / "configs" / "demo.yaml"), [], root / "runs" / "unused")
    assert (config["fp8"], config["fp8_recipe"], config["clip_mode"]) == (True, "rowwise", "static")
    with pytest.raises(ValueError, match="fp8_recipe"):
        command._resolve(arms.parse_arm_spec("bad:fp8=true,fp8_recipe=columnwise"), str(root / "configs" / "demo.yaml"),
                         [], root / "runs" / "unused")


def test_list_arms(capsys):
    assert command.main(["--list-arms"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in arms.PRESETS) and "tis_mode=token_truncate" in out


def test_the_evidence_config_leaves_the_arm_fields_to_the_arms():
    import yaml

    from calclip.cli.arguments import parse_train_args

    path = Path(__file__).resolve().parents[2] / "configs" / "compare_smollm2.yaml"
    raw = yaml.safe_load(path.read_text())
    assert not set(raw) & arms.arm_fields(list(arms.PRESETS.values()))
    script_args, args = parse_train_args(["--config", str(path)])
    # The evidence runs' setting (docs/evidence.md): the embedded model, >= 300 optimizer steps; resumes land on
    # generation-cycle ends.
    assert script_args.model_name_or_path == "default" and args.max_steps >= 300
    assert args.save_steps % (args.steps_per_generation * args.num_iterations) == 0


def test_usage_doc_lists_every_preset_and_metric():
    usage = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    for arm in arms.PRESETS.values():
        fields = ", ".join(f"`{key}={report._show(value)}`" for key, value in arm.overrides.items())
        assert f"| `{arm.name}` | {fields} |" in usage
    section = usage.split("## `calclip compare`", 1)[1].split("\n## ", 1)[0]
    assert all(f"`{name}`" in section for name in metrics.FIELD_NAMES)


def test_redrawing_needs_neither_torch_nor_trl():
    # `--plot-only` on a laptop with the copied folder: the table and figure modules import no ML stack.
    import subprocess
    import sys

    code = ("import sys; from calclip.compare import command, report; command.main(['--list-arms']); "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trl', 'transformers'}); "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr


def test_command_refuses_runs_that_would_fail_or_clash_before_any_starts(tmp_path, capsys):
    """A compare output dir that is a file, a seed the trainer refuses and an arm named like a file compare writes
    failed after launch (a traceback, or every run trained and then the report could not be written): exit 2
    before anything runs now."""
    config = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    (tmp_path / "file").write_text("x")
    cases = [
        (["--output-dir", str(tmp_path / "file")], f"--output-dir {tmp_path / 'file'} is a file, not a folder"),
        (["--output-dir", str(tmp_path / "file" / "c")], f"lies under {tmp_path / 'file'}, which is a file"),
        (["--seeds", "0,-1"], "--seeds: -1 is not a seed calclip train takes (0 to 2**32 - 1"),
        (["--seeds", str(2**32)], f"--seeds: {2**32} is not a seed calclip train takes"),
        (["--time-limit", "-5"], "--time-limit must be a finite number of seconds > 0, got -5.0"),
        (["--time-limit", "nan"], "--time-limit must be a finite number of seconds > 0, got nan"),
        (["--stop-timeout", "-1"], "--stop-timeout must be a finite number of seconds >= 0, got -1.0"),
        (["--stop-timeout", "inf"], "--stop-timeout must be a finite number of seconds >= 0, got inf"),
    ]
    for name in arms.COMPARISON_FILES[:2] + arms.COMPARISON_FILES[3:] + ("Report.MD",):
        cases.append((["--arms", name, "--arm", f"{name}:fp8=false"], f"arm name {name!r} is a file calclip compare "
                                                                       "writes"))  # fmt: skip
    for extra, expected in cases:
        argv = ["--config", config, "--arms", "fp8_static", *extra]
        if "--output-dir" not in extra:
            argv += ["--output-dir", str(tmp_path / "c")]
        assert command.main(argv) == command.EXIT_USAGE, extra
        assert expected in capsys.readouterr().err, extra
    assert not (tmp_path / "c").exists()  # nothing was created
    assert (tmp_path / "file").read_text() == "x"


def test_the_reserved_arm_names_are_the_files_compare_writes():
    from calclip.compare import report

    written = {folder.COMPARISON_FILE, folder.LOCK_FILE, report.REPORT_FILE, report.FIGURE_FILE, "config.yaml",
               Path(folder.COMPARISON_FILE).with_suffix(".tmp").name}  # fmt: skip
    assert set(arms.COMPARISON_FILES) == written


def test_the_trainer_refuses_the_seeds_compare_refuses():
    from calclip.trainers.config import CalibratedGRPOConfig

    for seed in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"seed must be finite and in \[0, 4294967295\], got {seed}"):
            CalibratedGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", seed=seed)
    with pytest.raises(ValueError, match=r"data_seed must be finite and in \[0, 4294967295\], got -3"):
        CalibratedGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", data_seed=-3)
