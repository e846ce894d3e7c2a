"""``clip_higher``: DAPO's decoupled bounds [1 - epsilon, 1 + epsilon_high] with epsilon_high > epsilon."""

from __future__ import annotations

import dataclasses

from calclip.clipping.policy import ClipFields, ClipPolicy
from calclip.clipping.registry import register_clip_mode
from calclip.losses.registry import ClipMode

# DAPO paper (arXiv 2503.14476): clip-higher with eps_low 0.2, eps_high 0.28.
DEFAULT_EPSILON_HIGH = 0.28


@register_clip_mode
class ClipHigher(ClipPolicy):
    """DAPO's decoupled bounds [1 - epsilon, 1 + epsilon_high]: epsilon_high defaults to 0.28 and must exceed
    epsilon."""

    name = ClipMode.CLIP_HIGHER

    @classmethod
    def config_rules(cls, fields: ClipFields) -> ClipFields:
        if fields.epsilon_high is None:
            fields = dataclasses.replace(fields, epsilon_high=DEFAULT_EPSILON_HIGH)
        if fields.epsilon_high <= fields.epsilon:
            raise ValueError(f"epsilon_high ({fields.epsilon_high}) must be > epsilon ({fields.epsilon}) with "
                             f"clip_mode='clip_higher'")
        return fields
