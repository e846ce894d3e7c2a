"""Rollout-vs-trainer log-prob outliers: the JSONL log (caps, order, masking) and the trainer writing it."""

import json
import math

import pytest
import torch

from calclip.monitoring.mismatch_outliers import (
    BURST_NATS,
    FILE_NAME,
    MismatchOutlierLog,
    burst_counts,
    logp_gaps,
    outlier_path,
)


def _tensors():
    trainer = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, float("nan"), -9.0, -1.0]])
    rollout = torch.tensor([[-1.5, -9.0, -3.0, -0.1], [-7.5, -1.0, float("-inf"), -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return trainer, rollout, mask


def test_gaps_skip_masked_and_nonfinite_tokens():
    trainer, rollout, mask = _tensors()
    expected = torch.tensor([[0.5, 7.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]])  # [0, 3] masked; [1, 1] and [1, 2] not finite
    assert torch.equal(logp_gaps(trainer, rollout, mask), expected)


def test_burst_counts_count_compared_tokens_above_one_nat():
    trainer, rollout, mask = _tensors()
    # compared: [0, 0..2] and [1, 0], [1, 3] (masked [0, 3], non-finite [1, 1], [1, 2]); above 1 nat: 7.0 and 7.0
    hits, compared = burst_counts(logp_gaps(trainer, rollout, mask), trainer, rollout, mask)
    assert BURST_NATS == 1.0 and (int(hits), int(compared)) == (2, 5)
    exactly_one = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-2.0, -3.5]]), torch.ones(1, 2)  # gaps 1.0, 1.5
    assert [int(n) for n in burst_counts(logp_gaps(*exactly_one), *exactly_one)] == [1, 2]  # strictly above


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
    from calclip.trainers.config import CalibratedGRPOConfig
    from tests.fixtures import tiny_training_args

    for bad in (0, -1.0, "high"):
        with pytest.raises(ValueError, match="mismatch_dump_threshold"):
            tiny_training_args(CalibratedGRPOConfig, tmp_path, mismatch_dump_threshold=bad)
    assert tiny_training_args(CalibratedGRPOConfig, tmp_path,
                              mismatch_dump_threshold=None).mismatch_dump_threshold is None


@pytest.mark.slow
def test_trainer_writes_outliers_and_logs_the_step_max(tmp_path):
    """top_k=2 makes generate's processed scores (renormalized over two tokens) differ from the trainer's full
    softmax, so real rollout-vs-trainer gaps exist on the tiny model; each written row must be one of them."""
    from tests.fixtures import tiny_trainer

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


@pytest.mark.slow
def test_off_writes_nothing_but_still_logs_the_max(tmp_path):
    from tests.fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, fp8=False, top_k=2, gradient_accumulation_steps=1, steps_per_generation=2,
                           max_steps=1, mismatch_dump_threshold=None)
    trainer.train()
    assert not (tmp_path / FILE_NAME).exists()
    values = [e["mismatch/max_abs_logp_diff"] for e in trainer.state.log_history if "mismatch/max_abs_logp_diff" in e]
    assert values and all(v > 0 for v in values)


def _recording_mismatch(monkeypatch):
    """Wraps the trainer's mismatch metrics to keep each micro-batch's (trainer, rollout, mask) log-probs."""
    from calclip.trainers.grpo import CalibratedGRPOTrainer

    calls = []
    original = CalibratedGRPOTrainer._mismatch_outliers

    def recording(self, mode, inputs, old_logps, rollout, mask, stats, token_sums):
        calls.append((self.state.global_step + 1, old_logps.detach().double(), rollout.double(), mask.clone()))
        return original(self, mode, inputs, old_logps, rollout, mask, stats, token_sums)

    monkeypatch.setattr(CalibratedGRPOTrainer, "_mismatch_outliers", recording)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_step_max_and_burst_share_over_the_micro_batches_of_a_step(tmp_path, monkeypatch, fp8):
    """Two micro-batches per optimizer step (GA=2). With top_k=1 the rollout's log-prob of every sampled token is 0
    and the trainer's is log p(argmax); an LM head scaled x10 makes that p vary around 1/e across tokens, so some gaps
    are above 1 nat and some below. The logged max must be the larger micro-batch max (not their mean) and the burst
    share the token-weighted share over both micro-batches, recomputed here in float64 from the log-probs."""
    from calclip.trainers.config import CalibratedGRPOConfig
    from calclip.trainers.grpo import CalibratedGRPOTrainer
    from tests.fixtures import build_tiny_model, build_tiny_tokenizer, digit_share_reward, tiny_prompt_dataset
    from tests.fixtures import tiny_training_args

    calls = _recording_mismatch(monkeypatch)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    args = tiny_training_args(CalibratedGRPOConfig, tmp_path, fp8=fp8, top_k=1, gradient_accumulation_steps=2,
                              steps_per_generation=4, max_steps=2, mismatch_dump_threshold=None)
    trainer = CalibratedGRPOTrainer(model=model, reward_funcs=digit_share_reward, args=args,
                                    train_dataset=tiny_prompt_dataset(8), processing_class=tokenizer)
    trainer.train()
    logged_max = {e["step"]: e["mismatch/max_abs_logp_diff"] for e in trainer.state.log_history
                  if "mismatch/max_abs_logp_diff" in e}
    logged_share = {e["step"]: e["mismatch/gap_gt_1nat_frac"] for e in trainer.state.log_history
                    if "mismatch/gap_gt_1nat_frac" in e}
    assert sorted(logged_max) == sorted(logged_share) == [1, 2]
    maxima_differ = False
    for step in (1, 2):
        batches = [(t, r, m) for s, t, r, m in calls if s == step]
        assert len(batches) == 2
        maxima, hits, counts = [], 0, 0
        for trainer_logps, rollout, mask in batches:
            gap = (trainer_logps - rollout).abs()[mask != 0]
            maxima.append(float(gap.max()))
            hits, counts = hits + int((gap > 1.0).sum()), counts + gap.numel()
        maxima_differ |= abs(maxima[0] - maxima[1]) > 1e-3
        assert logged_max[step] == pytest.approx(max(maxima), rel=1e-5)
        assert logged_share[step] == pytest.approx(hits / counts, rel=1e-9)
        assert 0 < hits < counts  # the share is neither trivially 0 nor 1
    assert maxima_differ  # so the window max is told apart from the mean of the micro-batch maxima
