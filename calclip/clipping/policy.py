"""The questions a trainer asks its clip mode, answered by one ``ClipPolicy`` subclass per mode.

A trainer holds one policy for the run (built from its config by ``calclip.clipping.clip_policy_from_fields``)
and asks it, instead of comparing mode names:

- ``bounds_in_force(calibrator)``: the scalar (low, high) in force (logged as ``calib/low`` / ``calib/high``);
- ``batch_bounds(in_force, ...)``: what the loss of one mini-batch clips with: ``ClipBounds(low, high,
  dual_clip_c)``, floats or per-token tensors;
- ``needs_shadow``: whether its bounds need BF16 shadow ratios at all (then the shadow runs even with FP8 off);
- ``needs_shadow_this_step(calibration_due)``: whether this moved mini-batch needs the shadow forward;
- ``uses_calibrator``: whether the calibrator's bounds are the ones in force (every_step refits, recalibration on an
  entropy spike);
- ``config_rules(fields)``: the mode's own rules on the config's plain values (``ClipFields``), run by the config;
- ``metric_names``: the metrics that exist because of this mode (docs list them).

Plain floats and tensors in; no config object, no trl/transformers.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar, NamedTuple

from torch import Tensor

from calclip.calibration import ClipCalibrator


class ClipBounds(NamedTuple):
    """What the clipped surrogate of one mini-batch clips with (``calclip.losses.clipped_surrogate``'s arguments)."""

    low: float | Tensor  # float, or [B, T] per token
    high: float | Tensor
    dual_clip_c: float | None = None  # the dual-clip constant c > 1, or None (no dual clip)


@dataclasses.dataclass(frozen=True)
class ClipFields:
    """The plain config values a clip mode's rules read (a trainer config hands these over; no config object)."""

    epsilon: float  # lower epsilon: the static lower bound is 1 - epsilon
    epsilon_high: float | None  # upper epsilon; None: the config's default (TRL's: epsilon)
    importance_sampling_level: str  # "token" or "sequence": what a ratio is taken over
    # Why no mini-batch of this config sees a policy that moved since its old log-probs (so every ratio is 1), or
    # None when some do. The config knows its trainer's schedule; a mode that calibrates only needs the answer.
    on_policy_reason: str | None = None


class ClipPolicy:
    """Base class of the clip modes: static bounds [1 - eps_low, 1 + eps_high] and no shadow of its own.

    A subclass sets ``name`` (its registry key) and overrides what differs. ``__init__`` takes the epsilons in force
    and the dual-clip constant; a mode ignores what it does not use.
    """

    name: ClassVar[str]
    # Whether the bounds in force are the calibrator's (fitted from BF16 shadow statistics).
    uses_calibrator: ClassVar[bool] = False
    # Metrics logged because of this mode, beyond every mode's (docs list them per mode).
    metric_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, eps_low: float, eps_high: float, dual_clip_c: float | None = None) -> None:
        self.eps_low = float(eps_low)
        self.eps_high = float(eps_high)
        self._dual_clip_c = dual_clip_c

    @classmethod
    def config_rules(cls, fields: ClipFields) -> ClipFields:
        """The mode's rules on the config values: returns them with any default the mode fills in; raises
        ValueError (naming the field) or warns. The base mode has none."""
        return fields

    @property
    def needs_shadow(self) -> bool:
        """Whether this mode's bounds need BF16 shadow ratios (then the shadow runs even with FP8 off, where it is
        the policy itself). Without it a trainer runs the shadow only to monitor FP8 against BF16."""
        return self.uses_calibrator

    def needs_shadow_this_step(self, calibration_due: bool) -> bool:
        """Whether a moved mini-batch needs the BF16 shadow forward: when a calibration is due (the calibrator's
        schedule, which also paces the FP8-vs-BF16 monitoring of the static modes)."""
        return calibration_due

    @property
    def static_bounds(self) -> tuple[float, float]:
        """(1 - eps_low, 1 + eps_high): BF16's bounds, the base the calibration matches."""
        return 1.0 - self.eps_low, 1.0 + self.eps_high

    def bounds_in_force(self, calibrator: ClipCalibrator) -> tuple[float, float]:
        """The scalar (low, high) in force; static modes ignore the calibrator."""
        return self.static_bounds

    def batch_bounds(
        self,
        in_force: tuple[float, float],  # bounds_in_force() of this step
        *,
        ratio_fp8: Tensor | None,  # [B, T] the loss's ratios on a moved mini-batch, else None
        ratio_bf16: Tensor | None,  # [B, T] BF16 shadow ratios of the same tokens where a shadow ran, else None
        advantages: Tensor,  # [B] or [B, T]
    ) -> ClipBounds:
        """What this mini-batch's loss clips with: the bounds in force and the mode's dual-clip constant."""
        return ClipBounds(in_force[0], in_force[1], self.dual_clip_c)

    @property
    def dual_clip_c(self) -> float | None:
        """The dual-clip constant the loss applies (None: this mode has no dual clip)."""
        return None


def warn_if_on_policy(name: str, fields: ClipFields) -> None:
    """A mode that learns from moved mini-batches warns when the config has none (its bounds never move)."""
    if fields.on_policy_reason is not None:
        warnings.warn(f"clip_mode={name!r} but every mini-batch is on-policy: {fields.on_policy_reason}", UserWarning,
                      stacklevel=4)


def require_token_ratios(name: str, fields: ClipFields) -> None:
    """Bounds set from token ratios would be misapplied to sequence (GSPO) ratios."""
    if fields.importance_sampling_level != "token":
        raise ValueError(
            f"clip_mode={name!r} needs importance_sampling_level='token': the bounds are set on token "
            f"ratios and would be applied to sequence ratios, got {fields.importance_sampling_level!r}"
        )
