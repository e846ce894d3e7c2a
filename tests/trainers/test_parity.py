"""Parity with stock TRL: with clip_mode static, FP8 off and no TIS, CalibratedGRPOTrainer's loss, gradients and
TRL metrics equal GRPOTrainer's on the same batch (TRL 1.16, the version pinned in pyproject.toml)."""

import copy
import warnings

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from calclip.rollout.positions import use_rollout_positions
from calclip.trainers.config import CalibratedGRPOConfig
from calclip.trainers.grpo import CalibratedGRPOTrainer
from tests.fixtures import (
    build_tiny_model,
    build_tiny_tokenizer,
    digit_share_reward,
    tiny_prompt_dataset,
    tiny_training_args,
)

B, P, T = 6, 7, 9


@pytest.fixture(scope="module")
def base():
    tokenizer = build_tiny_tokenizer()
    return tokenizer, build_tiny_model(tokenizer, seed=3), tiny_prompt_dataset(4)


def _trainers(base, tmp_path, **overrides):
    tokenizer, model, dataset = base
    common = dict(num_generations=2, per_device_train_batch_size=B, max_completion_length=T, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = GRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=digit_share_reward,
            args=tiny_training_args(GRPOConfig, tmp_path / "stock", **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        ours = CalibratedGRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=digit_share_reward,
            args=tiny_training_args(
                CalibratedGRPOConfig, tmp_path / "ours", clip_mode="static", fp8=False, tis_mode="none", **common
            ),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    # calclip numbers a left-padded row's positions as generate does (calclip.rollout.positions), TRL from its first
    # pad: the same function, rounded differently in fp32 (up to 3e-6 on gradients of ~10). The stock model gets the
    # same positions, so what is compared is the loss and its gradients, not the rounding of rotary angles.
    assert use_rollout_positions(stock.model)
    for trainer in (stock, ours):
        # Set by Trainer's training loop; the loss reads it for gradient-accumulation scaling.
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        trainer.model.train()
    return stock, ours


def _batch(trainer, *, with_old: bool, with_ref: bool, seed: int = 0):
    """A generation batch as TRL's _generate_and_score_completions returns it, with ragged prompts/completions."""
    g = torch.Generator().manual_seed(seed)
    vocab = len(trainer.processing_class)
    prompt_ids = torch.randint(4, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :3] = 0  # left padding
    prompt_mask[4, :1] = 0
    prompt_ids[prompt_mask == 0] = trainer.processing_class.pad_token_id
    completion_ids = torch.randint(4, vocab, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 5:] = 0  # right padding
    completion_mask[3, 2:] = 0
    completion_ids[completion_mask == 0] = trainer.processing_class.pad_token_id
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        # the generation batch's token count over all ranks (more than this mini-batch holds)
        "num_items_in_batch": completion_mask.sum() * 3,
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T
        )
    if with_old:
        # a moved policy: ratios spread well beyond [0.8, 1.2] so both clip branches and both signs are exercised
        batch["old_per_token_logps"] = logps + 0.4 * torch.randn(B, T, generator=g)
    if with_ref:
        batch["ref_per_token_logps"] = logps + 0.2 * torch.randn(B, T, generator=g)
    return batch


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, copy.deepcopy(batch))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "dapo_asymmetric": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
    "grpo_sequence_level": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "bnpo_entropy_bonus": dict(loss_type="bnpo", entropy_coef=0.05),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradients_equal_stock_grpo(base, tmp_path, case):
    stock, ours = _trainers(base, tmp_path, **CASES[case])
    # off-policy (old log-probs in the batch) and on-policy (TRL then uses the detached current log-probs)
    for seed, with_old in enumerate((True, False)):
        for trainer in (stock, ours):
            trainer._metrics["train"].clear()
        batch = _batch(stock, with_old=with_old, with_ref=False, seed=seed)
        stock_loss, stock_grads = _loss_and_grads(stock, batch)
        our_loss, our_grads = _loss_and_grads(ours, batch)

        assert stock_loss.abs() > 1e-4  # a batch that actually produces a loss
        torch.testing.assert_close(our_loss, stock_loss, rtol=1e-5, atol=1e-7)
        assert stock_grads.keys() == our_grads.keys() and len(stock_grads) > 0
        for name, grad in stock_grads.items():
            torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
        # TRL's own metrics keep their values
        for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                    "clip_ratio/low_min", "clip_ratio/high_max"):
            assert stock._metrics["train"][key], key
            assert ours._metrics["train"][key] == pytest.approx(stock._metrics["train"][key], rel=1e-5, abs=1e-7)
        if with_old:
            assert stock._metrics["train"]["clip_ratio/region_mean"][0] > 0.1  # clipping is exercised


def test_kl_term_equals_stock_grpo(base, tmp_path):
    stock, ours = _trainers(base, tmp_path, loss_type="dapo")
    for trainer in (stock, ours):
        trainer.beta = 0.04  # the reference model only matters at generation; the batch carries its log-probs
    batch = _batch(stock, with_old=True, with_ref=True, seed=1)
    stock_loss, stock_grads = _loss_and_grads(stock, batch)
    our_loss, our_grads = _loss_and_grads(ours, batch)
    torch.testing.assert_close(our_loss, stock_loss, rtol=1e-5, atol=1e-7)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
    assert ours._metrics["train"]["kl"][0] == pytest.approx(stock._metrics["train"]["kl"][0], rel=1e-5)


def test_static_bounds_differ_from_calibrated_loss(base, tmp_path):
    """The parity above is not vacuous: the same trainer with other bounds gives another loss."""
    stock, ours = _trainers(base, tmp_path, loss_type="grpo")
    batch = _batch(stock, with_old=True, with_ref=False)
    stock_loss, _ = _loss_and_grads(stock, batch)
    ours.args.epsilon = 0.05
    our_loss, _ = _loss_and_grads(ours, batch)
    assert not torch.isclose(our_loss, stock_loss, rtol=1e-3)


def test_dapo_normalizer_below_one_equals_stock_grpo(base, tmp_path):
    """TRL clamps the global token count at 1 and then rescales it to one accumulation window (x GA / spg), so
    the normalizer can fall below 1 (here 1 x 2 / 4 = 0.5); calclip must not clamp that again."""
    stock, ours = _trainers(base, tmp_path, loss_type="dapo")
    batch = _batch(stock, with_old=True, with_ref=False, seed=2)
    batch["num_items_in_batch"] = torch.tensor(1)
    assert stock.args.gradient_accumulation_steps / stock.args.steps_per_generation == 0.5
    stock_loss, stock_grads = _loss_and_grads(stock, batch)
    our_loss, our_grads = _loss_and_grads(ours, batch)
    torch.testing.assert_close(our_loss, stock_loss, rtol=1e-5, atol=1e-7)
    for name, grad in stock_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")


@pytest.mark.parametrize("bad_key", ["ref_per_token_logps", "old_per_token_logps"])
def test_nonfinite_token_leaves_kl_and_entropy_terms(base, tmp_path, bad_key):
    """A NaN reference/old log-prob on one valid token is dropped from the KL term (and the entropy bonus keeps
    finite): the loss and every gradient stay finite, and the KL part equals an independent k3 mean over the
    remaining tokens."""
    _, ours = _trainers(base, tmp_path, loss_type="bnpo", entropy_coef=0.05)
    batch = _batch(ours, with_old=True, with_ref=True, seed=4)
    batch[bad_key][2, 3] = float("nan")
    ours.beta = 0.04
    loss, grads = _loss_and_grads(ours, batch)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())

    ours.beta = 0.0
    loss_without_kl, _ = _loss_and_grads(ours, batch)
    with torch.no_grad():
        logps, _, _ = ours._get_per_token_logps_and_entropies(
            ours.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), T,
        )
    valid = batch["completion_mask"].bool().clone()
    valid[2, 3] = False
    diff = (batch["ref_per_token_logps"] - logps).double()[valid]
    kl = torch.exp(diff) - diff - 1
    assert ours.args.use_bias_correction_kl  # TRL 1.16's default: k3 weighted by the importance ratio
    kl_mean = (kl * torch.exp((logps - batch["old_per_token_logps"]).double()[valid])).mean()
    expected = 0.04 * kl_mean / ours.current_gradient_accumulation_steps  # bnpo: token mean, accumulation-scaled
    torch.testing.assert_close((loss - loss_without_kl).double(), expected, rtol=1e-4, atol=1e-8)


class _RecordedRank:
    """Another rank, faked: its tensors given to each collective are recorded in call order, then replayed so that
    this process's i-th reduce/gather sees rank 0's tensor together with the other rank's i-th one."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.calls: list[tuple[str, torch.Tensor]] = []

    def record(self, monkeypatch):
        def reduce(tensor, reduction="sum"):
            self.calls.append(("reduce", tensor.clone()))
            return tensor.clone()

        def gather(tensor):
            self.calls.append(("gather", tensor.clone()))
            return tensor.clone()

        monkeypatch.setattr(self.accelerator, "reduce", reduce)
        monkeypatch.setattr(self.accelerator, "gather", gather)

    def replay(self, monkeypatch):
        calls = iter(self.calls)

        def reduce(tensor, reduction="sum"):
            kind, other = next(calls)
            assert kind == "reduce" and reduction == "sum"
            return tensor + other

        def gather(tensor):
            kind, other = next(calls)
            assert kind == "gather"
            return torch.cat([tensor, other])

        monkeypatch.setattr(self.accelerator, "reduce", reduce)
        monkeypatch.setattr(self.accelerator, "gather", gather)


def test_token_metrics_are_token_weighted_global_means(base, tmp_path, monkeypatch):
    """Two ranks with very unequal token counts: every token-level metric (TRL's and calclip's) equals the
    single-process value over the union of both ranks' tokens, not the average of the two per-rank means."""
    _, ours = _trainers(base, tmp_path, loss_type="grpo")
    ours.args.tis_mode, ours.args.tis_cap = "token_truncate", 1.5  # (stock TRL has no such field)
    ours.beta = 0.04
    rank0 = _batch(ours, with_old=True, with_ref=True, seed=5)
    rank1 = _batch(ours, with_old=True, with_ref=True, seed=6)
    rank1["completion_mask"][:, 2:] = 0  # rank 1 holds 12 tokens, rank 0 holds 45
    rank1["completion_ids"][rank1["completion_mask"] == 0] = ours.processing_class.pad_token_id
    for batch, seed, scale in ((rank0, 7, 0.1), (rank1, 8, 0.6)):  # the ranks' rollout mismatch differs
        g = torch.Generator().manual_seed(seed)
        batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + scale * torch.randn(B, T, generator=g)
    union = {key: torch.cat([rank0[key], rank1[key]]) for key in rank0 if key != "num_items_in_batch"}
    union["num_items_in_batch"] = rank0["num_items_in_batch"]

    def metrics_of(batch):
        ours._metrics["train"].clear()
        with torch.no_grad():
            ours.compute_loss(ours.model, copy.deepcopy(batch))
        return {key: values[-1] for key, values in ours._metrics["train"].items()}

    expected = metrics_of(union)
    with monkeypatch.context() as patch:
        other_rank = _RecordedRank(ours.accelerator)
        other_rank.record(patch)
        metrics_of(rank1)
        other_rank.replay(patch)
        got = metrics_of(rank0)
    alone0, alone1 = metrics_of(rank0), metrics_of(rank1)
    for key in ("kl", "clip_ratio/region_mean", "mismatch/kl_k3"):  # the unequal counts matter here
        assert got[key] != pytest.approx((alone0[key] + alone1[key]) / 2, rel=1e-2), key

    token_means = ("entropy", "entropy/neg_adv", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                   "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "clip/neg_low_frac_fp8",
                   "clip/pos_high_frac", "mismatch/token_mult_prob_error", "mismatch/kl_k3", "tis/weight_mean",
                   "tis/clipped_frac", "tis/weight_min", "tis/weight_max", "loss/nonfinite_tokens")  # fmt: skip
    for key in token_means:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert 0.0 < got["clip_ratio/region_mean"] < 1.0 and got["mismatch/token_mult_prob_error"] > 1.0
