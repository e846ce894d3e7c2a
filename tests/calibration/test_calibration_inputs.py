"""Corrupt inputs to the calibration functions: ratios <= 0 are dropped and counted like non-finite ones (a ratio
is exp of a log-ratio), and advantages must have exactly one value per sequence or per token."""

import math

import pytest
import torch

from calclip.calibration import ClipCalibrator, calibrate_bounds, fit_bounds
from calclip.losses import clipped_surrogate


def test_nonpositive_ratios_are_excluded_and_counted_by_hand():
    # Five A<0 tokens; the first ratio is 0 (corrupt). Valid N- ratios [0.5, 0.9, 1.0, 1.1]:
    # alpha = 1/4 (only 0.5 < 0.8), L = quantile(., 0.25) = 0.5 + 0.75 * (0.9 - 0.5) = 0.8.
    ratio = torch.tensor([0.0, 0.5, 0.9, 1.0, 1.1], dtype=torch.float64)
    advantages = -torch.ones(5, dtype=torch.float64)
    result = calibrate_bounds(ratio, ratio, advantages, torch.ones(5), eps_low=0.2, eps_high=0.2)
    assert result.alpha == 0.25 and result.num_neg == 4 and result.num_nonfinite == 1
    assert math.isclose(result.low, 0.8, rel_tol=1e-12)


@pytest.mark.parametrize("bad", [0.0, -0.3, -math.inf])
@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_calibrate_bounds_with_a_nonpositive_ratio_equals_the_token_masked_out(bad, which):
    generator = torch.Generator().manual_seed(0)
    rb = torch.exp(0.3 * torch.randn(4, 6, generator=generator))
    rq = rb * torch.exp(0.1 * torch.randn(4, 6, generator=generator))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(4, 6)
    corrupt_rb, corrupt_rq = rb.clone(), rq.clone()
    (corrupt_rb if which == "bf16" else corrupt_rq)[1, 2] = bad
    (corrupt_rb if which == "bf16" else corrupt_rq)[0, 4] = bad
    masked = mask.clone()
    masked[1, 2] = masked[0, 4] = 0
    for upper in ("balance", "quantile"):
        got = calibrate_bounds(corrupt_rb, corrupt_rq, advantages, mask, eps_low=0.2, eps_high=0.2, upper=upper)
        want = calibrate_bounds(rb, rq, advantages, masked, eps_low=0.2, eps_high=0.2, upper=upper)
        assert got.num_nonfinite == 2 and want.num_nonfinite == 0
        assert (got.low, got.high, got.alpha, got.balance_p) == (want.low, want.high, want.alpha, want.balance_p)
        assert got.low > 0 and got.high >= 1.0


def test_fit_bounds_and_the_calibrator_drop_nonpositive_ratios_too():
    generator = torch.Generator().manual_seed(1)
    rq = torch.exp(0.3 * torch.randn(4, 6, generator=generator))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(4, 6)
    corrupt = rq.clone()
    corrupt[1, 0], corrupt[2, 3] = 0.0, -1.0
    masked = mask.clone()
    masked[1, 0] = masked[2, 3] = 0
    stats = dict(alpha=0.3, balance_p=1.2, beta=0.1, eps_high=0.2, upper="balance")
    assert fit_bounds(corrupt, advantages, mask, **stats) == fit_bounds(rq, advantages, masked, **stats)

    def run(ratio, m):
        calibrator = ClipCalibrator(schedule="every_step")
        calibrator.needs_calibration(0)
        calibrator.calibrate(ratio, ratio, advantages, m)
        calibrator.refit(ratio, advantages, m)
        return calibrator.bounds

    assert run(corrupt, mask) == run(rq, masked)


@pytest.mark.parametrize("shape", [(1,), (1, 1), (2,), (4, 2), (8,)])
def test_advantages_must_match_the_batch_exactly(shape):
    ratio, mask = torch.ones(4, 6), torch.ones(4, 6)
    advantages = torch.ones(shape)
    with pytest.raises(ValueError, match=rf"^advantages must have shape .*got {tuple(shape)}".replace("(", r"\(")
                       .replace(")", r"\)")):  # fmt: skip
        calibrate_bounds(ratio, ratio, advantages, mask, eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match=r"^advantages must have shape"):
        fit_bounds(ratio, advantages, mask, alpha=0.1, balance_p=1.0, beta=0.1, eps_high=0.2, upper="balance")
    calibrator = ClipCalibrator()
    with pytest.raises(ValueError, match=r"^advantages must have shape"):
        calibrator.calibrate(ratio, ratio, advantages, mask)
    with pytest.raises(ValueError, match=r"^advantages must have shape"):
        clipped_surrogate(torch.zeros(4, 6), torch.zeros(4, 6), advantages, mask, low=0.8, high=1.2)


def test_accepted_advantage_shapes_agree():
    generator = torch.Generator().manual_seed(2)
    ratio = torch.exp(0.3 * torch.randn(4, 6, generator=generator))
    per_sequence = torch.tensor([1.0, -1.0, 0.5, -0.5])
    results = [
        calibrate_bounds(ratio, ratio * 1.02, adv, torch.ones(4, 6), eps_low=0.2, eps_high=0.2)
        for adv in (per_sequence, per_sequence[:, None], per_sequence[:, None].expand(4, 6))
    ]
    assert results[0] == results[1] == results[2]
    flat = calibrate_bounds(ratio.flatten(), (ratio * 1.02).flatten(), per_sequence.repeat_interleave(6),
                            torch.ones(24), eps_low=0.2, eps_high=0.2)  # fmt: skip
    assert flat == results[0]
