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

import ast
import dataclasses
import functools
import gc
import os
import re
import subprocess
import warnings
import sys
import types
from contextlib import nullcontext

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl_vllm_generation = pytest.importorskip("trl.generation.vllm_generation")

from calclip.fp8 import Fp8Config, FP8BlockLinear, quantize_model  # noqa: E402
from calclip.rollout import vllm_sync  # noqa: E402
from calclip.rollout.vllm_sync import (  # noqa: E402
    COMPILE_CACHE_ENV,
    DEEP_GEMM_E8M0_ENV,
    DEEP_GEMM_WARMUP_ENV,
    DEFAULT_LINEAR_BACKEND,
    apply_deep_gemm_warmup,
    capture_size_for_batch,
    deep_gemm_e8m0_setting,
    deep_gemm_runs_here,
    fp8_engine_numerics_kwargs,
    nvcc_found,
    resolve_linear_backend,
    unit_kv_cache_scales_,
    ENGINE_MODEL_DIRNAME,
    linear_backend_problem,
    check_vllm_compatible,
    engine_model_kwargs,
    fp8_engine_kwargs,
    fp8_vllm_generation_class,
    use_fp8_vllm_generation,
    use_vllm_generation,
    vllm_generation_class,
)

from tests.fp8._quant_calls import count_weight_quantizations  # noqa: E402

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


def make_generation(model, mode, recorder, cls=None):
    """An FP8VLLMGeneration (or ``cls``) with TRL's __init__ skipped (it would start an engine) and fakes wired in."""
    cls = cls or fp8_vllm_generation_class()
    gen = cls.__new__(cls)
    gen.model = model
    gen.processing_class = None
    gen.mode = mode
    gen.enable_sleep_mode = False
    gen.tensor_parallel_size = 1
    gen._weight_metadata = None
    gen.accelerator = types.SimpleNamespace(is_main_process=True)
    gen._dist = types.SimpleNamespace(is_fsdp=False, gather_params=lambda params: nullcontext())

    vllm_model = types.SimpleNamespace(  # no parameters: the direct-sync check after the first reload refuses
        load_weights=lambda weights: recorder.events.extend(("load", n, t) for n, t in weights),
        named_parameters=lambda: iter(()), named_modules=lambda: iter(()))
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


@pytest.mark.slow
def test_module_imports_without_vllm():
    code = ("import sys, calclip.rollout.vllm_sync, calclip.fp8.export; "
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


def _loads(events):
    return {name: t for kind, name, t in (e for e in events if e[0] == "load")}


def test_colocate_sync_sends_the_layers_own_codes_and_the_next_forward_quantizes_nothing(fake_reload, monkeypatch):
    """The stream sends each FP8 layer's resident codes (the same storage), brought up to date with the weight as it
    is after an optimizer step; they equal the reference quantizer's bits, and the training forward after the sync
    finds them current (no weight is quantized again)."""
    from calclip.fp8.reference import quantize_128x128

    model = tiny_fp8_llama()
    ids = torch.randint(0, 320, (2, 8))
    model(ids).logits.sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # every weight moves: the codes of the forward are stale
    gen = make_generation(model, "colocate", fake_reload)
    gen.sync_weights()
    loads = _loads(fake_reload.events)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8BlockLinear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        q, s = loads[f"{name}.weight"], loads[f"{name}.weight_scale_inv"]
        assert q.data_ptr() == layer._fp8_qw.data_ptr() and s.data_ptr() == layer._fp8_sw.data_ptr()
        ref_q, ref_s = quantize_128x128(layer.weight.detach())
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    calls = count_weight_quantizations(monkeypatch)
    model(ids).logits.sum().backward()
    assert calls == []


def test_sync_without_resident_codes_sends_reference_codes_and_keeps_none(fake_reload):
    from calclip.fp8.reference import quantize_128x128

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = quantize_model(transformers.LlamaForCausalLM(cfg).float().eval(), Fp8Config(resident_weight_codes=False))
    make_generation(model, "colocate", fake_reload).sync_weights()
    loads = _loads(fake_reload.events)
    for name, layer in model.named_modules():
        if isinstance(layer, FP8BlockLinear):
            ref_q, ref_s = quantize_128x128(layer.weight.detach())
            assert torch.equal(loads[f"{name}.weight"].view(torch.uint8), ref_q.view(torch.uint8))
            assert torch.equal(loads[f"{name}.weight_scale_inv"], ref_s)
            assert layer._fp8_qw is None and not bool(layer._fp8_bad)


def test_sync_sends_codes_of_weights_written_through_data_without_invalidating(fake_reload):
    """A weight written through ``.data`` (no version bump, no ``invalidate_fp8_weight_caches``) keeps a key that
    looks current; the sync still sends the codes of the weight as it is."""
    from calclip.fp8.reference import quantize_128x128

    model = tiny_fp8_llama()
    layer = model.get_submodule("model.layers.0.mlp.up_proj")
    stale_q, _, _ = layer.quantized_weight()
    stale_q = stale_q.clone()
    layer.weight.data.mul_(3.0)
    make_generation(model, "colocate", fake_reload).sync_weights()
    sent = _loads(fake_reload.events)["model.layers.0.mlp.up_proj.weight"]
    ref_q, _ = quantize_128x128(layer.weight.detach())
    assert torch.equal(sent.view(torch.uint8), ref_q.view(torch.uint8))
    assert not torch.equal(sent.view(torch.uint8), stale_q.view(torch.uint8))


def test_sync_refuses_a_non_finite_weight_naming_it_before_anything_is_sent(fake_reload):
    model = tiny_fp8_llama()
    with torch.no_grad():
        model.get_submodule("model.layers.1.self_attn.o_proj").weight[3, 5] = float("inf")
    gen = make_generation(model, "colocate", fake_reload)
    named = r"non-finite values in 1 FP8 layer\(s\): \['model.layers.1.self_attn.o_proj'\]"
    with pytest.raises(ValueError, match=named):
        gen.sync_weights()
    assert not any(e[0] == "load" for e in fake_reload.events)


def test_peft_policies_and_copied_tensors_are_quantized_again_as_exported(fake_reload):
    """Under PEFT (merge/unmerge write weights through ``.data`` around the stream) and for a stream tensor that is
    not the layer's weight itself (a gathered copy), the codes come from the reference quantizer, not the layer."""
    from calclip.fp8.export import fp8_weight_specs, live_fp8_layers, quantize_named_params
    from calclip.fp8.reference import quantize_128x128

    model = tiny_fp8_llama()
    model.peft_config = {"default": object()}
    make_generation(model, "colocate", fake_reload).sync_weights()
    loads = _loads(fake_reload.events)
    for name, layer in model.named_modules():
        if isinstance(layer, FP8BlockLinear):
            sent = loads[f"{name}.weight"]
            assert layer._fp8_qw is None or sent.data_ptr() != layer._fp8_qw.data_ptr()
            assert torch.equal(sent.view(torch.uint8), quantize_128x128(layer.weight.detach())[0].view(torch.uint8))
    del model.peft_config
    sharded = model.get_submodule("model.layers.1.mlp.down_proj")
    whole = sharded.weight
    sharded.weight = torch.nn.Parameter(whole.detach().flatten()[:10])  # what ZeRO-3 leaves outside a gather
    live = live_fp8_layers(model)
    assert "model.layers.1.mlp.down_proj" not in live and "model.layers.0.mlp.down_proj" in live
    sharded.weight = whole
    config = sharded.fp8_config
    sharded.fp8_config = dataclasses.replace(config, cache_weights=False)  # the trainer's setting under FSDP / ZeRO-3
    assert "model.layers.1.mlp.down_proj" not in live_fp8_layers(model)
    sharded.fp8_config = config
    name = "model.layers.0.self_attn.q_proj"
    copy = model.get_submodule(name).weight.detach() * 2  # what a gather hands over: another tensor
    (_, q), (_, s) = quantize_named_params([(f"{name}.weight", copy)], fp8_weight_specs(model),
                                           live_layers=live_fp8_layers(model))
    ref_q, ref_s = quantize_128x128(copy)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


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


def colocate_init(monkeypatch, model, *, cls=None, process_index=0, num_processes=1):
    """A colocate-mode generation over ``model`` whose TRL ``_init_vllm`` builds a recorded fake ``LLM``: returns
    (generation, the kwargs of each ``LLM(...)`` call, TRL's ``LLM`` to check it is restored). Call
    ``gen._init_vllm()`` after setting what the test varies."""
    calls = []
    monkeypatch.setattr(trl_vllm_generation, "LLM", lambda **kw: calls.append(kw) or "ENGINE", raising=False)
    monkeypatch.setattr(trl_vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(trl_vllm_generation, "ensure_master_addr_port", lambda: None)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, "0")
    gen = make_generation(model, "colocate", Recorder(), cls=cls)
    gen.gpu_memory_utilization, gen.max_model_length, gen.max_num_seqs = 0.3, 128, 8
    gen.model_impl, gen.trust_remote_code = "vllm", False
    gen.accelerator = types.SimpleNamespace(num_processes=num_processes, process_index=process_index,
                                            local_process_index=process_index, wait_for_everyone=lambda: None,
                                            is_main_process=process_index == 0)
    return gen, calls, trl_vllm_generation.LLM


def test_init_vllm_builds_a_block_fp8_engine_and_restores_trl(monkeypatch, tmp_path):
    model = tiny_fp8_llama()
    gen, calls, original_llm = colocate_init(monkeypatch, model)
    model.name_or_path = "base-model"
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
    with use_vllm_generation(engine_model_root="/out/_vllm_engine_model") as cls:  # fp8 false
        assert grpo_module.VLLMGeneration is cls and issubclass(cls, original)
        assert cls.engine_model_root == "/out/_vllm_engine_model" and not hasattr(cls, "fp8_export_dir")
    assert grpo_module.VLLMGeneration is original


# ---------------------------------------------------------------------------------------------------------------
# CalibratedGRPOTrainer(use_vllm=True, fp8=True): TRL 1.16's GRPOTrainer.__init__ builds the (calclip) generation
# object, TRL's _init_vllm builds the engine, TRL's _generate_single_turn syncs and generates; only vLLM's names
# (LLM, SamplingParams, VLLMClient, the layerwise-reload hooks) are fakes that record what they receive.

from tests.fixtures import (  # noqa: E402
    build_tiny_model,
    build_tiny_tokenizer,
    tiny_prompt_dataset,
    tiny_trainer,
    tiny_training_args,
)
from calclip.trainers.config import CalibratedGRPOConfig  # noqa: E402

# What the fake engine "samples" for every prompt (token characters) and the log-probs it reports for them.
FAKE_COMPLETION = "12"
FAKE_LOGPROBS = [-0.5, -1.25, -2.0]  # the two digits, then EOS


class FakeVLLM:
    """Stands in for ``vllm.LLM`` (colocate) and TRL's ``VLLMClient`` (server); records every call."""

    def __init__(self, recorder, tokenizer):
        self.recorder, self.tokenizer = recorder, tokenizer
        self.engine_kwargs = []
        self.sampling_params = []  # the SamplingParams arguments of each generate call (SamplingParams is a dict here)
        self.gc_enabled = []  # gc.isenabled() inside each generate call
        self.env_set_by_engine = {}  # environment variables the engine's start sets (vLLM: its compile cache dirs)
        self.fp8_modules_at_engine_start = None

    def llm(self, model_of):
        fake = self

        class LLM:
            def __init__(self, **kwargs):
                fake.engine_kwargs.append(kwargs)
                for name, value in fake.env_set_by_engine.items():  # as vLLM's compile does (its cache dirs)
                    os.environ[name] = value
                fake.fp8_modules_at_engine_start = sorted(
                    n for n, m in model_of().named_modules() if isinstance(m, FP8BlockLinear))
                vllm_model = types.SimpleNamespace(load_weights=lambda weights: fake.recorder.events.extend(
                    ("load", n, t) for n, t in weights), named_parameters=lambda: iter(()),
                    named_modules=lambda: iter(()))
                self.vllm_model = vllm_model
                self.llm_engine = types.SimpleNamespace(
                    model_executor=types.SimpleNamespace(
                        driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=vllm_model))),
                    model_config=types.SimpleNamespace(max_model_len=512))

            def reset_prefix_cache(self):
                fake.recorder.events.append(("reset",))

            def generate(self, prompts, sampling_params, use_tqdm):
                fake.recorder.events.append(("generate", len(prompts)))
                fake.sampling_params.append(sampling_params)
                fake.gc_enabled.append(gc.isenabled())
                return [fake.request_output(p["prompt_token_ids"]) for p in prompts]

        return LLM

    def request_output(self, prompt_ids):
        ids = [*self.tokenizer.convert_tokens_to_ids(list(FAKE_COMPLETION)), self.tokenizer.eos_token_id]
        logprobs = [{i: types.SimpleNamespace(rank=1, logprob=lp)} for i, lp in zip(ids, FAKE_LOGPROBS)]
        return types.SimpleNamespace(prompt_token_ids=prompt_ids,
                                     outputs=[types.SimpleNamespace(token_ids=ids, logprobs=logprobs)])

    def client(self):
        fake = self

        class VLLMClient:
            def __init__(self, **kwargs):
                pass

            def init_communicator(self, device):
                pass

            def get_server_info(self):
                return {"model_config": {"logprobs_mode": "processed_logprobs"}}

            def update_named_params(self, metadata, stream):
                fake.recorder.events.append(("metadata", metadata))
                fake.recorder.events.extend(("load", n, t) for n, t in stream)

            def reset_prefix_cache(self):
                fake.recorder.events.append(("reset",))

        return VLLMClient


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def fake_vllm(monkeypatch, fake_reload, tokenizer):
    fake = FakeVLLM(fake_reload, tokenizer)
    holder = {}
    monkeypatch.setattr(trl_vllm_generation, "LLM", fake.llm(lambda: holder["model"]), raising=False)
    monkeypatch.setattr(trl_vllm_generation, "SamplingParams", lambda **kw: kw, raising=False)
    monkeypatch.setattr(trl_vllm_generation, "VLLMClient", fake.client())
    monkeypatch.setattr(trl_vllm_generation, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(trl_vllm_generation, "ensure_master_addr_port", lambda: None)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        # TRL's _init_vllm sets these; they must be unset while the training arguments are built (accelerate would
        # see a multi-process launch) and unset again afterwards: setenv records the original, delenv clears it.
        monkeypatch.setenv(var, "0")
        monkeypatch.delenv(var)
    fake.holder = holder
    return fake


def make_vllm_trainer(fake, tokenizer, tmp_path, *, num_key_value_heads=4, model_path=None, **overrides):
    """hidden 128, 4 heads of 32, kv heads 4: every projection is a whole number of 128x128 blocks. The policy is
    built from a config (``name_or_path == ""``) unless ``model_path``: then it is saved there with the tokenizer
    and carries that path, as ``from_pretrained`` gives it."""
    model = build_tiny_model(tokenizer, hidden_size=128, intermediate_size=256,
                             num_key_value_heads=num_key_value_heads, dtype=torch.bfloat16)
    if model_path is not None:
        model.save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
        model.name_or_path = str(model_path)
    fake.holder["model"] = model
    options = dict(use_vllm=True, vllm_mode="colocate", fp8=True, fp8_keep_last_n_layers=1)
    return tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, **{**options, **overrides})


LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8_LAYERS = [f"model.layers.0.{m}" for m in LAYER_LINEARS]  # fp8_keep_last_n_layers=1 keeps layer 1 in BF16
BF16_LAYERS = [f"model.layers.1.{m}" for m in LAYER_LINEARS] + ["lm_head"]


def test_trainer_builds_block_fp8_engine_after_quantizing(fake_vllm, tokenizer, tmp_path):
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path)
    assert grpo_module.VLLMGeneration is original  # TRL's class is back once __init__ is done
    (kw,) = fake_vllm.engine_kwargs
    # the engine started once, after the policy's quantization: its layer split is the trained one
    assert fake_vllm.fp8_modules_at_engine_start == sorted(FP8_LAYERS)
    assert kw["quantization"] == "fp8" and kw["load_format"] == "dummy"
    assert kw["hf_overrides"]["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": BF16_LAYERS, "ignored_layers": BF16_LAYERS,
    }
    assert kw["logprobs_mode"] == "processed_logprobs"  # TRL's own argument survives: TIS/bypass need it
    assert trainer.vllm_generation.llm is not None and not trainer.vllm_generation._fp8_engine_pending
    # the engine runs the trainer's arithmetic: FP32 block scales (no UE8M0 requant), no quant-fusion kernels
    assert kw["linear_backend"] == "cutlass"
    assert kw["compilation_config"] == {"pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False},
                                        "inductor_compile_config": {"emulate_precision_casts": True},
                                        # engine_speed_kwargs'
                                        "max_cudagraph_capture_size": capture_size_for_batch(kw["max_num_seqs"])}


def test_trainer_engine_numerics_follow_the_config(fake_vllm, tokenizer, tmp_path):
    make_vllm_trainer(fake_vllm, tokenizer, tmp_path, vllm_fp8_linear_backend=None,
                      vllm_fp8_match_trainer_numerics=False)
    (kw,) = fake_vllm.engine_kwargs
    assert "linear_backend" not in kw  # vLLM's own defaults; of compilation_config only the capture size
    assert kw["compilation_config"] == {"max_cudagraph_capture_size": capture_size_for_batch(kw["max_num_seqs"])}
    assert kw["quantization"] == "fp8"


@pytest.mark.parametrize("backend", ["deep_gemm", None])
def test_deep_gemm_engine_keeps_fp32_scales_by_switching_ue8m0_off(fake_vllm, tokenizer, tmp_path, monkeypatch,
                                                                  backend):
    """A backend under which vLLM may run DeepGEMM: the engine starts with VLLM_USE_DEEP_GEMM_E8M0=0 (DeepGEMM then
    keeps the policy's FP32 block scales and codes), whatever vLLM cached for it before."""
    import types

    monkeypatch.delenv(DEEP_GEMM_E8M0_ENV, raising=False)
    reads = []

    @functools.cache
    def is_deep_gemm_e8m0_used():  # vLLM caches its first read of the variable
        reads.append(os.environ.get(DEEP_GEMM_E8M0_ENV))
        return os.environ.get(DEEP_GEMM_E8M0_ENV, "1") == "1"

    assert is_deep_gemm_e8m0_used()  # an earlier engine in this process read the default
    module = types.ModuleType("vllm.utils.deep_gemm")
    module.is_deep_gemm_e8m0_used = is_deep_gemm_e8m0_used
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", module)
    make_vllm_trainer(fake_vllm, tokenizer, tmp_path, vllm_fp8_linear_backend=backend)
    (kw,) = fake_vllm.engine_kwargs
    assert kw.get("linear_backend") == backend
    assert os.environ[DEEP_GEMM_E8M0_ENV] == "0"
    assert not is_deep_gemm_e8m0_used() and reads == [None, "0"]


def test_deep_gemm_e8m0_setting_rules():
    env_off, env_on = {DEEP_GEMM_E8M0_ENV: "0"}, {DEEP_GEMM_E8M0_ENV: "1"}
    assert deep_gemm_e8m0_setting("cutlass", False, env_on) is None  # CUTLASS never requantizes
    assert deep_gemm_e8m0_setting("deep_gemm", False, {}) == "0"
    assert deep_gemm_e8m0_setting(None, False, {}) == "0"
    assert deep_gemm_e8m0_setting("deep_gemm", False, env_off) is None  # already off
    assert deep_gemm_e8m0_setting("deep_gemm", True, env_on) is None  # power-of-two scales survive UE8M0
    with pytest.raises(ValueError, match="VLLM_USE_DEEP_GEMM_E8M0=1.*power_of_two_scales.*cutlass"):
        deep_gemm_e8m0_setting("deep_gemm", False, env_on)
    with pytest.raises(ValueError, match="VLLM_USE_DEEP_GEMM_E8M0"):
        deep_gemm_e8m0_setting(None, False, env_on)


def _deep_gemm_module(monkeypatch, supported: bool):
    """A stand-in for vllm.utils.deep_gemm: vLLM's DeepGEMM test answers ``supported``; E8M0 read from the env."""
    module = types.ModuleType("vllm.utils.deep_gemm")
    module.is_deep_gemm_supported = lambda: supported
    module.is_deep_gemm_e8m0_used = lambda: os.environ.get(DEEP_GEMM_E8M0_ENV, "1") == "1"
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", module)


def test_fastest_linear_backend_is_deep_gemm_for_blocks_where_it_runs_and_cutlass_elsewhere(monkeypatch):
    """The default "fastest" is resolved before vLLM sees it: DeepGEMM for the blockwise recipe where vLLM says
    DeepGEMM runs (it measured 1.36x BF16's decode at batch 64 on the H200, CUTLASS 1.00x), CUTLASS for the other
    recipes (vLLM 0.24 has no per-channel DeepGEMM kernel) and where DeepGEMM does not run; a named backend is the
    user's and passes unchanged."""
    assert DEFAULT_LINEAR_BACKEND == "fastest"
    monkeypatch.setattr(vllm_sync, "nvcc_found", lambda env=None: True)
    for supported in (True, False):
        _deep_gemm_module(monkeypatch, supported)
        assert deep_gemm_runs_here() is supported
        assert resolve_linear_backend("fastest") == ("deep_gemm" if supported else "cutlass")
        assert fp8_engine_numerics_kwargs()["linear_backend"] == ("deep_gemm" if supported else "cutlass")
        for recipe in ("rowwise", "tensorwise"):
            assert resolve_linear_backend("fastest", recipe) == "cutlass"
            assert fp8_engine_numerics_kwargs(recipe=recipe)["linear_backend"] == "cutlass"
        for named in ("cutlass", "deep_gemm", "triton", None):
            assert resolve_linear_backend(named) == named and resolve_linear_backend(named, "rowwise") == named
    assert resolve_linear_backend("fastest", deep_gemm=True) == "deep_gemm"
    monkeypatch.setattr(vllm_sync, "nvcc_found", lambda env=None: False)  # no CUDA compiler for DeepGEMM's JIT
    assert not deep_gemm_runs_here() and resolve_linear_backend("fastest") == "cutlass"
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", None)  # vLLM not installed: import fails
    assert not deep_gemm_runs_here() and resolve_linear_backend("fastest") == "cutlass"
    for recipe in ("blockwise", "rowwise", "tensorwise"):
        assert linear_backend_problem(recipe, "fastest") is None


def test_nvcc_is_looked_for_where_deep_gemm_looks(tmp_path):
    """CUDA_HOME / CUDA_PATH first (its bin/nvcc must exist), else nvcc on PATH (else /usr/local/cuda)."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    assert not nvcc_found({"CUDA_HOME": str(home)}) and not nvcc_found({"CUDA_PATH": str(home)})
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert nvcc_found({"CUDA_HOME": str(home)}) and nvcc_found({"CUDA_PATH": str(home)})
    assert nvcc_found({"PATH": str(home / "bin")})
    assert nvcc_found({"PATH": str(tmp_path)}) == os.path.exists("/usr/local/cuda/bin/nvcc")


def test_deep_gemm_warmup_is_skipped_unless_the_environment_chose_one():
    """vLLM's default DeepGEMM warm-up ("relax") JIT-compiled 1,749 GEMMs on a fresh H200 and had not finished after
    280 s; calclip sets "skip" (kernels compiled as first used) for engines that may run DeepGEMM, and leaves a
    user's choice and other backends alone."""
    for backend in ("deep_gemm", None, "auto"):
        env = {}
        assert apply_deep_gemm_warmup(backend, env) == "skip" and env == {DEEP_GEMM_WARMUP_ENV: "skip"}
    env = {DEEP_GEMM_WARMUP_ENV: "full"}
    assert apply_deep_gemm_warmup("deep_gemm", env) is None and env == {DEEP_GEMM_WARMUP_ENV: "full"}
    env = {}
    assert apply_deep_gemm_warmup("cutlass", env) is None and env == {}


@pytest.mark.parametrize("recipe", ["blockwise", "rowwise"])
def test_trainer_engine_takes_deep_gemm_by_default_where_it_runs(fake_vllm, tokenizer, tmp_path, monkeypatch,
                                                                recipe):
    """The trainer's default engine on a machine where vLLM runs DeepGEMM: blockwise gets linear_backend "deep_gemm"
    with UE8M0 off (the trainer's FP32 scales kept) and the warm-up skipped; rowwise gets CUTLASS, no env change."""
    monkeypatch.delenv(DEEP_GEMM_E8M0_ENV, raising=False)
    monkeypatch.delenv(DEEP_GEMM_WARMUP_ENV, raising=False)
    _deep_gemm_module(monkeypatch, True)
    monkeypatch.setattr(vllm_sync, "nvcc_found", lambda env=None: True)
    make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8_recipe=recipe)
    (kw,) = fake_vllm.engine_kwargs
    if recipe == "blockwise":
        assert kw["linear_backend"] == "deep_gemm"
        assert os.environ[DEEP_GEMM_E8M0_ENV] == "0" and os.environ[DEEP_GEMM_WARMUP_ENV] == "skip"
    else:
        assert kw["linear_backend"] == "cutlass"
        assert DEEP_GEMM_E8M0_ENV not in os.environ and DEEP_GEMM_WARMUP_ENV not in os.environ


@pytest.mark.parametrize("backend", ["fastest", "cutlass"])
def test_an_engine_that_fails_to_start_on_deep_gemm_says_which_field_switches_it(fake_vllm, tokenizer, tmp_path,
                                                                                 monkeypatch, backend):
    """DeepGEMM compiles its kernels inside the engine's start (nvcc, CUDA headers): a machine where that fails stops
    with an error from deep inside vLLM. The trainer re-raises it unchanged, with a note naming
    vllm_fp8_linear_backend: cutlass, where the engine ran DeepGEMM; an engine on CUTLASS gets no such note."""
    monkeypatch.delenv(DEEP_GEMM_E8M0_ENV, raising=False)
    monkeypatch.delenv(DEEP_GEMM_WARMUP_ENV, raising=False)
    _deep_gemm_module(monkeypatch, True)
    monkeypatch.setattr(vllm_sync, "nvcc_found", lambda env=None: True)

    class JitFailure(RuntimeError):
        pass

    def failing_llm(**kwargs):
        fake_vllm.engine_kwargs.append(kwargs)
        raise JitFailure("Failed to compile fp8_gemm_kernel: nvcc not found")

    monkeypatch.setattr(trl_vllm_generation, "LLM", failing_llm)
    with pytest.raises(JitFailure, match="nvcc not found") as caught:
        make_vllm_trainer(fake_vllm, tokenizer, tmp_path, vllm_fp8_linear_backend=backend)
    (kw,) = fake_vllm.engine_kwargs
    text = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    if backend == "fastest":
        assert kw["linear_backend"] == "deep_gemm" and "vllm_fp8_linear_backend: cutlass" in text
    else:
        assert kw["linear_backend"] == "cutlass" and "vllm_fp8_linear_backend" not in text


def test_exception_notes_reach_python_3_10_messages():
    """vllm_sync.add_exception_note: the note in the message where exceptions have no add_note (Python 3.10)."""

    class Old(Exception):
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    err = Old("engine failed", 3)
    vllm_sync.add_exception_note(err, "see the field")
    assert err.args == ("engine failed\nsee the field", 3)
    err = RuntimeError("engine failed")
    vllm_sync.add_exception_note(err, "see the field")
    assert "see the field" in (getattr(err, "__notes__", None) or [str(err)])[0]


def test_linear_backends_that_cannot_serve_the_recipe():
    """vLLM 0.24's block-only backends (deep_gemm, triton) hold no per-channel FP8 kernel, torch no block one: vLLM
    refuses such an engine only after loading the model."""
    for backend in ("deep_gemm", "triton"):
        assert linear_backend_problem("blockwise", backend) is None
        for recipe in ("rowwise", "tensorwise"):
            assert "block-FP8 kernels only" in linear_backend_problem(recipe, backend)
    assert "no block-FP8 kernel" in linear_backend_problem("blockwise", "torch")
    for recipe in ("blockwise", "rowwise", "tensorwise"):
        assert linear_backend_problem(recipe, "cutlass") is None and linear_backend_problem(recipe, None) is None


@pytest.mark.parametrize("recipe,backend", [("rowwise", "deep_gemm"), ("tensorwise", "triton"),
                                            ("blockwise", "torch")])
def test_config_refuses_a_backend_vllm_cannot_serve_the_recipe_with(tmp_path, recipe, backend):
    with pytest.raises(ValueError, match=f"vllm_fp8_linear_backend='{backend}' with fp8_recipe='{recipe}'"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, use_vllm=True, fp8=True, fp8_recipe=recipe,
                           vllm_fp8_linear_backend=backend)
    # without vLLM (or without FP8) the field does nothing: no refusal
    tiny_training_args(CalibratedGRPOConfig, tmp_path, use_vllm=False, fp8=True, fp8_recipe=recipe,
                       vllm_fp8_linear_backend=backend)


def test_engine_refuses_a_backend_that_cannot_serve_the_recipe(fake_vllm, tokenizer, tmp_path):
    """A config changed after its check (a field set on the object) is refused when the engine's arguments are built,
    before vLLM starts."""
    args = tiny_training_args(CalibratedGRPOConfig, tmp_path, use_vllm=True, vllm_mode="colocate", fp8=True,
                              fp8_keep_last_n_layers=1, fp8_recipe="rowwise")
    args.vllm_fp8_linear_backend = "deep_gemm"
    fake_vllm.holder["model"] = model = build_tiny_model(tokenizer, hidden_size=128, intermediate_size=256,
                                                         num_key_value_heads=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="vllm_fp8_linear_backend: vLLM's linear_backend 'deep_gemm'"):
        tiny_trainer(tmp_path, tokenizer=tokenizer, model=model, args=args)
    assert not fake_vllm.engine_kwargs


@pytest.mark.parametrize("value", ["", "   ", 3])
def test_bad_linear_backend_is_named(tmp_path, value):
    with pytest.raises(ValueError, match="vllm_fp8_linear_backend"):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, vllm_fp8_linear_backend=value)


def test_bf16_vllm_trainer_keeps_trl_engine_untouched(fake_vllm, tokenizer, tmp_path):
    """fp8 false, a policy with a local path: TRL's own LLM(...) arguments (and the capture size, a speed default
    both arms share) and per-tensor BF16 sync."""
    path = str(tmp_path / "policy")
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=False, fp8_keep_last_n_layers=0, model_path=path)
    (kw,) = fake_vllm.engine_kwargs
    assert kw["model"] == path and not (tmp_path / ENGINE_MODEL_DIRNAME).exists()
    assert "quantization" in kw and kw["quantization"] is None
    assert not {"hf_overrides", "load_format", "linear_backend"} & set(kw)
    assert kw["compilation_config"] == {"max_cudagraph_capture_size": capture_size_for_batch(kw["max_num_seqs"])}
    trainer.vllm_generation.sync_weights()
    loads = {name: t for kind, name, t, *rest in (e for e in fake_vllm.recorder.events if e[0] == "load")}
    assert loads and all(t.dtype == torch.bfloat16 for t in loads.values())
    assert not any(e[0] in ("init", "finalize") for e in fake_vllm.recorder.events)


def test_sync_fp8_weights_reloads_layerwise_and_resets_the_prefix_cache(fake_reload):
    from calclip.rollout.vllm_sync import sync_fp8_weights

    model = tiny_fp8_llama()
    loads = []
    vllm_model = types.SimpleNamespace(load_weights=lambda weights: loads.extend(weights) or
                                       fake_reload.events.append(("load",)), named_modules=lambda: iter(()))
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_config="MODEL_CONFIG", model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=vllm_model)))),
        reset_prefix_cache=lambda: fake_reload.events.append(("reset",)))
    count = sync_fp8_weights(llm, model)
    kinds = [e[0] for e in fake_reload.events]
    assert kinds == ["init", *["load"] * count, "finalize", "reset"]
    sent = dict(loads)
    assert {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in sent.items()
            if n in vllm_spec(model)} == vllm_spec(model)


def test_reload_drops_only_the_rotary_fallback_warning(fake_reload, caplog):
    """vLLM 0.24 warns "RotaryEmbedding: Failed to load weights" at every reload (seen on the H200 at every sync);
    the sync drops that one record while it runs and nothing else, and leaves the logger as it found it."""
    import logging

    from calclip.rollout.vllm_sync import reload_weights_layerwise

    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    reload = sys.modules["vllm.model_executor.model_loader.reload"]

    def finalize(model, cfg):
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")

    reload.finalize_layerwise_reload = finalize
    model = types.SimpleNamespace(load_weights=lambda weights: None, named_modules=lambda: iter(()))
    filters = list(layerwise.filters)
    with caplog.at_level(logging.WARNING, logger=layerwise.name):
        assert reload_weights_layerwise(model, "CFG", [("a.weight", torch.zeros(1))]) == 1
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
    assert layerwise.filters == filters
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=layerwise.name):  # outside a sync nothing is filtered
        layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
    assert len(caplog.records) == 1


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_trainer_sync_sends_training_fp8_codes_for_exactly_the_fp8_layers(fake_vllm, tokenizer, tmp_path, mode):
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, vllm_mode=mode)
    model = trainer.model
    fake_vllm.recorder.events.clear()
    trainer.vllm_generation.sync_weights()  # TRL 1.16's own method, on the trainer's generation object
    events = fake_vllm.recorder.events
    loads = {name: t for kind, name, t in (e for e in events if e[0] == "load")}
    assert len(loads) == sum(e[0] == "load" for e in events)  # each tensor once
    if mode == "colocate":
        assert events[0][0] == "init" and events[-2][0] == "finalize" and events[-1] == ("reset",)

    scaled = sorted(n.removesuffix(".weight_scale_inv") for n in loads if n.endswith(".weight_scale_inv"))
    assert scaled == sorted(FP8_LAYERS)
    for name in FP8_LAYERS:
        q, s, _ = model.get_submodule(name).quantized_weight()
        weight, scale = loads[f"{name}.weight"], loads[f"{name}.weight_scale_inv"]
        assert weight.dtype == FP8 and scale.dtype == torch.float32
        assert torch.equal(weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale, s)
    for name in BF16_LAYERS:
        assert loads[f"{name}.weight"].dtype == torch.bfloat16
        assert torch.equal(loads[f"{name}.weight"], model.get_submodule(name).weight)
    assert set(loads) == {n for n, _ in model.named_parameters()} | {f"{n}.weight_scale_inv" for n in FP8_LAYERS}


def test_trainer_refuses_layers_vllm_cannot_serve_and_names_the_fix(fake_vllm, tokenizer, tmp_path):
    # 2 kv heads of 32: k_proj/v_proj have N = 64, so the fused qkv_proj cannot be block-FP8 in vLLM
    with pytest.raises(ValueError, match="fp8_keep_patterns") as err:
        make_vllm_trainer(fake_vllm, tokenizer, tmp_path, num_key_value_heads=2)
    message = str(err.value)
    assert "model.layers.0.self_attn.k_proj: N=64 is not a multiple of 128 in fused qkv_proj" in message
    assert not fake_vllm.engine_kwargs  # refused before any engine starts
    # the message proposes regexes that keep the bad layers and their fused sibling q_proj; they are the fix
    suggested = ast.literal_eval(message.split("fp8_keep_patterns:\n", 1)[1].split("\n", 1)[0].strip())
    kept = {f"model.layers.0.self_attn.{m}_proj" for m in "qkv"}
    assert {n for n in kept if any(re.search(p, n) for p in suggested)} == kept
    make_vllm_trainer(fake_vllm, tokenizer, tmp_path, num_key_value_heads=2,
                      fp8_keep_patterns=["lm_head", *suggested])
    assert fake_vllm.engine_kwargs and not any("self_attn.q_proj" in n or "self_attn.k_proj" in n
                                              for n in fake_vllm.fp8_modules_at_engine_start)


@pytest.mark.parametrize("options", [dict(old_logps_source="rollout", vllm_importance_sampling_correction=False),
                                     dict(tis_mode="token_truncate", vllm_importance_sampling_correction=False)])
def test_rollout_logps_come_from_the_fp8_engine(fake_vllm, tokenizer, tmp_path, options):
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, **options)
    fake_vllm.recorder.events.clear()
    trainer.model.train()
    inputs = [row for row in tiny_prompt_dataset(1) for _ in range(trainer.num_generations)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = trainer._generate_and_score_completions(inputs)
    kinds = [e[0] for e in fake_vllm.recorder.events]
    assert kinds.index("finalize") < kinds.index("generate")  # FP8 weights synced before the first rollout
    mask = batch["completion_mask"].bool()
    expected = torch.tensor(FAKE_LOGPROBS).expand(mask.size(0), -1)
    assert torch.equal(batch["sampling_per_token_logps"][mask].view(mask.size(0), -1), expected)
    logps = torch.zeros_like(batch["sampling_per_token_logps"])
    if trainer.args.old_logps_source == "rollout":  # bypass: the old log-probs are the engine's
        assert torch.equal(trainer._old_logps(batch, logps), batch["sampling_per_token_logps"])
        assert trainer._policy_moved(batch)
        # ... and no second correction weight: TRL's own vLLM correction is off (the config requires it)
        assert trainer._rollout_correction(batch, logps, batch["completion_mask"], {}) is None
    else:  # TIS weights compare the trainer's FP8 old log-probs with the engine's
        stats = {}
        weights = trainer._rollout_correction(batch, trainer._old_logps(batch, logps), batch["completion_mask"], stats)
        old = trainer._old_logps(batch, logps)
        ratio = torch.exp(old - batch["sampling_per_token_logps"]).clamp(max=trainer.args.tis_cap)
        assert torch.allclose(weights[mask], ratio[mask]) and "tis/weight_mean" in stats


def test_expected_engine_tensors_stack_shards_in_vllms_fused_order_and_mismatches_are_named():
    from calclip.rollout.vllm_sync import engine_fp8_mismatches, expected_engine_fp8_tensors

    model = tiny_fp8_llama()  # hidden 256, kv 2 x 64: q 256, k 128, v 128 rows
    expected = expected_engine_fp8_tensors(model)
    prefix = "model.layers.0.self_attn"
    assert set(expected) == {f"model.layers.{i}.{m}.{leaf}" for i in range(2) for leaf in ("weight", "weight_scale_inv")
                             for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    qkv = expected[f"{prefix}.qkv_proj.weight"]
    assert qkv.dtype == torch.uint8 and tuple(qkv.shape) == (512, 256)
    k_codes, k_scale, _ = model.get_submodule(f"{prefix}.k_proj").quantized_weight()
    assert torch.equal(qkv[256:384], k_codes.view(torch.uint8))  # k after q's 256 rows, before v
    assert torch.equal(expected[f"{prefix}.qkv_proj.weight_scale_inv"][2:3], k_scale)

    engine = torch.nn.Module()  # a stand-in holding vLLM's parameter names and dtypes
    for name, t in expected.items():
        module_name, _, leaf = name.rpartition(".")
        holder = engine
        for part in module_name.split("."):
            if not hasattr(holder, part):
                holder.add_module(part, torch.nn.Module())
            holder = getattr(holder, part)
        value = t.view(FP8) if leaf == "weight" else t
        holder.register_parameter(leaf, torch.nn.Parameter(value.clone(), requires_grad=False))
    assert engine_fp8_mismatches(engine, model) == []
    engine.get_parameter(f"{prefix}.qkv_proj.weight_scale_inv").data[2, 0] *= 2
    assert engine_fp8_mismatches(engine, model) == [
        f"{prefix}.qkv_proj.weight_scale_inv: engine torch.float32 (4, 2), trainer torch.float32 (4, 2)"]


# ---------------------------------------------------------------------------------------------------------------
# A policy without a loadable name_or_path (built from a config: ""): TRL 1.16 would build LLM(model=""), which
# vLLM tries to download from the Hub (HFValidationError, seen on the H200). The engine starts from a directory
# holding the policy's config and tokenizer, with dummy weights that TRL's first sync replaces.


def sync_before_first_generate(events):
    """{name: tensor} that reached the fake engine before its first generate call."""
    first = [e[0] for e in events].index("generate")
    return {name: t for kind, name, t in (e for e in events[:first] if e[0] == "load")}


@pytest.mark.parametrize("fp8", [True, False])
def test_pathless_policy_engine_starts_from_its_written_config_and_gets_the_weights_first(
        fake_vllm, tokenizer, tmp_path, fp8):
    options = {} if fp8 else {"fp8_keep_last_n_layers": 0}
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=fp8, **options)
    model = trainer.model
    assert model.name_or_path == ""
    (kw,) = fake_vllm.engine_kwargs
    assert kw["model"] == str(tmp_path / ENGINE_MODEL_DIRNAME / "rank-0") and kw["load_format"] == "dummy"
    assert kw["quantization"] == ("fp8" if fp8 else None) and ("hf_overrides" in kw) == fp8
    assert kw["logprobs_mode"] == "processed_logprobs"  # the rest of TRL's arguments stay
    # what vLLM reads from the directory: the policy's config (with the architecture to build and the dtype), its
    # tokenizer, no weights
    config = transformers.AutoConfig.from_pretrained(kw["model"])
    assert config.architectures == ["LlamaForCausalLM"]
    assert str(config.dtype).removeprefix("torch.") == str(model.dtype).removeprefix("torch.") == "bfloat16"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads",
                "max_position_embeddings", "eos_token_id", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert transformers.AutoTokenizer.from_pretrained(kw["model"]).get_vocab() == tokenizer.get_vocab()
    assert not [f for f in os.listdir(kw["model"]) if f.endswith((".safetensors", ".bin"))]
    assert model.config.architectures is None  # the policy's own config is not changed

    # TRL's own rollout path pushes every policy weight before the engine generates
    fake_vllm.recorder.events.clear()
    model.train()
    inputs = [row for row in tiny_prompt_dataset(1) for _ in range(trainer.num_generations)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer._generate_and_score_completions(inputs)
    loads = sync_before_first_generate(fake_vllm.recorder.events)
    assert {n for n, _ in model.named_parameters()} <= set(loads)
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, FP8BlockLinear) and name.endswith(".weight"):
            assert torch.equal(loads[name].view(torch.uint8), module.quantized_weight()[0].view(torch.uint8))
        else:
            assert torch.equal(loads[name], param), name
    assert any(isinstance(m, FP8BlockLinear) for m in model.modules()) == fp8


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("user_dir", [None, "mine"])
def test_the_engines_start_leaves_the_trainers_compile_caches_where_they_were(fake_vllm, tokenizer, tmp_path,
                                                                            monkeypatch, fp8, user_dir):
    """vLLM's compile points TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at its own cache (one per model path and
    config); after the colocated engine's start both are what they were, set or unset, for the trainer's compiles."""
    for name in COMPILE_CACHE_ENV:
        if user_dir is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(tmp_path / user_dir / name))
    before = {name: os.environ.get(name) for name in COMPILE_CACHE_ENV}
    fake_vllm.env_set_by_engine = {name: str(tmp_path / "vllm-cache" / name) for name in COMPILE_CACHE_ENV}
    bf16 = {} if fp8 else dict(fp8_keep_last_n_layers=0)
    make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=fp8, **bf16)
    assert len(fake_vllm.engine_kwargs) == 1  # the engine started (and moved both)
    assert {name: os.environ.get(name) for name in COMPILE_CACHE_ENV} == before


def test_pathless_policy_in_server_mode_writes_nothing(fake_vllm, tokenizer, tmp_path):
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=False, fp8_keep_last_n_layers=0,
                                vllm_mode="server")
    assert trainer.vllm_generation.vllm_client is not None
    assert not fake_vllm.engine_kwargs and not (tmp_path / ENGINE_MODEL_DIRNAME).exists()
    assert trainer.vllm_generation.generation_kwargs == {}  # the colocated engine's sampling defaults stay there


@pytest.mark.parametrize("name", ["org/tiny-model", "tiny-model", "DIR", "FILE"])
def test_loadable_name_or_path_passes_through(tokenizer, tmp_path, name):
    """Hub ids (not checked for existence, as TRL does not) and existing local paths are TRL's to pass on."""
    (tmp_path / "DIR").mkdir()
    (tmp_path / "FILE").write_text("")
    model = build_tiny_model(tokenizer)
    model.name_or_path = str(tmp_path / name) if name.isupper() else name
    assert engine_model_kwargs(model, tokenizer, str(tmp_path / "engine")) == {}
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("name", ["", "not a repo id", "/no/such/dir", "./missing", "a/b/c", None])
def test_unloadable_name_or_path_gets_a_fresh_engine_directory(tokenizer, tmp_path, name):
    model = build_tiny_model(tokenizer)
    model.name_or_path = name
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "preprocessor_config.json").write_text("{}")  # an earlier run's file: vLLM must not read it
    assert engine_model_kwargs(model, tokenizer, str(engine)) == {"model": str(engine), "load_format": "dummy"}
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= set(os.listdir(engine))
    assert "preprocessor_config.json" not in os.listdir(engine)
    assert transformers.AutoConfig.from_pretrained(engine).dtype == torch.float32  # build_tiny_model's default


def test_pathless_policy_without_tokenizer_or_directory_is_refused_naming_name_or_path(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer)
    with pytest.raises(ValueError, match=r"model\.name_or_path, which is '' .*no processing class"):
        engine_model_kwargs(model, None, str(tmp_path / "engine"))
    with pytest.raises(ValueError, match=r"model\.name_or_path, which is '' .*no directory"):
        engine_model_kwargs(model, tokenizer, None)
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("fp8", [True, False])
def test_each_colocated_process_writes_its_own_engine_directory(monkeypatch, tokenizer, tmp_path, fp8):
    model = tiny_fp8_llama() if fp8 else build_tiny_model(tokenizer)
    gen, calls, original_llm = colocate_init(monkeypatch, model, cls=None if fp8 else vllm_generation_class(),
                                             process_index=1, num_processes=2)
    gen.processing_class, gen.engine_model_root = tokenizer, str(tmp_path)
    gen._init_vllm()
    (kw,) = calls
    assert gen.llm == "ENGINE" and trl_vllm_generation.LLM is original_llm
    assert kw["model"] == str(tmp_path / "rank-1") and kw["load_format"] == "dummy"
    assert os.path.isfile(tmp_path / "rank-1" / "config.json") and not (tmp_path / "rank-0").exists()
    assert kw["quantization"] == ("fp8" if fp8 else None)


def test_fp8_export_dir_is_the_engine_model_even_for_a_pathless_policy(monkeypatch, tmp_path):
    gen, calls, _ = colocate_init(monkeypatch, tiny_fp8_llama())
    gen.fp8_export_dir, gen.engine_model_root = str(tmp_path / "export"), str(tmp_path / "engine")
    gen._init_vllm()
    (kw,) = calls
    assert kw["model"] == str(tmp_path / "export") and "load_format" not in kw  # the checkpoint's own weights
    assert not (tmp_path / "engine").exists()


def test_unit_kv_cache_scales_fills_fp8_layers_in_place_and_leaves_others():
    """unit_kv_cache_scales_: every attention layer with an FP8 KV cache gets 1.0 in its scale tensors (in place:
    the storage CUDA graphs read) and their host copies; layers without one, and layers already at 1.0, are left
    alone and not reported."""
    def attention(kv_cache_dtype, value):
        layer = torch.nn.Module()
        layer.kv_cache_dtype = kv_cache_dtype
        layer._k_scale = torch.nn.Parameter(torch.tensor(value), requires_grad=False)  # compressed-tensors rebinds it
        for name in ("_v_scale", "_q_scale", "_prob_scale"):
            layer.register_buffer(name, torch.tensor(value))
        for name in ("_k_scale_float", "_v_scale_float", "_q_scale_float", "_prob_scale_float"):
            setattr(layer, name, value)
        return layer

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([attention("fp8", -0.00094), attention("fp8_e5m2", 1.0), attention("auto", 0.5)])
    storage = model.layers[0]._k_scale.data_ptr()
    assert unit_kv_cache_scales_(model) == ["layers.0"]
    fixed = model.layers[0]
    assert fixed._k_scale.data_ptr() == storage
    assert all(float(getattr(fixed, name)) == 1.0 for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"))
    assert fixed._k_scale_float == fixed._v_scale_float == fixed._q_scale_float == fixed._prob_scale_float == 1.0
    assert float(model.layers[2]._k_scale) == 0.5 and model.layers[2]._k_scale_float == 0.5  # no FP8 KV cache
    assert unit_kv_cache_scales_(model) == []  # idempotent: nothing left to fix


def test_colocate_reload_sync_leaves_an_fp8_kv_cache_at_unit_scales(fake_reload):
    """The trainer's reload sync (TRL's sync_weights through the mixin) ends with the engine's FP8 KV-cache scales at
    1.0, whatever the dummy start left there."""
    gen = make_generation(tiny_fp8_llama(), "colocate", fake_reload)
    attention = torch.nn.Module()
    attention.kv_cache_dtype = "fp8"
    attention.register_buffer("_k_scale", torch.tensor(-0.00094))
    attention.register_buffer("_v_scale", torch.tensor(-0.00094))
    attention._k_scale_float = attention._v_scale_float = -0.00094
    gen._fake_vllm_model.named_modules = lambda: iter([("model.layers.0.self_attn.attn", attention)])
    gen.sync_weights()
    assert float(attention._k_scale) == float(attention._v_scale) == 1.0
    assert attention._k_scale_float == attention._v_scale_float == 1.0
    assert fake_reload.events[-2][0] == "finalize" and fake_reload.events[-1] == ("reset",)  # one whole reload
