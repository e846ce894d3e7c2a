"""Position ids for the trainer's forwards: the ones the rollout used, counted from each row's first real token.

transformers ``generate`` numbers the tokens of a left-padded row from 0 at its first real token
(``attention_mask.cumsum(-1) - 1``, in the prefill and every decode step), and so does vLLM. TRL computes the old,
current and reference log-probs with a plain forward that passes no ``position_ids``, so the model numbers every
row from 0 at its first column: a row with p pad tokens gets positions shifted by p. With rotary embeddings that is
the same function in exact arithmetic, not in floating point (the rotation angles, and so the roundings of q and k,
differ), and block FP8 turns those roundings into different FP8 codes downstream, so the rollout's and the
trainer's log-probs of the same tokens, from the same FP8 weight codes, differ by the same order as FP8 differs
from BF16.

Measured on CPU (SmolLM2-135M-Instruct, block FP8 on fp32 masters under bf16 autocast, left-padded arithmetic
prompts, eager attention; docs/usage.md has the numbers): with TRL's positions rollout and trainer log-probs parted
by more than 1 nat on some tokens and agreed only on the unpadded rows; with generate's positions every log-prob was
identical. FP8 against its BF16 shadow parts by more still on the same tokens. With models that learn absolute
positions (GPT-2) the shift is not even the same function.

``use_rollout_positions(model)`` registers a forward pre-hook on the model's backbone that fills ``position_ids``
from the 2-D ``attention_mask`` whenever a call passes none and no KV cache: exactly TRL's log-prob forwards.
``generate`` always passes its own positions, so it is unaffected; so is any call that passes ``position_ids``.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

_HOOK_ATTRIBUTE = "_calclip_rollout_positions_hook"


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids as transformers' ``generate`` derives them from a [B, T] 0/1 mask: each row counts its
    attended tokens from 0; masked (pad) entries get 0."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, tokens], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _fill_positions(module: nn.Module, args: tuple, kwargs: dict):
    if kwargs.get("position_ids") is not None:
        return None
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    cache = kwargs.get("past_key_values")
    if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
        return None  # a continued sequence: its positions start after the cached tokens
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    tokens = ids.shape[1] if isinstance(ids, torch.Tensor) else embeds.shape[1] if isinstance(embeds,
                                                                                               torch.Tensor) else None
    if tokens != mask.shape[1]:
        return None
    kwargs["position_ids"] = positions_from_attention_mask(mask)
    return args, kwargs


def _backbone(model: nn.Module) -> nn.Module | None:
    """The module whose forward takes ``position_ids`` and numbers positions itself when given none (a decoder-only
    text model's ``base_model``), or None for a model this does not apply to."""
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        return None  # multimodal: some compute their own (e.g. 3-D rotary) positions from the inputs
    backbone = getattr(model, "base_model", None)
    if not isinstance(backbone, nn.Module) or backbone is model:
        return None
    if "position_ids" not in inspect.signature(backbone.forward).parameters:
        return None
    return backbone


def use_rollout_positions(model: nn.Module) -> bool:
    """Make forwards of ``model`` that pass an attention mask but no ``position_ids`` (and no KV cache) use the
    positions ``generate`` uses (``positions_from_attention_mask``). Idempotent. Returns whether the model got the
    hook: False for encoder-decoder and multimodal models and for backbones without ``position_ids``."""
    backbone = _backbone(model)
    if backbone is None:
        return False
    if getattr(backbone, _HOOK_ATTRIBUTE, None) is None:
        handle = backbone.register_forward_pre_hook(_fill_positions, with_kwargs=True)
        setattr(backbone, _HOOK_ATTRIBUTE, handle)
    return True
