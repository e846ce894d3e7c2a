"""One run owns an ``output_dir``: an exclusive lock file, and a writability check before the model loads.

Two runs on one ``output_dir`` both finish with exit code 0 while their checkpoints and final model replace each
other's; a read-only ``output_dir`` is found at the first save, after ``save_steps`` of training. ``claim_output_dir``
runs before anything expensive (``calclip train`` calls it right after parsing, ``CalibratedGRPOTrainer`` before
TRL loads the model) and:

- creates ``output_dir`` and the lock file ``LOCK_NAME`` in it: that both succeed is the writability check (a
  folder it created is removed again on release when nothing else was written to it);
- takes an exclusive ``flock`` on the lock file and writes its pid, host and start time into it. The kernel drops a
  flock when its process dies, however it dies (SIGKILL, OOM), so a lock file nobody holds is stale by
  construction: it is taken over with a warning naming the process that left it. A held one is an error naming
  the process that holds it.
- the lock is per process and re-entrant: several trainers in one process (a notebook, a test, ``calclip train``
  and the trainer it builds) share it; it is released (the file removed) when the last holder releases it, or at
  interpreter exit.

Only the processes that write to ``output_dir`` take it (``TrainingArguments.should_save``: global rank 0, or
local rank 0 of every node with ``save_on_each_node``), so an ``accelerate launch`` run holds one lock, and ranks
that do not save never fail on it. ``LOCK_NAME`` starts with ``_``: transformers' hub uploads skip such files.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import warnings

try:
    import fcntl
except ImportError:  # not POSIX: no flock; the writability check still runs
    fcntl = None

LOCK_NAME = "_calclip_run.lock"


class OutputDirInUseError(RuntimeError):
    """Another live process holds ``output_dir``'s lock."""


class OutputDirNotWritableError(RuntimeError):
    """``output_dir`` cannot be created or written."""


class OutputDirLock:
    """A claim on one ``output_dir``'s lock (see the module docstring); ``release()`` is idempotent."""

    def __init__(self, path: str) -> None:
        self.path = path  # the lock file
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            _release(self.path)

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# lock file path -> [fd, claims, pid that took it, folder created by the claim]; one flock per process and file.
_held: dict[str, list] = {}
_mutex = threading.Lock()


def claim_output_dir(args) -> OutputDirLock | None:
    """Claim ``args.output_dir`` for this run when this process saves (``args.should_save``), else None."""
    if not args.should_save:
        return None
    return claim_directory(args.output_dir)


def claim_directory(output_dir: str | os.PathLike) -> OutputDirLock:
    """Create ``output_dir`` if needed and take its lock file (OutputDirNotWritableError / OutputDirInUseError)."""
    directory = os.path.abspath(os.fspath(output_dir))
    created = not os.path.isdir(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        raise OutputDirNotWritableError(
            f"output_dir {directory} cannot be created: {error.strerror or error}; checkpoints and the final model "
            "go there, so pick a folder this process can write") from None
    path = os.path.join(directory, LOCK_NAME)
    with _mutex:
        entry = _held.get(path)
        if entry is not None and entry[2] == os.getpid():
            entry[1] += 1
            return OutputDirLock(path)
        try:
            fd = _lock_file(path, directory)
        except BaseException:
            if created:
                _remove_if_empty(directory)
            raise
        _held[path] = [fd, 1, os.getpid(), created]
    return OutputDirLock(path)


def _lock_file(path: str, directory: str) -> int:
    """An fd of ``path`` holding its exclusive flock, with this process's record written in it."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise OutputDirNotWritableError(
                f"output_dir {directory} is not writable ({error.strerror or error} creating {LOCK_NAME}); "
                "checkpoints and the final model go there, so pick a folder this process can write") from None
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read_record(fd))
                os.close(fd)
                raise OutputDirInUseError(
                    f"output_dir {directory} is in use by another run ({holder}; lock file {path}). Two runs in one "
                    "folder overwrite each other's checkpoints and final model: use another output_dir, or wait "
                    "for that run to end.") from None
            except OSError as error:  # a file system without flock (some network mounts)
                warnings.warn(f"output_dir {directory}: cannot lock {LOCK_NAME} ({error.strerror or error}); "
                              "nothing stops a second run from using the same folder", RuntimeWarning, stacklevel=4)
        # The holder we waited for may have removed the file after we opened it: then we hold a lock on a
        # deleted file, and must lock the one now at ``path`` instead.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = _read_record(fd)
    if previous:
        warnings.warn(f"output_dir {directory}: taking over the lock left by a run that is no longer running "
                      f"({_describe(previous)}); it may have left an incomplete checkpoint, which resuming skips",
                      RuntimeWarning, stacklevel=4)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError as error:  # e.g. a full disk: the first checkpoint would fail the same way
        os.close(fd)
        raise OutputDirNotWritableError(f"output_dir {directory} is not writable ({error.strerror or error} "
                                        f"writing {LOCK_NAME})") from None
    return fd


def _read_record(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return {"unreadable": text[:80]}
    return record if isinstance(record, dict) else {"unreadable": text[:80]}


def _describe(record: dict | None) -> str:
    if not record:
        return "a process that has not written its pid yet"
    if "unreadable" in record:
        return f"unreadable record {record['unreadable']!r}"
    return f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}"


def _release(path: str) -> None:
    with _mutex:
        entry = _held.get(path)
        if entry is None or entry[2] != os.getpid():
            return  # released already, or inherited through fork: the process that took it removes it
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[path]
        fd = entry[0]
        try:
            os.unlink(path)  # while still holding the flock: nobody can take a file that is being removed
        except OSError:
            pass
        os.close(fd)
        if entry[3]:
            _remove_if_empty(os.path.dirname(path))


def _remove_if_empty(directory: str) -> None:
    """A folder the claim created and nothing filled (a trainer built and dropped without training)."""
    try:
        os.rmdir(directory)
    except OSError:  # not empty (checkpoints, logs), or already gone
        pass


@atexit.register
def _release_all() -> None:
    for path, entry in list(_held.items()):
        if entry[2] == os.getpid():
            entry[1] = 1
            _release(path)
