"""The calibration of one set of tokens, as pure functions (DESIGN.md, "The calibration, defined exactly", steps
1-5; the step numbers below refer to it).

- ``calibrate_bounds``: steps 1-5 on the given tokens: alpha, p, beta from the BF16 shadow ratios, [L, H] on the
  FP8 ratios.
- ``fit_bounds``: steps 2 and 4 only, on FP8 ratios, from a stored alpha / p / beta (the ``every_step`` refit).

Statistics are computed in float64: the update masses are sums over up to millions of tokens, where float32
rounding would be large enough to move the balance search across data steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

UPPER_MODES = ("balance", "quantile", "fixed")


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
