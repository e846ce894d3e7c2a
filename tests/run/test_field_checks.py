"""Config fields are type- and range-checked at construction, inherited ones included, naming the field."""

import math
import warnings
from pathlib import Path

import pytest

from calclip.cli.arguments import ScriptArguments, parse_train_args
from calclip.run.field_checks import INHERITED_RANGES, resume_flag
from calclip.trainers.config import CalibratedDAPOConfig, CalibratedGRPOConfig


def _config(config_class=CalibratedGRPOConfig, **fields):
    fields = {"output_dir": "unused-output", "use_cpu": True, "bf16": False, "report_to": "none", **fields}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_class(**fields)


@pytest.mark.parametrize("value", [[False], [True], 2, 0, 0.5, "yes", None])
def test_booleans_must_be_booleans(value):
    with pytest.raises(ValueError, match=r"^fp8 must be a boolean \(true/false\), got "):
        _config(fp8=value)
    with pytest.raises(ValueError, match=r"^recalibrate_on_spike must be a boolean"):
        _config(recalibrate_on_spike=value)


def test_inherited_booleans_and_numbers_are_checked_too():
    with pytest.raises(ValueError, match=r"^mask_truncated_completions must be a boolean"):
        _config(mask_truncated_completions=[False])
    with pytest.raises(ValueError, match=r"^seed must be an integer, got 1.5"):
        _config(seed=1.5)
    with pytest.raises(ValueError, match=r"^learning_rate must be a number, got '1e-3' \(str\)"):
        _config(learning_rate="1e-3")
    with pytest.raises(ValueError, match=r"^learning_rate must be a number, got nan"):
        _config(learning_rate=math.nan)
    with pytest.raises(ValueError, match=r"^num_generations must be an integer or null, got True"):
        _config(num_generations=True)
    with pytest.raises(ValueError, match=r"^overlong_penalty_factor must be a number"):
        _config(CalibratedDAPOConfig, overlong_penalty_factor=[1.0])


@pytest.mark.parametrize(
    "name, value",
    [("learning_rate", -1e-3), ("learning_rate", math.inf), ("weight_decay", -0.1), ("max_grad_norm", -1.0),
     ("adam_beta1", 1.0), ("adam_beta2", -0.5), ("adam_epsilon", -1e-8), ("per_device_train_batch_size", 0),
     ("gradient_accumulation_steps", 0), ("steps_per_generation", 0), ("num_iterations", 0),
     ("max_completion_length", 0), ("temperature", 0.0), ("temperature", 1e-3), ("num_generations", 1),
     ("epsilon_high", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
     ("min_p", 1.5), ("repetition_penalty", 0.0), ("beta", -0.04), ("num_train_epochs", -1.0)],
)  # fmt: skip
def test_inherited_numbers_out_of_range_are_refused_naming_the_field(name, value):
    assert name in INHERITED_RANGES
    with pytest.raises(ValueError, match=rf"^{name} must be finite and "):
        _config(**{name: value})


@pytest.mark.parametrize("fields, message", [
    # each of these used to pass the config and fail later, naming no field (or not fail at all)
    (dict(reward_weights=[math.nan, 1.0]), r"^reward_weights\[0\] must be a finite number, got nan"),
    (dict(reward_weights=[1.0, -math.inf]), r"^reward_weights\[1\] must be a finite number, got -inf"),
    (dict(reward_weights=[1.0, "2"]), r"^reward_weights\[1\] must be a finite number, got '2'"),
    (dict(reward_weights="1.0"), r"^reward_weights must be a list of numbers"),
    (dict(num_generations=0), r"^num_generations must be finite and >= 2, got 0"),
    (dict(num_generations=1), r"^num_generations must be finite and >= 2, got 1"),
    (dict(num_generations_eval=0), r"^num_generations_eval must be finite and >= 2"),
    (dict(generation_batch_size=0, steps_per_generation=None), r"^generation_batch_size must be finite and >= 1"),
    (dict(entropy_spike_window=10**30), r"^entropy_spike_window must be an int in \[2, 100000\], got 10000000"),
    (dict(entropy_spike_warmup=30), r"^entropy_spike_warmup \(30\) must be <= entropy_spike_window \(20\)"),
    (dict(temperature=1e-300), r"^temperature must be finite and >= 0.01, got 1e-300"),
    (dict(temperature=math.inf), r"^temperature must be finite"),
    (dict(epsilon_high=math.inf), r"^epsilon_high must be finite and > 0.0, got inf"),
    (dict(epsilon_high=math.inf, clip_mode="static"), r"^epsilon_high must be finite"),
    (dict(output_dir=""), r"^output_dir must be a folder path, got ''"),
    (dict(output_dir="   "), r"^output_dir must be a folder path"),
])
def test_numbers_that_break_a_run_are_refused_when_parsed(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)


def test_the_temperature_floor_keeps_logits_finite_in_fp16():
    """TEMPERATURE_MIN's reason, checked: at the floor, fp16 logits up to 655 stay finite after the division (and
    sampling is greedy for gaps of 1 nat: the lower token's probability is ~4e-44); at 1e-300 every logit
    overflows."""
    import torch

    from calclip.run.field_checks import TEMPERATURE_MIN

    logits = torch.tensor([655.0, -655.0, 30.0, 29.0], dtype=torch.float16)
    assert torch.isfinite(logits / TEMPERATURE_MIN).all()
    probs = torch.softmax(torch.tensor([1.0, 0.0]) / TEMPERATURE_MIN, dim=0)
    assert probs[1] < 1e-40  # e**-100: the lower token is never drawn in practice
    assert not torch.isfinite(torch.tensor([30.0]) / 1e-300).all()


def test_valid_values_and_trl_spellings_still_pass():
    config = _config(fp8=False, learning_rate=0, temperature=0.7, top_p=1.0, top_k=0, min_p=None, beta=0.0,
                     adam_beta2=0.999, scale_rewards=True)  # fmt: skip
    assert config.fp8 is False and config.scale_rewards == "group"  # TRL maps True -> "group"
    assert str(_config(output_dir=Path("unused-output")).output_dir).endswith("unused-output")  # paths pass


def test_yaml_values_are_checked_when_parsed(tmp_path):
    for body, field in (("fp8: [false]\n", "fp8"), ("fp8: 2\n", "fp8"), ("fp8: 0.5\n", "fp8"),
                        ("learning_rate: -1.0e-3\n", "learning_rate"), ("save_final_model: [false]\n",
                                                                         "save_final_model")):  # fmt: skip
        config = tmp_path / "run.yaml"
        config.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\n" + body)
        with pytest.raises(ValueError, match=rf"^{field} must be"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parse_train_args(["--config", str(config)])
    with pytest.raises(ValueError, match=r"^num_train_examples must be an integer"):
        ScriptArguments(num_train_examples="many")


def test_resume_flag():
    assert resume_flag("true") is True and resume_flag("TRUE") is True and resume_flag(True) is True
    assert resume_flag("false") is None and resume_flag(False) is None and resume_flag(None) is None
    assert resume_flag("runs/checkpoint-4") == "runs/checkpoint-4"
    assert resume_flag(Path("runs/checkpoint-4")) == "runs/checkpoint-4"
    with pytest.raises(ValueError, match="resume_from_checkpoint must be"):
        resume_flag(4)
