"""Sibling FP8 linears that read one input: one fused decode launch for q/k/v, one for gate/up.

A Llama-style decoder layer calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` and ``gate_proj(x)``,
``up_proj(x)`` on the same tensor. In eager decode each FP8BlockLinear call pays one launch's host time, so a
group (``Fp8Config.decode_group_siblings``) turns those five calls into two launches. The first member called
with a new x launches the fused decode kernel once over the members' stacked codes and keeps the other members'
outputs; their calls with the same x (same tensor object and version, same output dtype) take them without a
launch. A member called with another input computes its own, as without a group.

Codes and scales stay each member's own. The group's buffers stack the members' [N_i, K] codes at row offsets
padded to a multiple of 128, so each member's 128x128 blocks stay whole. Each member's code and scale buffers are
views into the group's, refreshed in place as before; padding rows hold zero codes and their outputs are never
read. Each output element is the same K sum as in the member's own fused call, since its sum does not depend on
the other columns. The non-finite count adds what the members' own calls would add together, all of it to the
first member's counter (``pop_nonfinite_count`` sums them).

Used only where the fused decode is (``Fp8Config.decode_fused_max_m``'s rule: eager, grad disabled, at most
that many rows). Training forwards, compiled calls and BF16 shadow forwards run each member as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from calclip.fp8.config import BLOCK, FP8_DTYPE

# Child names of one parent module whose linears read the same input in Llama, Mistral, Qwen2/3, Gemma, SmolLM2.
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingGroup:
    """The stacked code buffers of sibling FP8BlockLinears and the outputs a group launch left for the others."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.in_features = members[0].in_features
        self.offsets: list[int] = []  # each member's first row in the stacked codes, a multiple of BLOCK
        rows = 0
        for member in members:
            self.offsets.append(rows)
            rows += -(-member.out_features // BLOCK) * BLOCK
        self.rows = rows
        self.qw: Tensor | None = None  # [rows, K] e4m3fn
        self.sw: Tensor | None = None  # [rows / BLOCK, ceil(K / BLOCK)] fp32
        self.bad_members: Tensor | None = None  # int32 []: members whose weight has a non-finite block
        self._keys: tuple | None = None  # the members' weight keys bad_members was summed for
        self._pending: tuple | None = None  # (x, x._version, out_dtype, round_to, {member index: output})

    def buffers(self, index: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Member ``index``'s code and scale buffers on ``device``: views into the stacked ones (made on first use, and
        again on another device: the members move together)."""
        kb = -(-self.in_features // BLOCK)
        if self.qw is None or self.qw.device != device:
            with torch.inference_mode(False):
                self.qw = torch.zeros(self.rows, self.in_features, dtype=torch.uint8, device=device).view(FP8_DTYPE)
                self.sw = torch.ones(self.rows // BLOCK, kb, dtype=torch.float32, device=device)
            self._keys = None
            self._pending = None
        first, n = self.offsets[index], self.members[index].out_features
        return self.qw[first:first + n], self.sw[first // BLOCK:first // BLOCK + -(-n // BLOCK)]

    def _stacked(self) -> bool:
        """Whether every member's codes are still the views ``buffers`` made (nothing replaced them)."""
        if self.qw is None:
            return False
        k = self.in_features
        kb = self.sw.shape[1]
        for member, first in zip(self.members, self.offsets):
            qw, sw = member._fp8_qw, member._fp8_sw
            if (qw is None or qw.data_ptr() != self.qw.data_ptr() + first * k
                    or sw.data_ptr() != self.sw.data_ptr() + (first // BLOCK) * kb * 4):
                return False
        return True

    def decode(self, member: nn.Module, x: Tensor, x2: Tensor, kernel, *, out_dtype: torch.dtype,
               round_to: torch.dtype | None, pow2: bool) -> Tensor | None:
        """``member``'s output for x (x2: x as [M, K]) from a group launch, or None: then it runs on its own."""
        index = member._fp8_group_index
        pending = self._pending
        if (pending is not None and pending[0] is x and pending[1:4] == (x._version, out_dtype, round_to)
                and index in pending[4]):
            outputs = pending[4]
            y = outputs.pop(index)
            if not outputs:
                self._pending = None  # every sibling took its output: let x and the stacked output go
            return y
        for sibling in self.members:
            # A sharded weight (ZeRO-3 gathers each module's own parameters in its own forward) is not a whole weight
            # here: then each sibling runs alone.
            if tuple(sibling.weight.shape) != (sibling.out_features, sibling.in_features):
                return None
        for sibling in self.members:
            sibling._refresh_weight_codes()
        if not self._stacked() or self.qw.device != x2.device:
            return None
        keys = tuple(sibling._fp8_key for sibling in self.members)
        if keys != self._keys:  # a weight changed: its non-finite flag may have (once per refresh, not per call)
            self.bad_members = bad_weight_count(self.members)
            self._keys = keys
        y = kernel(x2, self.qw, self.sw, out_dtype=out_dtype, nonfinite_count=self.members[0].nonfinite_count,
                   weight_bad=self.bad_members, pow2=pow2, round_to=round_to, members=len(self.members))
        outputs = {i: y[:, first:first + sibling.out_features]
                   for i, (sibling, first) in enumerate(zip(self.members, self.offsets))}
        mine = outputs.pop(index)
        self._pending = (x, x._version, out_dtype, round_to, outputs)
        return mine


def bad_weight_count(members: list[nn.Module]) -> Tensor:
    """int32 []: how many of ``members``' weights have a non-finite block (their current ``_fp8_bad`` flags summed):
    the ``weight_bad`` of a launch that counts non-finite rows for all of them at once."""
    return torch.stack([m._fp8_bad for m in members]).sum(dtype=torch.int32)


def sibling_sets(model: nn.Module):
    """Each set of sibling FP8BlockLinears of ``model`` that read one input: the children named as in SIBLING_NAMES
    of one parent, all FP8BlockLinear, with one Fp8Config, one in_features and one weight dtype and device. Both
    groupings start here (``group_siblings``; ``shared_input.share_sibling_inputs``)."""
    from calclip.fp8.linear import FP8BlockLinear

    for parent in model.modules():
        for names in SIBLING_NAMES:
            members = [parent._modules.get(name) for name in names]
            if not all(type(m) is FP8BlockLinear for m in members):
                continue
            config = members[0].fp8_config
            if any(m.fp8_config != config for m in members):
                continue
            if len({(m.in_features, m.weight.dtype, m.weight.device) for m in members}) == 1:
                yield members


def group_siblings(model: nn.Module) -> int:
    """Group the sibling FP8BlockLinears of ``model`` (``sibling_sets``, with ``decode_group_siblings`` and
    ``cache_weights`` set, none run yet nor grouped already); returns how many groups were formed."""
    formed = 0
    for members in sibling_sets(model):
        config = members[0].fp8_config
        # cache_weights=False: sharded parameters (FSDP, ZeRO-3), whose weights are whole only inside their
        # own module's call; a group refreshes its siblings' codes in the first sibling's call.
        if not (config.decode_group_siblings and config.cache_weights):
            continue
        if any(m._fp8_group is not None or m._fp8_qw is not None for m in members):
            continue
        group = SiblingGroup(members)
        for index, member in enumerate(members):
            member._fp8_group, member._fp8_group_index = group, index
        formed += 1
    return formed
