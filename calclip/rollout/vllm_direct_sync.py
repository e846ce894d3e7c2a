"""Weight sync into a colocated vLLM engine by in-place copies, once the engine's layout has been checked.

vLLM's supported way to update a block-FP8 engine is its layerwise reload (``vllm_sync.reload_weights_layerwise``):
every layer is put back into its ``create_weights`` layout, loaded by its own weight loaders, post-processed again
and copied into the storage its CUDA graphs read. On the H200 that cost several times TRL's per-tensor BF16 sync,
a visible share of a GRPO step (docs/vllm.md has the measurement).

On the engine this sync targets (block-FP8 on CUTLASS, Hopper, one tensor-parallel rank) the post-processing leaves
each tensor as loaded: a fused layer's ``weight`` (e4m3 codes) and ``weight_scale_inv`` (fp32 block scales) are its
shards stacked along dim 0 in vLLM's packed order (q, k, v; gate, up), every other tensor sits under its own name
(a vocabulary table possibly padded with extra rows). So after the first sync, which goes through the reload,
``DirectSync.verify`` compares the engine's parameters with a second pass of the same stream, byte for byte, under
that layout. Only if every tensor sits exactly where the layout says, with its dtype, its trailing shape and its
bits, are the later syncs done by ``DirectSync.copy``: one in-place ``copy_`` per tensor into the same storage (the
CUDA graphs stay valid, as with the reload). Any difference (another kernel's layout, UE8M0 re-quantized scales,
tensor parallelism, another architecture's names) keeps the reload, and the reason is kept in ``DirectSync.reason``.

The per-channel engine of the rowwise / tensorwise recipes (vLLM's ``CompressedTensorsW8A8Fp8`` on CUTLASS) holds
``weight_scale`` [N, 1] as loaded and its ``weight`` as the loaded [N, K] storage seen transposed (``weight.t()``, the
[K, N] operand CUTLASS reads, no copy). An FP8 ``weight`` whose storage is row-major only when transposed (not
contiguous, its transpose contiguous) is therefore compared and written through that transpose: the same bytes,
rows in the checkpoint's orientation (``rows_view``). Scales are always compared as the engine indexes them (a
kernel may keep a scale column-major and still index it [N, ...]). Any other layout fails the check and the
reload stays.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

# the integer dtype of each element size: bytes are compared through it (NaN-safe, no float compare)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint-format tensor lives in the engine: ``target`` parameter, rows from ``start``."""

    target: str
    start: int


def engine_name(name: str, packed_modules: Mapping[str, tuple[str, ...]]) -> tuple[str, str | None, int]:
    """vLLM's parameter name for checkpoint tensor ``name``, the fused layer it is a shard of (None: not a shard) and
    its index among that layer's shards (``packed_modules``: fused name -> shard names in vLLM's order):
    ``model.layers.0.self_attn.k_proj.weight`` -> ``(model.layers.0.self_attn.qkv_proj.weight, "qkv_proj", 1)``."""
    module, _, leaf = name.rpartition(".")
    parent, _, short = module.rpartition(".")
    for fused, shards in packed_modules.items():
        if short in shards:
            return (f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}"), fused, shards.index(short)
    return name, None, 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def rows_view(param: torch.Tensor) -> torch.Tensor:
    """``param`` in the checkpoint's orientation: itself, or for a 2-D FP8 weight that is the transpose of a row-major
    storage (vLLM's per-channel FP8 ``weight``: the loaded [N, K] tensor kept as its [K, N] view) that storage's
    [N, K] view. Same memory either way, so a copy into it updates what the engine reads."""
    if (param.dtype == torch.float8_e4m3fn and param.dim() == 2 and not param.is_contiguous()
            and param.t().is_contiguous()):
        return param.t()
    return param


class DirectSync:
    """Decides once, after a sync through vLLM's reload, whether later syncs may copy in place (module docstring).

    ``verified``: the copies are on; ``reason``: why not, after a check that failed (None before any check).
    """

    def __init__(self, packed_modules: Mapping[str, tuple[str, ...]]) -> None:
        self.packed_modules = packed_modules
        self.slots: dict[str, Slot] | None = None
        self.verified = False
        self.reason: str | None = None

    @property
    def checked(self) -> bool:
        return self.verified or self.reason is not None

    def verify(self, params: Mapping[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Compare ``params`` (the engine model's ``named_parameters()``, just loaded by vLLM from the same weights)
        with ``named_tensors`` (a second pass of the sync stream) under that layout (module docstring), one tensor
        at a time (a shard waits only until the shards before it in the fused order have passed: in HF's parameter
        order, never). Sets and returns ``verified``; on a difference, ``reason`` names the first tensor and how."""
        self.slots, self.verified, self.reason = None, False, None
        slots: dict[str, Slot] = {}
        fused_rows: dict[str, tuple[str, list[int | None]]] = {}  # target -> (fused name, rows of each shard seen)
        waiting: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}

        def place(name: str, tensor: torch.Tensor, slot: Slot) -> bool:
            problem = self._problem(params.get(slot.target), slot, tensor)
            if problem is not None:
                self.reason = f"{name} -> {slot.target}: {problem}"
                return False
            slots[name] = slot
            return True

        for name, tensor in named_tensors:
            target, fused, index = engine_name(name, self.packed_modules)
            if fused is None:
                if not place(name, tensor, Slot(name, 0)):
                    return False
                continue
            rows = fused_rows.setdefault(target, (fused, [None] * len(self.packed_modules[fused])))[1]
            pending = waiting.setdefault(target, {})
            pending[index] = (name, tensor)
            while True:  # place every shard whose predecessors have all been seen
                ready = [i for i in pending if all(r is not None for r in rows[:i])]
                if not ready:
                    break
                i = ready[0]
                shard_name, shard = pending.pop(i)
                if not place(shard_name, shard, Slot(target, sum(rows[:i]))):  # (a 0-d shard fails there too)
                    return False
                rows[i] = shard.shape[0]
        for target, (fused, rows) in fused_rows.items():
            if any(r is None for r in rows):
                missing = [s for s, r in zip(self.packed_modules[fused], rows) if r is None]
                self.reason = f"{target}: shards {missing} are not in the sync"
                return False
            total = rows_view(params[target]).shape[0]
            if sum(rows) != total:  # all shards, no rows of another rank or layout
                self.reason = f"{target}: its shards fill {sum(rows)} of {total} rows"
                return False
        self.slots, self.verified = slots, True
        return True

    @staticmethod
    def _problem(param: torch.Tensor | None, slot: Slot, tensor: torch.Tensor) -> str | None:
        if param is None:
            return "no such engine parameter"
        param = rows_view(param)
        if param.dtype != tensor.dtype:
            return f"engine dtype {param.dtype}, sync dtype {tensor.dtype}"
        if tensor.dim() == 0 or param.dim() != tensor.dim() or param.shape[1:] != tensor.shape[1:]:
            return f"engine shape {tuple(param.shape)}, sync shape {tuple(tensor.shape)}"
        if slot.start + tensor.shape[0] > param.shape[0]:
            return f"rows {slot.start}..{slot.start + tensor.shape[0]} past the engine's {param.shape[0]}"
        held = param.detach()[slot.start:slot.start + tensor.shape[0]]
        if not torch.equal(_bits(held), _bits(tensor.detach().to(held.device))):
            return "the engine holds other values than the ones just synced (another layout or re-quantization)"
        return None

    def copy(self, params: Mapping[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every tensor of a sync into its slot, in place. Only after ``verify`` succeeded; a tensor the
        verified sync did not hold raises (the engine must not serve a half-updated model silently)."""
        if not self.verified or self.slots is None:
            raise RuntimeError("DirectSync.copy before a successful verify")
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                slot = self.slots.get(name)
                if slot is None:
                    raise RuntimeError(f"{name} was not in the sync that verified the engine's layout; the engine now "
                                       "holds a partial update")
                rows = rows_view(params[slot.target].data)
                rows[slot.start:slot.start + tensor.shape[0]].copy_(tensor, non_blocking=True)
                count += 1
        return count
