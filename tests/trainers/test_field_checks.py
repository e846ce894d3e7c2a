"""Config fields are type- and range-checked at construction, inherited ones included, naming the field."""

import math
import warnings
from pathlib import Path

import pytest

from calclip.cli import ScriptArguments, parse_train_args
from calclip.trainers.config import CalibratedDAPOConfig, CalibratedGRPOConfig
from calclip.trainers.field_checks import INHERITED_RANGES, resume_flag


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
     ("max_completion_length", 0), ("temperature", 0.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
     ("min_p", 1.5), ("repetition_penalty", 0.0), ("beta", -0.04), ("num_train_epochs", -1.0)],
)  # fmt: skip
def test_inherited_numbers_out_of_range_are_refused_naming_the_field(name, value):
    assert name in INHERITED_RANGES
    with pytest.raises(ValueError, match=rf"^{name} must be finite and "):
        _config(**{name: value})


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
