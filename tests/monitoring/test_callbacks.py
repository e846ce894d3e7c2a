"""Entropy-spike detector, garbled-output signal and the W&B alert helper (pure Python, no trainer)."""

import math
import sys
import types

import pytest

from calclip.monitoring.callbacks import (
    EntropySpikeDetector,
    repeated_ngram_counts,
    repeated_ngram_fraction,
    send_wandb_alert,
)

# A noisy but stationary entropy history: over two cycles (8 values) mean 3.0 and sample std (n - 1) 0.05 exactly.
CYCLE = [3.0 + 0.05 * x * math.sqrt(7 / 8) for x in (1, -1, 1, -1)]


def test_no_spike_during_warmup_even_for_a_jump():
    detector = EntropySpikeDetector(window=10, warmup=4, z_threshold=3.0)
    for value in [3.0, 3.0, 9.0]:  # only 2 values of history before the jump: still warming up
        assert not detector.update(value).spike


def test_spike_fires_on_the_z_score_worked_by_hand():
    detector = EntropySpikeDetector(window=8, warmup=4, z_threshold=4.0)
    for value in CYCLE * 2:
        report = detector.update(value)
        assert not report.spike
    # history mean 3.0, sample std (n-1) 0.05: 3.19 is z = 3.8 (no spike), 3.21 is z = 4.2 (spike)
    z = detector._all.z_score(3.19)
    assert z == pytest.approx(3.8, rel=1e-9)
    assert not detector.update(3.19).spike
    detector = EntropySpikeDetector(window=8, warmup=4, z_threshold=4.0)
    for value in CYCLE * 2:
        detector.update(value)
    report = detector.update(3.21)
    assert report.spike and report.signal == "entropy" and report.z == pytest.approx(4.2, rel=1e-9)
    assert detector.num_spikes == 1


def test_only_upward_jumps_count():
    detector = EntropySpikeDetector(window=8, warmup=4, z_threshold=3.0)
    for value in CYCLE * 2:
        detector.update(value)
    assert not detector.update(1.0).spike  # entropy collapsing is ordinary RL training


def test_negative_advantage_entropy_alone_can_fire():
    detector = EntropySpikeDetector(window=8, warmup=4, z_threshold=4.0)
    for value in CYCLE * 2:
        detector.update(3.0, value)
    report = detector.update(3.0, 3.5)
    assert report.spike and report.signal == "entropy/neg_adv" and report.z == 0.0


def test_nonfinite_entropy_is_a_spike_and_stays_out_of_the_history():
    detector = EntropySpikeDetector(window=8, warmup=2, z_threshold=4.0)
    detector.update(3.0)
    report = detector.update(float("nan"))
    assert report.spike and report.signal == "nonfinite"
    assert list(detector._all.values) == [3.0]


def test_flat_history_uses_a_floor_instead_of_dividing_by_zero():
    detector = EntropySpikeDetector(window=8, warmup=4, z_threshold=4.0)
    for _ in range(6):
        detector.update(2.0)
    # std floor = 1e-3 * 2.0: a 1e-4 wiggle is z = 0.05, not a spike
    assert not detector.update(2.0001).spike
    assert detector.update(2.5).spike


def test_state_dict_round_trip_resumes_identically():
    first = EntropySpikeDetector(window=6, warmup=3, z_threshold=3.0)
    for i, value in enumerate(CYCLE * 3):
        first.update(value, value + 0.1, step=i)
    first.update(4.0, step=99)
    resumed = EntropySpikeDetector(window=6, warmup=3, z_threshold=3.0)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == first.state_dict()
    assert resumed.last_spike_step == 99 and resumed.num_spikes == first.num_spikes == 1
    for value in (3.02, 3.5, 2.9):
        assert resumed.update(value, value) == first.update(value, value)


def test_invalid_detector_arguments():
    with pytest.raises(ValueError, match="window"):
        EntropySpikeDetector(window=1)
    with pytest.raises(ValueError, match="warmup"):
        EntropySpikeDetector(warmup=1)
    with pytest.raises(ValueError, match="z_threshold"):
        EntropySpikeDetector(z_threshold=0)
    with pytest.raises(ValueError, match=r"window must be an int in \[2, 100000\]"):
        EntropySpikeDetector(window=10**30)  # used to reach deque(maxlen=...): OverflowError
    with pytest.raises(ValueError, match=r"warmup must be an int in \[2, window=8\]"):
        EntropySpikeDetector(window=8, warmup=9)  # a history of 8 never reaches a warmup of 9: it would never fire


def test_repeated_ngrams_worked_by_hand():
    # [1,2,1,2,1,2] has bigrams 12 21 12 21 12: 3 repeats of 5; [7,8,9] has 2 distinct bigrams; [5] has none
    assert repeated_ngram_counts([[1, 2, 1, 2, 1, 2], [7, 8, 9], [5]], 2) == (3, 7)
    assert repeated_ngram_fraction([[1, 2, 1, 2, 1, 2], [7, 8, 9], [5]], 2) == pytest.approx(3 / 7)
    # repeats are counted within a sequence, never across sequences
    assert repeated_ngram_counts([[1, 2, 3], [1, 2, 3]], 3) == (0, 2)
    assert repeated_ngram_fraction([[4, 4, 4, 4, 4]], 1) == pytest.approx(4 / 5)
    assert repeated_ngram_fraction([], 4) == 0.0
    with pytest.raises(ValueError):
        repeated_ngram_counts([[1]], 0)


def test_wandb_alert_only_with_an_active_run(monkeypatch):
    sent = []
    fake = types.SimpleNamespace(
        run=None,
        AlertLevel=types.SimpleNamespace(WARN="WARN"),
        alert=lambda **kwargs: sent.append(kwargs),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert send_wandb_alert("title", "text") is False and sent == []
    fake.run = object()
    assert send_wandb_alert("title", "text") is True
    assert sent == [{"title": "title", "text": "text", "level": "WARN"}]

    def failing_alert(**kwargs):
        raise RuntimeError("offline")

    fake.alert = failing_alert
    assert send_wandb_alert("title", "text") is False  # never raises into the training loop


@pytest.mark.parametrize("change, match", [
    (dict(entropy=[1.0, math.nan]), r"spike_detector.entropy\[1\] must be a finite number .*got nan"),
    (dict(entropy_neg_adv=[math.inf]), r"spike_detector.entropy_neg_adv\[0\] must be a finite number"),
    (dict(entropy=["1.0"]), r"spike_detector.entropy\[0\] must be a finite number .*got str"),
    (dict(entropy="1.0"), r"spike_detector.entropy must be a list of numbers, got str"),
    (dict(num_steps=-1), r"spike_detector.num_steps must be an int >= 0, got -1"),
    (dict(num_steps=True), r"spike_detector.num_steps must be an int >= 0, got True"),
    (dict(num_spikes=99), r"spike_detector.num_spikes \(99\) exceeds spike_detector.num_steps"),
    (dict(num_steps=1), r"spike_detector.entropy holds \d+ values, more than the spike_detector.num_steps \(1\)"),
    (dict(last_spike_step="3"), r"spike_detector.last_spike_step must be null or an int >= 0, got '3'"),
    (dict(entropy=[1.0] * 100_001, num_steps=100_001), r"spike_detector.entropy holds 100001 values, more than any"),
])
def test_a_bad_saved_state_is_refused_naming_the_field_and_changes_nothing(change, match):
    """A NaN in the history would make every later z-score NaN (the detector silently never fires again); each
    field is checked before any is restored."""
    saved = EntropySpikeDetector(window=6, warmup=3, z_threshold=3.0)
    for value in CYCLE * 2:
        saved.update(value, value + 0.1)
    detector = EntropySpikeDetector(window=6, warmup=3, z_threshold=3.0)
    detector.update(5.0)
    before = detector.state_dict()
    with pytest.raises(ValueError, match=match):
        detector.load_state_dict({**saved.state_dict(), **change})
    assert detector.state_dict() == before
    state = saved.state_dict()
    del state["num_spikes"]
    with pytest.raises(ValueError, match="spike_detector.num_spikes is missing"):
        detector.load_state_dict(state)
