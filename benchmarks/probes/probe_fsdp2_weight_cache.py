"""Probe: does FP8BlockLinear's weight-code cache go stale under FSDP2?

Under ``fully_shard`` the weight a layer sees in its forward is FSDP's unsharded Parameter: one object for the whole
run whose storage is all-gathered before each forward and freed after it. Its ``_version`` never changes, and the
freed buffer is often handed out again at the same address, so the cache key (weight epoch, data_ptr, _version)
repeats although the shards changed. Optimizer steps still invalidate (the weight epoch), but an in-place write to
the shards that is not an optimizer step (a weight sync, an EMA, a checkpoint load into the DTensors) can leave
stale codes. This probe counts stale forwards with the cache on and off, after such a write before every forward.

    torchrun --nproc_per_node 2 benchmarks/probes/probe_fsdp2_weight_cache.py            # CPU, gloo
    torchrun --nproc_per_node 1 benchmarks/probes/probe_fsdp2_weight_cache.py --cuda     # one GPU, NCCL

Measured 2026-12-01 on the 2-core CPU machine (torch 2.13, gloo, 2 ranks), 6 no-grad forwards: cache on, D = 2048
3 stale forwards of 6 (two runs), D = 256 0 or 2 of 6 (the address reuse varies); cache off 0 always. CUDA's caching
allocator reuses same-size blocks more predictably (not measured). The trainer turns the cache off under FSDP and
ZeRO-3.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calclip.fp8 import Fp8Config, FP8BlockLinear, quantize_model  # noqa: E402


def stale_forwards(cache_weights: bool, dim: int, device: torch.device, forwards: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)).to(device)
    config = Fp8Config(cache_weights=cache_weights)
    quantize_model(model, config)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layer = model[0]
    weight, bias = layer.weight, layer.bias  # DTensor shards
    outputs = []
    handle = layer.register_forward_hook(lambda module, args, output: outputs.append((args[0], output)))
    stale = 0
    x = torch.randn(4, dim, device=device)
    with torch.no_grad():
        for _ in range(forwards):
            weight.mul_(1.01)  # not an optimizer step
            model(x)
            inp, out = outputs.pop()
            reference = FP8BlockLinear(dim, dim, device=device, config=replace(config, cache_weights=False))
            reference.weight.copy_(weight.full_tensor())
            reference.bias.copy_(bias.full_tensor())
            stale += int(not torch.equal(reference(inp), out))
    handle.remove()
    return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--forwards", type=int, default=6)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")
    try:
        for dim in args.dims:
            counts = {cache: stale_forwards(cache, dim, device, args.forwards) for cache in (True, False)}
            if dist.get_rank() == 0:
                print(f"D={dim}: stale forwards of {args.forwards}: cache on {counts[True]}, cache off {counts[False]}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
