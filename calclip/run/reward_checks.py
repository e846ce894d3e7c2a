"""What reward functions return: checked, and infinite rewards treated like TRL's ``None`` (unscorable).

``checked_reward_function`` wraps a reward function so that what it returns is checked before TRL turns it into a
float32 tensor: one value per completion, each None (unscorable) or a number within float32's range. TRL's own
conversion fails naming no function ("too many dimensions 'str'", "int too large to convert to float"), and a
finite value beyond float32's range (1e39) silently becomes inf, which the rule below then excludes: a whole
batch of unscorable completions and a loss of 0 with no message. Here the error names the function, the
completion and the value.

Rewards that are not finite are treated like TRL's ``None`` rewards (unscorable), not averaged into a group.

TRL 1.16 turns a ``None`` reward into NaN and computes the group baselines with ``nanmean``/``nanstd``, so an
unscorable completion leaves its group's statistics alone and gets advantage 0. A +inf or -inf reward instead makes
the group's mean and std infinite: every advantage of the group becomes NaN and then 0, and the group's learning
signal is gone. ``exclude_nonfinite_rewards`` marks a completion with an infinite reward from any reward function
unscorable (its whole row NaN, as when every function returned ``None``: one broken score should not leave the
completion ranked on the remaining functions alone), so TRL's own NaN handling excludes exactly that completion.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

FLOAT32_MAX = torch.finfo(torch.float32).max  # rewards_per_func is float32 in TRL 1.16


class RewardFunctionError(ValueError):
    """A reward function returned something TRL cannot score (the message names the function)."""


def check_reward_values(values, name: str, expected: int | None):
    """``values`` unchanged when it holds ``expected`` rewards, each None or a number within float32's range;
    RewardFunctionError naming ``name``, the completion and the value otherwise."""
    from calclip.run.config_file import bounded_repr

    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise RewardFunctionError(f"reward function '{name}' returned {bounded_repr(values)} "
                                  f"({type(values).__name__}); it must return a list of rewards, one per completion")
    if expected is not None and len(values) != expected:
        raise RewardFunctionError(f"reward function '{name}' returned {len(values)} rewards for {expected} "
                                  "completions; it must return one per completion (None where it cannot score one)")
    for index, value in enumerate(values):
        if value is None:
            continue
        problem = None
        if isinstance(value, (str, bytes)):
            problem = "a string, not a number"
        else:
            try:
                number = float(value)  # bool, int, float, numpy and 0-d tensor values
            except OverflowError:
                problem = "beyond the float range"
            except (TypeError, ValueError, RuntimeError):
                problem = "not a number"
            else:
                if math.isfinite(number) and abs(number) > FLOAT32_MAX:
                    problem = f"beyond float32's range (+-{FLOAT32_MAX:.4g}): it would become inf"
        if problem is not None:
            raise RewardFunctionError(
                f"reward function '{name}' returned {bounded_repr(value)} ({type(value).__name__}) for completion "
                f"{index} of {len(values)}: {problem}. A reward is a number, or None where the function cannot "
                "score the completion")
    return values


def checked_reward_function(func, name: str, *, is_async: bool):
    """``func`` whose results pass ``check_reward_values`` (named ``name``); async stays async. functools.wraps keeps
    its name and, through ``__wrapped__``, the signature that says which dataset columns it needs."""
    if is_async:
        @functools.wraps(func)
        async def checked(*args, **kwargs):
            return check_reward_values(await func(*args, **kwargs), name, _completions(kwargs))
    else:
        @functools.wraps(func)
        def checked(*args, **kwargs):
            return check_reward_values(func(*args, **kwargs), name, _completions(kwargs))
    checked.calclip_checked = True
    return checked


def _completions(kwargs: dict) -> int | None:
    completions = kwargs.get("completions", kwargs.get("prompts"))
    return None if completions is None else len(completions)


def exclude_nonfinite_rewards(rewards_per_func: Tensor) -> tuple[Tensor, Tensor]:
    """(rewards with every row holding an infinite value set to NaN, per-function counts of infinite values).

    rewards_per_func: [N, F], one row per completion, one column per reward function; NaN (TRL's ``None``) is left
    as it is and not counted.
    """
    if rewards_per_func.dim() != 2:
        raise ValueError("rewards_per_func must be [completions, reward functions], "
                         f"got {tuple(rewards_per_func.shape)}")
    infinite = torch.isinf(rewards_per_func)  # [N, F]
    rows = infinite.any(dim=1, keepdim=True)
    return torch.where(rows, torch.nan, rewards_per_func), infinite.sum(dim=0)
