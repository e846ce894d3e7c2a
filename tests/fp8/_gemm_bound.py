"""How far an FP8 block GEMM computed in fp32 may lie from the exact product of its FP8 operands: the bound the
kernel tests use where two kernels sum in different orders (so bit equality is not a property of the math).

The kernels (``calclip.fp8.kernels``) compute, per output and per 128-wide K block,
``acc += dot(codes_x, codes_w) * (sx * sw)`` and round ``acc`` once to the output dtype. Along the path of any
one product x_k w_k:

- the product of two e4m3 codes (4 significant bits each) is exact in fp32;
- the block's dot adds at most BLOCK - 1 times (in whatever order or tree the BLAS or the MMA uses);
- the scale product ``sx * sw`` and its multiply round once each;
- the accumulator adds once per K block: ceil(K / BLOCK) times (a split-K reduction only regroups these).

So every product passes through at most n = BLOCK - 1 + 2 + ceil(K / BLOCK) fp32 roundings, and the classic
summation bound (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 3.1 and 4.2) holds for
every order: |fl(y) - y| <= gamma_n * sum_k |x_k w_k|, gamma_n = n u / (1 - n u), u = 2**-24. It scales with
sum |x_k w_k| of that output, so it is tight: an FP8 code one step off (a 2**-4 relative change of one product)
breaks it by orders of magnitude. The exact y and sum |x_k w_k| are computed in float64 from codes and scales
(dequantizing in fp32 would itself round); float64's own error (~K 2**-53 relative) is covered by ``SLACK``.

The output's rounding comes on top: fp32 none; bf16/fp16 one unit of the last place of |y| when the conversion
truncates (Triton's interpreter) or half of one when it rounds to nearest (GPUs, torch).
"""

from __future__ import annotations

import torch

from calclip.fp8 import reference as ref
from calclip.fp8.config import BLOCK

FP32_UNIT_ROUNDOFF = 2.0**-24
SLACK = 1.0 + 1e-6  # float64 reference's own rounding (~1e-13 relative), with room to spare
# One unit in the last place, relative to the value (significand bits - 1), and the absolute spacing of
# subnormals (fp16 outputs below 6e-5 round on an absolute grid).
OUTPUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
OUTPUT_SUBNORMAL_STEP = {torch.float32: 0.0, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}


def fp32_roundings(k: int) -> int:
    """The most fp32 roundings any product x_k w_k passes through on its way into one output (see above)."""
    return BLOCK - 1 + 2 + -(-k // BLOCK)


def exact_products(qx, sx, qw, sw) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, sum_k |x_k w_k|) in float64 [M, N] from 1x128 codes/scales of x [M, K] and 128x128 ones of W [N, K]."""
    k = qx.shape[-1]
    xd = qx.cpu().double() * sx.cpu().double().repeat_interleave(BLOCK, dim=-1)[..., :k]
    n = qw.shape[0]
    sw_full = sw.cpu().double().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    wd = qw.cpu().double() * sw_full
    return xd @ wd.t(), xd.abs() @ wd.abs().t()


def exact_linear(x, qw, sw, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``exact_products`` of x quantized by the torch reference quantizer (the codes the kernels must produce)."""
    qx, sx = ref.quantize_1x128(x.reshape(-1, x.shape[-1]).float().cpu(), pow2=pow2)
    return exact_products(qx, sx, qw, sw)


def gemm_bound(abs_sum: torch.Tensor, y_abs: torch.Tensor, k: int, out_dtype: torch.dtype, *,
               truncating: bool, extra_rtol: float = 0.0) -> torch.Tensor:
    """Largest |y_kernel - y| allowed: gamma_n sum |x_k w_k| (plus ``extra_rtol`` of it, e.g. a GPU MMA's reduced
    block-sum precision), then the output rounding of a value up to |y| + that."""
    n = fp32_roundings(k)
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    accumulation = (gamma + extra_rtol) * abs_sum
    share = 1.0 if truncating else 0.5
    rounding = share * (OUTPUT_ULP[out_dtype] * (y_abs + accumulation) + OUTPUT_SUBNORMAL_STEP[out_dtype])
    return (accumulation + rounding) * SLACK


def assert_within_bound(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str = "y") -> None:
    """Non-finite outputs exactly where the float64 reference has them (same NaNs, same signed infinities), and
    every finite output within ``bound`` of it."""
    y = y.reshape(exact.shape).double().cpu()
    assert torch.equal(y.isnan(), exact.isnan()), f"{what}: NaNs at other places than the float64 reference's"
    assert torch.equal(y.isinf(), exact.isinf()) and torch.equal(y[y.isinf()], exact[exact.isinf()]), \
        f"{what}: infinities at other places than the float64 reference's"
    finite = exact.isfinite()
    err, allowed = (y - exact).abs()[finite], bound.reshape(exact.shape)[finite]
    worst = float((err / allowed.clamp_min(1e-300)).max()) if err.numel() else 0.0
    assert bool((err <= allowed).all()), f"{what}: worst |error| / bound {worst:.3g} (fp32 accumulation bound)"
