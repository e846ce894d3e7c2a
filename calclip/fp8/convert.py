"""Swap nn.Linear layers for FP8 linears in place (torchao's ``convert_to_float8_training`` shape), and back.

The FP8 linear is the one of ``config.recipe`` (``calclip.fp8.recipes``): FP8BlockLinear for blockwise, torchao's
Float8Linear (``TorchaoFloat8Linear``) for rowwise and tensorwise. Every recipe goes through the same selection
below, so selective precision means the same thing for each.

Which layers convert: exact ``nn.Linear`` instances (subclasses are left alone: they may override forward)
whose fully qualified name matches none of ``config.keep_patterns`` (``re.search``; "lm_head" by default),
whose decoder layer index is not kept by ``keep_first_n_layers`` / ``keep_last_n_layers`` /
``keep_last_fraction``, and for which ``module_filter_fn(module, fqn)`` (when given) returns True.
Embeddings and norms are not nn.Linear, and attention score math is not a module, so they stay in BF16.

The decoder layer index comes from the module name: the integer after ``layers.`` / ``h.`` / ``blocks.``
(``model.layers.3.mlp.up_proj`` is layer 3); the layer count is the largest index + 1. Modules outside any
decoder layer are unaffected by the layer options.

The converted names are recorded, sorted, in ``model._calclip_fp8_modules`` (and the config in
``model._calclip_fp8_config``) for export; ``dequantize_model`` removes both. Forward hooks registered on an
original nn.Linear are not carried over to its replacement.

A model on the meta device converts as any other; it works once materialized (``to_empty`` then initialized or
loaded weights). Until then a call of the model raises, naming the layers whose weights have no data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

from torch import nn

from calclip.fp8.config import Fp8Config
from calclip.fp8.linear import FP8BlockLinear
from calclip.fp8.producers import fuse_producers, unfuse_producers
from calclip.fp8.recipes import fp8_linear_from, is_fp8_linear
from calclip.fp8.shared_input import share_sibling_inputs
from calclip.fp8.siblings import group_siblings
from calclip.fp8.weight_codes import fp8_layers, refresh_before_compiled_call

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)")

ModuleFilter = Callable[[nn.Module, str], bool]


def decoder_layer_index(fqn: str) -> int | None:
    """Index of the decoder layer a module name lies in, or None (e.g. "lm_head")."""
    match = _LAYER_INDEX.search(fqn)
    return int(match.group(1)) if match else None


def _layer_position(fqn: str) -> tuple[str, int] | None:
    """(layer stack, index) of a module name, e.g. ("model.layers.", 3), or None outside any layer stack."""
    match = _LAYER_INDEX.search(fqn)
    return (fqn[:match.start(1)], int(match.group(1))) if match else None


def _kept_layers(names: list[str], config: Fp8Config) -> set[tuple[str, int]]:
    """Layer positions kept in BF16. The first/last-N and last-fraction rules apply to each layer stack on its
    own (a vision-language model's vision blocks and language layers, an encoder and a decoder)."""
    stacks: dict[str, int] = {}
    for position in filter(None, map(_layer_position, names)):
        stack, index = position
        stacks[stack] = max(stacks.get(stack, -1), index)
    kept: set[tuple[str, int]] = set()
    for stack, last in stacks.items():
        n_layers = last + 1
        # Exact rational ceiling: float products such as 0.28 * 25 = 7.000000000000001 must not round up to 8.
        n_last = max(config.keep_last_n_layers, math.ceil(Fraction(str(config.keep_last_fraction)) * n_layers))
        indices = set(range(min(config.keep_first_n_layers, n_layers))) | set(range(max(n_layers - n_last, 0),
                                                                                     n_layers))
        kept |= {(stack, i) for i in indices}
    return kept


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _refuse_meta_forward(model: nn.Module, args) -> None:
    """Root forward pre-hook of a model converted on the meta device: a clear error while FP8 weights have no data
    (instead of an autocast error from inside a layer); removes itself at the first call after materialization."""
    on_meta = [fqn for fqn, module in model.named_modules() if isinstance(module, FP8BlockLinear)
               and module.weight.is_meta]  # fmt: skip
    if on_meta:
        raise RuntimeError(
            f"FP8 layers {on_meta[:3]}{' ...' if len(on_meta) > 3 else ''} still have their weights on the meta "
            "device: materialize the model before calling it (model.to_empty(device=...), then initialize or load "
            "the weights); the FP8 layers quantize the real weights at their first call"
        )
    model.__dict__.pop("_calclip_meta_guard").remove()


def quantize_model(model: nn.Module, config: Fp8Config | None = None, *,
                   module_filter_fn: ModuleFilter | None = None) -> nn.Module:
    """Replace eligible nn.Linear layers of ``model`` by ``config.recipe``'s FP8 linear sharing their Parameters;
    returns ``model`` (modified in place). Converting an already converted model converts the remaining layers.
    A layer the recipe cannot run raises before any layer is swapped."""
    config = config if config is not None else Fp8Config()
    if isinstance(model, nn.Linear) and type(model) is nn.Linear:
        raise ValueError("quantize_model swaps submodules; wrap a bare nn.Linear in a container first")
    if "_calclip_meta_guard" not in model.__dict__ and any(p.is_meta for p in model.parameters()):
        # Converting on meta is fine (layers share the Parameters and quantize at call time), calling is not.
        model._calclip_meta_guard = model.register_forward_pre_hook(_refuse_meta_forward)
    named = list(model.named_modules())
    kept_layers = _kept_layers([name for name, _ in named], config)
    patterns = [re.compile(p) for p in config.keep_patterns]
    converted = set(getattr(model, "_calclip_fp8_modules", ()))
    replacements: dict[str, nn.Module] = {}
    for fqn, module in named:
        if type(module) is not nn.Linear or not fqn:
            continue
        if any(p.search(fqn) for p in patterns) or _layer_position(fqn) in kept_layers:
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        replacements[fqn] = fp8_linear_from(module, config, fqn)
    for fqn, module in replacements.items():
        _set_submodule(model, fqn, module)
        converted.add(fqn)
    model._calclip_fp8_modules = tuple(sorted(converted))
    model._calclip_fp8_config = config
    if config.decode_group_siblings:
        group_siblings(model)
    if config.share_sibling_inputs:
        share_sibling_inputs(model)
        if config.fuse_producers:
            fuse_producers(model)
    _track_fp8_layers(model)
    return model


def _track_fp8_layers(model: nn.Module) -> None:
    """Keep the converted layers in a list on the root (no module walk per call) and, while there are any,
    the pre-hook that refreshes their weight codes before a torch.compile'd call of the model."""
    layers = fp8_layers(model)
    handle = model.__dict__.pop("_calclip_fp8_hook", None)
    if handle is not None:
        handle.remove()
    model.__dict__.pop("_calclip_fp8_layers", None)
    model.__dict__.pop("_calclip_codes_key", None)  # refresh_fp8_weights' "all fresh" key of the old layers
    for layer in layers:
        layer._set_refreshed_by_root(layer is not model)
    model._calclip_frozen = False  # frozen_fp8_weights: compiled calls skip the refresh (read by the pre-hook)
    # compiled blocks inside the eager root (regional compilation): the pre-hook refreshes on eager calls too
    model._calclip_compiled_blocks = model.__dict__.get("_calclip_compiled_blocks", False)
    if layers:
        model._calclip_fp8_layers = layers
        model._calclip_fp8_hook = model.register_forward_pre_hook(refresh_before_compiled_call)


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every FP8 linear (any recipe) by a plain nn.Linear sharing its Parameters; returns ``model``."""
    unfuse_producers(model)  # the fused producers' own forwards back (they fed the FP8 linears' groups)
    for fqn, module in list(model.named_modules()):
        if is_fp8_linear(module) and fqn:
            _set_submodule(model, fqn, module.to_linear())
    for attr in ("_calclip_fp8_modules", "_calclip_fp8_config"):
        if attr in model.__dict__:
            delattr(model, attr)
    _track_fp8_layers(model)
    return model
