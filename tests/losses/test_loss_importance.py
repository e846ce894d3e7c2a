"""rollout_correction_weights (TIS/MIS) against a loop-based float64 reference."""

import math

import numpy as np
import pytest
import torch

from calclip.losses import IS_MODES, rollout_correction_weights


def reference_weights(old, rollout, mask, mode, cap, lower_cap):
    """Returns (weights, items) where items = [(raw, final)] over the counted tokens/sequences."""
    nb, nt = mask.shape
    lo = 0.0 if lower_cap is None else lower_cap
    valid = [[mask[b, t] != 0 and math.isfinite(old[b, t]) and math.isfinite(rollout[b, t]) for t in range(nt)]
             for b in range(nb)]

    def final(raw):
        if mode == "none":
            return 1.0
        if mode.endswith("truncate"):
            return min(max(raw, lo), cap)
        return 0.0 if (raw > cap or raw < lo) else raw

    if mode.startswith("sequence"):
        weights, items = np.zeros((nb, 1)), []
        for b in range(nb):
            raw = math.exp(sum(old[b, t] - rollout[b, t] for t in range(nt) if valid[b][t]))
            weights[b, 0] = final(raw)
            if any(valid[b]):
                items.append((raw, weights[b, 0]))
        return weights, items
    weights, items = np.ones((nb, nt)), []
    for b in range(nb):
        for t in range(nt):
            raw = math.exp(old[b, t] - rollout[b, t]) if valid[b][t] else 1.0
            weights[b, t] = final(raw)
            if valid[b][t]:
                items.append((raw, weights[b, t]))
    return weights, items


def reference_stats(items, mode, cap, lower_cap):
    lo = 0.0 if lower_cap is None else lower_cap
    w = np.array([f for _, f in items])
    outside = [mode != "none" and (raw > cap or raw < lo) for raw, _ in items]
    return {
        "tis/weight_mean": w.mean(),
        "tis/weight_min": w.min(),
        "tis/weight_max": w.max(),
        "tis/clipped_frac": sum(outside) / len(items),
        "tis/ess": w.sum() ** 2 / (len(w) * (w**2).sum()),
    }


def random_logps(seed, nb=12, nt=9, spread=0.35):
    rng = np.random.default_rng(seed)
    old = -np.abs(rng.normal(1.0, 0.8, size=(nb, nt)))
    rollout = old + rng.normal(0.0, spread, size=(nb, nt))
    mask = (rng.random((nb, nt)) < 0.8).astype(np.float64)
    mask[0] = 0.0
    return old, rollout, mask


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("cap,lower_cap", [(2.0, None), (1.3, 0.7)])
def test_weights_and_stats_match_reference(mode, cap, lower_cap):
    # A smaller per-token spread at sequence level keeps the products of ~7 token ratios near the caps.
    old, rollout, mask = random_logps(IS_MODES.index(mode), spread=0.5 if mode.startswith("token") else 0.3)
    weights, stats = rollout_correction_weights(
        torch.tensor(old), torch.tensor(rollout), torch.tensor(mask), mode=mode, cap=cap, lower_cap=lower_cap
    )
    ref_w, items = reference_weights(old, rollout, mask, mode, cap, lower_cap)
    assert weights.shape == ((12, 1) if mode.startswith("sequence") else (12, 9))
    # Weights on positions the loss ignores are irrelevant; compare where they can matter.
    keep = mask.any(-1, keepdims=True) if mode.startswith("sequence") else mask != 0
    np.testing.assert_allclose(np.where(keep, weights.numpy(), 0), np.where(keep, ref_w, 0), rtol=1e-13)
    for key, value in reference_stats(items, mode, cap, lower_cap).items():
        assert stats[key].item() == pytest.approx(value, rel=1e-12), key
    if mode != "none":  # the random data must actually exercise the cap, or this test proves little
        assert 0 < stats["tis/clipped_frac"].item() < 1


def test_hand_worked_sequence_weight_is_exp_of_sum():
    # Token log-ratios 0.1, 0.2, 0.3 (+ a padded 5.0): sequence weight exp(0.6) = 1.8221, under the cap of 2.
    old = torch.tensor([[0.1, 0.2, 0.3, 5.0]], dtype=torch.float64) - 1.0
    rollout = torch.full((1, 4), -1.0, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    w, _ = rollout_correction_weights(old, rollout, mask, mode="sequence_truncate")
    assert w.item() == pytest.approx(math.exp(0.6), rel=1e-14)
    w, stats = rollout_correction_weights(old, rollout, mask, mode="sequence_truncate", cap=1.5)
    assert w.item() == 1.5 and stats["tis/clipped_frac"].item() == 1.0
    w, stats = rollout_correction_weights(old, rollout, mask, mode="sequence_mask", cap=1.5)
    assert w.item() == 0.0 and stats["tis/ess"].item() == 0.0


def test_hand_worked_token_modes_and_ess():
    # Token weights e^{ln 3} = 3, 1, e^{ln 0.25} = 0.25 with cap 2 and lower cap 0.5.
    old = torch.log(torch.tensor([[3.0, 1.0, 0.25]], dtype=torch.float64))
    rollout = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3)
    w, stats = rollout_correction_weights(old, rollout, mask, mode="token_truncate", cap=2.0, lower_cap=0.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5]], dtype=torch.float64), rtol=1e-14, atol=0)
    # ESS = (3.5)^2 / (3 * (4 + 1 + 0.25)) = 12.25 / 15.75
    assert stats["tis/ess"].item() == pytest.approx(12.25 / 15.75, rel=1e-14)
    assert stats["tis/clipped_frac"].item() == pytest.approx(2 / 3, rel=1e-14)
    w, stats = rollout_correction_weights(old, rollout, mask, mode="token_mask", cap=2.0, lower_cap=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64), rtol=1e-14, atol=0)
    assert stats["tis/ess"].item() == pytest.approx(1 / 3, rel=1e-14)  # one non-zero weight of three
    assert stats["tis/weight_mean"].item() == pytest.approx(1 / 3, rel=1e-14)


def test_weights_are_detached():
    old = torch.randn(2, 3, requires_grad=True)
    rollout = torch.randn(2, 3, requires_grad=True)
    for mode in IS_MODES:
        w, stats = rollout_correction_weights(old, rollout, torch.ones(2, 3), mode=mode)
        assert not w.requires_grad and not any(v.requires_grad for v in stats.values())


def test_nonfinite_logps_get_weight_one_and_are_counted():
    old = torch.tensor([[-1.0, float("nan"), -2.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, -2.0], [float("-inf"), -1.2, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 3)
    w, stats = rollout_correction_weights(old, rollout, mask, mode="token_truncate", cap=10.0)
    assert torch.isfinite(w).all()
    assert w[0, 1] == 1.0 and w[1, 0] == 1.0
    assert stats["tis/nonfinite_tokens"].item() == 2
    expected = [math.exp(0.5), 1.0, math.exp(0.2), 1.0]  # the four finite tokens only
    assert stats["tis/weight_mean"].item() == pytest.approx(np.mean(expected), rel=1e-14)
    w, _ = rollout_correction_weights(old, rollout, mask, mode="sequence_truncate", cap=10.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5)], [math.exp(0.2)]], dtype=torch.float64))


def test_huge_sequence_log_ratio_is_finite():
    old = torch.zeros(1, 100, dtype=torch.float64)
    rollout = torch.full((1, 100), -1.0, dtype=torch.float64)  # sum = 100: exp would be 2.7e43
    w, stats = rollout_correction_weights(old, rollout, torch.ones(1, 100), mode="sequence_mask", cap=1e30)
    assert w.item() == pytest.approx(math.exp(20.0), rel=1e-14)  # the documented clamp at LOG_RATIO_CLAMP
    assert all(torch.isfinite(v) for v in stats.values())


def test_all_masked_gives_zero_stats():
    w, stats = rollout_correction_weights(torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3),
                                          mode="sequence_truncate")
    assert torch.equal(w, torch.ones(2, 1))
    assert all(v.item() == 0.0 for v in stats.values())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="tis"), "mode must be one of"),
        (dict(mode="token_truncate", cap=0.0), "cap must be > 0"),
        (dict(mode="token_truncate", cap=2.0, lower_cap=3.0), "lower_cap"),
        (dict(mode="token_mask", lower_cap=-0.1), "lower_cap"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)
