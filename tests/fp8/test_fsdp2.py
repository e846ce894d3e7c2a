"""FP8BlockLinear under torch's FSDP2 (``fully_shard``) on two gloo ranks: every FP8 forward computes with the
full weight gathered for that forward — never a stale code set, never the local shard.

The model is sharded the way accelerate's FSDP2 preparation does it (each block, then the root) with ragged shapes
(192 and 320 are not multiples of 128). Weights change by optimizer steps and by in-place writes to the sharded
parameters that are not optimizer steps; forwards run with and without grad. Each forward's output must equal,
bit for bit, a fresh uncached FP8 layer built from ``full_tensor()`` of the sharded parameter (an independent
all-gather). The test also proves it would catch a stale weight: whenever the weight changed since the layer's
previous forward, the FP8 output on the previous weight differs from the actual output.

Fp8Config(cache_weights=False) is what the trainer uses with sharded parameters: with the default cache the codes
are keyed on the gather buffer, whose Parameter never bumps its version and whose address often repeats, so an
in-place write to the shards can leave stale codes (a one-off probe showed it; in git history at 8843ffb).
"""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from calclip.fp8 import Fp8Config, FP8BlockLinear, quantize_model
from tests.fixtures import spawn_workers

WORLD_SIZE = 2
TIMEOUT_S = 120
SHAPES = ((192, 320), (320, 192))  # (in, out) of the two FP8 layers


class _Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.nn.functional.gelu(self.proj(x))


def _reference(weight: torch.Tensor, bias: torch.Tensor, config: Fp8Config) -> FP8BlockLinear:
    layer = FP8BlockLinear(weight.shape[1], weight.shape[0], config=replace(config, cache_weights=False))
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        torch.manual_seed(0)  # the same initial weights on both ranks, as after a broadcast
        model = nn.Sequential(*(_Block(d_in, d_out) for d_in, d_out in SHAPES))
        config = Fp8Config(cache_weights=False)
        quantize_model(model, config)
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        layers = [block.proj for block in model]
        assert all(isinstance(layer, FP8BlockLinear) for layer in layers)
        sharded = [(layer.weight, layer.bias) for layer in layers]  # held by the modules outside their forward
        assert all(isinstance(w, DTensor) and w.to_local().shape[0] == w.shape[0] // WORLD_SIZE for w, _ in sharded)

        result = {"checked": 0, "stale_would_fail": 0, "weight_changes_seen": 0, "max_abs_diff": 0.0}
        previous: dict[int, torch.Tensor] = {}

        def hook_for(index):
            def hook(module, args, output):
                weight, bias = (p.full_tensor() for p in sharded[index])
                # the weight in this forward is the gathered full one, equal to the shards right now
                assert module.weight.shape == weight.shape and torch.equal(module.weight.detach(), weight)
                x = args[0].detach()
                with torch.no_grad():
                    expected = _reference(weight, bias, config)(x)
                    if index in previous and not torch.equal(previous[index], weight):
                        result["weight_changes_seen"] += 1
                        stale = _reference(previous[index], bias, config)(x)
                        result["stale_would_fail"] += int(not torch.equal(stale, output.detach()))
                result["max_abs_diff"] = max(result["max_abs_diff"], (output.detach() - expected).abs().max().item())
                result["checked"] += 1
                previous[index] = weight

            return hook

        for index, layer in enumerate(layers):
            layer.register_forward_hook(hook_for(index))

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data, as under data parallelism

        def batch():
            return torch.randn(5, 3, SHAPES[0][0], generator=gen)

        for _ in range(2):  # optimizer steps
            model(batch()).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():  # an in-place write to the shards that is not an optimizer step
            for weight, _ in sharded:
                weight.mul_(1.01)
        with torch.no_grad():  # generation-like forwards
            model(batch())
            model(batch())
        with torch.no_grad():
            for weight, _ in sharded:
                weight.add_(0.01)
        model(batch()).square().mean().backward()
        torch.save(result, f"{out_dir}/rank{rank}.pt")
        # FSDP2's last reduce-scatter can still be in flight on gloo's worker threads; tearing the group down
        # under it aborts the process ("terminate called without an active exception", seen in CI runs).
        dist.barrier()
    finally:
        dist.destroy_process_group()



@pytest.mark.slow
def test_fsdp2_fp8_forward_uses_the_gathered_weight_of_this_step(tmp_path):
    spawn_workers(_worker, tmp_path, WORLD_SIZE, TIMEOUT_S, "FSDP2 workers")

    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # 5 forwards x 2 layers; the weights changed before forward 2 (optimizer step), 3 (optimizer step and an
        # in-place write) and 5 (an in-place write), not before forward 4
        assert result["checked"] == 10
        assert result["max_abs_diff"] == 0.0
        assert result["weight_changes_seen"] == 6
        assert result["stale_would_fail"] == result["weight_changes_seen"]
