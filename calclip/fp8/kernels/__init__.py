"""calclip's Triton kernels for the FP8 block recipe (GPU; CPU tensors only under ``TRITON_INTERPRET=1``, in tests).

One module per concept, each kernel beside the name of the plain-torch function it must reproduce:

    launch.py        autotuning once per shape (``_Tuned``), the direct C-launcher path, the launchers' input checks
    numerics.py      ``reference.py``'s numerics contract as ``@triton.jit`` helpers (scales, codes, the e4m3fn cast)
    quantize.py      quantize_1x128 / quantize_128x1 / quantize_128x128 / requantize_128x128_
                     == the same names in ``calclip.fp8.reference`` (codes and scales exactly)
    block_gemm.py    fp8_block_gemm_triton     ~ ``calclip.fp8.gemm.emulated_block_gemm`` (fp32 summation order)
    splitk_gemm.py   fp8_splitk_gemm_triton    ~ emulated_block_gemm; the block GEMM's K step, K split for few rows
    fused_decode.py  fp8_linear_fused_quant_gemm == fp8_block_gemm_triton(*quantize_1x128(x), qw, sw) bit for bit

This package imports triton; ``calclip.fp8.quant`` imports it lazily (``quant.triton_kernels()``), on the first CUDA
tensor, so CPU machines without triton never do. The names below are the launchers the dispatchers and the layer
call; they are looked up on this package at call time.
"""

from calclip.fp8.kernels.block_gemm import fp8_block_gemm_triton
from calclip.fp8.kernels.fused_decode import fp8_linear_decode_unchecked, fp8_linear_fused_quant_gemm
from calclip.fp8.kernels.quantize import (
    quantize_1x128, quantize_128x1, quantize_128x128, requantize_128x128_,
)
from calclip.fp8.kernels.splitk_gemm import SPLITK_MAX_SPLIT, fp8_splitk_gemm_triton, sm_count, splitk_splits

__all__ = [
    "quantize_1x128",
    "quantize_128x1",
    "quantize_128x128",
    "requantize_128x128_",
    "fp8_block_gemm_triton",
    "fp8_splitk_gemm_triton",
    "fp8_linear_fused_quant_gemm",
    "fp8_linear_decode_unchecked",
    "splitk_splits",
    "sm_count",
    "SPLITK_MAX_SPLIT",
]
