"""``calibrated``: Calibrated Clipping, the bounds fitted from BF16 shadow ratio quantiles (DESIGN.md).

The bounds in force are the calibrator's (``calclip.calibration.ClipCalibrator``): its initial bounds until the
first calibration, then each fit from the next generation round on.
"""

from __future__ import annotations

from calclip.calibration import ClipCalibrator
from calclip.clipping.policy import ClipFields, ClipPolicy, require_token_ratios, warn_if_on_policy
from calclip.clipping.registry import register_clip_mode
from calclip.losses.registry import ClipMode


@register_clip_mode
class CalibratedClip(ClipPolicy):
    """The calibrator's bounds (Calibrated Clipping); epsilon / epsilon_high are the BF16 base bounds the
    calibration matches."""

    name = ClipMode.CALIBRATED
    uses_calibrator = True
    # The calibrator's statistics at a round end (calclip.calibration.ClipCalibrator.commit); calib/low and
    # calib/high, the bounds in force, are logged in every mode.
    # calib/balance_p with calibration_upper 'balance' (the default).
    metric_names = ("calib/alpha", "calib/balance_p", "calib/neg_tokens", "calib/pos_tokens", "calib/fit",
                    "calib/bf16_low_clipped_tokens")

    @classmethod
    def config_rules(cls, fields: ClipFields) -> ClipFields:
        require_token_ratios(cls.name, fields)
        warn_if_on_policy(cls.name, fields)
        return fields

    def bounds_in_force(self, calibrator: ClipCalibrator) -> tuple[float, float]:
        return calibrator.bounds
