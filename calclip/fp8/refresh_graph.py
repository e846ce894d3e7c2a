"""Every FP8 layer's weight refresh as one CUDA-graph replay.

Before each compiled call (the whole model compiled, or its layers compiled one by one) the converted root's
pre-hook re-quantizes every changed weight eagerly, outside the graph. After an optimizer step that is every layer:
per layer a staleness key, the buffers' checks, ``bad.zero_()``, two requantize launches and four version bumps. On
the H200 that took milliseconds of CPU per step for the 56 layers of the Qwen2.5-1.5B row while the GPU, done with
the previous step, waited for it (docs/benchmarks-log.md, sixteenth session).

When every layer is stale and already has its code buffers (the steady state of training: after the first backward
made W^T's), the same launches, on the same tensors, are captured once into a CUDA graph and replayed on later
refreshes: one launch of host time instead of three per layer. The graph reads the weights and writes the codes at
fixed addresses, so it is keyed on every operand's address; a layer whose buffers or weight moved (a device move, a
resize) makes a new capture. The capture is taken on the second steady refresh of a layer set, after the first ran
the kernels eagerly (their compilation and autotuning cannot be captured). Replays write the same codes, scales,
flags and W^T as the eager launches (same kernels, same launch configs) and bump the buffers' autograd versions as
they do. A capture that fails falls back to the eager refresh for the rest of the process, with a warning.
``Fp8Config(refresh_graph=False)`` switches it off for a model, ``CALCLIP_REFRESH_GRAPH=0`` for the process.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from calclip.fp8 import quant

_ENABLED = os.environ.get("CALCLIP_REFRESH_GRAPH", "1") != "0"


class RefreshGraph:
    """The captured refresh of one model's FP8 layers (kept on the converted root), per operand-address key."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.seen: set[tuple] = set()  # keys refreshed eagerly once: captured on their next refresh
        self.failed = False
        self.replays = 0

    def refresh(self, layers: list[nn.Module], for_backward: bool) -> bool:
        """Refresh every layer by one graph replay when all are stale and steady; return whether it did (False:
        the caller refreshes them one by one)."""
        if self.failed:
            return False
        operands = _steady_operands(layers, for_backward)
        if operands is None:
            return False
        keys = [layer._weight_key() for layer in layers]
        if any(layer._fp8_key == key for layer, key in zip(layers, keys)):
            return False  # some layer is current: the per-layer path skips it, a replay would redo it
        address_key = tuple(_addresses(op) for op in operands)
        graph = self.graphs.get(address_key)
        if graph is None:
            if address_key not in self.seen:
                self.seen.add(address_key)
                return False
            graph = self._capture(operands)
            if graph is None:
                return False
            self.graphs[address_key] = graph
        graph.replay()
        self.replays += 1
        for layer, key, (_, q, s, _, transposed, _) in zip(layers, keys, operands):
            for t in (q, s, *(transposed or ())):
                torch.autograd.graph.increment_version(t)
            layer._fp8_key = key
            layer._fp8_dgrad_key = key if transposed is not None else None
        return True

    def _capture(self, operands: list[tuple]) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's unsafe CUDA calls are refused during the capture, not those of other
            # threads of the process (a DataLoader's pin-memory thread)
            capture = torch.cuda.graph(graph, capture_error_mode="thread_local")
            with torch.inference_mode(False), torch.no_grad(), capture:
                for w, q, s, bad, transposed, pow2 in operands:
                    quant.requantize_128x128_(w, q, s, bad, transposed=transposed, pow2=pow2)
        except Exception as err:  # noqa: BLE001 - any capture failure: the eager refresh still works
            self.failed = True
            warnings.warn(f"calclip: the FP8 weight refresh could not be captured as a CUDA graph ({err}); refreshing "
                          "layer by layer from now on", RuntimeWarning, stacklevel=4)
            return None
        return graph


def _addresses(operand: tuple) -> tuple:
    w, q, s, bad, transposed, pow2 = operand
    tensors = (w, q, s, bad, *(transposed or ()))
    return (*(t.data_ptr() for t in tensors), tuple(w.shape), tuple(w.stride()), w.dtype, pow2, transposed is None)


def _steady_operands(layers: list[nn.Module], for_backward: bool) -> list[tuple] | None:
    """Each layer's (w, q, s, bad, (qt, st) or None, pow2) as its eager refresh would pass them to
    ``requantize_128x128_``, or None when some layer's refresh would be anything else (buffers still to be made, a
    CPU layer, codes not cached, W^T missing where the backward needs it)."""
    operands = []
    for layer in layers:
        cfg = layer.fp8_config
        w = layer._parameters.get("weight")
        q = layer._fp8_qw
        if (w is None or q is None or not q.is_cuda or not cfg.cache_weights or cfg.block_size != quant.BLOCK
                or q.shape != w.shape or q.device != w.device or w.dtype == torch.float64):
            return None
        qt = layer._fp8_qwt
        has_transposed = qt is not None and qt.shape == q.t().shape and qt.device == q.device
        if for_backward and cfg.backward == "fp8" and cfg.resident_dgrad_codes and not has_transposed:
            return None  # the first backward still has to make W^T's buffers
        transposed = (qt, layer._fp8_swt) if has_transposed else None
        operands.append((w.detach(), q, layer._fp8_sw, layer._fp8_bad, transposed, cfg.power_of_two_scales))
    return operands


def graph_refresh(model: nn.Module, layers: list[nn.Module], for_backward: bool) -> bool:
    """Refresh ``layers`` (every FP8 layer of the converted root ``model``) by one CUDA-graph replay where it applies;
    return whether it did."""
    if not _ENABLED or not layers or not torch.cuda.is_available():
        return False
    if not all(layer.fp8_config.refresh_graph for layer in layers):  # Fp8Config(refresh_graph=False)
        return False
    state = model.__dict__.get("_calclip_refresh_graph")
    if state is None:
        state = model.__dict__["_calclip_refresh_graph"] = RefreshGraph()
    return state.refresh(layers, for_backward)


def replay_count(model: nn.Module) -> int:
    """How many refreshes of ``model`` were graph replays."""
    state = model.__dict__.get("_calclip_refresh_graph")
    return 0 if state is None else state.replays
