"""One rank of a tiny calibrated FP8 ``CalibratedGRPOTrainer`` run, started by ``accelerate launch`` with one of
configs/accelerate/*.yaml (tests/trainers/test_launch_modes.py). ``python _launch_worker.py OUT_DIR`` writes
``OUT_DIR/rank{R}.pt`` with what the test checks:

- ``calls``: every calibrator call (``observe``, with this rank's own inputs, and ``commit``, with the stats and bounds
  it returned), the optimizer step and micro-batch it ran on, so the test can replay all of them on the union of
  both ranks' tokens;
- ``bounds_in_force``: calib/low and calib/high of every training micro-batch (TRL's metric lists, read before each
  log averages and clears them), and ``logged``: the values TRL logged per step;
- ``fp8_checks``: how many FP8 forwards (generation, old/shadow log-probs, training) were checked against a fresh
  FP8 layer built from the full weight of that moment (under FSDP2: the sharded parameter's ``full_tensor()``, an
  independent all-gather), and the worst mismatch. Once, between two optimizer steps, every FP8 weight is also
  changed in place without an optimizer step (on the sharded parameter under FSDP2), so a weight-code cache keyed
  on the gathered tensor's pointer/version instead of the weight's content would be caught here;
- ``generate_synced_gpus``: the ``synced_gpus`` argument of every ``generate`` call (the trainer sets it under FSDP).

accelerate 1.15 never enables FSDP on CPU (``AcceleratorState`` turns it on only for accelerator device types; on
CPU the run silently becomes DDP): with ``ACCELERATE_USE_FSDP`` set, this worker applies that one missing
assignment for the CPU (gloo) state, so accelerate's own FSDP2 preparation (``fully_shard`` per decoder layer and on
the root, from the launcher's FSDP_* variables) runs unchanged. The worker asserts that the policy's parameters
really are DTensors afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Four optimizer steps, two generation rounds (steps_per_generation 4 over gradient accumulation 2): the second
# step of each round (two micro-batches) sees a moved policy. every_step with interval 4: round 1 pools both moved
# micro-batches with their BF16 shadow and calibrates at its end; round 2 (step 3, same window) pools their FP8
# ratios and refits at its end.
RUN = dict(
    clip_mode="calibrated", fp8=True, max_steps=4, calibration_schedule="every_step", calibration_interval=4,
    per_device_train_batch_size=4, logging_steps=1,
)  # fmt: skip
WEIGHT_WRITE_STEP = 2  # after this optimizer step, every FP8 weight is scaled in place (no optimizer step)


def _enable_fsdp_on_cpu() -> None:
    """accelerate 1.15's AcceleratorState sets DistributedType.FSDP only for accelerator device types; on CPU
    (MULTI_CPU, gloo) it drops the FSDP plugin. Assign it as the accelerator branch does, nothing else."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # on the process state too: every later AcceleratorState() copies the process state's fields over its own
            PartialState._shared_state["distributed_type"] = self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


class _Fp8ForwardChecker:
    """Forward hooks on every FP8BlockLinear: the output must equal a fresh, uncached FP8 layer's output on the
    full weight of this moment. Under FSDP2 that weight comes from the sharded DTensor parameter (recorded before
    training, while the module holds it) through ``full_tensor()``; every rank runs the same forwards, so the
    all-gathers pair up. Under DDP and ZeRO-3 the module's own Parameter holds the full weight during the forward."""

    def __init__(self, model) -> None:
        from torch.distributed.tensor import DTensor

        from calclip.fp8.linear import FP8BlockLinear

        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8BlockLinear)}
        if not self.layers:
            raise AssertionError("the policy has no FP8BlockLinear layer")
        self.params = {name: (m.weight, m.bias) for name, m in self.layers.items()}
        weights = [w for w, _ in self.params.values()]
        if all(isinstance(w, DTensor) for w in weights):
            self.sharding = "fsdp2"  # DTensor shards; the full weight exists only inside the layer's forward
        elif all(hasattr(w, "ds_tensor") and w.ds_tensor.numel() < w.ds_numel for w in weights):
            self.sharding = "zero3"  # DeepSpeed partitions; param.data is gathered around each forward
        else:
            self.sharding = "none"
        self.cache_weights = sorted({m.fp8_config.cache_weights for m in self.layers.values()})
        self.num_checked = 0
        self.max_abs_diff = 0.0
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in self.layers.items()]

    @staticmethod
    def _full(param):
        from torch.distributed.tensor import DTensor

        if param is None:
            return None
        return param.full_tensor() if isinstance(param, DTensor) else param

    def _hook(self, name):
        from calclip.fp8.linear import FP8BlockLinear

        def hook(module, args, output):
            if module.bf16_shadow_depth > 0:
                return  # the BF16 shadow forward is a plain F.linear
            weight, bias = (self._full(p) for p in self.params[name])
            with torch.no_grad():
                reference = FP8BlockLinear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                                           config=replace(module.fp8_config, cache_weights=False))  # fmt: skip
                reference.weight.copy_(weight.detach())
                if bias is not None:
                    reference.bias.copy_(bias.detach())
                expected = reference(args[0].detach())
            if expected.shape != output.shape:
                raise AssertionError(f"{name}: FP8 output {tuple(output.shape)}, expected {tuple(expected.shape)}")
            self.max_abs_diff = max(self.max_abs_diff, (output.detach() - expected).abs().max().item())
            self.num_checked += 1

        return hook

    def scale_weights_in_place(self) -> None:
        """A weight change that is not an optimizer step (as a weight sync or EMA would make), on the parameter
        the training holds (the shard under FSDP2)."""
        with torch.no_grad():
            for weight, _ in self.params.values():
                # ZeRO-3 keeps this rank's partition in ds_tensor (param.data is empty outside the forward)
                (weight.ds_tensor if self.sharding == "zero3" else weight).mul_(1.001)


def main(out_dir: Path) -> None:
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        _enable_fsdp_on_cpu()
    from transformers import TrainerCallback

    from calclip.calibration import ClipCalibrator
    from tests.fixtures import tiny_trainer

    warnings.simplefilter("ignore")
    trainer = tiny_trainer(out_dir / "run", num_prompts=16, disable_tqdm=True, **RUN)
    rank = trainer.accelerator.process_index
    calibrator: ClipCalibrator = trainer.calibrator
    record: dict = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "calibrator_config": calibrator.settings,
        # one run, one output_dir lock: the rank that saves holds it, the others take none (and do not fail)
        "holds_output_dir_lock": trainer._output_dir_lock is not None,
        "init_bounds": calibrator.bounds,
        "calls": [],
        "bounds_in_force": {"calib/low": [], "calib/high": []},
        "logged": [],
    }

    micro_batch = [-1]  # index of the training micro-batch being computed
    compute_loss = trainer.compute_loss

    def counting_compute_loss(*args, **kwargs):
        if trainer.model.training:
            micro_batch[0] += 1
        return compute_loss(*args, **kwargs)

    observe, commit = calibrator.observe, calibrator.commit

    def recorded_observe(*tensors):
        record["calls"].append({
            "kind": "observe", "step": trainer.state.global_step, "micro_batch": micro_batch[0],
            "inputs": [None if t is None else t.detach().cpu().clone() for t in tensors],
        })  # fmt: skip
        return observe(*tensors)

    def recorded_commit(step=None):
        stats = commit(step)
        record["calls"].append({"kind": "commit", "step": step, "micro_batch": micro_batch[0],
                                "bounds": calibrator.bounds, "stats": dict(stats)})  # fmt: skip
        return stats

    trainer.compute_loss = counting_compute_loss
    calibrator.observe = recorded_observe
    calibrator.commit = recorded_commit

    log = trainer.log

    def recording_log(logs, *args, **kwargs):
        for name in ("calib/low", "calib/high"):
            record["bounds_in_force"][name].extend(trainer._metrics["train"].get(name, []))
        log(logs, *args, **kwargs)
        record["logged"].append({k: v for k, v in logs.items() if k.startswith("calib/")})

    trainer.log = recording_log

    checker: list[_Fp8ForwardChecker] = []

    class Fp8Check(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # accelerator.prepare has run: under FSDP2 the FP8 layers now hold DTensor shards
            checker.append(_Fp8ForwardChecker(trainer.accelerator.unwrap_model(trainer.model)))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WEIGHT_WRITE_STEP:
                checker[0].scale_weights_in_place()

    trainer.add_callback(Fp8Check())
    from transformers.generation.utils import GenerationMixin

    generate = GenerationMixin.generate
    synced_gpus_seen = []

    def recording_generate(self, *args, **kwargs):
        synced_gpus_seen.append(kwargs.get("synced_gpus"))
        return generate(self, *args, **kwargs)

    GenerationMixin.generate = recording_generate
    trainer.train()
    record["generate_synced_gpus"] = synced_gpus_seen

    record["fp8_checks"] = {
        "sharding": checker[0].sharding, "cache_weights": checker[0].cache_weights,
        "num_checked": checker[0].num_checked, "max_abs_diff": checker[0].max_abs_diff,
        "num_layers": len(checker[0].layers),
    }  # fmt: skip
    record["final_bounds"] = calibrator.bounds
    torch.save(record, out_dir / f"rank{rank}.pt")
    if rank == 0:
        print(json.dumps({k: record[k] for k in ("world_size", "distributed_type", "fp8_checks")}))
    # Let every rank's in-flight collectives finish before exit (tests/fp8/test_fsdp2.py: a gloo rank exiting
    # under pending work aborts).
    torch.distributed.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
