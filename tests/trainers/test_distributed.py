"""Two CPU processes (torch.distributed over gloo, set up by accelerate from the usual env variables) train the same
calibrated FP8 run on different data: both ranks must hold identical bounds, equal to a single-process calibration
on the concatenated tokens of both ranks (DESIGN.md step 7).

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

from calclip.testing import free_port

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

    # each rank calibrated once, on its own (different) tokens
    assert all(r["world_size"] == WORLD_SIZE for r in ranks)
    assert all(r["calibrator"]["num_calibrations"] == 1 for r in ranks)
    assert not torch.equal(tokens[0]["ratio_fp8"][:8], tokens[1]["ratio_fp8"][:8])
    # identical state on both ranks, moved from the initial bounds
    assert ranks[0]["calibrator"] == ranks[1]["calibrator"]
    assert ranks[0]["bounds"] == ranks[1]["bounds"] != [0.6, 1.8]

    # equal to one process calibrating on all ranks' tokens
    from calclip.calibration import ClipCalibrator

    single = ClipCalibrator(eps_low=0.2, eps_high=0.2, low_rails=(0.2, 1.0), high_rails=(1.0, 5.0))
    single.needs_calibration(1)
    cat = {key: torch.cat([t[key] for t in tokens]).unsqueeze(0) for key in tokens[0]}
    single.calibrate(cat["ratio_bf16"], cat["ratio_fp8"], cat["advantages"], torch.ones_like(cat["ratio_fp8"]))
    assert list(single.bounds) == pytest.approx(ranks[0]["bounds"], rel=1e-12)


def _worker(out_dir: Path) -> None:
    from calclip.testing import tiny_trainer

    warnings.simplefilter("ignore")
    trainer = tiny_trainer(out_dir / "run", num_prompts=16, disable_tqdm=True, **RUN)
    rank = trainer.accelerator.process_index

    # record this rank's calibration tokens (flattened masked tokens) before the calibrator gathers them
    calibrate = trainer.calibrator.calibrate

    def recording_calibrate(ratio_bf16, ratio_fp8, advantages, mask):
        keep = mask.bool()
        adv = advantages.unsqueeze(-1).expand_as(ratio_fp8)
        torch.save(
            {"ratio_bf16": ratio_bf16[keep].double().cpu(), "ratio_fp8": ratio_fp8[keep].double().cpu(),
             "advantages": adv[keep].double().cpu()},
            out_dir / f"rank{rank}_calibration_tokens.pt",
        )  # fmt: skip
        return calibrate(ratio_bf16, ratio_fp8, advantages, mask)

    trainer.calibrator.calibrate = recording_calibrate
    trainer.train()
    state = trainer.calibrator.state_dict()
    state.pop("config")
    result = {"world_size": trainer.accelerator.num_processes, "bounds": list(trainer.calibrator.bounds)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps({**result, "calibrator": state}))
    # Finish every rank's in-flight gloo work before the interpreter exits: exiting under it aborted a rank
    # ("terminate called without an active exception") in a loaded CI run.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
