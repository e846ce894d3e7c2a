"""Statistics over every rank (DESIGN.md step 7): the ``all_gather`` callable a ``ClipCalibrator`` takes."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# Concatenates a 1-D tensor from every rank along dim 0, in rank order (ragged lengths allowed).
AllGather = Callable[[Tensor], Tensor]


def torch_distributed_all_gather(group=None) -> AllGather:
    """An ``all_gather`` callable for ``ClipCalibrator`` built on torch.distributed (any backend).

    Every rank must call it with a 1-D tensor (lengths may differ); each gets the concatenation in rank order.
    Lengths are exchanged first, then the tensors padded to the longest and trimmed after the gather.
    """
    import torch.distributed as dist

    def all_gather(tensor: Tensor) -> Tensor:
        if tensor.dim() != 1:
            raise ValueError(f"all_gather takes a 1-D tensor, got shape {tuple(tensor.shape)}")
        world_size = dist.get_world_size(group)
        length = torch.tensor([tensor.numel()], dtype=torch.long, device=tensor.device)
        lengths = [torch.empty_like(length) for _ in range(world_size)]
        dist.all_gather(lengths, length, group=group)
        sizes = [int(n.item()) for n in lengths]
        longest = max(sizes)
        if longest == 0:  # the same on every rank, so every rank skips the gather together
            return tensor.new_empty(0)
        padded = tensor.new_zeros(longest)
        padded[: tensor.numel()] = tensor
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(gathered, sizes)])

    return all_gather


