"""Regional compilation of a model's repeated blocks (its decoder layers), FP8 layers inside them included.

``torch.compile`` of a whole model traces everything once per new set of shapes, the model's embedding, head and
loss included; compiling each repeated block instead (every member of an ``nn.ModuleList`` whose members are all of one
class) costs one block's compile however deep the model, since the blocks share one traced graph
(Dynamo treats their parameters as graph inputs). ``nn.Module.compile`` compiles in place: the module tree, the
parameter names, the state dict and checkpoints stay those of the eager model.

The FP8 layers of a converted model refresh their weight codes in the root's pre-hook before compiled calls; with
the root eager and only the blocks compiled, that hook is told to refresh on every call
(``weight_codes.refresh_for_compiled_blocks``), one pass over the weights' keys when no weight changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from calclip.fp8.weight_codes import refresh_for_compiled_blocks


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of every non-empty ``nn.ModuleList`` of ``model`` whose members are all of one class (the decoder
    layers; one layer too), outermost only: a list inside a chosen block (an MoE layer's experts) is compiled with
    it."""
    blocks: list[nn.Module] = []
    chosen: list[str] = []  # names of the chosen blocks, whose descendants are skipped
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in chosen):
            continue
        if isinstance(module, nn.ModuleList) and len({type(m) for m in module}) == 1:
            blocks.extend(module)
            chosen.extend(f"{name}.{i}" if name else str(i) for i in range(len(module)))
    return blocks


def compile_repeated_blocks(model: nn.Module, *, backend: str = "inductor", dynamic: bool | None = True,
                            mode: str | None = None, options: dict | None = None) -> int:
    """Compile each repeated block of ``model`` in place (``nn.Module.compile``, with torch.compile's ``backend``,
    ``mode`` and ``options``); return how many. ``dynamic=True`` (default) compiles symbolic token counts from the
    first call, since RL batches change length every step; ``dynamic=False`` compiles one static graph per shape
    (the trainer's bucketed layers, whose inputs are padded to a few lengths: calclip.rollout.compiled_layers).
    torch.compile takes a mode or options, not both; with Inductor both are honoured: the mode's options
    (``torch._inductor.list_mode_options``) with ``options`` over them. Raises, naming the model's class, when it has
    no repeated block."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (no nn.ModuleList of modules of one class) "
                         "to compile")
    if mode is not None and options and backend == "inductor":
        from torch._inductor import list_mode_options

        mode, options = None, {**list_mode_options(mode, dynamic), **options}
    refresh_for_compiled_blocks(model)  # a model quantize_model converted: its root's hook refreshes the codes
    for block in blocks:
        block.compile(backend=backend, dynamic=dynamic, mode=mode, options=options)
    return len(blocks)


def compiled_block_count(model: nn.Module) -> int:
    """How many modules of ``model`` run through ``nn.Module.compile``'s compiled call."""
    return sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


@contextlib.contextmanager
def eager_blocks(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, ``model``'s compiled blocks run eager: each one's compiled call is set aside, so ``nn.Module.__call__``
    takes its plain path, and put back on exit. Unlike ``torch.compiler.set_stance("force_eager")``, no call enters
    Dynamo's wrapper (a rollout calls every layer once per token)."""
    saved = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    for module, _ in saved:
        module._compiled_call_impl = None
    try:
        yield model
    finally:
        for module, compiled in saved:
            module._compiled_call_impl = compiled
