"""Checks of the config fields calclip relies on, inherited ones included, at construction and naming the field.

The YAML loader and the command line hand values through unconverted where a dataclass field has no single type
(``TrlParser`` reads ``resume_from_checkpoint: true`` from YAML as a bool, ``--resume_from_checkpoint true`` as a
string), so the values are normalized or refused here rather than deep inside ``train()``.
"""

from __future__ import annotations

import os


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
            f"resume_from_checkpoint must be true, false, or a checkpoint folder path, got {value!r} "
            f"({type(value).__name__})"
        )
    if value.strip().lower() in ("true", "false") and not os.path.exists(value):
        return True if value.strip().lower() == "true" else None
    return value
