"""Which negative-advantage penalties a lower bound drops, scored against the ones BF16 drops (DESIGN.md step 10).

A token with A < 0 whose ratio is below the lower bound sits on the constant branch of the PPO objective: its
gradient is zero, its penalty dropped. The set FP8 drops at the bounds in force is compared with the set the BF16
shadow drops at the static bound 1 - eps_low on the same tokens:

    recall    = |FP8 drops and BF16 drops| / |BF16 drops|   (the penalties BF16 would drop that FP8 drops too)
    precision = |FP8 drops and BF16 drops| / |FP8 drops|    (FP8 drops that BF16 would have dropped too)

Scored on tokens the bounds were not fitted on, these say whether a calibration generalizes; on the tokens it was
fitted on they say nothing. ``drop_counts`` returns counts, so a trainer sums them over ranks and mini-batches
before dividing.

The bounds that drop exactly BF16's drops are the ``oracle`` clip mode's (``calclip.clipping.oracle``).
"""

from __future__ import annotations

import torch
from torch import Tensor

# drop_counts() layout
NEG_TOKENS, FP8_DROPS, BF16_DROPS, BOTH_DROP = range(4)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.dim() == 1 and like.dim() == 2:
        advantages = advantages.unsqueeze(-1)  # [B] -> [B, 1]: one advantage per sequence
    return advantages.expand(like.shape)


def drop_counts(
    ratio_fp8: Tensor,  # [B, T] ratio under the policy being trained
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T] nonzero for completion tokens
    low: float | Tensor,  # the lower bound in force: float or broadcastable to [B, T]
    *,
    ratio_bf16: Tensor | None = None,  # [B, T] BF16 shadow ratios of the same tokens
    base_low: float | None = None,  # 1 - eps_low, the bound BF16 is scored at
) -> Tensor:
    """float64 [4]: (A<0 tokens, of which FP8 drops (r_fp8 < low), BF16 drops (r_bf16 < base_low), both drop).

    Tokens with a non-finite ratio or advantage are left out. Without ``ratio_bf16`` the last two counts are 0.
    """
    adv = _per_token(advantages, ratio_fp8)
    neg = (mask != 0) & torch.isfinite(adv) & (adv < 0) & torch.isfinite(ratio_fp8)
    low = torch.as_tensor(low, dtype=ratio_fp8.dtype, device=ratio_fp8.device)
    fp8 = neg & (ratio_fp8 < low)
    if ratio_bf16 is None:
        bf16 = torch.zeros_like(neg)
    else:
        if base_low is None:
            raise ValueError("base_low (1 - eps_low) is needed with ratio_bf16")
        neg = neg & torch.isfinite(ratio_bf16)
        fp8 = fp8 & neg
        bf16 = neg & (ratio_bf16 < base_low)
    counts = torch.stack([neg.sum(), fp8.sum(), bf16.sum(), (fp8 & bf16).sum()])
    return counts.to(torch.float64)


def drop_shares(counts: Tensor) -> dict[str, float]:
    """Shares from (summed) ``drop_counts``; a share over an empty set is 0 (nothing to drop) or, for recall and
    precision, left out (undefined)."""
    neg, fp8, bf16, both = (float(c) for c in counts)
    shares = {"neg_drop_frac": fp8 / neg if neg else 0.0, "neg_drop_frac_bf16": bf16 / neg if neg else 0.0}
    if bf16:
        shares["drop_recall"] = both / bf16
    if fp8:
        shares["drop_precision"] = both / fp8
    return shares

