"""The datasets are checked when the trainer is built: bad rows fail naming the row index and the column."""

import warnings

import pytest
from datasets import Dataset

from calclip.run.data_checks import required_reward_columns
from calclip.tasks import arithmetic_reward, format_reward
from calclip.trainers.grpo import CalibratedGRPOTrainer
from tests.fixtures import build_tiny_tokenizer, digit_share_reward, tiny_trainer

MAX_POSITIONS = 512  # build_tiny_model's max_position_embeddings
COMPLETION = 8  # tiny_training_args' max_completion_length


def _rows(n=4, **replace):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1=?"}], "answer": str(i + 1)} for i in range(n)]
    for index, row in replace.items():
        rows[int(index.removeprefix("row"))] = row
    return rows


def _trainer(rows, reward_funcs=digit_share_reward, eval_rows=None, **overrides):
    tokenizer = build_tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*on-policy.*")
        return tiny_trainer("unused-output", tokenizer=tokenizer, reward_funcs=reward_funcs,
                            train_dataset=Dataset.from_list(rows),
                            eval_dataset=None if eval_rows is None else Dataset.from_list(eval_rows), fp8=False,
                            **overrides)


@pytest.mark.parametrize(
    "prompt",
    ["", "   ", [], [{"role": "user", "content": ""}],
     [{"role": "system", "content": " "}, {"role": "user", "content": ""}]],
    ids=["empty", "blank", "no_messages", "empty_message", "blank_messages"],
)
def test_empty_prompt_fails_at_construction_naming_row_and_column(prompt):
    rows = _rows(4)
    if isinstance(prompt, str):  # a standard (string-prompt) dataset
        rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
    rows[2] = {"prompt": prompt, "answer": "3"}
    with pytest.raises(ValueError, match=r"train_dataset row 2, column 'prompt': empty prompt"):
        _trainer(rows)


@pytest.mark.parametrize("rows, match", [
    # a message without role: the chat template's jinja failed ("'dict object' has no attribute 'role'")
    (_rows(4, row2={"prompt": [{"content": "2+1=?"}], "answer": "3"}),
     r"train_dataset row 2, column 'prompt': message 0 has no 'role'"),
    (_rows(4, row3={"prompt": [{"role": "system", "content": "Add."}, {"role": " ", "content": "3+1=?"}],
                    "answer": "4"}), r"train_dataset row 3, column 'prompt': message 1 has no 'role'"),
    # non-string content: "can only concatenate str (not 'int') to str" inside the template
    ([{"prompt": [{"role": "user", "content": i}], "answer": str(i + 1)} for i in range(4)],
     r"train_dataset row 0, column 'prompt': message 0 \(user\): 'content' must be a string or a list of content "
     r"parts, got 0 \(int\)"),
    ([{"prompt": [{"role": "user", "content": {"text": f"{i}+1=?"}}], "answer": str(i + 1)} for i in range(4)],
     r"train_dataset row 0, column 'prompt': message 0 \(user\): 'content' must be a string"),
    ([{"prompt": i, "answer": str(i + 1)} for i in range(4)],
     r"train_dataset row 0, column 'prompt': a prompt is a string or a list of chat messages, got 0 \(int\)"),
])
def test_malformed_chat_messages_fail_at_construction_naming_row_and_message(rows, match):
    with pytest.raises(ValueError, match=match):
        _trainer(rows)


def test_eval_dataset_is_checked_too():
    with pytest.raises(ValueError, match=r"eval_dataset row 1, column 'prompt'"):
        _trainer(_rows(4), eval_rows=_rows(2, row1={"prompt": [{"role": "user", "content": ""}], "answer": "2"}))


def test_missing_reward_column_fails_naming_the_reward_function_and_column():
    rows = [{"prompt": r["prompt"]} for r in _rows(4)]
    with pytest.raises(ValueError, match=r"reward function 'arithmetic_reward' requires a 'answer' column"):
        _trainer(rows, reward_funcs=[arithmetic_reward, format_reward])
    rows = _rows(4, row3={"prompt": [{"role": "user", "content": "3+1=?"}], "answer": None})
    with pytest.raises(ValueError, match=r"train_dataset row 3, column 'answer': None.*arithmetic_reward"):
        _trainer(rows, reward_funcs=[arithmetic_reward, format_reward])
    _trainer(_rows(4), reward_funcs=[arithmetic_reward, format_reward])  # the complete dataset passes


def test_required_reward_columns_reads_the_signature():
    def needs_two(prompts, completions, answer, *, difficulty, optional=1, **kwargs):
        return []

    def reads_kwargs(completions, **kwargs):
        return []

    assert required_reward_columns([needs_two, reads_kwargs, arithmetic_reward], ["a", "b", "c"]) == {
        "a": ["answer", "difficulty"], "c": ["answer"],
    }  # fmt: skip


def _long_prompt(tokens):
    # The tiny tokenizer has one token per character; the chat template adds its own tokens around the content.
    return [{"role": "user", "content": "1" * tokens}]


def test_prompt_longer_than_the_model_fails_naming_the_row():
    rows = _rows(4, row1={"prompt": _long_prompt(MAX_POSITIONS), "answer": "1"})
    with pytest.raises(ValueError) as caught:
        _trainer(rows)
    message = str(caught.value)
    assert "train_dataset row 1, column 'prompt'" in message and "max_position_embeddings 512" in message
    assert f"at most {MAX_POSITIONS - COMPLETION} tokens" in message and "truncate_long_prompts" in message


def test_prompt_that_just_fits_passes():
    trainer = _trainer(_rows(4))
    header = len(trainer._tokenize_prompts([_long_prompt(0)])[0][0])  # chat-template tokens around the content
    fits = MAX_POSITIONS - COMPLETION - header
    _trainer(_rows(4, row0={"prompt": _long_prompt(fits), "answer": "1"}))
    with pytest.raises(ValueError, match="row 0"):
        _trainer(_rows(4, row0={"prompt": _long_prompt(fits + 1), "answer": "1"}))


def test_truncate_long_prompts_keeps_the_last_tokens():
    rows = _rows(4, row1={"prompt": _long_prompt(MAX_POSITIONS), "answer": "1"})
    with pytest.warns(UserWarning, match=r"1 prompts \(first: row 1.*left-truncated"):
        trainer = _trainer(rows, truncate_long_prompts=True)
    short, long = trainer._tokenize_prompts([rows[0]["prompt"], rows[1]["prompt"]])[0]
    untruncated = super(CalibratedGRPOTrainer, trainer)._tokenize_prompts([rows[1]["prompt"]])[0][0]
    assert len(long) == MAX_POSITIONS - COMPLETION and list(long) == list(untruncated[-len(long):])
    assert list(short) == list(super(CalibratedGRPOTrainer, trainer)._tokenize_prompts([rows[0]["prompt"]])[0][0])


def test_max_completion_length_reaching_the_positions_warns_and_the_prompt_alone_must_fit():
    with pytest.warns(UserWarning, match=r"max_completion_length \(512\) is not below"):
        _trainer(_rows(4), max_completion_length=MAX_POSITIONS)  # TRL runs this: not refused
    with pytest.warns(UserWarning, match="is not below"), pytest.raises(ValueError, match=r"row 2.*at most 512"):
        _trainer(_rows(4, row2={"prompt": _long_prompt(MAX_POSITIONS), "answer": "3"}),
                 max_completion_length=MAX_POSITIONS)


def test_check_dataset_false_skips_the_scan():
    _trainer(_rows(4, row0={"prompt": [{"role": "user", "content": ""}], "answer": "1"}), check_dataset=False)


# ------------------------------------------------------------------ a dataset too small to train (issue 40)
# tiny_training_args: 4 completions a micro-batch over 4 micro-batches a round, 4 completions a prompt: a generation
# batch draws 16 / 4 = 4 distinct prompts, and TRL's RepeatSampler drops a chunk of fewer.


def test_a_dataset_of_no_rows_is_refused_before_the_model_loads(tmp_path):
    """A 0-row dataset trained nothing and train() returned; `calclip train` then saved the untrained model."""
    from tests.fixtures import tiny_training_args
    from calclip.trainers.config import CalibratedGRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = tiny_training_args(CalibratedGRPOConfig, tmp_path / "out")
    dataset = Dataset.from_list(_rows(4)).select([])
    with pytest.raises(ValueError, match=r"train_dataset has 0 rows: there is nothing to train on"):
        # the model name does not exist: nothing is loaded before the check
        CalibratedGRPOTrainer(model="calclip-test/no-such-model", reward_funcs=digit_share_reward, args=args,
                              train_dataset=dataset)  # fmt: skip
    assert not (tmp_path / "out").exists()  # refused before the output_dir was claimed


def test_a_dataset_smaller_than_a_generation_batch_is_refused_by_train(tmp_path):
    """3 rows, 4 prompts a generation batch: TRL's sampler made no batch, train() returned having trained nothing.
    (A trainer built only to compute losses, as the parity tests do, still builds.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, train_dataset=Dataset.from_list(_rows(3)), fp8=False)
    with pytest.raises(ValueError, match=r"train_dataset has 3 row\(s\) but one generation batch draws 4 distinct "
                                         r"prompts"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_dataset_of_one_generation_batch_trains(tmp_path):
    from tests.fixtures import logged

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = tiny_trainer(tmp_path, train_dataset=Dataset.from_list(_rows(4)), fp8=False, max_steps=1)
        trainer.train()
    assert trainer.state.global_step == 1 and len(logged(trainer, "loss")) == 1


def test_vllm_rollouts_without_vllm_name_the_package_and_the_extra(tmp_path, monkeypatch):
    """use_vllm=True without vLLM installed failed with an AttributeError naming neither."""
    from trl.generation import vllm_generation

    from tests.fixtures import tiny_training_args
    from calclip.trainers.config import CalibratedGRPOConfig

    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: False)  # as without the package
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = tiny_training_args(CalibratedGRPOConfig, tmp_path / "out", use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ImportError, match=r"use_vllm=True needs the vllm package.*pip install 'calclip\[vllm\]'"):
        CalibratedGRPOTrainer(model="calclip-test/no-such-model", reward_funcs=digit_share_reward, args=args,
                              train_dataset=Dataset.from_list(_rows(4)))  # fmt: skip
