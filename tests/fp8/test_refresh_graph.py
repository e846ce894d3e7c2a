"""calclip.fp8.refresh_graph's bookkeeping on CPU: when a refresh is a replay, which layer set is captured and when,
and what a replay leaves behind (keys, versions). The capture itself needs CUDA: here the "graph" runs the captured
calls again, eagerly (tests/fp8/test_gpu_compile.py replays real CUDA graphs)."""

import torch
from torch import nn

from calclip.fp8 import Fp8Config, invalidate_fp8_weight_caches, quantize_128x128, quantize_model, refresh_fp8_weights
from calclip.fp8 import refresh_graph
from calclip.fp8.weight_codes import fp8_layers


class _EagerGraph:
    """Stands in for a CUDA graph: replay() runs the recorded requantize calls again."""

    def __init__(self, operands):
        self.operands = operands

    def replay(self):
        from calclip.fp8 import quant
        for w, q, s, bad, transposed, pow2 in self.operands:
            quant.requantize_128x128_(w, q, s, bad, transposed=transposed, pow2=pow2)


def _model(monkeypatch, **options):
    torch.manual_seed(0)
    model = quantize_model(nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 256)),
                           Fp8Config(keep_patterns=(), **options))
    # CPU stand-ins: the layers count as steady once their buffers exist, with W^T as separate contiguous buffers
    monkeypatch.setattr(refresh_graph, "_ENABLED", True)
    monkeypatch.setattr(refresh_graph.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(refresh_graph.RefreshGraph, "_capture", lambda self, ops: _EagerGraph(ops))

    def steady(layers, for_backward):
        ops = []
        for layer in layers:
            if layer._fp8_qw is None:
                return None
            if not hasattr(layer, "_test_qwt"):  # CPU keeps W^T as views of the codes: give it fixed buffers
                layer._test_qwt = layer._fp8_qw.t().contiguous()
                layer._test_swt = layer._fp8_sw.t().contiguous()
            layer._fp8_qwt, layer._fp8_swt = layer._test_qwt, layer._test_swt
            ops.append((layer.weight.detach(), layer._fp8_qw, layer._fp8_sw, layer._fp8_bad,
                        (layer._fp8_qwt, layer._fp8_swt), False))
        return ops

    monkeypatch.setattr(refresh_graph, "_steady_operands", steady)
    return model


def _step(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    invalidate_fp8_weight_caches()


def test_second_steady_refresh_captures_then_replays(monkeypatch):
    model = _model(monkeypatch)
    layers = fp8_layers(model)
    refresh_fp8_weights(model, for_backward=True)  # buffers made: not steady yet
    assert refresh_graph.replay_count(model) == 0
    _step(model)
    refresh_fp8_weights(model, for_backward=True)  # steady and all stale: seen, refreshed eagerly
    assert refresh_graph.replay_count(model) == 0
    for expected in (1, 2):
        _step(model)
        versions = [(layer._fp8_qw._version, layer._fp8_qwt._version) for layer in layers]
        refresh_fp8_weights(model, for_backward=True)
        assert refresh_graph.replay_count(model) == expected
        for layer, (vq, vqt) in zip(layers, versions):
            q, s = quantize_128x128(layer.weight.detach())
            assert torch.equal(layer._fp8_qw.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(layer._fp8_sw, s)
            assert torch.equal(layer._fp8_qwt.view(torch.uint8), q.t().contiguous().view(torch.uint8))
            # a backward that saved the old codes must see them change, as after an eager refresh
            assert layer._fp8_qw._version > vq and layer._fp8_qwt._version > vqt
            assert layer._fp8_key == layer._weight_key() and layer._fp8_dgrad_key == layer._fp8_key
    refresh_fp8_weights(model, for_backward=True)  # nothing changed since: no replay
    assert refresh_graph.replay_count(model) == 2


def test_no_replay_while_some_layer_is_current(monkeypatch):
    model = _model(monkeypatch)
    layers = fp8_layers(model)
    for _ in range(3):
        _step(model)
        refresh_fp8_weights(model, for_backward=True)
    replays = refresh_graph.replay_count(model)
    assert replays == 1
    with torch.no_grad():
        layers[1].weight.add_(0.01)  # only the second layer changes: the first is current
    refresh_fp8_weights(model, for_backward=True)
    assert refresh_graph.replay_count(model) == replays
    q, _ = quantize_128x128(layers[1].weight.detach())
    assert torch.equal(layers[1]._fp8_qw.view(torch.uint8), q.view(torch.uint8))  # refreshed layer by layer


def test_config_switches_it_off(monkeypatch):
    model = _model(monkeypatch, refresh_graph=False)
    for _ in range(4):
        _step(model)
        refresh_fp8_weights(model, for_backward=True)
    assert refresh_graph.replay_count(model) == 0
    layer = fp8_layers(model)[0]
    q, _ = quantize_128x128(layer.weight.detach())
    assert torch.equal(layer._fp8_qw.view(torch.uint8), q.view(torch.uint8))  # refreshed layer by layer
