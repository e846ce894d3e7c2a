"""Policy losses in pure torch: ratios, clipped surrogate, aggregation, TIS/MIS weights, diagnostics.

Tensors and floats in, ``(loss, stats)`` out; stats are detached 0-dim tensors. Nothing here logs, calls
``.item()`` or imports trl/transformers/accelerate.
"""

from calclip.losses.aggregation import AGGREGATIONS, aggregate
from calclip.losses.importance import IS_MODES, rollout_correction_weights
from calclip.losses.metrics import entropy_stats, kl_k3, masked_mean, token_mult_prob_error
from calclip.losses.ratios import LOG_RATIO_CLAMP, importance_ratio, sequence_log_ratio, token_log_ratio
from calclip.losses.registry import ClipMode, clip_mode_names, get_clip_mode
from calclip.losses.sanitize import SanitizedInputs, sanitize_inputs
from calclip.losses.surrogate import clipped_surrogate, clipped_surrogate_per_token

__all__ = [
    "AGGREGATIONS",
    "IS_MODES",
    "LOG_RATIO_CLAMP",
    "ClipMode",
    "SanitizedInputs",
    "aggregate",
    "clip_mode_names",
    "clipped_surrogate",
    "clipped_surrogate_per_token",
    "entropy_stats",
    "get_clip_mode",
    "importance_ratio",
    "kl_k3",
    "masked_mean",
    "rollout_correction_weights",
    "sanitize_inputs",
    "sequence_log_ratio",
    "token_log_ratio",
    "token_mult_prob_error",
]
