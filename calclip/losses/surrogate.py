"""PPO/GRPO clipped surrogate with static, asymmetric, per-token and dual-clip bounds.

Per token (or per sequence at level "sequence"), with r the importance ratio and A the advantage:

    loss = -min(r * A, clip(r, low, high) * A)                      (PPO; TRL 1.16 grpo/bnpo/dr_grpo/dapo)
    loss = -max(min(r * A, clip(r, low, high) * A), c * A)  if A < 0 and dual_clip_c = c > 1  (dual clip)

``low``/``high`` are ratio bounds (0.8 / 1.28), not epsilons. The dual clip (Ye et al. 2020, as verl's
``compute_policy_loss`` and NeMo RL implement it) caps the penalty of a negative-advantage token whose ratio
exploded: for A < 0 the inner min equals A * max(r, low), so the dual branch c * A (constant, zero gradient)
takes over exactly when max(r, low) > c.

Why the split clip statistics matter (docs/DESIGN.md): a token with A < 0 and r < low sits on the constant branch,
so its gradient is zero; FP8 noise raises that share. "clip/neg_low_frac" measures it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from calclip.losses.aggregation import aggregate, check_aggregation
from calclip.losses.metrics import masked_share, stat_dtype
from calclip.losses.ratios import LEVELS, importance_ratio
from calclip.losses.sanitize import sanitize_inputs


def _check_bounds(low, high, dual_clip_c) -> None:
    """Number bounds (the static and calibrated modes, or a registered mode's): no NaN, low <= high, and no side
    that clips every token (low = +inf, high = -inf). A NaN bound made every clamp NaN and the loss NaN. An open
    side (high = +inf, low = -inf) clips nothing on that side, as the oracle's per-token ``high`` of +inf does.
    Tensor bounds are per token: checking them here would cost a device sync each call, so a token with a NaN
    bound (or low = +inf, high = -inf) is left out like a non-finite input (``_bad_bound_tokens``)."""
    for name, bound, wrong in (("low", low, math.inf), ("high", high, -math.inf)):
        if not isinstance(bound, Tensor) and (math.isnan(float(bound)) or float(bound) == wrong):
            raise ValueError(f"{name} must be a ratio bound that can clip (e.g. 0.8 and 1.28; high = +inf leaves "
                             f"the upper side open), got {bound}")
    if not isinstance(low, Tensor) and not isinstance(high, Tensor) and float(low) > float(high):
        raise ValueError(f"low must be <= high (ratio bounds, e.g. 0.8 and 1.28), got low={low}, high={high}")
    if dual_clip_c is not None and not (math.isfinite(float(dual_clip_c)) and float(dual_clip_c) > 1.0):
        raise ValueError(f"dual_clip_c must be > 1 and finite (verl/NeMo dual-clip constant, e.g. 3.0), got "
                         f"{dual_clip_c}")


def _bad_bound_tokens(low, high, shape: torch.Size, device: torch.device) -> Tensor | None:
    """[B, T] bool: tokens whose tensor bound cannot clip (NaN, low = +inf, high = -inf); None for number bounds."""
    bad = None
    for bound, wrong in ((low, float("inf")), (high, float("-inf"))):
        if isinstance(bound, Tensor):
            flags = (torch.isnan(bound) | (bound == wrong)).to(device).expand(shape)
            bad = flags if bad is None else bad | flags
    return bad


def _as_bound(bound: float | Tensor, like: Tensor) -> Tensor:
    # Bounds are hyperparameters or calibrator outputs: never differentiate through them.
    return torch.as_tensor(bound, dtype=like.dtype, device=like.device).detach()


def clipped_surrogate_per_token(
    ratio: Tensor,  # [B, T] or [B, 1]
    advantages: Tensor,  # [B, 1] or [B, T]
    low: float | Tensor,  # float, 0-dim, or broadcastable to [B, T]
    high: float | Tensor,
    dual_clip_c: float | None = None,
) -> Tensor:  # broadcast of ratio and advantages: [B, 1] or [B, T]
    """The unreduced surrogate loss (see module docstring). No masking, no sanitizing."""
    _check_bounds(low, high, dual_clip_c)
    advantages = advantages.to(ratio.dtype)
    clipped = torch.clamp(ratio, min=_as_bound(low, ratio), max=_as_bound(high, ratio))
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip_c is not None:
        dual = torch.maximum(objective, float(dual_clip_c) * advantages)
        objective = torch.where(advantages < 0, dual, objective)
    return -objective


def clipped_surrogate(
    logp: Tensor,  # [B, T] current policy log-probs (requires grad)
    old_logp: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T] nonzero for completion tokens
    *,
    low: float | Tensor,  # ratio lower bound: float, 0-dim or [B, T]
    high: float | Tensor,  # ratio upper bound: float, 0-dim or [B, T]
    dual_clip_c: float | None = None,
    level: str = "token",  # "token" | "sequence" (GSPO, TRL importance_sampling_level)
    aggregation: str = "grpo",  # "grpo" | "bnpo" | "dr_grpo" | "dapo"
    max_completion_length: int | None = None,
    num_items: Tensor | float | None = None,
    is_weights: Tensor | None = None,  # [B, T] or [B, 1] rollout-correction weights (TIS/MIS), detached
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy loss and its detached statistics.

    Tokens with a non-finite logp, old_logp, advantage or IS weight are excluded from the loss and from every
    statistic and counted in "nonfinite_tokens", as are tokens whose per-token (tensor) bound is NaN; the loss and
    its gradient stay finite. A number bound must be able to clip: not NaN, no low = +inf or high = -inf
    (ValueError); high = +inf leaves the upper side open. With no tokens left, an empty batch (no
    rows) included, the loss is 0 with a zero gradient and every statistic 0.

    Stats (0-dim, detached; fractions over the valid tokens, a sequence-level ratio counted once per token):
      "clip/neg_low_frac"   share of A<0 tokens with r < low   (zero-gradient penalties)
      "clip/pos_high_frac"  share of A>0 tokens with r > high
      "clip/dual_frac"      share of A<0 tokens on the dual-clip branch (0 without dual clip)
      "ratio/mean", "ratio/min", "ratio/max"   over valid tokens (0 when there are none)
      "nonfinite_tokens", "tokens", "neg_tokens", "pos_tokens"   counts (float32; the last two are the A<0 /
      A>0 valid tokens behind the clip shares)
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    check_aggregation(aggregation, max_completion_length, num_items)
    _check_bounds(low, high, dual_clip_c)

    extra = () if is_weights is None else (is_weights.detach(),)
    inputs = sanitize_inputs(logp, old_logp, advantages, mask, *extra)
    bad = _bad_bound_tokens(low, high, inputs.mask.shape, inputs.mask.device)
    if bad is not None:  # left out and counted, and given bounds that clip nothing so no NaN is computed
        with torch.no_grad():
            inputs = inputs._replace(mask=inputs.mask & ~bad,
                                     nonfinite_tokens=inputs.nonfinite_tokens + (bad & inputs.mask).sum().float())
        low = torch.where(bad, 0.0, low) if isinstance(low, Tensor) else low
        high = torch.where(bad, float("inf"), high) if isinstance(high, Tensor) else high
    ratio, _ = importance_ratio(inputs.logp, inputs.old_logp, inputs.mask, level=level)
    per_token_loss = clipped_surrogate_per_token(ratio, inputs.advantages, low, high, dual_clip_c)
    if is_weights is not None:
        per_token_loss = per_token_loss * inputs.extra[0].to(per_token_loss.dtype)
    loss = aggregate(
        per_token_loss,
        inputs.mask,
        aggregation,
        max_completion_length=max_completion_length,
        num_items=num_items,
    )
    stats = _surrogate_stats(ratio, inputs.advantages, inputs.mask, low, high, dual_clip_c)
    stats["nonfinite_tokens"] = inputs.nonfinite_tokens
    return loss, stats


def _surrogate_stats(ratio, advantages, valid, low, high, dual_clip_c) -> dict[str, Tensor]:
    with torch.no_grad():
        r = ratio.detach().to(stat_dtype(ratio)).expand(valid.shape)
        adv = advantages.detach().to(r.dtype).expand(valid.shape)
        neg = valid & (adv < 0)
        pos = valid & (adv > 0)
        stats = {
            "clip/neg_low_frac": masked_share(r < _as_bound(low, r), neg),
            "clip/pos_high_frac": masked_share(r > _as_bound(high, r), pos),
        }
        if dual_clip_c is None:
            stats["clip/dual_frac"] = torch.zeros((), dtype=torch.float32, device=r.device)
        else:
            clipped = torch.clamp(r, min=_as_bound(low, r), max=_as_bound(high, r))
            inner = torch.minimum(r * adv, clipped * adv)
            stats["clip/dual_frac"] = masked_share(inner < float(dual_clip_c) * adv, neg)
        count = valid.sum()
        zero = torch.zeros((), dtype=r.dtype, device=r.device)
        stats["ratio/mean"] = torch.where(valid, r, zero).sum() / count.clamp(min=1).to(r.dtype)
        if valid.numel() == 0:  # an empty batch (no rows or no positions): amin/amax of nothing would raise
            stats["ratio/min"] = stats["ratio/max"] = zero
        else:
            inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
            rmin = torch.where(valid, r, inf).amin()
            rmax = torch.where(valid, r, -inf).amax()
            stats["ratio/min"] = torch.where(count > 0, rmin, zero)
            stats["ratio/max"] = torch.where(count > 0, rmax, zero)
        stats["tokens"] = count.to(torch.float32)
        # the populations behind the shares, so callers can reduce the shares exactly across ranks
        stats["neg_tokens"] = neg.sum().to(torch.float32)
        stats["pos_tokens"] = pos.sum().to(torch.float32)
        return stats
