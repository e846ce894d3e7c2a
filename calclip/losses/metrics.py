"""Detached diagnostics: masked means, train/rollout mismatch, entropy by advantage sign.

Every function returns detached 0-dim tensors in at least float32 (counts in bfloat16 are wrong above 256).
A token whose inputs are not finite is left out of the statistic; a statistic over no tokens is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calclip.losses.ratios import LOG_RATIO_CLAMP
from calclip.losses.sanitize import as_2d


def stat_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def masked_mean(
    x: Tensor,  # [B, T] (or anything broadcastable to mask)
    mask: Tensor,  # [B, T] nonzero = in
) -> Tensor:  # 0-dim, detached; 0 when the mask is empty
    """Plain masked mean. Values under a zero mask are ignored even if non-finite (torch.where)."""
    with torch.no_grad():
        keep = mask != 0
        x = x.detach().to(stat_dtype(x))
        total = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
        return total / keep.sum().clamp(min=1).to(x.dtype)


def masked_share(selected: Tensor, population: Tensor) -> Tensor:
    """|selected & population| / |population| as float32; 0 for an empty population."""
    with torch.no_grad():
        hits = (selected & population).sum().to(torch.float32)
        return hits / population.sum().clamp(min=1).to(torch.float32)


def _finite_diff(logp_a: Tensor, logp_b: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    a = logp_a.detach().to(stat_dtype(logp_a))
    b = logp_b.detach().to(stat_dtype(logp_b))
    keep = (mask != 0) & torch.isfinite(a) & torch.isfinite(b)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    diff = torch.where(keep, a - b, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return diff, keep


def token_mult_prob_error(
    logp_a: Tensor,  # [B, T] e.g. trainer log-probs
    logp_b: Tensor,  # [B, T] e.g. rollout-engine log-probs of the same tokens
    mask: Tensor,  # [B, T]
) -> Tensor:  # 0-dim: mean over tokens of exp(|a - b|); 1.0 is perfect, < 1.03-1.05 acceptable (NVIDIA NeMo RL)
    """|a - b| is clamped to LOG_RATIO_CLAMP first, so one wild token cannot make the metric inf."""
    with torch.no_grad():
        diff, keep = _finite_diff(logp_a, logp_b, mask)
        return masked_mean(torch.exp(diff.abs()), keep)


def kl_k3(
    logp_p: Tensor,  # [B, T] log p(token), e.g. trainer log-probs
    logp_q: Tensor,  # [B, T] log q(token) of the policy that SAMPLED the tokens, e.g. the rollout engine
    mask: Tensor,  # [B, T]
) -> Tensor:  # 0-dim
    """k3 estimator (Schulman, "Approximating KL divergence") of KL(q || p) from tokens sampled from q.

    With log_r = log p - log q per token, k3 = exp(log_r) - 1 - log_r >= 0 and E_q[k3] = KL(q || p).
    For the train/rollout mismatch call it as kl_k3(trainer_logp, rollout_logp, mask).
    """
    with torch.no_grad():
        log_r, keep = _finite_diff(logp_p, logp_q, mask)
        return masked_mean(torch.expm1(log_r) - log_r, keep)


def entropy_stats(
    entropies: Tensor,  # [B, T] per-token entropy of the current policy
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T]
) -> dict[str, Tensor]:
    """"entropy": mean over tokens; "entropy/neg_adv": mean over tokens with A < 0 (the tokens FP8 clipping
    stops penalizing, where entropy spikes start). Tokens with non-finite entropy or advantage are left out."""
    with torch.no_grad():
        adv = as_2d(advantages.detach(), "advantages", mask.size(0), mask.size(1))
        ent = entropies.detach()
        keep = (mask != 0) & torch.isfinite(ent) & torch.isfinite(adv)
        return {
            "entropy": masked_mean(ent, keep),
            "entropy/neg_adv": masked_mean(ent, keep & (adv < 0)),
        }
