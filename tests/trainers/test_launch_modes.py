"""Calibrated FP8 training under ``accelerate launch`` with the shipped configs/accelerate/*.yaml, two CPU processes
over gloo (tests/trainers/_launch_worker.py is one rank).

Per mode, from one run:
(a) both ranks hold and log identical calib/low and calib/high at every micro-batch and every logged step;
(b) every calibrator update equals, bit for bit, a single-process calibrator replaying the same calls on the
    union of both ranks' tokens (rank 0's first, the all-gather's order): both moved micro-batches of a round are
    pooled, and one calibration (round 1) or refit (round 2) commits at the round's end; the bounds in force at
    each micro-batch are those of the last commit before it;
(c) every FP8 forward (generation, old and shadow log-probs, training) equals a fresh FP8 layer on the full weight of
    that moment, including after a weight change that is not an optimizer step; under FSDP2 the weights really are
    DTensor shards and the full weight comes from ``full_tensor()``, under ZeRO-3 they really are partitioned.

FSDP2 on CPU: accelerate 1.15 drops the FSDP plugin on CPU (the run silently becomes DDP); the worker restores that
one assignment so accelerate's own FSDP2 preparation runs (see its docstring). ZeRO-3 needs the optional
``deepspeed`` package (skipped without it); DeepSpeed builds its CPU shared-memory op on first use (~2 min, cached).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calclip.calibration import ClipCalibrator
from tests.fixtures import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_launch_worker.py")
sys.path.insert(0, str(WORKER.parent))
from _launch_worker import RUN  # noqa: E402

WORLD_SIZE = 2
MICRO_BATCHES = RUN["max_steps"] * 2  # tiny_training_args: gradient_accumulation_steps 2
TIMEOUT_S = 400



def _launch(mode: str, out_dir: Path) -> list[dict]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "configs/accelerate" / f"{mode}.yaml"),
        "--num_processes", str(WORLD_SIZE), "--main_process_port", str(free_port()), "--mixed_precision", "no",
        str(WORKER), str(out_dir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"accelerate launch ({mode}) failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def _union(inputs: list[list[torch.Tensor | None]]) -> tuple[torch.Tensor | None, ...]:
    """Both ranks' observe() inputs as flat [N] tensors, rank 0 first: (BF16 ratios or None, FP8 ratios,
    advantages, mask of ones)."""
    columns = []
    for ratio_bf16, ratio_fp8, advantages, mask in inputs:
        keep = mask != 0
        adv = advantages.unsqueeze(-1).expand_as(ratio_fp8) if advantages.dim() == 1 else advantages
        columns.append([None if ratio_bf16 is None else ratio_bf16[keep], ratio_fp8[keep], adv[keep]])
    flat = [None if parts[0] is None else torch.cat(parts) for parts in zip(*columns)]
    return (*flat, torch.ones(flat[1].shape, dtype=torch.bool))


def _check_one_output_dir_lock(ranks: list[dict]) -> None:
    """The rank that saves holds the run's output_dir lock; the other takes none and does not fail on it."""
    assert [rank["holds_output_dir_lock"] for rank in ranks] == [True, False]


def _check_global_bounds(ranks: list[dict]) -> None:
    r0, r1 = ranks
    assert r0["world_size"] == r1["world_size"] == WORLD_SIZE
    # (a) identical bounds in force at every micro-batch, identical logged values at every step
    assert len(r0["bounds_in_force"]["calib/low"]) == MICRO_BATCHES
    assert r0["bounds_in_force"] == r1["bounds_in_force"]
    assert len([log for log in r0["logged"] if "calib/low" in log]) == RUN["max_steps"]
    assert r0["logged"] == r1["logged"]

    # (b) one process replaying every call on the union of the tokens
    calls0, calls1 = r0["calls"], r1["calls"]
    shadow = [c["inputs"][0] is not None for c in calls0 if c["kind"] == "observe"]
    assert [c["kind"] for c in calls0] == ["observe", "observe", "commit", "observe", "observe", "commit"]
    assert shadow == [True, True, False, False]  # round 1 with the BF16 shadow, round 2 FP8 only (refit)
    config = r0["calibrator_config"]
    replay = ClipCalibrator(**config, init_low=r0["init_bounds"][0], init_high=r0["init_bounds"][1])
    for c0, c1 in zip(calls0, calls1, strict=True):
        assert (c0["kind"], c0["step"], c0["micro_batch"]) == (c1["kind"], c1["step"], c1["micro_batch"])
        if c0["kind"] == "observe":
            fp8_0, fp8_1 = c0["inputs"][1], c1["inputs"][1]  # FP8 ratios: the ranks pool different tokens
            assert fp8_0.shape != fp8_1.shape or not torch.equal(fp8_0, fp8_1)
            assert replay.needs_calibration(c0["step"]) == (c0["inputs"][0] is not None)
            replay.observe(*_union([c0["inputs"], c1["inputs"]]))
        else:
            stats = replay.commit(c0["step"])
            assert replay.bounds == c0["bounds"] == c1["bounds"]
            assert stats == c0["stats"] == c1["stats"]
    commits = [c for c in calls0 if c["kind"] == "commit"]
    assert commits[0]["stats"]["calib/fit"] == 1.0 and commits[1]["stats"]["calib/refit"] == 1.0
    assert len({c["bounds"] for c in commits} | {r0["init_bounds"]}) >= 3  # the bounds moved, more than once

    # the bounds in force at micro-batch j: the last commit before j (a commit runs after its micro-batch's loss)
    expected_low, expected_high = [], []
    for j in range(MICRO_BATCHES):
        done = [c["bounds"] for c in commits if c["micro_batch"] < j]
        low, high = done[-1] if done else r0["init_bounds"]
        expected_low.append(low)
        expected_high.append(high)
    assert r0["bounds_in_force"] == {"calib/low": expected_low, "calib/high": expected_high}


def _check_generation_synced(ranks: list[dict], synced_gpus) -> None:
    """Under FSDP every rank must keep stepping the decode loop until all ranks are done (transformers does this
    by itself for ZeRO-3), or a rank that finished early leaves the others waiting in an all-gather."""
    for rank in ranks:
        assert rank["generate_synced_gpus"] == [synced_gpus] * 2  # two generation rounds


def _check_fp8_forwards(ranks: list[dict], sharding: str, cache_weights: bool) -> None:
    for rank in ranks:
        checks = rank["fp8_checks"]
        assert checks["sharding"] == sharding
        assert checks["cache_weights"] == [cache_weights]  # the trainer turns the cache off for sharded params
        # 14 FP8 layers; generation (prompt + decode steps), old/shadow log-probs and training forwards
        assert checks["num_layers"] == 14 and checks["num_checked"] >= 14 * 20
        assert checks["max_abs_diff"] == 0.0
    assert ranks[0]["fp8_checks"]["num_checked"] == ranks[1]["fp8_checks"]["num_checked"]


@pytest.mark.slow
def test_ddp_launch(tmp_path):
    ranks = _launch("ddp", tmp_path)
    assert {r["distributed_type"] for r in ranks} == {"DistributedType.MULTI_CPU"}
    _check_global_bounds(ranks)
    _check_one_output_dir_lock(ranks)
    _check_fp8_forwards(ranks, sharding="none", cache_weights=True)
    _check_generation_synced(ranks, None)


@pytest.mark.slow
def test_fsdp2_launch(tmp_path):
    ranks = _launch("fsdp2", tmp_path)
    assert {r["distributed_type"] for r in ranks} == {"DistributedType.FSDP"}
    _check_global_bounds(ranks)
    _check_one_output_dir_lock(ranks)
    _check_fp8_forwards(ranks, sharding="fsdp2", cache_weights=False)
    _check_generation_synced(ranks, True)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed (extra 'deepspeed')")
def test_zero3_launch(tmp_path):
    ranks = _launch("zero3", tmp_path)
    assert {r["distributed_type"] for r in ranks} == {"DistributedType.DEEPSPEED"}
    _check_global_bounds(ranks)
    _check_one_output_dir_lock(ranks)
    _check_fp8_forwards(ranks, sharding="zero3", cache_weights=False)
    _check_generation_synced(ranks, None)  # transformers syncs by itself under ZeRO-3
