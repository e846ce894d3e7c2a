"""The oracle clip mode's per-token bounds (calclip.clipping.oracle; moved from tests/test_calibration_pool.py with
the function they test, which left calclip.calibration.drops)."""

import pytest
import torch

from calclip.calibration import drop_counts, drop_shares
from calclip.clipping import ClipBounds, OracleClip
from calclip.clipping.oracle import oracle_bounds
from calclip.losses import clipped_surrogate


def test_oracle_bounds_drop_exactly_the_tokens_bf16_drops():
    """With the oracle's per-token bounds the surrogate's gradient is zero exactly on the tokens the BF16 shadow
    clips (A<0 below 1-eps, A>0 above 1+eps) and equals the unclipped gradient -A*r everywhere else, whatever the
    FP8 ratio of the token."""
    gen = torch.Generator().manual_seed(3)
    logp_old = -torch.rand(4, 12, generator=gen, dtype=torch.float64)
    logp = (logp_old + 0.4 * torch.randn(4, 12, generator=gen, dtype=torch.float64)).requires_grad_()
    ratio_bf16 = torch.exp(0.25 * torch.randn(4, 12, generator=gen, dtype=torch.float64))
    adv = torch.tensor([-1.5, -0.5, 0.7, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 12, dtype=torch.bool)
    ratio = torch.exp(logp.detach() - logp_old)
    low, high = oracle_bounds(ratio, ratio_bf16, adv, base_low=0.8, base_high=1.2)
    loss, stats = clipped_surrogate(logp, logp_old, adv, mask, low=low, high=high, aggregation="dr_grpo",
                                    max_completion_length=1)  # sum of per-token losses
    loss.backward()
    a = adv.unsqueeze(-1).expand_as(ratio)
    dropped = ((a < 0) & (ratio_bf16 < 0.8)) | ((a > 0) & (ratio_bf16 > 1.2))
    assert 0 < int(dropped.sum()) < dropped.numel()
    assert torch.equal(logp.grad[dropped], torch.zeros_like(logp.grad[dropped]))
    torch.testing.assert_close(logp.grad[~dropped], (-a * ratio / 4)[~dropped], rtol=1e-12, atol=0)
    neg = a < 0
    assert stats["clip/neg_low_frac"].item() == pytest.approx(float(dropped[neg].double().mean()))
    counts = drop_counts(ratio, adv, mask, low, ratio_bf16=ratio_bf16, base_low=0.8)
    shares = drop_shares(counts)
    assert shares["drop_recall"] == 1.0 and shares["drop_precision"] == 1.0



def test_oracle_mode_clips_per_token_where_a_shadow_ran_and_statically_elsewhere():
    policy = OracleClip(eps_low=0.2, eps_high=0.28)
    gen = torch.Generator().manual_seed(5)
    ratio = torch.exp(0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64))
    ratio_bf16 = torch.exp(0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64))
    adv = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
    bounds = policy.batch_bounds((0.8, 1.28), ratio_fp8=ratio, ratio_bf16=ratio_bf16, advantages=adv)
    low, high = oracle_bounds(ratio, ratio_bf16, adv, base_low=0.8, base_high=1.28)
    assert torch.equal(bounds.low, low) and torch.equal(bounds.high, high) and bounds.dual_clip_c is None
    # no shadow ratios (none computed yet this round) or an on-policy mini-batch: the static bounds in force
    assert policy.batch_bounds((0.8, 1.28), ratio_fp8=ratio, ratio_bf16=None, advantages=adv) == ClipBounds(0.8, 1.28)
    assert policy.batch_bounds((0.8, 1.28), ratio_fp8=None, ratio_bf16=None, advantages=adv) == ClipBounds(0.8, 1.28)
    # the shadow runs on every moved mini-batch, with or without a calibration due, and with FP8 off too
    assert policy.needs_shadow and policy.needs_shadow_this_step(False) and policy.needs_shadow_this_step(True)
    assert not policy.uses_calibrator
