"""Step 7 across real processes: two gloo ranks on CPU hold identical bounds, equal to one process's result on
the union of their tokens, with different token counts per rank (and a step where one rank has none)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from calclip.calibration import ClipCalibrator, torch_distributed_all_gather
from tests.fixtures import flat_calibration_tokens, spawn_workers

WORLD_SIZE = 2
STEPS = 6
SHAPES = {0: (3, 7), 1: (5, 4)}  # [B, T] per rank: ragged token counts on purpose
# min_tokens 15: a rank alone never has enough A<0 tokens in one step (~10 of its 20-21 tokens), both ranks together
# sometimes do and sometimes not, so the pool spans ranks and, at times, steps. Rails open, so the bounds move.
CALIBRATOR = dict(schedule="every_step", interval=2, ema=0.2, min_tokens=15, low_rails=(0.0, 1.0),
                  high_rails=(1.0, 10.0))
TIMEOUT_S = 120


def _rank_batch(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    n_seq, length = SHAPES[rank]
    rb = torch.exp(0.1 * torch.randn(n_seq, length, generator=gen))
    rq = rb * torch.exp(0.3 * torch.randn(n_seq, length, generator=gen))
    adv = torch.randn(n_seq, generator=gen)
    mask = torch.rand(n_seq, length, generator=gen) < 0.85
    if rank == 1 and step == 4:
        mask.zero_()  # this rank contributes no token at all this step
    return rb, rq, adv, mask


def _drive(cal, batch_for_step):
    """The trainer's loop: shadow calibration when due, refit otherwise. Returns bounds and stats per step."""
    trace = []
    for step in range(STEPS):
        if step == 3:
            cal.request_recalibration()
        rb, rq, adv, mask = batch_for_step(step)
        stats = cal.calibrate(rb, rq, adv, mask) if cal.needs_calibration(step) else cal.refit(rq, adv, mask)
        trace.append((cal.bounds, stats))
    return trace


def _worker(rank, port, out_dir):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        all_gather = torch_distributed_all_gather()
        # The helper itself: ragged lengths, including an empty contribution, concatenated in rank order.
        ragged = [
            all_gather(torch.arange(lengths[rank], dtype=torch.float64) + 10 * rank) for lengths in ((0, 3), (2, 5))
        ]
        cal = ClipCalibrator(all_gather=all_gather, **CALIBRATOR)
        trace = _drive(cal, lambda step: _rank_batch(rank, step))
        torch.save({"ragged": ragged, "trace": trace}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()



def _union_batch(step):
    """Both ranks' tokens as flat [N] tensors, rank 0 first: the order the all-gather concatenates in."""
    return flat_calibration_tokens([_rank_batch(rank, step) for rank in range(WORLD_SIZE)])


@pytest.mark.slow
def test_two_ranks_match_single_process_on_the_union(tmp_path):
    spawn_workers(_worker, tmp_path, WORLD_SIZE, TIMEOUT_S, "distributed calibration")

    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    expected_ragged = [torch.tensor([10.0, 11.0, 12.0], dtype=torch.float64),
                       torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0, 13.0, 14.0], dtype=torch.float64)]  # fmt: skip
    for result in results:
        for got, want in zip(result["ragged"], expected_ragged):
            assert torch.equal(got, want)

    single = _drive(ClipCalibrator(**CALIBRATOR), _union_batch)
    rank0, rank1 = results[0]["trace"], results[1]["trace"]
    assert rank0 == rank1  # identical bounds and stats on both ranks, bit for bit
    assert rank0 == single  # and equal to one process on the union of the tokens
    bounds = [b for b, _ in single]
    assert len(set(bounds)) > 3  # the bounds really moved over the run (calibrations and refits)
