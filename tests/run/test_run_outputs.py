"""The per-run metrics file (calclip.run.run_outputs): rows keep the trainer's names, nulls and non-finite
values; reading keeps the last row of a step and skips a killed writer's unterminated line; truncation for resume."""

import json
import math

from calclip.run import run_outputs


def test_metrics_row_keeps_trainer_names_nulls_and_nonfinite():
    logs = {"loss": 0.5, "reward": 0.25, "entropy": float("nan"), "calib/low": 0.7, "step_time": 1.5, "epoch": 0.1}
    row = run_outputs.metrics_row(logs, step=3, time=12.34567)
    assert list(row) == list(run_outputs.FIELD_NAMES)
    assert row["step"] == 3 and row["time"] == 12.346 and row["reward"] == 0.25 and row["calib/low"] == 0.7
    assert math.isnan(row["entropy"])  # a collapse stays visible
    assert row["clip/neg_low_frac_bf16"] is None
    assert run_outputs.metrics_row({"train_runtime": 3.0, "train_loss": 0.1, "epoch": 1.0}, 3, 1.0) is None


def test_read_last_step_and_truncate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward": s / 10}) for s in (1, 2, 3)] + [json.dumps({"step": 2, "reward": 9.0})]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "rew')  # a resumed step 2 and a killed writer's line
    rows = run_outputs.read_metrics(path)
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[1]["reward"] == 9.0
    assert run_outputs.last_step(path) == 2  # the last complete line
    run_outputs.truncate_metrics(path, 2)
    assert [(row["step"], row["reward"]) for row in run_outputs.read_metrics(path)] == [(1, 0.1), (2, 9.0)]
    assert (run_outputs.last_step(tmp_path / "missing.jsonl") == 0
            and run_outputs.read_metrics(tmp_path / "missing") == [])
