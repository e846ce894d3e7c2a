"""Where a training step's memory goes, counted tensor by tensor (CPU or GPU): bf16 vs calclip FP8 arms.

    python benchmarks/memory_budget.py [--models qwen2.5-7b,qwen2.5-1.5b] [--tokens 256,512] [--scale-to 4x2048]
                                       [--arms bf16,fp8,fp8-ondemand,fp8-fused,fp8-lean] [--mode eager|layers]

A counting tool, not a peak measurement: it runs one forward + backward of bench_speed's model row (its dims, vocab
and architecture; ``--layers`` to override the row's layer count) and adds up

- saved: every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``), deduplicated by
  storage (a storage saved twice, or saved through several views, counts once; a view counts its whole storage),
  by the module that saved it (the innermost module running when it was saved; ``--mode layers`` compiles each
  decoder layer, so everything a layer saves is its own) and by dtype. Parameters and FP8 weight codes saved for
  backward are resident already and not counted again;
- resident: what lives outside autograd through the step: parameters, their gradients (one per parameter, its
  dtype), AdamW's two moments (each the parameter's dtype, as torch's AdamW makes them) and step counters, and the
  FP8 layers' weight codes: W codes + 128x128 scales, the W^T codes + scales the dgrad GEMM reads (on CUDA a
  contiguous copy, resident unless ``Fp8Config.resident_dgrad_codes=False``; on CPU views of W, so counted as on
  CUDA), non-finite flags and counters.

Saved bytes are linear in the token count for these models (flash-style attention saves its output and one fp32
log-sum-exp per head and token; every other saved tensor is per token, the 128x1 scales per 128 tokens); the tool
runs each token count of ``--tokens`` (multiples of 128, as batches of at least two 128-token sequences), checks that
the saved bytes are exactly linear (the per-token slope of each category is the same between every pair of counts), and
scales to ``--scale-to BATCHxSEQ`` (bench_speed's model rows: 4x2048 at 7B/8B dims, 8x2048 at 1.5B).

CPU vs CUDA: the eager FP8 layer saves the same tensors on both (linear_function: the W^T dgrad operands, which are
resident, and x's 128x1 codes + scales); only the W^T operands differ in storage (see above). The CPU emulation's
cached fp32 dequantized weight (gemm.emulated_block_gemm, 4 bytes per parameter) exists on CPU only and is left out.
``--mode layers`` compiles each decoder layer as bench_speed's "by layer" arms do (``compile_repeated_blocks``), by
default with AOTAutograd and the partitioner Inductor uses (min-cut rematerialization, ``compiler="inductor"``) but
without Inductor's kernels (``--compile-backend partitioner``): the saved set is the partitioner's choice, which is
what Inductor runs. On CPU calclip's quantizers are torch ops (the reference), which the partitioner may split and
recompute piece by piece; on CUDA they are Triton kernels, each one unit; so on CPU they run as opaque custom ops
(``opaque_quantizers``), one unit each, like the kernels. There the partitioner moves the 128x1 quantization of the
q/k/v and gate/up inputs into the backward and saves their bf16 inputs instead (docs/benchmarks.md, "Where the memory
goes (counted)").
On a GPU, ``--device cuda --mode layers --compile-backend inductor`` counts the real compiled step.

Transients (not counted, estimated): beside the bf16 dy, the backward of an FP8 linear holds dy's 1x128 codes during
the dgrad GEMM (with ``resident_dgrad_codes=False`` also the contiguous W^T copy) and its 128x1 codes during the wgrad
GEMM, one layout at a time; BF16's backward holds neither
(``transient_estimates`` works them out per linear shape).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
import weakref
from collections import defaultdict
from pathlib import Path

import torch
from torch import Tensor, nn

# The fused producers' Triton kernels run on CPU under the interpreter (set before triton is imported, as the tests do)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import git_commit, table  # noqa: E402

GIB = 2**30
# arm name -> Fp8Config fields (None: the BF16 model). Each arm names its W^T layout, so the arms (and the tables
# recorded with them) keep their meaning when a default changes: "fp8" keeps the W^T codes resident, as the
# default did until 2026-12-05; "fp8-ondemand" is today's default.
ARMS: dict[str, dict | None] = {
    "bf16": None,
    "fp8": {"resident_dgrad_codes": True},
    "fp8-ondemand": {"resident_dgrad_codes": False},
    "fp8-fused": {"fuse_producers": True, "resident_dgrad_codes": True},
    "fp8-lean": {"resident_dgrad_codes": False, "fuse_producers": True},
    # no W codes kept between calls either: each forward and each backward quantizes W (Fp8Config.resident_weight_codes)
    "fp8-transient": {"resident_dgrad_codes": False, "resident_weight_codes": False},
}
# tokens per sequence of the counting runs: --tokens are multiples of it, at least two sequences (with one, HF's loss
# saves its shifted labels as a view of the padded [1, SEQ + 1] labels, 8 bytes more than one per token)
SEQ = 128


# ---------------------------------------------------------------------------------------------------------------
# saved for backward


def linear_role(fqn: str) -> str:
    """The role of a module by its name: which input a linear reads (the q/k/v and gate/up siblings share one)."""
    leaf = fqn.rsplit(".", 1)[-1]
    roles = {"q_proj": "q/k/v", "k_proj": "q/k/v", "v_proj": "q/k/v", "o_proj": "o", "gate_proj": "gate/up",
             "up_proj": "gate/up", "down_proj": "down", "lm_head": "lm_head", "qkv_proj": "qkv",
             "gate_up_proj": "gate_up"}
    return roles.get(leaf, "")


def module_category(fqn: str, module: nn.Module) -> str:
    """A saved tensor's category by the innermost module that saved it: linear input (by role), norm, attention,
    mlp activation, embedding, decoder layer (compiled: the layer saves as one), or the model (the loss)."""
    role = linear_role(fqn)
    if role:
        return f"linear {role}"
    name = type(module).__name__
    if "Norm" in name:
        return "norm"
    if name.endswith("Attention") or "rotary" in fqn:
        return "attention"
    if name.endswith("MLP") or fqn.endswith("act_fn"):
        return "mlp act"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if name.endswith("DecoderLayer"):
        return "decoder layer (compiled)"
    return "model (loss, logits)"


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    if dtype == torch.float32:
        return "fp32"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "int/bool"


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedCounter:
    """Counts the bytes autograd saves for backward while active, each storage once, by (module category, dtype).
    Module tracking: forward pre/post hooks on ``track`` (every module in eager mode; the layers and what runs
    outside them when the layers are compiled, whose insides Dynamo must not trace)."""

    def __init__(self, model: nn.Module, resident: set[int], track: list[tuple[str, nn.Module]]) -> None:
        self.resident = resident
        self.seen: dict[int, tuple[str, str, int, list]] = {}
        self.stack: list[tuple[str, nn.Module]] = [("", model)]
        self.handles = []
        for fqn, module in track:
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._enter, fqn)))
            self.handles.append(module.register_forward_hook(functools.partial(self._leave, fqn), always_call=True))

    def _enter(self, fqn, module, args):
        self.stack.append((fqn, module))

    def _leave(self, fqn, module, args, output):
        if self.stack and self.stack[-1][1] is module:
            self.stack.pop()

    def pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr, nbytes = storage_key(t)
            if nbytes and ptr not in self.resident:
                entry = self.seen.get(ptr)
                # an address seen before whose tensors all died (a graph branch freed during the forward, e.g. the
                # loss's unused outputs) is a new storage at a reused address
                if entry is None or not any(ref() is not None for ref in entry[3]):
                    fqn, module = self.stack[-1]
                    self.seen[ptr] = (module_category(fqn, module), dtype_kind(t.dtype), nbytes, [weakref.ref(t)])
                else:
                    entry[3].append(weakref.ref(t))
        return t

    def totals(self) -> dict[tuple[str, str], int]:
        """Bytes saved and still held (some saved tensor of the storage alive), by (category, dtype): call it between
        the forward and the backward."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for category, kind, nbytes, refs in self.seen.values():
            if any(ref() is not None for ref in refs):
                out[(category, kind)] += nbytes
        return dict(out)

    def close(self) -> None:
        """Remove the hooks and drop the model and the saved tensors (the graph may keep the pack hook alive)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.stack, self.seen = [], [], {}


# ---------------------------------------------------------------------------------------------------------------
# resident


def adamw_state_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of torch.optim.AdamW's state for ``params``: exp_avg and exp_avg_sq in each parameter's dtype and shape
    (torch.zeros_like / memory_format preserve), and one fp32 ``step`` scalar per parameter."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def fp8_resident_bytes(model: nn.Module) -> dict[str, int]:
    """The FP8 layers' resident code bytes as on CUDA: W codes, W scales, W^T codes and scales when resident
    (``resident_dgrad_codes``; CPU keeps them as views of W, CUDA as contiguous copies), flags and counters."""
    from calclip.fp8.weight_codes import fp8_layers

    out = {"fp8 W codes": 0, "fp8 W scales": 0, "fp8 W^T codes": 0, "fp8 W^T scales": 0, "fp8 flags/counters": 0}
    for layer in fp8_layers(model):
        for t in (layer._fp8_bad, layer.nonfinite_count):
            if t is not None:
                out["fp8 flags/counters"] += t.numel() * t.element_size()
        qw, sw = layer._fp8_qw, layer._fp8_sw
        if qw is None:  # not made yet, or not kept (Fp8Config.resident_weight_codes=False)
            continue
        out["fp8 W codes"] += qw.numel() * qw.element_size()
        out["fp8 W scales"] += sw.numel() * sw.element_size()
        if layer.fp8_config.backward == "fp8" and layer.fp8_config.resident_dgrad_codes:
            out["fp8 W^T codes"] += qw.numel() * qw.element_size()
            out["fp8 W^T scales"] += sw.numel() * sw.element_size()
    return out


def resident_storages(model: nn.Module) -> set[int]:
    """Storage addresses that live outside autograd: parameters, buffers, FP8 codes (W, W^T on CUDA) and flags."""
    from calclip.fp8.weight_codes import fp8_layers

    ptrs = {storage_key(t)[0] for t in (*model.parameters(), *model.buffers())}
    for layer in fp8_layers(model):
        for name in ("_fp8_qw", "_fp8_sw", "_fp8_qwt", "_fp8_swt", "_fp8_bad", "nonfinite_count"):
            t = getattr(layer, name, None)
            if t is not None:
                ptrs.add(storage_key(t)[0])
    return ptrs


# ---------------------------------------------------------------------------------------------------------------
# one arm


@dataclasses.dataclass
class Count:
    tokens: int
    saved: dict[tuple[str, str], int]
    resident: dict[str, int]


def aot_layer_backend():
    """AOTAutograd with Inductor's partitioner (min-cut rematerialization, compiler="inductor"), the graphs run as
    traced: the saved set Inductor would run, without compiling kernels (CPU has no C++ toolchain to spare)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def run_as_traced(gm, example_inputs):
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=run_as_traced, bw_compiler=run_as_traced,
                        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))


_OPAQUE: dict[str, object] = {}


def _opaque_ops() -> dict[str, object]:
    """calclip's CPU quantizers (and the fused producers' CPU twins) as custom ops, which AOTAutograd's partitioner
    does not recompute (not in its allowlist), as it does not recompute the Triton kernels that serve them on CUDA.
    Same values: each op runs the reference, and its fake implementation is the reference on fake tensors."""
    if _OPAQUE:
        return _OPAQUE
    from calclip.fp8 import producers, reference

    @torch.library.custom_op("calclip_membudget::quantize_1x128", mutates_args=())
    def q_1x128(x: Tensor, block: int, pow2: bool) -> tuple[Tensor, Tensor]:
        q, s = reference.quantize_1x128(x, block=block, pow2=pow2)
        return q, s.clone()

    q_1x128.register_fake(lambda x, block, pow2: reference.quantize_1x128(x, block=block, pow2=pow2))

    def q_128x1_fake(x, block, pow2, gemm_layout):
        q, s = reference.quantize_128x1(x, block=block, pow2=pow2)
        if gemm_layout:  # the kernels' layout: token rows padded to reference.wgrad_rows, scales row-major
            return reference.pad_128x1_codes(q, block=block), s.contiguous()
        return q, s

    @torch.library.custom_op("calclip_membudget::quantize_128x1", mutates_args=())
    def q_128x1(x: Tensor, block: int, pow2: bool, gemm_layout: bool) -> tuple[Tensor, Tensor]:
        q, s = q_128x1_fake(x, block, pow2, gemm_layout)
        # clones keep the strides (column-major codes); the padded codes are a fresh tensor already
        return (q if gemm_layout else q.clone()), s.clone()

    q_128x1.register_fake(q_128x1_fake)

    def producer_op(name: str, twin):
        def run(*args, members, need_t, pow2):
            return tuple(twin(*args, members=members, need_t=need_t, pow2=pow2))

        if name == "rms_norm_quantize":
            @torch.library.custom_op(f"calclip_membudget::{name}", mutates_args=())
            def op(x: Tensor, rstd: Tensor, weight: Tensor, weight_bad: Tensor, members: int, need_t: bool,
                   pow2: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
                return tuple(t.clone() for t in run(x, rstd, weight, weight_bad, members=members, need_t=need_t,
                                                    pow2=pow2))

            op.register_fake(lambda x, rstd, weight, weight_bad, members, need_t, pow2: run(
                x, rstd, weight, weight_bad, members=members, need_t=need_t, pow2=pow2))
            return lambda x, rstd, weight, weight_bad, *, members=1, need_t=True, pow2=False: op(
                x, rstd, weight, weight_bad, members, need_t, pow2)

        @torch.library.custom_op(f"calclip_membudget::{name}", mutates_args=())
        def op(a: Tensor, b: Tensor, weight_bad: Tensor, members: int, need_t: bool,
               pow2: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            return tuple(t.clone() for t in run(a, b, weight_bad, members=members, need_t=need_t, pow2=pow2))

        op.register_fake(lambda a, b, weight_bad, members, need_t, pow2: run(
            a, b, weight_bad, members=members, need_t=need_t, pow2=pow2))
        return lambda a, b, weight_bad, *, members=1, need_t=True, pow2=False: op(a, b, weight_bad, members, need_t,
                                                                                  pow2)

    _OPAQUE["quantize_1x128"] = q_1x128
    _OPAQUE["quantize_128x1"] = q_128x1
    _OPAQUE["rms_norm_quantize"] = producer_op("rms_norm_quantize", producers.rms_norm_quantize_reference)
    _OPAQUE["mul_quantize"] = producer_op("mul_quantize", producers.mul_quantize_reference)
    return _OPAQUE


@contextlib.contextmanager
def opaque_quantizers():
    """Inside, calclip's CPU quantizer calls (``quant.quantize_1x128`` / ``quantize_128x1``, which linear_math calls
    through the module) and the fused producers' CPU twins run as the opaque ops of ``_opaque_ops``: a compiled CPU
    layer then saves what a compiled CUDA layer saves (codes the partitioner cannot recompute). CPU tensors only."""
    from calclip.fp8 import producers, quant

    ops = _opaque_ops()
    saved = quant.quantize_1x128, quant.quantize_128x1, dict(producers._REFERENCES)

    def unpadded(out_rows, name):
        # linear_math passes out_rows (gemm.operand_rows) to every 1x128 call; it pads CUDA operands only, so on
        # these CPU tensors it is always None
        if out_rows is not None:
            raise ValueError(f"opaque_quantizers: {name}(out_rows={out_rows}) on CPU; only CUDA operands are padded")

    def quantize_1x128(x, *, block=128, pow2=False, gemm_layout=False, nonfinite_count=None, weight_bad=None,
                       members=1, out_rows=None):
        unpadded(out_rows, "quantize_1x128")
        q, s = ops["quantize_1x128"](x, block, pow2)
        if gemm_layout:
            s = s.t().contiguous().t()
        if nonfinite_count is not None:
            quant.add_nonfinite_rows(nonfinite_count, s, weight_bad, members)
        return q, s

    def quantize_128x1(x, *, block=128, pow2=False, gemm_layout=False):
        return ops["quantize_128x1"](x, block, pow2, gemm_layout)

    quant.quantize_1x128, quant.quantize_128x1 = quantize_1x128, quantize_128x1
    producers._REFERENCES.update(rms_norm_quantize=ops["rms_norm_quantize"], mul_quantize=ops["mul_quantize"])
    try:
        yield
    finally:
        quant.quantize_1x128, quant.quantize_128x1 = saved[:2]
        producers._REFERENCES.clear()
        producers._REFERENCES.update(saved[2])


def build_arm(base: nn.Module, arm: str, mode: str, backend: str = "partitioner") -> nn.Module:
    """``arm``'s model sharing ``base``'s Parameters; ``mode`` "layers": each decoder layer compiled with ``backend``
    ("partitioner": ``aot_layer_backend``; or a torch.compile backend, e.g. "inductor" on a GPU)."""
    import bench_speed

    options = ARMS[arm]
    model = base if options is None else bench_speed.calclip_fp8_copy(base, options)
    if mode == "layers":
        from calclip.fp8 import compile_repeated_blocks

        from calclip.rollout.compiled_layers import inductor_options

        model = bench_speed.sharing_copy(model) if options is None else model
        # Inductor with the trainer's and bench_speed's options; static shapes (each token count is counted on its
        # own; the saved set is decided by the partitioner, before any lowering)
        compile_repeated_blocks(model, backend=aot_layer_backend() if backend == "partitioner" else backend,
                                dynamic=False, options=None if backend == "partitioner" else inductor_options(backend))
    return model


def count_step(model: nn.Module, ids: torch.Tensor, mode: str, backward: bool = True) -> Count:
    """One forward of ``model`` on ``ids`` with the saved set counted, then its backward (``backward``: the gradients
    counted as made, then dropped; else counted as they would be, one per trainable parameter in its dtype: a CPU
    run of a large model then costs one forward per token count)."""
    import bench_speed
    from calclip.fp8 import refresh_fp8_weights
    from calclip.fp8.regional_compile import repeated_blocks

    if mode == "layers" and not model.__dict__.get("_memory_budget_warm"):
        # compiles the layers (and makes the FP8 codes: W on the first forward, W^T on the first backward)
        bench_speed.training_loss(model, ids).backward()
        model.zero_grad(set_to_none=True)
        model.__dict__["_memory_budget_warm"] = True
    else:
        refresh_fp8_weights(model, for_backward=True)  # the codes a training step finds resident
    if mode == "layers":
        inside: set[int] = set()
        for block in repeated_blocks(model):
            inside.update(id(m) for m in block.modules() if m is not block)
        track = [(n, m) for n, m in model.named_modules() if id(m) not in inside]
    else:
        track = list(model.named_modules())
    counter = SavedCounter(model, resident_storages(model), track)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = bench_speed.training_loss(model, ids)
        saved = counter.totals()
    finally:
        counter.close()
    params = list(model.parameters())
    if backward:
        loss.backward()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        model.zero_grad(set_to_none=True)
    else:
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    del loss
    resident = {"parameters": sum(p.numel() * p.element_size() for p in params), "gradients": grads,
                "AdamW state": adamw_state_bytes([p for p in params if p.requires_grad]), **fp8_resident_bytes(model)}
    return Count(ids.numel(), saved, resident)


# ---------------------------------------------------------------------------------------------------------------
# linearity, scaling, tables


def per_token(counts: list[Count]) -> dict[tuple[str, str], tuple[float, float]]:
    """(slope bytes/token, intercept) of each saved category from the first two counts; raises ValueError naming the
    category when a third count is off the line (the scaling to the benchmark's tokens would then be wrong)."""
    a, b = counts[0], counts[1]
    out = {}
    for key in sorted(set(a.saved) | set(b.saved) | {k for c in counts for k in c.saved}):
        ya, yb = a.saved.get(key, 0), b.saved.get(key, 0)
        slope = (yb - ya) / (b.tokens - a.tokens)
        intercept = ya - slope * a.tokens
        for c in counts[2:]:
            predicted = intercept + slope * c.tokens
            if abs(c.saved.get(key, 0) - predicted) > 0.5:
                raise ValueError(f"saved bytes of {key} are not linear in tokens: {c.saved.get(key, 0)} at "
                                 f"{c.tokens} tokens, the line through {a.tokens} and {b.tokens} says {predicted:.0f}")
        out[key] = (slope, intercept)
    return out


def scaled(lines: dict[tuple[str, str], tuple[float, float]], tokens: int) -> dict[tuple[str, str], float]:
    return {key: slope * tokens + intercept for key, (slope, intercept) in lines.items()}


def gib(x: float) -> str:
    return f"{x / GIB:.3f}"


def transient_estimates(row, tokens: int) -> list[list[str]]:
    """Per linear shape of ``row``: the most bytes an FP8 linear's backward holds beside BF16's (dy's codes and scales;
    the W^T copy of ``resident_dgrad_codes=False``): both layouts of dy's codes at once (every backward before
    linear_math._backward released the 1x128 codes after the dgrad GEMM), or one at a time
    (the dgrad's 1x128 codes and W^T, then the wgrad's 128x1 codes); and the forward's transient 1x128 codes of x."""
    h, i = row.hidden, row.intermediate
    head_dim = row.head_dim or h // row.heads
    q, kv = row.heads * head_dim, row.kv_heads * head_dim
    shapes = {"q": (q, h), "k/v": (kv, h), "o": (h, q), "gate/up": (i, h), "down": (h, i)}
    rows = []
    for name, (n, k) in shapes.items():
        m = tokens
        dy_codes_1x128 = m * n + m * -(-n // 128) * 4
        dy_codes_128x1 = m * n + -(-m // 128) * n * 4
        wt = n * k + -(-n // 128) * -(-k // 128) * 4
        x_codes_1x128 = m * k + m * -(-k // 128) * 4
        both = dy_codes_1x128 + dy_codes_128x1
        rows.append([name, f"{n}x{k}", gib(both), gib(max(dy_codes_1x128, dy_codes_128x1)), gib(both + wt),
                     gib(max(dy_codes_1x128 + wt, dy_codes_128x1)), gib(x_codes_1x128)])
    return rows


def main(argv: list[str] | None = None) -> int:
    import bench_speed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen2.5-7b,qwen2.5-1.5b", help="bench_speed --models rows")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the row's)")
    parser.add_argument("--tokens", default="256,512", help="token counts to count at (multiples of 128, >= 256)")
    parser.add_argument("--scale-to", default=None, help="BATCHxSEQ to scale to (default: the row's batch x 2048)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--mode", default="eager", choices=("eager", "layers"),
                        help="eager, or each decoder layer compiled (AOTAutograd + Inductor's partitioner)")
    parser.add_argument("--compile-backend", default="partitioner",
                        help="--mode layers: 'partitioner' (AOTAutograd + Inductor's partitioner, no kernels: CPU) or "
                             "a torch.compile backend (inductor, on a GPU: the saved set the benchmark runs)")
    parser.add_argument("--no-backward", action="store_true",
                        help="count the gradients instead of running the backward (large models on CPU)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default: bench_speed's GPU runs')")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    if len(tokens) < 2 or any(t < 2 * SEQ or t % SEQ for t in tokens) or len(set(tokens)) != len(tokens):
        raise SystemExit(f"--tokens: at least two different multiples of {SEQ} of at least {2 * SEQ}, got "
                         f"{args.tokens!r}")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    if arms[0] != "bf16":
        arms = ["bf16"] + [a for a in arms if a != "bf16"]
    rows = bench_speed.parse_model_rows(args.models)
    vocab = args.vocab or bench_speed.GPU_SIZES.vocab
    device = torch.device(args.device)
    print("== memory budget (counted tensor by tensor, not a peak) ==")
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S')}  torch {torch.__version__}  commit {git_commit()}  mode "
          f"{args.mode}  device {device}  tokens {tokens}  vocab {vocab}")
    for row in rows:
        if args.layers:
            row = dataclasses.replace(row, layers=args.layers)
        if args.scale_to:
            batch, seq = (int(v) for v in args.scale_to.lower().split("x"))
        else:
            batch, seq = row.batch or bench_speed.GPU_SIZES.batch, bench_speed.GPU_SIZES.seq
        report_row(row, vocab, device, tokens, arms, args.mode, batch * seq, f"{batch}x{seq}", args.compile_backend,
                   not args.no_backward)
    return 0


def report_row(row, vocab: int, device, tokens: list[int], arms: list[str], mode: str, target: int,
               target_label: str, backend: str = "partitioner", backward: bool = True) -> dict[str, dict]:
    """Count every arm of ``row`` at each token count, print the tables, return {arm: {"saved": {key: bytes at
    target}, "resident": {...}}}."""
    import bench_speed

    torch.manual_seed(0)
    base = bench_speed.build_row_model(row, vocab, device)
    base.train()
    gen = torch.Generator(device="cpu").manual_seed(1)
    results: dict[str, dict] = {}
    for arm in arms:
        torch._dynamo.reset()
        print(f"   counting {arm} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
        model = build_arm(base, arm, mode, backend)
        counts = []
        cpu_stand_ins = mode == "layers" and device.type == "cpu" and backend == "partitioner"
        with opaque_quantizers() if cpu_stand_ins else contextlib.nullcontext():
            for t in tokens:
                ids = torch.randint(3, vocab, (t // SEQ, SEQ), generator=gen).to(device)
                counts.append(count_step(model, ids, mode, backward))
        lines = per_token(counts)
        results[arm] = {"saved": scaled(lines, target), "per_token": {k: s for k, (s, _) in lines.items()},
                        "resident": counts[-1].resident}
        del model
        gc.collect()
    print(f"\n### {row.label}, vocab {vocab}: counted at {tokens} tokens, scaled to {target_label} = {target} tokens "
          f"({mode}); GiB")
    print_tables(results, arms, loss_transient=8 * target * vocab)
    print(f"\nFP8 transients per linear at {target} tokens (GiB; CUDA path, from linear_math._backward / _forward):")
    table(["linear", "N x K", "bwd, both dy layouts at once", "bwd, one at a time", "ondemand W^T: at once",
           "ondemand W^T: one at a time", "fwd: x 1x128 codes"], transient_estimates(row, target))
    return results


def print_tables(results: dict[str, dict], arms: list[str], loss_transient: int = 0) -> None:
    """The per-category table. ``loss_transient``: the bytes the loss's backward adds while every saved tensor is
    still alive (HF's loss in fp32: the log-softmax's incoming and outgoing gradients, two fp32 [tokens, vocab]
    tensors), for the peak estimate row: the end of the forward plus that."""
    keys = sorted({k for r in results.values() for k in r["saved"]})
    rows = []
    for key in keys:
        values = [results[a]["saved"].get(key, 0.0) for a in arms]
        if any(abs(v) >= 1 for v in values):
            rows.append([f"saved: {key[0]} ({key[1]})", *(gib(v) for v in values)])
    saved_total = {a: sum(results[a]["saved"].values()) for a in arms}
    rows.append(["saved total", *(gib(saved_total[a]) for a in arms)])
    res_keys = list(dict.fromkeys(k for a in arms for k in results[a]["resident"]))
    for key in res_keys:
        rows.append([f"resident: {key}", *(gib(results[a]["resident"].get(key, 0)) for a in arms)])
    resident_total = {a: sum(results[a]["resident"].values()) for a in arms}
    rows.append(["resident total", *(gib(resident_total[a]) for a in arms)])
    total = {a: saved_total[a] + resident_total[a] for a in arms}
    rows.append(["resident + saved", *(gib(total[a]) for a in arms)])
    rows.append(["ratio / bf16", *(f"{total[a] / total['bf16']:.3f}" for a in arms)])
    # at the end of the forward the gradients do not exist yet (zero_grad(set_to_none=True))
    fwd_end = {a: total[a] - results[a]["resident"].get("gradients", 0) for a in arms}
    rows.append(["end of forward (no grads)", *(gib(fwd_end[a]) for a in arms)])
    rows.append(["ratio / bf16", *(f"{fwd_end[a] / fwd_end['bf16']:.3f}" for a in arms)])
    if loss_transient:
        peak = {a: fwd_end[a] + loss_transient for a in arms}
        rows.append([f"peak estimate (+ loss backward {gib(loss_transient)})", *(gib(peak[a]) for a in arms)])
        rows.append(["ratio / bf16", *(f"{peak[a] / peak['bf16']:.3f}" for a in arms)])
    table(["category", *arms], rows)


if __name__ == "__main__":
    sys.exit(main())
