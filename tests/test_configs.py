"""Every shipped YAML loads through the CLI's parser into the config class and validates; bad configs name the
offending field."""

from pathlib import Path

import pytest
import yaml

from calclip.cli.arguments import ScriptArguments, parse_train_args
from calclip.cli.demo import DEMO_CONFIG
from calclip.trainers.config import CalibratedDAPOConfig, CalibratedGRPOConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
EXPECTED = {
    "bf16_static.yaml",
    "fp8_static.yaml",
    "fp8_tis.yaml",
    "fp8_calibrated.yaml",
    "fp8_calibrated_tis.yaml",
    "dapo_fp8_calibrated.yaml",
    "demo.yaml",
    "compare_smollm2.yaml",
    "compare_smollm2_tensorwise.yaml",
}


def with_line(path: Path, line: str) -> str:
    """The YAML at ``path`` with ``line`` (``key: value``) replacing that key's line, or appended (a repeated key
    is an error: tests/run/test_config_file.py)."""
    key = line.split(":", 1)[0]
    lines = [text for text in path.read_text().splitlines() if not text.startswith(key + ":")]
    return "\n".join(lines + [line]) + "\n"


def test_every_mode_has_a_config():
    assert {p.name for p in CONFIG_DIR.glob("*.yaml")} == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_and_validates(name):
    path = CONFIG_DIR / name
    text = path.read_text()
    # Header comment: purpose, the command that runs it, one override example.
    header = text.split("\n\n")[0]
    assert header.startswith("# ")
    assert f"calclip train --config configs/{name}" in header
    assert "Override:" in header and "--" in header.split("Override:")[1]

    script_args, args = parse_train_args(["--config", str(path)])
    raw = yaml.safe_load(text)
    assert isinstance(script_args, ScriptArguments)
    expected_class = CalibratedDAPOConfig if raw.get("trainer") == "dapo" else CalibratedGRPOConfig
    assert type(args) is expected_class
    # Every YAML value arrived (nothing silently dropped or renamed).
    for key, value in raw.items():
        target = script_args if hasattr(script_args, key) and key in ScriptArguments.__dataclass_fields__ else args
        got = getattr(target, key)
        got = getattr(got, "value", got)  # enums (save_strategy, ...) compare by value
        if key == "report_to":
            assert got == ([] if value == "none" else [value])
        else:
            assert got == value, key
    # The configs are off-policy on purpose: calibration (and FP8-vs-BF16 monitoring) sees a moved policy.
    assert args.calibration_is_meaningful
    assert args.steps_per_generation > args.gradient_accumulation_steps or args.num_iterations > 1


def test_fp8_configs_say_what_their_name_says():
    def load(name):
        return parse_train_args(["--config", str(CONFIG_DIR / name)])[1]

    assert not load("bf16_static.yaml").fp8 and load("bf16_static.yaml").clip_mode == "static"
    assert load("fp8_static.yaml").fp8 and load("fp8_static.yaml").tis_mode == "none"
    assert load("fp8_tis.yaml").tis_mode == "token_truncate" and load("fp8_tis.yaml").clip_mode == "static"
    assert load("fp8_calibrated.yaml").clip_mode == "calibrated" and load("fp8_calibrated.yaml").tis_mode == "none"
    assert load("fp8_calibrated_tis.yaml").clip_mode == "calibrated"
    assert load("fp8_calibrated_tis.yaml").tis_mode != "none"
    dapo = load("dapo_fp8_calibrated.yaml")
    assert dapo.fp8 and dapo.clip_mode == "calibrated" and dapo.dynamic_sampling and dapo.mask_truncated_completions
    assert (dapo.epsilon, dapo.epsilon_high, dapo.loss_type) == (0.2, 0.28, "dapo")


def test_demo_yaml_mirrors_the_embedded_demo():
    raw = yaml.safe_load((CONFIG_DIR / "demo.yaml").read_text())
    assert raw == DEMO_CONFIG


def test_command_line_overrides_yaml():
    path = str(CONFIG_DIR / "fp8_calibrated.yaml")
    script_args, args = parse_train_args(
        ["--config", path, "--calibration_schedule", "every_step", "--max_steps", "7", "--task", "arithmetic_format"]
    )
    assert args.calibration_schedule == "every_step" and args.max_steps == 7
    assert script_args.task == "arithmetic_format"


def test_unknown_yaml_field_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("clip_mod: calibrated\noutput_dir: x\n")
    with pytest.raises(ValueError, match="clip_mod"):
        parse_train_args(["--config", str(bad)])


def test_unknown_flag_is_named():
    with pytest.raises(ValueError, match="--calibraton_interval"):
        parse_train_args(["--config", str(CONFIG_DIR / "fp8_calibrated.yaml"), "--calibraton_interval", "3"])


@pytest.mark.parametrize(
    "line, match",
    [
        ("clip_mode: calibratd", "clip_mode must be one of"),
        ("tis_mode: token", "tis_mode must be one of"),
        ("calibration_init_bounds: [1.2, 1.8]", "calibration_init_bounds"),
        ("task: algebra", r"task must be one of \[.*'arithmetic_format'\], got 'algebra'"),
        ("trainer: ppo", "trainer must be one of"),
        ("model_dtype: int8", "model_dtype must be one of"),
    ],
)
def test_bad_value_is_named(tmp_path, line, match):
    bad = tmp_path / "bad.yaml"
    bad.write_text(with_line(CONFIG_DIR / "fp8_calibrated.yaml", line))
    with pytest.raises(ValueError, match=match):
        parse_train_args(["--config", str(bad)])


def test_bf16_default_follows_the_machine(tmp_path):
    import torch

    _, args = parse_train_args(["--config", str(CONFIG_DIR / "fp8_calibrated.yaml")])
    assert args.bf16 == torch.cuda.is_available()


def test_usage_doc_lists_every_config():
    usage = (CONFIG_DIR.parent / "docs" / "usage.md").read_text()
    for name in EXPECTED:
        assert f"configs/{name}" in usage, name


def test_config_aliases_cannot_blow_up_the_parse(tmp_path):
    """A 500-byte YAML whose nested aliases stand for 59,049 strings in a list field is refused at load, naming the
    file and the limit; one within the limit (6,561 strings, a wrong type) is refused by the field check with a
    message of bounded length (it used to print the expanded value: 9 levels took minutes and gigabytes)."""
    from tests.run.test_config_file import laughs

    big = tmp_path / "laughs.yaml"
    big.write_text(laughs(4))
    with pytest.raises(ValueError, match=r"laughs.yaml: line \d+: this value expands to \d+ values or more"):
        parse_train_args(["--config", str(big)])
    small = tmp_path / "small.yaml"
    small.write_text(laughs(3))
    with pytest.raises(ValueError, match="fp8_keep_patterns must be a list of regex strings") as info:
        parse_train_args(["--config", str(small)])
    assert len(str(info.value)) < 300


def test_a_repeated_yaml_key_is_named(tmp_path):
    bad = tmp_path / "twice.yaml"
    bad.write_text((CONFIG_DIR / "fp8_calibrated.yaml").read_text() + "\nmax_steps: 3\nmax_steps: 5\n")
    with pytest.raises(ValueError, match=r"twice.yaml: key 'max_steps' appears twice in one mapping \(lines \d+ "
                                         r"and \d+\)"):
        parse_train_args(["--config", str(bad)])


def test_abbreviated_flags_are_refused():
    """argparse's prefix matching is off: --resume_from_check would otherwise become --resume_from_checkpoint, past
    calclip compare's guard of the fields it sets per run (which compares whole names)."""
    for flag in ("--max_step", "--resume_from_check"):
        with pytest.raises(ValueError, match=flag):
            parse_train_args(["--config", str(CONFIG_DIR / "fp8_calibrated.yaml"), flag, "3"])
