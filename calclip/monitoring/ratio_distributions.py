"""The ratio distributions calclip draws: FP8 and BF16-shadow importance ratios of the same tokens, split by the
sign of the advantage, and the shares of them that given bounds drop. Pure torch (the trainer's W&B histograms
and ``calclip diagnose --plot`` both take their numbers from here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RatioSamples:
    """1-D float64 ratios of the masked tokens whose two ratios and advantage are finite (the tokens the
    calibration uses), split by advantage sign; zero-advantage tokens are in neither side."""

    fp8_neg: Tensor  # ratio under the quantized policy, A < 0
    bf16_neg: Tensor  # ratio under the BF16 shadow, same tokens
    fp8_pos: Tensor  # A > 0
    bf16_pos: Tensor
    num_nonfinite: int  # masked tokens left out for a NaN/Inf ratio or advantage

    def log_ratios(self) -> dict[str, Tensor]:
        """``{"fp8/neg_adv": log r, ...}``: the four distributions, as log r (what the histograms show)."""
        return {
            "fp8/neg_adv": self.fp8_neg.log(),
            "bf16/neg_adv": self.bf16_neg.log(),
            "fp8/pos_adv": self.fp8_pos.log(),
            "bf16/pos_adv": self.bf16_pos.log(),
        }


def split_ratios(
    ratio_fp8: Tensor,  # [B, T] ratio under the quantized policy
    ratio_bf16: Tensor,  # [B, T] ratio under the BF16 shadow, same tokens
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T] bool or float, nonzero for completion tokens
) -> RatioSamples:
    """The masked tokens' ratios by advantage sign, on the CPU (float64)."""
    if ratio_fp8.shape != ratio_bf16.shape or ratio_fp8.shape != mask.shape:
        raise ValueError(
            f"ratio_fp8 {tuple(ratio_fp8.shape)}, ratio_bf16 {tuple(ratio_bf16.shape)} and mask "
            f"{tuple(mask.shape)} must have one shape"
        )
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv = adv.expand_as(ratio_fp8)
    masked = mask != 0
    finite = torch.isfinite(ratio_fp8) & torch.isfinite(ratio_bf16) & torch.isfinite(adv)
    keep = masked & finite
    neg, pos = keep & (adv < 0), keep & (adv > 0)

    def take(ratio: Tensor, where: Tensor) -> Tensor:
        return ratio[where].detach().to(device="cpu", dtype=torch.float64)

    return RatioSamples(
        fp8_neg=take(ratio_fp8, neg),
        bf16_neg=take(ratio_bf16, neg),
        fp8_pos=take(ratio_fp8, pos),
        bf16_pos=take(ratio_bf16, pos),
        num_nonfinite=int((masked & ~finite).sum()),
    )


def _share(values: Tensor, selected: Tensor) -> float:
    return float(selected.sum()) / values.numel() if values.numel() else 0.0


def dropped_shares(samples: RatioSamples, *, low: float, high: float, eps_low: float, eps_high: float) -> dict:
    """Shares of each side whose clipped branch is taken (zero gradient): A<0 tokens with r < bound, A>0 tokens
    with r > bound, for FP8 at the static bounds 1-eps_low / 1+eps_high, BF16 at the static bounds, and FP8 at the
    calibrated ``low`` / ``high``. The A<0 names match the trainer's metrics (``clip/neg_low_frac_*``)."""
    base_low, base_high = 1.0 - eps_low, 1.0 + eps_high
    return {
        "neg_low_frac_fp8_static": _share(samples.fp8_neg, samples.fp8_neg < base_low),
        "neg_low_frac_bf16": _share(samples.bf16_neg, samples.bf16_neg < base_low),
        "neg_low_frac_fp8": _share(samples.fp8_neg, samples.fp8_neg < low),
        "pos_high_frac_fp8_static": _share(samples.fp8_pos, samples.fp8_pos > base_high),
        "pos_high_frac_bf16": _share(samples.bf16_pos, samples.bf16_pos > base_high),
        "pos_high_frac_fp8": _share(samples.fp8_pos, samples.fp8_pos > high),
    }
