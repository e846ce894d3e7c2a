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
eager).

Every generation batch has its own sequence length, so the token count of the layers' inputs changes from step to
step. ``compile_layers_shapes`` says how the compiled layers meet that: ``dynamic`` compiles symbolic batch and
sequence sizes from the first call (one graph for every length); ``bucketed`` pads each log-prob forward's sequence on
the right to the next of a few lengths (``bucket_length``: at most 1/16 more tokens) and compiles one static graph
per length. Right padding leaves the real tokens' results as they were, up to the last bits of attention over more
(masked) keys: causal attention never lets a token see a later one, the pads are masked out of the labels and their
positions (calclip.rollout.positions) are 0, and the log-probs of the pads are cut off before TRL sees them.

What a static graph buys depends on the recipe. On an H100 (2026-12-07, Qwen2.5-7B dims, 3 layers, 4 x 2048 tokens,
fwd + bwd + AdamW; docs/benchmarks.md) torchao's tensorwise by layer ran 63.6 ms static against 73.9 ms with
``dynamic=True`` and 74.7 ms under Dynamo's automatic dynamic shapes (sequence symbolic, batch static), rowwise 70.6
against 88.2 ms: Inductor's fused scaling loses its speed on a symbolic token count, and the whole-model compile's
1.2x over BF16 by layer comes back only with static shapes. calclip's blockwise (67.3 / 67.5 ms) and BF16 (74.5 /
75.2 ms) ran alike either way, so they stay dynamic, without the padding's extra tokens. null (default): ``bucketed``
for torchao's recipes (tensorwise, rowwise), ``dynamic`` otherwise.

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

import math

import torch
import torch.nn.functional as F

LAYER_SHAPES = ("dynamic", "bucketed")
BUCKETED_RECIPES = ("tensorwise", "rowwise")  # torchao's: their scaling is Inductor's, fused per graph
# Static graphs of the layers' one function: up to three per bucket length (with grad, an input without grad, no grad),
# 64 lengths (four doublings, e.g. 256 to 4096 tokens); Dynamo's default limit (8) would leave a long run eager.
BUCKET_GRAPHS_PER_LENGTH = 3
BUCKETED_RECOMPILE_LIMIT = 64 * BUCKET_GRAPHS_PER_LENGTH


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


def check_layer_shapes(setting) -> None:
    """Raises, naming the field, unless ``setting`` is one of ``LAYER_SHAPES`` or None (the trainer config checks its
    field with this at config time)."""
    if setting is not None and setting not in LAYER_SHAPES:
        raise ValueError(f"compile_layers_shapes must be one of {LAYER_SHAPES} or null (the recipe's choice), got "
                         f"{setting!r}")


def resolve_layer_shapes(setting: str | None, *, fp8: bool, recipe: str | None) -> tuple[str, str]:
    """(``dynamic`` or ``bucketed``, why): how the compiled layers meet a new sequence length. ``setting`` is the
    user's ``compile_layers_shapes``; None chooses ``bucketed`` for torchao's recipes (an FP8 policy of
    ``BUCKETED_RECIPES``), ``dynamic`` for calclip's blockwise and for BF16 (measured alike either way)."""
    check_layer_shapes(setting)
    if setting is not None:
        return setting, f"compile_layers_shapes: {setting}"
    if fp8 and recipe in BUCKETED_RECIPES:
        return "bucketed", f"compile_layers_shapes auto: bucketed (fp8_recipe {recipe}: static graphs pay)"
    return "dynamic", "compile_layers_shapes auto: dynamic"


def bucket_length(tokens: int) -> int:
    """The padded length of a ``tokens``-long sequence: the next multiple of max(16, 2^(floor(log2(tokens)) - 4)),
    so at most 1/16 more tokens past 256 (and fewer than 16 below), and 16 lengths from one power of two to the
    next: 276 -> 288, 1300 -> 1344, 2048 -> 2048, 2049 -> 2176."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an integer >= 1, got {tokens!r}")
    step = max(16, 1 << max(0, tokens.bit_length() - 1 - 4))
    return math.ceil(tokens / step) * step


def pad_to_bucket(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``input_ids`` and ``attention_mask`` ([batch, tokens]) padded on the right to ``bucket_length(tokens)`` (ids
    ``pad_token_id``, mask 0), and the number of columns added."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must be [batch, tokens] of one shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    pad = bucket_length(input_ids.size(1)) - input_ids.size(1)
    if not pad:
        return input_ids, attention_mask, 0
    return F.pad(input_ids, (0, pad), value=pad_token_id), F.pad(attention_mask, (0, pad), value=0), pad


def raise_recompile_limit(limit: int) -> None:
    """Dynamo's per-function limit of compiled graphs raised to ``limit``, and its process-wide one to twice that
    (never lowered): bucketed layers compile one static graph per bucket length and grad mode, and past the limit
    Dynamo runs the function eager."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * limit)


def bucket_overflow(shapes_seen: int) -> str | None:
    """A warning once the bucketed layers have met more (batch, length) shapes than their recompile limit has graphs
    for (``BUCKET_GRAPHS_PER_LENGTH`` each): further new shapes run eager, far slower for torchao's recipes."""
    if shapes_seen * BUCKET_GRAPHS_PER_LENGTH <= BUCKETED_RECOMPILE_LIMIT:
        return None
    return (f"compile_layers_shapes bucketed: the policy's layers have met {shapes_seen} (batch, length) shapes, more "
            f"than Dynamo's recompile limit ({BUCKETED_RECOMPILE_LIMIT} graphs) holds; new ones now run eager. Set "
            "compile_layers_shapes: dynamic for runs whose lengths spread this wide")
