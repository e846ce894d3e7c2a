"""Ratios, the log-ratio clamp, input sanitizing and the clip-mode registry."""

import math

import pytest
import torch

from calclip.losses import (
    LOG_RATIO_CLAMP,
    ClipMode,
    clip_mode_names,
    get_clip_mode,
    importance_ratio,
    sanitize_inputs,
    sequence_log_ratio,
    token_log_ratio,
)


def test_token_log_ratio_is_clamped_with_zero_gradient_outside():
    logp = torch.tensor([[0.0, -1.0, -50.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-30.0, -1.5, 0.0]], dtype=torch.float64)
    log_r = token_log_ratio(logp, old)
    torch.testing.assert_close(log_r, torch.tensor([[20.0, 0.5, -20.0]], dtype=torch.float64), rtol=0, atol=0)
    log_r.sum().backward()
    assert logp.grad.tolist() == [[0.0, 1.0, 0.0]]
    assert LOG_RATIO_CLAMP == 20.0


def test_half_precision_is_upcast_so_exp_stays_finite():
    # exp(20) = 4.9e8 overflows float16 (max 65504).
    ratio, _ = importance_ratio(torch.zeros(1, 1, dtype=torch.float16), torch.full((1, 1), -25.0, dtype=torch.float16),
                                torch.ones(1, 1))
    assert ratio.dtype == torch.float32 and ratio.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_sequence_log_ratio_is_the_masked_mean():
    log_r = torch.tensor([[0.1, 0.3, float("nan")], [0.5, 0.0, 0.0], [1.0, 2.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = sequence_log_ratio(log_r, mask)
    torch.testing.assert_close(out, torch.tensor([[0.2], [0.5], [0.0]], dtype=torch.float64), rtol=1e-15, atol=0)


def test_importance_ratio_levels():
    logp = torch.log(torch.tensor([[2.0, 0.5, 7.0]], dtype=torch.float64))
    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    ratio, log_r = importance_ratio(logp, old, mask, level="token")
    torch.testing.assert_close(ratio, torch.tensor([[2.0, 0.5, 7.0]], dtype=torch.float64))
    ratio, log_r = importance_ratio(logp, old, mask, level="sequence")
    assert ratio.shape == (1, 1) and ratio.item() == pytest.approx(1.0, abs=1e-15)  # geometric mean of 2 and 0.5
    with pytest.raises(ValueError, match="level must be one of"):
        importance_ratio(logp, old, mask, level="seq")


def test_sanitize_counts_and_zeroes_nonfinite_with_finite_gradients():
    logp = torch.tensor([[float("nan"), -1.0, float("-inf")], [-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, float("inf"), -1.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([1.0, float("nan")])
    weights = torch.tensor([[1.0], [1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the -inf at [0, 2] is padding: not counted
    out = sanitize_inputs(logp, old, adv, mask, weights)
    assert out.nonfinite_tokens.item() == 4 and out.stats == {"nonfinite_tokens": out.nonfinite_tokens}
    assert out.mask.dtype == torch.bool and not out.mask.any()
    assert out.advantages.shape == (2, 1) and out.extra[0].shape == (2, 1)
    assert all(torch.isfinite(x).all() for x in (out.logp, out.old_logp, out.advantages))
    (grad,) = torch.autograd.grad(out.logp.sum(), logp)
    assert grad.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]


def test_sanitize_rejects_bad_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logp"):
        sanitize_inputs(x, torch.zeros(2, 4), torch.zeros(2), x)
    with pytest.raises(ValueError, match="extra"):
        sanitize_inputs(x, x, torch.zeros(2), x, torch.zeros(2, 2))


def test_registry_keys_and_lookup():
    assert clip_mode_names() == ("static", "clip_higher", "dual_clip", "calibrated", "oracle")
    assert get_clip_mode("calibrated") is ClipMode.CALIBRATED
    assert get_clip_mode(ClipMode.DUAL_CLIP) is ClipMode.DUAL_CLIP
    assert ClipMode.STATIC == "static"  # str-backed: compares equal to the YAML string
    with pytest.raises(ValueError, match="static, clip_higher, dual_clip, calibrated") as err:
        get_clip_mode("calibrate")
    assert "'calibrate'" in str(err.value)


def test_registry_has_no_aliases():
    # A duplicate value in a plain Enum becomes a silent alias (in __members__, not in iteration); @unique in
    # registry.py turns it into an import error. Either way no key may be an alias.
    assert len(ClipMode.__members__) == len(list(ClipMode)) == len(set(clip_mode_names()))


def test_losses_import_only_torch():
    # docs/DESIGN.md layering rule: calclip.losses never imports trl, transformers or accelerate (fresh interpreter,
    # since other tests in this session may have imported them).
    import subprocess
    import sys

    code = (
        "import sys, calclip.losses\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'trl', 'transformers', 'accelerate'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
