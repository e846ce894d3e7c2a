"""Exclude tokens with non-finite inputs before they reach a loss.

FP8 forwards can produce NaN/Inf log-probs. A token whose log-prob, old log-prob, advantage (or any extra
per-token tensor such as IS weights) is not finite is dropped from the mask and counted, and every
non-finite value, masked or not, is replaced by 0 with ``torch.where``. ``torch.where`` matters: its backward
sends exactly 0 to the replaced entries, whereas ``x * mask`` would turn NaN * 0 into a NaN gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class SanitizedInputs(NamedTuple):
    logp: Tensor  # [B, T] non-finite entries replaced by 0 (gradient 0 there)
    old_logp: Tensor  # [B, T] same
    advantages: Tensor  # [B, 1] or [B, T] (a [B] input gains a trailing dim); non-finite -> 0
    mask: Tensor  # [B, T] bool: caller's mask (nonzero = in) minus the non-finite tokens
    extra: tuple[Tensor, ...]  # extra tensors, same treatment, [B] -> [B, 1]
    nonfinite_tokens: Tensor  # 0-dim float32: masked-in tokens dropped for non-finite inputs

    @property
    def stats(self) -> dict[str, Tensor]:
        return {"nonfinite_tokens": self.nonfinite_tokens}


def as_2d(x: Tensor, name: str, batch: int, length: int) -> Tensor:
    """[B] -> [B, 1]; accept [B, 1] and [B, T]; anything else is a caller bug."""
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    if x.dim() != 2 or x.size(0) != batch or x.size(1) not in (1, length):
        raise ValueError(f"{name} must have shape [B], [B, 1] or [B, T] = [{batch}, {length}], got {tuple(x.shape)}")
    return x


def _zero_nonfinite(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def sanitize_inputs(
    logp: Tensor,  # [B, T]
    old_logp: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    mask: Tensor,  # [B, T] bool, int or float; nonzero = completion token
    *extra: Tensor,  # [B], [B, 1] or [B, T], e.g. IS weights or rollout log-probs
) -> SanitizedInputs:
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape [B, T], got {tuple(mask.shape)}")
    batch, length = mask.shape
    for name, x in (("logp", logp), ("old_logp", old_logp)):
        if x.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(x.shape)}")
    advantages = as_2d(advantages, "advantages", batch, length)
    extra = tuple(as_2d(e, f"extra[{i}]", batch, length) for i, e in enumerate(extra))

    with torch.no_grad():
        finite = torch.isfinite(logp) & torch.isfinite(old_logp) & torch.isfinite(advantages)
        for e in extra:
            finite = finite & torch.isfinite(e)
        in_mask = mask != 0
        valid = in_mask & finite
        nonfinite = (in_mask & ~finite).sum().to(torch.float32)

    return SanitizedInputs(
        logp=_zero_nonfinite(logp),
        old_logp=_zero_nonfinite(old_logp),
        advantages=_zero_nonfinite(advantages),
        mask=valid,
        extra=tuple(_zero_nonfinite(e) for e in extra),
        nonfinite_tokens=nonfinite,
    )
