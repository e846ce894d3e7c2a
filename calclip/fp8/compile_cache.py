"""torch.compile's on-disk caches and calclip's ops: the key must change when calclip's dispatch does.

AOTAutograd's cache (and Inductor's FX graph cache behind it) keys a graph that calls ``calclip::fp8_linear_forward``
and its siblings (linear_ops.py) by the Dynamo graph, the example inputs and the Triton kernels it finds inside the
ops: not by the Python inside the ops that decides which GEMM runs and how its operands are laid out (linear_math.py,
gemm.py, quant.py), nor by the environment switches those modules read at import. A process that compiled a layer
with one dispatch therefore served its compiled graph to later processes with another: on the H200 (2026-12-05) a run
with ``CALCLIP_SCALED_MM_PAD_ROWS=0`` left a compiled 4093-token layer on the Triton GEMMs, and the next run, with the
padding on, loaded it from the cache (its compiled arm unchanged, 2.74 -> 2.76 ms, where eager went 2.81 -> 1.75 ms).
An upgraded calclip would do the same with a fixed bug.

``tag_compile_caches`` (called when linear_ops registers the ops) appends a fingerprint of calclip.fp8's sources and of
those switches to ``torch.compiler.config.cache_key_tag``, which every torch.compile cache key includes; a tag the
user set is kept in front of it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch

# Environment switches calclip.fp8 reads once at import and that change what a compiled graph runs.
DISPATCH_ENV = ("CALCLIP_SCALED_MM_PAD_ROWS", "CALCLIP_SPLITK_MAX_M", "CALCLIP_TRITON_AUTOTUNE",
                "CALCLIP_TRITON_FAST_LAUNCH", "CALCLIP_REFRESH_GRAPH", "CALCLIP_ONE_BUFFER", "CALCLIP_DIV_FREE")
TAG_PREFIX = "calclip-fp8-"
_ROOT = Path(__file__).resolve().parent


def dispatch_fingerprint(root: Path = _ROOT, env: Mapping[str, str] = os.environ) -> str:
    """16 hex digits of a SHA-256 over every ``*.py`` under ``root`` (relative path and bytes, in sorted order) and
    the values of ``DISPATCH_ENV`` in ``env``."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for name in DISPATCH_ENV:
        digest.update(f"{name}={env.get(name)}\0".encode())
    return digest.hexdigest()[:16]


def tag_compile_caches() -> str:
    """Put calclip's fingerprint into ``torch.compiler.config.cache_key_tag`` (appended after "|" to a user's tag; an
    older calclip tag is replaced, never stacked). Returns the tag now in force ("" on a torch without the setting,
    torch < 2.7, whose AOTAutograd cache is off by default)."""
    config = getattr(torch.compiler, "config", None)
    if not hasattr(config, "cache_key_tag"):
        return ""
    ours = TAG_PREFIX + dispatch_fingerprint()
    kept = [part for part in config.cache_key_tag.split("|") if part and not part.startswith(TAG_PREFIX)]
    config.cache_key_tag = "|".join([*kept, ours])
    return config.cache_key_tag
