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
# A pool of this many times min_tokens commits even if a side is still short (that side keeps its bound, step 5), so
# a run whose advantages never take one sign cannot grow the pool without end. (Here, not in the calibrator, which
# imports it, so that check_state_against_run can bound a saved pool with it.)
POOL_LIMIT_FACTOR = 8

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


def check_state_against_run(state: dict, *, global_step: int, step_slack: int, max_commits: int,
                            max_pool_tokens_per_round: int) -> None:
    """Raise ValueError naming the first field of a checked ``state`` that the run resuming it could not have
    produced by ``global_step`` (the trainer's step of the checkpoint).

    A state checked only against itself can hold step counters far ahead of the run: ``needs_calibration`` then
    waits for a window the trainer reaches only at that step, so the bounds stay frozen with no warning.

    - ``last_calibration_step``: a fit is credited to the trainer step it ran at, so it is at most ``global_step``.
    - ``step``: the last step the schedule was asked about; a generation round asks about the optimizer steps it
      feeds, at most ``step_slack`` ahead of ``global_step``.
    - ``num_calibrations``, ``num_refits``: at most one commit per generation round, at most ``max_commits``.
    - the shadow pool: a commit below ``POOL_LIMIT_FACTOR * min_tokens`` pooled tokens keeps them, one at or above
      fits and empties the pool, so a pool saved between commits holds less than that plus the tokens of one round
      (``max_pool_tokens_per_round``: completions of a round times ``max_completion_length``, over all ranks).
    """
    last = state["last_calibration_step"]
    if last is not None and last > global_step:
        raise ValueError(f"'last_calibration_step' ({last}) is later than the checkpoint's global_step "
                         f"({global_step}): calibration would wait for that step with the bounds frozen")
    if state["step"] > global_step + step_slack:
        raise ValueError(f"'step' ({state['step']}) is beyond the checkpoint's global_step ({global_step}) plus the "
                         f"{step_slack} step(s) a generation round looks ahead")
    for name in ("num_calibrations", "num_refits"):
        if state[name] > max_commits:
            raise ValueError(f"'{name}' ({state[name]}) exceeds the {max_commits} generation round(s) of "
                             f"{global_step} optimizer step(s): the state is not this run's")
    min_tokens = state["settings"].get("min_tokens")
    advantages = state["pool"].get("advantages")
    if _is_count(min_tokens) and isinstance(advantages, list):
        limit = POOL_LIMIT_FACTOR * min_tokens - 1 + max_pool_tokens_per_round
        if len(advantages) > limit:
            raise ValueError(f"'pool' holds {len(advantages)} tokens, more than the {limit} a run can pool between "
                             f"commits ({POOL_LIMIT_FACTOR} x min_tokens {min_tokens}, less one, plus "
                             f"{max_pool_tokens_per_round} tokens of a generation round)")
