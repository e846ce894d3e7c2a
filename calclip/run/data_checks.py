"""The training data checked before the first step, so a bad row fails at start-up naming its index and column
instead of mid-run (an empty prompt crashes stock TRL inside the embedding when its row is drawn; a prompt longer
than the model's positions runs silently at many times the memory).

Checks, for every row of a map-style dataset (an ``IterableDataset`` cannot be scanned and is not checked):
- ``prompt`` is a string or a list of chat messages, each a mapping with a string ``role`` and a ``content`` that
  is a string, a list of content parts or None (a message without ``role`` used to fail inside the chat template's
  jinja, a number as content in a string concatenation, neither naming the row);
- ``prompt`` is present and not empty (a blank string, no messages, or messages without any content);
- every column a reward function requires is present and not None: the parameters of the function that have no
  default and are not among the arguments TRL passes itself (TRL passes every dataset column but ``prompt`` as a
  keyword argument, so ``def reward(completions, answer, **kwargs)`` needs ``answer``);
- prompt tokens + ``max_completion_length`` fit in the model's ``max_position_embeddings`` (counted with the
  trainer's own prompt tokenization, chat template included; when max_completion_length alone reaches the
  positions, a warning, and the prompt alone must fit); longer prompts fail, or are left-truncated to fit with
  ``truncate_long_prompts``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

# Arguments TRL 1.16's GRPOTrainer._calculate_rewards passes to every reward function besides the dataset columns.
TRL_REWARD_ARGUMENTS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)
PROMPT_COLUMN = "prompt"


def _is_empty_prompt(prompt) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, Sequence):  # chat messages: empty when no message has any content
        return not any(_has_content(message) for message in prompt)
    return False


def _has_content(message) -> bool:
    content = message.get("content") if isinstance(message, dict) else message
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, Sequence):  # content parts: {"type": "text", "text": ...} or images
        return any(not isinstance(part, dict) or part.get("type") != "text" or str(part.get("text", "")).strip()
                   for part in content)  # fmt: skip
    return content is not None


def prompt_problem(prompt) -> str | None:
    """What is wrong with the shape of one ``prompt`` value (None when nothing): see the module docstring."""
    from calclip.run.config_file import bounded_repr

    if isinstance(prompt, str) or prompt is None:
        return None  # emptiness is _is_empty_prompt's
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
        return (f"a prompt is a string or a list of chat messages, got {bounded_repr(prompt)} "
                f"({type(prompt).__name__})")
    for number, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return f"message {number} must be a mapping with 'role' and 'content', got {bounded_repr(message)}"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role.strip():
            return (f"message {number} has no 'role' (a string such as 'user' or 'system'), got "
                    f"{bounded_repr(role)} in {bounded_repr(dict(message))}")
        if content is not None and not isinstance(content, str) and (
                isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence)):
            return (f"message {number} ({role}): 'content' must be a string or a list of content parts, got "
                    f"{bounded_repr(content)} ({type(content).__name__})")
    return None


def required_reward_columns(reward_funcs: Sequence, names: Sequence[str]) -> dict[str, list[str]]:
    """Dataset columns each reward function requires, by reward function name (only the ones that require some)."""
    required = {}
    for func, name in zip(reward_funcs, names):
        if not callable(func) or hasattr(func, "parameters"):  # reward models (nn.Module) read the text only
            continue
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # builtins and some C callables have no signature
            continue
        columns = [
            p.name
            for p in parameters
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p.name not in TRL_REWARD_ARGUMENTS
        ]
        if columns:
            required[name] = columns
    return required


def check_rows(dataset, reward_funcs: Sequence, reward_func_names: Sequence[str], *, split: str) -> None:
    """Raise ValueError naming ``split``, the row index and the column for the first empty prompt, missing reward
    column or None value in one."""
    columns = set(dataset.column_names)
    if PROMPT_COLUMN not in columns:
        raise ValueError(f"{split}: no '{PROMPT_COLUMN}' column (columns: {sorted(columns)})")
    for index, prompt in enumerate(dataset[PROMPT_COLUMN]):
        problem = prompt_problem(prompt)
        if problem is not None:
            raise ValueError(f"{split} row {index}, column '{PROMPT_COLUMN}': {problem}")
        if _is_empty_prompt(prompt):
            raise ValueError(
                f"{split} row {index}, column '{PROMPT_COLUMN}': empty prompt {prompt!r}; remove or fill the row"
            )
    for name, needed in required_reward_columns(reward_funcs, reward_func_names).items():
        for column in needed:
            if column not in columns:
                raise ValueError(
                    f"{split}: reward function '{name}' requires a '{column}' column, which the dataset lacks "
                    f"(columns: {sorted(columns)})"
                )
            for index, value in enumerate(dataset[column]):
                if value is None:
                    raise ValueError(
                        f"{split} row {index}, column '{column}': None, but reward function '{name}' requires it"
                    )


def prompt_token_counts(prompts: list, tokenize: Callable[[list], list], chunk: int = 256) -> list[int]:
    """Token counts of ``prompts`` through ``tokenize`` (a list of prompts -> a list of token-id lists), in chunks."""
    counts = []
    for start in range(0, len(prompts), chunk):
        counts.extend(len(ids) for ids in tokenize(prompts[start : start + chunk]))
    return counts


def long_prompt_message(split: str, index: int, tokens: int, max_prompt_tokens: int, max_completion_length: int,
                        max_positions: int) -> str:  # fmt: skip
    return (
        f"{split} row {index}, column '{PROMPT_COLUMN}': {tokens} prompt tokens (+ max_completion_length "
        f"{max_completion_length}) exceed the model's max_position_embeddings {max_positions} (prompts may have at "
        f"most {max_prompt_tokens} tokens). Shorten or drop such rows, lower max_completion_length, or set "
        "truncate_long_prompts=true to keep the last tokens of each long prompt"
    )


def check_train_rows(dataset, *, prompts_per_generation: int, split: str = "train_dataset") -> None:
    """Refuse a map-style training dataset too small to make one generation batch (an IterableDataset has no length
    and is not checked).

    TRL's RepeatSampler draws ``prompts_per_generation`` distinct prompts per generation batch
    (``generation_batch_size // num_generations``) and drops a last chunk of fewer, so a dataset of fewer rows (0
    among them) yields no batch at all: ``train()`` returned at once, trained nothing, and a script went on to save
    the untrained model."""
    if dataset is None or not hasattr(dataset, "__len__"):
        return
    rows = len(dataset)
    if rows == 0:
        raise ValueError(f"{split} has 0 rows: there is nothing to train on")
    if rows < prompts_per_generation:
        raise ValueError(
            f"{split} has {rows} row(s) but one generation batch draws {prompts_per_generation} distinct prompts "
            "(generation_batch_size // num_generations: per_device_train_batch_size x steps_per_generation x "
            "processes / num_generations), and TRL's sampler makes no batch from fewer; training would do nothing. "
            "Add rows or lower per_device_train_batch_size / steps_per_generation."
        )
