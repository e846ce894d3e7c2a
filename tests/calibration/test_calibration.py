"""calibrate_bounds / fit_bounds against an independent float64 reference, hand-worked cases, the
gradient-dropout effect Calibrated Clipping exists to fix, and the stateful ClipCalibrator."""

import copy
import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calclip.calibration import (
    CalibrationResult,
    ClipCalibrator,
    calibrate_bounds,
    fit_bounds,
)

EPS = 0.2  # base bounds [0.8, 1.2] unless a test says otherwise
# The stateful tests below check the fit arithmetic, smoothing and schedules on one small batch at a time: a
# calibrator that fits on any number of tokens, with the rails open to [0, 1] and [1, 10]. The minimum-evidence
# rule and the default rails have tests of their own (tests/calibration/test_calibration_pool.py).
ONE_BATCH = dict(min_tokens=1, low_rails=(0.0, 1.0), high_rails=(1.0, 10.0))


# ------------------------------------------------------------------------------------- float64 reference


def _tokens(rb, rq, adv, mask):
    """Plain-Python token lists: N- as (rb, rq, |A|), N+ as (rb, rq, A)."""
    rb, rq, mask = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (rb, rq, mask))
    adv = np.asarray(adv, dtype=np.float64)
    if adv.ndim == 1 and np.asarray(mask).size != adv.size:
        adv = np.repeat(adv, rb.size // adv.size)
    adv = adv.reshape(-1)
    neg, pos = [], []
    for b, q, a, m in zip(rb, rq, adv, mask):
        if m == 0 or not (math.isfinite(b) and math.isfinite(q) and math.isfinite(a)):
            continue
        if a < 0:
            neg.append((b, q, -a))
        elif a > 0:
            pos.append((b, q, a))
    return neg, pos


def _reference_high_balance(pos_q, target):
    """Brute force over candidate H values: the smallest rq in N+ whose M+(H) reaches the target."""
    for h in sorted({q for q, _ in pos_q}):
        if sum(a * q for q, a in pos_q if q <= h) >= target:
            return h
    return max(q for q, _ in pos_q)


def reference_bounds(rb, rq, adv, mask, eps_low, eps_high, upper, target_slack=0.0):
    """docs/DESIGN.md steps 1-5 with loops and numpy.quantile. target_slack scales the balance target by
    (1 + target_slack) so a test can bracket H when the target sits on a data step up to rounding."""
    neg, pos = _tokens(rb, rq, adv, mask)
    base_low, base_high = 1 - eps_low, 1 + eps_high
    alpha = sum(b < base_low for b, _, _ in neg) / len(neg) if neg else None
    low = float(np.quantile([q for _, q, _ in neg], alpha)) if neg else None
    neg_mass_b = sum(a * b for b, _, a in neg if b >= base_low)
    p = sum(a * b for b, _, a in pos if b <= base_high) / neg_mass_b if neg_mass_b > 0 else None
    beta = sum(b > base_high for b, _, _ in pos) / len(pos) if pos else None
    if upper == "fixed":
        high = base_high
    elif not pos:
        high = None
    elif upper == "quantile":
        high = float(np.quantile([q for _, q, _ in pos], 1 - beta))
    elif p is None or low is None:
        high = None
    else:
        target = p * sum(a * q for _, q, a in neg if q >= low) * (1 + target_slack)
        high = _reference_high_balance([(q, a) for _, q, a in pos], target)
    return dict(low=low, high=high, alpha=alpha, balance_p=p, beta=beta, num_neg=len(neg), num_pos=len(pos))


def assert_matches_reference(result: CalibrationResult, rb, rq, adv, mask, eps_low, eps_high, upper):
    ref = reference_bounds(rb, rq, adv, mask, eps_low, eps_high, upper)
    assert (result.num_neg, result.num_pos) == (ref["num_neg"], ref["num_pos"])
    for key in ("alpha", "beta"):  # ratios of integer counts: exact
        assert getattr(result, key) == ref[key], key
    for key in ("low", "balance_p"):
        got, want = getattr(result, key), ref[key]
        assert (got is None) == (want is None), key
        if want is not None:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12), key
    if ref["high"] is None:
        assert result.high is None
    elif upper == "balance":
        # H is a data value picked by a >= comparison of two sums; summation order moves the sums by ulps, so
        # accept exactly the data values the reference picks with the target nudged by -+1e-9 relative.
        lo = reference_bounds(rb, rq, adv, mask, eps_low, eps_high, upper, target_slack=-1e-9)["high"]
        hi = reference_bounds(rb, rq, adv, mask, eps_low, eps_high, upper, target_slack=1e-9)["high"]
        assert lo <= result.high <= hi
        assert result.high in {q for _, q, a in _tokens(rb, rq, adv, mask)[1]}
    else:
        assert result.high == pytest.approx(ref["high"], rel=1e-12, abs=1e-12)


# ------------------------------------------------------------------------------ calibrate_bounds: random

# A small set of values makes ties and duplicates frequent; the continuous range covers the rest.
RATIO = st.one_of(st.sampled_from([0.5, 0.8, 0.9, 1.0, 1.2, 1.5]), st.floats(0.3, 2.5))
ADVANTAGE = st.one_of(st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0]), st.floats(-2.0, 2.0))


@st.composite
def batches(draw):
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    n = batch * length

    def grid(values):
        return torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float64).view(batch, length)

    rb, rq = grid(RATIO), grid(RATIO)
    per_token = draw(st.booleans())
    adv_values = draw(st.lists(ADVANTAGE, min_size=n if per_token else batch, max_size=n if per_token else batch))
    adv = torch.tensor(adv_values, dtype=torch.float64)
    adv = adv.view(batch, length) if per_token else adv
    mask = grid(st.sampled_from([0.0, 1.0, 1.0, 1.0]))
    if draw(st.booleans()):
        mask = mask.bool()
    return rb, rq, adv, mask


def _flat_adv(adv, like):
    return adv.unsqueeze(-1).expand_as(like) if adv.dim() == 1 else adv


@settings(max_examples=60, deadline=None)
@given(batch=batches(), upper=st.sampled_from(["balance", "quantile", "fixed"]),
       eps_low=st.sampled_from([0.1, 0.2, 0.28]), eps_high=st.sampled_from([0.2, 0.28]))  # fmt: skip
def test_calibrate_bounds_matches_float64_reference(batch, upper, eps_low, eps_high):
    rb, rq, adv, mask = batch
    result = calibrate_bounds(rb, rq, adv, mask, eps_low=eps_low, eps_high=eps_high, upper=upper)
    assert_matches_reference(result, rb, rq, _flat_adv(adv, rb), mask.double(), eps_low, eps_high, upper)


@settings(max_examples=30, deadline=None)
@given(batch=batches(), upper=st.sampled_from(["balance", "quantile"]))
def test_fit_bounds_with_own_statistics_reproduces_calibration(batch, upper):
    rb, rq, adv, mask = batch
    result = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS, upper=upper)
    refit = fit_bounds(rq, adv, mask, alpha=result.alpha, balance_p=result.balance_p, beta=result.beta,
                       eps_high=EPS, upper=upper)  # fmt: skip
    assert refit == (result.low, result.high)


# ------------------------------------------------------------------------------ calibrate_bounds: by hand

# N-: five tokens with A = -1; N+: three tokens with A = +1 (one row each, advantages per token).
HAND_RB = [0.7, 0.9, 1.0, 1.1, 1.0, 1.0, 1.1, 1.3]
HAND_RQ = [0.5, 0.6, 0.9, 1.0, 1.3, 0.9, 1.25, 1.6]
HAND_ADV = [-1.0] * 5 + [1.0] * 3


def _hand(upper):
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    return calibrate_bounds(t(HAND_RB), t(HAND_RQ), t(HAND_ADV), torch.ones(1, 8, dtype=torch.bool),
                            eps_low=EPS, eps_high=EPS, upper=upper)  # fmt: skip


def test_hand_worked_balance():
    result = _hand("balance")
    # alpha: one of five N- tokens has rb < 0.8.
    assert result.alpha == pytest.approx(0.2)
    # L: rank 0.2 * 4 = 0.8 between sorted rq 0.5 and 0.6 -> 0.58 (values come in as float32).
    assert result.low == pytest.approx(0.58, abs=1e-6)
    # p = M+(1.2; rb) / M-(0.8; rb) = (1.0 + 1.1) / (0.9 + 1.0 + 1.1 + 1.0) = 0.525.
    assert result.balance_p == pytest.approx(0.525, abs=1e-6)
    # target = 0.525 * M-(0.58; rq) = 0.525 * (0.6 + 0.9 + 1.0 + 1.3) = 1.995; M+ over sorted rq+ is
    # 0.9, 2.15, 3.75 -> the first value reaching it is 1.25.
    assert result.high == pytest.approx(1.25, abs=1e-6)
    assert (result.num_neg, result.num_pos, result.num_nonfinite) == (5, 3, 0)


def test_hand_worked_quantile_and_fixed():
    result = _hand("quantile")
    # beta = 1/3 (rb 1.3 > 1.2); quantile 2/3 of [0.9, 1.25, 1.6]: rank 4/3 -> 1.25 + (1/3) * 0.35.
    assert result.beta == pytest.approx(1 / 3)
    assert result.high == pytest.approx(1.25 + 0.35 / 3, abs=1e-6)
    assert _hand("fixed").high == pytest.approx(1.2)
    assert _hand("fixed").low == _hand("balance").low


def test_ties_in_the_balance_search():
    # N-: rq = [1.0, 1.0], |A| = 1 -> L = 1.0 (all of rq- is 1.0) and M-(L; rq) = 2.
    # N+: rq = [1.1, 1.1, 1.1, 1.5] with A = 1, so M+(1.1; rq) = 3.3 (the tie group counts together) and
    # M+(1.5; rq) = 4.8. rb is chosen to set p = M+(1.2; rb) / M-(0.8; rb), hence the target p * 2.
    rq_neg = [1.0, 1.0]
    rq_pos = [1.1, 1.1, 1.1, 1.5]
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(6)

    def high_for(rb_pos, rb_neg=(1.0, 1.0)):
        rb = torch.tensor(list(rb_neg) + rb_pos, dtype=torch.float64)
        rq = torch.tensor(rq_neg + rq_pos, dtype=torch.float64)
        return calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS).high

    # p = 2.0 / 2 -> target 2: the first 1.1 alone (1.1) falls short, the tie group (3.3) reaches it: H = 1.1.
    assert high_for([1.0, 1.0, 1.3, 1.3]) == pytest.approx(1.1)
    # p = 3.4 / 2 -> target 3.4 > M+(1.1) = 3.3: the whole tie group is not enough, H = 1.5.
    assert high_for([1.0, 1.1, 1.1, 0.2]) == pytest.approx(1.5)
    # p = 4.4 / 1 (rb- = [1.0, 0.5]: M-(0.8; rb) = 1) -> target 8.8 > M+(1.5) = 4.8: no value reaches it and
    # H falls back to max rq over N+.
    assert high_for([1.1, 1.1, 1.1, 1.1], rb_neg=(1.0, 0.5)) == pytest.approx(1.5)


def test_target_reached_exactly_and_boundary_ratios():
    # Dyadic values, so every sum below is exact in floating point.
    # N-: rb = [0.75, 1.0, 1.0], rq = [0.5, 1.0, 1.0], |A| = 1. With eps_low = 0.25, rb = 0.75 sits on the
    # base bound: not below it (alpha = 0) and inside M-(0.75; rb) = 2.75.
    # N+: rb = [1.0, 1.25, 1.0, 2.0], rq = [1.0, 1.5, 2.0, 3.0], A = 1. rb = 1.25 sits on 1+eps_high: inside
    # M+(1.25; rb) = 3.25 -> p = 3.25 / 2.75. L = min rq = 0.5, M-(0.5; rq) = 2.5 -> target = p * 2.5.
    rb = torch.tensor([0.75, 1.0, 1.0, 1.0, 1.25, 1.0, 2.0], dtype=torch.float64)
    rq = torch.tensor([0.5, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    result = calibrate_bounds(rb, rq, adv, torch.ones(7), eps_low=0.25, eps_high=0.25)
    assert result.alpha == 0.0 and result.low == 0.5
    assert result.balance_p == 3.25 / 2.75
    # target = 3.25 * 2.5 / 2.75 = 2.954...: M+ over rq+ is 1.0, 2.5, 4.5 -> H = 2.0.
    assert result.high == 2.0
    assert result.beta == 0.25  # rb = 2.0 only; 1.25 is not above the bound
    # The target hit exactly: p = 1.25 (M+(1.25; rb) = 1.0 + 1.0 + 0.5 = 2.5, M-(0.75; rb) = 2), L = 1.0,
    # M-(1.0; rq) = 2, target = 2.5 = M+(1.5; rq) exactly -> H = 1.5, the value whose mass equals the target.
    rb = torch.tensor([1.0, 1.0, 1.0, 1.5, 1.0, 0.5], dtype=torch.float64)
    rq = torch.tensor([1.0, 1.0, 1.0, 1.5, 2.0, 3.0], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    result = calibrate_bounds(rb, rq, adv, torch.ones(6), eps_low=0.25, eps_high=0.25)
    assert (result.low, result.balance_p, result.high) == (1.0, 1.25, 1.5)


def test_ties_in_the_lower_quantile():
    # rq over N- = [0.7, 0.7, 0.7, 1.0]; alpha = 2/4 -> rank 1.5 between 0.7 and 0.7 -> L = 0.7 exactly.
    rb = torch.tensor([0.5, 0.6, 1.0, 1.0, 1.0])
    rq = torch.tensor([0.7, 0.7, 0.7, 1.0, 1.0])
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0])
    result = calibrate_bounds(rb, rq, adv, torch.ones(5), eps_low=EPS, eps_high=EPS)
    assert result.alpha == 0.5
    assert result.low == pytest.approx(0.7)


def test_degenerate_no_negative_tokens():
    rb = torch.tensor([[1.0, 1.1, 1.3]])
    rq = torch.tensor([[0.9, 1.4, 1.6]])
    for upper in ("balance", "quantile"):
        result = calibrate_bounds(rb, rq, torch.tensor([1.0]), torch.ones(1, 3), eps_low=EPS, eps_high=EPS, upper=upper)
        assert result.low is None and result.alpha is None and result.balance_p is None
        assert result.bounds()[0] == pytest.approx(0.8)
    # balance needs M-: no upper bound from this batch; quantile does not: beta = 1/3 -> quantile 2/3.
    assert calibrate_bounds(rb, rq, torch.tensor([1.0]), torch.ones(1, 3), eps_low=EPS, eps_high=EPS).high is None
    quantile = calibrate_bounds(rb, rq, torch.tensor([1.0]), torch.ones(1, 3), eps_low=EPS, eps_high=EPS,
                                upper="quantile")  # fmt: skip
    assert quantile.high == pytest.approx(1.4 + 0.2 / 3, abs=1e-6)


def test_degenerate_no_positive_tokens_and_zero_negative_mass():
    rb = torch.tensor([0.5, 0.7, 0.75])  # every N- token below 0.8 under BF16: alpha 1, M-(0.8; rb) = 0
    rq = torch.tensor([0.4, 0.9, 0.6])
    adv = torch.tensor([-1.0, -2.0, -0.5])
    result = calibrate_bounds(rb, rq, adv, torch.ones(3), eps_low=EPS, eps_high=EPS)
    assert result.alpha == 1.0 and result.low == pytest.approx(0.9)  # quantile 1 = max
    assert result.balance_p is None and result.high is None and result.beta is None
    assert result.bounds() == (pytest.approx(0.9), pytest.approx(1.2))
    # M-(0.8; rb) = 0 with N+ present: balance has no p -> 1+eps_high by step 5.
    rb2, rq2 = torch.cat([rb, torch.tensor([1.0])]), torch.cat([rq, torch.tensor([1.5])])
    adv2 = torch.cat([adv, torch.tensor([1.0])])
    result = calibrate_bounds(rb2, rq2, adv2, torch.ones(4), eps_low=EPS, eps_high=EPS)
    assert result.balance_p is None and result.high is None and result.bounds()[1] == pytest.approx(1.2)


def test_all_masked_gives_no_data():
    ratio = torch.rand(2, 3) + 0.5
    result = calibrate_bounds(ratio, ratio, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), eps_low=EPS, eps_high=EPS)
    assert (result.low, result.high, result.num_neg, result.num_pos) == (None, None, 0, 0)
    assert result.bounds() == (pytest.approx(0.8), pytest.approx(1.2))


def test_nonfinite_ratios_are_excluded_and_counted():
    gen = torch.Generator().manual_seed(0)
    rb = torch.exp(0.1 * torch.randn(3, 6, generator=gen))
    rq = rb * torch.exp(0.3 * torch.randn(3, 6, generator=gen))
    adv = torch.tensor([-1.0, 0.5, -0.3])
    mask = torch.ones(3, 6)
    mask[2, 5] = 0
    dirty_rb, dirty_rq = rb.clone(), rq.clone()
    dirty_rq[0, 1], dirty_rb[1, 2], dirty_rq[2, 0] = float("nan"), float("inf"), float("-inf")
    dirty_rq[2, 5] = float("nan")  # masked out: neither used nor counted
    clean_mask = mask.clone()
    clean_mask[0, 1] = clean_mask[1, 2] = clean_mask[2, 0] = 0
    dirty = calibrate_bounds(dirty_rb, dirty_rq, adv, mask, eps_low=EPS, eps_high=EPS)
    clean = calibrate_bounds(rb, rq, adv, clean_mask, eps_low=EPS, eps_high=EPS)
    assert dirty.num_nonfinite == 3 and clean.num_nonfinite == 0
    for key in ("low", "high", "alpha", "balance_p", "num_neg", "num_pos"):
        assert getattr(dirty, key) == getattr(clean, key), key


def test_mask_dtypes_and_advantage_shapes_agree():
    gen = torch.Generator().manual_seed(1)
    rb = torch.exp(0.1 * torch.randn(4, 5, generator=gen))
    rq = rb * torch.exp(0.3 * torch.randn(4, 5, generator=gen))
    adv = torch.tensor([-1.0, 0.7, -0.2, 1.3])
    mask = torch.rand(4, 5, generator=gen) > 0.3
    a = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
    b = calibrate_bounds(rb, rq, adv.unsqueeze(-1).expand(4, 5), mask.float(), eps_low=EPS, eps_high=EPS)
    assert a == b


def test_argument_errors_name_the_parameter():
    ratio, adv, mask = torch.ones(2, 3), torch.ones(2), torch.ones(2, 3)
    with pytest.raises(ValueError, match="upper"):
        calibrate_bounds(ratio, ratio, adv, mask, eps_low=EPS, eps_high=EPS, upper="median")
    with pytest.raises(ValueError, match="eps_low"):
        calibrate_bounds(ratio, ratio, adv, mask, eps_low=1.0, eps_high=EPS)
    with pytest.raises(ValueError, match="eps_high"):
        calibrate_bounds(ratio, ratio, adv, mask, eps_low=EPS, eps_high=0.0)
    with pytest.raises(ValueError, match="mask"):
        calibrate_bounds(ratio, ratio, adv, torch.ones(3, 2), eps_low=EPS, eps_high=EPS)
    with pytest.raises(ValueError, match="advantages"):
        calibrate_bounds(ratio, ratio, torch.ones(3), mask, eps_low=EPS, eps_high=EPS)
    with pytest.raises(ValueError, match="alpha"):
        fit_bounds(ratio, adv, mask, alpha=1.5, balance_p=1.0, beta=0.0, eps_high=EPS, upper="balance")


# --------------------------------------------------------------- what the calibration reproduces from BF16


def _noisy_batch(seed, n_seq=64, length=64, bf16_std=0.1, fp8_std=0.3):
    """BF16 ratios near 1 and FP8 ratios = BF16 ratios times log-normal quantization noise."""
    gen = torch.Generator().manual_seed(seed)
    rb = torch.exp(bf16_std * torch.randn(n_seq, length, generator=gen, dtype=torch.float64))
    rq = rb * torch.exp(fp8_std * torch.randn(n_seq, length, generator=gen, dtype=torch.float64))
    adv = torch.randn(n_seq, generator=gen, dtype=torch.float64)
    mask = torch.rand(n_seq, length, generator=gen) < 0.9
    return rb, rq, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alpha_reproduced_on_fp8_ratios(seed):
    rb, rq, adv, mask = _noisy_batch(seed)
    result = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
    neg = mask & (adv.unsqueeze(-1) < 0)
    bf16_below = int((rb[neg] < 0.8).sum())
    fp8_below = int((rq[neg] < result.low).sum())
    assert 0 < bf16_below < result.num_neg  # the interior case, where linear interpolation is exact
    # Continuous ratios have no ties: quantile alpha at rank k(n-1)/n = k - k/n lies strictly between the
    # k-th and (k+1)-th smallest value, so exactly k tokens are below it.
    assert fp8_below == bf16_below
    assert fp8_below / result.num_neg == pytest.approx(result.alpha)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balance_p_reproduced_within_one_data_step(seed):
    rb, rq, adv, mask = _noisy_batch(seed)
    result = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
    a = adv.unsqueeze(-1).expand_as(rq)
    neg, pos = mask & (a < 0), mask & (a > 0)
    rq_pos, a_pos = rq[pos], a[pos]
    neg_mass = float((-a[neg] * rq[neg])[rq[neg] >= result.low].sum())

    def balance(h):
        return float((a_pos * rq_pos)[rq_pos <= h].sum()) / neg_mass

    below_h = rq_pos[rq_pos < result.high].max()  # the data step just under H
    assert balance(result.high) >= result.balance_p > balance(below_h)
    assert result.high < rq_pos.max()  # the balance was reached, not the fallback


def _zero_gradient_share(ratio, adv, mask, low, high):
    """Share of A<0 tokens whose PPO gradient is exactly zero, by autograd on the surrogate."""
    log_ratio = ratio.log().clone().requires_grad_(True)
    r = log_ratio.exp()
    a = adv.unsqueeze(-1).expand_as(r)
    objective = torch.minimum(r * a, r.clamp(low, high) * a)
    (objective * mask).sum().backward()
    neg = mask & (a < 0)
    return int((log_ratio.grad[neg] == 0).sum()), int(neg.sum())


def test_gradient_dropout_is_restored_to_bf16_by_calibration():
    rb, rq, adv, mask = _noisy_batch(3)
    dropped_bf16, n_neg = _zero_gradient_share(rb, adv, mask, 0.8, 1.2)
    dropped_fp8_static, _ = _zero_gradient_share(rq, adv, mask, 0.8, 1.2)
    low, high = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS).bounds()
    dropped_fp8_calibrated, _ = _zero_gradient_share(rq, adv, mask, low, high)
    # FP8 noise at static bounds silently drops many more A<0 penalties than BF16 does (~24% vs ~1.3%).
    assert dropped_fp8_static > 5 * dropped_bf16 > 0
    assert dropped_fp8_static / n_neg > 0.15
    # Calibrated bounds drop BF16's share, within one token.
    assert abs(dropped_fp8_calibrated - dropped_bf16) <= 1


# ------------------------------------------------------------------------------------------ ClipCalibrator


def _batches(count, seed=0):
    return [_noisy_batch(seed * 1000 + i, n_seq=8, length=16) for i in range(count)]


def test_initial_bounds_then_first_calibration_replaces_them():
    cal = ClipCalibrator(**ONE_BATCH)
    assert cal.bounds == (0.6, 1.8) and not cal.calibrated
    rb, rq, adv, mask = _noisy_batch(0, n_seq=8, length=16)
    stats = cal.calibrate(rb, rq, adv, mask)
    expected = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
    assert cal.bounds == (expected.low, expected.high) and cal.calibrated
    assert stats["calib/low"] == expected.low and stats["calib/high"] == expected.high
    assert stats["calib/alpha"] == expected.alpha and stats["calib/balance_p"] == expected.balance_p
    a = adv.unsqueeze(-1).expand_as(rq)
    neg, pos = mask & (a < 0), mask & (a > 0)
    assert (stats["calib/neg_tokens"], stats["calib/pos_tokens"]) == (float(neg.sum()), float(pos.sum()))
    assert stats["calib/neg_tokens"] > 0 and stats["calib/pos_tokens"] > 0
    assert stats["calib/fit"] == 1.0
    assert stats["calib/bf16_low_clipped_tokens"] == float((rb[neg] < 1 - EPS).sum())
    # The clip shares are the trainer's (scored out of sample, calclip.calibration.drops): the calibrator no longer
    # writes a second, differently defined clip/neg_low_frac_bf16.
    assert not any(name.startswith("clip/") for name in stats)


def test_ema_smooths_later_calibrations():
    (b1, b2, b3) = _batches(3)
    cal = ClipCalibrator(**ONE_BATCH, ema=0.25)
    results = [calibrate_bounds(*b, eps_low=EPS, eps_high=EPS) for b in (b1, b2, b3)]
    cal.calibrate(*b1)
    low, high = results[0].low, results[0].high  # the first replaces the initial bounds, no smoothing
    assert cal.bounds == (low, high)
    for batch, result in zip((b2, b3), results[1:]):
        cal.calibrate(*batch)
        low, high = 0.25 * low + 0.75 * result.low, 0.25 * high + 0.75 * result.high
        assert cal.bounds == (pytest.approx(low, rel=1e-14), pytest.approx(high, rel=1e-14))


def test_rails_are_enforced():
    rb, rq, adv, mask = _noisy_batch(0, n_seq=8, length=16)
    free = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
    assert free.low < 0.7 and free.high > 1.3  # so that both rails below bite
    cal = ClipCalibrator(min_tokens=1, init_low=0.75, init_high=1.25, low_rails=(0.7, 0.9), high_rails=(1.1, 1.3))
    cal.calibrate(rb, rq, adv, mask)
    assert cal.bounds == (0.7, 1.3)


@pytest.mark.parametrize("upper", ["balance", "quantile"])
def test_side_without_data_keeps_its_bound(upper):
    cal = ClipCalibrator(**ONE_BATCH, ema=0.5, upper=upper)
    rb, rq, adv, mask = _noisy_batch(0, n_seq=8, length=16)
    cal.calibrate(rb, rq, adv, mask)
    low, high = cal.bounds
    alpha = cal.state_dict()["alpha"]
    cal.calibrate(rb, rq * 1.1, adv.abs(), mask)  # N- empty: no L, no alpha from this batch
    assert cal.bounds[0] == low and cal.state_dict()["alpha"] == alpha
    if upper == "balance":  # balance needs this batch's L and M-: H stays too
        assert cal.bounds[1] == high
    else:  # quantile needs N+ only
        new = calibrate_bounds(rb, rq * 1.1, adv.abs(), mask, eps_low=EPS, eps_high=EPS, upper=upper).high
        assert cal.bounds[1] == pytest.approx(0.5 * high + 0.5 * new, rel=1e-14)


def test_fixed_upper_is_fixed_from_the_start():
    cal = ClipCalibrator(**ONE_BATCH, upper="fixed", eps_high=0.28)
    assert cal.bounds == (0.6, 1.28)
    cal.calibrate(*_noisy_batch(0, n_seq=8, length=16))
    assert cal.bounds[1] == 1.28


def test_interval_schedule_and_request_recalibration():
    cal = ClipCalibrator(**ONE_BATCH, interval=3)
    batch = _noisy_batch(0, n_seq=4, length=8)
    due = []
    for step in range(10):
        for _ in range(2):  # two mini-batches per optimizer step: only the first one calibrates
            if cal.needs_calibration(step):
                due.append(step)
                cal.calibrate(*batch)
    assert due == [0, 3, 6, 9]

    cal = ClipCalibrator(**ONE_BATCH, interval=3)
    assert cal.needs_calibration(0)
    cal.calibrate(*batch)
    assert not cal.needs_calibration(1)
    cal.request_recalibration()
    assert cal.needs_calibration(1) and cal.needs_calibration(2)  # pending until a calibration happens
    cal.calibrate(*batch)
    assert not cal.needs_calibration(2)
    # A due calibration that is not taken stays due; taking it late does not shift the grid.
    assert cal.needs_calibration(3) and cal.needs_calibration(4)
    cal.calibrate(*batch)
    assert not cal.needs_calibration(5) and cal.needs_calibration(6)
    with pytest.raises(RuntimeError, match="every_step"):
        cal.refit(batch[1], batch[2], batch[3])


def test_every_step_schedule_refits_with_stored_statistics():
    cal = ClipCalibrator(**ONE_BATCH, schedule="every_step", interval=4)
    batches = _batches(6, seed=1)
    _, rq0, adv0, mask0 = batches[0]
    cal.refit(rq0, adv0, mask0)  # nothing stored yet: initial bounds stay
    assert cal.bounds == (0.6, 1.8)
    stored = None
    for step, (rb, rq, adv, mask) in enumerate(batches):
        if cal.needs_calibration(step):
            stored = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
            cal.calibrate(rb, rq, adv, mask)
            assert cal.bounds == (stored.low, stored.high)
        else:
            stats = cal.refit(rq, adv, mask)
            expected = fit_bounds(rq, adv, mask, alpha=stored.alpha, balance_p=stored.balance_p,
                                  beta=stored.beta, eps_high=EPS, upper="balance")  # fmt: skip
            # Rails [0, 1] and [1, 10]: on these small batches the share of A>0 mass moves a lot between
            # batches, and a refit H below 1 (seen here) is held at 1.
            assert cal.bounds == (min(max(expected[0], 0.0), 1.0), min(max(expected[1], 1.0), 10.0))
            assert stats["calib/alpha"] == stored.alpha  # alpha and p are the shadow calibration's
            # The refit reproduces the stored BF16 share on this batch's FP8 ratios (continuous ratios).
            neg = mask & (adv.unsqueeze(-1) < 0)
            assert abs(int((rq[neg] < cal.bounds[0]).sum()) - stored.alpha * int(neg.sum())) <= 1
    # Four refits: the call before any shadow statistic had nothing to refit from and is not counted.
    assert cal.state_dict()["num_calibrations"] == 2 and cal.state_dict()["num_refits"] == 4


def _drive(cal, batches, start=0):
    """Run a training-loop-shaped sequence; returns the bounds after each batch."""
    bounds = []
    for step, batch in enumerate(batches, start=start):
        if step == 5:
            cal.request_recalibration()
        if cal.needs_calibration(step):
            cal.calibrate(*batch)
        else:
            cal.refit(*batch[1:])
        bounds.append(cal.bounds)
    return bounds


def test_state_dict_round_trip_resumes_identically():
    kwargs = dict(**ONE_BATCH, schedule="every_step", interval=4, ema=0.3, upper="quantile")
    batches = _batches(12, seed=2)
    uninterrupted = _drive(ClipCalibrator(**kwargs), batches)

    first = ClipCalibrator(**kwargs)
    before = _drive(first, batches[:6])
    first.request_recalibration()  # a pending request is part of the state too
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = ClipCalibrator(**kwargs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.state_dict() == first.state_dict()
    after = _drive(resumed, batches[6:], start=6)

    reference = ClipCalibrator(**kwargs)
    expected = _drive(reference, batches[:6])
    reference.request_recalibration()
    expected += _drive(reference, batches[6:], start=6)
    assert before + after == expected
    assert uninterrupted[:6] == before  # and the pending request changed the run only from step 6 on
    with pytest.raises(ValueError, match="alpha"):
        resumed.load_state_dict({k: v for k, v in first.state_dict().items() if k != "alpha"})


def test_all_gather_identity_matches_single_process():
    batch = _noisy_batch(4, n_seq=8, length=16)
    plain, gathered = ClipCalibrator(**ONE_BATCH), ClipCalibrator(**ONE_BATCH, all_gather=lambda t: t.clone())
    assert plain.calibrate(*batch) == gathered.calibrate(*batch)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(upper="median"), "upper"),
        (dict(schedule="sometimes"), "schedule"),
        (dict(interval=0), "interval"),
        (dict(interval=2.5), "interval"),
        (dict(ema=1.0), "ema"),
        (dict(ema=-0.1), "ema"),
        (dict(eps_low=1.2), "eps_low"),
        (dict(low_rails=(0.9, 0.5)), "low_rails"),
        (dict(high_rails=(2.0, 1.5)), "high_rails"),
        (dict(low_rails=(0.0, 1.1), high_rails=(1.0, 10.0)), "low_rails"),
        (dict(init_low=0.95, low_rails=(0.5, 0.9)), "init_low"),
        (dict(init_high=1.8, high_rails=(1.0, 1.5)), "init_high"),
        (dict(all_gather=3), "all_gather"),
    ],
)
def test_calibrator_argument_errors_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ClipCalibrator(**kwargs)


def test_state_dict_is_a_deep_copy_of_plain_values():
    cal = ClipCalibrator(**ONE_BATCH)
    cal.calibrate(*_noisy_batch(0, n_seq=4, length=8))
    state = cal.state_dict()
    assert copy.deepcopy(state) == state
    assert all(isinstance(v, (int, float, bool, type(None), dict)) for v in state.values())


def test_calibration_imports_torch_only():
    import subprocess
    import sys

    code = (
        "import sys, calclip.calibration; "
        "bad = [m for m in ('trl', 'transformers', 'accelerate') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_balance_p_overflow_from_subnormal_advantage_is_degenerate():
    """M-(1-eps_low; rb) > 0 but subnormal: p = M+/M- overflows float64. It must count as undefined (step 5:
    H = 1+eps_high), not become inf, which the every_step refit would then reject (hypothesis found this)."""
    ratio_bf16 = torch.ones(1, 6, dtype=torch.float64)  # M+ = 1 * 1, M- = 2.2e-309 * 1: p = 4.5e308 > float64 max
    ratio = torch.full((1, 6), 0.5, dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, -2.2251e-309, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    result = calibrate_bounds(ratio_bf16, ratio, adv, mask, eps_low=0.2, eps_high=0.2, upper="balance")
    assert result.balance_p is None
    assert result.bounds()[1] == pytest.approx(1.2)
    low, high = fit_bounds(ratio, adv, mask, alpha=result.alpha, balance_p=result.balance_p, beta=result.beta,
                           eps_high=0.2, upper="balance")
    assert high is None  # no stored p: a stateful caller keeps its previous upper bound
