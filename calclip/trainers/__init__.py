"""TRL integration: the calibrated trainers and their configs, the glue over calclip's rooms (rollout, run,
monitoring and the math). ``EntropySpikeDetector`` and ``repeated_ngram_fraction`` live in
``calclip.monitoring.callbacks`` and stay importable from here.

With ``calclip.rollout``, the part of calclip that imports TRL. Submodules are imported lazily so that importing the
config does not import the trainer (and its FP8/loss dependencies).
"""

_LAZY = {
    "CalibratedGRPOConfig": "calclip.trainers.config",
    "CalibratedDAPOConfig": "calclip.trainers.config",
    "CalibratedGRPOTrainer": "calclip.trainers.grpo",
    "CalibratedDAPOTrainer": "calclip.trainers.dapo",
    "EntropySpikeDetector": "calclip.monitoring.callbacks",
    "repeated_ngram_fraction": "calclip.monitoring.callbacks",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'calclip.trainers' has no attribute {name!r}")


__all__ = list(_LAZY)
