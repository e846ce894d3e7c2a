import math

import pytest
import torch

from calclip.trainers.dapo import (
    concat_batches,
    informative_rows,
    select_rows,
    soft_overlong_punishment,
)

# ------------------------------------------------------------------------------------------------------------
# soft overlong punishment (DAPO paper, eq. 13): L_max = 10, L_cache = 4 -> free up to 6 tokens, then -1/4 per
# token down to -1 at 10, and -1 beyond.


@pytest.mark.parametrize(
    "length, expected",
    [(0, 0.0), (3, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0), (11, -1.0), (50, -1.0)],
)
def test_soft_overlong_punishment_hand_worked(length, expected):
    reward = soft_overlong_punishment(10, 4)
    assert reward(completion_ids=[[1] * length]) == [expected]


def test_soft_overlong_punishment_batch_factor_and_name():
    reward = soft_overlong_punishment(10, 4, penalty_factor=0.5)
    assert reward(completion_ids=[[1] * 5, [2] * 8, [3] * 10], prompts=None, completions=None) == [0.0, -0.25, -0.5]
    assert reward.__name__ == "soft_overlong_punishment"
    # cache == max length: the ramp covers the whole budget (|y| = 5 of 10 -> -0.5).
    assert soft_overlong_punishment(10, 10)(completion_ids=[[0] * 5]) == [-0.5]


@pytest.mark.parametrize(
    "args, match",
    [((10, 0), "cache_length"), ((10, 11), "cache_length"), ((0, 1), "max_completion_length")],
)
def test_soft_overlong_punishment_rejects_bad_lengths(args, match):
    with pytest.raises(ValueError, match=match):
        soft_overlong_punishment(*args)
    with pytest.raises(ValueError, match="penalty_factor"):
        soft_overlong_punishment(10, 4, penalty_factor=-1.0)


# ------------------------------------------------------------------------------------------------------------
# group selection


def test_informative_rows_hand_worked():
    nan = math.nan
    rewards = torch.tensor(
        [
            # group 0: weighted sums 1.5, 1.5 -> uniform
            [1.0, 1.0], [0.0, 3.0],
            # group 1: 1.0 vs 0.0 -> informative
            [1.0, 0.0], [0.0, 0.0],
            # group 2: NaN in one function is skipped (nansum): 2.0 vs 2.0 -> uniform
            [2.0, nan], [2.0, 0.0],
            # group 3: one unscorable row (all NaN) and one scored row: nothing to compare -> uniform
            [nan, nan], [1.0, 1.0],
            # group 4: differs by less than the tolerance -> uniform
            [1.0, 0.0], [1.0 + 1e-8, 0.0],
        ]
    )
    weights = torch.tensor([1.0, 0.5])
    keep = informative_rows(rewards, weights, num_generations=2)
    assert keep.tolist() == [False, False, True, True, False, False, False, False, False, False]
    # With weight 0 on the first function, group 1 becomes uniform (0, 0) and group 0 informative (0.5, 1.5).
    keep = informative_rows(rewards, torch.tensor([0.0, 0.5]), num_generations=2)
    assert keep[:4].tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="groups of 3"):
        informative_rows(rewards, weights, num_generations=3)


def test_concat_batches_repads_prompts_left_and_completions_right():
    pad = 9
    a = {
        "prompt_ids": torch.tensor([[1, 2, 3]]),
        "prompt_mask": torch.tensor([[1, 1, 1]]),
        "completion_ids": torch.tensor([[4, 5]]),
        "completion_mask": torch.tensor([[1, 1]]),
        "advantages": torch.tensor([0.5]),
        "old_per_token_logps": torch.tensor([[-1.0, -2.0]]),
        "num_items_in_batch": torch.tensor(2),
    }
    b = {
        "prompt_ids": torch.tensor([[7], [8]]),
        "prompt_mask": torch.tensor([[1], [1]]),
        "completion_ids": torch.tensor([[4, 5, 6], [6, pad, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "advantages": torch.tensor([-1.0, 1.0]),
        "old_per_token_logps": torch.tensor([[-0.25, -0.5, -0.75], [-0.125, 0.0, 0.0]]),
        "num_items_in_batch": torch.tensor(4),
    }
    merged = concat_batches([a, b], pad_token_id=pad)
    assert merged["prompt_ids"].tolist() == [[1, 2, 3], [pad, pad, 7], [pad, pad, 8]]
    assert merged["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert merged["completion_ids"].tolist() == [[4, 5, pad], [4, 5, 6], [6, pad, pad]]
    assert merged["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert merged["old_per_token_logps"].tolist() == [[-1.0, -2.0, 0.0], [-0.25, -0.5, -0.75], [-0.125, 0.0, 0.0]]
    assert merged["advantages"].tolist() == [0.5, -1.0, 1.0]

    picked = select_rows(merged, torch.tensor([False, True, False]))
    assert picked["completion_ids"].tolist() == [[4, 5, 6]] and picked["advantages"].tolist() == [-1.0]
    assert picked["num_items_in_batch"] is merged["num_items_in_batch"]  # scalars pass through
    # An empty part contributes nothing and does not break the padding.
    empty = select_rows(a, torch.tensor([False]))
    assert concat_batches([empty, b], pad_token_id=pad)["prompt_ids"].tolist() == [[7], [8]]


# ------------------------------------------------------------------------------------------------------------
# the trainer on a tiny model

NUM_GENERATIONS = 4
BATCH = 8  # rows per optimizer step = 2 groups


def _kind_dataset(kinds):
    """Prompts whose text says what the reward will do: 'same' prompts get one reward for every completion,
    'vary' prompts a reward that depends on the completion text (so their groups are informative)."""
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{kind} {i}"}], "kind": kind} for i, kind in enumerate(kinds)]
    )


def kind_reward(completions, kind, **kwargs):
    rewards = []
    for completion, k in zip(completions, kind):
        text = completion[0]["content"]
        # a completion-dependent value in [0, 1): distinct sampled texts almost surely differ
        rewards.append(1.0 if k == "same" else (sum(map(ord, text)) * 7919 % 1000) / 1000)
    return rewards


def _dapo_trainer(tmp_path, kinds, **overrides):
    from calclip.trainers.config import CalibratedDAPOConfig
    from calclip.trainers.dapo import CalibratedDAPOTrainer
    from tests.fixtures import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        num_generations=NUM_GENERATIONS,
        steps_per_generation=2,
        max_completion_length=8,
        overlong_buffer_length=4,
        # Off by default here: the length penalty would make 'same' groups informative too.
        overlong_penalty_factor=0.0,
        max_steps=2,
        learning_rate=1e-3,
        fp8=False,
        clip_mode="clip_higher",
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        dynamic_sampling_max_rounds=8,
    )
    values.update(overrides)
    args = CalibratedDAPOConfig(**values)
    return CalibratedDAPOTrainer(
        model=build_tiny_model(tokenizer),
        reward_funcs=[kind_reward],
        args=args,
        train_dataset=_kind_dataset(kinds),
        processing_class=tokenizer,
    )


def _generation_batch(trainer):
    """One generation batch as TRL's dataloader yields it (groups of num_generations identical rows)."""
    trainer.model.train()
    return next(iter(trainer.get_train_dataloader()))


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_with_informative_groups(tmp_path):
    kinds = ["same", "vary"] * 8
    trainer = _dapo_trainer(tmp_path, kinds)
    inputs = _generation_batch(trainer)
    assert len(inputs) == BATCH * 2  # steps_per_generation 2 -> 16 rows = 4 groups

    output = trainer._generate_and_score_completions(inputs)

    tokenizer = trainer.processing_class
    prompts = tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True)
    assert len(prompts) == len(inputs)
    assert all("vary" in p and "same" not in p for p in prompts)  # every uniform group was dropped and refilled
    assert output["advantages"].abs().sum() > 0
    # The shapes line up after re-padding, and num_items_in_batch counts exactly the kept completion tokens.
    assert output["completion_mask"].shape == output["completion_ids"].shape
    assert output["prompt_mask"].shape == output["prompt_ids"].shape
    assert int(output["num_items_in_batch"]) == int(output["completion_mask"].sum())

    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/dropped_groups"][-1] >= 1  # some 'same' groups were drawn and dropped
    assert metrics["dynamic_sampling/rounds"][-1] >= 2
    assert metrics["dynamic_sampling/underfilled_rows"][-1] == 0


@pytest.mark.slow
def test_dynamic_sampling_caps_rounds_and_keeps_batch_size(tmp_path):
    trainer = _dapo_trainer(tmp_path, ["same"] * 8, dynamic_sampling_max_rounds=2)
    inputs = _generation_batch(trainer)
    output = trainer._generate_and_score_completions(inputs)
    assert output["completion_ids"].size(0) == len(inputs)  # topped up with zero-advantage rows
    assert torch.all(output["advantages"] == 0)
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/rounds"][-1] == 2
    assert metrics["dynamic_sampling/underfilled_rows"][-1] == len(inputs)
    # every round's groups were dropped: 4 groups in the first round, 4 refilled groups in the second
    assert metrics["dynamic_sampling/dropped_groups"][-1] == 8


@pytest.mark.slow
def test_dapo_training_run_updates_parameters_and_logs(tmp_path):
    # The preset as shipped: FP8 policy and calibrated clipping (the shadow log-probs ride through the re-padding).
    trainer = _dapo_trainer(
        tmp_path, ["same", "vary"] * 8, overlong_penalty_factor=1.0, reward_weights=[2.0], fp8=True,
        clip_mode="calibrated", calibration_interval=1,
    )
    assert trainer.reward_func_names == ["kind_reward", "soft_overlong_punishment"]
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p.detach())]
    assert changed, "no parameter changed"
    logs = [entry for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry]
    assert logs and all(math.isfinite(entry["loss"]) for entry in logs)
    assert all(entry["dynamic_sampling/underfilled_rows"] == 0 for entry in logs)
    assert "rewards/soft_overlong_punishment/mean" in logs[0]
    low, high = trainer.clip_bounds
    assert 0.2 <= low <= 1.0 <= high <= 5.0  # the config's rails


def test_dynamic_sampling_off_is_plain_generation(tmp_path):
    trainer = _dapo_trainer(tmp_path, ["same", "vary"] * 8, dynamic_sampling=False)
    assert trainer.reward_func_names == ["kind_reward"]  # penalty factor 0: no overlong reward appended
    inputs = _generation_batch(trainer)
    output = trainer._generate_and_score_completions(inputs)
    prompts = trainer.processing_class.batch_decode(output["prompt_ids"], skip_special_tokens=True)
    assert sum("same" in p for p in prompts) == sum("same" in x["prompt"][0]["content"] for x in inputs)
    assert "dynamic_sampling/rounds" not in trainer._metrics["train"]


@pytest.mark.slow
def test_dynamic_sampling_refuses_multimodal_batches(tmp_path, monkeypatch):
    """Image tensors are indexed per image/patch, not per row: selecting rows would misalign them, so a batch
    carrying them is refused by name instead of being silently corrupted."""
    from calclip.trainers.grpo import CalibratedGRPOTrainer

    trainer = _dapo_trainer(tmp_path, ["vary"] * 8)
    inputs = _generation_batch(trainer)
    parent = CalibratedGRPOTrainer._generate_and_score_completions

    def with_images(self, batch_inputs):
        batch = parent(self, batch_inputs)
        batch["pixel_values"] = torch.zeros(3 * len(batch_inputs), 8)  # e.g. 3 patches per row
        return batch

    monkeypatch.setattr(CalibratedGRPOTrainer, "_generate_and_score_completions", with_images)
    with pytest.raises(NotImplementedError, match="pixel_values"):
        trainer._generate_and_score_completions(inputs)
