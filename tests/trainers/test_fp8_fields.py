"""The trainer config's fp8_* fields become an Fp8Config through one table (calclip.trainers.config
FP8_CONFIG_FIELDS): every fp8_* field is in it or named trainer-only, every Fp8Config option is reachable from it or
named with the reason it has no field, and each field's value arrives in the trainer's Fp8Config."""

import dataclasses

from calclip.fp8.config import Fp8Config
from calclip.trainers.config import (
    FP8_CONFIG_FIELDS,
    FP8_OPTIONS_WITHOUT_FIELD,
    TRAINER_ONLY_FP8_FIELDS,
    CalibratedDAPOConfig,
    CalibratedGRPOConfig,
)

CPU = dict(use_cpu=True, bf16=False, output_dir="unused")


def test_every_fp8_field_is_in_the_table_or_named_trainer_only():
    for config_class in (CalibratedGRPOConfig, CalibratedDAPOConfig):
        fp8_fields = {f.name for f in dataclasses.fields(config_class) if f.name.startswith("fp8_")}
        assert fp8_fields == set(FP8_CONFIG_FIELDS) | set(TRAINER_ONLY_FP8_FIELDS)
    assert not set(FP8_CONFIG_FIELDS) & set(TRAINER_ONLY_FP8_FIELDS)
    # a field is "fp8_" + its option: the config's messages spell Fp8Config's option names that way
    assert all(name == f"fp8_{option}" for name, option in FP8_CONFIG_FIELDS.items())


def test_every_fp8config_option_is_reachable_from_the_table_or_named_with_a_reason():
    options = {f.name for f in dataclasses.fields(Fp8Config)}
    from_fields = list(FP8_CONFIG_FIELDS.values())
    assert len(from_fields) == len(set(from_fields))  # one field per option
    assert set(from_fields) | set(FP8_OPTIONS_WITHOUT_FIELD) == options
    assert not set(from_fields) & set(FP8_OPTIONS_WITHOUT_FIELD)
    assert all(reason.strip() for reason in FP8_OPTIONS_WITHOUT_FIELD.values())


def test_each_fp8_field_arrives_in_the_trainers_fp8config():
    # every option away from its default, in one combination Fp8Config accepts
    values = {
        "fp8_recipe": "blockwise", "fp8_backward": "bf16", "fp8_gemm": "triton", "fp8_power_of_two_scales": True,
        "fp8_keep_first_n_layers": 1, "fp8_keep_last_n_layers": 2, "fp8_keep_patterns": ["mlp"],
        "fp8_decode_fused_max_m": 8, "fp8_decode_group_siblings": True, "fp8_share_sibling_inputs": False,
        "fp8_fuse_producers": True, "fp8_resident_dgrad_codes": True,
    }  # fmt: skip
    # fp8_resident_weight_codes=False rules out fp8_decode_group_siblings and the trainer's cache_weights=False: its
    # own combination below
    assert set(values) | {"fp8_resident_weight_codes"} == set(FP8_CONFIG_FIELDS)
    config = CalibratedGRPOConfig(**CPU, **values)
    fp8 = config.fp8_config(cache_weights=False)
    defaults = Fp8Config()
    for name, option in FP8_CONFIG_FIELDS.items():
        if name not in values:
            continue
        expected = ("mlp", "lm_head") if option == "keep_patterns" else values[name]  # the LM head stays BF16
        assert getattr(fp8, option) == expected, name
        if option != "recipe":  # blockwise is both the default and the only recipe without torchao
            assert getattr(defaults, option) != expected, name  # so the value really came from the field
    assert fp8.cache_weights is False  # the trainer's own option
    assert CalibratedGRPOConfig(**CPU).fp8_config().keep_patterns == ("lm_head",)  # not listed twice


def test_resident_weight_codes_field_arrives_and_its_rules_name_the_fields():
    import pytest

    config = CalibratedGRPOConfig(**CPU, fp8_resident_weight_codes=False)
    assert config.fp8_config().resident_weight_codes is False and Fp8Config().resident_weight_codes is True
    with pytest.raises(ValueError, match="fp8_resident_weight_codes=False .* fp8_decode_group_siblings=True"):
        CalibratedGRPOConfig(**CPU, fp8_resident_weight_codes=False, fp8_decode_group_siblings=True)
    with pytest.raises(ValueError, match="sharded parameters"):  # what the trainer builds under FSDP / ZeRO-3
        config.fp8_config(cache_weights=False)
