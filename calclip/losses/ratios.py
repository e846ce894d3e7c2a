"""Importance ratios r = pi_theta / pi_old at token and sequence level.

The log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp`` so that no inf reaches the
loss: exp(20) ~ 4.9e8 is finite in float32 and bfloat16, and a ratio that far from 1 is clipped by any
sane [low, high] anyway. Inside the clamp range the gradient is the exact one; outside it is zero (the token
sits on the clipped, constant branch in every clip mode, so nothing is lost). Half-precision inputs are
upcast to float32 first because exp(20) overflows float16.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0

LEVELS = ("token", "sequence")


def _upcast(x: Tensor) -> Tensor:
    # float16/bfloat16 -> float32; float32/float64 unchanged.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def token_log_ratio(
    logp: Tensor,  # [B, T] current policy log-probs
    old_logp: Tensor,  # [B, T] log-probs the batch was sampled (or last evaluated) under
) -> Tensor:  # [B, T] log r, clamped to +-LOG_RATIO_CLAMP, at least float32
    return (_upcast(logp) - _upcast(old_logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(
    log_ratio: Tensor,  # [B, T] token log-ratios
    mask: Tensor,  # [B, T] nonzero for tokens that count
) -> Tensor:  # [B, 1] masked mean of the token log-ratio (GSPO / TRL importance_sampling_level="sequence")
    keep = mask != 0
    # torch.where, not log_ratio * mask: a non-finite value on a padded position must not become NaN.
    total = torch.where(keep, log_ratio, torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)).sum(-1)
    count = keep.sum(-1).clamp(min=1).to(log_ratio.dtype)
    return (total / count).unsqueeze(-1)


def importance_ratio(
    logp: Tensor,  # [B, T]
    old_logp: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    level: str = "token",
) -> tuple[Tensor, Tensor]:  # (ratio, log_ratio): [B, T] for "token", [B, 1] for "sequence"
    """Ratio and log-ratio at the chosen importance-sampling level.

    "token": r_t = exp(clamp(logp_t - old_logp_t)).
    "sequence": one ratio per sequence, exp of the masked mean of the clamped token log-ratios, exactly as
    TRL 1.16 computes it for ``importance_sampling_level="sequence"`` (GSPO); it broadcasts over tokens.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    log_ratio = token_log_ratio(logp, old_logp)
    if level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)
    return torch.exp(log_ratio), log_ratio
