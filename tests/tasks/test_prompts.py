"""Prompts the TRL way: dataset_name / dataset_config / dataset_train_split / dataset_test_split / dataset_streaming."""

import json
from pathlib import Path

import pytest

from calclip.cli.arguments import ScriptArguments, parse_train_args
from calclip.cli.train import build_trainer
from calclip.tasks import prompts


def write_split(folder, split, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def arithmetic_rows(start, count):
    return [{"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "answer": i + 1}
            for i in range(start, start + count)]


@pytest.fixture
def local_dataset(tmp_path):
    # A folder of data files is what datasets.load_dataset reads offline like a hub repo: train.jsonl / test.jsonl
    # become the splits "train" / "test".
    folder = tmp_path / "arith"
    write_split(folder, "train", arithmetic_rows(0, 8))
    write_split(folder, "test", arithmetic_rows(100, 3))
    return folder


def test_local_folder_through_datasets_with_both_splits(local_dataset):
    train, evaluation = prompts.load_hub_dataset(str(local_dataset), test_split="test")
    assert len(train) == 8 and train[5]["answer"] == 6
    assert len(evaluation) == 3 and evaluation[0]["answer"] == 101


def test_arguments_reach_datasets_load_dataset_as_in_trl(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return {"train": ["t"], "validation": ["v"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    train, evaluation = prompts.load_hub_dataset(
        "openai/gsm8k", dataset_config="main", train_split="train", test_split="validation", streaming=True
    )
    assert calls == [("openai/gsm8k", {"name": "main", "streaming": True})]
    assert (train, evaluation) == (["t"], ["v"])


def test_missing_split_names_the_field_and_the_splits(local_dataset):
    with pytest.raises(ValueError, match=r"dataset_train_split 'training' is not a split .* \['test', 'train'\]"):
        prompts.load_hub_dataset(str(local_dataset), train_split="training")


def test_hub_dataset_offline_fails_in_datasets_not_calclip():
    # HF_HUB_OFFLINE=1 (conftest, CI): the id reaches datasets' loader, whose own error the user sees.
    with pytest.raises(Exception) as error:
        prompts.load_hub_dataset("calclip-tests/no-such-dataset-anywhere")
    raised_in = str(error.traceback[-1].path)
    assert "/datasets/" in raised_in or "/huggingface_hub/" in raised_in, raised_in


@pytest.mark.parametrize("field,value", [("dataset_name", "./no-such-data"), ("dataset_name", "~/no-such-data"),
                                         ("model_name_or_path", "../no-such-model")])
def test_a_missing_local_path_is_refused_by_name_before_anything_loads(field, value, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{field} '{value}' does not exist"):
        ScriptArguments(**{field: value})


def test_a_home_relative_dataset_folder_is_expanded_for_datasets(local_dataset, monkeypatch):
    monkeypatch.setenv("HOME", str(local_dataset.parent))
    args = ScriptArguments(dataset_name="~/arith")
    assert args.dataset_name == str(local_dataset)
    train, _ = prompts.load_hub_dataset(args.dataset_name)
    assert len(train) == 8


def test_hub_ids_and_plain_names_are_left_to_datasets_and_transformers():
    args = ScriptArguments(dataset_name="openai/gsm8k", model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct")
    assert (args.dataset_name, args.model_name_or_path) == ("openai/gsm8k", "Qwen/Qwen2.5-1.5B-Instruct")


def test_dataset_name_and_dataset_path_together_are_refused():
    with pytest.raises(ValueError, match="dataset_name .* or dataset_path .*not both"):
        ScriptArguments(dataset_name="a/b", dataset_path="data.jsonl")


def test_train_builds_on_dataset_name_with_eval_split(local_dataset, tmp_path):
    script_args, args = parse_train_args([
        "--config", str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"),
        "--model_name_or_path", "tiny", "--dataset_name", str(local_dataset), "--output_dir", str(tmp_path / "out"),
        "--report_to", "none", "--eval_strategy", "steps", "--eval_steps", "10", "--per_device_eval_batch_size", "4",
    ])
    trainer = build_trainer(script_args, args)
    assert len(trainer.train_dataset) == 8 and trainer.train_dataset[7]["answer"] == 8
    assert len(trainer.eval_dataset) == 3


def test_train_hub_model_id_goes_to_trl_and_fails_offline_in_transformers(tmp_path):
    # As trl/scripts/grpo.py: the id is the trainer's `model`, loaded by TRL with model_init_kwargs; offline the
    # error is transformers'.
    script_args, args = parse_train_args([
        "--model_name_or_path", "calclip-tests/no-such-model-anywhere", "--output_dir", str(tmp_path),
        "--report_to", "none", "--num_train_examples", "8", "--model_revision", "v2",
        "--model_init_kwargs", '{"attn_implementation": "eager"}',
    ])
    with pytest.raises(OSError) as error:
        build_trainer(script_args, args)
    raised_in = str(error.traceback[-1].path)
    assert "/transformers/" in raised_in or "/huggingface_hub/" in raised_in, raised_in
    assert args.model_init_kwargs["revision"] == "v2" and args.model_init_kwargs["attn_implementation"] == "eager"
    assert args.model_init_kwargs["trust_remote_code"] is False


def test_train_local_folder_model_loaded_by_trl(tmp_path):
    from tests.fixtures import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    script_args, args = parse_train_args([
        "--model_name_or_path", str(tmp_path / "model"), "--output_dir", str(tmp_path / "out"), "--report_to", "none",
        "--num_train_examples", "8", "--fp8", "true",
    ])
    trainer = build_trainer(script_args, args)
    assert trainer.model.config.vocab_size == len(tokenizer)
    assert trainer.processing_class.padding_side == "left"  # TRL's own tokenizer loading
    from calclip.fp8 import FP8BlockLinear

    assert any(isinstance(m, FP8BlockLinear) for m in trainer.model.modules())  # converted after TRL loaded it
