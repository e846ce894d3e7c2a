"""Rollout-correction importance weights (TIS / MIS) between the trainer and the rollout engine.

The rollout engine (vLLM, possibly FP8) samples from pi_rollout while the trainer's old log-probs come from
pi_old; the weight w = pi_old / pi_rollout corrects that mismatch (Yao et al., "Your efficient RL framework
secretly brings you off-policy RL training"; verl rollout correction; TRL ``vllm_importance_sampling_*``).

    token_*     w_t = exp(old_logp_t - rollout_logp_t)                       -> [B, T]
    sequence_*  w_b = exp(sum over the sequence's tokens of the token log-ratio) -> [B, 1]
                (the SUM, i.e. the likelihood ratio of the whole sequence, as TRL 1.16 and verl do)
    *_truncate  TIS: w <- clamp(w, lower_cap, cap)
    *_mask      MIS: w <- 0 where w > cap or w < lower_cap, else w unchanged (TRL 1.16 semantics)
    none        w = 1

The log-weight is clamped to +-LOG_RATIO_CLAMP before exp (a sequence sum can be far larger than any token's),
which changes nothing for any cap below exp(20). Weights are detached: they are constants of the loss.

A token whose old or rollout log-prob is not finite gets a log-ratio of 0 (weight 1 at token level, no
contribution to a sequence sum; TRL does the same for NaN), is counted in "tis/nonfinite_tokens" and is left
out of the statistics. Pass the weights to ``clipped_surrogate(is_weights=...)``; a non-finite old log-prob
also excludes the token from the loss there.

Stats (0-dim, detached, over valid tokens for token modes, over sequences with >= 1 valid token otherwise):
"tis/weight_mean", "tis/weight_min", "tis/weight_max" of the final weights; "tis/clipped_frac" the share of
raw weights outside [lower_cap, cap] (truncated or masked); "tis/ess" the normalized effective sample size
(sum w)^2 / (N * sum w^2) in [1/N, 1], 1 for uniform weights, 0 when every weight is 0 or N = 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calclip.losses.metrics import stat_dtype
from calclip.losses.ratios import LOG_RATIO_CLAMP

IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _check(mode: str, cap: float, lower_cap: float | None) -> None:
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if lower_cap is not None and not 0 <= lower_cap <= cap:
        raise ValueError(f"lower_cap must satisfy 0 <= lower_cap <= cap = {cap}, got {lower_cap}")


def rollout_correction_weights(
    old_logp: Tensor,  # [B, T] trainer log-probs of the sampled tokens (before the update)
    rollout_logp: Tensor,  # [B, T] rollout-engine log-probs of the same tokens
    mask: Tensor,  # [B, T] nonzero for completion tokens
    *,
    mode: str,
    cap: float = 2.0,
    lower_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:  # weights [B, T] (token/none) or [B, 1] (sequence), detached
    _check(mode, cap, lower_cap)
    if old_logp.shape != mask.shape or rollout_logp.shape != mask.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} must have the "
            f"mask's shape {tuple(mask.shape)}"
        )
    with torch.no_grad():
        old = old_logp.detach().to(stat_dtype(old_logp))
        rollout = rollout_logp.detach().to(old.dtype)
        in_mask = mask != 0
        finite = torch.isfinite(old) & torch.isfinite(rollout)
        valid = in_mask & finite
        zero = torch.zeros((), dtype=old.dtype, device=old.device)
        log_w = torch.where(valid, old - rollout, zero)
        if mode.startswith("sequence"):
            log_w = log_w.sum(-1, keepdim=True)  # [B, 1]
            counted = valid.any(-1, keepdim=True)  # [B, 1]
        else:
            counted = valid  # [B, T]
        raw = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        low = 0.0 if lower_cap is None else float(lower_cap)
        outside = (raw > cap) | (raw < low)
        if mode == "none":
            weights = torch.ones_like(raw)
            outside = torch.zeros_like(outside)
        elif mode.endswith("truncate"):
            weights = raw.clamp(min=low, max=cap)
        else:
            weights = torch.where(outside, zero, raw)
        stats = _weight_stats(weights, outside, counted)
        stats["tis/nonfinite_tokens"] = (in_mask & ~finite).sum().to(torch.float32)
        return weights, stats


def _weight_stats(weights: Tensor, outside: Tensor, counted: Tensor) -> dict[str, Tensor]:
    n = counted.sum().to(weights.dtype)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    w = torch.where(counted, weights, zero)
    inf = torch.tensor(float("inf"), dtype=weights.dtype, device=weights.device)
    total, total_sq = w.sum(), (w * w).sum()
    # The clamp only guards the branch torch.where discards (every weight 0), so no NaN is ever formed.
    safe_sq = total_sq.clamp(min=torch.finfo(w.dtype).tiny)
    ess = torch.where(total_sq > 0, total * total / (n.clamp(min=1) * safe_sq), zero)
    return {
        "tis/weight_mean": total / n.clamp(min=1),
        "tis/weight_min": torch.where(n > 0, torch.where(counted, weights, inf).amin(), zero),
        "tis/weight_max": torch.where(n > 0, torch.where(counted, weights, -inf).amax(), zero),
        "tis/clipped_frac": (outside & counted).sum().to(weights.dtype) / n.clamp(min=1),
        "tis/ess": ess,
    }
