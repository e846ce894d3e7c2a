"""What an FP8 linear's backward holds at once: dy's 1x128 codes (the dgrad operand) are released before its 128x1
codes (the wgrad operand) are made, so a backward never holds both layouts of dy's codes beside dy (M x N bytes
less at the peak of each linear's backward; benchmarks/memory_budget.py). Gradients are unchanged by the order: the
reference tests pin them."""

import weakref

import pytest
import torch

from calclip.fp8 import Fp8Config, quant
from calclip.fp8.linear import FP8BlockLinear


def _watch_dy_codes(monkeypatch, n: int) -> list[str]:
    """Record, for the layer's dy ([M, n] inputs of the quantizers), each quantization and whether dy's 1x128 codes
    were still alive when its 128x1 codes were made."""
    events: list[str] = []
    refs: list[weakref.ref] = []
    q_1x128, q_128x1 = quant.quantize_1x128, quant.quantize_128x1

    def quantize_1x128(x, **kwargs):
        out = q_1x128(x, **kwargs)
        if x.shape[-1] == n:
            events.append("1x128")
            refs.extend(weakref.ref(t) for t in out)
        return out

    def quantize_128x1(x, **kwargs):
        if x.shape[-1] == n:
            alive = any(ref() is not None for ref in refs)
            events.append("128x1 with 1x128 codes alive" if alive else "128x1")
        return q_128x1(x, **kwargs)

    monkeypatch.setattr(quant, "quantize_1x128", quantize_1x128)
    monkeypatch.setattr(quant, "quantize_128x1", quantize_128x1)
    return events


@pytest.mark.parametrize("resident_dgrad_codes", [True, False])
def test_backward_releases_dy_1x128_codes_before_making_its_128x1_codes(monkeypatch, resident_dgrad_codes):
    torch.manual_seed(0)
    k, n, m = 256, 384, 256
    layer = FP8BlockLinear(k, n, bias=False, dtype=torch.bfloat16,
                           config=Fp8Config(resident_dgrad_codes=resident_dgrad_codes))
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    events = _watch_dy_codes(monkeypatch, n)
    y.backward(torch.randn_like(y))
    assert events == ["1x128", "128x1"]
    assert x.grad is not None and layer.weight.grad is not None


def test_backward_quantizes_dy_once_per_layout_when_only_one_gradient_is_needed(monkeypatch):
    torch.manual_seed(0)
    layer = FP8BlockLinear(256, 384, bias=False, dtype=torch.bfloat16)
    layer.weight.requires_grad_(False)
    x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    events = _watch_dy_codes(monkeypatch, 384)
    y.backward(torch.randn_like(y))
    assert events == ["1x128"]  # dx only: no 128x1 codes of dy
