"""calclip's part of a checkpoint: the calibrator / spike-detector state file, read without executing code, and
the choice of the checkpoint ``resume_from_checkpoint=True`` resumes from.

``calclip_state.pt`` holds only plain Python values (dicts, lists, tuples, str, int, float, bool, None), so it is
read with ``torch.load(..., weights_only=True)``: a crafted pickle in a downloaded or shared checkpoint is refused
instead of run (transformers reads its own checkpoint files the same way). A file that cannot be read, truncated
by a kill during the save, corrupt, or holding other objects, fails with a message naming the file and the two
ways out.

Crash-safe resume. transformers writes a checkpoint folder file by file (model, tokenizer, training_args.bin, then
optimizer.pt and scheduler.pt, where calclip adds calclip_state.pt, then rng_state.pth, and trainer_state.json last)
and its ``get_last_checkpoint`` picks the highest-numbered ``checkpoint-N`` folder whatever it holds, so a run killed
during a save resumes from the half-written folder and crashes. ``calclip_state.pt`` records the folder's file names
at the moment it is written (``checkpoint_files``); ``checkpoint_problem`` calls a folder complete when
trainer_state.json parses, calclip_state.pt reads, and every recorded file, an RNG state file and those two exist.
``latest_complete_checkpoint`` skips incomplete folders with a warning naming each one.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import torch

CALCLIP_STATE_NAME = "calclip_state.pt"
CHECKPOINT_FILES_KEY = "checkpoint_files"  # the folder's entries when calclip_state.pt was written
TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name; written last by Trainer._save_checkpoint
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR-<global step>
# Model weights as Trainer.save_model writes them (full model, sharded, PEFT adapter, FSDP or DeepSpeed folders):
# the one requirement of a checkpoint that has no calclip_state.pt (save_only_model, or saved by another trainer).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")  # fmt: skip
_WEIGHT_DIR_PREFIXES = ("pytorch_model_fsdp", "global_step")
_OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
_STATE_SECTIONS = ("calibrator", "spike_detector")


class CalclipStateError(RuntimeError):
    """``calclip_state.pt`` could not be read or holds something calclip did not write (``reason``: what is wrong)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


def _unreadable(path: str, reason: str) -> CalclipStateError:
    return CalclipStateError(
        f"{path}: {reason}. calclip writes this file with the optimizer state of every checkpoint (calibrator and "
        "entropy-spike-detector state, plain values only). Either resume from an earlier checkpoint, or delete "
        f"{path} to resume this checkpoint with a calibrator and spike detector that start fresh (the model, "
        "optimizer and scheduler still resume).",
        reason,
    )


def save_calclip_state(state: dict, path: str) -> None:
    """Write ``state`` plus the names of the entries already in the checkpoint folder (see the module docstring)."""
    folder = os.path.dirname(path) or "."
    files = sorted(name for name in os.listdir(folder) if name != os.path.basename(path))
    torch.save({**state, CHECKPOINT_FILES_KEY: files}, path)


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


def checkpoint_problem(folder: str) -> str | None:
    """Why ``folder`` is not a complete checkpoint (a sentence), or None when it is complete."""
    trainer_state = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(trainer_state):
        return f"{TRAINER_STATE_NAME} is missing (the save did not finish)"
    try:
        with open(trainer_state) as handle:
            json.load(handle)
    except (OSError, ValueError) as err:
        return f"{TRAINER_STATE_NAME} cannot be read ({err})"
    entries = set(os.listdir(folder))
    state_path = os.path.join(folder, CALCLIP_STATE_NAME)
    if CALCLIP_STATE_NAME in entries:
        try:
            state = load_calclip_state(state_path)
        except CalclipStateError as err:
            return f"{CALCLIP_STATE_NAME} {err.reason}"
        recorded = state.get(CHECKPOINT_FILES_KEY)
        if isinstance(recorded, list):
            missing = [name for name in recorded if name not in entries]
        else:  # written before calclip recorded the folder's files: the files a resume reads
            missing = [] if _has_weights(entries) else ["model weights"]
            if not entries & set(_OPTIMIZER_FILES):
                missing.append("optimizer.pt")
        if not any(name.startswith("rng_state") for name in entries):
            missing.append("rng_state.pth")
    else:
        # calclip writes calclip_state.pt right after the optimizer state: with an optimizer state but without it,
        # the save stopped in between (or the file was removed). Without either, a save_only_model checkpoint.
        missing = [CALCLIP_STATE_NAME] if entries & set(_OPTIMIZER_FILES) else []
        if not _has_weights(entries):
            missing.append("model weights")
    return f"missing {', '.join(missing)}" if missing else None


def _has_weights(entries: set[str]) -> bool:
    return bool(entries & set(_WEIGHT_FILES)) or any(name.startswith(_WEIGHT_DIR_PREFIXES) for name in entries)


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The highest-numbered complete ``checkpoint-N`` folder of ``output_dir`` (None if there is none); every newer,
    incomplete one is skipped with a warning naming it and what it lacks."""
    if not os.path.isdir(output_dir):
        return None
    numbered = [
        (int(match.group(1)), os.path.join(output_dir, name))
        for name in os.listdir(output_dir)
        if (match := _CHECKPOINT_DIR.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    ]
    for _, folder in sorted(numbered, reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        warnings.warn(
            f"resume_from_checkpoint=True: skipping incomplete checkpoint {folder} ({problem}); an interrupted save "
            "leaves such a folder. Resuming from the latest complete checkpoint instead.",
            UserWarning,
            stacklevel=3,
        )
    return None
