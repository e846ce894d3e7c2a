"""Offline fixtures for tests and benchmarks: tiny prompt datasets, a dense reward, CPU-sized configs and trainers,
process-group helpers. The tiny tokenizer and model themselves are ``calclip.models.tiny`` (re-exported here);
no module of calclip imports this one (tests/test_layout_rules.py checks it).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from unittest import mock

import torch

from calclip.models.tiny import build_tiny_model, build_tiny_tokenizer  # re-exported for tests and benchmarks


def flat_calibration_tokens(batches) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mini-batches of (ratio_bf16 [B, T], ratio_fp8 [B, T], advantages [B], mask [B, T]) as flat [N] tensors in
    arrival order, each sequence's advantage repeated over its tokens: the concatenation a calibration pool (or an
    all-gather over ranks, rank 0 first) holds, for a one-shot ``calibrate_bounds`` to compare with."""
    rb, rq, adv, mask = [], [], [], []
    for b_rb, b_rq, b_adv, b_mask in batches:
        rb.append(b_rb.reshape(-1))
        rq.append(b_rq.reshape(-1))
        adv.append(b_adv.unsqueeze(-1).expand_as(b_rb).reshape(-1))
        mask.append(b_mask.reshape(-1))
    return torch.cat(rb), torch.cat(rq), torch.cat(adv), torch.cat(mask)


def tiny_prompt_dataset(num_prompts: int = 8, *, seed: int = 0):
    """``datasets.Dataset`` of conversational arithmetic prompts with an ``answer`` column."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = (int(x) for x in torch.randint(0, 50, (2,), generator=generator))
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}=?"}], "answer": str(a + b)})
    return Dataset.from_list(rows)


def digit_share_reward(completions, **kwargs) -> list[float]:
    """Share of digit characters in each completion: a dense reward a random tiny model already spreads over
    [0, 1], so every group has non-zero advantages (a sparse exact-match reward would give all-zero groups)."""
    rewards = []
    for completion in completions:
        text = completion[0]["content"] if isinstance(completion, list) else completion
        rewards.append(sum(ch.isdigit() for ch in text) / max(len(text), 1))
    return rewards


def tiny_training_args(config_cls, output_dir, **overrides):
    """A CPU-sized config of ``config_cls`` (GRPOConfig or a calclip config): fp32, no logging backends, no
    gradient checkpointing, 4 completions per prompt, 8-token completions, a two-mini-batch generation round
    (steps_per_generation=4 over gradient_accumulation_steps=2) so that half the mini-batches see a moved policy."""
    defaults = dict(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
    )
    if "calibration_min_tokens" in getattr(config_cls, "__dataclass_fields__", {}):
        # A tiny round holds a few dozen A<0 tokens, far below a real run's minimum: fit on whatever it has, so that
        # a two-step test run calibrates (tests/calibration/test_calibration_pool.py covers the minimum itself).
        defaults["calibration_min_tokens"] = 1
    defaults.update(overrides)
    return config_cls(**defaults)


def tiny_trainer(output_dir, *, tokenizer=None, model=None, reward_funcs=None, num_prompts: int = 8,
                 train_dataset=None, eval_dataset=None, args=None, callbacks=None, **overrides):
    """A CalibratedGRPOTrainer of the tiny model (``build_tiny_model``) on ``tiny_prompt_dataset(num_prompts)``
    with ``digit_share_reward`` and ``tiny_training_args(CalibratedGRPOConfig, output_dir, **overrides)``.

    Each piece can be given instead: ``model`` (of ``tokenizer``), ``reward_funcs``, ``train_dataset`` /
    ``eval_dataset``, or ``args`` (a config built by the caller, e.g. to check the warnings its construction gives;
    then ``overrides`` must be empty)."""
    from calclip.trainers.config import CalibratedGRPOConfig  # the trainer imports TRL: only when asked for
    from calclip.trainers.grpo import CalibratedGRPOTrainer

    if args is not None and overrides:
        raise TypeError(f"tiny_trainer: give args or config overrides, not both (got {sorted(overrides)})")
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    return CalibratedGRPOTrainer(
        model=model if model is not None else build_tiny_model(tokenizer),
        reward_funcs=reward_funcs if reward_funcs is not None else digit_share_reward,
        args=args if args is not None else tiny_training_args(CalibratedGRPOConfig, output_dir, **overrides),
        train_dataset=train_dataset if train_dataset is not None else tiny_prompt_dataset(num_prompts),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def logged(trainer, key: str) -> list:
    """Every value ``trainer`` logged under ``key``, in order (its ``state.log_history``)."""
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def train_and_check(trainer, *, moved: str = "model.layers.0.self_attn.q_proj.weight") -> None:
    """``trainer.train()``, then check that parameter ``moved`` changed and every logged float is finite."""
    import math

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved in changed, f"{moved} did not change (changed: {changed[:5]}...)"
    for entry in trainer.state.log_history:
        for key, value in entry.items():
            if isinstance(value, float):
                assert math.isfinite(value), (key, value)


def _dumping_worker(rank: int, worker, port: int, out_dir: str, dump_after_s: float) -> None:
    """``worker(rank, port, out_dir)`` with every thread's Python stack written to ``out_dir/stacks-rank{R}.txt``
    after ``dump_after_s`` seconds, so a worker that hangs says where.

    A worker that returns leaves with ``os._exit(0)``, skipping the interpreter's teardown: there, libtorch's
    destructors (a TCP store's server thread, gloo's worker threads still referenced by a device mesh) run in no set
    order, and a full-suite run on the 2-core machine saw one abort with "terminate called without an active
    exception" after the worker had saved its results and torn its process group down. A worker's exception
    still reaches the parent through spawn's error file."""
    import faulthandler

    with open(os.path.join(out_dir, f"stacks-rank{rank}.txt"), "w") as stacks:
        faulthandler.dump_traceback_later(dump_after_s, file=stacks)
        try:
            worker(rank, port, out_dir)
        finally:
            faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_workers(worker, out_dir, nprocs: int, timeout_s: float, what: str) -> None:
    """Run ``worker(rank, port, out_dir)`` in ``nprocs`` processes (torch.multiprocessing.spawn, a fresh
    ``free_port()`` for their process group) and wait for them; kill them and fail the test naming ``what`` once
    ``timeout_s`` seconds have passed, with the Python stacks each worker wrote 10 s before that. A worker's
    exception is raised here by spawn."""
    import pytest
    import torch.multiprocessing as mp

    dump_after_s = max(timeout_s - 10.0, 1.0)
    with mock.patch.dict(os.environ, _loopback_gloo_env()):  # the spawned workers inherit it
        context = mp.spawn(_dumping_worker, args=(worker, free_port(), str(out_dir), dump_after_s), nprocs=nprocs,
                           join=False)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            stacks = []
            for rank in range(nprocs):
                path = os.path.join(str(out_dir), f"stacks-rank{rank}.txt")
                text = open(path).read() if os.path.exists(path) else "(no stack file)"
                stacks.append(f"--- rank {rank} ---\n{text[-6000:]}")
            pytest.fail(f"{what} did not finish within {timeout_s} s; the workers' stacks:\n" + "\n".join(stacks))


def _loopback_gloo_env() -> dict[str, str]:
    """{"GLOO_SOCKET_IFNAME": "lo"} unless it is set or there is no "lo" interface: without it gloo picks its
    interface by resolving the machine's hostname (its DNS and /etc/hosts); the test process groups need only the
    loopback."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return {} if "GLOO_SOCKET_IFNAME" in os.environ or "lo" not in names else {"GLOO_SOCKET_IFNAME": "lo"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for two-process gloo / accelerate tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def printed_under_env(variable: str, values, code: str) -> dict:
    """What ``python -c code`` prints in a fresh interpreter with ``variable`` set to each of ``values`` (None: unset),
    by value: for switches calclip reads at import (CALCLIP_ONE_BUFFER, CALCLIP_DIV_FREE)."""
    import subprocess

    seen = {}
    for value in values:
        env = {k: v for k, v in os.environ.items() if k != variable}
        if value is not None:
            env[variable] = value
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[value] = done.stdout.strip()
    return seen
