"""``bf16_shadow(model)``: run a converted model in its master-weight precision, without copying weights.

Under the context every FP8 linear (any recipe: FP8BlockLinear, TorchaoFloat8Linear) computes
``F.linear(x, weight, bias)`` from its own Parameters — bit-identical to the unconverted nn.Linear — so the
calibrator's shadow forward costs no weight memory.
Each layer holds a depth counter rather than a boolean: nested or overlapping shadows (the same model entered
twice, or a model and one of its submodules) restore correctly, also when the body raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from calclip.fp8.recipes import fp8_linear_types


@contextmanager
def bf16_shadow(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: the FP8 linears of ``model`` compute plain F.linear inside; yields ``model``."""
    types = fp8_linear_types()
    layers = [m for m in model.modules() if isinstance(m, types)]
    for layer in layers:
        layer.bf16_shadow_depth += 1
    try:
        yield model
    finally:
        for layer in layers:
            layer.bf16_shadow_depth -= 1


def in_bf16_shadow(model: nn.Module) -> bool:
    """True when any FP8 linear of ``model`` currently computes in the shadow precision."""
    types = fp8_linear_types()
    return any(isinstance(m, types) and m.bf16_shadow_depth > 0 for m in model.modules())
