"""The policy's decoder layers compiled one by one for the training forwards and backwards (``compile_layers``).

A converted FP8 policy is host-bound in eager mode: each FP8 linear's quantizer and GEMM launches cost host time,
and nothing fuses the norms, rotary and activations around them. On the H200 a training step runs markedly faster
with the layers compiled one by one than eager (docs/benchmarks.md, FP8 at real model shapes). TRL's own
switch, ``TrainingArguments.torch_compile``, compiles the whole model, generation included, and its first steps did
not end inside one device call there. Here each repeated block (the decoder layers: the members of every
``nn.ModuleList`` whose members are all of one class) is compiled in place with ``nn.Module.compile`` (regional
compilation, ``calclip.fp8.compile_repeated_blocks``): the layers share one traced graph (Dynamo treats their
parameters as inputs), so the compile cost is one layer's, however deep the model; the state dict, the parameter
names and the checkpoints stay those of the eager model.

Only the trainer's own forwards run compiled. Rollouts (HF ``generate``: one token per call, a new shape every step)
and the BF16 shadow forwards (their FP8 layers switched off; a second graph for an occasional call) run eager inside
``calclip.fp8.regional_compile.eager_blocks``, which sets the compiled calls aside rather than entering Dynamo per
call (under ``torch.compiler.set_stance("force_eager")`` the H200's generation steps were slower than plain
eager). Shapes are compiled dynamic from the start: every generation batch has its own sequence length.

Inductor and Triton keep their compiled kernels and autotune results on disk (Inductor's FX graph and AOTAutograd
caches, under ``TORCHINDUCTOR_CACHE_DIR``, by default /tmp/torchinductor_<user>; calclip's kernels' timings in
Triton's cache), so a second run on the machine skips most of the first step's cost (docs/benchmarks.md, first-step
cost).

``None`` (the default) turns it on where it pays and is known to run: a blockwise FP8 policy (FP8 backward) or a
BF16 policy (fp8 off) on CUDA, trained without TrainingArguments.torch_compile, compile_generation, gradient
checkpointing or sharded parameters. BF16 gets it too so that an FP8-against-BF16 comparison compares like with
like: on the H200 a BF16 policy compiled by layer was faster than the same policy eager, and than it compiled whole
at 7-12B dims (docs/benchmarks.md), so a BF16 baseline left eager would flatter FP8.
"""

from __future__ import annotations


def resolve_compile_layers(setting: bool | None, *, device_type: str, fp8: bool, torch_compile: bool,
                           compile_generation: bool, gradient_checkpointing: bool, sharded: bool,
                           fp8_backward: str = "fp8") -> tuple[bool, str]:
    """(whether to compile the policy's layers, why). ``setting`` True/False is the user's; None chooses: on for an
    FP8 policy of any recipe and for a BF16 one (``fp8`` False) on CUDA unless another setting rules it out. An
    explicit True that cannot work raises, naming both fields.

    torchao's recipes run eager far below BF16: on an H100 (2026-12-07) the 8-layer GRPO row's training part took
    2.08 s in tensorwise and 2.10 s in rowwise, eager, against BF16 by layer's 0.96 s, while tensorwise compiled by
    layer ran 1.02-1.04x BF16 by layer at Qwen 7-8B dims (docs/benchmarks.md); so they compile by layer too."""
    if setting is True:
        if torch_compile:
            raise ValueError("compile_layers and torch_compile both set: torch_compile already compiles the whole "
                             "policy; set one of them")
        if compile_generation:
            raise ValueError("compile_layers with compile_generation: the CUDA-graphed decode step would trace the "
                             "compiled layers inside its own graph, which is not supported; set one of them")
        return True, "compile_layers: true"
    if setting is False:
        return False, "compile_layers: false"
    reasons = [(device_type != "cuda", f"the device is {device_type}, not cuda"),
               # the straight-through mode breaks the graph per linear
               (fp8 and fp8_backward != "fp8", f"fp8_backward is {fp8_backward}, not fp8"),
               (torch_compile, "torch_compile compiles the whole model"),
               (compile_generation, "compile_generation compiles the decode step"),
               (gradient_checkpointing, "gradient checkpointing is on"),
               (sharded, "the parameters are sharded (FSDP / ZeRO-3)")]
    off = [why for ruled_out, why in reasons if ruled_out]
    if off:
        return False, "compile_layers auto: off, " + "; ".join(off)
    return True, f"compile_layers auto: on ({'FP8' if fp8 else 'BF16'} policy on CUDA)"


def inductor_options(backend: str) -> dict | None:
    """torch.compile options of the compiled layers: with Inductor, round every BF16 intermediate as eager PyTorch
    does (``emulate_precision_casts``), so the trainer's compiled log-prob forwards stay close to the eager rollout's
    (block FP8 turns a last-bit difference in an activation into other codes downstream)."""
    return {"emulate_precision_casts": True} if backend == "inductor" else None
