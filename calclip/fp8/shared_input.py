"""Sibling FP8 linears that read one input quantize it once: q/k/v, and gate/up (``Fp8Config.share_sibling_inputs``).

A Llama-style decoder layer calls ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` and ``gate_proj(x)``, ``up_proj(x)`` on
the same tensor, and each FP8BlockLinear quantized that x itself: 1x128 for its forward GEMM, 128x1 for its weight
gradient, and saved its own copy of the 128x1 codes for backward. Grouped, the first member called with a new x
quantizes it once (both layouts; the non-finite count of all members, one launch) and the others, called with the
same x, take those codes: per layer 3 of the 7 input quantizations and 3 of the 7 saved 128x1 copies go away. Each
member's GEMMs, backward and gradients are what they were, bit for bit: the codes are the same.

Same x means the same tensor object, in the same dtype (after autocast) and grad mode, and in eager calls the same
autograd version (an in-place change between the calls makes the next member quantize again). Under torch.compile
the group's bookkeeping is traced like the rest of the layer (no graph break): the first member records
``calclip::fp8_quantize_input``, every member ``calclip::fp8_linear_forward_codes``; the version is not checked there
(an in-place change of a traced input between two sibling calls would be in the graph itself; no model calls them so).

The non-finite count adds what the members' own calls would add together, all of it to the member that quantized
(``pop_nonfinite_count`` sums them). Used for forwards that do not take the fused decode (training, and no-grad
forwards of many rows such as the old log-probs); decode keeps ``decode_group_siblings``. Not formed where weights are
sharded (``cache_weights=False``) or for ``backward="bf16"``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from calclip.fp8.linear_math import _quantize_input
from calclip.fp8.siblings import bad_weight_count, sibling_sets


class SharedInput:
    """The members of one group and the quantized input the first of them left for the others."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        # (x, (dtype, grad mode), x._version or None when compiled, members still to take it, codes)
        self._pending: tuple | None = None
        self._bad: Tensor | None = None  # int32 []: how many members' weights have a non-finite block (eager)
        self._bad_keys: tuple | None = None  # the members' weight keys _bad was summed for

    def codes(self, member: nn.Module, x: Tensor, x2: Tensor, *, compiled: bool) -> tuple[Tensor, ...]:
        """``member``'s quantized input: (qx, sx, qxt, sxt) quantized by a sibling for this x, or by this call (then
        left for the others). x: the tensor the caller passed (the key); x2: it as [M, K], in the compute dtype.
        qxt/sxt are None (eager) or empty (compiled) when no member's weight needs a gradient."""
        index = member._fp8_share_index
        key = (x2.dtype, torch.is_grad_enabled())
        pending = self._pending
        if (pending is not None and pending[0] is x and pending[1] == key and index in pending[3]
                and (compiled or pending[2] == x._version)):
            waiting = pending[3]
            waiting.discard(index)
            if not waiting:
                self._pending = None  # every member took the codes: let x and them go
            return pending[4]
        cfg = member.fp8_config
        need_t = key[1] and any(m.weight.requires_grad for m in self.members)
        if compiled:  # the root's pre-hook refreshed every member's codes before the graph
            bad = bad_weight_count(self.members)
            # detached: the codes carry no gradient (each member's fp8_linear_forward_codes routes x2's)
            *codes, count = torch.ops.calclip.fp8_quantize_input(x2.detach(), bad, len(self.members), need_t,
                                                                 cfg.power_of_two_scales, cfg.gemm, cfg.row_scales)
            member.nonfinite_count.add_(count)
        else:
            with torch.no_grad():
                codes = _quantize_input(x2, self._bad_weights(), member.nonfinite_count, need_t,
                                        cfg.power_of_two_scales, len(self.members),
                                        gemm=cfg.gemm, row_scales=cfg.row_scales)
        codes = tuple(codes)
        others = {i for i in range(len(self.members)) if i != index}
        # a group of one (down_proj, which its fused producer feeds: calclip.fp8.producers) leaves nothing pending:
        # no x or codes kept past the call, and the same state for a compiled call's guards every time
        self._pending = (x, key, None if compiled else x._version, others, codes) if others else None
        return codes

    def offer(self, x: Tensor, codes: tuple, *, compiled: bool) -> None:
        """Register ``codes`` (qx, sx, qxt, sxt, laid out and counted as ``codes`` makes them) as every member's
        quantized x: the producer of x quantized it (calclip.fp8.producers), so no member quantizes it again."""
        key = (x.dtype, torch.is_grad_enabled())
        self._pending = (x, key, None if compiled else x._version, set(range(len(self.members))), tuple(codes))

    def _bad_weights(self) -> Tensor:
        """int32 []: the members' weights with a non-finite block, with every member's codes brought up to date
        (summed again only when a weight changed: once per refresh, not per call)."""
        for m in self.members:
            m._refresh_weight_codes()
        keys = tuple(m._fp8_key for m in self.members)
        if keys != self._bad_keys or self._bad is None:
            with torch.inference_mode(False), torch.no_grad():
                self._bad = bad_weight_count(self.members)
            self._bad_keys = keys
        return self._bad


def share_sibling_inputs(model: nn.Module) -> int:
    """Group the sibling FP8BlockLinears of ``model`` that read one input (``siblings.sibling_sets``, with
    ``share_sibling_inputs``, ``cache_weights`` and backward "fp8", none grouped already); returns how many groups
    were formed. ``cache_weights=False`` (sharded parameters) stays ungrouped: the first member's call refreshes every
    member's codes, whose weights are whole only inside their own call there."""
    formed = 0
    for members in sibling_sets(model):
        config = members[0].fp8_config
        if not (config.share_sibling_inputs and config.cache_weights and config.backward == "fp8"):
            continue
        if any(m._fp8_share is not None for m in members):
            continue
        group = SharedInput(members)
        for index, member in enumerate(members):
            member._fp8_share, member._fp8_share_index = group, index
        formed += 1
    return formed
