"""The lifecycle of an FP8 layer's weight codes: built once, refreshed IN PLACE when the weight changes, frozen for
a generation call.

The quantized weight lives in per-module tensors (plain attributes, never in state_dict) that are refreshed in place
when the weight changes, so their addresses never move: a CUDA graph captured over the layer (HF ``generate`` with a
static cache compiles its decode step with mode="reduce-overhead") reads the current codes on every replay.
Staleness is the key (weight epoch, weight.data_ptr(), weight._version, dtype, device): in-place updates
(optimizer.step, load_state_dict's copy_) bump _version, moves change data_ptr, and fused optimizers (transformers'
default adamw_torch_fused), which bump neither, advance a process-wide weight epoch through a global optimizer step
post-hook; code that writes ``param.data`` directly calls ``invalidate_fp8_weight_caches()``. The W^T codes that dgrad
reads ([K, N] contiguous on CUDA, so torch._scaled_mm gets K-major operands) are made by the first backward that needs
them; from then on a refresh writes codes, scales and the non-finite flag in one Triton launch and W^T in a second
(``quant.requantize_128x128_``) instead of eight launches (quantize, isnan, any, three copies, two transposing
copies). A refresh bumps the codes' autograd version, so a backward whose forward saw older codes raises instead of
computing a gradient against weights it never used.

Eager calls check staleness in the layer; under torch.compile the staleness check runs once per model call in a
forward pre-hook that ``quantize_model`` puts on the root module (one graph break at the top of the model, outside the
layers). ``refresh_fp8_weights(model)`` does the same by hand, e.g. before replaying a graph captured by other means,
or before each call of one submodule of a converted model compiled on its own (its layers leave the refresh to the
root's hook, which that call does not run; a bare FP8BlockLinear compiled alone refreshes in its own hook).
``frozen_fp8_weights(model)`` marks a block (a generation call) in which no weight changes, so compiled calls skip
that refresh.

``Fp8Config.resident_weight_codes=False`` keeps none of this between calls: each call quantizes the weight it reads,
a backward quantizes it again from the weight it saved, and a refresh only brings the layer's non-finite flag up to
date (one reduction over the weight); ``frozen_fp8_weights`` holds the codes for its block and frees them after it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from calclip.fp8 import quant
from calclip.fp8.refresh_graph import graph_refresh

# Advanced after every optimizer step of any optimizer in the process, and by invalidate_fp8_weight_caches():
# part of every weight-cache key, since fused optimizers and `.data` writes change weights without bumping
# Tensor._version (measured: torch 2.13 AdamW(fused=True) leaves _version unchanged).
_weight_epoch = 0


def invalidate_fp8_weight_caches() -> None:
    """Mark every FP8BlockLinear's weight codes stale: call after writing ``param.data`` directly (EMA
    updates, weight syncs that copy into ``.data``, PEFT merges); optimizer steps do this by themselves."""
    global _weight_epoch
    _weight_epoch += 1


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    invalidate_fp8_weight_caches()


register_optimizer_step_post_hook(_after_optimizer_step)


class Fp8WeightCodes:
    """The weight codes of an FP8 linear layer (FP8BlockLinear's base beside nn.Linear): the current 128x128 codes,
    scales and non-finite flag of ``self.weight``, the W^T codes dgrad reads, the non-finite row counter, and when
    to refresh them. The layer provides ``weight``, ``fp8_config``, ``in_features``/``out_features`` and the sibling
    group attributes (``_fp8_group``, ``_fp8_group_index``; siblings.py)."""

    def _init_weight_codes(self) -> None:
        # Current weight codes (refreshed in place, addresses stable): qw [N, K], sw [N/128, K/128], bad [].
        self._fp8_qw: Tensor | None = None
        self._fp8_sw: Tensor | None = None
        self._fp8_bad: Tensor | None = None
        self._fp8_key: tuple | None = None
        # dgrad operands W^T (qwt [K, N], swt [K/128, N/128]); built on the first backward that needs them.
        self._fp8_qwt: Tensor | None = None
        self._fp8_swt: Tensor | None = None
        self._fp8_dgrad_key: tuple | None = None
        # A layer compiled on its own refreshes its codes in its own pre-hook; inside a model that quantize_model
        # converted, the root's pre-hook does it for all layers (one graph break per model, not per layer).
        self._fp8_refreshed_by_root = False
        self._fp8_own_refresh_hook = self.register_forward_pre_hook(_refresh_layer_before_compiled_call)
        # Fp8Config.resident_weight_codes=False: codes held only inside frozen_fp8_weights (a generation call)
        self._fp8_hold_codes = False

    def _set_refreshed_by_root(self, by_root: bool) -> None:
        """Whether the converted root's pre-hook refreshes this layer's codes before compiled calls. If it does, the
        layer's own pre-hook would do nothing and is removed: a module without hooks takes nn.Module's fast call
        path, which saves host time in every eager call (decode calls each layer once per token)."""
        self._fp8_refreshed_by_root = by_root
        handle = self._fp8_own_refresh_hook
        if by_root and handle is not None:
            handle.remove()
            self._fp8_own_refresh_hook = None
        elif not by_root and handle is None:
            self._fp8_own_refresh_hook = self.register_forward_pre_hook(_refresh_layer_before_compiled_call)


    def _weight_key(self) -> tuple:
        """What the weight codes are current for: the weight epoch and ``_weight_state``."""
        return (_weight_epoch, _weight_state(self))

    def quantized_weight(self) -> tuple[Tensor, Tensor, Tensor]:
        """(codes [N, K] e4m3fn, scales [N/128, K/128] fp32, 0-dim bool "weight has a non-finite block"),
        current for the weight as it is now (re-quantized in place when it changed, see module docstring; with
        ``Fp8Config.resident_weight_codes=False`` quantized for this call and kept by nobody)."""
        self._refresh_weight_codes()
        if self._fp8_qw is None:
            return (*self._transient_codes(), self._fp8_bad)
        return self._fp8_qw, self._fp8_sw, self._fp8_bad

    def requantize(self) -> Tensor:
        """Quantize the weight as it is now, whatever the staleness key says, and return the non-finite flag (bool [],
        on the weight's device, not read back). For code that sends the codes elsewhere (the vLLM weight sync), which
        must send the weight's codes even where it was written through ``.data`` without
        ``invalidate_fp8_weight_caches()``. Resident codes (and W^T, once a backward made it) are rewritten in place
        and marked current, so the next forward does not quantize again; without resident codes only the flag is
        refreshed."""
        self._fp8_key = None
        self._refresh_weight_codes()
        return self._fp8_bad

    def _codes_resident(self) -> bool:
        """Whether this layer keeps its W codes between calls: always, unless ``Fp8Config.resident_weight_codes``
        is False and no ``frozen_fp8_weights`` block holds them."""
        return self.fp8_config.resident_weight_codes or self._fp8_hold_codes

    def _transient_codes(self) -> tuple[Tensor, Tensor]:
        """(codes, scales) of the weight as it is now, made for one call (``Fp8Config.resident_weight_codes=False``):
        the same 128x128 quantization the resident buffers hold."""
        cfg = self.fp8_config
        with torch.inference_mode(False), torch.no_grad():
            return quant.quantize_128x128(self.weight.detach(), block=cfg.block_size, pow2=cfg.power_of_two_scales)

    def _refresh_weight_flag(self, key: tuple) -> None:
        """Codes not resident: bring only the non-finite flag (and the counter) up to date with the weight, in place,
        so that sibling groups and fused producers read every member's flag before any member quantizes its weight."""
        w = self.weight.detach()
        with torch.inference_mode(False), torch.no_grad():
            bad = self._flag_buffer(w.device)
            bad.copy_(quant.weight_has_nonfinite_block(w))
            self._counter_on(w.device)
        self._fp8_key = key
        self._fp8_dgrad_key = None

    def _flag_buffer(self, device: torch.device) -> Tensor:
        """The layer's non-finite flag (bool []), kept at one address while the layer stays on ``device`` (a compiled
        graph or a CUDA graph reads it in place)."""
        bad = self._fp8_bad
        if bad is None or bad.device != device:
            bad = self._fp8_bad = torch.zeros((), dtype=torch.bool, device=device)
            _mark_static(bad)
        return bad

    def _release_weight_codes(self) -> None:
        """Drop the resident W and W^T codes (``Fp8Config.resident_weight_codes=False`` on leaving a
        ``frozen_fp8_weights`` block); the flag and its key stay, still current for the weight."""
        self._fp8_qw = self._fp8_sw = self._fp8_qwt = self._fp8_swt = None
        self._fp8_dgrad_key = None

    def _refresh_weight_codes(self) -> None:
        key = self._weight_key()
        # current codes (resident, or held by frozen_fp8_weights): every eager call's fast return, checked first
        if self._fp8_key == key and self._fp8_qw is not None and self.fp8_config.cache_weights:
            return
        if not self._codes_resident():
            if self._fp8_key != key or self._fp8_bad is None:
                self._refresh_weight_flag(key)
            return
        cfg = self.fp8_config
        w = self.weight.detach()
        dgrad_fresh = False
        # Outside inference mode, so codes built under torch.inference_mode can still be saved by autograd.
        with torch.inference_mode(False), torch.no_grad():
            qw = self._fp8_qw
            group = self._fp8_group
            new_buffers = qw is None or qw.shape != w.shape or qw.device != w.device
            if new_buffers and group is not None and w.shape == (self.out_features, self.in_features):
                # a grouped sibling's codes are views into the group's stacked buffers (one launch for all)
                qw, sw = group.buffers(self._fp8_group_index, w.device)
                bad = self._flag_buffer(w.device)
                quant.requantize_128x128_(w, qw, sw, bad, block=cfg.block_size, pow2=cfg.power_of_two_scales)
                self._fp8_qw, self._fp8_sw = qw, sw
                _mark_static(qw, sw)
            elif new_buffers:
                qw, sw = quant.quantize_128x128(w, block=cfg.block_size, pow2=cfg.power_of_two_scales)
                self._fp8_qw, self._fp8_sw = qw, sw
                self._flag_buffer(w.device).copy_(torch.isnan(sw).any())
                _mark_static(self._fp8_qw, self._fp8_sw)
            else:  # in place: captured graphs and saved-for-backward checks see the same tensors
                qwt = self._fp8_qwt
                # W^T's buffers, once a backward has made them (CUDA; on CPU they are views of the codes), are
                # refreshed by the same launch instead of by two copies at the next backward.
                dgrad_fresh = qw.is_cuda and qwt is not None and qwt.shape == qw.t().shape and qwt.device == qw.device
                quant.requantize_128x128_(w, qw, self._fp8_sw, self._fp8_bad,
                                          transposed=(qwt, self._fp8_swt) if dgrad_fresh else None,
                                          block=cfg.block_size, pow2=cfg.power_of_two_scales)
            self._counter_on(qw.device)
        self._fp8_key = key
        self._fp8_dgrad_key = key if dgrad_fresh else None  # else W^T follows on the next backward that needs it

    def _dgrad_codes(self) -> tuple[Tensor, Tensor]:
        """(W^T codes [K, N], W^T scales [K/128, N/128]) of the current weight codes for dx = dy W. On CUDA
        contiguous copies (K-major operands for torch._scaled_mm); on CPU views of the codes."""
        if self._fp8_dgrad_key == self._fp8_key and self._fp8_qwt is not None:
            return self._fp8_qwt, self._fp8_swt
        qw, sw = self._fp8_qw, self._fp8_sw
        with torch.inference_mode(False), torch.no_grad():
            if not qw.is_cuda:
                self._fp8_qwt, self._fp8_swt = qw.t(), sw.t()
                _mark_static(self._fp8_qwt, self._fp8_swt)
            elif self._fp8_qwt is None or self._fp8_qwt.shape != qw.t().shape or self._fp8_qwt.device != qw.device:
                self._fp8_qwt, self._fp8_swt = qw.t().contiguous(), sw.t().contiguous()
                _mark_static(self._fp8_qwt, self._fp8_swt)
            else:
                self._fp8_qwt.copy_(qw.t())
                self._fp8_swt.copy_(sw.t())
        self._fp8_dgrad_key = self._fp8_key
        return self._fp8_qwt, self._fp8_swt

    def _dgrad_operands(self) -> tuple[Tensor, Tensor | None]:
        """What a backward saves for dx = dy W: the resident W^T codes (``_dgrad_codes``), or with
        ``Fp8Config.resident_dgrad_codes=False`` views of the W codes transposed, which the backward makes contiguous
        on CUDA (linear_math._backward) and frees after its GEMM; with no resident W codes
        (``Fp8Config.resident_weight_codes=False``) the weight itself and None: the backward quantizes W^T from it."""
        if self._fp8_qw is None:
            return self.weight, None
        if self.fp8_config.resident_dgrad_codes:
            return self._dgrad_codes()
        return self._fp8_qw.t(), self._fp8_sw.t()

    def _counter_on(self, device: torch.device) -> None:
        """Make the non-finite row counter live on ``device`` (created, or moved with its count), if it does not."""
        if self.nonfinite_count is None or self.nonfinite_count.device != device:
            self._new_counter(device)

    def _new_counter(self, device: torch.device) -> None:
        old = self.nonfinite_count
        carried = 0 if old is None else int(old)  # a device move: one sync, not per call
        with torch.inference_mode(False):
            self.nonfinite_count = torch.full((), carried, dtype=torch.int64, device=device)
        _mark_static(self.nonfinite_count)

    def refresh(self, *, for_backward: bool | None = None) -> None:
        """Bring the weight codes (and, when a backward may follow, the dgrad W^T codes) up to date with the
        weight; what the eager forward does by itself, and ``refresh_fp8_weights`` does before compiled calls."""
        self._refresh_weight_codes()
        if for_backward is None:  # grad mode alone: a frozen weight (a LoRA base) still needs W^T for dx
            for_backward = torch.is_grad_enabled()
        if (for_backward and self.fp8_config.backward == "fp8" and self.fp8_config.resident_dgrad_codes
                and self._fp8_qw is not None):
            self._dgrad_codes()


@torch.compiler.disable  # allocation-time only; if a traced call ever reaches it, a graph break, not an error
def _mark_static(*tensors: Tensor) -> None:
    """Tell torch.compile these long-lived tensors are like parameters: their shapes are static (with dynamic=True
    they would get symbols, and duck sizing shares a symbol between a token count and a scale dim of the same size,
    specializing the token count), and on CUDA their address is fixed, so CUDA-graph replays read them in place
    instead of copying them into the graph's own inputs."""
    for t in tensors:
        if t.is_cuda:
            torch._dynamo.mark_static_address(t)
        for view in (t, t._base):  # Dynamo wraps a view's base on its own (the uint8 buffer under e4m3fn codes)
            if view is not None:
                torch._dynamo.mark_static(view)


def fp8_layers(model: nn.Module) -> list[Fp8WeightCodes]:
    """Every FP8BlockLinear (every layer holding ``Fp8WeightCodes``) in ``model`` (``model`` itself included), in
    module order."""
    return [m for m in model.modules() if isinstance(m, Fp8WeightCodes)]


def refresh_fp8_weights(model: nn.Module, *, for_backward: bool | None = None) -> None:
    """Re-quantize, in place, the weight codes of every FP8BlockLinear in ``model`` whose weight changed (and
    their dgrad W^T codes when ``for_backward``, by default when grad mode is on).

    The root's pre-hook calls this before every compiled call (a CUDA-graphed decode step included). When no
    weight changed since the last call that refreshed them all, it returns after one pass over the weights' keys:
    less host time than every layer's own check. When all of them changed
    (after an optimizer step) on CUDA, the refresh is one CUDA-graph replay (calclip.fp8.refresh_graph)."""
    layers = getattr(model, "_calclip_fp8_layers", None) or fp8_layers(model)
    if for_backward is None:
        for_backward = torch.is_grad_enabled()
    key = _all_codes_key(layers, for_backward)
    if key is not None and model.__dict__.get("_calclip_codes_key") == key:
        return
    # after an optimizer step every layer is stale: one CUDA-graph replay instead of three launches per layer
    if key is None or not graph_refresh(model, layers, for_backward):
        for layer in layers:
            layer.refresh(for_backward=for_backward)
    if key is not None:
        model.__dict__["_calclip_codes_key"] = key


def _weight_state(layer: nn.Module) -> tuple:
    """The layer's weight as its codes' staleness key sees it: storage address, autograd version, dtype, device."""
    w = layer._parameters.get("weight")  # nn.Module.__getattr__ is a slow Python lookup, on every eager call
    if w is None:
        w = layer.weight
    return (w.data_ptr(), w._version, w.dtype, w.device)


def _all_codes_key(layers: list[Fp8WeightCodes], for_backward: bool) -> tuple | None:
    """Every layer's ``_weight_key`` (the epoch once, then each ``_weight_state``) with the layer and its config, or
    None when a layer does not cache its codes (``cache_weights=False`` re-quantizes on every refresh)."""
    key = [_weight_epoch, for_backward]
    for layer in layers:
        cfg = layer.fp8_config
        if not cfg.cache_weights:
            return None
        key.append((id(layer), id(cfg), _weight_state(layer)))
    return tuple(key)


@torch.compiler.disable
def _refresh_outside_graph(model: nn.Module) -> None:
    refresh_fp8_weights(model)


def _refresh_layer_before_compiled_call(layer: Fp8WeightCodes, args) -> None:
    if torch.compiler.is_compiling() and not layer._fp8_refreshed_by_root:
        _refresh_outside_graph(layer)


def refresh_before_compiled_call(model: nn.Module, args) -> None:
    """Forward pre-hook that quantize_model registers on the converted root module: under torch.compile it
    refreshes every layer's codes eagerly (one graph break, before the model's graph); eager calls skip it,
    since each layer checks its own weight, unless compiled blocks sit inside the eager root (``compiled_blocks``:
    regional compilation), whose layers leave the refresh to this hook. Inside ``frozen_fp8_weights(model)``
    compiled calls skip it too (no graph break): the codes were refreshed on entry."""
    if (torch.compiler.is_compiling() or model._calclip_compiled_blocks) and not model._calclip_frozen:
        _refresh_outside_graph(model)


def refresh_for_compiled_blocks(model: nn.Module) -> None:
    """Make the converted root's pre-hook refresh every layer's codes on eager calls too, as compiled blocks inside
    an eager root (regional compilation, ``calclip.fp8.compile_repeated_blocks``) need: their layers refresh
    nothing themselves, and the root itself is not compiled. A cheap check when no weight changed. Nothing to do for
    a model quantize_model did not convert (no FP8 root pre-hook)."""
    if "_calclip_compiled_blocks" in model.__dict__:
        model._calclip_compiled_blocks = True


def _hold_codes(model: nn.Module, layers: list[Fp8WeightCodes], hold: bool) -> None:
    """Make ``layers`` (without resident codes) keep their codes from the next refresh on (hold), or free them now
    (not hold); either way ``refresh_fp8_weights``' "all fresh" key of the model no longer holds."""
    if not layers:
        return
    for layer in layers:
        layer._fp8_hold_codes = hold
        if not hold:
            layer._release_weight_codes()
    model.__dict__.pop("_calclip_codes_key", None)


@contextlib.contextmanager
def frozen_fp8_weights(model: nn.Module):
    """A block in which the weights of ``model``'s FP8 layers do not change: a generation call.

    On entry every layer's codes are brought up to date once; inside, compiled calls of ``model`` skip the root
    pre-hook's refresh, so the compiled graph has no graph break in front of it (``generate`` with a static cache
    otherwise leaves its CUDA-graphed decode step once per token to run that check eagerly). Eager calls keep their
    own per-layer check. On a normal exit the weights are checked once: if one changed inside (an optimizer step,
    ``load_state_dict``), it raises, since compiled calls inside may have used the codes of entry.

    Layers that keep no codes between calls (``Fp8Config.resident_weight_codes=False``) hold them for the block:
    built on entry, freed on exit (a CUDA graph captured inside over them is re-recorded at the next block, whose
    codes have new addresses).

    Does nothing for a model without FP8 layers, inside another ``frozen_fp8_weights`` of the same model, and when
    a layer does not cache its codes (``cache_weights=False``, sharded parameters: those re-quantize on every call).
    The trainer wraps each transformers ``generate`` call in it."""
    layers = model.__dict__.get("_calclip_fp8_layers")
    key = _all_codes_key(layers, False) if layers and not model._calclip_frozen else None
    if key is None:
        yield model
        return
    # Fp8Config.resident_weight_codes=False: these layers hold their codes for the block and free them after it
    held = [layer for layer in layers if not layer.fp8_config.resident_weight_codes]
    _hold_codes(model, held, True)
    try:
        refresh_fp8_weights(model, for_backward=False)  # re-quantizes codes, not weights: ``key`` still holds
        model._calclip_frozen = True
        try:
            yield model
        finally:
            model._calclip_frozen = False
    finally:
        _hold_codes(model, held, False)
    if _all_codes_key(layers, False) != key:
        raise RuntimeError("a weight of an FP8 layer changed inside frozen_fp8_weights(model): compiled calls inside "
                           "may have run on the codes of entry; change weights outside the block")

