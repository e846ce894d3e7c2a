"""``ClipCalibrator``: the Calibrated Clipping bounds a trainer holds across training steps (DESIGN.md steps 1-10
and the schedules).

The flow, per generation round of a GRPO trainer:

1. ``needs_calibration(step)``: whether BF16 shadow statistics are wanted for the mini-batches of this round.
2. ``observe(ratio_bf16, ratio_fp8, advantages, mask)`` on every moved mini-batch of the round (every rank calls it
   together): its tokens join the pool. The bounds in force are not touched, so whatever a mini-batch is scored
   against was fitted on other tokens (step 10: out of sample).
3. ``commit(step)`` once the round's mini-batches are all in (a trainer calls it when the next round starts): when
   the pool holds at least ``min_tokens`` A<0 tokens (and A>0 tokens, unless ``upper="fixed"``) one calibration on
   all pooled tokens replaces the bounds and the pool starts empty; below that the bounds in force stay and the pool
   keeps growing over the next rounds (step 8).

``calibrate(...)`` is ``observe`` + ``commit`` for callers without rounds. With ``schedule="every_step"``, rounds
without a shadow calibration pool FP8 ratios only (``observe(None, ratio_fp8, ...)``) and ``commit`` refits L and H
on them from the stored alpha, p and beta, under the same minimum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calclip.calibration.distributed import AllGather
from calclip.calibration.fit import (
    UPPER_MODES,
    _calibrate_tokens,
    _check_eps,
    _check_upper,
    _fit_tokens,
    _select_tokens,
)
from calclip.calibration.pool import TokenPool
from calclip.calibration.state import (
    FIT_SETTINGS,
    POOL_LIMIT_FACTOR,
    STATE_KEYS,
    changed_settings,
    check_settings,
    check_state,
)

SCHEDULES = ("interval", "every_step")
# Enough A<0 tokens for alpha: at a BF16 clip share of 2%, 256 tokens hold ~5 clipped ones (standard error of alpha
# ~0.009); one mini-batch of the SmolLM2 evidence runs held 12-45.
DEFAULT_MIN_TOKENS = 256
HIGH_RAIL_MAX = 10.0  # an upper bound above 10 no longer bounds anything


def _check_rails(name: str, rails) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in rails)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a pair (min, max), got {rails!r}") from err
    if not (0.0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(f"{name} must satisfy 0 <= min <= max, got {rails!r}")
    return lo, hi


class ClipCalibrator:
    """Calibrated Clipping bounds held across training steps.

    Before the first calibration the bounds are ``[init_low, init_high]`` (the paper's [0.6, 1.8]: wide, so that the
    first steps, before any BF16 statistic exists, drop few gradients). The first calibration that has data for a
    side replaces that side's initial bound; later ones, and every `every_step` refit, are smoothed:
    ``bound <- ema * bound + (1 - ema) * new``. A side without data keeps its bound (step 5).

    Rails (step 9). After every update the bounds are clamped to ``low_rails`` and ``high_rails``. By default
    ``low_rails = (0, 1 - eps_low)`` and ``high_rails = (1 + eps_high, 10)``: FP8 noise widens the ratio
    distribution, so the calibrated trust region is at least as wide as the static one, and a fit tighter than
    static is noise. A user may open them (e.g. ``low_rails=(0, 1)``); ``low_rails`` must end at or below the start of
    ``high_rails`` so that low <= high always holds. With ``upper="fixed"`` the upper bound is 1+eps_high (clamped)
    from the start and ``init_high`` is not used.

    Minimum evidence (step 8). A fit needs ``min_tokens`` A<0 tokens (and as many A>0 tokens unless
    ``upper="fixed"``) in the pool; a trainer pools every moved mini-batch of a generation round, and further
    rounds until there are enough.

    Schedules. ``needs_calibration(step)`` is True while no calibration has been made yet, after
    ``request_recalibration()`` (e.g. an entropy spike) until the next calibration, and from the first step of each
    new window of ``interval`` optimizer steps until a calibration has been made in it (the grid is not shifted by
    late or requested calibrations). `every_step` adds the refits described in the module docstring.

    ``all_gather`` (optional) concatenates a 1-D tensor over ranks; with it ``observe`` pools every rank's tokens,
    so every rank holds the same pool and bounds, equal to one process's result on the tokens of all ranks in
    (mini-batch, rank) order (step 7). Every rank must then call ``observe`` together. See
    ``torch_distributed_all_gather``.

    Stats are plain floats (this object is not a loss) under DESIGN.md's metric names.
    """

    def __init__(
        self,
        *,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
        upper: str = "balance",
        schedule: str = "interval",
        interval: int = 20,
        ema: float = 0.0,
        init_low: float = 0.6,
        init_high: float = 1.8,
        low_rails: tuple[float, float] | None = None,
        high_rails: tuple[float, float] | None = None,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        all_gather: AllGather | None = None,
    ) -> None:
        _check_eps(eps_low, eps_high)
        _check_upper(upper)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval must be an integer >= 1 (optimizer steps), got {interval!r}")
        if not (0.0 <= ema < 1.0):
            raise ValueError(f"ema must lie in [0, 1), got {ema!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"min_tokens must be an integer >= 1 (A<0 tokens a fit needs), got {min_tokens!r}")
        low_rails = _check_rails("low_rails", (0.0, 1.0 - eps_low) if low_rails is None else low_rails)
        high_rails = _check_rails("high_rails", (1.0 + eps_high, HIGH_RAIL_MAX) if high_rails is None else high_rails)
        if low_rails[1] > high_rails[0]:
            raise ValueError(
                f"low_rails {low_rails} must end at or below the start of high_rails {high_rails}, "
                "so that the lower bound can never exceed the upper one"
            )
        if not (low_rails[0] <= init_low <= low_rails[1]):
            raise ValueError(f"init_low must lie within low_rails {low_rails}, got {init_low!r}")
        if upper != "fixed" and not (high_rails[0] <= init_high <= high_rails[1]):
            raise ValueError(f"init_high must lie within high_rails {high_rails}, got {init_high!r}")
        if all_gather is not None and not callable(all_gather):
            raise ValueError(f"all_gather must be callable or None, got {type(all_gather).__name__}")

        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.upper, self.schedule, self.interval, self.ema = upper, schedule, interval, float(ema)
        self.low_rails, self.high_rails = low_rails, high_rails
        self.min_tokens = min_tokens
        self.init_low, self.init_high = float(init_low), float(init_high)
        self._all_gather = all_gather
        self._pool = TokenPool(with_bf16=True)  # shadow tokens for the next calibration
        self._refit_pool = TokenPool(with_bf16=False)  # FP8 tokens for the next every_step refit
        self._step = 0  # the step last passed to needs_calibration: the default step of a commit
        self._num_calibrations = 0
        self._num_refits = 0
        self.reset()

    def reset(self) -> None:
        """Back to the initial bounds with no statistics and empty pools; a calibration is due at once. The step
        clock and the calibration counters are kept."""
        self._low, self._high = self.init_low, self.init_high
        self._low_fitted = self._high_fitted = False
        if self.upper == "fixed":
            self._high, self._high_fitted = self._clamp_high(1.0 + self.eps_high), True
        self._alpha: float | None = None
        self._balance_p: float | None = None
        self._beta: float | None = None
        self._last_calibration_step: int | None = None
        self._pending_recalibration = False
        self._pool.clear()
        self._refit_pool.clear()

    # -- reading --------------------------------------------------------------------------------------

    @property
    def bounds(self) -> tuple[float, float]:
        """The (low, high) ratio bounds in force."""
        return self._low, self._high

    @property
    def calibrated(self) -> bool:
        """Whether the statistics in force come from a calibration (not the initial bounds, nor after ``reset``)."""
        return self._last_calibration_step is not None

    @property
    def settings(self) -> dict:
        """The settings that shaped this calibrator's state (saved with it, compared on load)."""
        return {
            "eps_low": self.eps_low, "eps_high": self.eps_high, "upper": self.upper, "low_rails": self.low_rails,
            "high_rails": self.high_rails, "min_tokens": self.min_tokens, "schedule": self.schedule,
            "interval": self.interval, "ema": self.ema,
        }  # fmt: skip

    def pool_counts(self) -> tuple[int, int]:
        """(A<0, A>0) tokens in the shadow pool (over all ranks when pooling with all_gather)."""
        return self._pool.counts()

    # -- schedule -------------------------------------------------------------------------------------

    def needs_calibration(self, step: int) -> bool:
        """True when BF16 shadow statistics are wanted at optimizer step ``step`` (>= 0): no calibration yet, one
        requested, or none made yet in the window of ``interval`` steps that holds ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self._step = step
        if self._pending_recalibration or self._last_calibration_step is None:
            return True
        return step // self.interval > self._last_calibration_step // self.interval

    def request_recalibration(self) -> None:
        """Make ``needs_calibration`` return True until the next calibration."""
        self._pending_recalibration = True

    # -- updates --------------------------------------------------------------------------------------

    def observe(
        self,
        ratio_bf16: Tensor | None,  # [B, T] BF16 shadow ratios, or None (an every_step refit's FP8-only tokens)
        ratio_fp8: Tensor,  # [B, T] FP8 ratios, same tokens
        advantages: Tensor,  # [B] or [B, T]
        mask: Tensor,  # [B, T] bool or float
    ) -> int:
        """Pool one moved mini-batch's tokens (masked, A != 0, finite and positive ratios); the bounds in force do
        not change. Returns the masked tokens left out for a non-finite or non-positive value (over all ranks)."""
        if ratio_bf16 is None:
            if self.schedule != "every_step":
                raise RuntimeError("FP8-only tokens feed the 'every_step' refit; this calibrator uses "
                                   f"{self.schedule!r}")
            (rq,), adv, num_nonfinite = _select_tokens(mask, advantages, ratio_fp8)
            adv, rq, num_nonfinite = self._gather(adv, rq, num_nonfinite=num_nonfinite)
            if self._alpha is not None or self._balance_p is not None or self._beta is not None:
                self._refit_pool.add(adv, rq)  # before any shadow statistic there is nothing to refit from
            return num_nonfinite
        (rb, rq), adv, num_nonfinite = _select_tokens(mask, advantages, ratio_bf16, ratio_fp8)
        adv, rq, rb, num_nonfinite = self._gather(adv, rq, rb, num_nonfinite=num_nonfinite)
        self._pool.add(adv, rq, rb)
        return num_nonfinite

    def commit(self, step: int | None = None) -> dict[str, float]:
        """Calibrate on the pool when it holds enough tokens (or refit, every_step); return the stats ({} when
        nothing was pooled since the last commit). Credited to ``step`` (default: the last ``needs_calibration``
        step). Every rank calls it together and gets the same result."""
        if step is not None:
            self._step = step  # the schedule's clock follows the trainer's steps
        step = self._step
        if self._pool.batches:
            return self._commit_calibration(step)
        if self._refit_pool.batches:
            return self._commit_refit()
        return {}

    def calibrate(
        self,
        ratio_bf16: Tensor,  # [B, T] BF16 shadow ratios
        ratio_fp8: Tensor,  # [B, T] FP8 ratios, same tokens
        advantages: Tensor,  # [B] or [B, T]
        mask: Tensor,  # [B, T] bool or float
        step: int | None = None,
    ) -> dict[str, float]:
        """``observe`` then ``commit``: pool this batch and calibrate if the pool now holds enough tokens."""
        self.observe(ratio_bf16, ratio_fp8, advantages, mask)
        return self.commit(step)

    def refit(
        self,
        ratio_fp8: Tensor,  # [B, T]
        advantages: Tensor,  # [B] or [B, T]
        mask: Tensor,  # [B, T] bool or float
    ) -> dict[str, float]:
        """``observe(None, ...)`` then ``commit``: the `every_step` refit of L and H on pooled FP8 ratios with the
        stored alpha, p, beta. Before the first shadow calibration the bounds stay as they are."""
        self.observe(None, ratio_fp8, advantages, mask)
        return self.commit()

    def _enough(self, num_neg: int, num_pos: int) -> bool:
        """Whether a pool of these counts may be fitted: every side the fit needs (N- for L; N+ too for a
        `balance` or `quantile` H) holds min_tokens, or the pool has reached its limit."""
        sides = (num_neg,) if self.upper == "fixed" else (num_neg, num_pos)
        return min(sides) >= self.min_tokens or num_neg + num_pos >= POOL_LIMIT_FACTOR * self.min_tokens

    def _commit_calibration(self, step: int) -> dict[str, float]:
        num_neg, num_pos = self._pool.counts()
        if not self._enough(num_neg, num_pos):
            return {**self._stats("calib/pool_", num_neg, num_pos), "calib/fit": 0.0}
        tokens = self._pool.tensors()
        rb, rq, adv = tokens["ratio_bf16"], tokens["ratio_fp8"], tokens["advantages"]
        result = _calibrate_tokens(rb, rq, adv, eps_low=self.eps_low, eps_high=self.eps_high, upper=self.upper,
                                   num_nonfinite=0)  # fmt: skip
        # A statistic without data keeps its previous value, like the bounds.
        self._alpha = self._alpha if result.alpha is None else result.alpha
        self._balance_p = self._balance_p if result.balance_p is None else result.balance_p
        self._beta = self._beta if result.beta is None else result.beta
        self._update_bounds(result.low, result.high)
        self._last_calibration_step = step
        self._num_calibrations += 1
        self._pending_recalibration = False
        self._pool.clear()
        self._refit_pool.clear()  # FP8 tokens pooled under the old statistics
        stats = {**self._stats("calib/", num_neg, num_pos), "calib/fit": 1.0}
        # The count alpha rests on: with a handful of BF16-clipped tokens, alpha is a coarse estimate.
        stats["calib/bf16_low_clipped_tokens"] = float(((adv < 0) & (rb < 1.0 - self.eps_low)).sum())
        return stats

    def _commit_refit(self) -> dict[str, float]:
        num_neg, num_pos = self._refit_pool.counts()
        if not self._enough(num_neg, num_pos):
            return {}
        tokens = self._refit_pool.tensors()
        rq, adv = tokens["ratio_fp8"], tokens["advantages"]
        neg, pos = adv < 0, adv > 0
        low, high = _fit_tokens(
            rq[neg], -adv[neg], rq[pos], adv[pos], alpha=self._alpha, balance_p=self._balance_p,
            beta=self._beta, base_high=1.0 + self.eps_high, upper=self.upper,
        )  # fmt: skip
        self._update_bounds(low, high)
        self._num_refits += 1
        self._refit_pool.clear()
        return {**self._stats("calib/", num_neg, num_pos), "calib/refit": 1.0}

    def _gather(self, *tensors: Tensor, num_nonfinite: int) -> tuple:
        if self._all_gather is None:
            return (*tensors, num_nonfinite)
        gathered = tuple(self._all_gather(t) for t in tensors)
        count = torch.tensor([float(num_nonfinite)], dtype=torch.float64, device=tensors[0].device)
        return (*gathered, int(self._all_gather(count).sum().item()))

    def _clamp_low(self, value: float) -> float:
        return min(max(value, self.low_rails[0]), self.low_rails[1])

    def _clamp_high(self, value: float) -> float:
        return min(max(value, self.high_rails[0]), self.high_rails[1])

    def _smooth(self, old: float, new: float, fitted: bool) -> float:
        return self.ema * old + (1.0 - self.ema) * new if fitted else new

    def _update_bounds(self, low: float | None, high: float | None) -> None:
        if low is not None:
            self._low = self._clamp_low(self._smooth(self._low, low, self._low_fitted))
            self._low_fitted = True
        if high is not None:
            self._high = self._clamp_high(self._smooth(self._high, high, self._high_fitted))
            self._high_fitted = True

    def _stats(self, token_prefix: str, num_neg: int, num_pos: int) -> dict[str, float]:
        """The bounds and statistics in force, and the A<0 / A>0 tokens under ``token_prefix``: "calib/" for the
        tokens a fit used, "calib/pool_" for the pool so far (a round below the minimum)."""
        low, high = self.bounds
        stats = {"calib/low": low, "calib/high": high}
        if self._alpha is not None:
            stats["calib/alpha"] = self._alpha
        if self._balance_p is not None:
            stats["calib/balance_p"] = self._balance_p
        if self.upper == "quantile" and self._beta is not None:
            stats["calib/beta"] = self._beta
        stats[token_prefix + "neg_tokens"] = float(num_neg)
        stats[token_prefix + "pos_tokens"] = float(num_pos)
        return stats

    # -- checkpointing --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything that evolves during training and the settings that shaped it: plain Python values only, so a
        checkpoint of it loads with ``torch.load(..., weights_only=True)``."""
        return {
            "low": self._low,
            "high": self._high,
            "low_fitted": self._low_fitted,
            "high_fitted": self._high_fitted,
            "alpha": _plain_float(self._alpha),
            "balance_p": _plain_float(self._balance_p),
            "beta": _plain_float(self._beta),
            "step": self._step,
            "last_calibration_step": self._last_calibration_step,
            "num_calibrations": self._num_calibrations,
            "num_refits": self._num_refits,
            "pending_recalibration": self._pending_recalibration,
            "pool": self._pool.state_dict(),
            "refit_pool": self._refit_pool.state_dict(),
            "settings": {name: list(v) if isinstance(v, tuple) else v for name, v in self.settings.items()},
        }

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore ``state_dict()``'s state after checking every field (ValueError naming the field).

        Settings are this object's own. When a setting that shapes a fit (epsilons, upper rule, rails, minimum)
        differs from the saved one, the saved bounds, statistics and pools are discarded and a calibration is due at
        once (``reset``): nothing fitted under other settings stays in force. A changed cadence (schedule, interval,
        ema) applies to the restored state. Returns the names of the settings that differ.
        """
        check_state(state)
        changed = changed_settings(check_settings(state["settings"]), self.settings)
        pool, refit_pool = TokenPool(with_bf16=True), TokenPool(with_bf16=False)
        pool.load_state_dict(state["pool"], where="'pool'")
        refit_pool.load_state_dict(state["refit_pool"], where="'refit_pool'")
        self._step = state["step"]
        self._num_calibrations = state["num_calibrations"]
        self._num_refits = state["num_refits"]
        if any(name in FIT_SETTINGS for name in changed):
            self.reset()
            return changed
        self._low = self._clamp_low(float(state["low"]))
        self._high = self._clamp_high(float(state["high"]))
        self._low_fitted, self._high_fitted = state["low_fitted"], state["high_fitted"]
        self._alpha, self._balance_p, self._beta = state["alpha"], state["balance_p"], state["beta"]
        self._last_calibration_step = state["last_calibration_step"]
        self._pending_recalibration = state["pending_recalibration"]
        self._pool, self._refit_pool = pool, refit_pool
        if self.schedule != "every_step":
            self._refit_pool.clear()
        return changed


def _plain_float(value) -> float | None:
    return None if value is None else float(value)


__all__ = ["ClipCalibrator", "DEFAULT_MIN_TOKENS", "SCHEDULES", "UPPER_MODES", "STATE_KEYS"]
