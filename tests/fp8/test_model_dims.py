"""The FP8 dispatch rules at the dims of real model families, on CPU: which kernel, which config table, which GEMM
backend and split-K every linear of a decoder layer gets, for training token counts and decode rows.

The GPU makes choices from shapes (config tables per group count, GEMM backend per contraction length, split-K per
output tile count); a choice that indexes past a table or picks a layout cuBLAS computes wrongly shows up only at the
dims that reach it. Qwen2.5-7B's down projection (K = 18944) once found an empty autotune table on the H200 while
every CPU test passed, since they ran smaller K. Here every linear of every family below runs its forward and backward
dispatch on fake CUDA tensors (``FakeTensorMode``: the kernels' launchers, config tables and GEMM choices run as on
the H200; no kernel does), in a fresh process whose Triton kernels are compiled-mode functions, not the interpreter's;
the chosen GEMM backends are checked against the layout rules of docs/scaled_mm_layouts.md written out again here.
Then a one-layer model at a few of these dims runs forward + backward in the CPU emulation against float32.

    python -m pytest -q tests/fp8/test_model_dims.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from calclip.fp8.config import BLOCK
from calclip.fp8.reference import wgrad_rows

from _sqnr import sqnr_db

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Family:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


# The decoder-layer dims of the common open families, from each model's config.json on the Hugging Face hub
# (hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim or hidden_size / heads), read
# 2026-12-02. Models that share every number with another row are listed once (Mistral-7B-v0.1 = Llama-3-8B's dims).
FAMILIES = (
    Family("qwen2.5-0.5b", 896, 4864, 14, 2, 64),  # Qwen/Qwen2.5-0.5B
    Family("qwen2.5-1.5b", 1536, 8960, 12, 2, 128),  # Qwen/Qwen2.5-1.5B
    Family("qwen2.5-3b", 2048, 11008, 16, 2, 128),  # Qwen/Qwen2.5-3B
    Family("qwen2.5-7b", 3584, 18944, 28, 4, 128),  # Qwen/Qwen2.5-7B
    Family("qwen2.5-14b", 5120, 13824, 40, 8, 128),  # Qwen/Qwen2.5-14B
    Family("qwen2.5-32b", 5120, 27648, 40, 8, 128),  # Qwen/Qwen2.5-32B
    Family("qwen3-0.6b", 1024, 3072, 16, 8, 128),  # Qwen/Qwen3-0.6B (head_dim 128: q_proj is 1024 -> 2048)
    Family("qwen3-1.7b", 2048, 6144, 16, 8, 128),  # Qwen/Qwen3-1.7B
    Family("qwen3-4b", 2560, 9728, 32, 8, 128),  # Qwen/Qwen3-4B (q_proj 2560 -> 4096)
    Family("qwen3-8b", 4096, 12288, 32, 8, 128),  # Qwen/Qwen3-8B
    Family("qwen3-14b", 5120, 17408, 40, 8, 128),  # Qwen/Qwen3-14B
    Family("qwen3-32b", 5120, 25600, 64, 8, 128),  # Qwen/Qwen3-32B (q_proj 5120 -> 8192)
    Family("llama3-1b", 2048, 8192, 32, 8, 64),  # meta-llama/Llama-3.2-1B
    Family("llama3-3b", 3072, 8192, 24, 8, 128),  # meta-llama/Llama-3.2-3B
    Family("llama3-8b", 4096, 14336, 32, 8, 128),  # meta-llama/Meta-Llama-3-8B; mistralai/Mistral-7B-v0.1
    Family("llama3-70b", 8192, 28672, 64, 8, 128),  # meta-llama/Meta-Llama-3-70B
    Family("gemma-2b", 2048, 16384, 8, 1, 256),  # google/gemma-2b (q_proj 2048 -> 2048, k/v 2048 -> 256)
    Family("gemma-7b", 3072, 24576, 16, 16, 256),  # google/gemma-7b (q/k/v 3072 -> 4096)
    Family("smollm2-135m", 576, 1536, 9, 3, 64),  # HuggingFaceTB/SmolLM2-135M (576: ragged 128-blocks)
    Family("smollm2-360m", 960, 2560, 15, 5, 64),  # HuggingFaceTB/SmolLM2-360M
    Family("smollm2-1.7b", 2048, 8192, 32, 32, 64),  # HuggingFaceTB/SmolLM2-1.7B
)
FAMILY = {f.name: f for f in FAMILIES}


def linear_shapes(f: Family) -> dict[str, tuple[int, int]]:
    """(in_features K, out_features N) of each linear of one Llama-style decoder layer."""
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    return {"q_proj": (f.hidden, q), "k_proj": (f.hidden, kv), "v_proj": (f.hidden, kv), "o_proj": (q, f.hidden),
            "gate_proj": (f.hidden, f.intermediate), "up_proj": (f.hidden, f.intermediate),
            "down_proj": (f.intermediate, f.hidden)}


# Training forwards (1, 4 and 8 sequences of 2048 tokens, and a ragged count: its wgrad contracts over the 128x1 codes'
# reference.wgrad_rows(3000) = 3072 token rows, zero codes past 3000) and no-grad decode rows (1 token up to the fused
# decode's 256-row limit, 257 just past it).
TRAIN_TOKENS = (2048, 8192, 16384, 3000)
DECODE_ROWS = (1, 7, 64, 256, 257)
H200_SMS = 132


def _distinct_linears() -> list[tuple[int, int]]:
    return sorted({shape for f in FAMILIES for shape in linear_shapes(f).values()})


def test_family_table_is_consistent():
    for f in FAMILIES:
        assert f.heads % f.kv_heads == 0, f.name  # grouped-query attention: whole groups
        assert f.head_dim % 2 == 0 and f.hidden % 64 == 0, f.name
    assert len({(f.hidden, f.intermediate, f.heads, f.kv_heads, f.head_dim) for f in FAMILIES}) == len(FAMILIES)


# --------------------------------------------------------------------------------------------------------------
# Config tables (in process: they are plain Python)
# --------------------------------------------------------------------------------------------------------------


def test_counting_quantizer_shares_the_plain_launch():
    """The training forward's 1x128 quantizer counts non-finite rows on the plain launch's grid (row tiles x chunks
    of GROUPS groups; tests/fp8/test_triton.py counts rows spanning many chunks), so no width needs a table of its
    own: both tables keep tiles within 16K elements and start from the same default, and they differ only where the
    counting code spills registers (test_kernels_compile_for_sm90_without_a_gpu)."""
    quantize = pytest.importorskip("calclip.fp8.kernels.quantize")
    for config in quantize._QUANT_1X128_CONFIGS + quantize._QUANT_1X128_COUNT_CONFIGS:
        assert config.kwargs["BLOCK_R"] * config.kwargs["GROUPS"] * BLOCK <= 16384, config.kwargs
    assert quantize._quantize_1x128_counting_tuned.default is quantize._quantize_1x128_tuned.default
    differ = {(c.kwargs["BLOCK_R"], c.kwargs["GROUPS"], c.num_warps) for c in quantize._QUANT_1X128_CONFIGS} ^ \
        {(c.kwargs["BLOCK_R"], c.kwargs["GROUPS"], c.num_warps) for c in quantize._QUANT_1X128_COUNT_CONFIGS}
    assert differ == {(8, 4, 4), (16, 8, 8), (8, 4, 8), (8, 8, 8)}


def test_autotune_buckets_are_capped_powers_of_two():
    launch = pytest.importorskip("calclip.fp8.kernels.launch")
    for m in (*TRAIN_TOKENS, *DECODE_ROWS, 65536, 65537, 10**6):
        bucket = launch._bucket(m)
        assert bucket & (bucket - 1) == 0 and bucket <= 1 << 16
        assert bucket >= m or bucket == 1 << 16


def test_empty_config_table_is_refused_by_name():
    launch = pytest.importorskip("calclip.fp8.kernels.launch")
    quantize = pytest.importorskip("calclip.fp8.kernels.quantize")
    with pytest.raises(ValueError, match="_quantize_1x128_kernel: no autotune config"):
        launch._Tuned(quantize._quantize_1x128_kernel, [], key=["K"])


# --------------------------------------------------------------------------------------------------------------
# The whole dispatch on fake CUDA tensors (fresh process, compiled-mode Triton functions)
# --------------------------------------------------------------------------------------------------------------

_SWEEP = r"""
import json, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from calclip.fp8 import gemm, linear_math, quant
from calclip.fp8 import kernels as tk
from calclip.fp8.kernels import quantize, splitk_gemm

gemm._is_sm90 = lambda device: True  # resolve as on the H200 (tk.sm_count gives its 132 SMs without a GPU)
spec = json.loads(sys.argv[1])
fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
splits = []
with FakeTensorMode(allow_non_fake_inputs=True):
    def empty(*size, dtype=bf16):
        return torch.empty(*size, dtype=dtype, device="cuda")

    for k, n in spec["linears"]:
        w = empty(n, k, dtype=torch.float32)  # fp32 master weights
        qw, sw = quant.quantize_128x128(w)
        bad = torch.zeros((), dtype=torch.bool, device="cuda")
        qwt, swt = empty(k, n, dtype=fp8), empty(sw.shape[1], sw.shape[0], dtype=torch.float32)
        quant.requantize_128x128_(w, qw, sw, bad, transposed=(qwt, swt))  # the in-place refresh after a step
        counter = torch.zeros((), dtype=torch.int64, device="cuda")
        for m in spec["tokens"]:
            # bf16 weights (the benchmarks' models), and fp32 master weights
            for w_dtype in (bf16, torch.float32):
                for row_scales in (False, True):
                    y, qxt, sxt = linear_math._forward(empty(m, k), qw, sw, bad, counter, True, False, "auto", bf16,
                                                       row_scales)
                    dx, dw = linear_math._backward(empty(m, n), qwt, swt, qxt, sxt, True, True, False, "auto",
                                                   bf16, w_dtype, row_scales)
                    assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (n, k), (m, n, k)
        for m in spec["rows"]:
            linear_math._forward(empty(m, k), qw, sw, bad, counter, False, False, "auto", bf16)  # compiled no-grad
            splits.append([m, n, k, tk.splitk_splits(m, n, k, tk.sm_count(torch.device("cuda")))])
            for dtype, round_to in ((bf16, None), (torch.float32, bf16)):  # eager fused decode, fp32 under autocast
                tk.fp8_linear_decode_unchecked(empty(m, k, dtype=dtype), qw, sw, out_dtype=bf16,
                                               nonfinite_count=counter, weight_bad=bad, round_to=round_to)
    for k, widths in spec["siblings"]:  # one fused decode launch over the stacked codes of q/k/v or gate/up
        rows = sum(-(-n // 128) * 128 for n in widths)
        qw, sw = empty(rows, k, dtype=fp8), empty(rows // 128, -(-k // 128), dtype=torch.float32)
        members_bad = torch.zeros((), dtype=torch.int32, device="cuda")
        counter = torch.zeros((), dtype=torch.int64, device="cuda")
        for m in spec["rows"]:
            tk.fp8_linear_decode_unchecked(empty(m, k), qw, sw, out_dtype=bf16, nonfinite_count=counter,
                                           weight_bad=members_bad, members=len(widths))
choices = [[key[0], key[1], key[2], key[3], key[4], key[5], str(key[6]), key[8], chosen]
           for key, chosen in linear_math._gemm_choice.items()]
print("RESULT " + json.dumps({"choices": choices, "splits": splits,
                              "splitk_tables": sorted(splitk_gemm._splitk_tuned)}))
"""


@pytest.fixture(scope="module")
def sweep() -> dict:
    pytest.importorskip("triton.backends.nvidia", reason="triton built without the NVIDIA backend")
    linears = _distinct_linears()
    siblings = sorted({(f.hidden, (q, kv, kv)) for f in FAMILIES
                       for q, kv in [(linear_shapes(f)["q_proj"][1], linear_shapes(f)["k_proj"][1])]}
                      | {(f.hidden, (f.intermediate, f.intermediate)) for f in FAMILIES})
    spec = {"linears": linears, "tokens": TRAIN_TOKENS, "rows": DECODE_ROWS, "siblings": siblings}
    env = {**os.environ, "TRITON_INTERPRET": "0", "CALCLIP_TRITON_AUTOTUNE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _SWEEP, json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _expected_backend(a_blocks: str, b_blocks: str, m: int, n: int, k: int, out_dtype: str, row_scales: bool) -> str:
    """What an H200 should run for y [m, n] = A [m, k] B [n, k]^T, gemm "auto", from the rules as written in
    docs/scaled_mm_layouts.md and calclip.fp8.gemm's docstring (not from gemm.py's code): split-K for few-row forward
    layouts whose output tiles leave multiprocessors idle; torch._scaled_mm where its layout pair is computed correctly
    (bf16 out, every dim a multiple of 16, M > 256 after zero rows appended up to one, K of 128, each scale's leading
    dimension of 4: the rows of a 1x128 operand, K / 128 of a 128x128 one); with row scales, a 128x128 b whose only
    obstacle is K / 128 runs as a 1x128 b; else Triton (so every weight gradient of fp32 master weights:
    torch._scaled_mm's blockwise path is measured for bf16 output only)."""
    tk = pytest.importorskip("calclip.fp8.kernels")
    forward_layout = (a_blocks, b_blocks) == ("1x128", "128x128")
    if forward_layout and 0 < m <= 256 and tk.splitk_splits(m, n, k, H200_SMS) > 1:
        return "splitk"
    rows = -(-m // 16) * 16 if m > 256 else m  # a training-sized row count runs on zero rows appended up to 16
    aligned = out_dtype == "torch.bfloat16" and rows % 16 == 0 and n % 16 == 0 and k % BLOCK == 0
    if aligned and (n % 4 == 0 if b_blocks == "1x128" else (k // BLOCK) % 4 == 0):
        return "scaled_mm"
    if aligned and forward_layout and row_scales and n % 4 == 0:
        return "scaled_mm_rows"
    return "triton"


@pytest.mark.slow
def test_every_family_dispatches_like_the_layout_rules(sweep):
    """The sweep above ran without an error (the K = 18944 crash fails here), and every GEMM the layers chose is the
    one the rules give; every training GEMM at the families' dims is covered."""
    choices = sweep["choices"]
    seen = set()
    for backend, a_blocks, b_blocks, m, n, k, out_dtype, row_scales, chosen in choices:
        assert backend == "auto"
        assert chosen == _expected_backend(a_blocks, b_blocks, m, n, k, out_dtype, row_scales), (
            a_blocks, b_blocks, m, n, k, out_dtype, row_scales, chosen)
        seen.add((a_blocks, b_blocks, m, n, k, out_dtype, row_scales))
    for k, n in _distinct_linears():
        for m in TRAIN_TOKENS:
            for row_scales in (False, True):
                assert ("1x128", "128x128", m, n, k, "torch.bfloat16", row_scales) in seen  # forward
                assert ("1x128", "128x128", m, k, n, "torch.bfloat16", row_scales) in seen  # dgrad
            for w_dtype in ("torch.bfloat16", "torch.float32"):  # wgrad (row scales do not apply: no 128x128 operand)
                assert ("1x128", "1x128", n, k, wgrad_rows(m), w_dtype, False) in seen
    for m, n, k, split in sweep["splits"]:
        assert 1 <= split <= 16 and (split == 1 or -(-k // BLOCK) >= 4 * (split // 2)), (m, n, k, split)
        if split > 1:
            assert split in sweep["splitk_tables"]


def _chosen(sweep, a_blocks, b_blocks, m, n, k, row_scales=False, out_dtype="torch.bfloat16") -> str:
    for backend, a, b, mm, nn, kk, dtype, rows, chosen in sweep["choices"]:
        if (a, b, mm, nn, kk, dtype, rows) == (a_blocks, b_blocks, m, n, k, out_dtype, row_scales):
            return chosen
    raise KeyError((a_blocks, b_blocks, m, n, k, out_dtype, row_scales))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama3-8b", "qwen3-8b", "llama3-70b"])
def test_large_families_run_every_training_gemm_on_cublas(sweep, name):
    """At 7B-70B dims with 4 x 2048 tokens every contraction length is a multiple of 512: all 21 GEMMs of a layer
    (forward, dgrad, wgrad of seven linears) on torch._scaled_mm, the FP8 GEMM the speed targets assume."""
    for k, n in linear_shapes(FAMILY[name]).values():
        for layout, (m, nn, kk) in (("128x128", (8192, n, k)), ("128x128", (8192, k, n)), ("1x128", (n, k, 8192))):
            assert _chosen(sweep, "1x128", layout, m, nn, kk) == "scaled_mm", (name, k, n)


def test_qwen2_5_1_5b_leaves_cublas_where_k_over_128_is_not_a_multiple_of_4(sweep):
    """Qwen2.5-1.5B: the down projection's forward (K = 8960: 70 blocks) and the dgrad of gate/up (contraction 8960)
    and of k/v (contraction 256: 2 blocks) run the Triton GEMM by default; with row scales, cuBLAS."""
    f = FAMILY["qwen2.5-1.5b"]
    m = 16384
    triton_by_default = [(m, f.hidden, f.intermediate), (m, f.hidden, f.intermediate),  # down fwd, gate/up dgrad
                         (m, f.hidden, f.kv_heads * f.head_dim)]  # k/v dgrad
    for mm, nn, kk in triton_by_default:
        assert _chosen(sweep, "1x128", "128x128", mm, nn, kk) == "triton"
        assert _chosen(sweep, "1x128", "128x128", mm, nn, kk, row_scales=True) == "scaled_mm_rows"
    assert _chosen(sweep, "1x128", "128x128", m, f.intermediate, f.hidden) == "scaled_mm"  # gate/up forward


def test_decode_rows_take_split_k_only_where_it_splits(sweep):
    """Decode (no grad, at most 256 rows): the forward GEMM splits K, doubling the split while 64 x 64 output tiles x
    split x 2 still fit 132 multiprocessors (and each range keeps >= 2 K blocks), and takes split-K only if it splits.
    Worked by hand at Qwen2.5-7B's dims."""
    splits = {(m, n, k): split for m, n, k, split in sweep["splits"]}
    f = FAMILY["qwen2.5-7b"]
    kv = f.kv_heads * f.head_dim
    assert splits[(1, kv, f.hidden)] == 8  # k_proj: 8 tiles; 16 x 16 = 256 > 132 stops at 8 (28 K blocks >= 16)
    assert splits[(1, f.hidden, f.intermediate)] == 2  # down_proj: 56 tiles; 56 x 4 = 224 > 132
    assert splits[(256, f.hidden, f.hidden)] == 1  # q_proj at 256 rows: 4 x 56 = 224 tiles already
    assert _chosen(sweep, "1x128", "128x128", 1, kv, f.hidden) == "splitk"
    assert _chosen(sweep, "1x128", "128x128", 256, f.hidden, f.hidden) == "scaled_mm"
    # past SPLITK_MAX_M never split-K; 257 rows are no multiple of 16: cuBLAS on 272 rows (zero rows appended)
    assert _chosen(sweep, "1x128", "128x128", 257, kv, f.hidden) == "scaled_mm"


# --------------------------------------------------------------------------------------------------------------
# One decoder layer in the CPU emulation vs float32
# --------------------------------------------------------------------------------------------------------------


def one_layer_model(f: Family, seed: int = 0, layers: int = 1, dtype=torch.float32, device="cpu"):
    """A random-weight LlamaModel (no embedding use, no LM head) with the family's linear dims and head counts."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=256, hidden_size=f.hidden, intermediate_size=f.intermediate,
                         num_hidden_layers=layers, num_attention_heads=f.heads, num_key_value_heads=f.kv_heads,
                         head_dim=f.head_dim, max_position_embeddings=4096, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaModel(config).to(dtype)


def layer_sqnr(model_fp8, model_ref, f: Family, tokens: tuple[int, int], seed: int = 1) -> dict[str, float]:
    """Forward + backward of both models on the same inputs_embeds x and output gradient dy -> SQNR (dB) of the FP8
    model's layer update (output - x), of its input gradient's update (dx - dy) and (the worst of) its linear weights'
    gradients against the reference model's. The updates, not the outputs: the residual stream passes x and dy
    through exactly, and how much of the output it makes up grows and shrinks with the dims (at Qwen2.5-7B's the
    output SQNR was 6 dB under SmolLM2's for the same error in the branches)."""
    device = next(model_ref.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(*tokens, f.hidden, generator=g).to(device)
    dy = torch.randn(*tokens, f.hidden, generator=g).to(device)
    results = []
    for model in (model_ref, model_fp8):
        model.zero_grad(set_to_none=True)
        dtype = next(model.parameters()).dtype
        xi = x.to(dtype).clone().requires_grad_()  # a fresh leaf per model
        dyi = dy.to(dtype)
        out = model(inputs_embeds=xi, use_cache=False).last_hidden_state
        out.backward(dyi)
        grads = {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if n.endswith("proj.weight")}
        results.append((out.detach().double() - xi.detach().double(), xi.grad.double() - dyi.double(), grads))
    (y_ref, dx_ref, g_ref), (y, dx, g) = results
    assert g.keys() == g_ref.keys() and len(g) == 7 * len(model_ref.layers)
    return {"output": sqnr_db(y_ref, y), "dgrad": sqnr_db(dx_ref, dx),
            "wgrad": min(sqnr_db(g_ref[n], g[n]) for n in g_ref)}


# One decoder layer (transformers' initialization), inputs_embeds and output gradient standard normal, 2 x 64 tokens,
# FP8 emulation vs the same float32 layer, SQNR of the layer update / input-gradient update / worst of the seven weight
# gradients (``layer_sqnr``). Measured on CPU 2026-12-02, dB: SmolLM2-135M 24.5 / 24.5 / 22.8, Qwen2.5-0.5B
# 24.1 / 23.9 / 21.9, Qwen2.5-1.5B 24.2 / 23.7 / 21.0, Gemma-2B 24.4 / 23.3 / 19.9, Qwen2.5-7B 23.3 / 20.7 / 18.5
# (the same layers in bf16 without FP8: 32-43 / 34-42 / 36-41). The floors sit ~3 dB under the lowest, the 7B's: the
# gradients lose a little with the dims, and tests/fp8/test_gpu_model_families.py holds every family to them on the
# GPU, up to Llama-3-70B's.
LAYER_SQNR_FLOOR_DB = {"output": 20.0, "dgrad": 17.0, "wgrad": 15.0}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_one_layer_emulation_tracks_float32_at_family_dims(name):
    """Ragged 128-blocks (576), head_dim 64 with 14/2 heads, and 8960-wide MLP: forward + backward through the
    emulated FP8 layer stays within the SQNR floors of float32 (the same bar the GPU test sets)."""
    import copy

    from calclip.fp8 import Fp8Config, quantize_model

    f = FAMILY[name]
    ref = one_layer_model(f)
    fp8 = quantize_model(copy.deepcopy(ref), Fp8Config())
    results = layer_sqnr(fp8, ref, f, (2, 64))
    for key, floor in LAYER_SQNR_FLOOR_DB.items():
        assert results[key] > floor, (name, results)
    # and the FP8 error is real: a layer that skipped quantization would reach ~140 dB in float32
    assert results["output"] < 40, results
