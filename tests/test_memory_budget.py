"""benchmarks/memory_budget.py: the saved-for-backward and resident byte counts of a tiny Llama, worked out by hand.

What the FP8 layers save is the point of the tool (and of FP8 training's memory): each FP8 linear keeps its input as
128x1 codes (1 byte per element) plus one fp32 scale per 128 tokens per feature, never the bf16 input, and the
siblings that read one input (q/k/v, gate/up) keep one copy. A regression that saved the bf16 input again, or one copy
per sibling, changes these byte counts.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_speed  # noqa: E402
import memory_budget  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 4, 2, 64, 512
TOKENS = 256  # two sequences of memory_budget.SEQ


@pytest.fixture(scope="module")
def base():
    row = bench_speed.ModelRow("tiny", HIDDEN, INTER, HEADS, KV_HEADS, layers=1, head_dim=HEAD_DIM)
    model = bench_speed.build_row_model(row, VOCAB, "cpu")
    model.train()
    return model


def count(base, arm: str, tokens: int = TOKENS) -> memory_budget.Count:
    model = memory_budget.build_arm(base, arm, "eager")
    ids = torch.randint(3, VOCAB, (tokens // memory_budget.SEQ, memory_budget.SEQ),
                        generator=torch.Generator().manual_seed(0))
    return memory_budget.count_step(model, ids, "eager")


def codes_bytes(m: int, k: int) -> tuple[int, int]:
    """(fp8 bytes, fp32 scale bytes) of an [m, k] input quantized 128x1: one byte per element, one scale per 128 rows
    per column."""
    return m * k, math.ceil(m / 128) * k * 4


def test_bf16_linears_save_their_bf16_inputs_once_per_sibling_group(base):
    saved = count(base, "bf16").saved
    m = TOKENS
    assert saved[("linear q/k/v", "bf16")] == m * HIDDEN * 2  # one input for q, k and v (the same tensor)
    assert saved[("linear gate/up", "bf16")] == m * HIDDEN * 2
    assert saved[("linear down", "bf16")] == m * INTER * 2
    assert not any(kind == "fp8" for _, kind in saved)


def test_fp8_linears_save_128x1_codes_and_scales_not_the_bf16_input(base):
    bf16, fp8 = count(base, "bf16").saved, count(base, "fp8").saved
    m = TOKENS
    for role, k in (("q/k/v", HIDDEN), ("o", HEADS * HEAD_DIM), ("gate/up", HIDDEN), ("down", INTER)):
        codes, scales = codes_bytes(m, k)
        assert fp8[(f"linear {role}", "fp8")] == codes, role
        assert fp8[(f"linear {role}", "fp32")] == scales, role
        assert (f"linear {role}", "bf16") not in fp8, role
    # everything the FP8 linears do not own (attention, norms, MLP activation, loss, LM head) is saved alike
    others = {k: v for k, v in bf16.items() if not k[0].startswith("linear ") or k[0] == "linear lm_head"}
    assert others == {k: v for k, v in fp8.items() if not k[0].startswith("linear ") or k[0] == "linear lm_head"}


def test_resident_codes_and_optimizer_state_by_hand(base):
    linears = [(HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN),
               (HIDDEN, HEADS * HEAD_DIM), (INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    w_codes = sum(n * k for n, k in linears)
    w_scales = sum(math.ceil(n / 128) * math.ceil(k / 128) * 4 for n, k in linears)
    default, ondemand = count(base, "fp8").resident, count(base, "fp8-ondemand").resident
    assert default["fp8 W codes"] == ondemand["fp8 W codes"] == w_codes
    assert default["fp8 W scales"] == ondemand["fp8 W scales"] == w_scales
    assert default["fp8 W^T codes"] == w_codes and default["fp8 W^T scales"] == w_scales
    assert ondemand["fp8 W^T codes"] == 0 and ondemand["fp8 W^T scales"] == 0
    params = list(base.parameters())
    param_bytes = sum(p.numel() * 2 for p in params)  # bf16
    assert default["parameters"] == default["gradients"] == param_bytes
    # AdamW's state as torch makes it: a real step's state tensors, counted
    probe = [torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(7))]
    for p in probe:
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(probe, lr=1e-3)
    opt.step()
    real = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values())
    assert memory_budget.adamw_state_bytes(probe) == real
    assert default["AdamW state"] == memory_budget.adamw_state_bytes(params)


def test_saved_bytes_are_linear_in_tokens_and_scale_exactly(base):
    counts = [count(base, "fp8", t) for t in (256, 512, 384)]
    lines = memory_budget.per_token(counts)  # raises if the third count is off the line
    codes, scales = codes_bytes(1024, INTER)
    at_1024 = memory_budget.scaled(lines, 1024)
    assert at_1024[("linear down", "fp8")] == codes
    assert at_1024[("linear down", "fp32")] == scales


def test_per_token_refuses_counts_off_the_line():
    a = memory_budget.Count(256, {("x", "bf16"): 512}, {})
    b = memory_budget.Count(512, {("x", "bf16"): 1024}, {})
    c = memory_budget.Count(384, {("x", "bf16"): 800}, {})
    with pytest.raises(ValueError, match="not linear"):
        memory_budget.per_token([a, b, c])


def test_cli_tiny_run_prints_the_ratio(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_budget.py"), "--models",
                           f"{HIDDEN}:{INTER}:{HEADS}:{KV_HEADS}:1", "--vocab", str(VOCAB), "--arms", "bf16,fp8",
                           "--tokens", "256,512", "--scale-to", "2x128"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| ratio / bf16" in done.stdout
    assert "saved: linear down (fp8)" in done.stdout
    with pytest.raises(SystemExit):
        memory_budget.main(["--tokens", "128,256"])  # one 128-token sequence: refused


@pytest.mark.slow  # compiles a decoder layer per arm and token count (~12 s on 2 cores)
def test_cli_compiled_by_layer_counts_fp8_codes_below_bf16_inputs():
    """--mode layers: each decoder layer compiled (AOTAutograd + Inductor's partitioner), calclip's quantizers as
    opaque ops; the FP8 arm's saved linear inputs are codes, fewer bytes than BF16's (the run broke when the
    quantizers gained their ``out_rows`` argument and nothing ran this mode)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_budget.py"), "--models",
                           f"{HIDDEN}:{INTER}:{HEADS}:{KV_HEADS}:1", "--vocab", str(VOCAB), "--arms", "bf16,fp8",
                           "--tokens", "256,512", "--scale-to", "256x2048", "--mode", "layers", "--no-backward"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in
                                             done.stdout.splitlines() if line.startswith("| saved"))}
    bf16_codes, fp8_codes = map(float, rows["saved: decoder layer (compiled) (fp8)"][:2])
    assert bf16_codes == 0 < fp8_codes, rows
    bf16_total, fp8_total = map(float, rows["saved total"][:2])
    assert 0 < fp8_total < bf16_total, rows["saved total"]


def test_peak_estimate_is_the_profiled_peak_of_a_bf16_step(base):
    """The tables' peak estimate, end of the forward + the loss backward's two fp32 [tokens, vocab] gradients, against
    the CPU allocator's real high-water mark over a fwd + bwd of the BF16 model (torch.profiler's memory timeline):
    the peak is at the loss backward, with every saved tensor alive and no weight gradient yet."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    counted = count(base, "bf16", TOKENS)
    estimate = sum(counted.saved.values()) + 8 * TOKENS * VOCAB
    ids = torch.randint(3, VOCAB, (TOKENS // memory_budget.SEQ, memory_budget.SEQ),
                        generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        bench_speed.training_loss(base, ids).backward()
    base.zero_grad(set_to_none=True)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    live = [sum(row) for row in sizes]
    peak = max(live) - live[0]
    # within 16 KiB (a few scalars, the loss among them; the estimate is ~4.4 MiB here, the loss term 1 MiB)
    assert abs(peak - estimate) <= 16 * 1024, (peak, estimate)


def test_opaque_quantizers_return_the_references_values_and_are_put_back():
    """The compiled count's stand-ins for the CUDA kernels (opaque custom ops) change what the partitioner may do,
    never a code or a scale."""
    from calclip.fp8 import quant

    x = torch.randn(256, 384, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    names = ("quantize_1x128", "quantize_128x1")
    originals = [getattr(quant, n) for n in names]
    expected = [fn(x, gemm_layout=True) for fn in originals]
    with memory_budget.opaque_quantizers():
        assert all(getattr(quant, n) is not fn for n, fn in zip(names, originals))
        got = [getattr(quant, n)(x, gemm_layout=True) for n in names]
    assert [getattr(quant, n) for n in names] == originals
    for want, have in zip(expected, got):
        assert len(want) == len(have)
        for a, b in zip(want, have):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
