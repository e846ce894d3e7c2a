"""`calclip train | demo | diagnose` through the python entry points, on the tiny offline model."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calclip import cli
from calclip.cli.arguments import parse_train_args
from calclip.cli.demo import DEMO_TABLE_COLUMNS, demo, format_metrics_table, out_of_sample_summary
from calclip.cli.diagnose import diagnose
from calclip.cli.train import build_trainer, train

ROOT = Path(__file__).resolve().parents[1]
DEMO_YAML = str(ROOT / "configs" / "demo.yaml")


def test_usage_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert "calclip {train,demo,diagnose,compare}" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_compare_is_a_command_returning_its_exit_status(capsys):
    assert cli.main(["compare", "--list-arms"]) == 0
    assert "fp8_calibrated" in capsys.readouterr().out
    assert cli.main(["compare", "--config", DEMO_YAML, "--arms", "fp8_calibratd"]) == 2
    assert "unknown arm(s) 'fp8_calibratd'" in capsys.readouterr().err


def test_module_entry_point_runs():
    # `python -m calclip` is the same entry as the console script (and `accelerate launch -m calclip.cli`).
    result = subprocess.run(
        [sys.executable, "-m", "calclip", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0 and "train" in result.stdout


def test_format_metrics_table_hand_worked():
    history = [
        {"loss": 0.1, "reward": 0.5, "entropy": 1.25, "calib/low": 0.6, "calib/high": 1.8, "step": 1},
        {"reward": 0.75, "calib/low": 0.7125, "calib/high": 1.5, "clip/neg_low_frac_fp8": 0.25,
         "clip/neg_low_frac_fp8_static": 0.125, "clip/neg_low_frac_bf16": 0.0,
         "mismatch/token_mult_prob_error": 1.0312,
         "mismatch/fp8_bf16_token_mult_prob_error": float("nan"), "calib/fit": 1.0, "step": 2},
        {"calib/low": 0.7125, "calib/high": 1.5, "calib/fit": 0.0, "step": 3},
        {"train_runtime": 3.0, "step": 3},  # the end-of-training summary is not a row
    ]
    lines = format_metrics_table(history).splitlines()
    assert len(lines) == 5
    assert [cell.strip() for cell in lines[0].split("  ") if cell.strip()] == [
        title for title, _, _ in DEMO_TABLE_COLUMNS
    ]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["1", "0.500", "1.250", "0.600", "1.800", "-", "-", "-", "-", "-", "-"]
    # NaN shows as "-"; the calib column marks a committed calibration "fit", a round below the minimum "short"
    assert lines[3].split() == ["2", "0.750", "-", "0.713", "1.500", "fit", "0.250", "0.125", "0.000", "1.0312", "-"]
    assert lines[4].split() == ["3", "-", "-", "0.713", "1.500", "short", "-", "-", "-", "-", "-"]
    assert len({len(line) for line in lines}) == 1  # right-aligned columns of equal width


def _oos(step, tokens, fp8, bf16, static_share, **extra):
    return {"step": step, "oos/shadow_neg_tokens": float(tokens), "oos/shadow_fp8_drops": float(fp8),
            "oos/shadow_bf16_drops": float(bf16), "clip/neg_low_frac_fp8_static": static_share, **extra}


def test_out_of_sample_summary_hand_worked():
    """Only the steps after the first committed fit count (their bounds were fitted on earlier rounds' tokens):
    steps 6 and 8 here, 50 + 20 = 70 A<0 tokens. Calibrated drops 2 + 1 = 3 (4.3%); static at 1-eps
    0.1 * 50 + 0.25 * 20 = 10 (14.3%); the BF16 shadow 2 + 1 = 3 (4.3%)."""
    history = [
        {"step": 1, "reward": 0.5},
        _oos(2, 20, 9, 0, 0.5, **{"calib/fit": 0.0, "calib/pool_neg_tokens": 20.0}),  # initial bounds: not counted
        {"step": 3},
        _oos(4, 30, 7, 1, 0.2, **{"calib/fit": 1.0, "calib/neg_tokens": 40.0}),  # scored before its own fit
        _oos(6, 50, 2, 2, 0.1, **{"calib/fit": 1.0}),
        {"step": 7},
        _oos(8, 20, 1, 1, 0.25, **{"calib/fit": 0.0}),
        {"train_runtime": 3.0, "step": 8},
    ]
    text = out_of_sample_summary(history, min_tokens=32)
    assert text.startswith("Pooled calibrations committed at the end of steps 4, 6.")
    assert "steps 6, 8: 70 A<0 tokens" in text
    assert "dropped 4.3% of the A<0 penalties (3)" in text
    assert "would have dropped 14.3% (10) under FP8" in text
    assert "the BF16 shadow 4.3% (3)" in text


def test_out_of_sample_summary_without_a_fit_names_the_pool_and_the_minimum():
    history = [{"step": 1}, _oos(2, 12, 1, 0, 0.1, **{"calib/fit": 0.0, "calib/pool_neg_tokens": 12.0}),
               _oos(4, 9, 0, 0, 0.0, **{"calib/fit": 0.0, "calib/pool_neg_tokens": 21.0})]
    text = out_of_sample_summary(history, min_tokens=32)
    assert text.startswith("No pooled calibration committed (the pool held 21 A<0 tokens; calibration_min_tokens 32)")


@pytest.mark.slow
def test_train_on_tiny_model_via_python_entry(tmp_path):
    argv = [
        "--config", DEMO_YAML,
        "--model_name_or_path", "tiny",
        "--output_dir", str(tmp_path),
        "--report_to", "none",
        "--max_steps", "2",
        "--max_completion_length", "8",
        "--num_train_examples", "16",
        "--save_final_model", "true",
    ]
    trainer = train(argv)
    assert trainer.state.global_step == 2
    assert trainer.args.fp8 and trainer.args.clip_mode == "calibrated"  # from demo.yaml
    assert trainer.reward_func_names == ["arithmetic_reward", "format_reward"]  # the arithmetic task's rewards
    assert trainer.reward_weights.tolist() == [1.0, 0.5]
    steps = [entry for entry in trainer.state.log_history if "calib/low" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    for entry in steps:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["entropy"])
        assert 0.2 <= entry["calib/low"] <= 1.0 <= entry["calib/high"] <= 5.0
    # The saved model reloads through the same loader as any local directory.
    from calclip.models import load_model

    reloaded, tokenizer = load_model(str(tmp_path))
    assert reloaded.config.vocab_size == len(tokenizer)


@pytest.mark.slow
def test_train_with_local_dataset_and_dapo(tmp_path):
    import json

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1=?"}], "answer": i + 1} for i in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    script_args, args = parse_train_args([
        "--config", str(ROOT / "configs" / "dapo_fp8_calibrated.yaml"),
        "--model_name_or_path", "tiny", "--dataset_path", str(data), "--output_dir", str(tmp_path / "out"),
        "--report_to", "none", "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--steps_per_generation", "2", "--max_completion_length", "8", "--overlong_buffer_length", "4",
        "--dynamic_sampling_max_rounds", "1", "--gradient_checkpointing", "false",
    ])
    trainer = build_trainer(script_args, args)
    from calclip.trainers.dapo import CalibratedDAPOTrainer

    assert isinstance(trainer, CalibratedDAPOTrainer)
    assert len(trainer.train_dataset) == 8 and trainer.train_dataset[3]["answer"] == 4
    assert trainer.reward_func_names == ["arithmetic_reward", "format_reward", "soft_overlong_punishment"]
    trainer.train()
    entry = next(e for e in trainer.state.log_history if "dynamic_sampling/rounds" in e)
    assert entry["dynamic_sampling/rounds"] == 1 and math.isfinite(entry["loss"])


@pytest.mark.slow
def test_demo_on_tiny_model_prints_table_and_writes_offline_wandb_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    trainer = demo(["--model", "tiny", "--max-steps", "2", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert os.environ["WANDB_MODE"] == "offline"
    assert trainer.state.global_step == 2 and "wandb" in trainer.args.report_to
    table = out[out.index("step  "):].splitlines()
    assert table[0].split()[:5] == ["step", "reward", "entropy", "low", "high"]
    assert [line.split()[0] for line in table[2:4]] == ["1", "2"]
    assert "total" in out and "model load" in out
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and f"W&B offline run: {runs[0]}" in out


def test_diagnose_tiny(capsys):
    result = diagnose(["--model", "tiny", "--seq-len", "32"])
    out = capsys.readouterr().out
    assert result["torch"] == torch.__version__ and "trl" in result and "torch._scaled_mm" in result
    assert result["tokens"] == 4 * 31
    # FP8 changes the log-probs, but only a little on a tiny random model.
    assert 0.0 < result["log_ratio_std"] < 0.2
    assert 1.0 < result["token_mult_prob_error"] < 1.2
    assert "token-mult-prob-error" in out


@pytest.mark.slow
@pytest.mark.parametrize("script", ["one_line_swap.py", "dapo_example.py"])
def test_examples_run_offline_on_the_tiny_model(script, tmp_path, capsys):
    import runpy

    namespace = runpy.run_path(str(ROOT / "examples" / script))  # defines main() without running it
    trainer = namespace["main"](["--max-steps", "2", "--output-dir", str(tmp_path)])
    assert trainer.state.global_step == 2
    low, high = trainer.clip_bounds
    assert 0.2 <= low <= 1.0 <= high <= 5.0
    assert "clip bounds in force" in capsys.readouterr().out


def test_train_flags_toggle_compile_layers(tmp_path):
    """compile_layers is a flag of `calclip train`: unset it is null (the trainer's auto rule), true/false force it;
    compile_layers_shapes likewise."""
    base = ["--output_dir", str(tmp_path), "--report_to", "none"]
    assert parse_train_args(base)[1].compile_layers is None
    assert parse_train_args(base + ["--compile_layers", "false"])[1].compile_layers is False
    _, args = parse_train_args(base + ["--compile_layers", "true", "--compile_layers_backend", "aot_eager"])
    assert args.compile_layers is True and args.compile_layers_backend == "aot_eager"
    # their shapes: null (the recipe's choice) unless given
    assert parse_train_args(base)[1].compile_layers_shapes is None
    assert parse_train_args(base + ["--compile_layers_shapes", "bucketed"])[1].compile_layers_shapes == "bucketed"


def test_calclip_train_exits_2_naming_what_the_command_line_got_wrong(tmp_path, capsys):
    """Arguments refused before any run starts: an unknown field, a bad value, an explicit resume path that is no
    checkpoint. `calclip train` printed a traceback and exited 1; the function itself still raises (scripts, tests)."""
    from calclip.cli import main
    from calclip.cli.train import train

    base = ["train", "--model_name_or_path", "tiny", "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    cases = (
        (["--no_such_field", "1"], "no_such_field"),
        (["--calibration_min_tokens", "-3"], "calibration_min_tokens"),
        (["--resume_from_checkpoint", str(tmp_path / "checkpoint-7")], "checkpoint-7"),
    )
    for extra, named in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("calclip train: error: ") and named in err, err
        with pytest.raises(ValueError):
            train(base[1:] + extra)
    assert not (tmp_path / "out").exists()  # refused before the output dir was claimed
