"""Casting a model to a dtype the way ``from_pretrained(..., dtype=...)`` leaves it: parameters and buffers cast, the
rotary embedding's frequencies kept float32."""

from __future__ import annotations

import torch

# Buffers transformers computes in float32 whatever the model's dtype: the rotary embedding's frequencies.
FLOAT32_BUFFER_NAMES = ("inv_freq", "original_inv_freq")


def cast_model_dtype(model, dtype):
    """``model.to(dtype)`` for parameters and buffers, but the rotary embedding's ``inv_freq`` buffers stay float32,
    as ``from_pretrained(..., dtype=dtype)`` leaves them. A plain ``model.to(torch.bfloat16)`` rounds them to bf16
    (SmolLM2: 0.69784 -> 0.69922, an angle error of ~1.4 rad at position 1000), so the model computes another
    function than its checkpoint, and than vLLM, which keeps RoPE in float32. Returns the model."""
    kept = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()
            if name in FLOAT32_BUFFER_NAMES and buffer is not None and buffer.dtype == torch.float32]
    model = model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer.to(device=module._buffers[name].device)
    return model
