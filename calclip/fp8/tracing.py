"""What a kernel launcher needs to know about torch.compile's tracing: whether a tensor is a tracing stand-in, and a
size's concrete value when it is symbolic. A leaf module (torch only) that the dispatchers (quant.py, gemm.py), the
layer and the Triton kernels all import, so none of them imports another for it."""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor


def is_traced(t: Tensor) -> bool:
    """True for the stand-in tensors torch.compile traces with (FakeTensor under Dynamo, FunctionalTensor while
    AOTAutograd decomposes calclip's triton ops): then kernels are recorded through ``torch.library.wrap_triton``
    and GEMMs through custom ops, instead of being launched."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


def size_hint(d) -> int | None:
    """A size as a plain int: itself, or a symbolic size's example value (its hint; None for one without). Kernel
    choices are made on it without a guard, as Inductor chooses kernels: every candidate is correct at every size,
    only the speed differs; an eager call of the hinted size chooses the same kernel (same result bit for bit)."""
    if type(d) is int:
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def same_size(a, b) -> bool:
    """a == b for sizes known to be equal: ints compared, symbolic sizes only where provable from their expressions
    (``statically_known_true``: no guard installed, so a compiled graph is not specialised on the answer; sizes equal
    only for some values of a symbol count as different)."""
    if type(a) is int and type(b) is int:
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


# devices whose quantizers are user Triton kernels inside a compiled graph (CPU runs the torch reference quantizers,
# which Inductor fuses like any other op); a module attribute so a CPU test can trace the CUDA graph's form.
# CALCLIP_ONE_BUFFER=0 leaves the quantizers' inputs as Inductor lays them out (compile_cache.DISPATCH_ENV).
TRITON_KERNEL_DEVICES: tuple[str, ...] = ("cuda",) if os.environ.get("CALCLIP_ONE_BUFFER", "1") != "0" else ()


def one_buffer(t: Tensor) -> Tensor:
    """``t`` as one buffer for the two quantizer kernels that read it inside a compiled graph (x's 1x128 and 128x1
    codes, and dy's); ``t`` itself outside tracing and where the quantizers are not Triton kernels.

    Inductor gives every argument of a user Triton kernel the exact strides it was traced with, and where the argument
    is a pointwise result not yet in memory (the SiLU-multiply before down_proj, RMSNorm before q/k/v and gate/up, the
    SiLU backward before gate/up's backward) it realizes a copy per kernel argument, which it then fuses into the
    producer: the producer stored its output twice, once per quantizer (the H100 profile of 2026-12-06 at Qwen2.5-1.5B
    dims: FP8's SiLU-multiply kernels 3.1 / 5.5 ms forward / backward against BF16's 2.3 / 3.9, at the same ~3 TB/s).
    Forcing the stride order it already has makes Inductor realize it once, as one store both kernels read; an input
    already in memory (a GEMM's output) is unchanged. The values, strides and codes are the same bit for bit. (Under
    the aot_eager backend the prim's eager form runs instead, and copies: a debugging backend, not a fast one.)"""
    if t.device.type not in TRITON_KERNEL_DEVICES or not is_traced(t):
        return t
    if t.device.type == "cuda" and not torch.backends.cuda.is_built():
        # CUDA stand-ins traced by a CPU-only torch (tests/fp8/test_model_dims.py's GEMM-choice sweep): the prim's
        # meta function copies, which such a torch cannot do for a CUDA tensor
        return t
    from torch._inductor import inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

    return torch.ops.prims.inductor_force_stride_order(t, t.stride())
