"""Run safety: what keeps a training run from silently going wrong or losing work.

- ``run_lock``: one process owns an ``output_dir``; ``run_outputs`` / ``run_callbacks``: the metrics file a
  supervisor reads, and a checkpoint then exit on SIGTERM.
- ``checkpoint``: ``calclip_state.pt`` read without executing code; incomplete checkpoint folders never resumed.
- ``config_file``: a run's YAML read with bounded aliases and no repeated keys; ``field_checks``: config fields
  type- and range-checked naming the field; ``data_checks``: dataset rows checked before training;
  ``reward_checks``: what reward functions return, checked.
- ``grad_guard``: a non-finite gradient step is skipped, a streak of them stops the run.

Modules are imported by their full path; nothing is re-exported.
"""
