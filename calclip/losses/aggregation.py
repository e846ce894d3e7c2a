"""Reduce a per-token loss to a scalar with TRL 1.16's normalizations.

The four modes reproduce ``GRPOTrainer._compute_loss`` in trl 1.16 (trl/trainer/grpo_trainer.py, the
``if self.loss_type in ["grpo", "sapo"]: ... elif "dapo"`` block) BEFORE gradient-accumulation scaling, which
stays the trainer's job:

    grpo     mean over sequences of  sum_t(loss * mask) / clamp(sum_t mask, 1)
    bnpo     sum(loss * mask) / clamp(sum(mask), 1)
    dr_grpo  sum(loss * mask) / (B * max_completion_length)
    dapo     sum(loss * mask) / clamp(num_items, 1)

For dapo, TRL divides by ``num_items_in_batch.clamp(min=1) / num_processes`` (the token count of the whole
generation batch over all ranks, computed once per generation) times ``gradient_accumulation_steps /
steps_per_generation``. The trainer passes ``num_items = num_items_in_batch / num_processes`` here and applies
the accumulation factor itself; the two agree whenever the global batch has at least one token per rank.

Masked positions are dropped with ``torch.where`` rather than multiplied by 0, so a non-finite value there
cannot become a NaN loss or gradient; an all-masked batch, or one of no rows, gives 0 with a zero gradient in every
mode.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


def check_aggregation(mode: str, max_completion_length: int | None, num_items) -> None:
    """Validate the mode and the argument it needs; called early so errors come before any compute."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    if mode == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError(f"aggregation 'dr_grpo' needs max_completion_length > 0, got {max_completion_length!r}")
    if mode == "dapo" and num_items is None:
        raise ValueError("aggregation 'dapo' needs num_items (the global-batch token count per process)")


def aggregate(
    per_token_loss: Tensor,  # [B, T] or [B, 1] (sequence-level losses broadcast over the tokens)
    mask: Tensor,  # [B, T] nonzero = token counts
    mode: str,
    *,
    max_completion_length: int | None = None,  # dr_grpo only: the configured maximum, not T
    num_items: Tensor | float | None = None,  # dapo only: see module docstring
) -> Tensor:  # 0-dim
    check_aggregation(mode, max_completion_length, num_items)
    keep = mask != 0
    zero = torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    masked = torch.where(keep, per_token_loss, zero)  # [B, T]
    if mode == "grpo":
        per_sequence = masked.sum(-1) / keep.sum(-1).clamp(min=1).to(masked.dtype)
        if per_sequence.numel() == 0:  # no rows: the mean of nothing is NaN; 0, still attached to the graph
            return masked.sum()
        return per_sequence.mean()
    if mode == "bnpo":
        return masked.sum() / keep.sum().clamp(min=1).to(masked.dtype)
    if mode == "dr_grpo":
        return masked.sum() / (max(mask.size(0), 1) * max_completion_length)
    # dapo
    if isinstance(num_items, Tensor):
        normalizer = num_items.detach().to(device=masked.device, dtype=masked.dtype).clamp(min=1.0)
    else:
        normalizer = max(float(num_items), 1.0)
    return masked.sum() / normalizer
