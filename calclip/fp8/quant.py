"""Quantizer dispatch: Triton kernels for CUDA tensors when they are importable, else the torch reference.

Both implementations follow the numerics of ``calclip.fp8.reference`` (module docstring there), so callers do
not care which one ran. ``calclip.fp8.kernels`` is imported lazily, on the first CUDA tensor, so CPU machines
without triton never import it; a missing or broken package falls back to the reference, with one warning.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch
from torch import Tensor

from calclip.fp8 import reference
from calclip.fp8.config import BLOCK

_UNSET = object()
_triton_module: object = _UNSET


def triton_kernels() -> ModuleType | None:
    """The ``calclip.fp8.kernels`` package, or None when it (or triton) cannot be imported. Only called for tensors
    the kernels would serve (CUDA, or CPU under TRITON_INTERPRET=1), so a failed import means those tensors run the
    torch reference, a far slower path: said once, as a warning naming the import error."""
    global _triton_module
    if _triton_module is _UNSET:
        try:
            from calclip.fp8 import kernels as module
        except ImportError as err:  # no triton on this machine, one too old (no triton.knobs), or a broken install
            module = None
            warnings.warn(f"calclip.fp8: the Triton kernels cannot be imported ({type(err).__name__}: {err}); FP8 "
                          "quantizers and GEMMs on CUDA fall back to the torch reference, which is correct but far "
                          'slower. Install the gpu extra (pip install "calclip[gpu]": triton>=3.4).',
                          RuntimeWarning, stacklevel=2)
        _triton_module = module
    return _triton_module  # type: ignore[return-value]


QUANTIZER_NAMES = ("quantize_1x128", "quantize_128x1", "quantize_128x128", "requantize_128x128_")
# (device type, block) -> {quantizer name: its Triton kernel, or None where the torch reference serves it}
_kernel_tables: dict[tuple[str, int], dict[str, object]] = {}


def kernel_table(device_type: str, block: int) -> dict[str, object]:
    """Which implementation serves each quantizer (``QUANTIZER_NAMES``) for tensors of ``device_type`` at ``block``:
    the Triton kernel, or None for the torch reference. Chosen on the first call per (device type, block) and kept,
    so a call does one dict lookup instead of re-deciding (and the kernels' import is tried once)."""
    key = (device_type, block)
    table = _kernel_tables.get(key)
    if table is None:
        module = triton_kernels() if device_type == "cuda" and block == BLOCK else None
        table = _kernel_tables[key] = {name: getattr(module, name, None) if module is not None else None
                                       for name in QUANTIZER_NAMES}
    return table


def _triton_impl(x: Tensor, name: str, block: int):
    """calclip.fp8.kernels' ``name`` for a CUDA ``x`` at the kernels' block size, or None."""
    return kernel_table(x.device.type, block)[name]


def _impl(x: Tensor, name: str, block: int):
    return _triton_impl(x, name, block) or getattr(reference, name)


def _call(x: Tensor, name: str, block: int, pow2: bool, gemm_layout: bool) -> tuple[Tensor, ...]:
    fn = _impl(x, name, block)
    if fn is not getattr(reference, name):
        return fn(x, block=block, pow2=pow2, gemm_layout=gemm_layout)
    out = fn(x, block=block, pow2=pow2)
    return _to_gemm_layout(name, out, block) if gemm_layout else out


def _to_gemm_layout(name: str, out: tuple[Tensor, ...], block: int = BLOCK) -> tuple[Tensor, ...]:
    """Reference outputs re-laid out as the kernels' ``gemm_layout=True`` gives them (values unchanged):
    1x128 scales column-major, 128x1 scales row-major, 128x1 codes padded to ``reference.wgrad_rows`` token rows."""
    def col_major(s: Tensor) -> Tensor:
        return s.t().contiguous().t() if s.dim() == 2 else s

    if name == "quantize_1x128":
        return out[0], col_major(out[1])
    if name == "quantize_128x1":
        return reference.pad_128x1_codes(out[0], block=block), out[1].contiguous()
    return out[0], col_major(out[1]), reference.pad_128x1_codes(out[2], block=block), out[3].contiguous()


def quantize_1x128(x: Tensor, *, block: int = BLOCK, pow2: bool = False, gemm_layout: bool = False,
                   nonfinite_count: Tensor | None = None, weight_bad: Tensor | None = None,
                   members: int = 1, out_rows=None) -> tuple[Tensor, Tensor]:
    """[..., K] -> (q e4m3fn [..., K], s fp32 [..., ceil(K/block)]); groups along the last dim.
    ``gemm_layout``: s column-major (2-D x), the layout torch._scaled_mm reads; same values.
    ``nonfinite_count`` (int64 [], x's device): += the number of rows with a non-finite group, or every row
    when ``weight_bad`` (bool []) is set; counted inside the Triton kernel on CUDA (no extra launch, no sync),
    from the scales by torch ops otherwise. ``members`` > 1: the count of that many linears reading x, with
    ``weight_bad`` an int32 [] number of bad weights among them (``add_nonfinite_rows``).
    ``out_rows``: a 2-D x [M, K] quantized over out_rows >= M rows, those past M zero tokens
    (``reference.check_out_rows``): the operand torch._scaled_mm takes for a ragged M (``gemm.scaled_mm_rows``),
    written by the quantizer itself; the count covers x's rows only."""
    fn = _impl(x, "quantize_1x128", block)
    if fn is not reference.quantize_1x128:
        return fn(x, block=block, pow2=pow2, gemm_layout=gemm_layout, nonfinite_count=nonfinite_count,
                  weight_bad=weight_bad, members=members, out_rows=out_rows)
    padded = x if out_rows is None else reference.zero_rows_appended(x, out_rows, "quantize_1x128")
    q, s = fn(padded, block=block, pow2=pow2)
    if gemm_layout:
        q, s = _to_gemm_layout("quantize_1x128", (q, s), block)
    if nonfinite_count is not None:  # x's own rows, not the zero tokens
        add_nonfinite_rows(nonfinite_count, s if out_rows is None else s.narrow(0, 0, x.shape[0]), weight_bad, members)
    return q, s


def add_nonfinite_rows(nonfinite_count: Tensor, s: Tensor, weight_bad: Tensor | None, members: int = 1) -> None:
    """nonfinite_count += rows of the 1x128 scales ``s`` [..., NB] holding a NaN (every row if weight_bad).
    ``members`` > 1: x feeds that many linears and ``weight_bad`` (int32 []) counts their bad weights: every row
    per bad weight plus the NaN rows per healthy one, what the linears' own calls would add together."""
    rows = s.numel() // s.shape[-1] if s.dim() and s.shape[-1] else 0
    bad_rows = torch.isnan(s).any(dim=-1).sum() if rows else torch.zeros((), dtype=torch.int64, device=s.device)
    if weight_bad is not None:  # one rule for a bool flag (members 1) and a count of bad weights, as in the kernel
        bad_weights = weight_bad.to(torch.int64)
        bad_rows = bad_weights * rows + (members - bad_weights) * bad_rows
    elif members > 1:
        bad_rows = members * bad_rows
    nonfinite_count.add_(bad_rows)


def quantize_128x1(x: Tensor, *, block: int = BLOCK, pow2: bool = False,
                   gemm_layout: bool = False) -> tuple[Tensor, Tensor]:
    """[M, K] -> (q e4m3fn [M, K], s fp32 [ceil(M/block), K]); groups along dim 0 (the token axis).
    ``gemm_layout``: s row-major, so the wgrad GEMM's s.t() is the column-major scale it reads, and q padded with
    zero codes to [reference.wgrad_rows(M), K] (the GEMM contracts over whole token groups); same values."""
    return _call(x, "quantize_128x1", block, pow2, gemm_layout)  # type: ignore[return-value]


def quantize_128x128(w: Tensor, *, block: int = BLOCK, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """[N, K] -> (q e4m3fn [N, K], s fp32 [ceil(N/block), ceil(K/block)]); square tiles."""
    return _impl(w, "quantize_128x128", block)(w, block=block, pow2=pow2)


def weight_has_nonfinite_block(w: Tensor) -> Tensor:
    """bool []: whether ``quantize_128x128(w)`` gives a NaN scale, i.e. w holds a NaN or an Inf once in fp32
    (reference.py, numerics 1 and 6), without making the codes: the flag a layer keeps when it keeps no codes. One
    reduction over w (its largest magnitude, NaN-propagating), no temporary of w's size."""
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=w.device)
    return ~torch.isfinite(torch.linalg.vector_norm(w.float() if w.dtype == torch.float64 else w, float("inf")))


def requantize_128x128_(w: Tensor, q: Tensor, s: Tensor, bad: Tensor, *,
                        transposed: tuple[Tensor, Tensor] | None = None, block: int = BLOCK,
                        pow2: bool = False) -> None:
    """Refresh a weight's code buffers in place: q, s = quantize_128x128(w), bad (bool []) = a scale is NaN, and,
    when ``transposed`` = (qt, st) is given, qt = q.t(), st = s.t() (contiguous). On CUDA one Triton launch writes
    the codes, scales and flag and a second one W^T's (FP8BlockLinear's weight refresh; the unfused sequence is
    eight launches); elsewhere the quantizer's outputs are copied in. Either way the buffers keep their storage and
    their autograd versions move."""
    fn = _triton_impl(w, "requantize_128x128_", block)
    if fn is not None:
        qt, st = transposed if transposed is not None else (None, None)
        fn(w, q, s, bad, qt=qt, st=st, block=block, pow2=pow2)
        return
    q_new, s_new = quantize_128x128(w, block=block, pow2=pow2)
    q.copy_(q_new)
    s.copy_(s_new)
    bad.copy_(torch.isnan(s_new).any())
    if transposed is not None:
        transposed[0].copy_(q_new.t())
        transposed[1].copy_(s_new.t())


dequantize_1x128 = reference.dequantize_1x128
dequantize_128x1 = reference.dequantize_128x1
dequantize_128x128 = reference.dequantize_128x128
