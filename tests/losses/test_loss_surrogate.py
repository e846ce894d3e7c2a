"""clipped_surrogate against an independent loop-based float64 reference (values, gradients, stats)."""

import itertools
import math

import numpy as np
import pytest
import torch

from calclip.losses import clipped_surrogate, clipped_surrogate_per_token

B, T = 5, 7
MAX_COMPLETION_LENGTH = 9  # deliberately != T: dr_grpo divides by the configured maximum, not the padded T


# ----------------------------------------------------------------------------------------------------------
# Reference: plain Python loops over float64 numpy arrays, written from the formulas in the issue / TRL 1.16.
# ----------------------------------------------------------------------------------------------------------
def _at(x, b, t):
    """x is a scalar, an array [B], [B, 1] or [B, T]: the value that applies to token (b, t)."""
    if np.ndim(x) == 0:
        return float(x)
    if np.ndim(x) == 1:
        return float(x[b])
    return float(x[b, 0]) if x.shape[1] == 1 else float(x[b, t])


def reference_valid(logp, old, adv, mask, isw):
    valid = np.zeros(mask.shape, dtype=bool)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            vals = [logp[b, t], old[b, t], _at(adv, b, t)] + ([] if isw is None else [_at(isw, b, t)])
            valid[b, t] = mask[b, t] != 0 and all(math.isfinite(v) for v in vals)
    return valid


def reference_ratios(logp, old, valid, level):
    nb, nt = valid.shape
    log_r = np.zeros((nb, nt))
    for b in range(nb):
        for t in range(nt):
            if valid[b, t]:
                log_r[b, t] = min(max(logp[b, t] - old[b, t], -20.0), 20.0)
    if level == "sequence":
        for b in range(nb):
            n = int(valid[b].sum())
            seq = sum(log_r[b, t] for t in range(nt) if valid[b, t]) / max(n, 1)
            log_r[b, :] = seq
    return np.exp(log_r)


def reference_loss(logp, old, adv, mask, *, low, high, c=None, level="token", agg="grpo", isw=None,
                   num_items=None):
    valid = reference_valid(logp, old, adv, mask, isw)
    r = reference_ratios(logp, old, valid, level)
    nb, nt = mask.shape
    per_token = np.zeros((nb, nt))
    for b in range(nb):
        for t in range(nt):
            if not valid[b, t]:
                continue
            a, lo, hi = _at(adv, b, t), _at(low, b, t), _at(high, b, t)
            rc = min(max(r[b, t], lo), hi)
            obj = min(r[b, t] * a, rc * a)
            if c is not None and a < 0:
                obj = max(obj, c * a)
            per_token[b, t] = -obj * (1.0 if isw is None else _at(isw, b, t))
    if agg == "grpo":
        return sum(per_token[b].sum() / max(valid[b].sum(), 1) for b in range(nb)) / nb
    if agg == "bnpo":
        return per_token.sum() / max(valid.sum(), 1)
    if agg == "dr_grpo":
        return per_token.sum() / (nb * MAX_COMPLETION_LENGTH)
    if agg == "dapo":
        return per_token.sum() / max(num_items, 1)
    raise AssertionError(agg)


def reference_grad(logp, *args, **kwargs):
    """Central differences of the reference loss w.r.t. logp (float64; inputs are away from the kinks)."""
    h = 1e-6
    grad = np.zeros_like(logp)
    for b, t in itertools.product(range(logp.shape[0]), range(logp.shape[1])):
        if not math.isfinite(logp[b, t]):
            continue
        up, down = logp.copy(), logp.copy()
        up[b, t] += h
        down[b, t] -= h
        grad[b, t] = (reference_loss(up, *args, **kwargs) - reference_loss(down, *args, **kwargs)) / (2 * h)
    return grad


def reference_stats(logp, old, adv, mask, *, low, high, c, level, isw):
    valid = reference_valid(logp, old, adv, mask, isw)
    r = reference_ratios(logp, old, valid, level)
    neg = pos = neg_low = pos_high = dual = 0
    ratios = []
    for b, t in itertools.product(range(mask.shape[0]), range(mask.shape[1])):
        if not valid[b, t]:
            continue
        a, lo, hi = _at(adv, b, t), _at(low, b, t), _at(high, b, t)
        ratios.append(r[b, t])
        if a < 0:
            neg += 1
            neg_low += r[b, t] < lo
            inner = min(r[b, t] * a, min(max(r[b, t], lo), hi) * a)
            dual += c is not None and inner < c * a
        elif a > 0:
            pos += 1
            pos_high += r[b, t] > hi
    return {
        "clip/neg_low_frac": neg_low / max(neg, 1),
        "clip/pos_high_frac": pos_high / max(pos, 1),
        "clip/dual_frac": dual / max(neg, 1),
        "ratio/mean": float(np.mean(ratios)) if ratios else 0.0,
        "ratio/min": min(ratios) if ratios else 0.0,
        "ratio/max": max(ratios) if ratios else 0.0,
        "tokens": float(len(ratios)),
        "neg_tokens": float(neg),
        "pos_tokens": float(pos),
    }


def assert_stats_match(stats, expected):
    for key, value in expected.items():
        # Shares and counts are float32 by design (ratio stats keep float64): float32 rounding, no more.
        rel = 1e-12 if key.startswith("ratio/") else 1e-6
        assert stats[key].item() == pytest.approx(value, rel=rel, abs=1e-12), key


# ----------------------------------------------------------------------------------------------------------
def random_batch(seed, adv_shape, bounds, isw_shape):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(1.0, 0.7, size=(B, T)))
    old = logp + rng.normal(0.0, 0.45, size=(B, T))  # ratios spread over ~[0.4, 2.5]: every branch is hit
    mask = (rng.random((B, T)) < 0.75).astype(np.float64)
    mask[0] = 0.0  # a sequence with no tokens: grpo's per-sequence clamp(min=1)
    mask[1, :] = 1.0
    adv = rng.normal(0.0, 1.0, size=(B,) if adv_shape == "B" else (B, T))
    if bounds == "float":
        low, high = 0.8, 1.28
    elif bounds == "scalar_tensor":
        low, high = np.float64(0.75), np.float64(1.3)
    else:  # per-token bounds, e.g. from a calibrator that differs by position
        low = rng.uniform(0.6, 0.95, size=(B, T))
        high = rng.uniform(1.05, 1.6, size=(B, T))
    isw = None if isw_shape is None else rng.uniform(0.2, 2.0, size=(B, T) if isw_shape == "BT" else (B, 1))
    return logp, old, adv, mask, low, high, isw


def t64(x):
    return None if x is None else torch.tensor(x, dtype=torch.float64)


def _bound_arg(x):
    return x if isinstance(x, float) else t64(x)


CASES = list(
    itertools.product(
        ["token", "sequence"], ["B", "BT"], ["grpo", "bnpo", "dr_grpo", "dapo"], [None, 1.6], [None, "BT", "B1"]
    )
)


@pytest.mark.parametrize("level,adv_shape,agg,dual_c,isw_shape", CASES)
def test_matches_reference_value_grad_and_stats(level, adv_shape, agg, dual_c, isw_shape):
    seed = CASES.index((level, adv_shape, agg, dual_c, isw_shape))
    bounds = ("float", "scalar_tensor", "per_token")[seed % 3]
    logp, old, adv, mask, low, high, isw = random_batch(seed, adv_shape, bounds, isw_shape)
    num_items = 23.0
    kw = dict(low=low, high=high, c=dual_c, level=level, agg=agg, isw=isw, num_items=num_items)

    logp_t = t64(logp).requires_grad_(True)
    loss, stats = clipped_surrogate(
        logp_t, t64(old), t64(adv), t64(mask), low=_bound_arg(low), high=_bound_arg(high), dual_clip_c=dual_c,
        level=level, aggregation=agg, max_completion_length=MAX_COMPLETION_LENGTH,
        num_items=torch.tensor(num_items), is_weights=t64(isw),
    )
    loss.backward()

    assert loss.item() == pytest.approx(reference_loss(logp, old, adv, mask, **kw), rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(logp_t.grad.numpy(), reference_grad(logp, old, adv, mask, **kw), atol=1e-7)
    assert logp_t.grad[0].abs().sum() == 0  # the fully masked sequence gets no gradient

    expected = reference_stats(logp, old, adv, mask, low=low, high=high, c=dual_c, level=level, isw=isw)
    assert_stats_match(stats, expected)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    assert stats["nonfinite_tokens"].item() == 0


def test_branches_are_all_exercised_by_the_random_cases():
    # Guard against a reference comparison that passes only because no token was ever clipped.
    logp, old, adv, mask, low, high, _ = random_batch(3, "BT", "float", None)
    s = reference_stats(logp, old, adv, mask, low=low, high=high, c=1.6, level="token", isw=None)
    assert s["clip/neg_low_frac"] > 0 and s["clip/pos_high_frac"] > 0 and s["clip/dual_frac"] > 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dual_c", [None, 1.4])
def test_gradcheck(level, dual_c):
    torch.manual_seed(0)
    logp = (-torch.rand(3, 4, dtype=torch.float64) - 0.2).requires_grad_(True)
    old = logp.detach() + 0.4 * torch.randn(3, 4, dtype=torch.float64)
    adv = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.float64)

    def f(lp):
        return clipped_surrogate(lp, old, adv, mask, low=0.8, high=1.2, dual_clip_c=dual_c, level=level)[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------
# Hand-worked single-token cases (bnpo over one token = the per-token loss itself).
# ----------------------------------------------------------------------------------------------------------
def one_token(ratio, adv, *, low=0.8, high=1.2, dual_c=None):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, stats = clipped_surrogate(
        logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1), low=low, high=high, dual_clip_c=dual_c, aggregation="bnpo",
    )
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_negative_advantage_below_low_has_zero_gradient():
    # A = -1, r = 0.5 < low = 0.8: -min(-0.5, -0.8) = 0.8, the constant branch: the penalty is dropped.
    loss, grad, stats = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8, abs=1e-15)
    assert grad == 0.0
    assert stats["clip/neg_low_frac"].item() == 1.0


def test_negative_advantage_inside_bounds_is_pushed_down():
    # A = -1, r = 0.9: loss = -r*A = 0.9, d loss / d logp = -A * r = 0.9 (dr/dlogp = r).
    loss, grad, stats = one_token(0.9, -1.0)
    assert loss == pytest.approx(0.9, abs=1e-15)
    assert grad == pytest.approx(0.9, abs=1e-15)
    assert stats["clip/neg_low_frac"].item() == 0.0


def test_positive_advantage_above_high_has_zero_gradient_and_below_low_keeps_it():
    loss, grad, stats = one_token(1.5, 2.0)  # -min(3.0, 2.4) = -2.4
    assert (loss, grad) == (pytest.approx(-2.4, abs=1e-15), 0.0)
    assert stats["clip/pos_high_frac"].item() == 1.0
    loss, grad, _ = one_token(0.5, 2.0)  # -min(1.0, 1.6) = -1.0, gradient -A*r = -1.0
    assert (loss, grad) == (pytest.approx(-1.0, abs=1e-15), pytest.approx(-1.0, abs=1e-15))


def test_dual_clip_engages_above_c():
    # A = -2, r = 4 > c = 3: min(-8, -2.4) = -8, max(-8, -6) = -6 -> loss 6, constant: zero gradient.
    loss, grad, stats = one_token(4.0, -2.0, dual_c=3.0)
    assert (loss, grad) == (pytest.approx(6.0, abs=1e-14), 0.0)
    assert stats["clip/dual_frac"].item() == 1.0
    # r = 2.5 < c: max(-5, -6) = -5 -> loss 5, gradient -A*r = 5.
    loss, grad, stats = one_token(2.5, -2.0, dual_c=3.0)
    assert (loss, grad) == (pytest.approx(5.0, abs=1e-14), pytest.approx(5.0, abs=1e-14))
    assert stats["clip/dual_frac"].item() == 0.0
    # Positive advantages never take the dual branch: r = 4, A = 2 -> -min(8, 2.4) = -2.4.
    loss, grad, _ = one_token(4.0, 2.0, dual_c=3.0)
    assert (loss, grad) == (pytest.approx(-2.4, abs=1e-14), 0.0)


def test_per_token_bounds_apply_per_token():
    ratio = torch.tensor([[0.7, 0.7]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    low = torch.tensor([[0.6, 0.8]], dtype=torch.float64)  # only the second token is below its bound
    out = clipped_surrogate_per_token(ratio, adv, low, 1.2)
    torch.testing.assert_close(out, torch.tensor([[0.7, 0.8]], dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(low=1.3, high=1.2), "low must be <= high"),
        (dict(low=0.8, high=1.2, dual_clip_c=1.0), "dual_clip_c must be > 1"),
        (dict(low=0.8, high=1.2, dual_clip_c=0.5), "dual_clip_c must be > 1"),
        (dict(low=0.8, high=1.2, level="seq"), "level must be one of"),
        (dict(low=0.8, high=1.2, aggregation="mean"), "aggregation must be one of"),
        (dict(low=0.8, high=1.2, aggregation="dr_grpo"), "max_completion_length"),
        (dict(low=0.8, high=1.2, aggregation="dapo"), "num_items"),
    ],
)
def test_invalid_arguments_raise(kwargs, match):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        clipped_surrogate(x, x, torch.zeros(2), torch.ones(2, 3), **kwargs)


def test_bad_advantage_shape_raises():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must have shape"):
        clipped_surrogate(x, x, torch.zeros(3), torch.ones(2, 3), low=0.8, high=1.2)


# ----------------------------------------------------------------------------------------------------------
# Non-finite inputs and empty batches.
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_nonfinite_tokens_are_excluded_and_counted(level, agg):
    logp, old, adv, mask, _, _, _ = random_batch(100, "B", "float", None)
    isw = np.random.default_rng(1).uniform(0.5, 1.5, size=(B, T))
    mask[2, :] = 1.0
    mask[3, :] = 1.0
    logp[2, 1] = np.nan
    old[2, 3] = np.inf
    old[3, 0] = -np.inf
    isw[3, 5] = np.nan
    adv[4] = np.nan  # a whole sequence with a NaN advantage
    logp[0, 2] = -np.inf  # padding (mask 0): neither counted nor allowed to poison anything
    expected_count = 4 + int(mask[4].sum())

    logp_t = t64(logp).requires_grad_(True)
    loss, stats = clipped_surrogate(
        logp_t, t64(old), t64(adv), t64(mask), low=0.8, high=1.28, dual_clip_c=2.0, level=level, aggregation=agg,
        max_completion_length=MAX_COMPLETION_LENGTH, num_items=20, is_weights=t64(isw),
    )
    loss.backward()
    kw = dict(low=0.8, high=1.28, c=2.0, level=level, agg=agg, isw=isw, num_items=20)
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(reference_loss(logp, old, adv, mask, **kw), rel=1e-12, abs=1e-12)
    assert torch.isfinite(logp_t.grad).all()
    assert logp_t.grad[2, 1] == 0 and logp_t.grad[2, 3] == 0 and logp_t.grad[3, 0] == 0 and logp_t.grad[3, 5] == 0
    assert logp_t.grad[4].abs().sum() == 0
    np.testing.assert_allclose(logp_t.grad.numpy(), reference_grad(logp, old, adv, mask, **kw), atol=1e-7)
    assert stats["nonfinite_tokens"].item() == expected_count
    expected = reference_stats(logp, old, adv, mask, low=0.8, high=1.28, c=2.0, level=level, isw=isw)
    assert_stats_match(stats, expected)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(level, agg, dtype):
    logp = torch.randn(3, 4, dtype=dtype)
    logp[1, 2] = float("nan")  # garbage on padded positions must not leak
    logp.requires_grad_(True)
    old = torch.randn(3, 4, dtype=dtype)
    old[0, 0] = float("inf")
    loss, stats = clipped_surrogate(
        logp, old, torch.randn(3), torch.zeros(3, 4), low=0.8, high=1.2, dual_clip_c=3.0, level=level,
        aggregation=agg, max_completion_length=4, num_items=0,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp.grad))
    assert stats["tokens"].item() == 0 and stats["nonfinite_tokens"].item() == 0
    assert all(torch.isfinite(v) for v in stats.values())


def test_all_tokens_nonfinite_gives_zero_loss_and_zero_gradient():
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    loss, stats = clipped_surrogate(logp, torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3), low=0.8, high=1.2)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert stats["nonfinite_tokens"].item() == 6


def test_huge_log_ratio_stays_finite():
    # logp - old = 60 would overflow exp in float32; the clamp at 20 keeps loss and gradient finite.
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-60.0, -1.0]])
    loss, stats = clipped_surrogate(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), low=0.8, high=1.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert stats["ratio/max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Bounds the loss cannot compute with, and batches of no rows (issue 40).
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, value", [("low", float("nan")), ("high", float("nan")), ("low", float("inf")),
                                         ("high", float("-inf"))])
def test_a_number_bound_that_cannot_clip_is_refused_naming_it(name, value):
    """A NaN bound made every clamp NaN and returned a NaN loss; low = +inf or high = -inf clip every token."""
    x = torch.zeros(2, 3)
    bounds = {"low": 0.8, "high": 1.2, name: value}
    with pytest.raises(ValueError, match=rf"{name} must be a ratio bound that can clip"):
        clipped_surrogate(x, x, torch.ones(2), torch.ones(2, 3), **bounds)
    with pytest.raises(ValueError, match=rf"{name} must be a ratio bound that can clip"):
        clipped_surrogate_per_token(torch.ones(2, 3), torch.ones(2, 1), **bounds)


def test_open_number_bounds_leave_the_surrogate_unclipped():
    """high = +inf and low = -inf clip nothing: the per-token loss is -r * A on every token (worked by hand)."""
    ratio = torch.tensor([[0.1, 1.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 2.0, 0.5]], dtype=torch.float64)
    loss = clipped_surrogate_per_token(ratio, adv, low=-math.inf, high=math.inf)
    torch.testing.assert_close(loss, torch.tensor([[0.1, -2.0, -4.5]], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_dual_clip_constant_is_refused(value):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="dual_clip_c must be > 1 and finite"):
        clipped_surrogate(x, x, torch.ones(2), torch.ones(2, 3), low=0.8, high=1.2, dual_clip_c=value)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_tokens_with_a_bound_that_cannot_clip_are_left_out_and_counted(level, agg):
    """Per-token bounds (the oracle's) are not checked with a device sync: a token whose bound is NaN, or low = +inf,
    or high = -inf, is left out like a non-finite input. The result equals the loss with those tokens masked out."""
    logp, old, adv, mask, _, _, _ = random_batch(7, "B", "float", None)
    mask[:] = 1.0
    low, high = np.full((B, T), 0.8), np.full((B, T), np.inf)  # the oracle's "no upper clip" is +inf: allowed
    low[1, 2], high[2, 0], low[3, 4], high[0, 1] = np.nan, np.nan, np.inf, -np.inf
    left_out = [(1, 2), (2, 0), (3, 4), (0, 1)]
    kept = mask.copy()
    for row, col in left_out:
        kept[row, col] = 0.0
    common = dict(level=level, aggregation=agg, max_completion_length=MAX_COMPLETION_LENGTH, num_items=20)
    logp_t = t64(logp).requires_grad_(True)
    loss, stats = clipped_surrogate(logp_t, t64(old), t64(adv), t64(mask), low=t64(low), high=t64(high), **common)
    loss.backward()
    clean_low, clean_high = np.where(np.isfinite(low), low, 0.8), np.where(np.isnan(high), np.inf, high)
    clean_high[0, 1] = np.inf
    logp_ref = t64(logp).requires_grad_(True)
    expected, expected_stats = clipped_surrogate(logp_ref, t64(old), t64(adv), t64(kept), low=t64(clean_low),
                                                 high=t64(clean_high), **common)  # fmt: skip
    expected.backward()
    assert math.isfinite(loss.item()) and loss.item() == expected.item()
    assert torch.equal(logp_t.grad, logp_ref.grad) and torch.isfinite(logp_t.grad).all()
    assert stats["nonfinite_tokens"].item() == len(left_out) and stats["tokens"].item() == B * T - len(left_out)
    assert stats["clip/neg_low_frac"].item() == expected_stats["clip/neg_low_frac"].item()


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_an_empty_batch_gives_zero_loss_zero_gradient_and_zero_stats(shape, level, agg):
    """A batch of no rows (or no positions) failed inside amin; TRL's grpo mean over no rows would be NaN."""
    logp = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    loss, stats = clipped_surrogate(
        logp, torch.zeros(shape, dtype=torch.float64), torch.zeros(shape[0], dtype=torch.float64), torch.ones(shape),
        low=0.8, high=1.2, dual_clip_c=3.0, level=level, aggregation=agg, max_completion_length=4, num_items=0,
    )
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.shape == shape and not logp.grad.any()
    assert {name: value.item() for name, value in stats.items()} == dict.fromkeys(stats, 0.0)
