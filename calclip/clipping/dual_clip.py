"""``dual_clip``: static bounds plus the dual clip (Ye et al. 2020): the loss of an A<0 token is at most -c*A."""

from __future__ import annotations

from calclip.clipping.policy import ClipPolicy
from calclip.clipping.registry import register_clip_mode
from calclip.losses.registry import ClipMode


@register_clip_mode
class DualClip(ClipPolicy):
    """The static bounds, and the loss of an A<0 token capped at -dual_clip_c * A (Ye et al. 2020).

    The cap takes over where a negative-advantage token's ratio exploded; ``dual_clip_c`` > 1 is checked by the
    config for every mode (it is a field like any other)."""

    name = ClipMode.DUAL_CLIP
    metric_names = ("clip/dual_frac",)  # share of A<0 tokens on the dual branch (0 in the other modes)

    def __init__(self, *, eps_low: float, eps_high: float, dual_clip_c: float | None = None) -> None:
        if dual_clip_c is None:
            raise ValueError("clip_mode='dual_clip' needs dual_clip_c (a number > 1)")
        super().__init__(eps_low=eps_low, eps_high=eps_high, dual_clip_c=float(dual_clip_c))

    @property
    def dual_clip_c(self) -> float:
        return self._dual_clip_c
