"""Fp8Config.resident_dgrad_codes=False: the dgrad GEMM's W^T codes are transposed from the W codes in each backward
instead of kept resident. Same outputs and gradients bit for bit (eager and compiled), no W^T buffers kept, and on
CUDA (marked gpu) the resident memory lower by exactly the W^T codes and scales."""

import copy

import pytest
import torch
from torch import nn

from calclip.fp8 import Fp8Config, quantize_model
from calclip.fp8.linear import FP8BlockLinear


def _model(seed=0, device="cpu"):
    torch.manual_seed(seed)
    # ragged 128-blocks on both dims, so the transposed scales' ragged edge moves too
    return nn.Sequential(nn.Linear(200, 300, bias=False), nn.SiLU(), nn.Linear(300, 130, bias=True),
                         nn.Linear(130, 256)).to(device)


def _pair(device="cpu"):
    base = _model(device=device)
    resident = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), resident_dgrad_codes=True))
    on_demand = quantize_model(copy.deepcopy(base), Fp8Config(keep_patterns=(), resident_dgrad_codes=False))
    return resident, on_demand


def _train_steps(models, device="cpu", steps=3, compiled=None):
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    calls = [models[0], models[1] if compiled is None else compiled]
    for step in range(steps):
        x = torch.randn(3, 70, 200, device=device)
        outs, grads = [], []
        for call in calls:
            xi = x.clone().requires_grad_()
            y = call(xi)
            y.square().mean().backward()
            outs.append(y.detach())
            grads.append(xi.grad)
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1]), step
        for p0, p1 in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p0.grad, p1.grad), step
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _layers(model):
    return [m for m in model.modules() if isinstance(m, FP8BlockLinear)]


def test_on_demand_dgrad_codes_equal_resident_ones_and_keep_no_buffers():
    resident, on_demand = _pair()
    _train_steps([resident, on_demand])
    assert all(m._fp8_qwt is not None for m in _layers(resident))
    assert all(m._fp8_qwt is None and m._fp8_swt is None for m in _layers(on_demand))
    with pytest.raises(ValueError, match="resident_dgrad_codes must be a bool"):
        Fp8Config(resident_dgrad_codes=1)
    assert Fp8Config().resident_dgrad_codes is False  # the default: measured faster and smaller on the H100


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_on_demand_dgrad_codes_equal_eager_resident_ones():
    resident, on_demand = _pair()
    compiled = torch.compile(on_demand, backend="aot_eager")
    _train_steps([resident, on_demand], compiled=compiled)
    assert all(m._fp8_qwt is None for m in _layers(on_demand))


def test_a_weight_changed_after_the_forward_still_raises():
    """The saved W^T views share the codes' version: a refresh between forward and backward is refused, as with
    resident codes."""
    _, on_demand = _pair()
    y = on_demand(torch.randn(4, 200))
    with torch.no_grad():
        on_demand[2].weight.mul_(2)  # a layer whose input needs a gradient: it saved W^T for dx
    on_demand(torch.randn(4, 200))  # refreshes the codes in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_on_demand_dgrad_codes_save_their_bytes_with_the_same_gradients():
    device = "cuda"
    resident, on_demand = _pair(device)
    resident, on_demand = resident.to(torch.bfloat16), on_demand.to(torch.bfloat16)
    x = torch.randn(4, 128, 200, device=device, dtype=torch.bfloat16)
    for model in (resident, on_demand):  # one step each: codes made (and W^T for the resident one)
        model(x.clone().requires_grad_()).float().square().mean().backward()
    torch.cuda.synchronize()
    w_t_bytes = sum(m.weight.numel() + 4 * m._fp8_sw.numel() for m in _layers(resident))
    held = {}
    for name, model in (("resident", resident), ("on_demand", on_demand)):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for m in _layers(model)
                    for t in (m._fp8_qw, m._fp8_sw, m._fp8_qwt, m._fp8_swt) if t is not None}
        held[name] = sum(storages.values())
    assert held["resident"] - held["on_demand"] == w_t_bytes
    for p0, p1 in zip(resident.parameters(), on_demand.parameters()):
        assert torch.equal(p0.grad, p1.grad)
