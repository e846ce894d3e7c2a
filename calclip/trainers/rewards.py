"""Rewards that are not finite are treated like TRL's ``None`` rewards (unscorable), not averaged into a group.

TRL 1.16 turns a ``None`` reward into NaN and computes the group baselines with ``nanmean``/``nanstd``, so an
unscorable completion leaves its group's statistics alone and gets advantage 0. A +inf or -inf reward instead makes
the group's mean and std infinite: every advantage of the group becomes NaN and then 0, and the group's learning
signal is gone. ``exclude_nonfinite_rewards`` marks a completion with an infinite reward from any reward function
unscorable (its whole row NaN, as when every function returned ``None``: one broken score should not leave the
completion ranked on the remaining functions alone), so TRL's own NaN handling excludes exactly that completion.
"""

from __future__ import annotations

import torch
from torch import Tensor


def exclude_nonfinite_rewards(rewards_per_func: Tensor) -> tuple[Tensor, Tensor]:
    """(rewards with every row holding an infinite value set to NaN, per-function counts of infinite values).

    rewards_per_func: [N, F], one row per completion, one column per reward function; NaN (TRL's ``None``) is left
    as it is and not counted.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be [completions, reward functions], got {tuple(rewards_per_func.shape)}")
    infinite = torch.isinf(rewards_per_func)  # [N, F]
    rows = infinite.any(dim=1, keepdim=True)
    return torch.where(rows, torch.nan, rewards_per_func), infinite.sum(dim=0)
