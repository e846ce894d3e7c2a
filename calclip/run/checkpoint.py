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

One check for every resume. ``checkpoint_problem`` is the rule for all three ways a run resumes:
``resume_from_checkpoint=True`` (the newest folder it passes, newer ones skipped with a warning), an explicit path
(``check_resume_checkpoint``: refused with the reason, never handed to transformers, which would resume a folder
without ``optimizer.pt`` with a fresh optimizer and log a missing RNG state as an INFO line), and ``calclip compare``
(the newest folder it passes). A folder passes when every file a resume reads is present and readable (model
weights, optimizer and scheduler state, an RNG state file, ``trainer_state.json``, ``calclip_state.pt`` with an
optimizer state; torch's zip files and safetensors files whole, not cut short), ``trainer_state.json`` holds an
integer ``global_step`` equal to the folder's ``checkpoint-N`` and not beyond its own ``max_steps``, and calclip's
state was not fitted at a later step than that (its ``last_calibration_step``). The trainer adds the checks that
need its settings: a step beyond this run's ``max_steps`` is refused, and the calibrator state is checked against
the run's cadence and pool sizes (``CalibratedGRPOTrainer.load_calclip_state_dict``).
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
import zipfile

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
_SCHEDULER_NAME = "scheduler.pt"
# Files torch.save writes (a zip archive whose directory sits at its end, so a file cut short is found by reading
# the last bytes only) and safetensors files (a length-prefixed JSON header that gives the data's size).
_TORCH_ZIP_SUFFIXES = (".pt", ".pth", ".bin")
_SAFETENSORS_SUFFIX = ".safetensors"
_STATE_SECTIONS = ("calibrator", "spike_detector")


class CalclipStateError(RuntimeError):
    """``calclip_state.pt`` could not be read or holds something calclip did not write (``reason``: what is wrong)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


class CheckpointError(ValueError):
    """A checkpoint folder that a resume must not use (the message names the folder and what is wrong)."""


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
    """Why ``folder`` cannot be resumed from (a sentence naming the file and what is wrong), or None when it can."""
    if not os.path.isdir(folder):
        return "it is not a folder" if os.path.exists(folder) else "it does not exist"
    step, problem = _trainer_state_step(folder)
    if problem is not None:
        return problem
    match = _CHECKPOINT_DIR.match(os.path.basename(os.path.normpath(folder)))
    if match and int(match.group(1)) != step:
        return (f"{TRAINER_STATE_NAME} says global_step {step} but the folder is {match.group(0)} (saved at step "
                f"{match.group(1)}): the file belongs to another checkpoint or was edited")
    try:
        entries = set(os.listdir(folder))
    except OSError as err:
        return f"the folder cannot be listed ({err})"
    missing = [] if _has_weights(entries) else ["model weights"]
    has_deepspeed = any(name.startswith("global_step") for name in entries)  # optimizer and scheduler inside
    if not has_deepspeed and not (entries & set(_OPTIMIZER_FILES) or any(n.startswith("optimizer_") for n in entries)):
        missing.append("optimizer.pt")
    if not has_deepspeed and _SCHEDULER_NAME not in entries:
        missing.append(_SCHEDULER_NAME)
    if not any(name.startswith("rng_state") for name in entries):
        missing.append("rng_state.pth")
    if CALCLIP_STATE_NAME in entries:
        try:
            state = load_calclip_state(os.path.join(folder, CALCLIP_STATE_NAME))
        except CalclipStateError as err:
            return f"{CALCLIP_STATE_NAME} {err.reason}"
        recorded = state.get(CHECKPOINT_FILES_KEY)
        if isinstance(recorded, list):  # the folder's files when calclip's state was written: none may be gone
            missing += [name for name in recorded if name not in entries and name not in missing]
        problem = _calclip_state_step_problem(state, step)
        if problem is not None:
            return problem
    elif entries & set(_OPTIMIZER_FILES):
        # calclip writes calclip_state.pt right after the optimizer state: with an optimizer state but without it,
        # the save stopped in between (or the file was removed).
        missing.append(CALCLIP_STATE_NAME)
    if missing:
        return f"missing {', '.join(missing)}"
    for name in sorted(entries):
        problem = _file_problem(os.path.join(folder, name))
        if problem is not None:
            return f"{name} {problem}"
    return None


def check_resume_checkpoint(folder: str) -> str:
    """``folder`` when a run may resume from it; else CheckpointError naming the folder and what is wrong (the
    check of an explicit ``resume_from_checkpoint`` path)."""
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise CheckpointError(
            f"resume_from_checkpoint={folder!r} cannot be resumed from: {problem}. Resume from another checkpoint "
            "(resume_from_checkpoint=true takes the newest complete one in output_dir), or start without "
            "resume_from_checkpoint."
        )
    return folder


def checkpoint_step(folder: str) -> int:
    """The ``global_step`` of a checkpoint that ``checkpoint_problem`` passed."""
    step, problem = _trainer_state_step(folder)
    if problem is not None:
        raise CheckpointError(f"{folder}: {problem}")
    return step


def check_resume_step(folder: str, max_steps: int) -> int:
    """The checkpoint's ``global_step``; CheckpointError when it lies beyond the run's ``max_steps`` (> 0): the run
    would stop at once and a caller saving the final model would save the checkpoint's weights as this run's result.
    A checkpoint at exactly ``max_steps`` (a finished run resumed again) trains nothing, with a warning."""
    step = checkpoint_step(folder)
    if max_steps > 0 and step > max_steps:
        raise CheckpointError(
            f"resume_from_checkpoint={folder!r}: its {TRAINER_STATE_NAME} is at global_step {step}, beyond this "
            f"run's max_steps {max_steps}; training would stop at once and train nothing. Raise max_steps, or resume "
            "an earlier checkpoint."
        )
    if max_steps > 0 and step == max_steps:
        warnings.warn(f"resume_from_checkpoint={folder!r} is at max_steps ({step}): nothing is left to train",
                      UserWarning, stacklevel=3)
    return step


def _trainer_state_step(folder: str) -> tuple[int, None] | tuple[None, str]:
    """(global_step, None) from the folder's trainer_state.json, or (None, what is wrong with the file)."""
    path = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return None, f"{TRAINER_STATE_NAME} is missing (the save did not finish)"
    try:
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None, f"{TRAINER_STATE_NAME} cannot be read ({type(err).__name__}: {err})"
    if not isinstance(state, dict):
        return None, f"{TRAINER_STATE_NAME} must hold a JSON object, got {type(state).__name__}"
    for field in ("global_step", "max_steps"):
        value = state.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None, f"{TRAINER_STATE_NAME}: '{field}' must be an integer >= 0, got {_shown(value)}"
    if state["max_steps"] and state["global_step"] > state["max_steps"]:
        return None, (f"{TRAINER_STATE_NAME}: 'global_step' {state['global_step']} exceeds its own 'max_steps' "
                      f"{state['max_steps']}")
    return state["global_step"], None


def _calclip_state_step_problem(state: dict, step: int) -> str | None:
    """A calibrator state fitted at a later step than the checkpoint's (it would hold back every calibration until
    the trainer reached that step: bounds frozen, with no warning)."""
    last = state["calibrator"].get("last_calibration_step")
    if isinstance(last, int) and not isinstance(last, bool) and last > step:
        return (f"{CALCLIP_STATE_NAME}: calibrator 'last_calibration_step' {last} is later than the checkpoint's "
                f"global_step {step} ({TRAINER_STATE_NAME}): the two files come from different runs or steps")
    return None


def _file_problem(path: str) -> str | None:
    """What makes one file of a checkpoint unreadable or cut short (None if nothing is found); folders pass."""
    if os.path.isdir(path):
        return None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            if size == 0:
                return "is empty"
            if path.endswith(_SAFETENSORS_SUFFIX):
                return _safetensors_problem(handle, size)
            if path.endswith(_TORCH_ZIP_SUFFIXES) and not zipfile.is_zipfile(handle):
                return "is not a whole torch.save file (cut short or corrupt)"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None


def _safetensors_problem(handle, size: int) -> str | None:
    header_bytes = handle.read(8)
    if len(header_bytes) < 8:
        return "is cut short (no safetensors header)"
    (header_len,) = struct.unpack("<Q", header_bytes)
    if header_len > size - 8:
        return "is cut short (its safetensors header runs past the end of the file)"
    try:
        header = json.loads(handle.read(header_len))
        end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError) as err:
        return f"has a corrupt safetensors header ({type(err).__name__})"
    if 8 + header_len + end > size:
        return f"is cut short ({size} bytes, its header describes {8 + header_len + end})"
    return None


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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
