import json

import pytest

from calclip.tasks import (
    TaskName,
    arithmetic_reward,
    extract_integer_answer,
    format_reward,
    get_task,
    load_dataset_from_path,
    make_arithmetic_dataset,
    register_task,
    task_names,
)


def chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>25</answer>", 25),
        ("12 + 13 = 25, so <answer> 25 </answer>", 25),  # the tag wins over earlier integers
        ("first 3, then <answer>-8</answer>", -8),
        ("<answer>1</answer> oops <answer>7</answer>", 7),  # last tag
        ("The answer is 41, no wait, 42.", 42),  # no tag: last integer
        ("<answer>seven</answer> 7", None),  # a tag without an integer is not rescued by free text
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_integer_answer(text, expected):
    assert extract_integer_answer(text) == expected


def test_arithmetic_reward_exact_match_hand_worked():
    completions = [
        chat("<answer>25</answer>"),  # right
        chat("It is 24."),  # wrong
        chat("12+13 is 25"),  # right, last integer
        chat("<answer>25</answer> and 26"),  # right: tag beats trailing text
        chat("I don't know"),  # no integer
        "<answer>-8</answer>",  # plain-string completion, negative answer
    ]
    answers = [25, 25, 25, 25, 25, -8]
    assert arithmetic_reward(completions, answer=answers) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_arithmetic_reward_length_mismatch_raises():
    with pytest.raises(ValueError):
        arithmetic_reward([chat("1")], answer=[1, 2])


def test_format_reward_hand_worked():
    completions = [
        chat("<answer>3</answer>"),
        chat("<answer> -3 </answer>"),
        chat("3"),
        chat("<answer>3</answer><answer>4</answer>"),  # two tags
        chat("<answer>three</answer>"),
        chat("<answer>3"),
    ]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_arithmetic_dataset_is_deterministic_and_correct():
    a = make_arithmetic_dataset(50, seed=3)
    b = make_arithmetic_dataset(50, seed=3)
    c = make_arithmetic_dataset(50, seed=4)
    assert a["prompt"] == b["prompt"] and a["answer"] == b["answer"]
    assert a["prompt"] != c["prompt"]
    for prompt, answer in zip(a["prompt"], a["answer"]):
        assert [m["role"] for m in prompt] == ["system", "user"]
        question = prompt[-1]["content"]
        left, op, right = question.removeprefix("What is ").removesuffix("?").split()
        assert 0 <= int(left) <= 20 and 0 <= int(right) <= 20
        assert answer == {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}[op]


def test_arithmetic_dataset_options():
    ds = make_arithmetic_dataset(20, seed=0, max_operand=3, operators=("+",), system_prompt=None)
    assert all(len(p) == 1 and "+" in p[0]["content"] for p in ds["prompt"])
    assert all(0 <= a <= 6 for a in ds["answer"])
    with pytest.raises(ValueError, match="operators"):
        make_arithmetic_dataset(5, operators=("/",))
    with pytest.raises(ValueError, match="num_examples"):
        make_arithmetic_dataset(0)


def test_task_registry():
    assert task_names() == ["arithmetic", "arithmetic_small", "arithmetic_format"]
    task = get_task("arithmetic")
    assert task.reward_funcs == (arithmetic_reward, format_reward)
    assert len(task.reward_weights) == len(task.reward_funcs)
    ds = task.build_dataset(8, seed=1)
    assert len(ds) == 8 and set(ds.column_names) == {"prompt", "answer"}
    with pytest.raises(ValueError, match=r"task must be one of \['arithmetic', 'arithmetic_small', "
                                         r"'arithmetic_format'\], got 'arithmetc'"):
        get_task("arithmetc")
    small = get_task("arithmetic_small").build_dataset(40, seed=0)
    assert all(-9 <= a <= 18 for a in small["answer"])
    assert all("*" not in p[-1]["content"] for p in small["prompt"])
    with pytest.raises(ValueError, match="already registered"):
        register_task(get_task(TaskName.ARITHMETIC))


ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": 4},
    {"prompt": [{"role": "user", "content": "What is 3 * 3?"}], "answer": 9},
    {"prompt": [{"role": "user", "content": "What is 1 - 5?"}], "answer": -4},
]


def test_load_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    ds = load_dataset_from_path(path)
    assert len(ds) == 3
    assert ds["answer"] == [4, 9, -4]
    assert ds[1]["prompt"] == ROWS[1]["prompt"]


def test_load_json_and_parquet_and_disk(tmp_path):
    import datasets

    json_path = tmp_path / "data.json"
    json_path.write_text(json.dumps(ROWS))
    assert load_dataset_from_path(json_path)["answer"] == [4, 9, -4]

    source = datasets.Dataset.from_list(ROWS)
    parquet_path = tmp_path / "data.parquet"
    source.to_parquet(str(parquet_path))
    from_parquet = load_dataset_from_path(parquet_path)
    assert from_parquet["answer"] == [4, 9, -4] and from_parquet[2]["prompt"] == ROWS[2]["prompt"]

    source.save_to_disk(str(tmp_path / "saved"))
    assert load_dataset_from_path(tmp_path / "saved")["answer"] == [4, 9, -4]


def test_load_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset_path"):
        load_dataset_from_path(tmp_path / "missing.jsonl")
    bad = tmp_path / "data.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="unsupported file type '.txt'"):
        load_dataset_from_path(bad)


def test_rewards_on_loaded_dataset(tmp_path):
    # The reward functions read the `answer` column exactly as TRL passes it (one value per completion).
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    ds = load_dataset_from_path(path)
    completions = [chat("<answer>4</answer>"), chat("<answer>8</answer>"), chat("-4")]
    assert arithmetic_reward(completions, answer=ds["answer"]) == [1.0, 0.0, 1.0]
    assert format_reward(completions) == [1.0, 1.0, 0.0]


def test_usage_doc_lists_every_task():
    from pathlib import Path

    usage = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    for name in task_names():
        assert f"| `{name}` |" in usage, name
