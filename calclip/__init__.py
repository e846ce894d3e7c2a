"""calclip: stable full-pipeline FP8 RL for language models.

The math (``calclip.losses``, ``calclip.calibration``, ``calclip.fp8``) imports only torch. The TRL trainer
classes are re-exported lazily from ``calclip.trainers`` so that ``import calclip`` stays light and TRL-free.
"""

__version__ = "0.1.0"

__all__ = ["CalibratedGRPOConfig", "CalibratedDAPOConfig", "CalibratedGRPOTrainer", "CalibratedDAPOTrainer"]


def __getattr__(name):
    if name in __all__:
        from calclip import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'calclip' has no attribute {name!r}")
