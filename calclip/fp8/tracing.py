"""What a kernel launcher needs to know about torch.compile's tracing: whether a tensor is a tracing stand-in, and a
size's concrete value when it is symbolic. A leaf module (torch only) that the dispatchers (quant.py, gemm.py), the
layer and the Triton kernels all import, so none of them imports another for it."""

from __future__ import annotations

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
