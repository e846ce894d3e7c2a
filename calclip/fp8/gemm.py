"""Block-scaled FP8 GEMM: y[M, N] = dequant(A)[M, K] @ dequant(B)[N, K]^T, with pluggable backends.

Both operands are given in "K-last" form, codes [rows, K] plus FP32 dequantization scales, and each has a
block granularity relative to that form:

    "1x128"    scale [rows, ceil(K/128)]            groups of 128 along K   (activations, gradients)
    "128x128"  scale [ceil(rows/128), ceil(K/128)]  square tiles            (weights)

The three GEMMs of a linear layer (DeepSeek-V3 recipe) in this form, with x [M, K], W [N, K], dy [M, N]:

    forward  y  = x  @ W^T    A = Q1x128(x)                     B = Q128x128(W)              (1x128, 128x128)
    dgrad    dx = dy @ W      A = Q1x128(dy)                    B = Q128x128(W)^T            (1x128, 128x128)
    wgrad    dW = dy^T @ x    A = Q128x1(dy)^T                  B = Q128x1(x)^T              (1x128, 1x128)

A 128x128-quantized matrix transposes for free (codes.t(), scales.t()) and a 128x1 quantization is the
transposed 1x128 quantization, so no operand is re-quantized for the backward GEMMs.

Backends:
    "emulated"   dequantize both operands to fp32, fp32 matmul, cast (CPU and GPU; the numerical reference)
    "scaled_mm"  torch._scaled_mm with blockwise FP32 scales (CUDA sm_90); only layout pairs listed in
                 SCALED_MM_LAYOUTS and shapes accepted by ``scaled_mm_supports`` (its rows of A checked as
                 ``scaled_mm_rows(M)``: zero rows appended, ``pad_1x128_rows``), else falls back as below
    "triton"     calclip.fp8.kernels.fp8_block_gemm_triton (CUDA), else "emulated"
    "auto"       "scaled_mm" when allowed, else "triton" on CUDA, else "emulated"
With ``row_scales`` (``Fp8Config.scaled_mm_row_scales``), "auto" and "scaled_mm" also run a (1x128, 128x128) GEMM that
``scaled_mm_supports`` rejects only for its 128x128 scale's leading dimension (contraction / 128 not a multiple of 4:
Qwen2.5-1.5B's down projection, K = 8960, and the dgrad of its gate/up and k/v projections) on torch._scaled_mm,
with the 128x128 operand's scales repeated per row (``row_scales_of``): the (1x128, 1x128) layout pair, which
cuBLAS computes correctly at any contraction length (the wgrad pair; docs/scaled_mm_layouts.md). Same codes, same
scale per element, so the same products as the Triton GEMM, summed in cuBLAS' order ("scaled_mm_rows").
"auto" and "triton" run a forward-layout GEMM (1x128, 128x128) of at most SPLITK_MAX_M rows whose output has too
few tiles to fill the GPU (``splitk_applies``: decode's q/k/v/o and down projections) on
calclip.fp8.kernels.fp8_splitk_gemm_triton: the same K step, K split across more programs. There cuBLAS'
blockwise kernel (128 x 128 tiles) runs one program per output tile (16 at M=64, N=2048 on a 132-SM H200); where the
split-K kernel does not split, it measured slower than cuBLAS (docs/benchmarks-log.md, ninth session). An explicit
"scaled_mm" keeps cuBLAS at every shape it supports.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from calclip.fp8.config import BLOCK
from calclip.fp8.quant import triton_kernels
from calclip.fp8.reference import dequantize_1x128, dequantize_128x128
from calclip.fp8.tracing import is_traced, same_size, size_hint

GRANULARITIES = ("1x128", "128x128")
BACKENDS = ("auto", "scaled_mm", "triton", "emulated")
# Rows up to which "auto"/"triton" take the split-K GEMM for (1x128, 128x128) operands; CALCLIP_SPLITK_MAX_M
# overrides (0: never), read once at import.
SPLITK_MAX_M = int(os.environ.get("CALCLIP_SPLITK_MAX_M", "256"))

# (a_blocks, b_blocks) pairs that torch._scaled_mm computes CORRECTLY on the H200 (docs/scaled_mm_layouts.md):
# forward and dgrad (1x128, 128x128) when the contraction dim / 128 is a multiple of 4 (else torch accepts the
# call and returns garbage, see scaled_mm_supports), and wgrad (1x128, 1x128). tests/fp8/test_gpu_linear.py
# compares each pair with "emulated" on the GPU.
SCALED_MM_LAYOUTS: frozenset[tuple[str, str]] = frozenset({("1x128", "128x128"), ("1x128", "1x128")})
# torch._scaled_mm takes a 1x128 first operand of a multiple of 16 rows only; "scaled_mm" runs one of any other row
# count M on zero rows appended up to ``scaled_mm_rows(M)`` and returns the first M rows of the result
# (``pad_1x128_rows``). CALCLIP_SCALED_MM_PAD_ROWS=0 (read once at import) restores the old rule, such GEMMs on
# Triton: the control arm of benchmarks that measure what the padding buys. Decode-sized GEMMs (fewer than
# SCALED_MM_PAD_MIN_ROWS rows, SPLITK_MAX_M's default range) keep the kernels measured for them: there the copy is a
# launch of its own beside a weight-bandwidth-bound GEMM, unmeasured.
SCALED_MM_ROW_MULTIPLE = 16
SCALED_MM_PAD_MIN_ROWS = 257
PAD_ROWS = os.environ.get("CALCLIP_SCALED_MM_PAD_ROWS", "1") != "0"


def _check_operand(name: str, q: Tensor, s: Tensor, blocks: str, block: int) -> None:
    if blocks not in GRANULARITIES:
        raise ValueError(f"{name}_blocks must be one of {GRANULARITIES}, got {blocks!r}")
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q{name} must be a 2-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}")
    rows, k = q.shape
    nbk = -(-k // block)
    want = (rows, nbk) if blocks == "1x128" else (-(-rows // block), nbk)
    if tuple(s.shape) != want or s.dtype != torch.float32:
        raise ValueError(f"s{name} for {blocks} blocks of q{name} {tuple(q.shape)} must be float32 {want}, "
                         f"got {s.dtype} {tuple(s.shape)}")


def _dequantize(q: Tensor, s: Tensor, blocks: str, block: int) -> Tensor:
    if blocks == "1x128":
        return dequantize_1x128(q, s, block=block)
    return dequantize_128x128(q, s, block=block)


def emulated_block_gemm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype,
                        a_blocks: str = "1x128", b_blocks: str = "128x128", block: int = BLOCK) -> Tensor:
    """fp32 reference: (qa*sa) [M,K] @ (qb*sb)^T [K,N] -> out_dtype [M,N]. Autocast is switched off so a
    surrounding bf16 autocast region cannot lower the emulation's fp32 matmul. A 128x128 operand (a weight)
    is dequantized once per version of its codes (``_dequantized_weight``), not per call."""
    with torch.autocast(qa.device.type, enabled=False):
        a = _dequantize(qa, sa, a_blocks, block)
        b = _dequantized_weight(qb, sb, block) if b_blocks == "128x128" else _dequantize(qb, sb, b_blocks, block)
        return (a @ b.t()).to(out_dtype)


def _dequantized_weight(q: Tensor, s: Tensor, block: int) -> Tensor:
    """dequantize_128x128(q, s), kept on the codes' storage while neither q nor s changes.

    The emulation's cost is dominated by re-dequantizing the weight on every call (most of a CPU decode
    FP8BlockLinear call). FP8BlockLinear's codes are refreshed in place, which bumps their
    version, so the versions of q and s are the staleness key. The dgrad operand (q.t(), s.t(): views of the
    forward's codes) reuses the forward's dequantization, transposed: elementwise, so the same values.
    Tensors without a version counter (inference mode) and torch.compile's stand-ins are not cached. Memory: one
    fp32 copy per weight (4 bytes per parameter) while the codes live, the price of emulating FP8 without kernels."""
    if q.is_inference() or s.is_inference() or is_traced(q):
        return dequantize_128x128(q, s, block=block)
    root_q = q if q._base is None else q._base
    root_s = s if s._base is None else s._base
    version = (root_q._version, root_s._version, id(root_s), block)

    def view(t: Tensor, flip: bool = False) -> tuple:
        shape, stride = tuple(t.shape), tuple(t.stride())
        return (shape[::-1], stride[::-1], t.storage_offset()) if flip else (shape, stride, t.storage_offset())

    cache = getattr(root_q, "_calclip_dequantized", None)
    if cache is None or cache[0] != version:
        cache = (version, {})
        root_q._calclip_dequantized = cache
    entries = cache[1]
    flipped = entries.get((view(q, True), view(s, True)))
    if flipped is not None:
        return flipped.t()
    key = (view(q), view(s))
    if key not in entries:
        entries[key] = dequantize_128x128(q, s, block=block)
    return entries[key]


def scaled_mm_supports(a_blocks: str, b_blocks: str, m: int, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Conservative shape/layout guard for the torch._scaled_mm path (CUDA-side checks not repeated here).

    torch checks K % 16 and N % 16; cuBLAS' handling of a ragged last K block is untested, so K % 128 == 0;
    docs/scaled_mm_layouts.md found that a 128x128 scale whose leading dimension (ceil(K/128)) is not a multiple
    of 4 floats gives silently wrong results, and torch's exact stride checks reject a padded stride; so every
    scale leading dimension must be a multiple of 4 floats (rows of a 1x128 operand, ceil(K/128) of a 128x128
    operand). BF16 output only (measured path).
    """
    if (a_blocks, b_blocks) not in SCALED_MM_LAYOUTS or out_dtype != torch.bfloat16:
        return False
    if k % BLOCK or n % 16 or m % 16:
        return False
    nbk = k // BLOCK
    for rows, blocks in ((m, a_blocks), (n, b_blocks)):
        lead = rows if blocks == "1x128" else nbk
        if lead % 4:
            return False
    return True


def scaled_mm_rows(m):
    """The rows torch._scaled_mm runs a 1x128 first operand of ``m`` rows on: m rounded up to a multiple of 16
    (``PAD_ROWS``, from SCALED_MM_PAD_MIN_ROWS rows), else m. A symbolic m is judged by its hint (``size_hint``, no
    guard: padded rows are correct at every size) and gives a size provably a multiple of 16."""
    hint = size_hint(m)
    if not PAD_ROWS or (hint is not None and hint < SCALED_MM_PAD_MIN_ROWS):
        return m
    return (m + SCALED_MM_ROW_MULTIPLE - 1) // SCALED_MM_ROW_MULTIPLE * SCALED_MM_ROW_MULTIPLE


def operand_rows(backend: str, a: Tensor, out_dtype: torch.dtype, row_scales: bool = False):
    """The rows to quantize the 1x128 first operand of a forward or dgrad GEMM over (``quant.quantize_1x128``'s
    ``out_rows``), given that operand in high precision, a [M, K]: ``scaled_mm_rows(M)`` where the GEMM may run on
    torch._scaled_mm (``backend`` "auto" / "scaled_mm", an sm_90 CUDA tensor, a contraction K and output dtype it
    takes: ``resolve_backend``'s rule without N), else M itself (the same object). The quantizer then writes the zero
    rows torch._scaled_mm needs and ``scaled_mm_on_padded_rows`` copies nothing; a GEMM that goes elsewhere after all
    (N % 16 != 0) runs on the padded operand, whose extra rows are zeros, and the caller keeps the first M rows."""
    m, k = a.shape
    if backend not in ("auto", "scaled_mm") or not a.is_cuda:
        return m
    rows = scaled_mm_rows(m)
    if rows is m:  # no padding at this size: nothing to decide (and no guard on a symbolic m)
        return m
    # resolve_backend's two cuBLAS layouts at any N (N only enters through N % 16 and the weight's own rows); the
    # device is asked last (fake CUDA tensors on a CPU build of torch reach here while tracing)
    any_n = SCALED_MM_ROW_MULTIPLE
    takes = scaled_mm_supports("1x128", "128x128", rows, any_n, k, out_dtype) or (
        row_scales and scaled_mm_supports("1x128", "1x128", rows, any_n, k, out_dtype))
    return rows if takes and _is_sm90(a.device) else m


def pad_1x128_rows(q: Tensor, s: Tensor, rows) -> tuple[Tensor, Tensor]:
    """1x128 codes q [M, K] and scales s [M, ceil(K/128)] -> [rows, K] codes (row-major) and [rows, ceil(K/128)]
    scales (column-major, torch._scaled_mm's layout), rows >= M holding zero codes and zero scales: they dequantize to
    exact zeros, so the GEMM's first M output rows are the unpadded GEMM's products and the extra rows are zeros.
    One copy of the codes (M x K bytes); the caller checks rows != M."""
    extra = rows - q.shape[0]
    codes = torch.nn.functional.pad(q.view(torch.uint8), (0, 0, 0, extra)).view(q.dtype)  # bytes: no float8 pad
    return codes, torch.nn.functional.pad(s.t(), (0, extra)).t()


def scaled_mm_on_padded_rows(mm, a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor,
                             out_dtype: torch.dtype, m=None) -> Tensor:
    """``mm(a, b, scale_a=, scale_b=, out_dtype=)`` (torch._scaled_mm, or the ``scaled_mm_blockwise`` op while
    tracing) for a 1x128 operand ``a`` of any row count M (``m``; default a's rows): run on ``scaled_mm_rows(M)`` rows
    and return the result's first M rows (``narrow``, not ``[:M]``: fake CUDA tensors on CPU builds take it). ``a``
    comes with those rows already (its quantizer wrote them: ``operand_rows``) or with M rows, then zero rows are
    appended here (``pad_1x128_rows``, one copy)."""
    m = a.shape[0] if m is None else m
    rows = scaled_mm_rows(m)
    if same_size(a.shape[0], rows):  # the quantizer wrote the GEMM's rows (or there is nothing to pad): no guard on M
        y = mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
        return y if same_size(rows, m) else y.narrow(0, 0, m)
    if rows == m:  # an operand of M rows (quantized without operand_rows): the guard on M % 16 decides the copy
        return mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    a, scale_a = pad_1x128_rows(a, scale_a, rows)
    return mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype).narrow(0, 0, m)


def row_scales_of(s: Tensor, rows: int, block: int = BLOCK) -> Tensor:
    """128x128 scales [ceil(rows/128), KB] of a [rows, K] operand -> the same values as 1x128 scales [rows, KB], one
    per row (each row keeps its block's scale), column-major: the strides torch._scaled_mm reads for a 1x128 b
    operand's scale (its ``.t()``, [KB, rows], is contiguous). The dequantized operand is the same bit for bit."""
    per_row = s.t().repeat_interleave(block, dim=1)  # [KB, 128 * ceil(rows / 128)], contiguous
    if per_row.shape[1] != rows:  # a ragged last block: narrow + clone (fake CUDA tensors on CPU builds take these)
        per_row = per_row.narrow(1, 0, rows).clone(memory_format=torch.contiguous_format)
    return per_row.t()


def _scale_layout(s: Tensor, blocks: str) -> Tensor:
    """Strides ScaledBlas.cpp demands for a row-major operand T [R, K]: 1x128 scales (R, K/128) with strides
    (1, R) ("outer-dim-major", column-major); 128x128 scales (R/128, K/128) row-major."""
    return s.t().contiguous().t() if blocks == "1x128" else s.contiguous()


def scaled_mm_block_gemm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype,
                         a_blocks: str = "1x128", b_blocks: str = "128x128") -> Tensor:
    """torch._scaled_mm with blockwise scales. a = qa row-major [M,K]; b = qb^T column-major [K,N]; torch
    validates b through b.t() = qb [N,K] with scale_b.t(), hence scale_b = layout(sb).t(). Callers must
    check ``scaled_mm_supports`` (or be a GPU test probing a new layout)."""
    a = qa.contiguous()
    b = qb.contiguous().t()
    scale_a = _scale_layout(sa, a_blocks)
    scale_b = _scale_layout(sb, b_blocks).t()
    if a_blocks == "1x128":  # torch._scaled_mm's row rule: zero rows appended, sliced off the result
        return scaled_mm_on_padded_rows(torch._scaled_mm, a, b, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


@torch.library.custom_op("calclip::scaled_mm_blockwise", mutates_args=())
def scaled_mm_blockwise(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """torch._scaled_mm(a, b, scale_a=, scale_b=, out_dtype=) as an op torch.compile does not look into: what
    calclip's triton ops record for a blockwise GEMM, so Inductor calls cuBLAS exactly as the eager layer does
    (same result bit for bit) instead of choosing a kernel of its own for these scale layouts."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


@scaled_mm_blockwise.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


_TRITON_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_gemm(out_dtype: torch.dtype):
    """``kernels.fp8_block_gemm_triton(qa, sa, qb, sb, *, out_dtype)``, or None when unavailable. It
    reads each operand's granularity from its scale shape ([rows, KB] 1x128, [ceil(rows/128), KB] 128x128;
    both readings coincide when rows == 1), so every layout pair goes through it."""
    module = triton_kernels()
    fn = getattr(module, "fp8_block_gemm_triton", None) if module is not None else None
    return fn if out_dtype in _TRITON_OUT_DTYPES else None


_sm90_devices: dict[torch.device, bool] = {}


def _is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is a Hopper GPU; asked once per device (every forward and dgrad GEMM asks, via
    ``operand_rows``, before quantizing: a dict lookup, not a device-properties query)."""
    if device.type != "cuda":
        return False
    known = _sm90_devices.get(device)
    if known is None:
        known = _sm90_devices[device] = torch.cuda.get_device_capability(device)[0] == 9
    return known


def resolve_backend(backend: str, qa: Tensor, qb: Tensor, *, out_dtype: torch.dtype, a_blocks: str,
                    b_blocks: str, block: int = BLOCK, row_scales: bool = False) -> str:
    """The backend that will actually run: a requested one falls back (scaled_mm -> triton -> emulated)
    when its device, layout pair or shape is not supported; "auto" and "triton" give "splitk" (the split-K Triton
    GEMM) for a forward-layout GEMM of at most SPLITK_MAX_M rows with too few output tiles (``splitk_applies``);
    with ``row_scales``, "auto" and "scaled_mm" give "scaled_mm_rows" where only the 128x128 scale's leading
    dimension keeps cuBLAS from a (1x128, 128x128) GEMM (module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "emulated" or not qa.is_cuda or block != BLOCK:
        return "emulated"
    m, k = qa.shape
    n = qb.shape[0]
    if backend in ("auto", "triton") and splitk_applies(a_blocks, b_blocks, m, n, k, out_dtype, qa.device):
        return "splitk"
    if backend in ("auto", "scaled_mm") and _is_sm90(qa.device):
        rows = scaled_mm_rows(m) if a_blocks == "1x128" else m  # run on padded rows (scaled_mm_block_gemm)
        if scaled_mm_supports(a_blocks, b_blocks, rows, n, k, out_dtype):
            return "scaled_mm"
        if row_scales and b_blocks == "128x128" and scaled_mm_supports(a_blocks, "1x128", rows, n, k, out_dtype):
            return "scaled_mm_rows"
    if _triton_gemm(out_dtype) is not None:
        return "triton"
    return "emulated"


def splitk_applies(a_blocks: str, b_blocks: str, m, n, k, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether "auto"/"triton" take the split-K GEMM: (1x128, 128x128) operands, 1 to SPLITK_MAX_M rows (symbolic
    sizes by their hints, ``size_hint``, no guard), an output dtype the Triton GEMMs write, the kernels importable,
    and a shape the kernel splits on this device (``kernels.splitk_splits`` > 1: too few output tiles for the
    multiprocessors). On the H200 it was faster than cuBLAS exactly where it split, slower where it did not."""
    if (a_blocks, b_blocks) != ("1x128", "128x128"):
        return False
    m, n, k = (size_hint(d) for d in (m, n, k))
    if None in (m, n, k) or not 0 < m <= SPLITK_MAX_M or _splitk_gemm(out_dtype) is None:
        return False
    module = triton_kernels()
    return module.splitk_splits(m, n, k, module.sm_count(device)) > 1


def _splitk_gemm(out_dtype: torch.dtype):
    module = triton_kernels()
    fn = getattr(module, "fp8_splitk_gemm_triton", None) if module is not None else None
    return fn if out_dtype in _TRITON_OUT_DTYPES else None


def fp8_block_gemm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, out_dtype: torch.dtype,
                   backend: str = "auto", a_blocks: str = "1x128", b_blocks: str = "128x128",
                   block: int = BLOCK, row_scales: bool = False) -> Tensor:
    """y[M, N] = (qa * sa)[M, K] @ (qb * sb)[N, K]^T in out_dtype.

    qa: float8_e4m3fn [M, K], sa: fp32 per ``a_blocks``; qb: float8_e4m3fn [N, K], sb: fp32 per ``b_blocks``
    (see the module docstring). Any M, N, K; non-finite (NaN) scales propagate NaN into the rows/columns
    they touch. ``row_scales``: see ``resolve_backend``.
    """
    _check_operand("a", qa, sa, a_blocks, block)
    _check_operand("b", qb, sb, b_blocks, block)
    if qa.shape[1] != qb.shape[1]:
        raise ValueError(f"contraction dims differ: qa {tuple(qa.shape)}, qb {tuple(qb.shape)}")
    chosen = resolve_backend(backend, qa, qb, out_dtype=out_dtype, a_blocks=a_blocks, b_blocks=b_blocks,
                             block=block, row_scales=row_scales)
    if chosen == "scaled_mm":
        return scaled_mm_block_gemm(qa, sa, qb, sb, out_dtype=out_dtype, a_blocks=a_blocks, b_blocks=b_blocks)
    if chosen == "scaled_mm_rows":
        return scaled_mm_block_gemm(qa, sa, qb, row_scales_of(sb, qb.shape[0]), out_dtype=out_dtype,
                                    a_blocks=a_blocks, b_blocks="1x128")
    if chosen == "splitk":
        return _splitk_gemm(out_dtype)(qa, sa, qb, sb, out_dtype=out_dtype)
    if chosen == "triton":
        return _triton_gemm(out_dtype)(qa, sa, qb, sb, out_dtype=out_dtype)
    return emulated_block_gemm(qa, sa, qb, sb, out_dtype=out_dtype, a_blocks=a_blocks, b_blocks=b_blocks,
                               block=block)
