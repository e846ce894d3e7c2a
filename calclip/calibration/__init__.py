"""Calibrated Clipping: PPO clip bounds that give an FP8 policy the clipping behaviour of BF16.

FP8 quantization noise widens the distribution of the importance ratio r. A token with advantage A < 0 and
r < low takes the constant, clipped branch of the PPO objective, so its gradient is zero: under FP8 many more
negative-advantage tokens fall below 1 - eps than under BF16 and their penalty is silently dropped. The
calibrator measures, on BF16 shadow forwards, which share of tokens BF16 would have clipped and moves the bounds
on the FP8 ratios so that the same share is clipped (DESIGN.md, "The calibration, defined exactly").

- ``fit``: ``calibrate_bounds`` (steps 1-5 on the given tokens, a pure function) and ``fit_bounds`` (the
  ``every_step`` refit of L and H on FP8 ratios from a stored alpha / p / beta).
- ``pool``: the tokens a calibration rests on, pooled over mini-batches and ranks (step 8).
- ``calibrator``: ``ClipCalibrator``, the stateful object a trainer holds (schedules, minimum evidence, EMA,
  rails, ranks, checkpointing); ``state``: the checks of a saved state.
- ``drops``: which A<0 penalties a bound drops against the ones BF16 drops (out-of-sample scoring, step 10; the
  bounds that drop exactly those are the oracle clip mode's, ``calclip.clipping.oracle``).
- ``distributed``: ``torch_distributed_all_gather``, the ``all_gather`` callable for ``ClipCalibrator``.

Imports torch only.
"""

from calclip.calibration.calibrator import DEFAULT_MIN_TOKENS, SCHEDULES, ClipCalibrator
from calclip.calibration.distributed import AllGather, torch_distributed_all_gather
from calclip.calibration.drops import drop_counts, drop_shares
from calclip.calibration.fit import UPPER_MODES, CalibrationResult, calibrate_bounds, fit_bounds

__all__ = [
    "AllGather", "CalibrationResult", "ClipCalibrator", "DEFAULT_MIN_TOKENS", "SCHEDULES", "UPPER_MODES",
    "calibrate_bounds", "drop_counts", "drop_shares", "fit_bounds", "torch_distributed_all_gather",
]  # fmt: skip
