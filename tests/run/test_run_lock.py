"""One run owns an output_dir (calclip.run.run_lock): a second process is refused naming the holder, a dead
holder's lock is taken over with a warning, an unwritable folder fails, all before any model loads; processes that
do not save (ranks > 0) take no lock (tests/trainers/test_launch_modes.py checks that under accelerate)."""

import gc
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from calclip.cli.train import train
from calclip.run import run_lock
from calclip.run.run_lock import (
    LOCK_NAME, OutputDirInUseError, OutputDirNotWritableError, claim_directory, claim_output_dir,
)

ROOT = Path(__file__).resolve().parents[2]
# A process that claims the folder in argv[1], says so, and holds it until its stdin closes.
_HOLDER = """
import sys
from calclip.run.run_lock import claim_directory
lock = claim_directory(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


class Holder:
    """Another process holding ``directory``'s lock (context manager; ``kill()`` ends it with SIGKILL)."""

    def __init__(self, directory):
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout.readline().strip() == "held"

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            assert self.proc.wait(timeout=30) == 0


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    with Holder(tmp_path / "run") as holder:
        record = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert record["pid"] == holder.proc.pid
        with pytest.raises(OutputDirInUseError, match=rf"output_dir .*run is in use by another run \(pid "
                                                      rf"{holder.proc.pid} on host"):
            claim_directory(tmp_path / "run")
    assert not (tmp_path / "run" / LOCK_NAME).exists()  # released on exit: the file is gone
    with claim_directory(tmp_path / "run"):  # and the folder is free, with no warning
        assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path):
    holder = Holder(tmp_path)
    pid = holder.proc.pid
    holder.kill()  # no clean-up ran: the file and its record stay, the kernel dropped the flock
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == pid
    with pytest.warns(RuntimeWarning, match=rf"taking over the lock left by a run that is no longer running "
                                            rf"\(pid {pid} on host"):
        lock = claim_directory(tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_one_process_shares_its_claim_and_the_last_release_frees_it(tmp_path):
    first, second = claim_directory(tmp_path), claim_directory(tmp_path / ".")
    first.release()
    first.release()  # idempotent: one claim is released once
    assert (tmp_path / LOCK_NAME).exists()
    second.release()
    assert not (tmp_path / LOCK_NAME).exists() and tmp_path.is_dir()  # a folder that existed stays


def test_a_folder_the_claim_created_goes_again_unless_something_was_written(tmp_path):
    with claim_directory(tmp_path / "empty"):
        assert (tmp_path / "empty" / LOCK_NAME).exists()
    assert not (tmp_path / "empty").exists()
    with claim_directory(tmp_path / "used"):
        (tmp_path / "used" / "checkpoint-1").mkdir()
    assert (tmp_path / "used" / "checkpoint-1").is_dir() and not (tmp_path / "used" / LOCK_NAME).exists()


def test_processes_that_do_not_save_take_no_lock(tmp_path):
    """accelerate ranks > 0 (TrainingArguments.should_save False) neither lock nor touch the folder."""
    args = types.SimpleNamespace(should_save=False, output_dir=str(tmp_path / "never"))
    assert claim_output_dir(args) is None and not (tmp_path / "never").exists()


def _train_argv(output_dir):
    return ["--config", str(ROOT / "configs" / "demo.yaml"), "--model_name_or_path", "tiny", "--output_dir",
            str(output_dir), "--report_to", "none", "--max_steps", "1"]


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output_dir check")

    monkeypatch.setattr("calclip.cli.train.build_trainer", refuse)


def test_calclip_train_refuses_a_folder_another_run_holds_before_loading(tmp_path, no_model_load):
    with Holder(tmp_path / "run") as holder:
        with pytest.raises(OutputDirInUseError, match=f"pid {holder.proc.pid}"):
            train(_train_argv(tmp_path / "run"))


def test_calclip_train_refuses_an_unwritable_folder_before_loading(tmp_path, no_model_load):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirNotWritableError, match=r"output_dir .*file/run cannot be created"):
        train(_train_argv(tmp_path / "file" / "run"))
    if os.geteuid() != 0:  # root writes into read-only folders
        (tmp_path / "ro").mkdir(mode=0o555)
        with pytest.raises(OutputDirNotWritableError, match=r"output_dir .*ro is not writable"):
            train(_train_argv(tmp_path / "ro"))


def test_the_trainer_claims_its_folder_before_trl_loads_the_model(tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from tests.fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path / "free", max_steps=1)
    record = json.loads((tmp_path / "free" / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and trainer._output_dir_lock is not None
    del trainer
    gc.collect()
    assert not (tmp_path / "free" / LOCK_NAME).exists()  # released with the trainer

    def refuse(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ (the model load) ran before the output_dir check")

    monkeypatch.setattr(GRPOTrainer, "__init__", refuse)
    with Holder(tmp_path / "held") as holder:
        with pytest.raises(OutputDirInUseError, match=f"pid {holder.proc.pid}"):
            tiny_trainer(tmp_path / "held", max_steps=1)
    assert str(tmp_path / "held" / LOCK_NAME) not in run_lock._held  # the refused claim left nothing held
