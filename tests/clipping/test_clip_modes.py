"""calclip.clipping: each built-in mode's answers to the trainer's questions, its config rules, its metric names, the
registry's keys and errors, and the docs' table of modes checked against the registry."""

import warnings
from pathlib import Path

import pytest
import torch

from calclip.calibration import ClipCalibrator
from calclip.clipping import (
    CalibratedClip,
    ClipBounds,
    ClipFields,
    ClipHigher,
    ClipPolicy,
    DualClip,
    OracleClip,
    StaticClip,
    clip_mode_class,
    clip_policy_from_fields,
    register_clip_mode,
    registered_clip_modes,
)
from calclip.losses import ClipMode, clipped_surrogate

ROOT = Path(__file__).resolve().parents[2]


def _calibrator(**kwargs):
    return ClipCalibrator(eps_low=0.2, eps_high=0.28, init_low=0.6, init_high=1.8, min_tokens=1, **kwargs)


def test_the_registry_holds_the_built_in_modes_under_their_enum_values():
    assert registered_clip_modes() == tuple(mode.value for mode in ClipMode)
    assert all(type(name) is str for name in registered_clip_modes())  # plain strings: saved in checkpoints as such
    classes = [clip_mode_class(name) for name in registered_clip_modes()]
    assert classes == [StaticClip, ClipHigher, DualClip, CalibratedClip, OracleClip]


def test_an_unknown_mode_fails_naming_the_field_and_the_registered_keys():
    with pytest.raises(ValueError, match=r"clip_mode must be one of \('static', 'clip_higher', .*'oracle'\), got "
                                         r"'calibrate'"):
        clip_mode_class("calibrate")
    with pytest.raises(ValueError, match="clip_mode must be one of"):
        clip_mode_class(["static"])  # an unhashable value from YAML


def test_registering_a_taken_name_or_a_non_policy_raises():
    class Again(ClipPolicy):
        name = "static"

    with pytest.raises(ValueError, match="'static' is already registered \\(by StaticClip\\)"):
        register_clip_mode(Again)
    with pytest.raises(TypeError, match="ClipPolicy subclass"):
        register_clip_mode(object)

    class Nameless(ClipPolicy):
        pass

    with pytest.raises(ValueError, match="Nameless.name must be a non-empty string"):
        register_clip_mode(Nameless)
    assert registered_clip_modes() == tuple(mode.value for mode in ClipMode)  # nothing was added


@pytest.mark.parametrize("mode", ["static", "clip_higher", "dual_clip", "oracle"])
def test_static_bounds_are_one_minus_and_plus_the_epsilons_whatever_the_calibrator_says(mode):
    calibrator = _calibrator()
    policy = clip_policy_from_fields(mode, epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0)
    assert policy.name == mode
    assert policy.bounds_in_force(calibrator) == (0.8, 1.28)
    assert calibrator.bounds == (0.6, 1.8)  # the calibrator's, unused by these modes


def test_calibrated_bounds_in_force_are_the_calibrators():
    calibrator = _calibrator()
    policy = clip_policy_from_fields("calibrated", epsilon=0.2, epsilon_high=0.28, dual_clip_c=3.0)
    assert policy.bounds_in_force(calibrator) == (0.6, 1.8)
    gen = torch.Generator().manual_seed(0)
    ratio = torch.exp(0.3 * torch.randn(8, 16, generator=gen))
    adv = torch.randn(8, generator=gen)
    calibrator.calibrate(ratio, ratio * torch.exp(0.2 * torch.randn(8, 16, generator=gen)), adv,
                         torch.ones(8, 16, dtype=torch.bool))
    assert calibrator.bounds != (0.6, 1.8) and policy.bounds_in_force(calibrator) == calibrator.bounds
    bounds = policy.batch_bounds(calibrator.bounds, ratio_fp8=ratio, ratio_bf16=ratio, advantages=adv)
    assert bounds == ClipBounds(*calibrator.bounds, None)  # scalar bounds, no dual clip, shadow or not


def test_only_dual_clip_applies_its_constant():
    for mode in registered_clip_modes():
        policy = clip_policy_from_fields(mode, epsilon=0.2, epsilon_high=0.28, dual_clip_c=2.5)
        bounds = policy.batch_bounds((0.8, 1.28), ratio_fp8=None, ratio_bf16=None, advantages=torch.ones(2))
        assert bounds.dual_clip_c == (2.5 if mode == "dual_clip" else None), mode
    with pytest.raises(ValueError, match="dual_clip_c"):
        DualClip(eps_low=0.2, eps_high=0.2, dual_clip_c=None)


def test_which_modes_need_the_shadow_and_the_calibrator():
    needs = {}
    for mode in registered_clip_modes():
        policy = clip_policy_from_fields(mode, epsilon=0.2, epsilon_high=0.2, dual_clip_c=3.0)
        needs[mode] = (policy.needs_shadow, policy.uses_calibrator, policy.needs_shadow_this_step(False),
                       policy.needs_shadow_this_step(True))
    assert needs == {
        "static": (False, False, False, True),  # the shadow on the calibrator's schedule only monitors (FP8)
        "clip_higher": (False, False, False, True),
        "dual_clip": (False, False, False, True),
        "calibrated": (True, True, False, True),
        "oracle": (True, False, True, True),
    }


def _fields(**overrides):
    return ClipFields(**{**dict(epsilon=0.2, epsilon_high=None, importance_sampling_level="token"), **overrides})


def test_clip_higher_rules_default_epsilon_high_to_dapos_and_require_it_above_epsilon():
    assert ClipHigher.config_rules(_fields()).epsilon_high == 0.28
    assert ClipHigher.config_rules(_fields(epsilon_high=0.4)).epsilon_high == 0.4
    with pytest.raises(ValueError, match=r"epsilon_high \(0.2\) must be > epsilon \(0.2\)"):
        ClipHigher.config_rules(_fields(epsilon_high=0.2))
    assert StaticClip.config_rules(_fields()).epsilon_high is None  # TRL's rule (epsilon) stays the config's


@pytest.mark.parametrize("mode", [CalibratedClip, OracleClip])
def test_modes_that_read_the_shadow_need_token_ratios_and_warn_when_nothing_moves(mode):
    with pytest.raises(ValueError, match="importance_sampling_level='token'"):
        mode.config_rules(_fields(importance_sampling_level="sequence"))
    with pytest.warns(UserWarning, match=rf"clip_mode='{mode.name}' but every mini-batch is on-policy: because"):
        mode.config_rules(_fields(on_policy_reason="because"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mode.config_rules(_fields()) == _fields()
    for other in (StaticClip, ClipHigher, DualClip):  # no rule on the ratio level, no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            other.config_rules(_fields(importance_sampling_level="sequence", on_policy_reason="because",
                                       epsilon_high=0.28))


def test_calibrated_metric_names_are_what_a_calibration_logs():
    calibrator = _calibrator()
    gen = torch.Generator().manual_seed(1)
    ratio = torch.exp(0.3 * torch.randn(8, 16, generator=gen))
    calibrator.observe(ratio, ratio * 1.1, torch.randn(8, generator=gen), torch.ones(8, 16, dtype=torch.bool))
    stats = calibrator.commit(step=0)
    assert stats["calib/fit"] == 1.0
    assert set(CalibratedClip.metric_names) <= set(stats), set(CalibratedClip.metric_names) - set(stats)


def test_dual_clip_metric_names_are_loss_stats():
    logp = torch.zeros(2, 3)
    _, stats = clipped_surrogate(logp, logp, torch.tensor([-1.0, 1.0]), torch.ones(2, 3), low=0.8, high=1.2,
                                 dual_clip_c=3.0)
    assert set(DualClip.metric_names) <= set(stats)


def _usage_rows() -> list[str]:
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("### Clip modes (`clip_mode`)", 1)[1].split("\n#", 1)[0]
    table = section.split("|---|---|---|---|---|\n", 1)[1].split("\n\n", 1)[0]  # the rows under the header
    return table.splitlines()


def clip_mode_rows() -> list[str]:
    """docs/usage.md's table of clip modes, from the registry: key, class, what it clips with, shadow, own metrics."""
    rows = []
    for name in registered_clip_modes():
        cls = clip_mode_class(name)
        policy = cls(eps_low=0.2, eps_high=0.2, dual_clip_c=3.0)
        shadow = ("every moved mini-batch" if policy.needs_shadow_this_step(False) else
                  "on the calibration schedule" if policy.needs_shadow else "with FP8, to monitor")
        summary = " ".join(cls.__doc__.split("\n\n")[0].split())
        metrics = ", ".join(f"`{metric}`" for metric in cls.metric_names) or "-"
        rows.append(f"| `{name}` | `{cls.__module__}.{cls.__name__}` | {summary} | {shadow} | {metrics} |")
    return rows


def test_usage_lists_exactly_the_registered_modes():
    assert _usage_rows() == clip_mode_rows(), "\n" + "\n".join(clip_mode_rows())


def test_clipping_imports_neither_trl_nor_transformers():
    # DESIGN.md layering: clipping sits on losses and calibration (torch only); a fresh interpreter, since other tests
    # in this session may have imported TRL.
    import subprocess
    import sys

    code = ("import sys, calclip.clipping\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'trl', 'transformers', 'accelerate'})\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
