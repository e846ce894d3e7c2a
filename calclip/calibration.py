"""Calibrated Clipping: PPO clip bounds that give an FP8 policy the clipping behaviour of BF16.

FP8 quantization noise widens the distribution of the importance ratio r. A token with advantage A < 0 and
r < low takes the constant, clipped branch of the PPO objective, so its gradient is zero: under FP8 many more
negative-advantage tokens fall below 1 - eps than under BF16 and their penalty is silently dropped. The
calibrator measures, on a few BF16 shadow forwards, which share of tokens BF16 would have clipped and moves
the bounds on the FP8 ratios so that the same share is clipped (DESIGN.md, "The calibration, defined
exactly"; the step numbers below refer to it).

- ``calibrate_bounds``: steps 1-5 on one batch, a pure function (torch only).
- ``fit_bounds``: the cheap ``every_step`` refit of L and H on FP8 ratios from a stored alpha / p / beta.
- ``ClipCalibrator``: the stateful object a trainer holds (schedules, EMA, rails, ranks, checkpointing).
- ``torch_distributed_all_gather``: the ``all_gather`` callable for ``ClipCalibrator`` under torch.distributed.

Statistics are computed in float64: the update masses are sums over up to millions of tokens, where float32
rounding would be large enough to move the balance search across data steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

UPPER_MODES = ("balance", "quantile", "fixed")
SCHEDULES = ("interval", "every_step")

# Concatenates a 1-D tensor from every rank along dim 0, in rank order (ragged lengths allowed).
AllGather = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class CalibrationResult:
    """One batch's calibration. A bound is None when its side had no data (DESIGN.md step 5)."""

    low: float | None  # L; None when N- is empty
    high: float | None  # H; None when N+ is empty, or (balance) when p or L is undefined
    alpha: float | None  # BF16 lower-clip share of N-; None when N- is empty
    balance_p: float | None  # M+(1+eps_high; rb) / M-(1-eps_low; rb); None when M-(1-eps_low; rb) = 0
    beta: float | None  # share of N+ with rb > 1+eps_high; None when N+ is empty
    base_low: float  # 1 - eps_low
    base_high: float  # 1 + eps_high
    num_neg: int  # |N-| (finite tokens)
    num_pos: int  # |N+| (finite tokens)
    num_nonfinite: int  # masked tokens dropped because a ratio was NaN/Inf or <= 0, or the advantage NaN/Inf

    def bounds(self) -> tuple[float, float]:
        """(low, high) with step 5's stateless fallbacks: L = 1-eps_low and H = 1+eps_high without data."""
        low = self.base_low if self.low is None else self.low
        high = self.base_high if self.high is None else self.high
        return low, high


# --------------------------------------------------------------------------------------------- validation


def _check_upper(upper: str) -> None:
    if upper not in UPPER_MODES:
        raise ValueError(f"upper must be one of {UPPER_MODES}, got {upper!r}")


def _check_eps(eps_low: float | None, eps_high: float) -> None:
    # 1 - eps_low is a ratio bound, so it must stay positive; eps_high = 0 would clip every A>0 token.
    if eps_low is not None and not (0.0 < eps_low < 1.0):
        raise ValueError(f"eps_low must lie in (0, 1), got {eps_low!r}")
    if not (0.0 < eps_high < math.inf):
        raise ValueError(f"eps_high must be positive and finite, got {eps_high!r}")


def _check_share(name: str, value: float | None) -> None:
    if value is not None and not (0.0 <= value <= 1.0):
        raise ValueError(f"{name} must lie in [0, 1] or be None, got {value!r}")


# ------------------------------------------------------------------------------------------ token selection


def _select_tokens(
    mask: Tensor,  # [B, T] (or [N]) bool or float; a token counts when mask != 0
    advantages: Tensor,  # [B], [B, 1] or [B, T] (or [N])
    *ratios: Tensor,  # each [B, T] (or [N])
) -> tuple[list[Tensor], Tensor, int]:
    """Flatten the masked tokens with A != 0 and finite values: (ratios [n] float64, advantages [n], #non-finite).

    Tokens with A = 0 belong to neither N- nor N+ and never enter a statistic, so they are dropped here.
    """
    shape = ratios[0].shape
    for ratio in ratios[1:]:
        if ratio.shape != shape:
            raise ValueError(f"ratio shapes differ: {tuple(ratio.shape)} vs {tuple(shape)}")
    if mask.shape != shape:
        raise ValueError(f"mask must have the ratio shape {tuple(shape)}, got {tuple(mask.shape)}")
    given = tuple(advantages.shape)
    if advantages.dim() == 1 and len(shape) == 2:
        advantages = advantages.unsqueeze(-1)  # [B] -> [B, 1]: one advantage per sequence
    # Exactly one advantage per sequence or per token: a [1] (or [1, 1]) tensor for a batch of 4 is a caller bug,
    # not something to broadcast to every row.
    per_sequence = len(shape) == 2 and tuple(advantages.shape) == (shape[0], 1)
    if not (per_sequence or advantages.shape == shape):
        allowed = f"[B], [B, 1] or [B, T] = {list(shape)}" if len(shape) == 2 else f"[N] = {list(shape)}"
        raise ValueError(f"advantages must have shape {allowed} for ratios of shape {tuple(shape)}, "
                         f"got {given}")  # fmt: skip
    advantages = advantages.expand(shape)

    keep = mask != 0
    finite = torch.isfinite(advantages)
    for ratio in ratios:
        # A ratio is exp of a log-ratio: <= 0 is corrupt data, dropped and counted with the non-finite tokens.
        finite = finite & torch.isfinite(ratio) & (ratio > 0)
    num_nonfinite = int((keep & ~finite).sum().item())
    keep = keep & finite & (advantages != 0)
    flat = [ratio[keep].to(torch.float64) for ratio in ratios]
    return flat, advantages[keep].to(torch.float64), num_nonfinite


# ------------------------------------------------------------------------------------------- the statistics


def _sorted_quantile(sorted_values: Tensor, q: float) -> Tensor:
    """torch.quantile(values, q) with its default linear interpolation, on values already sorted ([n], n > 0).

    Written out because the values are sorted anyway and torch.quantile refuses inputs above 2**24 elements.
    Same arithmetic as torch.quantile and numpy: rank q*(n-1), then lerp between its two neighbours.
    """
    rank = q * (sorted_values.numel() - 1)
    below = math.floor(rank)
    above = math.ceil(rank)
    return torch.lerp(sorted_values[below], sorted_values[above], rank - below)


def _neg_mass(ratio: Tensor, abs_adv: Tensor, low: float | Tensor) -> Tensor:
    """M-(L; r) = sum over N- with r >= L of |A| * r   (ratio, abs_adv: [n-] float64)."""
    return torch.where(ratio >= low, abs_adv * ratio, 0.0).sum()


def _pos_mass(ratio: Tensor, adv: Tensor, high: float | Tensor) -> Tensor:
    """M+(H; r) = sum over N+ with r <= H of A * r   (ratio, adv: [n+] float64)."""
    return torch.where(ratio <= high, adv * ratio, 0.0).sum()


def _balance_high(ratio_pos: Tensor, adv_pos: Tensor, target: Tensor) -> Tensor:
    """Smallest r_t (t in N+) with M+(r_t; r) >= target, else max r over N+ (step 4, `balance`).

    Scans the cumulative mass in ascending order of r. Ties need no special case although M+(H) counts every
    token with r <= H: the first position where the partial sum reaches the target lies in the first group
    of equal ratios whose full mass M+ reaches it, and every position of a group carries the same value.
    """
    sorted_ratio, order = torch.sort(ratio_pos)
    reached = torch.cumsum(adv_pos[order] * sorted_ratio, dim=0) >= target
    if not bool(reached.any()):
        return sorted_ratio[-1]
    return sorted_ratio[torch.nonzero(reached)[0, 0]]


def _fit_tokens(
    ratio_neg: Tensor,  # [n-] FP8 ratios of N-
    abs_adv_neg: Tensor,  # [n-] |A|
    ratio_pos: Tensor,  # [n+] FP8 ratios of N+
    adv_pos: Tensor,  # [n+] A
    *,
    alpha: float | None,
    balance_p: float | None,
    beta: float | None,
    base_high: float,
    upper: str,
) -> tuple[float | None, float | None]:
    """Steps 2 and 4 on the FP8 ratios, given the BF16 statistics. None marks a side without data."""
    low = None
    if alpha is not None and ratio_neg.numel() > 0:
        low = _sorted_quantile(torch.sort(ratio_neg).values, alpha)

    high = None
    if upper == "fixed":
        high = base_high
    elif ratio_pos.numel() == 0:
        high = None
    elif upper == "quantile":
        if beta is not None:
            high = _sorted_quantile(torch.sort(ratio_pos).values, 1.0 - beta).item()
    elif balance_p is not None and low is not None:
        target = balance_p * _neg_mass(ratio_neg, abs_adv_neg, low)
        high = _balance_high(ratio_pos, adv_pos, target).item()
    return (None if low is None else low.item()), high


def _calibrate_tokens(
    ratio_bf16: Tensor,  # [n] float64, masked finite tokens with A != 0
    ratio_fp8: Tensor,  # [n]
    advantages: Tensor,  # [n]
    *,
    eps_low: float,
    eps_high: float,
    upper: str,
    num_nonfinite: int,
) -> CalibrationResult:
    base_low, base_high = 1.0 - eps_low, 1.0 + eps_high
    neg, pos = advantages < 0, advantages > 0
    rb_neg, rq_neg, abs_adv_neg = ratio_bf16[neg], ratio_fp8[neg], -advantages[neg]
    rb_pos, rq_pos, adv_pos = ratio_bf16[pos], ratio_fp8[pos], advantages[pos]
    num_neg, num_pos = rb_neg.numel(), rb_pos.numel()

    # Step 1: the share of N- that BF16 clips from below.
    alpha = (rb_neg < base_low).sum().item() / num_neg if num_neg else None
    # Step 3: the BF16 balance of update masses between the two sides.
    neg_mass_bf16 = _neg_mass(rb_neg, abs_adv_neg, base_low)
    balance_p = (_pos_mass(rb_pos, adv_pos, base_high) / neg_mass_bf16).item() if neg_mass_bf16 > 0 else None
    if balance_p is not None and not math.isfinite(balance_p):
        # M- is positive but so small (subnormal advantages) that the quotient overflows float64: p is as
        # undefined as with M- = 0, so step 5's degenerate rule applies (found by hypothesis: A = -2.2e-309).
        balance_p = None
    # Step 4, `quantile` mode: the share of N+ that BF16 clips from above.
    beta = (rb_pos > base_high).sum().item() / num_pos if num_pos else None

    low, high = _fit_tokens(
        rq_neg, abs_adv_neg, rq_pos, adv_pos,
        alpha=alpha, balance_p=balance_p, beta=beta, base_high=base_high, upper=upper,
    )  # fmt: skip
    return CalibrationResult(
        low=low, high=high, alpha=alpha, balance_p=balance_p, beta=beta, base_low=base_low,
        base_high=base_high, num_neg=num_neg, num_pos=num_pos, num_nonfinite=num_nonfinite,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- public functions


def calibrate_bounds(
    ratio_bf16: Tensor,  # [B, T] ratio under the BF16 shadow policy (or [N] flat tokens)
    ratio_fp8: Tensor,  # [B, T] ratio under the quantized policy, same tokens
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T] bool or float, nonzero for completion tokens
    *,
    eps_low: float,
    eps_high: float,
    upper: str = "balance",
) -> CalibrationResult:
    """Clip bounds [L, H] for the FP8 ratios that clip like BF16 does at [1-eps_low, 1+eps_high].

    Exactly DESIGN.md steps 1-5:
      1. alpha = share of N- with rb < 1-eps_low
      2. L = quantile(rq over N-, alpha), linear interpolation
      3. p = M+(1+eps_high; rb) / M-(1-eps_low; rb)
      4. H: `balance` = smallest rq_t in N+ with M+(H; rq) >= p * M-(L; rq), else max rq over N+;
            `quantile` = quantile(rq over N+, 1-beta), beta = share of N+ with rb > 1+eps_high;
            `fixed` = 1+eps_high
      5. no data for a side -> that bound is None here (``result.bounds()`` gives 1-eps_low / 1+eps_high).
    The condition "M-(1-eps_low; rb) = 0 -> H = 1+eps_high" of step 5 is read as "p is undefined", so it
    applies to `balance`, the only mode that uses p; `quantile` needs N+ only.

    Masked tokens with a NaN/Inf or non-positive ratio (a ratio is exp of a log-ratio, so <= 0 is corrupt data),
    or a NaN/Inf advantage, are excluded and counted in ``num_nonfinite``. ``advantages`` must be exactly [B],
    [B, 1] or [B, T] (or [N] for flat ratios); anything else, a [1] tensor included, raises.
    """
    _check_upper(upper)
    _check_eps(eps_low, eps_high)
    (rb, rq), adv, num_nonfinite = _select_tokens(mask, advantages, ratio_bf16, ratio_fp8)
    return _calibrate_tokens(
        rb, rq, adv, eps_low=eps_low, eps_high=eps_high, upper=upper, num_nonfinite=num_nonfinite
    )


def fit_bounds(
    ratio_fp8: Tensor,  # [B, T] (or [N])
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T] bool or float
    *,
    alpha: float | None,
    balance_p: float | None,
    beta: float | None,
    eps_high: float,
    upper: str,
) -> tuple[float | None, float | None]:
    """The `every_step` refit: steps 2 and 4 on this batch's FP8 ratios with alpha, p, beta kept from the
    last BF16 shadow calibration. Returns (low, high); None marks a side without data (or without a stored
    statistic), where a stateful caller keeps its previous bound."""
    _check_upper(upper)
    _check_eps(None, eps_high)
    _check_share("alpha", alpha)
    _check_share("beta", beta)
    if balance_p is not None and not (0.0 <= balance_p < math.inf):
        raise ValueError(f"balance_p must be non-negative and finite or None, got {balance_p!r}")
    (rq,), adv, _ = _select_tokens(mask, advantages, ratio_fp8)
    neg, pos = adv < 0, adv > 0
    return _fit_tokens(
        rq[neg], -adv[neg], rq[pos], adv[pos],
        alpha=alpha, balance_p=balance_p, beta=beta, base_high=1.0 + eps_high, upper=upper,
    )  # fmt: skip


def torch_distributed_all_gather(group=None) -> AllGather:
    """An ``all_gather`` callable for ``ClipCalibrator`` built on torch.distributed (any backend).

    Every rank must call it with a 1-D tensor (lengths may differ); each gets the concatenation in rank order.
    Lengths are exchanged first, then the tensors padded to the longest and trimmed after the gather.
    """
    import torch.distributed as dist

    def all_gather(tensor: Tensor) -> Tensor:
        if tensor.dim() != 1:
            raise ValueError(f"all_gather takes a 1-D tensor, got shape {tuple(tensor.shape)}")
        world_size = dist.get_world_size(group)
        length = torch.tensor([tensor.numel()], dtype=torch.long, device=tensor.device)
        lengths = [torch.empty_like(length) for _ in range(world_size)]
        dist.all_gather(lengths, length, group=group)
        sizes = [int(n.item()) for n in lengths]
        longest = max(sizes)
        if longest == 0:  # the same on every rank, so every rank skips the gather together
            return tensor.new_empty(0)
        padded = tensor.new_zeros(longest)
        padded[: tensor.numel()] = tensor
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(gathered, sizes)])

    return all_gather


# ------------------------------------------------------------------------------------- the stateful calibrator

_STATE_KEYS = (
    "low", "high", "low_fitted", "high_fitted", "alpha", "balance_p", "beta", "step",
    "last_calibration_step", "num_calibrations", "num_refits", "pending_recalibration",
)  # fmt: skip


def _check_rails(name: str, rails: tuple[float, float]) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in rails)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a pair (min, max), got {rails!r}") from err
    if not (0.0 <= lo <= hi) or math.isnan(hi):
        raise ValueError(f"{name} must satisfy 0 <= min <= max, got {rails!r}")
    return lo, hi


class ClipCalibrator:
    """Calibrated Clipping bounds held across training steps (DESIGN.md steps 1-7 and the schedules).

    Before the first calibration the bounds are ``[init_low, init_high]`` (the paper's [0.6, 1.8]: wide, so
    that the first steps, before any BF16 statistic exists, drop few gradients). The first calibration that
    has data for a side replaces that side's initial bound; later ones, and every `every_step` refit, are
    smoothed: ``bound <- ema * bound + (1 - ema) * new``. A side without data keeps its bound (step 5).
    After every update the bounds are clamped to the rails, ``low_rails`` (default [0, 1]: a lower bound
    above 1 would clip on-policy tokens) and ``high_rails`` (default [1, 10]: an upper bound under 1 clips
    on-policy tokens, one above 10 no longer bounds anything). ``low_rails`` must end at or below the start
    of ``high_rails`` so that low <= high always holds. With ``upper="fixed"`` the upper bound is
    1+eps_high (clamped) from the start and ``init_high`` is not used.

    Schedules. The trainer asks ``needs_calibration(step)`` before each mini-batch whose policy has moved
    since the old log-probs (on an exactly on-policy mini-batch r = 1 and calibration means nothing):
      - `interval`: a shadow calibration is due at the first opportunity at or after steps 0, K, 2K, ...
        (once per window of K optimizer steps); the bounds are held in between.
      - `every_step`: the same shadow calibrations, and on every other mini-batch ``refit`` recomputes L and
        H from that batch's FP8 ratios with the stored alpha, p (and beta).
    ``request_recalibration()`` makes the next ``needs_calibration`` call return True (for example after an
    entropy spike); the K-step grid is not shifted by it.

    ``all_gather`` (optional) concatenates a 1-D tensor over ranks; with it every statistic is global and
    every rank holds the same bounds, equal to one process's result on all ranks' tokens (step 7). Every
    rank must then call ``calibrate`` / ``refit`` together. See ``torch_distributed_all_gather``.

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
        low_rails: tuple[float, float] = (0.0, 1.0),
        high_rails: tuple[float, float] = (1.0, 10.0),
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
        low_rails = _check_rails("low_rails", low_rails)
        high_rails = _check_rails("high_rails", high_rails)
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
        self._all_gather = all_gather

        self._low, self._high = float(init_low), float(init_high)
        self._low_fitted = self._high_fitted = False
        if upper == "fixed":
            self._high, self._high_fitted = self._clamp_high(1.0 + self.eps_high), True
        self._alpha: float | None = None
        self._balance_p: float | None = None
        self._beta: float | None = None
        self._step = 0  # the step last passed to needs_calibration: calibrations are credited to it
        self._last_calibration_step: int | None = None
        self._num_calibrations = 0
        self._num_refits = 0
        self._pending_recalibration = False

    # -- reading --------------------------------------------------------------------------------------

    @property
    def bounds(self) -> tuple[float, float]:
        """The (low, high) ratio bounds in force."""
        return self._low, self._high

    @property
    def calibrated(self) -> bool:
        return self._num_calibrations > 0

    # -- schedule -------------------------------------------------------------------------------------

    def needs_calibration(self, step: int) -> bool:
        """True when a BF16 shadow calibration is due at optimizer step ``step`` (>= 0)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self._step = step
        if self._pending_recalibration or self._last_calibration_step is None:
            return True
        return step // self.interval > self._last_calibration_step // self.interval

    def request_recalibration(self) -> None:
        """Make the next ``needs_calibration`` call return True."""
        self._pending_recalibration = True

    # -- updates --------------------------------------------------------------------------------------

    def calibrate(
        self,
        ratio_bf16: Tensor,  # [B, T] BF16 shadow ratios
        ratio_fp8: Tensor,  # [B, T] FP8 ratios, same tokens
        advantages: Tensor,  # [B] or [B, T]
        mask: Tensor,  # [B, T] bool or float
    ) -> dict[str, float]:
        """A shadow calibration (steps 1-7): update the bounds and the stored alpha, p, beta.

        It is credited to the step last passed to ``needs_calibration`` (the schedule's clock).
        """
        (rb, rq), adv, num_nonfinite = _select_tokens(mask, advantages, ratio_bf16, ratio_fp8)
        rb, rq, adv, num_nonfinite = self._gather(rb, rq, adv, num_nonfinite=num_nonfinite)
        result = _calibrate_tokens(
            rb, rq, adv, eps_low=self.eps_low, eps_high=self.eps_high, upper=self.upper,
            num_nonfinite=num_nonfinite,
        )  # fmt: skip
        # A statistic without data keeps its previous value, like the bounds.
        self._alpha = self._alpha if result.alpha is None else result.alpha
        self._balance_p = self._balance_p if result.balance_p is None else result.balance_p
        self._beta = self._beta if result.beta is None else result.beta
        self._update_bounds(result.low, result.high)
        self._last_calibration_step = self._step
        self._num_calibrations += 1
        self._pending_recalibration = False
        stats = self._stats(rq, adv)
        neg = adv < 0
        stats["clip/neg_low_frac_bf16"] = _share(rb[neg] < self._low)
        return stats

    def refit(
        self,
        ratio_fp8: Tensor,  # [B, T]
        advantages: Tensor,  # [B] or [B, T]
        mask: Tensor,  # [B, T] bool or float
    ) -> dict[str, float]:
        """The `every_step` refit of L and H on this batch's FP8 ratios with the stored alpha, p, beta.

        Before the first shadow calibration there is nothing to refit from and the bounds stay as they are.
        """
        if self.schedule != "every_step":
            raise RuntimeError(f"refit() belongs to the 'every_step' schedule; this calibrator uses {self.schedule!r}")
        (rq,), adv, num_nonfinite = _select_tokens(mask, advantages, ratio_fp8)
        rq, adv, _ = self._gather(rq, adv, num_nonfinite=num_nonfinite)
        neg, pos = adv < 0, adv > 0
        low, high = _fit_tokens(
            rq[neg], -adv[neg], rq[pos], adv[pos], alpha=self._alpha, balance_p=self._balance_p,
            beta=self._beta, base_high=1.0 + self.eps_high, upper=self.upper,
        )  # fmt: skip
        self._update_bounds(low, high)
        self._num_refits += 1
        return self._stats(rq, adv)

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

    def _stats(self, ratio_fp8: Tensor, adv: Tensor) -> dict[str, float]:
        low, high = self.bounds
        stats = {"calib/low": low, "calib/high": high}
        if self._alpha is not None:
            stats["calib/alpha"] = self._alpha
        if self._balance_p is not None:
            stats["calib/balance_p"] = self._balance_p
        if self.upper == "quantile" and self._beta is not None:
            stats["calib/beta"] = self._beta
        stats["clip/neg_low_frac_fp8"] = _share(ratio_fp8[adv < 0] < low)
        stats["clip/pos_high_frac"] = _share(ratio_fp8[adv > 0] > high)
        # How many tokens this fit saw (over all ranks): quantiles of a few hundred tokens move a lot between
        # calibrations (the evidence run's calibrated bounds did, docs/evidence.md), and these say how few.
        stats["calib/neg_tokens"] = float((adv < 0).sum())
        stats["calib/pos_tokens"] = float((adv > 0).sum())
        return stats

    # -- checkpointing --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything that evolves during training, plus the config for reference: plain Python values only, so a
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
            "config": {
                "eps_low": self.eps_low, "eps_high": self.eps_high, "upper": self.upper,
                "schedule": self.schedule, "interval": self.interval, "ema": self.ema,
                "low_rails": self.low_rails, "high_rails": self.high_rails,
            },  # fmt: skip
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state. The config is this object's own; bounds are clamped to its rails."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise KeyError(f"ClipCalibrator state is missing {missing}")
        self._low = self._clamp_low(float(state["low"]))
        self._high = self._clamp_high(float(state["high"]))
        self._low_fitted, self._high_fitted = bool(state["low_fitted"]), bool(state["high_fitted"])
        self._alpha, self._balance_p, self._beta = state["alpha"], state["balance_p"], state["beta"]
        self._step = int(state["step"])
        last = state["last_calibration_step"]
        self._last_calibration_step = None if last is None else int(last)
        self._num_calibrations = int(state["num_calibrations"])
        self._num_refits = int(state["num_refits"])
        self._pending_recalibration = bool(state["pending_recalibration"])


def _plain_float(value) -> float | None:
    return None if value is None else float(value)


def _share(flags: Tensor) -> float:
    """Share of True in a 1-D bool tensor; 0.0 for an empty one (no token of that side was clipped)."""
    return flags.double().mean().item() if flags.numel() else 0.0
