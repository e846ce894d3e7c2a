"""``calclip train --config configs/fp8_calibrated.yaml [--field value ...]``: parse (``arguments``), build the trainer
(model, task rewards, prompts), train, save. Runs the same under ``accelerate launch -m calclip.cli train ...``."""

from __future__ import annotations

from calclip.cli import usage_errors
from calclip.trainers.arguments import ScriptArguments, parse_train_args, resolve_dtype


def build_trainer(script_args: ScriptArguments, training_args, *, callbacks=None, model=None, tokenizer=None):
    """The trainer a `calclip train` run uses: model, task rewards and dataset from ``script_args``."""
    from calclip.models import EMBEDDED_MODEL_NAMES, load_model
    from calclip.tasks import get_task
    from calclip.tasks.prompts import load_prompt_datasets

    if model is None and script_args.model_name_or_path in EMBEDDED_MODEL_NAMES:
        model, tokenizer = load_model(script_args.model_name_or_path, dtype=resolve_dtype(script_args.model_dtype))
    elif model is None:
        # Hub ids and local folders the way TRL's scripts hand them over: the id goes to the trainer, which loads
        # model and tokenizer itself (TRL's create_model_from_path / AutoProcessor) with model_init_kwargs; the
        # config's own model_init_kwargs win over these, as in trl/scripts/grpo.py.
        model = script_args.model_name_or_path
        training_args.model_init_kwargs = {
            "revision": script_args.model_revision,
            "trust_remote_code": training_args.trust_remote_code,
            "dtype": resolve_dtype(script_args.model_dtype),
            **(training_args.model_init_kwargs or {}),
        }
    task = get_task(script_args.task)
    dataset, eval_dataset = load_prompt_datasets(
        script_args, task, seed=training_args.seed, evaluate=training_args.eval_strategy != "no"
    )
    if training_args.reward_weights is None and task.reward_weights is not None:
        training_args.reward_weights = list(task.reward_weights)

    if script_args.trainer == "dapo":
        from calclip.trainers.dapo import CalibratedDAPOTrainer as trainer_class
    else:
        from calclip.trainers.grpo import CalibratedGRPOTrainer as trainer_class
    return trainer_class(
        model=model,
        reward_funcs=list(task.reward_funcs),
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def train(argv: list[str] | None = None):
    """``calclip train``: parse, build, train, save. Returns the trainer."""
    from calclip.run.run_callbacks import train_callbacks
    from calclip.run.run_lock import claim_output_dir

    with usage_errors():  # what the command line got wrong: `calclip train` exits 2 on it, before any run starts
        script_args, training_args = parse_train_args(argv)
        resume = training_args.resume_from_checkpoint
        if isinstance(resume, str):  # an explicit path: refused now, before the model and the data load
            from calclip.run.checkpoint import check_resume_checkpoint, check_resume_step

            check_resume_step(check_resume_checkpoint(resume), training_args.max_steps)
    # Before the model and the data load: a folder another run holds, or one this process cannot write, fails now.
    lock = claim_output_dir(training_args)
    try:
        callbacks = train_callbacks(script_args.metrics_file, script_args.checkpoint_on_sigterm)
        trainer = build_trainer(script_args, training_args, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        if script_args.save_final_model:
            trainer.save_model(training_args.output_dir)
    finally:
        if lock is not None:
            lock.release()  # the trainer holds its own claim for as long as it lives
    return trainer

