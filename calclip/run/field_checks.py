"""Checks of the config fields calclip relies on, inherited ones included, at construction and naming the field.

- ``check_field_types``: every field annotated bool / int / float / str (or ``X | None``) holds that type;
- ``check_inherited_ranges``: the TrainingArguments / GRPOConfig numbers calclip relies on (learning_rate, the
  AdamW constants, batch and accumulation sizes, sampling parameters, beta) lie in their meaningful range;
- ``resume_flag``: ``resume_from_checkpoint`` normalized to what ``Trainer.train`` takes.

calclip's own fields are range-checked in ``CalibratedGRPOConfig._validate_calclip_fields``. The YAML loader and the
command line hand values through unconverted where a dataclass field has no single type (``TrlParser`` reads
``resume_from_checkpoint: true`` from YAML as a bool, ``--resume_from_checkpoint true`` as a string), so the values are
normalized or refused here rather than deep inside ``train()``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing

from calclip.run.config_file import bounded_repr


def resume_flag(value):
    """``resume_from_checkpoint`` as ``Trainer.train`` takes it: True (latest complete checkpoint), a path, or None.

    The strings 'true' / 'false' (any case; what ``--resume_from_checkpoint true`` gives) become True / None unless a
    folder of that name exists. A bool from YAML passes as is, as in TRL's scripts.
    """
    if value is None or isinstance(value, bool):
        return None if value is False else value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(
            f"resume_from_checkpoint must be true, false, or a checkpoint folder path, got {bounded_repr(value)} "
            f"({type(value).__name__})"
        )
    if value.strip().lower() in ("true", "false") and not os.path.exists(value):
        return True if value.strip().lower() == "true" else None
    return value


# ------------------------------------------------------------------------------------------------- types

_SIMPLE_TYPES = {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}
# Annotated str but taking a bool as well: scale_rewards (mapped in TRL's __post_init__, True -> "group") and
# resume_from_checkpoint (True = the latest complete checkpoint, checked by resume_flag).
_BOOL_OR_STR_FIELDS = frozenset({"scale_rewards", "resume_from_checkpoint"})


def _simple_type(annotation) -> tuple[type, bool] | None:
    """(type, None allowed) for bool / int / float / str and their ``X | None``; None for anything richer."""
    if annotation in _SIMPLE_TYPES:
        return annotation, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if inner in _SIMPLE_TYPES:
            return inner, True
    return None


@functools.cache
def _simple_fields(config_class) -> dict[str, tuple[type, bool]]:
    hints = typing.get_type_hints(config_class)
    fields = {}
    for f in dataclasses.fields(config_class):
        simple = _simple_type(hints.get(f.name))
        if simple is not None and f.name not in _BOOL_OR_STR_FIELDS:
            fields[f.name] = simple
    return fields


def _type_ok(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    return isinstance(value, (str, os.PathLike))  # paths (output_dir=Path(...)) are strings to transformers


def check_field_types(config) -> None:
    """Every field annotated bool / int / float / str (or ``| None``), inherited ones included, holds that type.

    YAML hands values through as parsed (``fp8: [false]`` is a non-empty list, so truthy; ``fp8: 0.5`` a float), so
    a value of another type is refused naming the field rather than read by its truthiness. Floats take ints; NaN is
    not a number here.
    """
    for name, (kind, optional) in _simple_fields(type(config)).items():
        value = getattr(config, name)
        if (value is None and optional) or _type_ok(value, kind):
            continue
        allowed = _SIMPLE_TYPES[kind] + (" or null" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {bounded_repr(value)} ({type(value).__name__})")


# ------------------------------------------------------------------------------------------------- ranges

def _at_least(minimum, *, strict=False):
    def check(value):
        return value > minimum if strict else value >= minimum

    return check, f"{'>' if strict else '>='} {minimum}"


def _within(low, high, *, low_open=False, high_open=False):
    def check(value):
        return (low < value if low_open else low <= value) and (value < high if high_open else value <= high)

    return check, f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


# The lowest sampling temperature. TRL and transformers divide the logits by it (generation in fp32, the loss's
# log-probs in the policy's dtype): at 1e-300 every logit overflows to inf and sampling fails with "probability
# tensor contains inf/nan" after the model loads. At 1e-2 the narrowest dtype calclip trains in, fp16 (largest
# finite 65504), still holds logits up to 655 (a language model's stay far below), and sampling is already greedy
# for any logit gap of 1 nat or more (a probability ratio of e**-100 ~ 4e-44, an fp32 subnormal: never drawn in
# practice): a lower temperature changes next to nothing but the overflow risk. Greedy rollouts give GRPO no
# exploration anyway.
TEMPERATURE_MIN = 1e-2

SEED_MAX = 2**32 - 1
SEED_RANGE = _within(0, SEED_MAX)

# Inherited TrainingArguments / GRPOConfig fields calclip's loss, optimizer set-up and sampling rely on, with the
# values that have a meaning (transformers and TRL accept the rest silently, or fail deep inside train(): a
# num_generations of 0 is a ZeroDivisionError in GRPOConfig's own checks, an epsilon_high of inf reaches the clip
# bounds and the calibrator's base bound 1 + epsilon_high).
INHERITED_RANGES = {
    "learning_rate": _at_least(0.0),
    "weight_decay": _at_least(0.0),
    "max_grad_norm": _at_least(0.0),
    "adam_beta1": _within(0.0, 1.0, high_open=True),
    "adam_beta2": _within(0.0, 1.0, high_open=True),
    "adam_epsilon": _at_least(0.0),
    "num_train_epochs": _at_least(0.0),
    "per_device_train_batch_size": _at_least(1),
    "gradient_accumulation_steps": _at_least(1),
    "steps_per_generation": _at_least(1),
    "num_iterations": _at_least(1),
    "max_completion_length": _at_least(1),
    "temperature": _at_least(TEMPERATURE_MIN),
    # GRPO's advantage is the reward relative to the other completions of the same prompt: it needs two.
    "num_generations": _at_least(2),
    "num_generations_eval": _at_least(2),
    "generation_batch_size": _at_least(1),
    "epsilon_high": _at_least(0.0, strict=True),
    "top_p": _within(0.0, 1.0, low_open=True),
    "top_k": _at_least(0),
    "min_p": _within(0.0, 1.0),
    "repetition_penalty": _at_least(0.0, strict=True),
    "beta": _at_least(0.0),
    # transformers' set_seed seeds numpy, which takes 0 to 2**32 - 1: another seed failed in train(), after the
    # model loaded (and in calclip compare, after the other runs were launched).
    "seed": SEED_RANGE,
    "data_seed": SEED_RANGE,
}


def check_inherited_ranges(config) -> None:
    """The values of INHERITED_RANGES' fields (None passes: those fields mean "TRL's default" when unset), then
    ``reward_weights`` and ``output_dir``."""
    for name, (check, allowed) in INHERITED_RANGES.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or not check(value):
            raise ValueError(f"{name} must be finite and {allowed}, got {bounded_repr(value)}")
    check_reward_weights(getattr(config, "reward_weights", None))
    check_output_dir(getattr(config, "output_dir", None))


def check_reward_weights(weights) -> None:
    """None (every reward function weighs 1) or a list of finite numbers. A NaN weight used to drop its reward
    function from the total silently (TRL sums with nansum), an infinite one makes every total inf or NaN. (That
    there is one weight per reward function is checked by TRL, which knows the functions.)"""
    if weights is None:
        return
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (list, tuple)):
        raise ValueError(f"reward_weights must be a list of numbers (one per reward function) or null, got "
                         f"{bounded_repr(weights)}")
    for index, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward_weights[{index}] must be a finite number, got {bounded_repr(weight)} "
                             f"(reward_weights {bounded_repr(weights)})")


def check_output_dir(output_dir) -> None:
    """None (transformers' default folder) or a non-empty path: '' used to pass until the first save raised
    FileNotFoundError: ''."""
    if output_dir is None:
        return
    if isinstance(output_dir, os.PathLike):
        output_dir = os.fspath(output_dir)
    if not isinstance(output_dir, str) or not output_dir.strip():
        raise ValueError(f"output_dir must be a folder path, got {bounded_repr(output_dir)}")
