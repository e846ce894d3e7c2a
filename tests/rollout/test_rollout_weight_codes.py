"""Rollouts run on the FP8 codes of the current weights: after every optimizer step (plain and fused AdamW, whose
updates do not bump the weights' autograd version) the codes inside the trainer's generate call equal a fresh
quantization of each FP8 layer's weight. Stale codes were one candidate cause of rollout-trainer mismatch bursts."""

import contextlib

import pytest
import torch

from calclip.fp8 import quantize_128x128
from calclip.fp8.weight_codes import fp8_layers
from tests.fixtures import tiny_trainer


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_generate_runs_on_codes_of_the_current_weights(tmp_path, monkeypatch, optim):
    import calclip.trainers.grpo as grpo

    seen = []  # per generate call: (every layer's codes current?, a copy of one weight)
    frozen = grpo.frozen_fp8_weights

    @contextlib.contextmanager
    def checking(model):
        with frozen(model) as inside:
            layers = fp8_layers(model)
            current = []
            for layer in layers:
                cfg = layer.fp8_config
                codes, scales = quantize_128x128(layer.weight.detach(), block=cfg.block_size,
                                                 pow2=cfg.power_of_two_scales)
                current.append(torch.equal(layer._fp8_qw.view(torch.uint8), codes.view(torch.uint8))
                               and torch.equal(layer._fp8_sw, scales))
            seen.append((bool(layers) and all(current), layers[0].weight.detach().clone()))
            yield inside

    monkeypatch.setattr(grpo, "frozen_fp8_weights", checking)
    # One generation round per optimizer step (steps_per_generation = GA = 1): every rollout after the first follows
    # an optimizer step.
    trainer = tiny_trainer(tmp_path, fp8=True, optim=optim, gradient_accumulation_steps=1, steps_per_generation=1,
                           max_steps=3, learning_rate=1e-2)
    trainer.train()
    assert len(seen) == 3 and all(ok for ok, _ in seen)
    weights = [w for _, w in seen]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])  # the weights moved
