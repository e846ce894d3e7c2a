"""``oracle``: a reference arm, not a method. Per token, clip exactly where the BF16 shadow ratio leaves
[1 - epsilon, 1 + epsilon_high], with a shadow forward on every moved mini-batch: the best any calibration of the
FP8 ratios can do.

``oracle_bounds`` gives the per-token bounds under which the clipped surrogate drops exactly the tokens the BF16
shadow drops (A<0 below 1-eps_low, A>0 above 1+eps_high) and keeps every other token's unclipped gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calclip.clipping.policy import ClipBounds, ClipFields, ClipPolicy, require_token_ratios, warn_if_on_policy
from calclip.clipping.registry import register_clip_mode
from calclip.losses.registry import ClipMode


def oracle_bounds(
    ratio_fp8: Tensor,  # [B, T] ratios the loss uses
    ratio_bf16: Tensor,  # [B, T] BF16 shadow ratios of the same tokens
    advantages: Tensor,  # [B] or [B, T]
    *,
    base_low: float,  # 1 - eps_low
    base_high: float,  # 1 + eps_high
) -> tuple[Tensor, Tensor]:
    """Per-token (low, high) [B, T] with which ``clipped_surrogate`` clips exactly the tokens BF16 clips.

    A token BF16 drops gets low = high = c with c on the clipped side of its own ratio (c = r + 1 > r for A < 0,
    c = r / 2 < r for A > 0), so min(r*A, clip(r, c, c)*A) = c*A is constant: zero gradient. Every other token gets
    [0, inf): clip(r) = r, the unclipped gradient. Non-finite ratios get the static bounds.
    """
    ratio_fp8 = ratio_fp8.detach()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 and ratio_fp8.dim() == 2 else advantages
    adv = adv.expand(ratio_fp8.shape)  # [B] -> [B, T]: one advantage per sequence
    drop_neg = (adv < 0) & (ratio_bf16 < base_low)
    drop_pos = (adv > 0) & (ratio_bf16 > base_high)
    inf = torch.full_like(ratio_fp8, float("inf"))
    low = torch.where(drop_neg, ratio_fp8 + 1.0, torch.where(drop_pos, ratio_fp8 / 2, torch.zeros_like(ratio_fp8)))
    high = torch.where(drop_neg, ratio_fp8 + 1.0, torch.where(drop_pos, ratio_fp8 / 2, inf))
    finite = torch.isfinite(ratio_fp8) & torch.isfinite(ratio_bf16)
    low = torch.where(finite, low, torch.full_like(low, base_low))
    high = torch.where(finite, high, torch.full_like(high, base_high))
    return low, high


@register_clip_mode
class OracleClip(ClipPolicy):
    """Reference arm: per token, clip exactly where the BF16 shadow ratio leaves [1 - epsilon, 1 + epsilon_high]
    (the static bounds are the ones logged in force).

    Where no shadow ran (on-policy, or no shadow old log-probs yet) the loss uses the static bounds."""

    name = ClipMode.ORACLE

    @classmethod
    def config_rules(cls, fields: ClipFields) -> ClipFields:
        require_token_ratios(cls.name, fields)
        warn_if_on_policy(cls.name, fields)
        return fields

    @property
    def needs_shadow(self) -> bool:
        return True

    def needs_shadow_this_step(self, calibration_due: bool) -> bool:
        return True  # its bounds are the shadow's clip decisions on every moved mini-batch

    def batch_bounds(self, in_force, *, ratio_fp8, ratio_bf16, advantages) -> ClipBounds:
        if ratio_fp8 is None or ratio_bf16 is None:  # on-policy, or no shadow old log-probs yet: the static bounds
            return super().batch_bounds(in_force, ratio_fp8=ratio_fp8, ratio_bf16=ratio_bf16, advantages=advantages)
        low, high = oracle_bounds(ratio_fp8, ratio_bf16, advantages, base_low=1.0 - self.eps_low,
                                  base_high=1.0 + self.eps_high)
        return ClipBounds(low, high, None)
