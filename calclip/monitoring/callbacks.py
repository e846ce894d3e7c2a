"""Monitoring for FP8 RL runs: entropy spikes, garbled outputs, W&B alerts.

The failure Calibrated Clipping fixes shows up as entropy spiking mid-training (negative-advantage tokens no longer
pushed down) and as garbled, repetitive completions. This module holds the pieces the trainer calls once per
optimizer step / generation; they are plain Python + torch so they can be tested and reused without TRL.

- ``EntropySpikeDetector``: rolling mean/std of the step entropy (all tokens and A<0 tokens); a spike is a z-score
  above the threshold once the warm-up has passed. Its state goes into every checkpoint.
- ``repeated_ngram_counts`` / ``repeated_ngram_fraction``: the cheap garbled-output signal, the share of n-grams
  of a completion that already occurred earlier in the same completion.
- ``send_wandb_alert``: ``wandb.alert`` when a W&B run is active (no-op otherwise, never raises).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# A flat entropy history has std ~ 0; without a floor the first rounding-level wiggle would be a "spike".
# The floor is relative to the entropy's scale (nats), so it means the same for a 2-nat and a 9-nat model.
RELATIVE_STD_FLOOR = 1e-3


@dataclass(frozen=True)
class SpikeReport:
    spike: bool
    z: float  # z-score of the all-token entropy (0.0 during warm-up)
    z_neg_adv: float  # z-score of the A<0-token entropy (0.0 during warm-up or without data)
    signal: str | None  # "entropy", "entropy/neg_adv", "nonfinite" or None

    def message(self, step: int, entropy: float, entropy_neg_adv: float | None) -> str:
        neg = "n/a" if entropy_neg_adv is None else f"{entropy_neg_adv:.4f}"
        return (
            f"entropy spike at step {step} ({self.signal}): entropy {entropy:.4f} (z={self.z:.1f}), "
            f"A<0 entropy {neg} (z={self.z_neg_adv:.1f})"
        )


# Longest rolling window, in optimizer steps. Each step's z-score walks the whole window in Python, so 100,000
# steps cost ~10 ms a step, far beyond any use (windows of tens to hundreds of steps; few RL runs have 100,000
# optimizer steps at all); 1e30 used to reach the deque's maxlen and fail with OverflowError after the model loaded.
SPIKE_WINDOW_MAX = 100_000


class _RollingStats:
    """Mean and std of the last ``window`` values."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def z_score(self, value: float) -> float:
        n = len(self.values)
        mean = sum(self.values) / n
        var = sum((v - mean) ** 2 for v in self.values) / max(n - 1, 1)
        std = max(math.sqrt(var), RELATIVE_STD_FLOOR * max(abs(mean), 1.0))
        return (value - mean) / std


class EntropySpikeDetector:
    """Flags optimizer steps whose entropy jumps above its recent history.

    ``update(entropy, entropy_neg_adv)`` is called once per optimizer step with the global (all-rank) means. The
    z-score of each signal is taken against the previous ``window`` steps (not including the current one);
    ``spike`` is True when either z-score exceeds ``z_threshold`` after at least ``warmup`` observed steps, or when
    the entropy is not finite (a NaN entropy is the loudest symptom of all). Only upward jumps count: collapsing
    entropy is the ordinary course of RL training. Non-finite values are not added to the history.
    """

    def __init__(self, *, window: int = 20, warmup: int = 5, z_threshold: float = 4.0) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= SPIKE_WINDOW_MAX:
            raise ValueError(f"window must be an int in [2, {SPIKE_WINDOW_MAX}], got {window!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 2 <= warmup <= window:
            raise ValueError(f"warmup must be an int in [2, window={window}] (the history holds at most window "
                             f"steps, so a longer warmup never fires), got {warmup!r}")
        if not z_threshold > 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        self.window, self.warmup, self.z_threshold = window, warmup, float(z_threshold)
        self._all = _RollingStats(window)
        self._neg = _RollingStats(window)
        self.num_steps = 0
        self.num_spikes = 0
        self.last_spike_step: int | None = None

    def update(self, entropy: float, entropy_neg_adv: float | None = None, *, step: int | None = None) -> SpikeReport:
        self.num_steps += 1
        if not math.isfinite(entropy) or (entropy_neg_adv is not None and not math.isfinite(entropy_neg_adv)):
            return self._record(SpikeReport(True, math.inf, math.inf, "nonfinite"), step)
        z = self._score(self._all, entropy)
        z_neg = 0.0 if entropy_neg_adv is None else self._score(self._neg, entropy_neg_adv)
        signal = None
        if z > self.z_threshold:
            signal = "entropy"
        elif z_neg > self.z_threshold:
            signal = "entropy/neg_adv"
        return self._record(SpikeReport(signal is not None, z, z_neg, signal), step)

    def _score(self, stats: _RollingStats, value: float) -> float:
        z = stats.z_score(value) if len(stats.values) >= self.warmup else 0.0
        stats.values.append(value)
        return z

    def _record(self, report: SpikeReport, step: int | None) -> SpikeReport:
        if report.spike:
            self.num_spikes += 1
            self.last_spike_step = step
        return report

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "z_threshold": self.z_threshold,
            # Plain floats (a numpy or tensor value passed to update() would not load with weights_only=True).
            "entropy": [float(v) for v in self._all.values],
            "entropy_neg_adv": [float(v) for v in self._neg.values],
            "num_steps": self.num_steps,
            "num_spikes": self.num_spikes,
            "last_spike_step": None if self.last_spike_step is None else int(self.last_spike_step),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the history; window/warmup/threshold stay this object's own (a resumed run may change them).

        Every field is checked before anything changes, and a bad one raises ValueError naming it
        (``spike_detector.<field>``; the trainer adds the file): a NaN in the history would make every later
        z-score NaN, so the detector would never fire again, silently."""
        if not isinstance(state, dict):
            raise ValueError(f"spike_detector must be a dict, got {type(state).__name__}")
        history = {key: _history(state, key) for key in ("entropy", "entropy_neg_adv")}
        num_steps = _count(state, "num_steps")
        num_spikes = _count(state, "num_spikes")
        if num_spikes > num_steps:
            raise ValueError(f"spike_detector.num_spikes ({num_spikes}) exceeds spike_detector.num_steps ({num_steps})")
        for key, values in history.items():
            if len(values) > num_steps:
                raise ValueError(f"spike_detector.{key} holds {len(values)} values, more than the "
                                 f"spike_detector.num_steps ({num_steps}) they came from")
        last = state.get("last_spike_step", _MISSING)
        if last is _MISSING:
            raise ValueError("spike_detector.last_spike_step is missing")
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise ValueError(f"spike_detector.last_spike_step must be null or an int >= 0, got {last!r}")
        self._all.values.clear()
        self._all.values.extend(history["entropy"])
        self._neg.values.clear()
        self._neg.values.extend(history["entropy_neg_adv"])
        self.num_steps, self.num_spikes, self.last_spike_step = num_steps, num_spikes, last


_MISSING = object()


def _history(state: dict, key: str) -> list[float]:
    values = state.get(key, _MISSING)
    if values is _MISSING:
        raise ValueError(f"spike_detector.{key} is missing")
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"spike_detector.{key} must be a list of numbers, got {type(values).__name__}")
    if len(values) > SPIKE_WINDOW_MAX:
        raise ValueError(f"spike_detector.{key} holds {len(values)} values, more than any window "
                         f"({SPIKE_WINDOW_MAX})")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            shown = repr(value) if isinstance(value, (int, float)) else type(value).__name__
            raise ValueError(f"spike_detector.{key}[{index}] must be a finite number (the history holds only "
                             f"finite entropies), got {shown}")
    return [float(value) for value in values]


def _count(state: dict, key: str) -> int:
    value = state.get(key, _MISSING)
    if value is _MISSING:
        raise ValueError(f"spike_detector.{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"spike_detector.{key} must be an int >= 0, got {value!r}")
    return value


def repeated_ngram_counts(sequences: Iterable[Sequence[int]], n: int) -> tuple[int, int]:
    """(repeated, total) n-grams over ``sequences``: an n-gram is repeated when it already occurred earlier in the
    same sequence. Sequences shorter than n contribute nothing."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    repeated = total = 0
    for seq in sequences:
        seq = list(seq)
        ngrams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
        total += len(ngrams)
        repeated += len(ngrams) - len(set(ngrams))
    return repeated, total


def repeated_ngram_fraction(sequences: Iterable[Sequence[int]], n: int = 4) -> float:
    """Share of repeated n-grams (see ``repeated_ngram_counts``); 0.0 when there is no n-gram at all."""
    repeated, total = repeated_ngram_counts(sequences, n)
    return repeated / total if total else 0.0


def send_wandb_alert(title: str, text: str) -> bool:
    """``wandb.alert(title, text, level=WARN)`` when a W&B run is active; returns whether an alert was sent."""
    try:
        import wandb
    except ImportError:
        return False
    if getattr(wandb, "run", None) is None:
        return False
    try:
        wandb.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
    except Exception as err:  # an alert must never stop training (offline mode, rate limits, ...)
        logger.warning("wandb.alert failed: %s", err)
        return False
    return True
