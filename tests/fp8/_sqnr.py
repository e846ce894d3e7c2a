"""Signal-to-quantization-noise ratio, the accuracy measure the FP8 tests put floors on (one definition for all).

    SQNR(ref, got) = 10 log10( sum ref^2 / sum (ref - got)^2 )   in dB, computed in float64

An exact match gives a large finite number (the error sum is clamped at 1e-300), never inf or NaN, so a floor
``sqnr_db(...) >= F`` passes for it.
"""

import torch


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-300))).item()
