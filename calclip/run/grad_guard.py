"""Skip optimizer steps whose gradients are non-finite, and stop a run whose gradients stay non-finite.

One NaN or inf gradient applied by AdamW makes every weight it touches NaN for good; the run then dies steps later
far from the cause (in sampling: "probability tensor contains either inf, nan or element < 0"), or trains on
garbage. TRL and transformers apply the step. ``NonfiniteGradGuard`` is an optimizer step pre-hook: when the total
gradient norm is NaN/inf it drops every gradient (``p.grad = None``), so the step leaves the weights and the
optimizer state as they were, and after ``max_consecutive`` such steps in a row it raises, naming the steps.

Cost: one host sync per optimizer step, and one norm over the gradients unless ``known_norm`` gives the one the
caller already computed for this step (the trainer passes transformers' pre-clip norm: finite, it decides alone, since
clipping by a finite norm keeps the gradients finite; non-finite, the guard recomputes it for its message). Every rank
reaches the same decision: DDP gradients are identical after their all-reduce, and a sharded (DTensor) norm is reduced
over the mesh first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class NonfiniteGradientsError(RuntimeError):
    """Raised when ``max_consecutive`` optimizer steps in a row had non-finite gradients."""


class NonfiniteGradGuard:
    """``optimizer.register_step_pre_hook(NonfiniteGradGuard(3))``.

    ``step_of``: the optimizer step's number for messages (the trainer's global step + 1); ``on_step(skipped)``:
    called once per optimizer step with whether it was skipped (the trainer logs it); ``known_norm()``: the total
    gradient norm already computed for this step's gradients (a tensor or float), or None.
    """

    def __init__(self, max_consecutive: int, *, step_of: Callable[[], int] | None = None,
                 on_step: Callable[[bool], None] | None = None, hint: str = "",
                 known_norm: Callable[[], torch.Tensor | float | None] | None = None) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"max_consecutive must be an int >= 1, got {max_consecutive!r}")
        self.max_consecutive = max_consecutive
        self.step_of = step_of
        self.on_step = on_step
        self.hint = hint
        self.known_norm = known_norm
        self.skipped_in_a_row: list[tuple[int | None, float]] = []  # (step, total norm) of the current streak
        self.skipped_total = 0

    def __call__(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        known = self.known_norm() if self.known_norm is not None else None
        norm = None
        if known is None or not math.isfinite(float(_replicated(known))):
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = _total_norm(grads)
        if norm is None or torch.isfinite(norm).item():
            self.skipped_in_a_row = []
            if self.on_step is not None:
                self.on_step(False)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # torch's optimizers skip parameters without a gradient: no update, no state change
        self.skipped_total += 1
        self.skipped_in_a_row.append((self.step_of() if self.step_of is not None else None, float(norm.item())))
        if self.on_step is not None:
            self.on_step(True)
        if len(self.skipped_in_a_row) >= self.max_consecutive:
            steps = ", ".join(f"{s} (grad norm {n})" if s is not None else f"grad norm {n}"
                              for s, n in self.skipped_in_a_row)
            raise NonfiniteGradientsError(
                f"{len(self.skipped_in_a_row)} optimizer steps in a row had non-finite gradients and were skipped: "
                f"{steps}. Training stops here so the weights stay as they were before the first of them "
                f"(max_nonfinite_grad_skips={self.max_consecutive}).{self.hint}")


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm over all gradients (NaN/inf when any element is), or None without gradients."""
    if not grads:
        return None
    return _replicated(torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False))


def _replicated(norm):
    """``norm`` as the same value on every rank: a DTensor's (FSDP2 shards) mesh-wide full tensor, else itself."""
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm
