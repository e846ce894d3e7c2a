"""calclip's part of a checkpoint: the calibrator / spike-detector state file, read without executing code.

``calclip_state.pt`` holds only plain Python values (dicts, lists, tuples, str, int, float, bool, None), so it is
read with ``torch.load(..., weights_only=True)``: a crafted pickle in a downloaded or shared checkpoint is refused
instead of run (transformers reads its own checkpoint files the same way). A file that cannot be read, truncated
by a kill during the save, corrupt, or holding other objects, fails with a message naming the file and the two
ways out.
"""

from __future__ import annotations

import os

import torch

CALCLIP_STATE_NAME = "calclip_state.pt"
_STATE_SECTIONS = ("calibrator", "spike_detector")


class CalclipStateError(RuntimeError):
    """``calclip_state.pt`` could not be read or holds something calclip did not write."""


def _unreadable(path: str, reason: str) -> CalclipStateError:
    return CalclipStateError(
        f"{path}: {reason}. calclip writes this file with the optimizer state of every checkpoint (calibrator and "
        "entropy-spike-detector state, plain values only). Either resume from an earlier checkpoint, or delete "
        f"{path} to resume this checkpoint with a calibrator and spike detector that start fresh (the model, "
        "optimizer and scheduler still resume)."
    )


def save_calclip_state(state: dict, path: str) -> None:
    torch.save(state, path)


def load_calclip_state(path: str) -> dict:
    """The state dict saved in ``path``, read with ``weights_only=True`` (no code from the file runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, garbage bytes, or a pickle that asks for a non-allowlisted global
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise _unreadable(
            path,
            "cannot be read as calclip state: it is truncated, corrupt, or holds objects other than plain values "
            f"(which are not unpickled) ({type(err).__name__}: {first_line})",
        ) from err
    if not isinstance(state, dict) or any(not isinstance(state.get(key), dict) for key in _STATE_SECTIONS):
        raise _unreadable(path, f"does not hold the dict of {_STATE_SECTIONS} calclip writes")
    return state
