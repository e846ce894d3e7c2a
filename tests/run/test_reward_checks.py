"""+-inf rewards are excluded like TRL's None rewards: only that completion loses its advantage."""

import math
import warnings

import pytest
import torch

from calclip.run.reward_checks import exclude_nonfinite_rewards
from tests.fixtures import tiny_prompt_dataset, tiny_trainer

# Fixed rewards by position in the generation batch (2 prompts x 4 completions); the broken entry is position 1.
BASE = [0.1, 0.7, 0.4, 0.9, 0.2, 0.5, 0.3, 0.8]


def _reward(broken):
    def scored_by_position(completions, **kwargs):
        rewards = list(BASE)
        rewards[1] = broken
        return rewards

    return scored_by_position


def _advantages(tmp_path, broken, *, second=None):
    funcs = [_reward(broken)] + ([second] if second else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, reward_funcs=funcs, num_prompts=2, clip_mode="static", fp8=False,
                               steps_per_generation=2)
    trainer.model.train()
    rows = [tiny_prompt_dataset(2)[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = trainer._generate_and_score_completions(rows)
    ours = [w for w in caught if "returned +-inf" in str(w.message)]
    return output["advantages"], trainer._metrics["train"], ours


def _expected(values):
    """TRL's group normalization by hand (float64): (r - mean) / (std + 1e-4), std unbiased, NaN excluded."""
    out = []
    for group in (values[:4], values[4:]):
        kept = [v for v in group if v is not None]
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))
        out += [0.0 if v is None else (v - mean) / (std + 1e-4) for v in group]
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [math.inf, -math.inf])
def test_infinite_reward_excludes_only_that_completion(tmp_path, broken):
    advantages, metrics, warned = _advantages(tmp_path / "inf", broken)
    expected = _expected([BASE[0], None, *BASE[2:]])
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)
    assert advantages[1] == 0 and (advantages[[0, 2, 3]] != 0).all()
    # the same advantages as TRL gives when the function returns None there
    none_advantages, none_metrics, none_warned = _advantages(tmp_path / "none", None)
    torch.testing.assert_close(advantages, none_advantages, rtol=0, atol=0)
    assert metrics["reward/nonfinite_count"] == [1.0] and none_metrics["reward/nonfinite_count"] == [0.0]
    assert math.isfinite(metrics["reward"][0])
    assert len(warned) == 1 and "scored_by_position" in str(warned[0].message) and not none_warned


def test_infinite_reward_of_one_function_excludes_the_whole_completion(tmp_path):
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    advantages, metrics, warned = _advantages(tmp_path, math.inf, second=always_one)
    # position 1 is unscorable (advantage 0); the others are ranked on the sum of both functions
    expected = _expected([BASE[0] + 1, None, *(b + 1 for b in BASE[2:])])
    torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)
    assert metrics["reward/nonfinite_count"] == [1.0]
    assert "'scored_by_position': 1" in str(warned[0].message) and "always_one" not in str(warned[0].message)


def test_exclude_nonfinite_rewards_counts_per_function():
    rewards = torch.tensor([[1.0, math.inf], [math.nan, 2.0], [-math.inf, -math.inf], [0.5, 0.25]])
    cleaned, counts = exclude_nonfinite_rewards(rewards)
    assert counts.tolist() == [1, 2]
    assert torch.isnan(cleaned[[0, 2]]).all() and torch.isnan(cleaned[1, 0]) and cleaned[1, 1] == 2.0
    assert cleaned[3].tolist() == [0.5, 0.25]
    with pytest.raises(ValueError, match="rewards_per_func"):
        exclude_nonfinite_rewards(torch.ones(3))


@pytest.mark.slow
def test_a_reward_function_returning_what_trl_cannot_score_is_named(tmp_path):
    """Each value TRL's float32 conversion cannot take fails naming the function, the completion and the value (TRL
    said "too many dimensions 'str'" or OverflowError, naming no function; 1e39 silently became inf). One trainer
    serves every case (its reward functions read the value to return from ``returned``); the second, async function
    shows the check wraps async functions too and leaves them async (TRL awaits them)."""
    from calclip.run.reward_checks import RewardFunctionError

    returned = {"sync": 0.5, "async": 0.5}

    def scored_by_position(completions, **kwargs):
        rewards = list(BASE)
        rewards[1] = returned["sync"]
        return rewards

    async def async_scores(completions, **kwargs):
        return [returned["async"]] * len(completions)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, reward_funcs=[scored_by_position, async_scores], num_prompts=2,
                               clip_mode="static", fp8=False, steps_per_generation=2)
    trainer.model.train()
    rows = [tiny_prompt_dataset(2)[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    cases = [
        ("sync", "0.5", r"'scored_by_position' returned '0.5' \(str\) for completion 1 of 8: a string, not a number"),
        ("sync", 10**400, r"'scored_by_position' returned 1000.*\(int\) for completion 1 of 8: beyond the float range"),
        ("sync", 1e39, r"'scored_by_position' returned 1e\+39 \(float\) for completion 1 of 8: beyond float32's"),
        ("sync", [0.5], r"'scored_by_position' returned \[0.5\] \(list\) for completion 1 of 8: not a number"),
        ("async", "high", r"'async_scores' returned 'high' \(str\) for completion 0 of 8: a string"),
    ]
    for which, value, match in cases:
        returned.update({"sync": 0.5, "async": 0.5, which: value})
        with pytest.raises(RewardFunctionError, match=rf"^reward function {match}"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer._generate_and_score_completions(rows)
    returned.update({"sync": None, "async": 1.0})  # None and plain numbers still pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert trainer._generate_and_score_completions(rows)["advantages"].shape == (8,)


def test_check_reward_values_passes_what_trl_takes():
    import numpy as np

    from calclip.run.reward_checks import FLOAT32_MAX, RewardFunctionError, check_reward_values

    good = [1, 0.5, None, True, np.float32(2.0), np.int64(3), torch.tensor(0.25), math.inf, -FLOAT32_MAX]
    assert check_reward_values(good, "f", len(good)) is good  # returned unchanged: TRL converts it as before
    assert check_reward_values(torch.ones(3), "f", 3) is not None
    for values, match in [("0.5", r"returned '0.5' \(str\); it must return a list"),
                          (0.5, r"returned 0.5 \(float\); it must return a list"),
                          ([1.0, 2.0], "returned 2 rewards for 3 completions")]:
        with pytest.raises(RewardFunctionError, match=rf"^reward function 'f' {match}"):
            check_reward_values(values, "f", 3)
