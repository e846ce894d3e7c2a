"""The names of the built-in clip modes.

``@unique`` makes a duplicate value an import-time error (a plain Enum would silently alias it). Each name is
registered with its ``ClipPolicy`` by ``calclip.clipping`` (the registry a config's ``clip_mode`` is looked up in,
which may hold further modes); the Enum stays here, in the bottom layer, so that ``calclip.losses`` imports nothing
of calclip's above it.
"""

from __future__ import annotations

from enum import Enum, unique


@unique
class ClipMode(str, Enum):
    STATIC = "static"  # symmetric PPO bounds [1 - eps, 1 + eps]
    CLIP_HIGHER = "clip_higher"  # DAPO's decoupled bounds [1 - eps_low, 1 + eps_high], eps_high > eps_low
    DUAL_CLIP = "dual_clip"  # static bounds plus the dual clip c * A for A < 0
    CALIBRATED = "calibrated"  # Calibrated Clipping: [low, high] fitted from FP8 vs BF16 ratios
    # Reference arm, not a method: per token, clip exactly where the BF16 shadow ratio leaves [1-eps, 1+eps_high]
    # (a shadow forward on every moved mini-batch); the best any calibration of the FP8 ratios can do.
    ORACLE = "oracle"


def clip_mode_names() -> tuple[str, ...]:
    return tuple(mode.value for mode in ClipMode)


def get_clip_mode(name: str | ClipMode) -> ClipMode:
    """ClipMode for a config string; an unknown name raises ValueError listing the valid ones."""
    if isinstance(name, ClipMode):
        return name
    try:
        return ClipMode(name)
    except ValueError:
        raise ValueError(f"unknown clip mode {name!r}; valid clip modes: {', '.join(clip_mode_names())}") from None
