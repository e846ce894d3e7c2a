"""``static``: TRL's symmetric PPO bounds [1 - epsilon, 1 + epsilon_high] (epsilon_high defaults to epsilon)."""

from __future__ import annotations

from calclip.clipping.policy import ClipPolicy
from calclip.clipping.registry import register_clip_mode
from calclip.losses.registry import ClipMode


@register_clip_mode
class StaticClip(ClipPolicy):
    """TRL's bounds [1 - epsilon, 1 + epsilon_high] (epsilon_high defaults to epsilon).

    Every answer is the base class's."""

    name = ClipMode.STATIC
