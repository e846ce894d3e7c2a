"""Offline tasks with verifiable rewards, and local dataset loading.

A task is a prompt dataset plus the reward functions that score completions on it. Everything here works
without a hub: the arithmetic prompts are generated from a seed, and `load_dataset_from_path` reads local
JSON / JSONL / parquet / CSV files through `datasets`.

Reward functions follow TRL's calling convention: ``f(completions, **kwargs) -> list[float]`` where each
completion is either a string (standard prompts) or a list of chat messages (conversational prompts), and every
extra dataset column (here ``answer``) arrives as a keyword argument holding one value per completion.

    >>> from calclip.tasks import get_task
    >>> task = get_task("arithmetic")
    >>> dataset = task.build_dataset(64, seed=0)
    >>> dataset[0]["prompt"][-1]["role"], sorted(dataset.column_names)
    ('user', ['answer', 'prompt'])
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

ANSWER_TAG_RE = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
# Integers with an optional sign; "1,234" style thousands separators are not accepted on purpose (the task
# asks for a plain integer).
INTEGER_RE = re.compile(r"[-+]?\d+")
# The format reward accepts exactly one plain integer inside the tag (whitespace around it allowed).
STRICT_ANSWER_RE = re.compile(r"<answer>\s*[-+]?\d+\s*</answer>")

ARITHMETIC_SYSTEM_PROMPT = (
    "You are a careful calculator. Reply with the result of the calculation inside <answer></answer> tags, "
    "for example <answer>42</answer>."
)

RewardFunc = Callable[..., list[float]]


def completion_text(completion: str | Sequence[dict[str, Any]]) -> str:
    """The text of one completion: the string itself, or the content of the assistant messages joined."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion if message.get("role") == "assistant")


def extract_integer_answer(text: str) -> int | None:
    """The model's answer: the last integer inside the last ``<answer>`` tag if there is one, else the last
    integer anywhere in the text; None when the text holds no integer."""
    tagged = ANSWER_TAG_RE.findall(text)
    if tagged:
        numbers = INTEGER_RE.findall(tagged[-1])
        # A tag without a number ("<answer>seven</answer>") is a wrong answer, not a fallback to the free text.
        return int(numbers[-1]) if numbers else None
    numbers = INTEGER_RE.findall(text)
    return int(numbers[-1]) if numbers else None


def arithmetic_reward(completions: Sequence, answer: Sequence, **kwargs) -> list[float]:
    """Exact match: 1.0 when the extracted integer equals ``answer``, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        predicted = extract_integer_answer(completion_text(completion))
        rewards.append(1.0 if predicted is not None and predicted == int(expected) else 0.0)
    return rewards


def format_reward(completions: Sequence, **kwargs) -> list[float]:
    """1.0 when the completion holds exactly one ``<answer>integer</answer>`` tag, else 0.0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        well_formed = len(STRICT_ANSWER_RE.findall(text)) == 1 and len(ANSWER_TAG_RE.findall(text)) == 1
        rewards.append(1.0 if well_formed else 0.0)
    return rewards


def make_arithmetic_dataset(
    num_examples: int,
    *,
    seed: int = 0,
    max_operand: int = 20,
    operators: Sequence[str] = ("+", "-", "*"),
    system_prompt: str | None = ARITHMETIC_SYSTEM_PROMPT,
):
    """Integer arithmetic prompts ``a <op> b`` with ``0 <= a, b <= max_operand``, deterministic in ``seed``.

    Returns a `datasets.Dataset` with a conversational ``prompt`` column (system + user messages) and an
    ``answer`` column (the exact integer result, as int).
    """
    import datasets

    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    unknown = sorted(set(operators) - set(_OPERATORS))
    if unknown or not operators:
        raise ValueError(f"operators must be a non-empty subset of {sorted(_OPERATORS)}, got {list(operators)}")

    rng = random.Random(seed)
    prompts, answers = [], []
    for _ in range(num_examples):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(list(operators))
        messages = [{"role": "user", "content": f"What is {a} {op} {b}?"}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        prompts.append(messages)
        answers.append(_OPERATORS[op](a, b))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


_OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


_DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset_from_path(path: str | Path, *, split: str = "train"):
    """Load a local JSON / JSONL / parquet / CSV file (or a directory saved with `Dataset.save_to_disk`) as a
    `datasets.Dataset`. Never touches the hub.

    The file's rows must carry a ``prompt`` column (a string or a list of chat messages) plus whatever columns
    the task's reward functions read (``answer`` for the arithmetic rewards).
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset_path {str(path)!r} does not exist")
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    builder = _DATASET_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"dataset_path {str(path)!r}: unsupported file type {path.suffix!r}; "
            f"expected one of {sorted(_DATASET_BUILDERS)} or a save_to_disk directory"
        )
    return datasets.load_dataset(builder, data_files={split: str(path)}, split=split)


# ----------------------------------------------------------------------------------------------------------------
# Registry: YAML picks a task by name (`task: arithmetic`); a typo fails with the valid names listed.


class TaskName(str, Enum):
    ARITHMETIC = "arithmetic"
    ARITHMETIC_SMALL = "arithmetic_small"
    ARITHMETIC_FORMAT = "arithmetic_format"


@dataclass(frozen=True)
class Task:
    """A named prompt source with its reward functions (and their weights, in the order of `reward_funcs`)."""

    name: TaskName
    build_dataset: Callable[..., Any]  # (num_examples, *, seed) -> datasets.Dataset
    reward_funcs: tuple[RewardFunc, ...]
    reward_weights: tuple[float, ...] | None = None
    description: str = ""


_TASKS: dict[TaskName, Task] = {}


def register_task(task: Task) -> Task:
    """Add a task to the registry; registering a name twice raises."""
    if task.name in _TASKS:
        raise ValueError(f"task {task.name.value!r} is already registered")
    if task.reward_weights is not None and len(task.reward_weights) != len(task.reward_funcs):
        raise ValueError(f"task {task.name.value!r}: reward_weights must have one weight per reward function")
    _TASKS[task.name] = task
    return task


def task_names() -> list[str]:
    """The registered task names (the values YAML's ``task:`` accepts)."""
    return [name.value for name in _TASKS]


def get_task(name: str | TaskName) -> Task:
    """Look a task up by name; an unknown name raises ValueError listing the valid ones."""
    try:
        key = TaskName(name)
    except ValueError:
        raise ValueError(f"task must be one of {[n.value for n in TaskName]}, got {name!r}") from None
    return _TASKS[key]


register_task(
    Task(
        name=TaskName.ARITHMETIC,
        build_dataset=lambda num_examples, *, seed=0, **kw: make_arithmetic_dataset(num_examples, seed=seed, **kw),
        reward_funcs=(arithmetic_reward, format_reward),
        # Correctness dominates; the format term gives small models a gradient before they get answers right.
        reward_weights=(1.0, 0.5),
        description="integer a+b, a-b, a*b with 0<=a,b<=20; exact match on the last integer plus a format bonus",
    )
)
register_task(
    Task(
        name=TaskName.ARITHMETIC_SMALL,
        build_dataset=lambda num_examples, *, seed=0, **kw: make_arithmetic_dataset(
            num_examples, seed=seed, **{"max_operand": 9, "operators": ("+", "-"), **kw}
        ),
        reward_funcs=(arithmetic_reward, format_reward),
        reward_weights=(1.0, 0.5),
        # A 135M model solves a fair share of these, so groups mix right and wrong answers (non-zero advantages)
        # within a few steps: the demo's task.
        description="single-digit a+b and a-b; the same rewards as 'arithmetic'",
    )
)
register_task(
    Task(
        name=TaskName.ARITHMETIC_FORMAT,
        build_dataset=lambda num_examples, *, seed=0, **kw: make_arithmetic_dataset(num_examples, seed=seed, **kw),
        reward_funcs=(format_reward,),
        description="the arithmetic prompts scored only on the <answer>integer</answer> format",
    )
)
