"""Runs the arm x seed grid: one ``python -m calclip train`` process per run, in the run's own folder.

A run folder holds ``command.json`` (the train argv), ``train.log`` (stdout+stderr of every attempt),
``metrics.jsonl``, the trainer's ``checkpoint-N/`` folders and ``status.json`` (written when an attempt ends).
A run whose status is ``finished`` is skipped; any other run resumes from its last complete checkpoint (one that
``calclip.run.checkpoint.checkpoint_problem`` passes, the rule every resume uses: every file present and whole,
``trainer_state.json``'s step agreeing with the folder and with calclip's state) or starts over. Up to ``parallel``
processes run at once (several share one GPU, or are spread over ``gpus``). With a time limit, or on SIGTERM, running
processes get SIGTERM: they save a checkpoint after the current step and exit (`EXIT_STOPPED`), so the next call
continues.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from calclip.compare.folder import COMMAND_FILE
from calclip.run.run_outputs import EXIT_STOPPED, METRICS_FILE, last_step, truncate_metrics

STATUS_FILE = "status.json"
LOG_FILE = "train.log"
ERROR_TAIL_LINES = 15
FINISHED, FAILED, STOPPED, RUNNING = "finished", "failed", "stopped", "running"


@dataclass
class RunSpec:
    arm: str
    seed: int
    directory: Path
    train_argv: list[str]  # `calclip train` arguments, without --resume_from_checkpoint
    max_steps: int

    @property
    def label(self) -> str:
        return f"{self.arm}/seed{self.seed}"


@dataclass
class _Active:
    spec: RunSpec
    process: subprocess.Popen
    log: object
    started: float
    gpu: str | None
    stop_sent: float | None = None


@dataclass
class RunOutcome:
    status: str
    returncode: int | None = None
    steps: int = 0
    wall_s: float = 0.0
    error_tail: list[str] = field(default_factory=list)


def read_status(directory: Path) -> dict | None:
    try:
        return json.loads((Path(directory) / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_finished(directory: Path) -> bool:
    status = read_status(directory)
    return bool(status) and status.get("status") == FINISHED


def checkpoint_problems(directory: Path) -> list[tuple[Path, str | None]]:
    """(checkpoint-N folder, why it cannot be resumed from or None), by step."""
    from calclip.run.checkpoint import checkpoint_problem  # torch: not for `calclip compare --list-arms`

    found = []
    for path in Path(directory).glob("checkpoint-*"):
        suffix = path.name.split("-", 1)[1]
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return [(path, checkpoint_problem(str(path))) for _, path in sorted(found)]


def complete_checkpoints(directory: Path) -> list[Path]:
    """checkpoint-N folders a run can resume from, by step."""
    return [path for path, problem in checkpoint_problems(directory) if problem is None]


def attempt_argv(spec: RunSpec) -> tuple[list[str], str]:
    """The argv of the next attempt of an unfinished run and what it does ('resume from checkpoint-N' or 'start')."""
    argv, action, _ = attempt_plan(spec)
    return argv, action


def attempt_plan(spec: RunSpec) -> tuple[list[str], str, list[str]]:
    """``attempt_argv``'s argv and action, and a line per checkpoint folder skipped, naming what is wrong with it.

    Checkpoint folders a run cannot resume from (a process killed while saving, a file cut short or corrupt, a
    trainer_state.json that disagrees with its folder) are removed: the resumed run saves those steps again.
    Without a complete checkpoint the run starts over (its metrics file is rewritten from step 1)."""
    directory = spec.directory
    checked = checkpoint_problems(directory)
    skipped = [f"skipped {path}: {problem}" for path, problem in checked if problem is not None]
    for path, problem in checked:
        if problem is not None:
            shutil.rmtree(path)
    complete = [path for path, problem in checked if problem is None]
    if complete:
        latest = complete[-1]
        # The callback drops the later rows too, but only once the model is loaded; the progress display reads
        # the file now.
        truncate_metrics(directory / METRICS_FILE, int(latest.name.split("-", 1)[1]))
        return [*spec.train_argv, "--resume_from_checkpoint", str(latest)], f"resume from {latest.name}", skipped
    (directory / METRICS_FILE).unlink(missing_ok=True)
    return list(spec.train_argv), "start", skipped


def error_tail(log_path: Path, lines: int = ERROR_TAIL_LINES) -> list[str]:
    """The last lines of the attempt's log (progress-bar redraws split off, blank lines dropped)."""
    try:
        with open(log_path, errors="replace", newline="") as handle:  # newline="": keep tqdm's \r redraws
            text = handle.read()
    except FileNotFoundError:
        return []
    if "\n=== attempt " in text:
        text = text.rsplit("\n=== attempt ", 1)[-1].split("\n", 1)[-1]
    kept = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]
    return [line for line in kept if line.strip()][-lines:]


def child_environment(spec: RunSpec, *, group: str, gpu: str | None, threads: int | None) -> dict[str, str]:
    import calclip

    env = dict(os.environ)
    # The child imports the calclip this process runs (a source checkout works without installing it).
    source_root = str(Path(calclip.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([source_root, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    # W&B: runs of one comparison share a group (wandb.init reads WANDB_RUN_GROUP; the run's name is run_name).
    env["WANDB_RUN_GROUP"] = group
    env.setdefault("WANDB_PROJECT", "calclip-compare")
    env.setdefault("WANDB_DIR", str(spec.directory))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


class Progress:
    """One status line: runs done, running, failed; steps done of all; throughput and time left. Rewritten in
    place on a terminal, printed every `interval_s` otherwise; run events are printed as their own lines."""

    def __init__(self, specs: list[RunSpec], stream=None, interval_s: float = 30.0):
        self.specs = specs
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.total_steps = sum(spec.max_steps for spec in specs)
        self.initial_steps = None
        self.last_printed = 0.0
        self.width = 0

    def steps_done(self, outcomes: dict[str, RunOutcome]) -> int:
        done = 0
        for spec in self.specs:
            outcome = outcomes.get(spec.label)
            if outcome is not None and outcome.status == FINISHED:
                done += spec.max_steps
            else:
                done += min(last_step(spec.directory / METRICS_FILE), spec.max_steps)
        return done

    def line(self, outcomes: dict[str, RunOutcome], running: int) -> str:
        steps = self.steps_done(outcomes)
        if self.initial_steps is None:
            self.initial_steps = steps
        finished = sum(outcome.status == FINISHED for outcome in outcomes.values())
        failed = sum(outcome.status == FAILED for outcome in outcomes.values())
        elapsed = time.monotonic() - self.started
        gained = steps - self.initial_steps
        parts = [f"runs {finished}/{len(self.specs)} done", f"{running} running"]
        if failed:
            parts.append(f"{failed} failed")
        parts.append(f"steps {steps}/{self.total_steps}")
        if steps >= self.total_steps:
            parts.append("done")
        elif gained > 0 and elapsed > 0:
            rate = gained / elapsed
            parts.append(f"{rate:.2f} steps/s, ~{format_seconds((self.total_steps - steps) / rate)} left")
        else:
            parts.append("time left: estimating")
        return f"[compare {format_seconds(elapsed)}] " + " | ".join(parts)

    def show(self, outcomes, running: int, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            text = self.line(outcomes, running)
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
            self.stream.flush()
        elif force or now - self.last_printed >= self.interval_s:
            self.stream.write(self.line(outcomes, running) + "\n")
            self.stream.flush()
            self.last_printed = now

    def event(self, message: str) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
        self.stream.write(message + "\n")
        self.stream.flush()


def run_grid(
    specs: list[RunSpec],
    *,
    parallel: int = 1,
    gpus: list[str] | None = None,
    group: str = "calclip-compare",
    time_limit_s: float | None = None,
    stop_timeout_s: float = 180.0,
    threads_per_run: int | None = None,
    stream=None,
    poll_s: float = 0.5,
) -> dict[str, RunOutcome]:
    """Run every unfinished spec; return an outcome per spec label (finished runs found on disk included)."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    progress = Progress(specs, stream)
    outcomes: dict[str, RunOutcome] = {}
    pending: list[RunSpec] = []
    for spec in specs:
        if is_finished(spec.directory):
            status = read_status(spec.directory)
            outcomes[spec.label] = RunOutcome(FINISHED, 0, status.get("steps", spec.max_steps),
                                              status.get("wall_s", 0.0))
        else:
            pending.append(spec)
    if len(pending) < len(specs):
        progress.event(f"{len(specs) - len(pending)} of {len(specs)} runs already finished: skipped")

    active: list[_Active] = []
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    stop = {"requested": False, "why": ""}

    def on_sigterm(signum, frame):
        stop.update(requested=True, why="SIGTERM")

    previous_handler = signal.signal(signal.SIGTERM, on_sigterm) if _in_main_thread() else None
    try:
        while pending or active:
            if not stop["requested"] and deadline is not None and time.monotonic() >= deadline:
                stop.update(requested=True, why=f"time limit {format_seconds(time_limit_s)}")
            if stop["requested"]:
                if pending:
                    progress.event(f"stopping ({stop['why']}): {len(pending)} runs not started; "
                                   f"{len(active)} running runs checkpoint and exit. Run the same command to continue.")
                    pending.clear()
                _stop_active(active, stop_timeout_s)
            while not stop["requested"] and pending and len(active) < parallel:
                active.append(_launch(pending.pop(0), group, gpus, active, threads_per_run, progress))
            for run in list(active):
                returncode = run.process.poll()
                if returncode is None:
                    continue
                active.remove(run)
                outcome = _finish(run, returncode)
                outcomes[run.spec.label] = outcome
                _report_outcome(run.spec, outcome, progress)
            progress.show(outcomes, len(active))
            if pending or active:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        for run in active:
            if run.process.poll() is None:
                run.process.kill()
            run.process.wait()
            run.log.close()
        progress.event("interrupted: run the same command to continue (runs resume from their last checkpoint)")
        raise
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    progress.show(outcomes, 0, force=True)
    if progress.tty:
        progress.stream.write("\n")
    return outcomes


def _launch(spec: RunSpec, group, gpus, active, threads, progress) -> _Active:
    spec.directory.mkdir(parents=True, exist_ok=True)
    argv, action, skipped = attempt_plan(spec)
    for line in skipped:  # a checkpoint given up is said where the user looks: the progress stream and the log
        progress.event(f"{spec.label}: {line}")
    (spec.directory / COMMAND_FILE).write_text(json.dumps({"train_argv": spec.train_argv}, indent=1) + "\n")
    # wall_s adds up the attempts that produced the run's steps: a run that starts over starts at 0.
    prior_wall = 0.0 if action == "start" else (read_status(spec.directory) or {}).get("wall_s", 0.0)
    gpu = None
    if gpus:  # the GPU with the fewest runs on it
        gpu = min(gpus, key=lambda g: sum(run.gpu == g for run in active))
    log = (spec.directory / LOG_FILE).open("a")
    log.write(f"\n=== attempt {time.strftime('%Y-%m-%d %H:%M:%S')}: {action} ===\n")
    log.writelines(line + "\n" for line in skipped)
    log.flush()
    process = subprocess.Popen(
        [sys.executable, "-m", "calclip", "train", *argv],  # the calclip entry point: a process, not an import
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_environment(spec, group=group, gpu=gpu, threads=threads),
    )
    _write_status(spec.directory, {"status": RUNNING, "pid": process.pid, "wall_s": prior_wall})
    where = f" on GPU {gpu}" if gpu is not None else ""
    progress.event(f"started {spec.label}{where} ({action})")
    return _Active(spec, process, log, time.monotonic(), gpu)


def _stop_active(active: list[_Active], stop_timeout_s: float) -> None:
    now = time.monotonic()
    for run in active:
        if run.process.poll() is not None:
            continue
        if run.stop_sent is None:
            run.process.send_signal(signal.SIGTERM)
            run.stop_sent = now
        elif now - run.stop_sent > stop_timeout_s:
            run.process.kill()


def _finish(run: _Active, returncode: int) -> RunOutcome:
    run.log.close()
    wall = time.monotonic() - run.started
    steps = last_step(run.spec.directory / METRICS_FILE)
    if returncode == 0:
        outcome = RunOutcome(FINISHED, returncode, steps, wall)
    elif returncode == EXIT_STOPPED or run.stop_sent is not None:
        outcome = RunOutcome(STOPPED, returncode, steps, wall)
    else:
        outcome = RunOutcome(FAILED, returncode, steps, wall, error_tail(run.spec.directory / LOG_FILE))
    outcome.wall_s = (read_status(run.spec.directory) or {}).get("wall_s", 0.0) + wall
    _write_status(run.spec.directory, {
        "status": outcome.status, "returncode": returncode, "steps": steps, "wall_s": round(outcome.wall_s, 1),
        "ended": time.strftime("%Y-%m-%d %H:%M:%S"), "error_tail": outcome.error_tail,
    })
    return outcome


def _write_status(directory: Path, status: dict) -> None:
    tmp = directory / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps(status, indent=1) + "\n")
    tmp.replace(directory / STATUS_FILE)


def _report_outcome(spec: RunSpec, outcome: RunOutcome, progress: Progress) -> None:
    if outcome.status == FINISHED:
        progress.event(f"finished {spec.label}: {outcome.steps} steps in {format_seconds(outcome.wall_s)}")
    elif outcome.status == STOPPED:
        progress.event(f"stopped {spec.label} at step {outcome.steps} (resumable)")
    else:
        tail = "\n".join(f"    {line}" for line in outcome.error_tail)
        progress.event(f"FAILED {spec.label} (exit {outcome.returncode}) after step {outcome.steps}; "
                       f"log {spec.directory / LOG_FILE}:\n{tail}")


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
