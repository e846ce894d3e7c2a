"""aggregate() equals the normalizations TRL 1.16 applies in GRPOTrainer._compute_loss.

Formulas restated from trl 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss:
  lines ~3084-3095  log-ratio and the "token" / "sequence" importance-sampling levels
  lines ~3110-3118  coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high); loss = -min(coef_1*A, coef_2*A)
  lines ~3153-3174  grpo / bnpo / dr_grpo / dapo normalizations (and the gradient-accumulation normalizer)
"""

import pytest
import torch

from calclip.losses import AGGREGATIONS, aggregate, clipped_surrogate


def trl_normalized_loss(per_token_loss, mask, loss_type, *, max_completion_length, num_items_in_batch,
                        num_processes, gradient_accumulation_steps, steps_per_generation):
    """TRL 1.16's reduction in train mode, including its gradient-accumulation scaling."""
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        return loss / gradient_accumulation_steps
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    if loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        return loss / gradient_accumulation_steps
    if loss_type == "dapo":
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        return (per_token_loss * mask).sum() / normalizer
    raise AssertionError(loss_type)


def calclip_trainer_side(per_token_loss, mask, mode, *, max_completion_length, num_items_in_batch, num_processes,
                         gradient_accumulation_steps, steps_per_generation):
    """What the trainer does around aggregate(): pass num_items per process, then scale for accumulation."""
    loss = aggregate(per_token_loss, mask, mode, max_completion_length=max_completion_length,
                     num_items=num_items_in_batch / num_processes)
    if mode == "dapo":
        return loss * steps_per_generation / gradient_accumulation_steps
    return loss / gradient_accumulation_steps


def random_inputs(seed, seq_level=False):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(6, 8, generator=g) < 0.7).to(torch.float64)
    mask[2] = 0.0  # an empty sequence
    per_token_loss = torch.randn(6, 1 if seq_level else 8, generator=g, dtype=torch.float64)
    return per_token_loss, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seq_level", [False, True])
@pytest.mark.parametrize("num_processes,ga,spg", [(1, 1, 1), (2, 4, 8), (4, 2, 2)])
def test_aggregate_matches_trl_formula(mode, seq_level, num_processes, ga, spg):
    per_token_loss, mask = random_inputs(10 * AGGREGATIONS.index(mode) + 2 * ga + seq_level, seq_level)
    num_items_in_batch = torch.tensor(137.0, dtype=torch.float64)  # global token count of the generation batch
    kw = dict(max_completion_length=11, num_items_in_batch=num_items_in_batch, num_processes=num_processes,
              gradient_accumulation_steps=ga, steps_per_generation=spg)
    ours = calclip_trainer_side(per_token_loss, mask, mode, **kw)
    trl = trl_normalized_loss(per_token_loss, mask, mode, **kw)
    torch.testing.assert_close(ours, trl, rtol=1e-14, atol=0)


def test_hand_worked_normalizations():
    # Two sequences: [1, 2, (pad)] and [3, (pad), (pad)]; 3 tokens in all.
    loss = torch.tensor([[1.0, 2.0, 100.0], [3.0, 200.0, 300.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(loss, mask, "grpo").item() == pytest.approx((1.5 + 3.0) / 2, abs=1e-15)
    assert aggregate(loss, mask, "bnpo").item() == pytest.approx(6.0 / 3, abs=1e-15)
    assert aggregate(loss, mask, "dr_grpo", max_completion_length=4).item() == pytest.approx(6.0 / 8, abs=1e-15)
    assert aggregate(loss, mask, "dapo", num_items=12).item() == pytest.approx(6.0 / 12, abs=1e-15)
    assert aggregate(loss, mask, "dapo", num_items=torch.tensor(0.0)).item() == pytest.approx(6.0, abs=1e-15)


def test_masked_nonfinite_values_do_not_leak_into_loss_or_gradient():
    loss = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    for mode in AGGREGATIONS:
        out = aggregate(loss, mask, mode, max_completion_length=2, num_items=2)
        (grad,) = torch.autograd.grad(out, loss)
        assert torch.isfinite(out) and torch.isfinite(grad).all()
        assert grad[0, 1] == 0 and grad[1, 0] == 0


@pytest.mark.parametrize("loss_type", AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clipped_surrogate_matches_trl_grpo_loss(loss_type, level):
    """End to end: TRL's per-token loss (epsilon bounds, both IS levels) + its reduction == clipped_surrogate."""
    g = torch.Generator().manual_seed(7)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.1
    old = logp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) < 0.8).to(torch.float64)
    advantages = torch.randn(4, generator=g, dtype=torch.float64)
    eps_low, eps_high, num_items = 0.2, 0.28, torch.tensor(15.0, dtype=torch.float64)

    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    trl = trl_normalized_loss(per_token_loss, mask, loss_type, max_completion_length=6, num_items_in_batch=num_items,
                              num_processes=1, gradient_accumulation_steps=1, steps_per_generation=1)

    ours, _ = clipped_surrogate(logp, old, advantages, mask, low=1 - eps_low, high=1 + eps_high, level=level,
                                aggregation=loss_type, max_completion_length=6, num_items=num_items)
    torch.testing.assert_close(ours, trl, rtol=1e-13, atol=1e-15)
