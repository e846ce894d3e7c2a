"""The FP8 speed table of docs/benchmarks.md in one run: BF16 vs calclip FP8 (eager and torch.compile) vs torchao, as Markdown.

    python benchmarks/bench_speed.py                          # every section, H200 (see benchmarks/README.md)
    python benchmarks/bench_speed.py --only layer,model       # some sections
    python benchmarks/bench_speed.py --tiny                   # CPU, tiny shapes: checks that every path runs
    python benchmarks/bench_speed.py --only model --models qwen2.5-7b,llama3-8b:2 --fp8-options scaled_mm_row_scales=false

Sections (``--only``), each printed (and flushed) as soon as it is done:

- ``layer``: one linear layer's forward+backward, nn.Linear vs FP8BlockLinear (eager, torch.compile) vs torchao
  ``Float8BlockwiseLinear``, bf16 input and weights, at (M, K, N) in LAYER_SHAPES. Per call: wall time (a loop
  of calls, synchronized at the end: what a training loop sees), GPU time (the same loop queued behind a
  ``torch.cuda._sleep`` so the device runs it without host gaps: kernel time alone) and host time (CPU time
  to issue one call, never synchronized). A step whose wall time is near its host time is host-bound.
- ``model``: a random-weight Llama (transformers ``LlamaConfig``, sdpa attention, bf16 weights, untied LM head,
  vocab 32000, KV cache off) with a real architecture's linear dims and head / KV-head counts (``--models``: by
  default Qwen2.5-1.5B's dims, 8 layers, 8 x 2048 tokens; Qwen2.5-7B's and Llama-3-8B's, 3 layers, 4 x 2048 tokens;
  see NAMED_MODELS), forward + backward + fused AdamW step on random tokens. Arms (``--model-arms``): BF16 eager and
  compiled, calclip FP8 eager and compiled, torchao blockwise eager (compiled with ``--compile-peers``), and "FP8+"
  eager and compiled with ``--fp8-options`` (a speed lever on, beside the defaults). All arms share the Parameters
  and one optimizer (the FP8 arms are ``quantize_model`` copies of the BF16 model's module tree, not of its weights),
  so peak memory is comparable: peak = this arm's transient peak over its step + the shared weights and optimizer
  state + this arm's own persistent buffers (the FP8 weight cache), measured after its warm-up. Per row: a table of
  every arm (ms, speed vs BF16 eager, peak, first-step and warm-up seconds, the compiled arms' graphs / graph breaks
  / graphs compiled during timed rounds from dynamo's counters); at the end one table of ratios over all rows
  (FP8 compiled vs BF16 compiled, FP8 eager vs BF16 eager and vs torchao, peak memory ratios, first-step seconds).
- ``decode``: HF ``generate`` on the 8-layer hidden-2048 model, greedy, prompt 32 random tokens, 128 new tokens
  (min_new_tokens = max_new_tokens: equal lengths), batch 64 and 256; settings ``eager`` (dynamic cache) and
  ``graphed`` (``cache_implementation="static"``: transformers compiles the decode step itself with
  ``CompileConfig()``'s mode "reduce-overhead", i.e. CUDA graphs, when the device is CUDA). Decode time is taken
  between CUDA events recorded by a logits processor after the first and the last token (prefill excluded).
- ``trainer``: ``bench_trainer_step.py``'s default config through its own functions: median optimizer-step
  time of CalibratedGRPOTrainer runs (HF generate inside), BF16 vs FP8.
- ``smollm``: ``calclip train`` equivalents (``calclip.cli.arguments.parse_train_args`` +
  ``calclip.cli.train.build_trainer``) on the embedded SmolLM2-135M-Instruct with configs/bf16_static.yaml and
  configs/fp8_calibrated.yaml, fp32 master weights (``--model_dtype float32``, bf16 autocast: the target's setting);
  ratio FP8/BF16 time, as the target states it.

Method: arms are interleaved (A B C A B C ...) over ``--repeats`` rounds after a warm-up per arm; medians over
rounds with the [min-max] spread; ratios are the median of the per-round ratios (arms of one round ran
back to back, so drift of the shared GPU cancels). Ratio columns are BF16 / arm (> 1: the arm is faster) except
the smollm row (FP8 / BF16 time, as in the issue). Data is random normal / random token ids, never zeros. The
trainer and smollm sections interleave whole short runs (``--run-rounds``). Compiled arms report compile time,
graph count and graph breaks, and are flagged when they recompile while being timed. Any arm that fails prints
its error and shows "err"; the other arms go on. torchao is optional: its columns show "-" when it cannot be
imported or built (it needs sm_90).
"""  # noqa: E501 - line 1 is argparse's description (__doc__.splitlines()[0]), line 6 a command to copy

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import dispatch_switches, git_commit, package_version, rotating, table

SECTIONS = ("layer", "model", "decode", "trainer", "smollm")
ROOT = Path(__file__).resolve().parents[1]

# (M, K, N) of docs/benchmarks.md's layer rows.
LAYER_SHAPES = ((2048, 4096, 4096), (8192, 2048, 2048), (8192, 4096, 14336))
TINY_LAYER_SHAPES = ((128, 256, 256), (256, 128, 384))


@dataclass(frozen=True)
class ModelRow:
    """A model row: a random-weight Llama with an architecture's linear dims and attention head counts, ``layers``
    decoder layers, trained on ``batch`` sequences of the run's sequence length (None: the run's batch)."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    head_dim: int | None = None  # None: hidden // heads
    batch: int | None = None
    arch: str = "llama"  # the transformers family built (ROW_ARCHS): its decoder layer, norms and fused linears


    @property
    def label(self) -> str:
        return f"{self.name} {self.layers}L h{self.hidden} i{self.intermediate} {self.heads}/{self.kv_heads}h"


# Named architectures (--models): the dims of each model's config.json on the Hugging Face hub, as in
# tests/fp8/test_model_dims.py's table (tests/test_bench_speed.py checks they agree), with the layer count and batch
# of the model rows: few layers, so the compiled peers of three rows finish within one 10-minute device call.
NAMED_MODELS = {row.name: row for row in (
    ModelRow("qwen2.5-1.5b", 1536, 8960, 12, 2, layers=8, head_dim=128, batch=8),
    ModelRow("qwen2.5-7b", 3584, 18944, 28, 4, layers=3, head_dim=128, batch=4),
    ModelRow("llama3-8b", 4096, 14336, 32, 8, layers=3, head_dim=128, batch=4),
    ModelRow("qwen2.5-0.5b", 896, 4864, 14, 2, layers=8, head_dim=64, batch=8),
    ModelRow("qwen3-8b", 4096, 12288, 32, 8, layers=3, head_dim=128, batch=4),
    ModelRow("smollm2-135m", 576, 1536, 9, 3, layers=30, head_dim=64, batch=8),
    # issue 38's rows of families the tests do not name, built as their own architecture: Phi-3's fused qkv_proj /
    # gate_up_proj (head dim 96; no shared-input group, so no fused producer: today's path), Mistral-NeMo's
    # attention width 4096 under hidden 5120
    ModelRow("phi3-mini", 3072, 8192, 32, 32, layers=4, head_dim=96, batch=8, arch="phi3"),
    ModelRow("mistral-nemo-12b", 5120, 14336, 32, 8, layers=3, head_dim=128, batch=4, arch="mistral"),
    # the original synthetic rows (head dim 128, no grouped-query attention)
    ModelRow("h2048", 2048, 8192, 16, 16, layers=8),
    ModelRow("h4096", 4096, 14336, 32, 32, layers=4),
)}
DEFAULT_MODELS = ("qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b")
TINY_MODELS = (ModelRow("tiny-gqa", 256, 512, 4, 2, layers=1), ModelRow("tiny", 128, 256, 2, 2, layers=1))
# (layers, hidden, intermediate) of the decode section's model
DECODE_MODEL = (8, 2048, 8192)
TINY_DECODE_MODEL = (1, 256, 512)
# A compiled arm's first calls differ (empty weight cache, then a cached one; CUDA graphs record on a later call):
# it always gets at least this many untimed calls.
COMPILED_WARMUP = 3
SLEEP_HZ = 2.0e9  # torch.cuda._sleep spins for clock cycles; the H200's top SM clock is 1.98 GHz


@dataclass
class Sizes:
    device: str
    layer_shapes: tuple
    model_rows: tuple[ModelRow, ...]
    decode_model: tuple[int, int, int]
    vocab: int
    batch: int
    seq: int
    decode_batches: tuple[int, ...]
    prompt: int
    new_tokens: int
    trainer_model: tuple[int, int, int]  # layers, hidden, intermediate (bench_trainer_step's defaults)
    completion_length: int


GPU_SIZES = Sizes("cuda", LAYER_SHAPES, tuple(NAMED_MODELS[m] for m in DEFAULT_MODELS), DECODE_MODEL, vocab=32000,
                  batch=8, seq=2048, decode_batches=(64, 256), prompt=32, new_tokens=128,
                  trainer_model=(8, 2048, 8192), completion_length=128)
TINY_SIZES = Sizes("cpu", TINY_LAYER_SHAPES, TINY_MODELS, TINY_DECODE_MODEL, vocab=512, batch=2, seq=32,
                   decode_batches=(2, 4), prompt=8, new_tokens=6, trainer_model=(1, 128, 256), completion_length=8)


# ---------------------------------------------------------------------------------------------------------------
# arms, interleaving, formatting


@dataclass
class Arm:
    """One column of a section: ``sample()`` runs one timed round and returns {metric: value}."""

    name: str
    sample: Callable[[], dict[str, float]] | None = None
    error: str | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def values(self, metric: str) -> list[float]:
        return self.samples.get(metric, [])


def short_error(err: BaseException) -> str:
    """Type, first line of the message and the innermost frame: enough to tell failures apart in a table run."""
    text = str(err).strip().splitlines()
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {text[0][:240] if text else ''}{where}"


def fail(arm: Arm, stage: str, err: BaseException) -> None:
    arm.error, arm.sample = f"{stage}: {short_error(err)}", None
    print(f"   !! {arm.name} {stage} failed: {arm.error}", flush=True)


def setup_arm(name: str, build: Callable[[], Callable[[], dict[str, float]]]) -> Arm:
    """``build()`` makes (and warms up) the arm and returns its sampling function; a failure becomes the arm's
    error instead of stopping the section."""
    arm = Arm(name)
    try:
        arm.sample = build()
    except Exception as err:  # noqa: BLE001 — one failing arm must not stop the others
        fail(arm, "setup", err)
    return arm


def interleave(arms: list[Arm], repeats: int) -> None:
    """A B C A B C ...: ``repeats`` rounds, each arm sampled once per round; a failing arm drops out."""
    for _ in range(repeats):
        for arm in arms:
            if arm.sample is None:
                continue
            try:
                for metric, value in arm.sample().items():
                    arm.samples.setdefault(metric, []).append(value)
            except Exception as err:  # noqa: BLE001
                fail(arm, "timed run", err)


def fmt_stat(values: list[float], digits: int = 3) -> str:
    """median [min-max] of the rounds."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def cell(arm: Arm | None, metric: str, digits: int = 3) -> str:
    if arm is None:
        return "-"
    if not arm.values(metric):
        return "err" if arm.error else "-"
    return fmt_stat(arm.values(metric), digits)


def paired_ratio(num: Arm | None, den: Arm | None, metric: str) -> str:
    """Median [min-max] over rounds of num/den for the rounds both arms completed."""
    if num is None or den is None:
        return "-"
    pairs = [a / b for a, b in zip(num.values(metric), den.values(metric)) if b > 0 and not math.isnan(a / b)]
    if not pairs:
        return "err" if (num.error or den.error) else "-"
    return fmt_stat(pairs, 2) + "x"


@contextlib.contextmanager
def quiet(label: str):
    """Hold back what a trainer prints (progress bars, per-step log dicts) so the tables stay readable; on an
    error, print the last of it."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            yield
    except BaseException:
        print(f"   -- last output of {label}:\n{buffer.getvalue()[-3000:]}", flush=True)
        raise


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# compile bookkeeping


def graphs_compiled() -> int:
    """Graphs torch._dynamo compiled so far in this process (its global counters)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_break_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def top_graph_breaks(before: dict[str, int], n: int = 2) -> str:
    """The ``n`` most frequent graph-break reasons since ``before`` (a graph_break_counts() snapshot)."""
    grown = {r: c - before.get(r, 0) for r, c in graph_break_counts().items() if c > before.get(r, 0)}
    reasons = sorted(grown.items(), key=lambda kv: -kv[1])[:n]
    return "; ".join(f"{count}x {reason.splitlines()[0][:120]}" for reason, count in reasons)


def watch_recompiles(arm_name: str, sample: Callable[[], dict[str, float]],
                     tally: dict[str, int] | None = None) -> Callable[[], dict[str, float]]:
    """Wrap a compiled arm's sampler: count graphs compiled during timed rounds (they should be none), printed, and
    added to ``tally["recompiled"]`` when given."""
    def run():
        before = graphs_compiled()
        result = sample()
        grew = graphs_compiled() - before
        if grew:
            print(f"   !! {arm_name}: {grew} graph(s) compiled during a timed round (recompilation)", flush=True)
        if tally is not None:
            tally["recompiled"] = tally.get("recompiled", 0) + grew
        return result
    return run


def compiled_warmup(arm_name: str, warm: Callable[[], None]) -> str:
    """Run ``warm`` (the first calls of a compiled arm) and describe what compiling cost."""
    g0 = graphs_compiled()
    breaks = graph_break_counts()
    t0 = time.perf_counter()
    warm()
    seconds = time.perf_counter() - t0
    g1 = graphs_compiled()
    n_breaks = sum(max(0, c - breaks.get(r, 0)) for r, c in graph_break_counts().items())
    note = f"{arm_name}: warm-up incl. compile {seconds:.1f} s, {g1 - g0} graph(s), {n_breaks} graph break(s)"
    if n_breaks:
        note += f" (top: {top_graph_breaks(breaks)})"
    print(f"   {note}", flush=True)
    return note


# ---------------------------------------------------------------------------------------------------------------
# optional peer: torchao's blockwise FP8 training linear


def compile_module(module: nn.Module, opts) -> nn.Module:
    """torch.compile with the run's --compile-backend and --compile-mode."""
    return torch.compile(module, backend=opts.compile_backend, mode=opts.compile_mode)


# --by-layer-auto-dynamic: the by-layer arms' first step runs this many tokens per sequence fewer, so the main length
# recompiles them with Dynamo's automatic dynamic shapes (only the dims that changed symbolic), as a trainer's second
# rollout length does; the timed steps run that graph, never a static one of the main length.
AUTO_DYNAMIC_SHORTER = 64


def by_layer_default_shapes(opts) -> bool:
    """Whether the by-layer arms compile with Dynamo's default shapes instead of the trainer's dynamic=True."""
    return bool(getattr(opts, "by_layer_static", False) or getattr(opts, "by_layer_auto_dynamic", False))


def compile_by_layer(module: nn.Module, opts) -> nn.Module:
    """Each decoder layer compiled in place as the trainer's compile_layers does (calclip.fp8.compile_repeated_blocks,
    dynamic shapes, its Inductor options), with the run's --compile-backend and --compile-mode; --by-layer-static
    and --by-layer-auto-dynamic compile them with Dynamo's default instead (static first), the whole-model arms'
    setting (the latter then recompiles them at a second length: model_section's warm-up)."""
    from calclip.fp8 import compile_repeated_blocks
    from calclip.rollout.compiled_layers import inductor_options

    backend = opts.compile_backend or "inductor"
    compile_repeated_blocks(module, backend=backend, mode=opts.compile_mode, options=inductor_options(backend),
                            dynamic=None if by_layer_default_shapes(opts) else True)
    return module


def torchao_blockwise():
    """(Float8BlockwiseLinear, Float8BlockwiseLinearConfig, quantize_) from torchao, or None with the reason."""
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear, Float8BlockwiseLinearConfig
        from torchao.quantization import quantize_
    except Exception as err:  # noqa: BLE001 — optional peer
        return None, short_error(err)
    return (Float8BlockwiseLinear, Float8BlockwiseLinearConfig, quantize_), None


def not_lm_head(module: nn.Module, fqn: str) -> bool:
    """torchao's filter, matching calclip's default Fp8Config.keep_patterns: every nn.Linear but the LM head."""
    return type(module) is nn.Linear and "lm_head" not in fqn


# ---------------------------------------------------------------------------------------------------------------
# layer


def time_calls(step: Callable[[], None], n: int, device: torch.device) -> dict[str, float]:
    """ms per call of ``step``: wall (loop, one sync at the end), gpu (kernel time: the loop queued behind a
    sleep kernel so the device never waits for the host; NaN if the sleep ran out first, e.g. the step syncs)
    and host (CPU time to issue one call)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = time.perf_counter() - t0
    sync(device)
    wall = time.perf_counter() - t0
    if device.type != "cuda":
        return {"wall": wall / n * 1e3, "host": host / n * 1e3, "gpu": math.nan}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = math.nan
    for margin in (3.0, 12.0):
        torch.cuda._sleep(int(margin * max(host, 1e-4) * SLEEP_HZ))
        start.record()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        issued = time.perf_counter() - t0
        end.record()
        queued_ahead = not start.query()  # the sleep still ran when the last call was issued: no host gaps
        end.synchronize()
        if queued_ahead:
            gpu, host = start.elapsed_time(end) / n, issued
            break
    return {"wall": wall / n * 1e3, "host": host / n * 1e3, "gpu": gpu}


def layer_section(opts, sizes: Sizes) -> None:
    from calclip.fp8 import Fp8Config, FP8BlockLinear

    device = torch.device(sizes.device)
    peer, peer_error = (None, None) if opts.no_torchao else torchao_blockwise()
    if peer is None and peer_error:
        print(f"   torchao not importable ({peer_error}): its column shows '-'")
    rows_wall, rows_split = [], []
    for m, k, n in sizes.layer_shapes:
        print(f"-- layer M={m} K={k} N={n}", flush=True)
        torch._dynamo.reset()  # a new shape compiles static, not as a recompile with dynamic shapes
        torch.manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        nxt = rotating(lambda _: (torch.randn(m, k, device=device, dtype=torch.bfloat16).requires_grad_(),
                                  torch.randn(m, n, device=device, dtype=torch.bfloat16)), 2 * (m * k + m * n))

        def arm_of(module: nn.Module, compiled: str | None = None):
            def build():
                def step():
                    x, dy = nxt()  # noqa: F821
                    x.grad = None
                    base.weight.grad = None  # noqa: F821
                    module(x).backward(dy)

                if compiled:
                    compiled_warmup(compiled, lambda: [step() for _ in range(max(opts.warmup, COMPILED_WARMUP))])
                else:
                    for _ in range(opts.warmup):
                        step()
                sample = lambda: time_calls(step, opts.layer_calls, device)  # noqa: E731
                return watch_recompiles(compiled, sample) if compiled else sample
            return build

        def compiled_arm(name: str, make: Callable[[], nn.Module]) -> Arm:
            return setup_arm(name, lambda: arm_of(compile_module(make(), opts),
                                                  compiled=name)())

        arms: dict[str, Arm] = {"BF16": setup_arm("BF16", arm_of(base))}
        if opts.compile_peers:
            arms["BF16 compile"] = compiled_arm("BF16 compile", lambda: base)  # noqa: F821
        arms["FP8 eager"] = setup_arm("FP8 eager",
                                      lambda: arm_of(FP8BlockLinear.from_linear(base, Fp8Config()))())  # noqa: F821
        arms["FP8 compile"] = compiled_arm("FP8 compile",
                                           lambda: FP8BlockLinear.from_linear(base, Fp8Config()))  # noqa: F821
        if peer is not None:
            arms["torchao"] = setup_arm("torchao", lambda: arm_of(peer[0].from_float(base))())  # noqa: F821
            if opts.compile_peers:
                arms["torchao compile"] = compiled_arm("torchao compile",
                                                       lambda: peer[0].from_float(base))  # noqa: F821
        interleave(list(arms.values()), opts.repeats)
        names = list(arms)
        bf16 = arms["BF16"]
        rows_wall.append([str(m), str(k), str(n)] + [cell(arms[a], "wall") for a in names]
                         + [paired_ratio(bf16, arms[a], "wall") for a in names if a != "BF16"])
        rows_split.append([str(m), str(k), str(n)]
                          + [f"{cell(arms[a], 'gpu')} / {cell(arms[a], 'host')}" for a in names])
        # each shape's row as soon as it is done: a run cut by a time limit keeps the shapes it finished
        print("   row: " + " | ".join(f"{a} {cell(arms[a], 'wall')} ms" for a in names) + " | "
              + " | ".join(f"BF16/{a} {paired_ratio(bf16, arms[a], 'wall')}" for a in names if a != "BF16"),
              flush=True)
        # ruff checks the closures above as if they ran after this del: their noqa F821 (astral-sh/ruff#9858)
        del arms, base, nxt
        free_memory()
    print(f"\n### layer: forward+backward per call (ms, median [min-max] of {opts.repeats} rounds of "
          f"{opts.layer_calls} calls)")
    table(["M", "K", "N"] + [f"{a} ms" for a in names] + [f"BF16/{a}" for a in names if a != "BF16"], rows_wall)
    print("\n### layer: GPU kernel time / host time per call (ms)")
    table(["M", "K", "N"] + [f"{a} gpu / host" for a in names], rows_split)
    print("gpu: the calls queued behind a sleep kernel (no host gaps); '-' if the sleep ran out first (a host "
          "sync inside the step). host: CPU time to issue one call. wall ~ host: host-bound.", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# model (fwd + bwd + AdamW)


def build_llama(layers: int, hidden: int, intermediate: int, vocab: int, device, seed: int = 0, *,
                heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
                dtype: torch.dtype = torch.bfloat16):
    """Random-weight Llama in ``dtype`` (bf16 by default), sdpa attention, untied LM head (as calclip's tests); head
    dim 128 and no grouped-query attention unless ``heads`` / ``kv_heads`` / ``head_dim`` say otherwise. The KV cache
    stays on in the config (the decode benchmarks generate with it); training steps call ``training_loss``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    heads = heads or max(1, hidden // 128)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                         head_dim=head_dim or hidden // heads, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model


def training_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The LM loss of a training step on ``ids`` (labels = inputs), with the KV cache off: without it the forward
    builds a DynamicCache the compiled graph guards on (the compiled BF16 arm recompiled during timed rounds)."""
    return model(input_ids=ids, labels=ids, use_cache=False).loss


# ModelRow.arch -> transformers config class name
ROW_ARCHS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
             "phi3": "Phi3Config"}


def build_row_model(row: ModelRow, vocab: int, device, seed: int = 0) -> nn.Module:
    if row.arch == "llama":
        return build_llama(row.layers, row.hidden, row.intermediate, vocab, device, seed, heads=row.heads,
                           kv_heads=row.kv_heads, head_dim=row.head_dim)
    import transformers

    config = getattr(transformers, ROW_ARCHS[row.arch])(
        vocab_size=vocab, hidden_size=row.hidden, intermediate_size=row.intermediate, num_hidden_layers=row.layers,
        num_attention_heads=row.heads, num_key_value_heads=row.kv_heads,
        head_dim=row.head_dim or row.hidden // row.heads, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


def parse_model_rows(text: str) -> tuple[ModelRow, ...]:
    """``--models``: comma-separated rows, each a name of NAMED_MODELS (optionally ``name:LAYERS`` or
    ``name:LAYERS:BATCH``), ``HIDDEN:INTERMEDIATE:HEADS:KV_HEADS:LAYERS[:BATCH]``, or the synthetic
    ``LAYERSxHIDDENxINTERMEDIATE`` (head dim 128, no GQA). Raises ValueError naming the bad item."""
    rows = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, *numbers = item.split(":")
        try:
            if name.lower() in NAMED_MODELS:
                if len(numbers) > 2:
                    raise ValueError("a named row takes at most :LAYERS:BATCH")
                row = NAMED_MODELS[name.lower()]
                values = [int(v) for v in numbers]
                row = dataclasses.replace(row, layers=values[0] if values else row.layers,
                                          batch=values[1] if len(values) > 1 else row.batch)
            elif numbers:
                values = [int(v) for v in (name, *numbers)]
                if len(values) not in (5, 6):
                    raise ValueError("expected HIDDEN:INTERMEDIATE:HEADS:KV_HEADS:LAYERS[:BATCH]")
                hidden, inter, heads, kv_heads, layers = values[:5]
                if min(values) < 1 or heads % kv_heads or hidden % heads:
                    raise ValueError("need positive ints, HEADS a multiple of KV_HEADS, HIDDEN of HEADS")
                row = ModelRow("dims", hidden, inter, heads, kv_heads, layers,
                               batch=values[5] if len(values) == 6 else None)
            elif "x" in name:
                layers, hidden, inter = (int(v) for v in name.split("x"))
                row = ModelRow("dims", hidden, inter, max(1, hidden // 128), max(1, hidden // 128), layers)
            else:
                raise ValueError(f"unknown architecture; named ones: {', '.join(NAMED_MODELS)}")
        except ValueError as err:
            raise ValueError(f"--models: {item!r}: {err}") from None
        if min(row.layers, row.batch or 1, row.hidden, row.intermediate) < 1:
            raise ValueError(f"--models: {item!r}: sizes must be positive")
        rows.append(row)
    if not rows:
        raise ValueError(f"--models: no rows in {text!r}")
    return tuple(rows)


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree holding the very same Parameter objects (buffers are copied)."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def calclip_fp8_copy(model: nn.Module, options: dict | None = None) -> nn.Module:
    from calclip.fp8 import Fp8Config, quantize_model

    return quantize_model(sharing_copy(model), Fp8Config(**(options or {})))


def torchao_copy(model: nn.Module, peer) -> nn.Module:
    _, config_cls, quantize_ = peer
    converted = sharing_copy(model)
    quantize_(converted, config_cls(), filter_fn=not_lm_head)
    return converted


# --model-arms keys -> column names. "FP8+": calclip FP8 with --fp8-options (the same arms with other Fp8Config
# fields, e.g. scaled_mm_row_scales=false, to measure a speed lever against the default in one run).
# "r" arms: each decoder layer compiled on its own (regional compilation, the trainer's compile_layers).
MODEL_ARMS = {"bf16": "BF16", "bf16c": "BF16 compile", "fp8": "FP8 eager", "fp8c": "FP8 compile",
              "fp8x": "FP8+ eager", "fp8xc": "FP8+ compile", "torchao": "torchao", "torchaoc": "torchao compile",
              "bf16r": "BF16 by layer", "fp8r": "FP8 by layer", "fp8xr": "FP8+ by layer",
              "fp8y": "FP8B eager", "fp8yc": "FP8B compile", "fp8yr": "FP8B by layer"}


def model_arm_keys(opts) -> list[str]:
    """The model section's arms: --model-arms, or BF16 eager/compiled, FP8 eager/compiled and torchao eager (plus
    the FP8+ arms with --fp8-options, torchao compiled with --compile-peers). BF16 eager always runs first: it is
    every ratio's baseline and makes the optimizer state the arms share."""
    if opts.model_arms:
        keys = [k.strip() for k in opts.model_arms.split(",") if k.strip()]
    else:
        keys = ["bf16", "bf16c", "fp8", "fp8c"] + (["fp8x", "fp8xc"] if opts.fp8_options else [])
        if not opts.no_torchao:
            keys += ["torchao"] + (["torchaoc"] if opts.compile_peers else [])
    unknown = [k for k in keys if k not in MODEL_ARMS]
    if unknown:
        raise ValueError(f"--model-arms: unknown arm(s) {unknown}; choose from {list(MODEL_ARMS)}")
    if any(k.startswith("fp8x") for k in keys) and not opts.fp8_options:
        raise ValueError("--model-arms fp8x/fp8xc/fp8xr need --fp8-options (the Fp8Config fields they change)")
    if any(k.startswith("fp8y") for k in keys) and not opts.fp8_options_b:
        raise ValueError("--model-arms fp8y/fp8yc/fp8yr need --fp8-options-b (the Fp8Config fields they change)")
    return ["bf16"] + [k for k in dict.fromkeys(keys) if k != "bf16"]


def parse_fp8_options(text: str | None, flag: str = "--fp8-options") -> dict:
    """``--fp8-options KEY=VALUE,...`` -> Fp8Config keyword arguments (true/false, ints, None, a tuple of strings
    where the value holds ";" (``keep_patterns=lm_head;self_attn``), else strings), checked by building an
    Fp8Config."""
    if not text:
        return {}
    from calclip.fp8 import Fp8Config

    options = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        lowered = value.strip().lower()
        if ";" in value:
            parsed = tuple(part.strip() for part in value.split(";") if part.strip())
        elif lowered in ("true", "false"):
            parsed = lowered == "true"
        elif lowered == "none":
            parsed = None
        else:
            try:
                parsed = int(value)
            except ValueError:
                parsed = value.strip()
        options[key.strip()] = parsed
    try:
        Fp8Config(**options)
    except TypeError as err:
        raise ValueError(f"{flag}: {err}") from None
    return options


def model_arm_makers(base: nn.Module, opts, peer) -> dict[str, Callable[[], nn.Module]]:
    """--model-arms key -> a function making that arm's model from the BF16 ``base`` (sharing its Parameters)."""
    return {
        "bf16": lambda: base,
        "bf16c": lambda: compile_module(base, opts),
        "fp8": lambda: calclip_fp8_copy(base),
        "fp8c": lambda: compile_module(calclip_fp8_copy(base), opts),
        "fp8x": lambda: calclip_fp8_copy(base, opts.fp8_options),
        "fp8xc": lambda: compile_module(calclip_fp8_copy(base, opts.fp8_options), opts),
        "fp8y": lambda: calclip_fp8_copy(base, opts.fp8_options_b),
        "fp8yc": lambda: compile_module(calclip_fp8_copy(base, opts.fp8_options_b), opts),
        "torchao": lambda: torchao_copy(base, peer),
        "torchaoc": lambda: compile_module(torchao_copy(base, peer), opts),
        "bf16r": lambda: compile_by_layer(sharing_copy(base), opts),
        "fp8r": lambda: compile_by_layer(calclip_fp8_copy(base), opts),
        "fp8xr": lambda: compile_by_layer(calclip_fp8_copy(base, opts.fp8_options), opts),
        "fp8yr": lambda: compile_by_layer(calclip_fp8_copy(base, opts.fp8_options_b), opts),
    }


def model_section(opts, sizes: Sizes) -> None:
    device = torch.device(sizes.device)
    keys = opts.model_arm_keys
    peer, peer_error = torchao_blockwise() if {"torchao", "torchaoc"} & set(keys) else (None, None)
    if peer is None and peer_error:
        print(f"   torchao not importable ({peer_error}): its columns show '-'")
    names = [MODEL_ARMS[k] for k in keys]
    results: list[tuple[ModelRow, dict[str, Arm], dict[str, dict]]] = []
    for row in sizes.model_rows:
        batch = row.batch or sizes.batch
        print(f"-- model {row.label}, {batch}x{sizes.seq} tokens", flush=True)
        torch._dynamo.reset()
        free_memory()
        sync(device)
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        outside = torch.cuda.memory_allocated() if cuda else 0
        base = build_row_model(row, sizes.vocab, device)
        base.train()
        optimizer = torch.optim.AdamW(base.parameters(), lr=1e-5, fused=cuda)
        gen = torch.Generator(device="cpu").manual_seed(1)
        batches = [torch.randint(3, sizes.vocab, (batch, sizes.seq), generator=gen).to(device) for _ in range(2)]
        shared = {"bytes": 0}
        info: dict[str, dict] = {}

        def arm_of(name: str, forward: Callable, compiled: bool, first: bool = False, shorter_first: bool = False):
            def build():
                counter = {"i": 0}
                tally = info.setdefault(name, {})

                def step(shorter: int = 0):
                    ids = batches[counter["i"] % len(batches)]  # noqa: F821
                    counter["i"] += 1
                    cut = min(shorter, ids.shape[1] // 2)  # --tiny's 32 tokens: 16
                    training_loss(forward, ids[:, :ids.shape[1] - cut] if cut else ids).backward()
                    optimizer.step()  # noqa: F821
                    optimizer.zero_grad(set_to_none=True)  # noqa: F821

                sync(device)
                before = torch.cuda.memory_allocated() if cuda else 0
                graphs, breaks = graphs_compiled(), graph_break_counts()
                t0 = time.perf_counter()
                # the first step: compile (compiled arms), Triton autotuning and JIT, allocation; shorter_first: at
                # a shorter length, so the next step recompiles with automatic dynamic shapes
                step(AUTO_DYNAMIC_SHORTER if shorter_first else 0)
                sync(device)
                tally["first_s"] = time.perf_counter() - t0
                for _ in range((max(opts.warmup, COMPILED_WARMUP) if compiled else opts.warmup) - 1):
                    step()
                sync(device)
                tally["warmup_s"] = time.perf_counter() - t0
                if compiled:
                    tally["graphs"] = graphs_compiled() - graphs
                    tally["breaks"] = sum(max(0, c - breaks.get(r, 0)) for r, c in graph_break_counts().items())
                    tally["top_breaks"] = top_graph_breaks(breaks)
                    tally["recompiled"] = 0
                print(f"   {name}: first step {tally['first_s']:.1f} s, warm-up {tally['warmup_s']:.1f} s"
                      + (f", {tally['graphs']} graph(s), {tally['breaks']} graph break(s)" if compiled else ""),
                      flush=True)
                # what this arm keeps between steps (its FP8 weight cache); the first arm's is the optimizer
                # state, which every arm uses and shared["bytes"] counts
                own = 0 if first else (torch.cuda.memory_allocated() if cuda else 0) - before

                def sample():
                    sync(device)
                    if cuda:
                        start_alloc = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    for _ in range(opts.model_steps):
                        step()
                    sync(device)
                    ms = (time.perf_counter() - t0) / opts.model_steps * 1e3
                    peak = math.nan
                    if cuda:
                        peak = (torch.cuda.max_memory_allocated() - start_alloc + shared["bytes"] + own) / 2**30
                    return {"ms": ms, "peak": peak}

                return watch_recompiles(name, sample, tally) if compiled else sample
            return build

        makers = model_arm_makers(base, opts, peer)
        arms: dict[str, Arm] = {"BF16": setup_arm("BF16", arm_of("BF16", base, compiled=False, first=True))}
        # weights + optimizer state, common to every arm (the BF16 arm's warm-up created the optimizer state)
        shared["bytes"] = (torch.cuda.memory_allocated() - outside) if cuda else 0
        for key in keys[1:]:
            name = MODEL_ARMS[key]
            if key.startswith("torchao") and peer is None:
                arms[name] = Arm(name, error="torchao not importable")
                continue
            make = makers[key]
            arms[name] = setup_arm(name, lambda make=make, name=name, key=key: arm_of(
                name, make(), compiled=key.endswith(("c", "r")),
                shorter_first=key.endswith("r") and opts.by_layer_auto_dynamic)())
        interleave(list(arms.values()), opts.repeats)
        print_model_row(row, batch, sizes, arms, info, names)
        results.append((row, arms, info))
        for arm in arms.values():  # the summary reads the samples; the closures hold the models, codes, compiled layers
            arm.sample = None
        if opts.peak_per_process and cuda:
            del arms, optimizer, base
            free_memory()
            print_solo_peaks(row, batch, keys, opts)
            arms = base = optimizer = None
        # ruff checks step above as if it ran after this del: its noqa F821 (astral-sh/ruff#9858)
        del arms, base, optimizer, batches, makers
        free_memory()
    print_model_summary(results, sizes, opts)


def print_model_row(row: ModelRow, batch: int, sizes: Sizes, arms: dict[str, Arm], info: dict[str, dict],
                    names: list[str]) -> None:
    """One model row's table: step ms, speed vs BF16 eager, peak memory, first-step and warm-up seconds, and the
    compiled arms' graphs, graph breaks and graphs compiled during timed rounds (dynamo's counters)."""
    bf16 = arms["BF16"]
    fastest = fastest_bf16(arms)
    rows = []
    for name in names:
        arm, tally = arms.get(name), info.get(name, {})
        compiled = "graphs" in tally
        rows.append([name, cell(arm, "ms", 1), "1.00x" if name == "BF16" else paired_ratio(bf16, arm, "ms"),
                     "-" if fastest is None else paired_ratio(fastest, arm, "ms"), cell(arm, "peak", 2),
                     f"{tally['first_s']:.1f}" if "first_s" in tally else "-",
                     f"{tally['warmup_s']:.1f}" if "warmup_s" in tally else "-",
                     f"{tally['graphs']} / {tally['breaks']} / {tally['recompiled']}" if compiled else "-"])
    print(f"\n### model {row.label}: fwd+bwd+AdamW(fused) step, {batch}x{sizes.seq} tokens, vocab {sizes.vocab} "
          f"(median [min-max] of the rounds)")
    table(["arm", "ms per step", "BF16 eager / arm", f"fastest BF16 ({fastest.name if fastest else '-'}) / arm",
           "peak GiB", "first step s", "warm-up s", "graphs / breaks / recompiled in timed rounds"], rows)
    for name in names:
        if info.get(name, {}).get("top_breaks"):
            print(f"   {name} graph breaks: {info[name]['top_breaks']}")
    sys.stdout.flush()


def fastest_bf16(arms: dict[str, Arm]) -> Arm | None:
    """The BF16 arm (eager, compiled or by layer) with the lowest median step time: the baseline issue 38's ratios
    use (the fastest BF16 configuration measured in the same run)."""
    timed = [a for n, a in arms.items() if n.startswith("BF16") and a.values("ms")]
    return min(timed, key=lambda a: statistics.median(a.values("ms"))) if timed else None


def row_spec(row: ModelRow, batch: int) -> str | None:
    """``--models`` text that rebuilds ``row`` in another process (named rows), or None."""
    if row.name in NAMED_MODELS and dataclasses.replace(NAMED_MODELS[row.name], layers=row.layers,
                                                        batch=row.batch) == row:
        return f"{row.name}:{row.layers}:{batch}"
    return None


def print_solo_peaks(row: ModelRow, batch: int, keys: list[str], opts) -> None:
    """--peak-per-process: each arm's peak memory in a process of its own (the model, its gradients, the AdamW state,
    the arm's own buffers and its step's transients: what a user's run of that configuration holds), and its ratio to
    the BF16 arms' lowest."""
    spec = row_spec(row, batch)
    if spec is None:
        print(f"   --peak-per-process: row {row.label} is not a named row; skipped")
        return
    import subprocess

    passed = ["--models", spec, "--compile-backend", opts.compile_backend, "--warmup", str(opts.warmup),
              "--model-steps", str(opts.model_steps)]
    for flag, value in (("--fp8-options", opts.fp8_options_text), ("--fp8-options-b", opts.fp8_options_b_text),
                        ("--compile-mode", opts.compile_mode), ("--seq-len", opts.seq_len and str(opts.seq_len))):
        if value:
            passed += [flag, value]
    for flag in ("by_layer_static", "by_layer_auto_dynamic"):
        if getattr(opts, flag):
            passed.append("--" + flag.replace("_", "-"))
    peaks: dict[str, float] = {}
    for key in keys:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--only", "model", "--solo-peak", key,
                               *passed], capture_output=True, text=True)
        found = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("SOLO_PEAK_GIB ")]
        peaks[MODEL_ARMS[key]] = float(found[-1]) if found and done.returncode == 0 else math.nan
        if not found:
            print(f"   !! solo peak of {MODEL_ARMS[key]} failed: {(done.stdout + done.stderr)[-800:]}", flush=True)
    bf16 = [v for n, v in peaks.items() if n.startswith("BF16") and not math.isnan(v)]
    low = min(bf16) if bf16 else math.nan
    print(f"\n### model {row.label}: peak GiB, one arm per process (lowest BF16 = {low:.2f} GiB)")
    table(["arm", "peak GiB", "peak / lowest BF16"], [[n, f"{v:.2f}", f"{v / low:.3f}"] for n, v in peaks.items()])
    sys.stdout.flush()


def solo_peak(opts, sizes: Sizes) -> int:
    """``--solo-peak KEY``: build the row's model and that one arm, warm it up, then print the process's peak allocated
    memory over ``--model-steps`` steps (``SOLO_PEAK_GIB x``), for print_solo_peaks."""
    device = torch.device(sizes.device)
    row = sizes.model_rows[0]
    batch = row.batch or sizes.batch
    peer = torchao_blockwise()[0] if opts.solo_peak.startswith("torchao") else None
    base = build_row_model(row, sizes.vocab, device)
    base.train()
    forward = model_arm_makers(base, opts, peer)[opts.solo_peak]()
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-5, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(3, sizes.vocab, (batch, sizes.seq), generator=gen).to(device)
    compiled = opts.solo_peak.endswith(("c", "r"))
    for i in range((max(opts.warmup, COMPILED_WARMUP) if compiled else opts.warmup) + opts.model_steps):
        if i == (max(opts.warmup, COMPILED_WARMUP) if compiled else opts.warmup) and device.type == "cuda":
            sync(device)
            torch.cuda.reset_peak_memory_stats()
        training_loss(forward, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else math.nan
    print(f"SOLO_PEAK_GIB {peak:.4f}", flush=True)
    return 0


# (column, numerator arm, denominator arm, metric): "speed" columns are den time / num time (> 1: num faster); the
# "peak" columns num peak / den peak (< 1: num uses less memory).
SUMMARY_COLUMNS = (
    ("FP8c vs BF16c", "FP8 compile", "BF16 compile", "ms"),
    ("FP8e vs BF16e", "FP8 eager", "BF16", "ms"),
    ("FP8e vs torchao e", "FP8 eager", "torchao", "ms"),
    ("BF16c vs BF16e", "BF16 compile", "BF16", "ms"),
    ("FP8+c vs FP8c", "FP8+ compile", "FP8 compile", "ms"),
    ("FP8+e vs FP8e", "FP8+ eager", "FP8 eager", "ms"),
    ("FP8r vs BF16c", "FP8 by layer", "BF16 compile", "ms"),
    ("FP8r vs BF16r", "FP8 by layer", "BF16 by layer", "ms"),
    ("FP8r vs FP8c", "FP8 by layer", "FP8 compile", "ms"),
    ("FP8+r vs FP8r", "FP8+ by layer", "FP8 by layer", "ms"),
    ("peak FP8c / BF16c", "FP8 compile", "BF16 compile", "peak"),
    ("peak FP8r / BF16c", "FP8 by layer", "BF16 compile", "peak"),
    ("peak FP8c / FP8+c", "FP8 compile", "FP8+ compile", "peak"),
    ("peak FP8r / FP8+r", "FP8 by layer", "FP8+ by layer", "peak"),
    ("peak FP8e / BF16e", "FP8 eager", "BF16", "peak"),
)


def summary_rows(results, names: list[str]) -> tuple[list[str], list[list[str]]]:
    """The columns of SUMMARY_COLUMNS whose arms ran, and one row per model: paired per-round ratios, then the
    first-step seconds of the compiled BF16 and FP8 arms."""
    columns = [c for c in SUMMARY_COLUMNS if c[1] in names and c[2] in names]
    compiled = [n for n in ("BF16 compile", "FP8 compile", "BF16 by layer", "FP8 by layer") if n in names]
    short = {"BF16 compile": "BF16c", "FP8 compile": "FP8c", "BF16 by layer": "BF16r", "FP8 by layer": "FP8r"}
    header = ["model"] + [c[0] for c in columns] + [f"first step s {' / '.join(short[n] for n in compiled)}"]
    rows = []
    for row, arms, info in results:
        cells = [row.label]
        for _, num, den, metric in columns:
            cells.append(paired_ratio(arms.get(den), arms.get(num), metric) if metric == "ms"
                         else paired_ratio(arms.get(num), arms.get(den), metric))
        first = [info.get(n, {}).get("first_s") for n in compiled]
        cells.append(" / ".join("-" if f is None else f"{f:.1f}" for f in first))
        rows.append(cells)
    return header, rows


def print_model_summary(results, sizes: Sizes, opts) -> None:
    if not results:
        return
    names = list(results[0][1])
    header, rows = summary_rows(results, names)
    options = f"; FP8+ = Fp8Config({', '.join(f'{k}={v!r}' for k, v in opts.fp8_options.items())})" \
        if opts.fp8_options else ""
    print(f"\n### model rows: ratios (median [min-max] of per-round ratios; {opts.repeats} rounds of "
          f"{opts.model_steps} steps{options})")
    table(header, rows)
    print("'A vs B': B's step time / A's (> 1: A is faster). 'peak A / B': A's peak memory over B's (< 1: A uses "
          "less). first step: compile + autotune + allocation on the first step of each compiled arm.", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# decode (HF generate)


def step_clock():
    """A logits processor recording a CUDA event per generated token (no sync): decode time without prefill."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.events: list[torch.cuda.Event] = []
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            if scores.is_cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.events.append(event)
            else:
                self.times.append(time.perf_counter())
            return scores

        def decode_seconds(self) -> tuple[float, int]:
            """(seconds from the first generated token to the last, decode steps in between)."""
            if self.events:
                self.events[-1].synchronize()
                return self.events[0].elapsed_time(self.events[-1]) / 1e3, len(self.events) - 1
            return self.times[-1] - self.times[0], len(self.times) - 1

    return StepClock()


def decode_section(opts, sizes: Sizes) -> None:
    import transformers
    from transformers import LogitsProcessorList

    transformers.logging.set_verbosity_error()  # generation-flag warnings would drown the table
    device = torch.device(sizes.device)
    layers, hidden, inter = sizes.decode_model
    torch._dynamo.reset()
    free_memory()
    base = build_llama(layers, hidden, inter, sizes.vocab, device).eval()
    models = {"BF16": base, "FP8": calclip_fp8_copy(base).eval()}
    settings = {"eager": {}, "graphed": {"cache_implementation": "static"}}
    new = sizes.new_tokens
    results: dict[tuple[int, str], dict[str, Arm]] = {}
    for batch in sizes.decode_batches:
        gen = torch.Generator(device="cpu").manual_seed(batch)
        prompt = torch.randint(3, sizes.vocab, (batch, sizes.prompt), generator=gen).to(device)
        mask = torch.ones_like(prompt)
        for setting, extra in settings.items():
            print(f"-- decode batch {batch}, {setting}", flush=True)
            if extra:  # compile this batch's decode step with static shapes, as a run with one batch size would
                torch._dynamo.reset()

            def arm_of(name: str, model: nn.Module):
                def generate_once() -> dict[str, float]:
                    clock = step_clock()
                    sync(device)
                    t0 = time.perf_counter()
                    out = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new,
                                         min_new_tokens=new, do_sample=False, pad_token_id=0,
                                         logits_processor=LogitsProcessorList([clock]), **extra)
                    sync(device)
                    wall = time.perf_counter() - t0
                    expected = (batch, sizes.prompt + new)  # min_new_tokens = max_new_tokens: equal lengths
                    if tuple(out.shape) != expected:
                        raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {expected}")
                    seconds, steps = clock.decode_seconds()
                    return {"ms_step": seconds / steps * 1e3, "tok_s": batch * steps / seconds, "wall": wall}

                def build():
                    label = f"{name} {setting} b{batch}"
                    if setting == "graphed" and device.type == "cuda":
                        compiled_warmup(label, lambda: [generate_once() for _ in range(2)])  # compile + record
                        return watch_recompiles(label, generate_once)
                    generate_once()
                    return generate_once
                return build

            arms = {name: setup_arm(name, arm_of(name, model)) for name, model in models.items()}
            interleave(list(arms.values()), opts.decode_repeats)
            results[(batch, setting)] = arms
    del models, base
    free_memory()

    rows = []
    for (batch, setting), arms in results.items():
        rows.append([str(batch), setting, cell(arms["BF16"], "tok_s", 0), cell(arms["BF16"], "ms_step", 2),
                     cell(arms["FP8"], "tok_s", 0), cell(arms["FP8"], "ms_step", 2),
                     paired_ratio(arms["FP8"], arms["BF16"], "tok_s")])
    for batch in sizes.decode_batches:  # each arm at its best setting (median tokens/s)
        best = {}
        for name in ("BF16", "FP8"):
            options = [(statistics.median(results[(batch, s)][name].values("tok_s")), s)
                       for s in settings if results[(batch, s)][name].values("tok_s")]
            best[name] = max(options) if options else None
        cells = []
        for name in ("BF16", "FP8"):
            if best[name] is None:
                cells += ["err", "err"]
            else:
                arm = results[(batch, best[name][1])][name]
                cells += [f"{cell(arm, 'tok_s', 0)} ({best[name][1]})", cell(arm, "ms_step", 2)]
        ratio = f"{best['FP8'][0] / best['BF16'][0]:.2f}x" if best["BF16"] and best["FP8"] else "err"
        rows.append([str(batch), "best of each"] + cells + [ratio])
    print(f"\n### decode: HF generate, {layers}L h{hidden} i{inter}, prompt {sizes.prompt}, {new} new tokens, greedy "
          f"(median [min-max] of {opts.decode_repeats} rounds)")
    table(["batch", "setting", "BF16 tok/s", "BF16 ms/step", "FP8 tok/s", "FP8 ms/step", "FP8/BF16 tok/s"], rows)
    print("tok/s and ms/step over the decode steps (after the first token); graphed = cache_implementation='static' "
          "(transformers compiles the decode step, mode reduce-overhead, on CUDA only). 'best of each': each arm "
          "at its faster setting.", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# trainer (bench_trainer_step.py's machinery)


def summarize_runs(times: dict[str, list[float]], base: str, *, run_over_base: bool = False) -> list[list[str]]:
    """One row per run: median [min-max] and mean step time over all its timed steps, and the ratios to
    ``base`` of medians and of means: base / run (> 1: faster), or run / base with ``run_over_base``."""
    ref = times.get(base) or []
    rows = []
    for name, values in times.items():
        if not values:
            rows.append([name, "err", "err", "-", "-"])
            continue
        med, mean = statistics.median(values), statistics.fmean(values)
        ratios = ["-", "-"]
        if ref:
            pairs = ((statistics.median(ref), med), (statistics.fmean(ref), mean))
            ratios = [f"{(r / b if run_over_base else b / r):.2f}x" for b, r in pairs]
        rows.append([name, f"{med:.3f} [{min(values):.3f}-{max(values):.3f}]", f"{mean:.3f}", *ratios])
    return rows


def trainer_runs(bts) -> dict[str, dict]:
    """bench_trainer_step's runs plus the same with TrainingArguments.torch_compile (the training forward), with
    compile_generation (CUDA-graphed HF decode), and with both."""
    runs = dict(bts.RUNS)
    for precision in ("bf16", "fp8"):
        base = bts.RUNS[f"{precision}_static"]
        runs[f"{precision}_compile"] = {**base, "torch_compile": True}
        runs[f"{precision}_graphed_gen"] = {**base, "compile_generation": True}
        # transformers' own new static cache per rollout (its moved addresses re-record the CUDA graphs)
        runs[f"{precision}_graphed_gen_fresh"] = {**base, "compile_generation": True, "keep_generation_cache": False}
        runs[f"{precision}_compile_all"] = {**base, "torch_compile": True, "compile_generation": True}
        # compile_layers: the decoder layers compiled one by one for training (default on for FP8 on CUDA)
        runs[f"{precision}_eager"] = {**base, "compile_layers": False}
        runs[f"{precision}_layers"] = {**base, "compile_layers": True}
    return runs


def trainer_section(opts, sizes: Sizes) -> None:
    import bench_trainer_step as bts
    from calclip.models.tiny import build_tiny_tokenizer
    from calclip.trainers import CalibratedGRPOConfig, CalibratedGRPOTrainer
    from tests.fixtures import digit_share_reward, tiny_prompt_dataset

    known = trainer_runs(bts)
    runs = [r.strip() for r in opts.trainer_runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in known]
    if unknown or not runs:
        raise ValueError(f"--trainer-runs: unknown run(s) {unknown}; choose from {list(known)}")
    tokenizer = build_tiny_tokenizer()
    dataset = tiny_prompt_dataset(256)
    layers, hidden, inter = sizes.trainer_model
    model_fn = bts.model_builder(tokenizer, layers=layers, hidden=hidden, intermediate=inter)
    cpu = {} if torch.cuda.is_available() else {"bf16": False}
    times: dict[str, list[float]] = {r: [] for r in runs}
    for rnd in range(opts.run_rounds):
        for name in runs:
            print(f"-- trainer {name}, round {rnd + 1}/{opts.run_rounds}", flush=True)
            try:
                with quiet(f"trainer {name}"):
                    warmup_times: list[float] = []
                    step_times, _, model = bts.timed_steps(
                        CalibratedGRPOTrainer, CalibratedGRPOConfig, model_fn=model_fn, tokenizer=tokenizer,
                        dataset=dataset, reward=digit_share_reward, overrides={**known[name], **cpu},
                        steps=opts.trainer_steps, warmup=opts.trainer_warmup,
                        completion_length=sizes.completion_length, warmup_times=warmup_times)
                times[name] += step_times
                # the first step pays compile and autotuning (less on a warm Inductor/Triton cache: a second process)
                print(f"   warm-up steps (s): {' '.join(f'{t:.3f}' for t in warmup_times)}", flush=True)
                print(f"   steps (s): {' '.join(f'{t:.3f}' for t in step_times)}", flush=True)
                del model
            except Exception as err:  # noqa: BLE001
                print(f"   !! trainer {name} failed: {short_error(err)}", flush=True)
            free_memory()
    print(f"\n### trainer: bench_trainer_step.py default config (Llama {layers}L h{hidden} i{inter}, HF generate), "
          f"optimizer-step time (s), {opts.run_rounds} round(s) x {opts.trainer_steps} timed steps after "
          f"{opts.trainer_warmup} warm-up")
    # the ratios' baseline is the first run named (--trainer-runs' order), not necessarily a BF16 one
    table(["run", "median step s [min-max]", "mean step s", f"{runs[0]} / run (median)", f"{runs[0]} / run (mean)"],
          summarize_runs(times, runs[0]))
    print("The mean covers whole generation cycles (generation every steps_per_generation / GA = 2 steps) when "
          "the timed steps per round are even.", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# smollm (`calclip train` equivalents)


SMOLLM_CONFIGS = {"bf16_static": "configs/bf16_static.yaml", "fp8_calibrated": "configs/fp8_calibrated.yaml"}


def smollm_section(opts, sizes: Sizes) -> None:
    import bench_trainer_step as bts
    from calclip.cli.arguments import parse_train_args, resolve_dtype
    from calclip.cli.train import build_trainer
    from calclip.models import load_model

    steps = opts.smollm_warmup + opts.smollm_steps
    loaded: dict[tuple[str, str], tuple] = {}
    runs = {name: (config, []) for name, config in SMOLLM_CONFIGS.items()}
    if opts.smollm_graphed:  # the same runs with CUDA-graphed HF decode (compile_generation)
        runs.update({f"{name}+graphed": (config, ["--compile_generation", "true"])
                     for name, config in SMOLLM_CONFIGS.items()})
    if opts.smollm_fused is not None:  # the FP8 run with an explicit fp8_decode_fused_max_m (0: two launches)
        label = f"+fused{opts.smollm_fused}" if opts.smollm_fused else "+unfused"
        runs.update({f"{name}{label}": (config, ["--fp8_decode_fused_max_m", str(opts.smollm_fused)])
                     for name, config in SMOLLM_CONFIGS.items() if name.startswith("fp8")})
    if opts.smollm_grouped:  # the FP8 run with q/k/v and gate/up as one fused decode launch each
        runs.update({f"{name}+grouped": (config, ["--fp8_decode_group_siblings", "true"])
                     for name, config in SMOLLM_CONFIGS.items() if name.startswith("fp8")})
    times: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as out:
        for rnd in range(opts.run_rounds):
            for name, (config, extra) in runs.items():
                print(f"-- smollm {name}, round {rnd + 1}/{opts.run_rounds}", flush=True)
                argv = ["--config", str(ROOT / config), "--max_steps", str(steps), "--report_to", "none",
                        "--output_dir", str(Path(out) / name), "--save_strategy", "no", "--logging_steps", "1",
                        "--model_dtype", opts.smollm_dtype, *extra]
                argv += shlex.split(opts.smollm_args)
                if opts.tiny:
                    argv += ["--model_name_or_path", "tiny", "--max_completion_length", str(sizes.completion_length),
                             "--num_train_examples", "64"]
                try:
                    script_args, training_args = parse_train_args(argv)
                    key = (script_args.model_name_or_path, script_args.model_dtype)
                    if key not in loaded:
                        t0 = time.perf_counter()
                        loaded[key] = load_model(key[0], dtype=resolve_dtype(key[1]))
                        print(f"   loaded {key[0]} ({key[1]}) in {time.perf_counter() - t0:.1f} s", flush=True)
                    model, tokenizer = loaded[key]
                    step_times: list[float] = []
                    with quiet(f"smollm {name}"):
                        trainer = build_trainer(script_args, training_args, model=copy.deepcopy(model),
                                                tokenizer=tokenizer, callbacks=[bts.step_timer(step_times)])
                        trainer.train()
                    times[name] += step_times[opts.smollm_warmup:]
                    print(f"   steps (s): {' '.join(f'{t:.3f}' for t in step_times)} (first "
                          f"{opts.smollm_warmup} untimed)", flush=True)
                    del trainer
                except Exception as err:  # noqa: BLE001
                    print(f"   !! smollm {name} failed: {short_error(err)}", flush=True)
                free_memory()
    rows = summarize_runs(times, "bf16_static", run_over_base=True)  # the target states this row as FP8 / BF16
    print(f"\n### smollm: `calclip train` on SmolLM2-135M-Instruct{' (tiny stand-in)' if opts.tiny else ''}, "
          f"master weights {opts.smollm_dtype}, optimizer-step time (s), {opts.run_rounds} round(s) x "
          f"{opts.smollm_steps} timed steps after {opts.smollm_warmup} warm-up")
    table(["config", "median step s [min-max]", "mean step s", "run/BF16 (median)", "run/BF16 (mean)"], rows)
    print("Ratios here are run time / BF16 time (the target's form: < 1.5x). Generation happens every "
          "4th step (steps_per_generation 4, GA 1): the mean over whole cycles is the throughput figure, the "
          "median is a training step without generation.", flush=True)


# ---------------------------------------------------------------------------------------------------------------


def header_line(sizes: Sizes) -> str:
    if sizes.device == "cuda":
        device = f"{torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})"
    else:
        device = "CPU (--tiny: FP8 emulated, shapes tiny, times meaningless)"
    return (f"bench_speed {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  commit {git_commit()}  torch {torch.__version__} "
            f"(cuda {torch.version.cuda})  triton {package_version('triton')}  transformers "
            f"{package_version('transformers')}  torchao {package_version('torchao')}  device {device}  "
            f"calclip switches {dispatch_switches()}")


# GPU defaults, and the smaller ones --tiny uses on the shared CPU machine; explicit flags win over both.
COUNT_DEFAULTS = {
    "repeats": (5, 2), "decode_repeats": (3, 2), "warmup": (3, 1), "layer_calls": (10, 3), "model_steps": (3, 1),
    "run_rounds": (2, 1), "trainer_steps": (2, 1), "trainer_warmup": (2, 1), "smollm_steps": (4, 1),
    "smollm_warmup": (2, 1),
}
COUNT_HELP = {
    "repeats": "interleaved rounds per arm (layer, model)",
    "decode_repeats": "interleaved generate calls per arm and setting (decode; FP8 eager takes ~4 s each today)",
    "warmup": "untimed calls/steps per arm before timing (layer, model)",
    "layer_calls": "calls per timed round (layer)",
    "model_steps": "optimizer steps per timed round (model)",
    "run_rounds": "interleaved short runs per arm (trainer, smollm)",
    "trainer_steps": "timed optimizer steps per run (trainer)",
    "trainer_warmup": "untimed first steps per run (trainer); torch_compile runs need two generation cycles (4): the "
                      "second rollout's new length recompiles TRL's log-prob forward with dynamic sizes",
    "smollm_steps": "timed optimizer steps per run (smollm)",
    "smollm_warmup": "untimed first steps per run (smollm)",
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, tiny shapes, fewer rounds, compile backend aot_eager: checks that every path runs")
    for name, (gpu, tiny) in COUNT_DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"{COUNT_HELP[name]} (default {gpu}; {tiny} with --tiny)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; "
                        "aot_eager with --tiny)")
    parser.add_argument("--layer-shapes", default=None,
                        help="layer rows as MxKxN,... (default: docs/benchmarks.md's three; the --tiny ones with "
                        "--tiny)")
    parser.add_argument("--models", default=None,
                        help="model rows, comma-separated: a named architecture (" + ", ".join(NAMED_MODELS)
                        + "; NAME:LAYERS or NAME:LAYERS:BATCH to change its layers / sequences), "
                        "HIDDEN:INTERMEDIATE:HEADS:KV_HEADS:LAYERS[:BATCH], or LAYERSxHIDDENxINTERMEDIATE "
                        f"(default: {','.join(DEFAULT_MODELS)}; the --tiny ones with --tiny)")
    parser.add_argument("--model-arms", default=None,
                        help=f"model section arms, comma-separated, of {list(MODEL_ARMS)} (default: bf16,bf16c,fp8,"
                        "fp8c,torchao; + fp8x,fp8xc with --fp8-options; + torchaoc with --compile-peers)")
    parser.add_argument("--fp8-options", default=None, metavar="KEY=VALUE,...",
                        help="Fp8Config fields of the FP8+ arms (model section), e.g. scaled_mm_row_scales=false: the "
                        "same model with a speed lever changed, beside the default FP8 arms; a value with ';' is a "
                        "tuple (keep_patterns=lm_head;self_attn keeps the attention projections in BF16)")
    parser.add_argument("--fp8-options-b", default=None, metavar="KEY=VALUE,...",
                        help="Fp8Config fields of the FP8B arms (fp8y, fp8yc, fp8yr): a second variant beside FP8+ in "
                        "the same interleaved run, e.g. resident_dgrad_codes=true")
    parser.add_argument("--peak-per-process", action="store_true",
                        help="model section: after each row, each arm's peak memory measured in a process of its own")
    parser.add_argument("--solo-peak", default=None, help=argparse.SUPPRESS)  # print_solo_peaks' child processes
    parser.add_argument("--by-layer-static", action="store_true",
                        help="the by-layer ('r') arms compile each layer with Dynamo's default shapes (static first, "
                             "as the whole-model arms) instead of the trainer's dynamic=True: what the symbolic token "
                             "count costs (torchao's tensorwise: 1.21x BF16 by layer static, 1.00x dynamic, H100)")
    parser.add_argument("--by-layer-auto-dynamic", action="store_true",
                        help="the by-layer arms compile with Dynamo's default shapes and take their first step "
                             f"{AUTO_DYNAMIC_SHORTER} tokens per sequence shorter, so the main length recompiles "
                             "them with automatic dynamic shapes (the sequence symbolic, batch and hidden static), as "
                             "a trainer's varying lengths would: whether that graph keeps the static speed")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode of the compiled arms, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--no-torchao", action="store_true",
                        help="leave torchao's Float8BlockwiseLinear out of the layer section and the model section's "
                             "default arms (its first call autotunes: 165 s at Qwen2.5-1.5B dims on the H200)")
    parser.add_argument("--compile-peers", action="store_true",
                        help="also time torch.compile'd BF16 and torchao arms (layer, model): more compile time")
    parser.add_argument("--trainer-runs", default="bf16_static,fp8_static",
                        help="runs compared (first = baseline): bench_trainer_step's bf16_static, fp8_static, "
                        "fp8_calibrated, and bf16_/fp8_ + compile (torch_compile=True), "
                        "graphed_gen (compile_generation=True), graphed_gen_fresh (the same with "
                        "keep_generation_cache=False), compile_all (both)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="TOKENS",
                        help="the model rows' tokens per sequence (default 2048; 32 with --tiny). An odd length, e.g. "
                             "2047 at 4 sequences (8188 tokens, not a multiple of 16), is a trainer's ragged "
                             "micro-batch: every forward/dgrad GEMM then runs torch._scaled_mm over padded rows")
    parser.add_argument("--trainer-model", default=None, metavar="LAYERS,HIDDEN,INTERMEDIATE",
                        help="the trainer section's random Llama (default 8,2048,8192: bench_trainer_step's; head dim "
                             "128), e.g. 8,1536,8960 for Qwen2.5-1.5B's widths")
    parser.add_argument("--smollm-dtype", default="float32", help="--model_dtype of the smollm runs")
    parser.add_argument("--smollm-graphed", action="store_true",
                        help="also time both smollm runs with --compile_generation true (CUDA-graphed decode)")
    parser.add_argument("--smollm-fused", type=int, default=None, metavar="M",
                        help="also time the FP8 smollm run with --fp8_decode_fused_max_m M (0: the two-launch decode; "
                             "the default run's is automatic: fused in eager CUDA decode)")
    parser.add_argument("--smollm-grouped", action="store_true",
                        help="also time the FP8 smollm run with --fp8_decode_group_siblings true (q/k/v and gate/up "
                             "one fused decode launch each)")
    parser.add_argument("--smollm-args", default="", help="more `calclip train` flags for both smollm runs, e.g. "
                        "'--torch_compile true'")
    opts = parser.parse_args(argv)
    if opts.by_layer_static and opts.by_layer_auto_dynamic:
        parser.error("--by-layer-static and --by-layer-auto-dynamic: choose one")
    opts.sections = [s.strip() for s in opts.only.split(",") if s.strip()]
    bad = [s for s in opts.sections if s not in SECTIONS]
    if bad or not opts.sections:
        parser.error(f"--only: unknown section(s) {bad}; choose from {SECTIONS}")
    for name, (gpu, tiny) in COUNT_DEFAULTS.items():
        if getattr(opts, name) is None:
            setattr(opts, name, tiny if opts.tiny else gpu)
        # >= 1 for warm-ups too: the first call/step pays autotuning, allocation and compilation
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.compile_backend is None:
        opts.compile_backend = "aot_eager" if opts.tiny else "inductor"
    if opts.layer_shapes is not None:
        text = opts.layer_shapes
        try:
            rows = tuple(tuple(int(v) for v in row.split("x")) for row in text.split(",") if row.strip())
        except ValueError:
            rows = ()
        if not rows or any(len(r) != 3 or min(r) < 1 for r in rows):
            parser.error(f"--layer-shapes: expected AxBxC,... of positive ints, got {text!r}")
        opts.layer_shapes = rows
    if opts.seq_len is not None and opts.seq_len < 1:
        parser.error(f"--seq-len must be >= 1, got {opts.seq_len}")
    if opts.trainer_model is not None:
        try:
            dims = tuple(int(v) for v in opts.trainer_model.split(","))
        except ValueError:
            dims = ()
        if len(dims) != 3 or min(dims) < 1 or dims[1] % 128:
            parser.error(f"--trainer-model: expected LAYERS,HIDDEN,INTERMEDIATE (hidden a multiple of 128, the head "
                         f"dim), got {opts.trainer_model!r}")
        opts.trainer_model = dims
    try:
        if opts.models is not None:
            opts.models = parse_model_rows(opts.models)
        opts.fp8_options_text, opts.fp8_options_b_text = opts.fp8_options, opts.fp8_options_b
        opts.fp8_options = parse_fp8_options(opts.fp8_options)
        opts.fp8_options_b = parse_fp8_options(opts.fp8_options_b, "--fp8-options-b")
        opts.model_arm_keys = model_arm_keys(opts)
        if opts.solo_peak is not None and opts.solo_peak not in MODEL_ARMS:
            raise ValueError(f"--solo-peak: unknown arm {opts.solo_peak!r}")
    except ValueError as err:
        parser.error(str(err))
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    for var, value in (("WANDB_MODE", "disabled"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                       ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(var, value)
    sizes = TINY_SIZES if opts.tiny else GPU_SIZES
    if opts.layer_shapes:
        sizes = dataclasses.replace(sizes, layer_shapes=opts.layer_shapes)
    if opts.models:
        sizes = dataclasses.replace(sizes, model_rows=opts.models)
    if opts.trainer_model:
        sizes = dataclasses.replace(sizes, trainer_model=opts.trainer_model)
    if opts.seq_len:
        sizes = dataclasses.replace(sizes, seq=opts.seq_len)
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on the GPU machine, or pass --tiny for the CPU check")
        return 2
    if opts.solo_peak is not None:
        return solo_peak(opts, sizes)
    print(header_line(sizes))
    print(f"sections {','.join(opts.sections)}  repeats {opts.repeats}  compile backend {opts.compile_backend}"
          f"  mode {opts.compile_mode or 'default'}",
          flush=True)
    sections = {"layer": layer_section, "model": model_section, "decode": decode_section,
                "trainer": trainer_section, "smollm": smollm_section}
    started = time.perf_counter()
    failed = []
    for name in opts.sections:
        t0 = time.perf_counter()
        print(f"\n## {name}", flush=True)
        try:
            sections[name](opts, sizes)
        except Exception as err:  # noqa: BLE001 — later sections still run
            failed.append(name)
            print(f"!! section {name} failed: {short_error(err)}")
            traceback.print_exc(limit=4, file=sys.stdout)
        print(f"[{name}: {time.perf_counter() - t0:.0f} s, total {time.perf_counter() - started:.0f} s]", flush=True)
    if failed:
        print(f"sections that failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
