"""The arguments of ``calclip train`` (``ScriptArguments``, ``parse_train_args``, ...), defined in
``calclip.trainers.arguments`` so that ``calclip.compare`` reads them without importing ``calclip.cli``; kept
importable from here, where the commands' users look for them."""

from calclip.trainers.arguments import (
    MODEL_DTYPES,
    TRAINERS,
    ScriptArguments,
    config_class,
    parse_train_args,
    resolve_dtype,
)

__all__ = ["MODEL_DTYPES", "TRAINERS", "ScriptArguments", "config_class", "parse_train_args", "resolve_dtype"]
