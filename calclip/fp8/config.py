"""FP8 block-recipe constants and the one configuration object of ``calclip.fp8``.

``Fp8Config`` follows torchao's float8 config: a frozen dataclass whose ``__post_init__`` validates every
field with a message naming the field and the allowed values. It is plain data: ``calclip.fp8`` never reads
a trainer config, the trainer builds an ``Fp8Config`` from its own fields.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

# Largest finite float8_e4m3fn value (448). Named, never written as a literal.
FP8_E4M3_MAX: float = torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPE = torch.float8_e4m3fn
# DeepSeek-V3 block size: 1x128 groups for activations/gradients, 128x128 blocks for weights.
BLOCK: int = 128

BACKWARD_MODES = ("fp8", "bf16")
GEMM_BACKENDS = ("auto", "scaled_mm", "triton", "emulated")


@dataclass(frozen=True)
class Fp8Config:
    """How linear layers are quantized and which ones stay in BF16.

    block_size: quantization block edge (1 x block_size groups, block_size x block_size weight blocks).
        Only 128 is supported by the GPU kernels; the CPU reference accepts any positive size.
    power_of_two_scales: round every scale UP to a power of two (exact scaling, nothing saturates).
    backward: "fp8" (DeepSeek-V3: dgrad and wgrad GEMMs in FP8) or "bf16" (straight-through: BF16
        matmuls against the dequantized weight and the unquantized activations).
    gemm: "auto" | "scaled_mm" | "triton" | "emulated" (see ``calclip.fp8.gemm``).
    keep_first_n_layers / keep_last_n_layers: decoder layers (``...layers.<i>.``) kept in BF16, counted in each
        layer stack separately (a vision tower's blocks and the language model's layers each keep their own).
    keep_last_fraction: share in [0, 1) of the last decoder layers kept in BF16 (rounded up).
    keep_patterns: regexes (``re.search`` on the fully qualified module name) of layers kept in BF16.
    cache_weights: keep the quantized weight between calls until the weight changes. Turn it off when the
        parameters are sharded (FSDP, ZeRO-3): the forward's weight is a fresh all-gather whose buffer key does
        not follow the shards (the trainer does this itself; docs/usage.md, Multi-GPU).
    fused_quantizer: quantize x (forward) and dy (backward) 1x128 and 128x1 in one fused kernel that reads the
        tensor once. Off by default: on the H200 the fused kernel reached 25% of copy bandwidth (its exact
        divisions dominate) and the layer ran 1.11x BF16 against 1.23x with the two separate kernels at
        M=8192, K=4096, N=14336 (docs/benchmarks.md). Same codes either way.
    """

    block_size: int = BLOCK
    power_of_two_scales: bool = False
    backward: str = "fp8"
    gemm: str = "auto"
    keep_first_n_layers: int = 0
    keep_last_n_layers: int = 0
    keep_last_fraction: float = 0.0
    keep_patterns: tuple[str, ...] = ("lm_head",)
    cache_weights: bool = True
    fused_quantizer: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"Fp8Config.block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.power_of_two_scales, bool):
            raise ValueError(f"Fp8Config.power_of_two_scales must be a bool, got {self.power_of_two_scales!r}")
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"Fp8Config.backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
        if self.gemm not in GEMM_BACKENDS:
            raise ValueError(f"Fp8Config.gemm must be one of {GEMM_BACKENDS}, got {self.gemm!r}")
        for name in ("keep_first_n_layers", "keep_last_n_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Fp8Config.{name} must be an int >= 0, got {value!r}")
        frac = self.keep_last_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not (0.0 <= frac < 1.0) or math.isnan(frac):
            raise ValueError(f"Fp8Config.keep_last_fraction must be a float in [0, 1), got {frac!r}")
        patterns = self.keep_patterns
        if isinstance(patterns, str):
            # A bare string would be iterated character by character: almost surely a mistake.
            raise ValueError(f"Fp8Config.keep_patterns must be a sequence of regexes, not a str: {patterns!r}")
        patterns = tuple(patterns)
        for pattern in patterns:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ValueError(f"Fp8Config.keep_patterns: invalid regex {pattern!r}: {err}") from None
        object.__setattr__(self, "keep_patterns", patterns)  # lists from YAML become a hashable tuple
        for name in ("cache_weights", "fused_quantizer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Fp8Config.{name} must be a bool, got {getattr(self, name)!r}")
