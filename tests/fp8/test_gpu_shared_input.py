"""Shared inputs (calclip.fp8.shared_input) on the GPU: q/k/v and gate/up quantizing their x once, with the Triton
kernels (the counting 1x128 launch for several members) and under Inductor, give each linear's own outputs,
gradients and non-finite count bit for bit. CUDA only; skipped otherwise.

    python -m pytest -q tests/fp8/test_gpu_shared_input.py
"""

import copy

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from calclip.fp8 import FP8BlockLinear, Fp8Config, pop_nonfinite_count, quantize_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]  # tests/conftest.py


class _Block(nn.Module):
    """q/k/v on one x, gate/up on another, joined by concatenation only (exact: no op between the FP8 layers whose
    rounding Inductor could order differently from eager)."""

    def __init__(self, k=512, nq=512, nkv=128, inter=768):
        super().__init__()
        self.self_attn, self.mlp = nn.Module(), nn.Module()
        a, m = self.self_attn, self.mlp
        a.q_proj, a.k_proj, a.v_proj = (nn.Linear(k, n, bias=False) for n in (nq, nkv, nkv))
        a.o_proj = nn.Linear(nq + 2 * nkv, k, bias=False)
        m.gate_proj, m.up_proj = nn.Linear(k, inter, bias=False), nn.Linear(k, inter, bias=False)
        m.down_proj = nn.Linear(2 * inter, k, bias=False)

    def forward(self, x):
        a, m = self.self_attn, self.mlp
        h = a.o_proj(torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1))
        return m.down_proj(torch.cat([m.gate_proj(h), m.up_proj(h)], -1))


def _models():
    torch.manual_seed(0)
    base = nn.Sequential(_Block(), _Block()).cuda().to(torch.bfloat16)
    shared = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=()))
    alone = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), share_sibling_inputs=False))
    assert shared[0].self_attn.q_proj._fp8_share is not None and alone[0].self_attn.q_proj._fp8_share is None
    return shared, alone, copy.deepcopy(shared)


def test_shared_equals_alone_eager_and_compiled_on_gpu():
    """Eager shared vs each linear alone, and Inductor-compiled shared vs eager shared: outputs, input and weight
    gradients bit for bit over AdamW steps; the non-finite counts agree (a NaN token, a weight with an Inf)."""
    shared, alone, model = _models()
    for m in (shared, alone, model):
        with torch.no_grad():
            m[1].self_attn.v_proj.weight[3, 3] = float("inf")
    compiled = torch.compile(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (shared, alone, model)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
        x[1, 7, 3] = float("nan")
        outs = []
        for m in (shared, alone, compiled):
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.float().nan_to_num().square().sum().backward()
            outs.append((y, xi.grad))
        for y, g in outs[1:]:
            assert torch.equal(outs[0][0].nan_to_num(), y.nan_to_num()), step
            assert torch.equal(outs[0][1].nan_to_num(), g.nan_to_num()), step
        for ps, pa, pc in zip(shared.parameters(), alone.parameters(), model.parameters()):
            assert torch.equal(ps.grad.nan_to_num(), pa.grad.nan_to_num()), step
            assert torch.equal(ps.grad.nan_to_num(), pc.grad.nan_to_num()), step
        counts = [int(pop_nonfinite_count(m)) for m in (shared, alone, model)]
        assert counts[0] == counts[1] == counts[2] > 2048, (step, counts)
        for opt in opts:
            for p in opt.param_groups[0]["params"]:
                p.grad.nan_to_num_()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(g._pending is None for g in {m._fp8_share for m in model.modules()
                                            if isinstance(m, FP8BlockLinear) and m._fp8_share is not None})
