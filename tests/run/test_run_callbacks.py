"""The callbacks of a `calclip train` run that a supervisor reads from (calclip.run.run_callbacks): the metrics
file as the trainer logs, and a checkpoint then exit status EXIT_STOPPED on SIGTERM at a generation-cycle end."""

import json
import os
import signal
from types import SimpleNamespace

import pytest

from calclip.run import run_outputs


def test_generation_cycle_boundaries():
    from calclip.run.run_callbacks import ends_generation_cycle

    grpo = SimpleNamespace(gradient_accumulation_steps=1, steps_per_generation=4, num_iterations=1)
    assert [step for step in range(1, 13) if ends_generation_cycle(grpo, step)] == [4, 8, 12]
    assert all(ends_generation_cycle(SimpleNamespace(), step) for step in (1, 2, 3))


def test_metrics_callback_resumes_the_file_at_the_checkpoint_step(tmp_path):
    from calclip.run.run_callbacks import MetricsFileCallback

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "time": float(s)}) + "\n" for s in (1, 2, 3)))
    callback = MetricsFileCallback(path)
    state = SimpleNamespace(is_world_process_zero=True, global_step=2)
    callback.on_train_begin(None, state, None)
    state.global_step = 3
    callback.on_log(None, state, None, logs={"loss": 0.1, "reward": 0.5})
    callback.on_log(None, state, None, logs={"train_runtime": 1.0})  # the summary is not a row
    callback.on_train_end(None, state, None)
    rows = run_outputs.read_metrics(path)
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[2]["reward"] == 0.5
    assert rows[2]["time"] >= 2.0  # the clock continues from the checkpoint's step
    fresh = MetricsFileCallback(path)
    fresh.on_train_begin(None, SimpleNamespace(is_world_process_zero=True, global_step=0), None)
    fresh.on_train_end(None, state, None)
    assert run_outputs.read_metrics(path) == []  # a run starting over starts its file over


def test_sigterm_checkpoints_and_exits_resumable():
    from transformers import TrainerControl

    from calclip.run.run_callbacks import CheckpointOnSigtermCallback

    callback = CheckpointOnSigtermCallback()
    # Generation every 4 micro-steps, 2 micro-steps per optimizer step: cycles end at optimizer steps 2, 4, 6, ...
    args = SimpleNamespace(gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2)
    state = SimpleNamespace(global_step=4, max_steps=10)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        callback.on_train_begin(args, state, TrainerControl())
        control = TrainerControl()
        callback.on_step_end(args, state, control)
        assert not control.should_save and not control.should_training_stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert callback.requested
        state.global_step = 5  # mid-cycle: keep going, a resume there would regenerate early
        callback.on_step_end(args, state, control)
        assert not control.should_save and not control.should_training_stop
        state.global_step = 6
        callback.on_step_end(args, state, control)
        assert control.should_save and control.should_training_stop
        with pytest.raises(SystemExit) as stopped:
            callback.on_train_end(args, state, control)
        assert stopped.value.code == run_outputs.EXIT_STOPPED
        # SIGTERM during the last step: the run finished, no special exit.
        callback.on_train_begin(args, state, control)
        callback.requested = True
        callback.on_train_end(args, SimpleNamespace(global_step=10, max_steps=10), control)
    finally:
        signal.signal(signal.SIGTERM, previous)
