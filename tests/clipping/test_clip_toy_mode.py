"""A new clip mode is one class plus its registration: a toy mode registered here runs through the config and the
trainer's loss, which branches on no mode name."""

import math
import warnings

import pytest
import torch

from calclip.clipping import ClipPolicy, register_clip_mode, unregister_clip_mode
from tests.fixtures import build_tiny_model, build_tiny_tokenizer, tiny_trainer
from calclip.trainers.config import CalibratedGRPOConfig

B, P, T = 4, 5, 8  # tiny_training_args: 4 completions a mini-batch, 8-token completions


class Unclipped(ClipPolicy):
    """Toy mode: no clipping at all, bounds [0, inf) in force: the loss is the plain policy gradient -r*A."""

    name = "toy_unclipped"

    def bounds_in_force(self, calibrator):
        return 0.0, math.inf


@pytest.fixture
def toy_mode():
    register_clip_mode(Unclipped)
    yield Unclipped
    unregister_clip_mode(Unclipped.name)


def _batch(trainer, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = len(trainer.processing_class)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 5:] = 0
    batch = {
        "prompt_ids": torch.randint(4, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (B, T), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([-1.5, -0.5, 0.7, 2.0]),
        "num_items_in_batch": completion_mask.sum(),
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], completion_mask], 1), T)
    # ratios far outside [0.8, 1.2], so static clipping would change the loss
    batch["old_per_token_logps"] = logps + 0.5 * torch.randn(B, T, generator=g)
    return batch, logps


def test_a_registered_toy_mode_runs_through_the_config_and_the_trainers_loss(toy_mode, tmp_path):
    assert CalibratedGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                clip_mode="toy_unclipped").clip_mode == "toy_unclipped"
    tokenizer = build_tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, tokenizer=tokenizer, model=build_tiny_model(tokenizer),
                               clip_mode="toy_unclipped", fp8=False, loss_type="dr_grpo")
    assert isinstance(trainer.clip_policy, Unclipped) and trainer.clip_mode == "toy_unclipped"
    assert trainer.clip_bounds == (0.0, math.inf)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch, logps = _batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)

    # float64 reference: dr_grpo sums the per-token losses over the mask and divides by B * max_completion_length
    ratio = torch.exp(logps.double() - batch["old_per_token_logps"].double())
    per_token = -ratio * batch["advantages"].double().unsqueeze(-1)
    expected = (per_token * batch["completion_mask"]).sum() / (B * T)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)
    clipped = torch.minimum(ratio * batch["advantages"].double().unsqueeze(-1),
                            ratio.clamp(0.8, 1.2) * batch["advantages"].double().unsqueeze(-1))
    static = -(clipped * batch["completion_mask"]).sum() / (B * T)
    assert abs(float(static - expected)) > 100 * 1e-5 * abs(float(expected))  # the mode's bounds made the difference
    assert trainer._metrics["train"]["calib/low"] == [0.0] and trainer._metrics["train"]["calib/high"] == [math.inf]


def test_the_toy_mode_leaves_the_registry_with_its_fixture(toy_mode):
    with pytest.raises(ValueError, match="already registered"):
        register_clip_mode(Unclipped)
    unregister_clip_mode(Unclipped.name)
    with pytest.raises(ValueError, match=r"clip_mode must be one of \('static', .*'oracle'\), got 'toy_unclipped'"):
        CalibratedGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, clip_mode="toy_unclipped")
    register_clip_mode(Unclipped)  # for the fixture's own clean-up
