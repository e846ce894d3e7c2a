"""Where a `calclip train` run's prompts come from, in the order it looks:

- ``dataset_name`` (TRL's scripts' convention, TRL's field names and meaning): ``datasets.load_dataset(dataset_name,
  name=dataset_config, streaming=dataset_streaming)``, then the ``dataset_train_split`` split for training and, when
  the run evaluates, the ``dataset_test_split`` split. A hub id, or a local folder / data file datasets can read;
  datasets decides, and with ``HF_HUB_OFFLINE=1`` it reads its cache or raises its own error.
- ``dataset_path``: calclip's loader for one local file or ``save_to_disk`` folder (`calclip.tasks`).
- neither: the task generates ``num_train_examples`` prompts.

Either way the rows need a ``prompt`` column and the columns the task's reward functions read.
"""

from __future__ import annotations


def load_hub_dataset(
    dataset_name: str,
    *,
    dataset_config: str | None = None,
    train_split: str = "train",
    test_split: str | None = None,
    streaming: bool = False,
):
    """``(train_dataset, eval_dataset)`` the way TRL's ``grpo.py`` loads them; ``eval_dataset`` is None unless
    ``test_split`` is given. A split the dataset does not have fails naming the field and the splits it has."""
    import datasets

    loaded = datasets.load_dataset(dataset_name, name=dataset_config, streaming=streaming)
    return (
        _split(loaded, train_split, "dataset_train_split", dataset_name),
        None if test_split is None else _split(loaded, test_split, "dataset_test_split", dataset_name),
    )


def _split(loaded, split: str, field_name: str, dataset_name: str):
    if split not in loaded:
        raise ValueError(
            f"{field_name} {split!r} is not a split of dataset_name {dataset_name!r}; it has {sorted(loaded)}"
        )
    return loaded[split]


def load_prompt_datasets(script_args, task, *, seed: int, evaluate: bool):
    """``(train_dataset, eval_dataset)`` for a run from `calclip.cli.arguments.ScriptArguments`-like fields (module
    docstring). ``evaluate``: whether the run evaluates (``eval_strategy != "no"``); only ``dataset_name`` datasets
    bring an eval split, as in TRL's scripts."""
    if script_args.dataset_name:
        return load_hub_dataset(
            script_args.dataset_name,
            dataset_config=script_args.dataset_config,
            train_split=script_args.dataset_train_split,
            test_split=script_args.dataset_test_split if evaluate else None,
            streaming=script_args.dataset_streaming,
        )
    if script_args.dataset_path:
        from calclip.tasks import load_dataset_from_path

        return load_dataset_from_path(script_args.dataset_path), None
    return task.build_dataset(script_args.num_train_examples, seed=seed), None
