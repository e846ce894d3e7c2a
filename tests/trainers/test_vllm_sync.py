"""FP8 weight sync through TRL 1.16's own ``VLLMGeneration`` code paths, with the vLLM engine replaced by
recorders (no vLLM can run here). What runs for real: TRL's ``sync_weights`` / ``_iter_named_params`` /
``_init_vllm`` (trl 1.16.0, trl/generation/vllm_generation.py) with calclip's overrides; what is faked: the
``vllm.LLM`` object, its model's ``load_weights``, the server client, and vLLM's layerwise-reload hooks
(``vllm.model_executor.model_loader.reload.initialize_layerwise_reload(model)`` /
``finalize_layerwise_reload(model, model_config)``, the calls vLLM's NCCL weight-transfer engine makes on
start/finish_weight_update).

Expected tensor spec = vLLM ``Fp8LinearMethod.create_weights`` with block quant
(vllm/model_executor/layers/quantization/fp8.py, read at vllm-project/vllm commits 0071b24b and 1436674b):
``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)].
"""

import subprocess
import sys
import types
from contextlib import nullcontext

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl_vllm_generation = pytest.importorskip("trl.generation.vllm_generation")

from calclip.fp8 import Fp8Config, FP8BlockLinear, quantize_model  # noqa: E402
from calclip.trainers.vllm_sync import (  # noqa: E402
    check_vllm_compatible,
    fp8_engine_kwargs,
    fp8_vllm_generation_class,
    use_fp8_vllm_generation,
)

FP8 = torch.float8_e4m3fn


def tiny_fp8_llama(hidden=256, intermediate=384):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    return quantize_model(model, Fp8Config())


def vllm_spec(model):
    spec = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8BlockLinear):
            n, k = m.out_features, m.in_features
            spec[f"{name}.weight"] = ("float8_e4m3fn", [n, k])
            spec[f"{name}.weight_scale_inv"] = ("float32", [-(-n // 128), -(-k // 128)])
    return spec


class Recorder:
    def __init__(self):
        self.events = []


def make_generation(model, mode, recorder):
    """An FP8VLLMGeneration with TRL's __init__ skipped (it would start an engine) and fakes wired in."""
    cls = fp8_vllm_generation_class()
    gen = cls.__new__(cls)
    gen.model = model
    gen.mode = mode
    gen.enable_sleep_mode = False
    gen.tensor_parallel_size = 1
    gen._weight_metadata = None
    gen.accelerator = types.SimpleNamespace(is_main_process=True)
    gen._dist = types.SimpleNamespace(is_fsdp=False, gather_params=lambda params: nullcontext())

    vllm_model = types.SimpleNamespace(
        load_weights=lambda weights: recorder.events.extend(("load", n, t) for n, t in weights))
    engine = types.SimpleNamespace(
        model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=vllm_model))),
        model_config="MODEL_CONFIG")
    gen.llm = types.SimpleNamespace(llm_engine=engine, reset_prefix_cache=lambda: recorder.events.append(("reset",)))
    gen._fake_vllm_model = vllm_model

    def update_named_params(metadata, stream):
        recorder.events.append(("metadata", metadata))
        recorder.events.extend(("send", n, t) for n, t in stream)

    gen.vllm_client = types.SimpleNamespace(
        update_named_params=update_named_params, reset_prefix_cache=lambda: recorder.events.append(("reset",)))
    return gen


@pytest.fixture
def fake_reload(monkeypatch):
    recorder = Recorder()
    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: recorder.events.append(("init", model))
    reload.finalize_layerwise_reload = lambda model, cfg: recorder.events.append(("finalize", model, cfg))
    names = ["vllm", "vllm.model_executor", "vllm.model_executor.model_loader"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload)
    return recorder


def test_module_imports_without_vllm():
    code = ("import sys, calclip.trainers.vllm_sync, calclip.fp8.export; "
            "assert 'vllm' not in sys.modules; assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_colocate_sync_loads_fp8_checkpoint_tensors_inside_layerwise_reload(fake_reload):
    model = tiny_fp8_llama()
    gen = make_generation(model, "colocate", fake_reload)
    gen.sync_weights()  # TRL 1.16's own method
    events = fake_reload.events
    assert events[0] == ("init", gen._fake_vllm_model)
    assert events[-2] == ("finalize", gen._fake_vllm_model, "MODEL_CONFIG") and events[-1] == ("reset",)
    loads = {name: t for kind, name, t in (e for e in events if e[0] == "load")}
    assert len(loads) == sum(e[0] == "load" for e in events)  # each tensor once
    expected = vllm_spec(model)
    got = {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in loads.items() if n in expected}
    assert got == expected
    assert set(loads) - set(expected) == {n for n, _ in model.named_parameters()} - set(expected)
    # the codes are the training codes
    q, s, _ = model.get_submodule("model.layers.1.mlp.down_proj").quantized_weight()
    assert torch.equal(loads["model.layers.1.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(loads["model.layers.1.mlp.down_proj.weight_scale_inv"], s)


def test_server_sync_announces_fp8_metadata_matching_the_stream(fake_reload):
    model = tiny_fp8_llama()
    gen = make_generation(model, "server", fake_reload)
    gen.sync_weights()
    events = fake_reload.events
    assert not any(e[0] in ("init", "finalize") for e in events)  # the server wraps start/finish itself
    (metadata,) = [e[1] for e in events if e[0] == "metadata"]
    sent = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for kind, n, t in
            (e for e in events if e[0] == "send")]
    assert [tuple(m) for m in metadata] == sent
    expected = vllm_spec(model)
    assert {n: (d, s) for n, d, s in sent if n in expected} == expected
    assert events[-1] == ("reset",)


def test_init_vllm_builds_a_block_fp8_engine_and_restores_trl(monkeypatch, tmp_path):
    model = tiny_fp8_llama()
    calls = []
    monkeypatch.setattr(trl_vllm_generation, "LLM", lambda **kw: calls.append(kw) or "ENGINE", raising=False)
    original_llm = trl_vllm_generation.LLM
    monkeypatch.setattr(trl_vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(trl_vllm_generation, "ensure_master_addr_port", lambda: None)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, "0")
    gen = make_generation(model, "colocate", Recorder())
    model.name_or_path = "base-model"
    gen.gpu_memory_utilization, gen.max_model_length, gen.max_num_seqs = 0.3, 128, 8
    gen.model_impl, gen.trust_remote_code = "vllm", False
    gen.accelerator = types.SimpleNamespace(num_processes=1, process_index=0, local_process_index=0,
                                            wait_for_everyone=lambda: None, is_main_process=True)
    gen._init_vllm()
    (kw,) = calls
    assert gen.llm == "ENGINE" and trl_vllm_generation.LLM is original_llm
    assert kw["quantization"] == "fp8" and kw["load_format"] == "dummy" and kw["model"] == "base-model"
    qc = kw["hf_overrides"]["quantization_config"]
    assert qc["weight_block_size"] == [128, 128] and qc["modules_to_not_convert"] == ["lm_head"]
    assert kw["logprobs_mode"] == "processed_logprobs"  # TRL's own argument survives (TIS needs it)
    assert fp8_engine_kwargs(model, export_dir=str(tmp_path)) == {"model": str(tmp_path), "quantization": "fp8"}


def test_ragged_model_is_refused_before_the_engine_starts():
    with pytest.raises(ValueError, match="keep them in BF16"):
        check_vllm_compatible(tiny_fp8_llama(192, 320))
    check_vllm_compatible(tiny_fp8_llama())


def test_use_fp8_vllm_generation_swaps_trl_class_only_inside():
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    with use_fp8_vllm_generation(export_dir="/ckpt") as cls:
        assert grpo_module.VLLMGeneration is cls and issubclass(cls, original)
        assert cls.fp8_export_dir == "/ckpt"
    assert grpo_module.VLLMGeneration is original
