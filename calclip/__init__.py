"""calclip: stable full-pipeline FP8 RL for language models.

The math (``calclip.losses``, ``calclip.calibration``, ``calclip.fp8``) imports only torch. The TRL trainer
classes are imported lazily so that ``import calclip`` stays light and TRL-free.
"""

__version__ = "0.1.0"

_LAZY = {
    "CalibratedGRPOConfig": "calclip.trainers.config",
    "CalibratedDAPOConfig": "calclip.trainers.config",
    "CalibratedGRPOTrainer": "calclip.trainers.grpo",
    "CalibratedDAPOTrainer": "calclip.trainers.dapo",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'calclip' has no attribute {name!r}")


__all__ = list(_LAZY)
