"""FP8 for the policy's linear layers: calclip's block-scaled recipe (DeepSeek-V3), and torchao's rowwise and
tensorwise recipes (``Fp8Config.recipe``). Imports only torch; Triton kernels are loaded lazily for CUDA tensors
(calclip.fp8.kernels, via quant.py / gemm.py), torchao only when a torchao recipe is converted (torchao_recipes.py)."""

from calclip.fp8.config import BLOCK, FP8_E4M3_MAX, Fp8Config, Fp8Recipe, fp8_recipe_names, get_fp8_recipe
from calclip.fp8.convert import decoder_layer_index, dequantize_model, quantize_model
from calclip.fp8.gemm import fp8_block_gemm
from calclip.fp8.linear import FP8BlockLinear
from calclip.fp8.quant import quantize_1x128, quantize_128x1, quantize_128x128
from calclip.fp8.recipes import is_fp8_linear, pop_nonfinite_count
from calclip.fp8.regional_compile import compile_repeated_blocks
from calclip.fp8.reference import dequantize_1x128, dequantize_128x1, dequantize_128x128
from calclip.fp8.shadow import bf16_shadow, in_bf16_shadow
from calclip.fp8.weight_codes import frozen_fp8_weights, invalidate_fp8_weight_caches, refresh_fp8_weights

__all__ = [
    "BLOCK", "FP8_E4M3_MAX", "Fp8Config", "Fp8Recipe", "FP8BlockLinear", "compile_repeated_blocks", "fp8_recipe_names",
    "get_fp8_recipe",
    "is_fp8_linear", "bf16_shadow", "decoder_layer_index",
    "dequantize_1x128", "dequantize_128x1", "dequantize_128x128", "dequantize_model", "fp8_block_gemm",
    "frozen_fp8_weights", "in_bf16_shadow", "invalidate_fp8_weight_caches", "pop_nonfinite_count", "quantize_1x128",
    "quantize_128x1", "quantize_128x128", "quantize_model", "refresh_fp8_weights",
]
