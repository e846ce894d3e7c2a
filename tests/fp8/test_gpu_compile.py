"""FP8BlockLinear under torch.compile with Inductor on the GPU: the triton ops decompose into calclip's own Triton
kernels and the cuBLAS GEMM op (no Python of calclip per call), results equal eager bit for bit, with and
without CUDA graphs (mode="reduce-overhead"). CUDA only; skipped otherwise.

    python -m pytest -q tests/fp8/test_gpu_compile.py
"""

import copy

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from torch._inductor.utils import run_and_get_code  # noqa: E402

from calclip.fp8 import (FP8BlockLinear, Fp8Config, compile_repeated_blocks, pop_nonfinite_count,  # noqa: E402
                         quantize_128x128, quantize_model)
from calclip.fp8.refresh_graph import replay_count  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]  # tests/conftest.py


def _chain(seed=0):
    """Three bias-free FP8 layers, nothing between them: every op of the compiled graph is calclip's (an
    activation or a bias sum would let Inductor's own rounding or reduction order differ from eager's)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.Linear(1024, 384, bias=False),
                          nn.Linear(384, 512, bias=False)).cuda().to(torch.bfloat16)
    return quantize_model(model, Fp8Config(keep_patterns=()))


@pytest.mark.parametrize("tokens", [256, 1021])  # 1021: forward/dgrad on cuBLAS over rows padded to 1024 (gemm.py)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_training_equals_eager_across_optimizer_steps(mode, tokens):
    eager, model = _chain(), _chain()
    compiled = torch.compile(model, mode=mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (eager, model)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye = eager(xe)
        yc = compiled(xc)
        assert torch.equal(ye, yc), step
        ye.float().square().sum().backward()
        yc.float().square().sum().backward()
        assert torch.equal(xe.grad, xc.grad), step
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert torch.equal(pe.grad, pc.grad), (step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # steps 3 and 4 refreshed all layers by one CUDA-graph replay (step 2 refreshed eagerly, then captured)
    assert replay_count(model) == 2


@pytest.mark.parametrize("resident", [True, False])
def test_graph_refresh_writes_the_codes_a_fresh_quantization_gives(resident):
    """Layers compiled one by one (the trainer's compile_layers) inside an eager root: after each optimizer step the
    root's pre-hook refreshes every layer, by a graph replay from the third step on; the codes, scales and (with
    resident_dgrad_codes) W^T then equal a fresh quantization of the new weights, and the forward equals an eager
    twin's. Without resident W^T codes no such buffer is kept."""
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(512, 640, bias=False),
                                                       nn.Linear(640, 512, bias=False)) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Stack().cuda().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    for m in (model, twin):
        quantize_model(m, Fp8Config(keep_patterns=(), resident_dgrad_codes=resident))
    compile_repeated_blocks(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (twin, model)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
        y, ye = model(x), twin(x)
        assert torch.equal(y, ye), step
        y.float().square().sum().backward()
        ye.float().square().sum().backward()
        for layer in (m for m in model.modules() if isinstance(m, FP8BlockLinear)):
            q, s = quantize_128x128(layer.weight.detach())
            assert torch.equal(layer._fp8_qw.view(torch.uint8), q.view(torch.uint8)), step
            assert torch.equal(layer._fp8_sw, s), step
            if step and resident:  # W^T exists from the first backward on, refreshed with the codes
                assert torch.equal(layer._fp8_qwt.view(torch.uint8), q.t().contiguous().view(torch.uint8)), step
                assert torch.equal(layer._fp8_swt, s.t().contiguous()), step
            elif not resident:
                assert layer._fp8_qwt is None and layer._fp8_swt is None, step
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert replay_count(model) == 3  # steps 2, 3 and 4 (step 1 refreshed eagerly and marked the layer set)


def test_inductor_launches_calclip_kernels_itself():
    """The generated code calls the Triton quantizers and the GEMM op directly; the layer ops are gone."""
    model = _chain()
    compiled = torch.compile(model)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, codes = run_and_get_code(lambda: compiled(x).float().sum().backward())
    code = "\n".join(codes)
    assert "_quantize_1x128_kernel" in code and "_quantize_128x1_kernel" in code
    assert "scaled_mm_blockwise" in code
    # the layer ops' names survive only in Inductor's "Source Nodes" comments, never as calls
    assert "calclip.fp8_linear_forward" not in code and "calclip.fp8_linear_backward" not in code


class _GatedMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(512, 1024, bias=False), nn.Linear(512, 1024, bias=False)
        self.down = nn.Linear(1024, 512, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def test_inductor_stores_a_quantized_activation_once_for_both_quantizers():
    """tracing.one_buffer: silu(gate) * up, read by down's 1x128 and 128x1 quantizers, is stored once by its
    Inductor kernel (Inductor copied it once per Triton kernel argument before: two stores, and four in the SiLU
    backward, whose d_gate and d_up each feed two quantizers)."""
    import re

    torch.manual_seed(0)
    model = quantize_model(_GatedMlp().cuda().to(torch.bfloat16), Fp8Config(keep_patterns=()))
    compiled = torch.compile(model)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, codes = run_and_get_code(lambda: compiled(x).float().sum().backward())
    # Inductor's kernels: name = async_compile.triton('name', '''source''', ...)
    found = re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", "\n".join(codes), flags=re.S)
    silu = {name: src.count("tl.store(") for name, src in found if "silu" in name}
    forward = {n: c for n, c in silu.items() if "silu_backward" not in n}
    backward = {n: c for n, c in silu.items() if "silu_backward" in n}
    assert forward and backward, sorted(name for name, _ in found)
    assert sum(forward.values()) == 1, forward  # h = silu(gate) * up, once
    assert sum(backward.values()) == 2, backward  # d_gate and d_up, once each


def test_compiled_inference_counts_nonfinite_tokens_on_gpu():
    model = _chain()
    compiled = torch.compile(model)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    x[7, 3] = float("inf")
    with torch.no_grad():
        y = compiled(x)
    assert torch.isnan(y[7]).all() and torch.isfinite(y[torch.arange(64, device="cuda") != 7]).all()
    assert int(pop_nonfinite_count(model)) == 3  # row 7 in each of the three layers
