"""The non-finite-gradient guard: a NaN/inf gradient step leaves weights and optimizer state as they were, a finite
step after it trains normally, and a streak of max_consecutive such steps stops the run with the steps named."""

import warnings

import pytest
import torch
from torch import nn

from calclip.run.grad_guard import NonfiniteGradGuard, NonfiniteGradientsError

NAN, INF = float("nan"), float("inf")


def _model_and_optimizer(guard=None, fused=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=fused)
    if guard is not None:
        opt.register_step_pre_hook(guard)
    return model, opt


def _backward(model, poison=None):
    model.zero_grad(set_to_none=True)
    model(torch.ones(2, 6)).square().sum().backward()
    if poison is not None:
        model[1].weight.grad[0, 1] = poison


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for p in model.parameters() for k, v in opt.state.get(p, {}).items()}
    return params, state


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1].keys() == b[1].keys() and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("poison", [NAN, INF, -INF])
def test_a_nonfinite_step_changes_nothing_and_a_finite_one_trains(poison):
    steps = []
    guard = NonfiniteGradGuard(3, on_step=steps.append)
    model, opt = _model_and_optimizer(guard)
    _backward(model)
    opt.step()  # one real step, so there is optimizer state to keep
    before = _snapshot(model, opt)
    _backward(model, poison)
    opt.step()
    assert _same(before, _snapshot(model, opt))
    assert all(p.grad is None for p in model.parameters())
    _backward(model)
    opt.step()
    after = _snapshot(model, opt)
    assert not _same(before, after) and all(torch.isfinite(p).all() for p in model.parameters())
    assert steps == [False, True, False] and guard.skipped_total == 1 and guard.skipped_in_a_row == []


def test_without_the_guard_one_nan_step_makes_the_weights_nan():
    """What the guard prevents (the behaviour of TRL/transformers' optimizer step)."""
    model, opt = _model_and_optimizer()
    _backward(model, NAN)
    opt.step()
    assert torch.isnan(model[1].weight).any()


def test_a_streak_raises_naming_the_steps_and_keeps_the_weights():
    step = iter(range(10, 20))
    guard = NonfiniteGradGuard(2, step_of=lambda: next(step), hint=" (hint)")
    model, opt = _model_and_optimizer(guard)
    before = _snapshot(model, opt)
    _backward(model, NAN)
    opt.step()
    _backward(model, INF)
    with pytest.raises(NonfiniteGradientsError, match=r"2 optimizer steps in a row.*10 \(grad norm nan\), 11 \(grad "
                                                      r"norm inf\).*max_nonfinite_grad_skips=2\)\. \(hint\)"):
        opt.step()
    assert _same(before, _snapshot(model, opt))


def test_finite_steps_in_between_reset_the_streak():
    guard = NonfiniteGradGuard(2)
    model, opt = _model_and_optimizer(guard)
    for poison in (NAN, None, NAN, None, INF):
        _backward(model, poison)
        opt.step()
    assert guard.skipped_total == 3 and len(guard.skipped_in_a_row) == 1


def test_no_gradients_is_not_a_skip():
    calls = []
    guard = NonfiniteGradGuard(1, on_step=calls.append)
    model, opt = _model_and_optimizer(guard)
    opt.step()
    assert calls == [False]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_max_consecutive_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_consecutive must be an int >= 1"):
        NonfiniteGradGuard(bad)


# -------------------------------------------------------------------------------------------- in the trainer


def _trainer(tmp_path, **overrides):
    from tests.fixtures import tiny_trainer

    return tiny_trainer(tmp_path, **overrides)  # the tiny model's default dims: hidden 128, intermediate 256


def _poison_step(trainer, steps):
    """A gradient hook making q_proj's weight gradient NaN during the optimizer steps in ``steps`` (1-based)."""
    weight = trainer.model.model.layers[0].self_attn.q_proj.weight
    weight.register_hook(lambda g: g * NAN if trainer.state.global_step + 1 in steps else g)
    return weight


@pytest.mark.slow
def test_trainer_skips_a_nan_step_and_logs_it(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(tmp_path, fp8=True, max_steps=3, logging_steps=1)
        _poison_step(trainer, {2})
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    skipped = [e["grad/nonfinite_skipped"] for e in trainer.state.log_history if "grad/nonfinite_skipped" in e]
    assert skipped == [0.0, 1.0, 0.0]
    assert any("optimizer step 2: the gradients are non-finite" in str(w.message) for w in caught)
    assert trainer.state.global_step == 3


@pytest.mark.slow
def test_trainer_stops_after_the_streak_with_the_weights_of_before(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp_path, fp8=True, max_steps=4, logging_steps=1, max_nonfinite_grad_skips=2)
        _poison_step(trainer, {2, 3, 4})
        trainer.create_optimizer()
        real_step = trainer.optimizer.step
        weights_after_step_1 = {}

        def step_and_record(*args, **kwargs):
            out = real_step(*args, **kwargs)
            if trainer.state.global_step == 0:  # optimizer step 1 just ran
                weights_after_step_1.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
            return out

        trainer.optimizer.step = step_and_record
        with pytest.raises(NonfiniteGradientsError, match=r"optimizer steps in a row.*2 \(grad norm nan\), 3 \(grad "
                                                          r"norm nan\).*FP8 is on"):
            trainer.train()
    assert weights_after_step_1 and all(torch.equal(p.detach(), weights_after_step_1[n])
                                        for n, p in trainer.model.named_parameters())


@pytest.mark.slow
def test_trainer_guard_off_applies_the_nan_step(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp_path, fp8=False, max_steps=2, logging_steps=1, max_nonfinite_grad_skips=0)
        weight = _poison_step(trainer, {2})
        try:
            trainer.train()
        except RuntimeError:
            pass  # generation may or may not reach NaN logits before the end; the weight is what is checked
    assert torch.isnan(weight).any()
    assert not any("grad/nonfinite_skipped" in e for e in trainer.state.log_history)


def test_config_field_is_checked():
    from calclip.trainers.config import CalibratedGRPOConfig

    cpu = dict(report_to="none", use_cpu=True, bf16=False, num_generations=2, per_device_train_batch_size=2)
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="max_nonfinite_grad_skips"):
            CalibratedGRPOConfig("out", max_nonfinite_grad_skips=bad, **cpu)
    assert CalibratedGRPOConfig("out", **cpu).max_nonfinite_grad_skips == 3


# -------------------------------------------------------------------------------------------- sharded (FSDP2)


def _fsdp2_worker(rank: int, port: int, out_dir: str) -> None:
    """Two gloo ranks, a model under fully_shard: a NaN in rank 0's local gradient shard only. Both ranks must skip
    the step (the norm is reduced over the mesh), else their shards would diverge."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        for block in model:
            fully_shard(block)
        fully_shard(model)
        guard = NonfiniteGradGuard(5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt.register_step_pre_hook(guard)
        skipped = []
        for poison in (False, True, False):
            model.zero_grad(set_to_none=True)
            model(torch.ones(2, 8) * (rank + 1)).square().sum().backward()
            if poison and rank == 0:
                model[0].weight.grad.to_local().view(-1)[0] = NAN
            before = [p.to_local().clone() for p in model.parameters()]
            opt.step()
            skipped.append(all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before)))
        torch.save({"skipped": skipped, "total": guard.skipped_total}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_ranks_skip_the_same_step(tmp_path):
    from tests.fixtures import spawn_workers

    spawn_workers(_fsdp2_worker, tmp_path, 2, 120, "FSDP2 grad-guard workers")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result == {"skipped": [False, True, False], "total": 1}, (rank, result)


@pytest.mark.slow
def test_trainer_guard_reuses_transformers_norm_on_finite_steps(tmp_path, monkeypatch):
    """transformers computes the gradient norm right before each optimizer step; the trainer's guard decides finite
    steps from it, and computes a norm of its own only for the non-finite one (whose message reports it)."""
    from calclip.run import grad_guard

    calls = []
    real = grad_guard._total_norm
    monkeypatch.setattr(grad_guard, "_total_norm", lambda grads: calls.append(1) or real(grads))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp_path, fp8=False, max_steps=3, logging_steps=1)
        _poison_step(trainer, {2})
        trainer.train()
    skipped = [e["grad/nonfinite_skipped"] for e in trainer.state.log_history if "grad/nonfinite_skipped" in e]
    assert skipped == [0.0, 1.0, 0.0]
    assert len(calls) == 1  # step 2 only
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_known_finite_norm_decides_without_a_second_one(monkeypatch):
    """A known finite norm applies the step without computing one; a known non-finite one is recomputed (for the
    message) and the step is skipped."""
    from calclip.run import grad_guard

    calls = []
    real = grad_guard._total_norm
    monkeypatch.setattr(grad_guard, "_total_norm", lambda grads: calls.append(1) or real(grads))
    known = [torch.tensor(1.0), NAN]
    guard = NonfiniteGradGuard(3, known_norm=lambda: known.pop(0))
    model, opt = _model_and_optimizer(guard)
    _backward(model)
    before = _snapshot(model, opt)
    opt.step()
    assert not _same(before, _snapshot(model, opt)) and calls == []
    _backward(model, poison=NAN)
    before = _snapshot(model, opt)
    opt.step()
    assert _same(before, _snapshot(model, opt)) and calls == [1] and guard.skipped_total == 1
