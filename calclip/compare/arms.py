"""The arms of a comparison: named sets of config overrides applied on top of one shared config.

An arm only sets the fields that define it (precision, clip mode, rollout correction); everything else (model,
task, batch, learning rate, ``tis_cap``, ...) comes from the shared config, so two arms differ exactly in their
arm fields. Presets live in `PRESETS`; a user arm is ``NAME:field=value,field=value`` on the command line
(`parse_arm_spec`). Looking up an unknown name raises ValueError listing the valid ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, unique


@unique
class Preset(str, Enum):
    BF16_STATIC = "bf16_static"  # the reference: no FP8, TRL's static clip [1-eps, 1+eps]
    FP8_STATIC = "fp8_static"  # full-pipeline FP8, static clip: the failure case
    FP8_TIS = "fp8_tis"  # FP8, static clip + token-level truncated importance sampling (the common fix)
    FP8_CALIBRATED = "fp8_calibrated"  # FP8 + Calibrated Clipping (the paper's method)
    FP8_CALIBRATED_TIS = "fp8_calibrated_tis"  # FP8 + Calibrated Clipping + token-level TIS
    FP8_ORACLE = "fp8_oracle"  # FP8, clipped exactly where the BF16 shadow clips: the best any calibration can do


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict  # field -> value, as YAML would hold it (bool, int, float, str, list)
    description: str = ""

    def train_flags(self) -> list[str]:
        """The overrides as ``calclip train`` command-line flags (TrlParser parses the strings): a single value as
        one argument ``--field=value`` (argparse then takes it whole, '-1e-5' included); a list as ``--field`` and
        one argument per item, none of which may look like a flag (``_checked``). No value becomes an extra flag."""
        flags: list[str] = []
        for name, value in self.overrides.items():
            if isinstance(value, (list, tuple)):
                flags.append(f"--{name}")
                flags.extend(_flag_values(value))
            else:
                flags.append(f"--{name}={_flag_values(value)[0]}")
        return flags


PRESETS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm(Preset.BF16_STATIC.value, {"fp8": False, "clip_mode": "static", "tis_mode": "none"},
            "no FP8, static clip [1-epsilon, 1+epsilon]"),
        Arm(Preset.FP8_STATIC.value, {"fp8": True, "clip_mode": "static", "tis_mode": "none"},
            "block FP8 (rollout and training), static clip"),
        Arm(Preset.FP8_TIS.value, {"fp8": True, "clip_mode": "static", "tis_mode": "token_truncate"},
            "block FP8, static clip, token-level TIS capped at tis_cap"),
        Arm(Preset.FP8_CALIBRATED.value, {"fp8": True, "clip_mode": "calibrated", "tis_mode": "none"},
            "block FP8, Calibrated Clipping"),
        Arm(Preset.FP8_CALIBRATED_TIS.value, {"fp8": True, "clip_mode": "calibrated", "tis_mode": "token_truncate"},
            "block FP8, Calibrated Clipping, token-level TIS capped at tis_cap"),
        Arm(Preset.FP8_ORACLE.value, {"fp8": True, "clip_mode": "oracle", "tis_mode": "none"},
            "block FP8, per token the clip decisions of the BF16 shadow (a reference, not a method)"),
    )
}
DEFAULT_ARMS = ("bf16_static", "fp8_static", "fp8_tis", "fp8_calibrated")

# Fields a comparison sets per run itself; neither an arm nor a shared-config flag may set them.
RUN_FIELDS = ("seed", "output_dir", "run_name", "resume_from_checkpoint", "metrics_file", "checkpoint_on_sigterm")

_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's own test for a value that starts with '-'


def preset_names() -> tuple[str, ...]:
    return tuple(preset.value for preset in Preset)


def parse_arm_spec(spec: str) -> Arm:
    """``NAME:field=value,field=value`` -> Arm. A list value is space-separated (``calibration_init_bounds=0.5 2``);
    no value or list item may look like a flag (``fp8=true --resume_from_checkpoint DIR`` would otherwise pass a
    foreign flag to every run of the arm).

    Values stay strings (TrlParser converts them exactly as it converts ``calclip train`` flags); whether a field
    exists and a value is valid is checked when the comparison resolves each arm's config.
    """
    name, sep, body = spec.partition(":")
    name = name.strip()
    if not sep or not body.strip():
        raise ValueError(f"arm spec {spec!r}: expected NAME:field=value[,field=value...]")
    if not _ARM_NAME.match(name):
        raise ValueError(f"arm spec {spec!r}: arm name {name!r} must be letters, digits, '_', '-' or '.'")
    overrides: dict = {}
    for item in body.split(","):
        field, eq, value = item.partition("=")
        field = field.strip().lstrip("-").replace("-", "_")
        if not eq or not field or not value.strip():
            raise ValueError(f"arm spec {spec!r}: {item!r} is not field=value")
        if field in overrides:
            raise ValueError(f"arm spec {spec!r}: field {field!r} given twice")
        parts = value.split()
        overrides[field] = parts[0] if len(parts) == 1 else parts
    return _checked(Arm(name, overrides, "user arm"))


def resolve_arms(names: list[str], user_arms: list[Arm] = ()) -> list[Arm]:
    """The arms named, in order: user arms first (a user arm may not reuse a preset's name), then presets."""
    registry = dict(PRESETS)
    for arm in user_arms:
        if arm.name in registry:
            kind = "preset" if arm.name in PRESETS else "user arm"
            raise ValueError(f"arm {arm.name!r} defined twice (it is already a {kind}); pick another name")
        registry[arm.name] = arm
    if not names:
        raise ValueError("no arms given")
    unknown = [name for name in names if name not in registry]
    if unknown:
        valid = ", ".join(registry)
        raise ValueError(f"unknown arm(s) {', '.join(map(repr, unknown))}; valid arms: {valid} "
                         "(or define one with --arm NAME:field=value,...)")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"arm(s) listed twice: {', '.join(duplicates)}")
    return [registry[name] for name in names]


def arm_fields(arms: list[Arm]) -> set[str]:
    """Every field some arm of the comparison sets."""
    return {field for arm in arms for field in arm.overrides}


# The files calclip compare writes at the top of its folder, next to the arms' folders (folder.COMPARISON_FILE and its
# temporary file, folder.LOCK_FILE, report.REPORT_FILE and FIGURE_FILE, the copied config): an arm of one of these
# names trained every run and then could not write the report. Compared without case (macOS and Windows file names).
COMPARISON_FILES = ("comparison.json", "comparison.tmp", ".compare.lock", "report.md", "figure.png", "config.yaml")


def _checked(arm: Arm) -> Arm:
    if arm.name.lower() in COMPARISON_FILES:
        raise ValueError(f"arm name {arm.name!r} is a file calclip compare writes in the comparison folder "
                         f"({', '.join(COMPARISON_FILES)}); pick another name")
    reserved = sorted(set(arm.overrides) & set(RUN_FIELDS))
    if reserved:
        raise ValueError(f"arm {arm.name!r} sets {', '.join(reserved)}: calclip compare sets these per run")
    for field, value in arm.overrides.items():
        if not isinstance(value, (list, tuple)):
            continue  # one argument --field=value: nothing in it can become a flag
        flag_like = [item for item in _flag_values(value) if looks_like_a_flag(item)]
        if flag_like:
            raise ValueError(f"arm {arm.name!r}: {field}={' '.join(_flag_values(value))!r} holds "
                             f"{flag_like[0]!r}, which `calclip train` would read as a flag: an arm value is one "
                             "value (a list: values separated by spaces), never more flags")
    return arm


def looks_like_a_flag(item: str) -> bool:
    """Whether argparse would take ``item`` for an option rather than a value: it starts with '-' and is not a
    plain negative number ('-1', '-.5', '-0.5' are values; '-1e-5' and '-inf' are options to argparse)."""
    return item.startswith("-") and not _NEGATIVE_NUMBER.match(item)


def _flag_values(value) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, (list, tuple)):
        return [item for element in value for item in _flag_values(element)]
    return [str(value)]
