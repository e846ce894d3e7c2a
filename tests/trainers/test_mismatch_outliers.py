"""Rollout-vs-trainer log-prob outliers: the JSONL log (caps, order, masking) and the trainer writing it."""

import json
import math

import pytest
import torch

from calclip.trainers.mismatch_outliers import FILE_NAME, MismatchOutlierLog, logp_gaps, outlier_path


def _tensors():
    trainer = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, float("nan"), -9.0, -1.0]])
    rollout = torch.tensor([[-1.5, -9.0, -3.0, -0.1], [-7.5, -1.0, float("-inf"), -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return trainer, rollout, mask


def test_gaps_skip_masked_and_nonfinite_tokens():
    trainer, rollout, mask = _tensors()
    expected = torch.tensor([[0.5, 7.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]])  # [0, 3] masked; [1, 1] and [1, 2] not finite
    assert torch.equal(logp_gaps(trainer, rollout, mask), expected)


def test_record_writes_the_largest_gaps_first_within_the_caps(tmp_path):
    trainer, rollout, mask = _tensors()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    shadow = trainer - 0.25
    log = MismatchOutlierLog(tmp_path / "out.jsonl", 0.4, per_step=2, total=3)
    gaps = logp_gaps(trainer, rollout, mask)
    decode = lambda tokens: "|".join(map(str, tokens))  # noqa: E731
    assert log.record(step=3, rank=0, gaps=gaps, completion_ids=ids, trainer_logps=trainer, rollout_logps=rollout,
                      mask=mask, shadow_logps=shadow, decode=decode) == 3  # found 3 above 0.4 nats, wrote 2
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["row"], r["position"], r["abs_gap"]) for r in rows] in (
        [(0, 1, 7.0), (1, 0, 7.0)], [(1, 0, 7.0), (0, 1, 7.0)])  # the two 7-nat gaps, not the 0.5 one
    first = next(r for r in rows if r["row"] == 0)
    assert first == {"step": 3, "rank": 0, "row": 0, "position": 1, "token_id": 6, "rollout_logp": -9.0,
                     "trainer_logp": -2.0, "abs_gap": 7.0, "shadow_logp": -2.25, "completion_length": 3,
                     "token": "6", "completion": "5|6|7"}
    # The run total caps the next call at one row: the largest remaining one.
    log.record(step=4, rank=0, gaps=gaps, completion_ids=ids, trainer_logps=trainer, rollout_logps=rollout, mask=mask)
    log.record(step=5, rank=0, gaps=gaps, completion_ids=ids, trainer_logps=trainer, rollout_logps=rollout, mask=mask)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 3, 4] and rows[2]["abs_gap"] == 7.0 and rows[2]["shadow_logp"] is None
    assert "token" not in rows[2] and (log.written, log.seen) == (3, 9)


def test_bad_threshold_and_rank_file_names(tmp_path):
    with pytest.raises(ValueError, match="threshold"):
        MismatchOutlierLog(tmp_path / "x", 0.0)
    assert outlier_path(tmp_path, 0) == tmp_path / FILE_NAME
    assert outlier_path(tmp_path, 2) == tmp_path / "mismatch_outliers.rank2.jsonl"


def test_config_refuses_a_bad_threshold(tmp_path):
    from calclip.testing import tiny_training_args
    from calclip.trainers.config import CalibratedGRPOConfig

    for bad in (0, -1.0, "high"):
        with pytest.raises(ValueError, match="mismatch_dump_threshold"):
            tiny_training_args(CalibratedGRPOConfig, tmp_path, mismatch_dump_threshold=bad)
    assert tiny_training_args(CalibratedGRPOConfig, tmp_path, mismatch_dump_threshold=None).mismatch_dump_threshold is None


def test_trainer_writes_outliers_and_logs_the_step_max(tmp_path):
    """top_k=2 makes generate's processed scores (renormalized over two tokens) differ from the trainer's full
    softmax, so real rollout-vs-trainer gaps exist on the tiny model; each written row must be one of them."""
    from calclip.testing import tiny_trainer

    threshold = 0.05
    with pytest.warns(UserWarning, match="nats apart"):
        trainer = tiny_trainer(tmp_path, fp8=True, top_k=2, gradient_accumulation_steps=1, steps_per_generation=2,
                               max_steps=2, mismatch_dump_threshold=threshold)
        trainer.train()
    rows = [json.loads(line) for line in (tmp_path / FILE_NAME).read_text().splitlines()]
    assert rows and {r["step"] for r in rows} <= {1, 2}
    for r in rows:
        assert r["abs_gap"] > threshold and r["rollout_logp"] > r["trainer_logp"]  # top-2 renormalization raises it
        assert math.isclose(r["abs_gap"], r["rollout_logp"] - r["trainer_logp"], rel_tol=1e-5)
        assert isinstance(r["token"], str) and isinstance(r["completion"], str) and 0 <= r["position"] < 8
    logged = {entry["step"]: entry["mismatch/max_abs_logp_diff"] for entry in trainer.state.log_history
              if "mismatch/max_abs_logp_diff" in entry}
    for step, value in logged.items():
        step_rows = [r["abs_gap"] for r in rows if r["step"] == step]
        if step_rows:  # one micro-batch per step: the logged max is the step's largest written gap
            assert value == pytest.approx(max(step_rows), rel=1e-5)
        assert step_rows == sorted(step_rows, reverse=True) and len(step_rows) <= 32


def test_off_writes_nothing_but_still_logs_the_max(tmp_path):
    from calclip.testing import tiny_trainer

    trainer = tiny_trainer(tmp_path, fp8=False, top_k=2, gradient_accumulation_steps=1, steps_per_generation=2,
                           max_steps=1, mismatch_dump_threshold=None)
    trainer.train()
    assert not (tmp_path / FILE_NAME).exists()
    values = [e["mismatch/max_abs_logp_diff"] for e in trainer.state.log_history if "mismatch/max_abs_logp_diff" in e]
    assert values and all(v > 0 for v in values)
