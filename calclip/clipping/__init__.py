"""Clip modes as objects: one ``ClipPolicy`` per mode, each in its own module, and the registry of their names.

- ``policy``: ``ClipPolicy`` (the questions a trainer asks its mode), ``ClipBounds``, ``ClipFields``;
- ``registry``: ``register_clip_mode``, ``clip_mode_class``, ``registered_clip_modes``, ``clip_policy_from_fields``;
- one module per mode: ``static``, ``clip_higher``, ``dual_clip``, ``calibrated``, ``oracle``.

Adding a mode: a module with a ``ClipPolicy`` subclass decorated ``@register_clip_mode``, imported below.
Imports torch, calclip.losses and calclip.calibration; never trl/transformers.
"""

from calclip.clipping.policy import ClipBounds, ClipFields, ClipPolicy
from calclip.clipping.registry import (
    clip_mode_class,
    clip_policy_from_fields,
    register_clip_mode,
    registered_clip_modes,
    unregister_clip_mode,
)

# The built-in modes, registered on import in the order docs list them.
from calclip.clipping.static import StaticClip  # noqa: I001 (registration order)
from calclip.clipping.clip_higher import ClipHigher
from calclip.clipping.dual_clip import DualClip
from calclip.clipping.calibrated import CalibratedClip
from calclip.clipping.oracle import OracleClip, oracle_bounds

__all__ = [
    "CalibratedClip", "ClipBounds", "ClipFields", "ClipHigher", "ClipPolicy", "DualClip", "OracleClip", "StaticClip",
    "clip_mode_class", "clip_policy_from_fields", "oracle_bounds", "register_clip_mode", "registered_clip_modes",
    "unregister_clip_mode",
]  # fmt: skip
