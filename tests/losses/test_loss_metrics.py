"""Mismatch metrics, entropy stats and masked means: hand-worked values and a Monte Carlo check of k3."""

import math

import pytest
import torch

from calclip.losses import entropy_stats, kl_k3, masked_mean, token_mult_prob_error


def test_token_mult_prob_error_hand_worked():
    a = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    b = torch.tensor([[-1.0, -2.0 + math.log(2.0), 5.0]], dtype=torch.float64)  # |diff| = 0, ln 2, (masked)
    value = token_mult_prob_error(a, b, torch.tensor([[1, 1, 0]]))
    assert value.item() == pytest.approx((1.0 + 2.0) / 2, rel=1e-14)
    # Symmetric in its arguments; 1.0 for identical log-probs.
    assert token_mult_prob_error(b, a, torch.tensor([[1, 1, 0]])).item() == pytest.approx(1.5, rel=1e-14)
    assert token_mult_prob_error(a, a, torch.ones(1, 3)).item() == 1.0


def test_kl_k3_hand_worked():
    # log r = log p - log q = ln 2 -> k3 = 2 - 1 - ln 2;  log r = -ln 2 -> 0.5 - 1 + ln 2
    p = torch.tensor([[math.log(0.4), math.log(0.1)]], dtype=torch.float64)
    q = torch.tensor([[math.log(0.2), math.log(0.2)]], dtype=torch.float64)
    expected = ((1 - math.log(2)) + (-0.5 + math.log(2))) / 2
    assert kl_k3(p, q, torch.ones(1, 2)).item() == pytest.approx(expected, rel=1e-14)


def test_kl_k3_estimates_kl_q_to_p_from_samples_of_q():
    # Tokens drawn from q; the k3 mean converges to KL(q || p), not KL(p || q) (the two differ a lot here).
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    p = torch.tensor([0.9, 0.09, 0.01], dtype=torch.float64)
    kl_q_p = (q * (q / p).log()).sum().item()
    kl_p_q = (p * (p / q).log()).sum().item()
    assert abs(kl_q_p - kl_p_q) > 0.3
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=g).view(400, 500)
    estimate = kl_k3(p.log()[tokens], q.log()[tokens], torch.ones(400, 500)).item()
    assert estimate == pytest.approx(kl_q_p, rel=0.03)


def test_nonfinite_tokens_are_left_out_of_mismatch_metrics():
    a = torch.tensor([[-1.0, float("nan"), -1.0, float("-inf")]])
    b = torch.tensor([[-1.0, -1.0, -1.0 - math.log(3.0), -2.0]])
    mask = torch.ones(1, 4)
    assert token_mult_prob_error(a, b, mask).item() == pytest.approx((1 + 3) / 2, rel=1e-6)
    assert kl_k3(a, b, mask).item() == pytest.approx((0 + (3 - 1 - math.log(3))) / 2, rel=1e-6)


def test_entropy_stats_by_advantage_sign():
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    stats = entropy_stats(ent, torch.tensor([-1.0, 2.0]), mask)
    assert stats["entropy"].item() == pytest.approx((1 + 2 + 4 + 5) / 4)
    assert stats["entropy/neg_adv"].item() == pytest.approx(1.5)
    per_token_adv = torch.tensor([[-1.0, 1.0, -1.0], [-2.0, float("inf"), -1.0]])
    stats = entropy_stats(ent, per_token_adv, mask)
    assert stats["entropy"].item() == pytest.approx((1 + 2 + 4) / 3)  # the inf-advantage token is left out
    assert stats["entropy/neg_adv"].item() == pytest.approx((1 + 4) / 2)
    empty = entropy_stats(ent, torch.tensor([1.0, 1.0]), mask)
    assert empty["entropy/neg_adv"].item() == 0.0


def test_masked_mean_ignores_masked_nonfinite_and_is_detached():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]], requires_grad=True)
    value = masked_mean(x, torch.tensor([[1, 0], [1, 0]]))
    assert value.item() == 2.0 and not value.requires_grad
    assert masked_mean(x, torch.zeros(2, 2)).item() == 0.0


def test_bfloat16_inputs_give_float32_stats():
    # Counting in bfloat16 goes wrong above 256; stats are at least float32.
    ent = torch.ones(1, 1000, dtype=torch.bfloat16)
    assert masked_mean(ent, torch.ones(1, 1000)).dtype == torch.float32
    assert token_mult_prob_error(ent, ent, torch.ones(1, 1000)).dtype == torch.float32
