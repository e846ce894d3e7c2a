"""FP8BlockLinear under torch.compile with Inductor on the GPU: the triton ops decompose into calclip's own Triton
kernels and the cuBLAS GEMM op (no Python of calclip per call), results equal eager bit for bit, with and
without CUDA graphs (mode="reduce-overhead"). CUDA only; skipped otherwise.

    python -m pytest -q tests/fp8/test_gpu_compile.py
"""

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from torch._inductor.utils import run_and_get_code  # noqa: E402

from calclip.fp8 import Fp8Config, pop_nonfinite_count, quantize_model  # noqa: E402

pytestmark = pytest.mark.gpu


def _chain(seed=0):
    """Three bias-free FP8 layers, nothing between them: every op of the compiled graph is calclip's (an
    activation or a bias sum would let Inductor's own rounding or reduction order differ from eager's)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 1024, bias=False), nn.Linear(1024, 384, bias=False),
                          nn.Linear(384, 512, bias=False)).cuda().to(torch.bfloat16)
    return quantize_model(model, Fp8Config(keep_patterns=()))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_training_equals_eager_across_optimizer_steps(mode):
    eager, model = _chain(), _chain()
    compiled = torch.compile(model, mode=mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (eager, model)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
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


def test_compiled_inference_counts_nonfinite_tokens_on_gpu():
    model = _chain()
    compiled = torch.compile(model)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    x[7, 3] = float("inf")
    with torch.no_grad():
        y = compiled(x)
    assert torch.isnan(y[7]).all() and torch.isfinite(y[torch.arange(64, device="cuda") != 7]).all()
    assert int(pop_nonfinite_count(model)) == 3  # row 7 in each of the three layers
