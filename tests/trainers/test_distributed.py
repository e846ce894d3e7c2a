"""Two CPU processes (torch.distributed over gloo, set up by accelerate from the usual env variables) train the same
calibrated FP8 run on different data: both ranks must hold identical bounds, equal to a single-process calibration
on the concatenated tokens of both ranks and of every moved mini-batch of the round, in (mini-batch, rank) order
(docs/DESIGN.md steps 7 and 8).

The test launches this file as a script once per rank; ``python test_distributed.py OUT_DIR`` is the worker.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.fixtures import free_port

WORLD_SIZE = 2
RUN = dict(clip_mode="calibrated", fp8=True, max_steps=2, calibration_interval=5, per_device_train_batch_size=4)



@pytest.mark.slow
def test_two_ranks_apply_identical_global_bounds(tmp_path):
    port = free_port()
    procs = []
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE), "LOCAL_WORLD_SIZE": str(WORLD_SIZE), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    outputs = [proc.communicate(timeout=240)[0].decode(errors="replace") for proc in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"

    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    tokens = [torch.load(tmp_path / f"rank{rank}_calibration_tokens.pt") for rank in range(WORLD_SIZE)]

    # each rank pooled both moved mini-batches of the round (step 1's two micro-batches), on its own tokens, and
    # calibrated once on the pool
    assert all(r["world_size"] == WORLD_SIZE for r in ranks)
    assert all(r["calibrator"]["num_calibrations"] == 1 for r in ranks)
    assert [len(t) for t in tokens] == [2, 2]
    assert not torch.equal(tokens[0][0]["ratio_fp8"][:8], tokens[1][0]["ratio_fp8"][:8])
    # identical state on both ranks, moved from the initial bounds
    assert ranks[0]["calibrator"] == ranks[1]["calibrator"]
    assert ranks[0]["bounds"] == ranks[1]["bounds"] != [0.6, 1.8]

    # equal to one process calibrating on all ranks' tokens of both mini-batches, in (mini-batch, rank) order
    from calclip.calibration import ClipCalibrator

    single = ClipCalibrator(**ranks[0]["settings"])
    parts = [tokens[rank][batch] for batch in range(2) for rank in range(WORLD_SIZE)]
    cat = {key: torch.cat([part[key] for part in parts]).unsqueeze(0) for key in parts[0]}
    single.calibrate(cat["ratio_bf16"], cat["ratio_fp8"], cat["advantages"], torch.ones_like(cat["ratio_fp8"]))
    assert list(single.bounds) == ranks[0]["bounds"]  # bit for bit
    expected_neg = int(sum((part["advantages"] < 0).sum() for part in parts))
    assert ranks[0]["calib_neg_tokens"] == [float(expected_neg)]


def _worker(out_dir: Path) -> None:
    from tests.fixtures import tiny_trainer

    warnings.simplefilter("ignore")
    trainer = tiny_trainer(out_dir / "run", num_prompts=16, disable_tqdm=True, **RUN)
    rank = trainer.accelerator.process_index

    # record this rank's pooled tokens (flattened masked tokens with A != 0) before the calibrator gathers them
    observe, observed = trainer.calibrator.observe, []

    def recording_observe(ratio_bf16, ratio_fp8, advantages, mask):
        keep = mask.bool() & (advantages.unsqueeze(-1) != 0)
        adv = advantages.unsqueeze(-1).expand_as(ratio_fp8)
        observed.append({"ratio_bf16": ratio_bf16[keep].double().cpu(), "ratio_fp8": ratio_fp8[keep].double().cpu(),
                         "advantages": adv[keep].double().cpu()})  # fmt: skip
        return observe(ratio_bf16, ratio_fp8, advantages, mask)

    trainer.calibrator.observe = recording_observe
    trainer.train()
    torch.save(observed, out_dir / f"rank{rank}_calibration_tokens.pt")
    state = trainer.calibrator.state_dict()
    result = {"world_size": trainer.accelerator.num_processes, "bounds": list(trainer.calibrator.bounds),
              "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in trainer.calibrator.settings.items()},
              "calib_neg_tokens": [e["calib/neg_tokens"] for e in trainer.state.log_history if "calib/neg_tokens" in e]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps({**result, "calibrator": state}))
    # Finish every rank's in-flight gloo work before the interpreter exits: exiting under it aborted a rank
    # ("terminate called without an active exception") in a loaded CI run.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
