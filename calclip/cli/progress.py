"""The demo's progress bar: transformers' bar prints every log dict; this one shows a few numbers."""

from __future__ import annotations


def use_compact_progress_bar(trainer) -> None:
    """Replace transformers' progress bar (which prints every log dict) with one that shows a few numbers."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_compact_progress_callback_class()())


def _compact_progress_callback_class():
    # Built on first use: it subclasses a transformers class, and `import calclip.cli.demo` stays light.
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class CompactProgressCallback(TrainerCallback):
        """A tqdm bar over optimizer steps whose postfix shows reward, entropy and the bounds in force."""

        shown = (("reward", "reward"), ("entropy", "entropy"), ("calib/low", "low"), ("calib/high", "high"))

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = (tqdm(total=state.max_steps, desc="train", dynamic_ncols=True) if state.is_world_process_zero
                        else None)
            self.latest = {}

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs:
                # reward is logged only on generating steps: keep showing the last value
                self.latest.update({name: f"{logs[key]:.3g}" for key, name in self.shown if key in logs})
                self.bar.set_postfix(self.latest)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()

    return CompactProgressCallback

