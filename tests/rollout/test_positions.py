"""The trainer's log-prob forwards use the positions generate used (calclip.rollout.positions): the hook itself, and a
short FP8 run whose rollout and trainer log-probs of left-padded rows then agree to fp32 rounding."""

import pytest
import torch
from torch import nn

from calclip.rollout.positions import positions_from_attention_mask, use_rollout_positions
from tests.fixtures import (
    build_tiny_model,
    build_tiny_tokenizer,
    digit_share_reward,
    logged,
    tiny_prompt_dataset,
    tiny_training_args,
)


def test_positions_count_each_rows_real_tokens_from_zero():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 0], [0, 0, 1, 0, 2]])
    assert torch.equal(positions_from_attention_mask(mask), expected)
    with pytest.raises(ValueError, match="attention_mask"):
        positions_from_attention_mask(mask[None])


def _padded_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, :1] = 0
    return ids, mask


def test_hook_fills_only_missing_positions_and_leaves_generate_alone():
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=1).eval()
    ids, mask = _padded_batch(model.config.vocab_size)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        given = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_attention_mask(mask)).logits
        greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                output_scores=True, return_dict_in_generate=True)
    hooks_before = len(model.model._forward_pre_hooks)
    assert use_rollout_positions(model) and use_rollout_positions(model)  # idempotent: one hook
    assert len(model.model._forward_pre_hooks) == hooks_before + 1
    with torch.no_grad():
        hooked = model(input_ids=ids, attention_mask=mask).logits
        arange = torch.arange(ids.shape[1]).expand_as(ids)
        explicit = model(input_ids=ids, attention_mask=mask, position_ids=arange).logits
        again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
    assert torch.equal(hooked, given)  # no position_ids passed: the mask's
    assert torch.equal(explicit, plain)  # position_ids passed: untouched
    assert not torch.equal(plain[:2], given[:2])  # the padded rows' numbers moved (in fp32 rounding)
    assert torch.equal(plain[2], given[2])  # the unpadded row is the same forward
    # generate passes its own positions, cached decode steps included: bit for bit what it gave before
    assert torch.equal(again.sequences, greedy.sequences)
    assert all(torch.equal(a, b) for a, b in zip(again.scores, greedy.scores))


def test_models_without_a_positions_backbone_are_left_alone():
    assert use_rollout_positions(nn.Linear(2, 2)) is False


def _padded_prompt_trainer(tmp_path, *, fp8: bool):
    from datasets import Dataset

    from calclip.trainers.config import CalibratedGRPOConfig
    from calclip.trainers.grpo import CalibratedGRPOTrainer

    tokenizer = build_tiny_tokenizer()
    # Every prompt a different length, so each generation batch (two prompts) is left-padded.
    prompts = [{"prompt": [{"role": "user", "content": "1" * (3 * k + 1) + "+1=?"}]} for k in range(8)]
    args = tiny_training_args(CalibratedGRPOConfig, tmp_path, fp8=fp8, bf16=True, gradient_accumulation_steps=1,
                              steps_per_generation=2, max_steps=2, mismatch_dump_threshold=None)
    return CalibratedGRPOTrainer(model=build_tiny_model(tokenizer), reward_funcs=digit_share_reward, args=args,
                                 train_dataset=Dataset.from_list(prompts), processing_class=tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_rollout_and_trainer_logps_agree_on_left_padded_rows(tmp_path, monkeypatch, fp8):
    """FP8 (or BF16) policy under bf16 autocast, left-padded prompts: with generate's positions the trainer's old
    log-probs equal the rollout's up to the fused LM head's fp32 arithmetic; with TRL's own positions (the hook
    switched off) the same run differs by bf16/FP8 roundings (measured 7e-3-1.5e-2 FP8, 2e-3 BF16, tiny model)."""
    trainer = _padded_prompt_trainer(tmp_path / "aligned", fp8=fp8)
    trainer.train()
    aligned = logged(trainer, "mismatch/max_abs_logp_diff")
    assert len(aligned) == 2 and max(aligned) < 1e-5
    assert logged(trainer, "mismatch/gap_gt_1nat_frac") == [0.0, 0.0]

    import calclip.trainers.grpo as grpo

    monkeypatch.setattr(grpo, "use_rollout_positions", lambda model: False)
    trainer = _padded_prompt_trainer(tmp_path / "shifted", fp8=fp8)
    trainer.train()
    assert max(logged(trainer, "mismatch/max_abs_logp_diff")) > 1e-3


def test_trainer_hooks_the_policy_and_the_reference_model(tmp_path):
    from calclip.trainers.config import CalibratedGRPOConfig
    from calclip.trainers.grpo import CalibratedGRPOTrainer

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(tmp_path / "model")  # beta > 0: TRL loads the reference from a path
    tokenizer.save_pretrained(tmp_path / "model")
    trainer = CalibratedGRPOTrainer(model=str(tmp_path / "model"), reward_funcs=digit_share_reward,
                                    args=tiny_training_args(CalibratedGRPOConfig, tmp_path, beta=0.04),
                                    train_dataset=tiny_prompt_dataset(4), processing_class=tokenizer)
    assert trainer.ref_model is not None
    ids, mask = _padded_batch(trainer.model.config.vocab_size)
    for model in (trainer.model, trainer.ref_model):
        with torch.no_grad():
            hooked = model(input_ids=ids, attention_mask=mask).logits
            given = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_attention_mask(mask)).logits
        assert torch.equal(hooked, given)
