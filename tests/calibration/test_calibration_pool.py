"""The calibration on enough tokens (docs/DESIGN.md steps 8-10): pooling over mini-batches, the minimum-evidence rule,
default rails that never make the trust region tighter than static, out-of-sample drop scores
(the oracle bounds: tests/clipping/test_oracle.py), and the checks of a saved calibrator state."""

import copy
import math

import pytest
import torch

from calclip.calibration import (
    ClipCalibrator,
    calibrate_bounds,
    drop_counts,
    drop_shares,
)
from calclip.calibration.calibrator import POOL_LIMIT_FACTOR
from calclip.calibration.pool import StarvationWatch
from tests.fixtures import flat_calibration_tokens

EPS = 0.2


def _batch(seed, n_seq=8, length=16, spread=0.3):
    """BF16 ratios near 1 and FP8 ratios with extra multiplicative noise; one advantage per sequence."""
    gen = torch.Generator().manual_seed(seed)
    rb = torch.exp(0.1 * torch.randn(n_seq, length, generator=gen, dtype=torch.float64))
    rq = rb * torch.exp(spread * torch.randn(n_seq, length, generator=gen, dtype=torch.float64))
    adv = torch.randn(n_seq, generator=gen, dtype=torch.float64)
    mask = torch.rand(n_seq, length, generator=gen) < 0.9
    return rb, rq, adv, mask


def _neg_pos(batch):
    rb, rq, adv, mask = batch
    a = adv.unsqueeze(-1).expand_as(rb)
    return int((mask & (a < 0)).sum()), int((mask & (a > 0)).sum())


# ---------------------------------------------------------------------------------------------------- pooling


def test_below_the_minimum_the_bounds_stay_and_the_pool_grows():
    batches = [_batch(seed) for seed in range(4)]
    counts = [_neg_pos(b) for b in batches]
    # A minimum that the first two batches do not reach and the first three do, on both sides.
    need = min(sum(n for n, _ in counts[:2]), sum(p for _, p in counts[:2])) + 1
    assert min(sum(n for n, _ in counts[:3]), sum(p for _, p in counts[:3])) >= need
    cal = ClipCalibrator(min_tokens=need, low_rails=(0.0, 1.0), high_rails=(1.0, 10.0))
    for i, batch in enumerate(batches[:2]):
        cal.observe(*batch)
        stats = cal.commit(step=i)
        assert cal.bounds == (0.6, 1.8) and not cal.calibrated
        assert stats["calib/fit"] == 0.0
        assert stats["calib/pool_neg_tokens"] == sum(n for n, _ in counts[: i + 1])
        assert stats["calib/pool_pos_tokens"] == sum(p for _, p in counts[: i + 1])
        assert cal.needs_calibration(i + 1)  # still due: the next round's shadow batches keep pooling
    cal.observe(*batches[2])
    stats = cal.commit(step=2)
    # One fit on all three batches' tokens: exactly the pure function on their concatenation.
    expected = calibrate_bounds(*flat_calibration_tokens(batches[:3]), eps_low=EPS, eps_high=EPS)
    assert cal.bounds == (expected.low, expected.high) and cal.calibrated
    assert stats["calib/fit"] == 1.0 and stats["calib/alpha"] == expected.alpha
    assert (stats["calib/neg_tokens"], stats["calib/pos_tokens"]) == (expected.num_neg, expected.num_pos)
    assert cal.pool_counts() == (0, 0)  # the pool starts empty after a fit
    assert cal.commit(step=3) == {}  # nothing pooled since


def test_observe_never_moves_the_bounds():
    """Bounds change only at commit: whatever a batch is scored against was fitted on other tokens."""
    cal = ClipCalibrator(min_tokens=1)
    for seed in range(3):
        before = cal.bounds
        cal.observe(*_batch(seed))
        assert cal.bounds == before
        cal.commit(step=seed)


def test_a_side_that_never_fills_commits_at_the_pool_limit():
    """Only A>0 tokens arrive: the pool commits once it holds POOL_LIMIT_FACTOR * min_tokens tokens (quantile H from
    N+, L kept: step 5), so it cannot grow without end."""
    cal = ClipCalibrator(min_tokens=10, upper="quantile", low_rails=(0.0, 1.0), high_rails=(1.0, 10.0))
    rb, rq, adv, mask = _batch(0, n_seq=4, length=8)
    adv, mask = adv.abs() + 0.1, torch.ones_like(mask)  # 32 A>0 tokens a batch, no A<0 token
    fits = []
    for step in range(4):
        cal.observe(rb, rq, adv, mask)
        fits.append(cal.commit(step=step)["calib/fit"])
    assert fits == [0.0, 0.0, 1.0, 0.0]  # 96 >= 8 * 10 tokens after the third batch
    assert cal.bounds[0] == 0.6  # no A<0 data: L kept
    expected = calibrate_bounds(*flat_calibration_tokens([(rb, rq, adv, mask)] * 3), eps_low=EPS, eps_high=EPS,
                                upper="quantile")
    assert cal.bounds[1] == expected.high
    assert POOL_LIMIT_FACTOR == 8


def test_every_step_refits_need_the_minimum_too():
    cal = ClipCalibrator(schedule="every_step", min_tokens=60, low_rails=(0.0, 1.0), high_rails=(1.0, 10.0))
    cal.calibrate(*flat_calibration_tokens([_batch(s) for s in range(3)]))
    assert cal.calibrated
    bounds = cal.bounds
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    first, second = (_batch(seed, n_seq=4, length=16)[1] for seed in (10, 11))
    full = torch.ones(4, 16, dtype=torch.bool)
    assert cal.refit(first, signs, full) == {} and cal.bounds == bounds  # 32 tokens a side: below 60
    stats = cal.refit(second, signs, full)  # pooled with the first: 64 a side
    assert stats["calib/refit"] == 1.0 and cal.bounds != bounds


# ------------------------------------------------------------------------------------------------------ rails


def test_default_rails_never_tighten_the_static_trust_region():
    """FP8 ratios narrower than BF16's (a fit would give L > 1-eps and H < 1+eps): the default rails hold the bounds
    at the static ones, while opened rails let the fit through."""
    rb, _, adv, mask = _batch(0, n_seq=16, length=16)
    rq = 1.0 + 0.2 * (rb - 1.0)  # a fifth of the spread
    free = calibrate_bounds(rb, rq, adv, mask, eps_low=EPS, eps_high=EPS)
    assert free.low > 1 - EPS and free.high < 1 + EPS
    default = ClipCalibrator(min_tokens=1)
    assert default.low_rails == (0.0, 1 - EPS) and default.high_rails == (1 + EPS, 10.0)
    default.calibrate(rb, rq, adv, mask)
    assert default.bounds == (1 - EPS, 1 + EPS)
    opened = ClipCalibrator(min_tokens=1, low_rails=(0.0, 1.0), high_rails=(1.0, 10.0))
    opened.calibrate(rb, rq, adv, mask)
    assert opened.bounds == (free.low, free.high)


def test_default_rails_follow_the_epsilons():
    cal = ClipCalibrator(eps_low=0.3, eps_high=0.28)
    assert cal.low_rails == (0.0, pytest.approx(0.7)) and cal.high_rails == (1.28, 10.0)
    with pytest.raises(ValueError, match="init_low"):
        ClipCalibrator(eps_low=0.5)  # init 0.6 would be tighter than the static 0.5


# ------------------------------------------------------------------------------------------------ drop scores


def test_drop_counts_by_hand():
    # six tokens; A<0 at positions 0-3 (position 3 masked out), A>0 at 4-5
    rq = torch.tensor([[0.5, 0.9, 0.7, 0.1, 0.5, 3.0]])
    rb = torch.tensor([[0.7, 0.75, 0.95, 0.1, 0.5, 3.0]])
    adv = torch.tensor([[-1.0, -1.0, -2.0, -1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])
    counts = drop_counts(rq, adv, mask, 0.8, ratio_bf16=rb, base_low=0.8)
    # A<0 in mask: 0, 1, 2. FP8 < 0.8: 0, 2. BF16 < 0.8: 0, 1. Both: 0.
    assert counts.tolist() == [3.0, 2.0, 2.0, 1.0]
    shares = drop_shares(counts)
    assert shares == {"neg_drop_frac": 2 / 3, "neg_drop_frac_bf16": 2 / 3, "drop_recall": 0.5, "drop_precision": 0.5}
    # A wider calibrated bound keeps token 2's penalty: precision 1, recall unchanged.
    shares = drop_shares(drop_counts(rq, adv, mask, 0.6, ratio_bf16=rb, base_low=0.8))
    assert (shares["neg_drop_frac"], shares["drop_recall"], shares["drop_precision"]) == (1 / 3, 0.5, 1.0)
    # Nothing dropped by either: recall and precision are undefined, not 0 or 1.
    assert drop_shares(drop_counts(rq, adv, mask, 0.0, ratio_bf16=rb, base_low=0.05)) == {
        "neg_drop_frac": 0.0, "neg_drop_frac_bf16": 0.0}
    # A per-token bound and no shadow.
    low = torch.tensor([[0.4, 0.95, 0.0, 0.0, 0.0, 0.0]])
    assert drop_counts(rq, adv, mask, low).tolist() == [3.0, 1.0, 0.0, 0.0]
    nan_rq = rq.clone()
    nan_rq[0, 0] = float("nan")
    assert drop_counts(nan_rq, adv, mask, 0.8, ratio_bf16=rb, base_low=0.8).tolist() == [2.0, 1.0, 1.0, 0.0]


# ------------------------------------------------------------------------------------------- saved state checks


def _fitted_state(**kwargs):
    cal = ClipCalibrator(min_tokens=1, **kwargs)
    cal.calibrate(*_batch(0))
    cal.observe(*_batch(1))  # a pool in flight is part of the state
    return cal.state_dict()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("low", float("nan")), ("high", float("inf")), ("low", -0.5), ("low", "0.7"), ("low", 2.0),
        ("alpha", 5.0), ("alpha", float("nan")), ("balance_p", -1.0), ("beta", 1.5),
        ("step", -1), ("step", 2.5), ("num_calibrations", True), ("last_calibration_step", 10**9),
        ("pending_recalibration", "no"), ("low_fitted", 1),
    ],
)
def test_a_bad_field_is_refused_naming_it(field, value):
    state = _fitted_state()
    state[field] = value
    cal = ClipCalibrator(min_tokens=1)
    before = cal.state_dict()
    with pytest.raises(ValueError, match=field):
        cal.load_state_dict(state)
    assert cal.state_dict() == before  # nothing was applied


@pytest.mark.parametrize(
    ("section", "field", "value", "match"),
    [
        ("pool", "ratio_fp8", "nan", "ratio_fp8"),
        ("pool", "ratio_bf16", "neg", "positive"),
        ("pool", "advantages", "zero", "non-zero"),
        ("pool", "ratio_fp8", "short", "one length"),
        ("pool", "batches", -1, "batches"),
        ("refit_pool", "extra", [1.0], "exactly the fields"),
        ("settings", "eps_low", "x", "eps_low"),
        ("settings", "upper", "median", "upper"),
        ("settings", "low_rails", [0.0], "low_rails"),
    ],
)
def test_a_bad_pool_or_setting_is_refused_naming_it(section, field, value, match):
    state = _fitted_state(schedule="every_step")
    part = state[section]
    if value == "nan":
        part[field][0] = float("nan")
    elif value == "neg":
        part[field][0] = -1.0
    elif value == "zero":
        part[field][0] = 0.0
    elif value == "short":
        part[field] = part[field][:-1]
    else:
        part[field] = value
    with pytest.raises(ValueError, match=match):
        ClipCalibrator(min_tokens=1, schedule="every_step").load_state_dict(state)


def test_changed_fit_settings_start_a_fresh_calibration():
    state = _fitted_state()
    same = ClipCalibrator(min_tokens=1)
    assert same.load_state_dict(copy.deepcopy(state)) == [] and same.calibrated
    assert same.bounds == (state["low"], state["high"]) and same.pool_counts() != (0, 0)
    for kwargs, name in ((dict(eps_low=0.25), "eps_low"), (dict(upper="quantile"), "upper"),
                         (dict(min_tokens=2), "min_tokens"), (dict(low_rails=(0.0, 1.0)), "low_rails")):
        kwargs = {"min_tokens": 1, **kwargs}
        changed = ClipCalibrator(**kwargs)
        assert name in changed.load_state_dict(copy.deepcopy(state))
        assert not changed.calibrated and changed.bounds == (0.6, 1.8) and changed.pool_counts() == (0, 0)
        assert changed.needs_calibration(state["step"])  # due at once
        assert changed.state_dict()["step"] == state["step"]
    cadence = ClipCalibrator(min_tokens=1, interval=7, ema=0.5)
    assert cadence.load_state_dict(copy.deepcopy(state)) == ["interval", "ema"]
    assert cadence.calibrated and cadence.bounds == (state["low"], state["high"])  # kept, under the new cadence


def test_round_trip_through_torch_save_keeps_the_pool(tmp_path):
    state = _fitted_state()
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    cal = ClipCalibrator(min_tokens=1)
    cal.load_state_dict(loaded)
    assert cal.state_dict() == state
    assert all(math.isfinite(v) for v in loaded["pool"]["ratio_fp8"])


def _short(neg, pos):
    return {"calib/fit": 0.0, "calib/pool_neg_tokens": float(neg), "calib/pool_pos_tokens": float(pos)}


def test_starvation_warns_at_three_short_rounds_then_at_doubling_streaks():
    watch = StarvationWatch(256, needs_positive=True)
    warned = []
    for round_index in range(1, 13):  # 12 short rounds, 40 A<0 and 50 A>0 tokens each
        metrics, message = watch.record(_short(40 * round_index, 50 * round_index))
        assert metrics == {"calib/short_rounds": float(round_index), "calib/pool_tokens": 40.0 * round_index}
        if message:
            warned.append(round_index)
    assert warned == [3, 6, 12]  # once, then each time the streak doubles
    # A fit ends the streak; the next streak must reach twice the last warning's length (24) before warning again.
    assert watch.record({"calib/fit": 1.0, "calib/neg_tokens": 300.0}) == (
        {"calib/short_rounds": 0.0, "calib/pool_tokens": 300.0}, None)
    assert all(watch.record(_short(10, 10))[1] is None for _ in range(23))
    assert watch.record(_short(10, 10))[1] is not None
    # Rounds without a shadow calibration (no calib/fit) neither count nor reset.
    assert watch.record({}) == ({}, None) and watch.short_rounds == 24


def test_starvation_message_names_the_pool_the_minimum_and_the_settings():
    watch = StarvationWatch(256, needs_positive=True)
    for neg, pos in ((30, 100), (60, 200)):
        assert watch.record(_short(neg, pos))[1] is None
    _, message = watch.record(_short(90, 300))
    assert "3 generation rounds in a row" in message
    assert "90 A<0 tokens" in message and "A>0" not in message.split("(")[0]  # 300 A>0 is enough: not named short
    assert "about 30 A<0 per round" in message and "calibration_min_tokens 256" in message
    for setting in ("per_device_train_batch_size", "num_generations", "steps_per_generation",
                    "max_completion_length", "calibration_min_tokens"):
        assert setting in message
    # A short positive side is named when the upper rule needs it, and not under upper="fixed".
    both = StarvationWatch(100, needs_positive=True, after=1)
    assert "120 A<0 and 7 A>0" not in both.record(_short(120, 7))[1] and "7 A>0 tokens" in both.message(120, 7)
    fixed = StarvationWatch(100, needs_positive=False, after=1)
    assert "A>0 tokens" not in fixed.record(_short(50, 7))[1].split("(")[0]


def test_starvation_watch_follows_a_real_calibrator():
    """The watch reads ClipCalibrator.commit's own stats: short rounds below the minimum, reset by the fit."""
    batches = [_batch(seed) for seed in range(4)]
    need = sum(n for n, _ in (_neg_pos(b) for b in batches[:3])) + 1  # four batches reach it, three do not
    cal = ClipCalibrator(min_tokens=need, upper="fixed", low_rails=(0.0, 1.0))
    watch = StarvationWatch(need, needs_positive=False)
    messages = []
    for step, batch in enumerate(batches):
        cal.observe(*batch)
        metrics, message = watch.record(cal.commit(step=step))
        messages.append(message)
        if step < 3:
            assert metrics["calib/short_rounds"] == step + 1
    assert [m is not None for m in messages] == [False, False, True, False]
    assert metrics == {"calib/short_rounds": 0.0, "calib/pool_tokens": float(sum(_neg_pos(b)[0] for b in batches))}


def test_starvation_watch_refuses_a_bad_streak_length():
    with pytest.raises(ValueError, match="after"):
        StarvationWatch(256, needs_positive=True, after=0)
