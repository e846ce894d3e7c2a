"""calclip.monitoring.ratio_distributions: the split by advantage sign and the dropped shares, worked by hand."""

import math

import pytest
import torch

from calclip.monitoring.ratio_distributions import dropped_shares, split_ratios


def hand_batch():
    # row 0: A = -1, row 1: A = +2, row 2: A = 0 (in neither side); the last column is padding.
    ratio_fp8 = torch.tensor([[0.70, 0.95, 1.10, 9.0], [1.30, 1.05, 0.90, 9.0], [0.10, 5.00, 1.00, 9.0]])
    ratio_bf16 = torch.tensor([[0.90, 0.97, 1.02, 9.0], [1.10, 1.25, 0.99, 9.0], [0.50, 2.00, 1.00, 9.0]])
    advantages = torch.tensor([-1.0, 2.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    return ratio_fp8, ratio_bf16, advantages, mask


def test_split_by_sign_keeps_masked_tokens_only():
    samples = split_ratios(*hand_batch())
    assert samples.fp8_neg.tolist() == pytest.approx([0.70, 0.95, 1.10])
    assert samples.bf16_neg.tolist() == pytest.approx([0.90, 0.97, 1.02])
    assert samples.fp8_pos.tolist() == pytest.approx([1.30, 1.05, 0.90])
    assert samples.bf16_pos.tolist() == pytest.approx([1.10, 1.25, 0.99])
    assert samples.fp8_neg.dtype == torch.float64 and samples.num_nonfinite == 0
    logs = samples.log_ratios()
    assert logs["fp8/neg_adv"][0].item() == pytest.approx(math.log(0.70))
    assert sorted(logs) == ["bf16/neg_adv", "bf16/pos_adv", "fp8/neg_adv", "fp8/pos_adv"]


def test_dropped_shares_by_hand():
    shares = dropped_shares(split_ratios(*hand_batch()), low=0.96, high=1.28, eps_low=0.2, eps_high=0.2)
    # A<0 fp8 [0.70, 0.95, 1.10]: < 0.8 -> 1 of 3; < L=0.96 -> 2 of 3. bf16 [0.90, 0.97, 1.02] < 0.8 -> 0.
    assert shares["neg_low_frac_fp8_static"] == pytest.approx(1 / 3)
    assert shares["neg_low_frac_fp8"] == pytest.approx(2 / 3)
    assert shares["neg_low_frac_bf16"] == 0.0
    # A>0 fp8 [1.30, 1.05, 0.90]: > 1.2 -> 1 of 3; > H=1.28 -> 1 of 3. bf16 [1.10, 1.25, 0.99] > 1.2 -> 1 of 3.
    assert shares["pos_high_frac_fp8_static"] == pytest.approx(1 / 3)
    assert shares["pos_high_frac_fp8"] == pytest.approx(1 / 3)
    assert shares["pos_high_frac_bf16"] == pytest.approx(1 / 3)


def test_nonfinite_tokens_are_counted_and_left_out():
    ratio_fp8, ratio_bf16, advantages, mask = hand_batch()
    ratio_fp8[0, 0] = float("nan")
    ratio_bf16[1, 2] = float("inf")
    samples = split_ratios(ratio_fp8, ratio_bf16, advantages, mask)
    assert samples.num_nonfinite == 2
    assert samples.fp8_neg.tolist() == pytest.approx([0.95, 1.10])
    assert samples.fp8_pos.tolist() == pytest.approx([1.30, 1.05])


def test_empty_side_has_share_zero_and_shape_mismatch_fails():
    ratio_fp8, ratio_bf16, _, mask = hand_batch()
    shares = dropped_shares(split_ratios(ratio_fp8, ratio_bf16, torch.ones(3), mask), low=0.9, high=1.15,
                            eps_low=0.2, eps_high=0.2)
    assert shares["neg_low_frac_fp8"] == 0.0 and shares["pos_high_frac_fp8"] == pytest.approx(2 / 9)
    with pytest.raises(ValueError, match="ratio_fp8 .* ratio_bf16 .* mask"):
        split_ratios(ratio_fp8, ratio_bf16[:, :2], torch.ones(3), mask)
