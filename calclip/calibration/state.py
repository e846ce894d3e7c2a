"""Checks of a saved ``ClipCalibrator`` state, field by field, before any of it is used.

A checkpoint file is untrusted input: ``torch.load(weights_only=True)`` refuses code, but a file that loads can
still hold NaN bounds (which survive every later EMA and clamp and switch clipping off for the rest of a run), an
alpha of 5, a negative step or a string where a flag belongs. Every field is checked for its type, finiteness and
range; an error names the field. The pools are checked by ``TokenPool.load_state_dict``.
"""

from __future__ import annotations

import math

from calclip.calibration.fit import UPPER_MODES

# Settings that shape a fit: bounds fitted under other values are not the bounds these settings would give.
FIT_SETTINGS = ("eps_low", "eps_high", "upper", "low_rails", "high_rails", "min_tokens")
# Settings of the cadence only: a resumed run applies the new values to the state it has.
CADENCE_SETTINGS = ("schedule", "interval", "ema")
SETTINGS = FIT_SETTINGS + CADENCE_SETTINGS

_FLOAT_OR_NONE = {"alpha": (0.0, 1.0), "beta": (0.0, 1.0), "balance_p": (0.0, math.inf)}
_FLAGS = ("low_fitted", "high_fitted", "pending_recalibration")
_COUNTS = ("step", "num_calibrations", "num_refits")
STATE_KEYS = (
    "low", "high", *_FLAGS, *_FLOAT_OR_NONE, *_COUNTS, "last_calibration_step", "pool", "refit_pool", "settings",
)  # fmt: skip


def is_real(value) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_state(state) -> None:
    """Raise ValueError naming the first field of ``state`` that is missing, of the wrong type or out of range.

    The pools ('pool', 'refit_pool') are only checked to be dicts here; their lists are checked when loaded.
    """
    if not isinstance(state, dict):
        raise ValueError(f"the calibrator state must be a dict, got {type(state).__name__}")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"the calibrator state is missing {missing}")
    for name in ("low", "high"):
        if not is_real(state[name]) or not state[name] > 0:
            raise ValueError(f"'{name}' must be a finite ratio bound > 0, got {state[name]!r}")
    if not state["low"] <= state["high"]:
        raise ValueError(f"'low' ({state['low']!r}) must not exceed 'high' ({state['high']!r})")
    for name in _FLAGS:
        if not isinstance(state[name], bool):
            raise ValueError(f"'{name}' must be true or false, got {state[name]!r}")
    for name, (lo, hi) in _FLOAT_OR_NONE.items():
        value = state[name]
        if value is not None and not (is_real(value) and lo <= value <= hi):
            raise ValueError(f"'{name}' must be null or a finite number in [{lo}, {hi}], got {value!r}")
    for name in _COUNTS:
        if not _is_count(state[name]):
            raise ValueError(f"'{name}' must be an int >= 0, got {state[name]!r}")
    last = state["last_calibration_step"]
    if last is not None and not (_is_count(last) and last <= state["step"]):
        raise ValueError(f"'last_calibration_step' must be null or an int in [0, step={state['step']}], got {last!r}")
    for name in ("pool", "refit_pool", "settings"):
        if not isinstance(state[name], dict):
            raise ValueError(f"'{name}' must be a dict, got {type(state[name]).__name__}")


def check_settings(settings: dict) -> dict:
    """The saved settings, checked; an error names the setting. Returns them with rails as tuples."""
    missing = [key for key in SETTINGS if key not in settings]
    if missing:
        raise ValueError(f"'settings' is missing {missing}")
    for name in ("eps_low", "eps_high", "ema"):
        if not is_real(settings[name]):
            raise ValueError(f"settings['{name}'] must be a finite number, got {settings[name]!r}")
    if settings["upper"] not in UPPER_MODES:
        raise ValueError(f"settings['upper'] must be one of {UPPER_MODES}, got {settings['upper']!r}")
    if not isinstance(settings["schedule"], str):
        raise ValueError(f"settings['schedule'] must be a string, got {settings['schedule']!r}")
    for name in ("interval", "min_tokens"):
        if not _is_count(settings[name]):
            raise ValueError(f"settings['{name}'] must be an int >= 0, got {settings[name]!r}")
    checked = dict(settings)
    for name in ("low_rails", "high_rails"):
        rails = settings[name]
        if not (isinstance(rails, (list, tuple)) and len(rails) == 2 and all(is_real(x) for x in rails)):
            raise ValueError(f"settings['{name}'] must be a pair of finite numbers, got {rails!r}")
        checked[name] = (float(rails[0]), float(rails[1]))
    return checked


def changed_settings(saved: dict, current: dict) -> list[str]:
    """Names of the settings whose saved value differs from the current one, in ``SETTINGS`` order."""
    return [name for name in SETTINGS if saved[name] != current[name]]
