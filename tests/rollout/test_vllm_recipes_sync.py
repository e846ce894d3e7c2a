"""vLLM export and weight sync of torchao's rowwise and tensorwise recipes (calclip.fp8.export,
calclip.rollout.vllm_sync, calclip.rollout.vllm_direct_sync), on CPU with torchao's emulated float8 training.

Expected values come from three independent places:
- torchao's own training forward: the WEIGHT cast ``matmul_with_hp_or_float8_args.forward`` makes
  (``torchao.float8.float8_linear.hp_tensor_to_float8_dynamic``) is recorded while the policy runs a forward, and the
  sync must send those codes and the reciprocal of those scales (what torchao's GEMM multiplies with);
- a float64 reference of the recipe's arithmetic written here (amax per output row or per tensor, 448 / amax rounded
  to float32, codes = saturate(w * scale) in e4m3);
- vLLM 0.24.0's source (read from the wheel, not imported): ``CompressedTensorsConfig._is_fp8_w8a8`` accepts FP8
  symmetric static weights of strategy "channel" with dynamic input activations and builds
  ``CompressedTensorsW8A8Fp8``, whose ``create_weights`` registers ``weight`` e4m3 [N_total, K] and ``weight_scale``
  fp32 [N_total, 1] (``ChannelQuantScaleParameter``; shards at their row offsets in q, k, v / gate, up order) and whose
  ``process_weights_after_loading`` (strategy CHANNEL) keeps both and replaces ``weight`` by ``weight.t()``, the
  same storage seen as [K, N_total] (CUTLASS's kernel does not pad dims that are multiples of 16). The engine
  stand-in below holds exactly that, with its own offsets written out.
"""

import gc
import json
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")
transformers = pytest.importorskip("transformers")
pytest.importorskip("trl.generation.vllm_generation")

import torchao.float8.float8_linear as torchao_float8_linear  # noqa: E402

from calclip.fp8 import Fp8Config, quantize_model  # noqa: E402
from calclip.fp8.export import (  # noqa: E402
    channel_fp8_quantization_config,
    export_fp8_checkpoint,
    fp8_weight_specs,
    fp8_weight_sync_tensors,
    shared_block_size,
    vllm_block_fp8_problems,
    vllm_channel_fp8_problems,
)
from calclip.rollout.vllm_sync import (  # noqa: E402
    TENSORWISE_ACTIVATION_NOTE,
    capture_size_for_batch,
    check_vllm_compatible,
    engine_fp8_mismatches,
    expected_engine_fp8_tensors,
    gc_paused,
    engine_speed_kwargs,
    fp8_engine_kwargs,
    merge_engine_kwargs,
    output_head_name,
)
from tests.fixtures import tiny_training_args  # noqa: E402
from calclip.trainers.config import CalibratedGRPOConfig  # noqa: E402
from tests.rollout.test_vllm_sync import (  # noqa: E402,F401
    BF16_LAYERS,
    FP8_LAYERS,
    fake_reload,
    fake_vllm,
    make_generation,
    make_vllm_trainer,
    tokenizer,
)

FP8 = torch.float8_e4m3fn
RECIPES = ["rowwise", "tensorwise"]
# hidden 256, intermediate 384, 4 heads of 64, 2 KV heads: q 256 rows, k and v 128 each; gate and up 384 each
OFFSETS = {"q_proj": 0, "k_proj": 256, "v_proj": 384, "gate_proj": 0, "up_proj": 384}
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
FUSED_ROWS = {"qkv_proj": 512, "gate_up_proj": 768}
UNFUSED = {"o_proj": (256, 256), "down_proj": (256, 384)}  # (N, K)


def tiny_llama(recipe, *, power_of_two_scales=False, keep_patterns=(), seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # spread the rows' ranges, so per-row and per-tensor scales differ visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(torch.exp(torch.randn(p.shape[0], 1)))
    return quantize_model(model, Fp8Config(recipe=recipe, power_of_two_scales=power_of_two_scales,
                                           keep_patterns=("lm_head", *keep_patterns)))


def reference_codes(weight, recipe, power_of_two=False):
    """float64 reference of the recipe's weight cast: (codes e4m3 [N, K], dequantization scale fp32 [N, 1])."""
    w = weight.detach().to(torch.float64)
    amax = w.abs().amax(dim=1, keepdim=True) if recipe == "rowwise" else w.abs().amax().expand(w.shape[0], 1)
    scale = (448.0 / amax.clamp(min=1e-12)).to(torch.float32)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    codes = (weight.detach().to(torch.float32) * scale).clamp(-448, 448).to(FP8)
    return codes, (1.0 / scale.to(torch.float64)).to(torch.float32)


def record_training_weight_casts(model, ids):
    """{id(weight Parameter's data): (codes [N, K], torchao's multiplier)} of every WEIGHT cast in one forward."""
    casts = {}
    original = torchao_float8_linear.hp_tensor_to_float8_dynamic

    def recording(hp_tensor, *args, **kwargs):
        out = original(hp_tensor, *args, **kwargs)
        if kwargs.get("gemm_input_role") is not None and kwargs["gemm_input_role"].value == "weight":
            casts[hp_tensor.data_ptr()] = (out._data.t().contiguous(), out._scale.detach().clone())
        return out

    torchao_float8_linear.hp_tensor_to_float8_dynamic = recording
    try:
        with torch.no_grad():
            model(ids)
    finally:
        torchao_float8_linear.hp_tensor_to_float8_dynamic = original
    return casts


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("recipe", RECIPES)
def test_sync_sends_the_codes_and_scales_of_torchaos_training_forward(recipe, power_of_two):
    model = tiny_llama(recipe, power_of_two_scales=power_of_two)
    casts = record_training_weight_casts(model, torch.randint(0, 320, (2, 9)))
    stream = dict(fp8_weight_sync_tensors(model))
    specs = fp8_weight_specs(model)
    assert len(specs) == 14 and {s.recipe for s in specs.values()} == {recipe}
    assert len(casts) == 14  # every FP8 linear cast its weight once
    for module_name in specs:
        weight = model.get_submodule(module_name).weight
        codes, scale = stream[f"{module_name}.weight"], stream[f"{module_name}.weight_scale"]
        n, k = weight.shape
        assert codes.dtype == FP8 and tuple(codes.shape) == (n, k)
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (n, 1)
        trained_codes, multiplier = casts[weight.data_ptr()]
        assert torch.equal(codes.view(torch.uint8), trained_codes.view(torch.uint8))
        # torchao's GEMMs multiply by the reciprocal of its multiplier (addmm_float8_unwrapped)
        assert torch.equal(scale, multiplier.reciprocal().reshape(-1, 1).expand(n, 1))
        ref_codes, ref_scale = reference_codes(weight, recipe, power_of_two)
        assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
        # 1/x in float32 and in float64-then-rounded agree for these scales (both correctly rounded)
        assert torch.equal(scale, ref_scale)
        if recipe == "tensorwise":
            assert (scale == scale[0]).all()
        else:
            assert scale.unique().numel() > 1
    assert "model.embed_tokens.weight" in stream and stream["lm_head.weight"].dtype == torch.float32  # as they are


def test_a_non_finite_weight_is_refused():
    model = tiny_llama("rowwise")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        dict(fp8_weight_sync_tensors(model))


@pytest.mark.parametrize("recipe", RECIPES)
def test_engine_kwargs_build_a_compressed_tensors_per_channel_engine(recipe):
    model = tiny_llama(recipe)
    kwargs = fp8_engine_kwargs(model)
    assert kwargs["quantization"] == "compressed-tensors" and kwargs["load_format"] == "dummy"
    config = kwargs["hf_overrides"]["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    # vLLM 0.24 _is_fp8_w8a8: float weights and inputs, symmetric static weight of strategy channel, dynamic input
    assert group["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                "dynamic": False}
    assert group["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                          "strategy": "token" if recipe == "rowwise" else "tensor"}
    assert config["ignore"] == ["lm_head"] == config["modules_to_not_convert"]
    assert fp8_engine_kwargs(model, export_dir="/ckpt") == {"model": "/ckpt", "quantization": "compressed-tensors"}
    with pytest.raises(ValueError, match="'blockwise' only"):
        shared_block_size(fp8_weight_specs(model))


@pytest.mark.parametrize("recipe", RECIPES)
def test_an_export_dir_in_another_format_than_the_sync_is_refused(recipe, tmp_path):
    """vLLM 0.24 with a per-tensor checkpoint (compressed-tensors weights of strategy "tensor"): one scale per shard,
    re-quantized to the largest in process_weights_after_loading, and calclip's [N, 1] shard scales refused by a bare
    AssertionError in PerTensorScaleParameter (seen on CPU with the real loaders: probe_vllm_reload_cpu.py
    --engine-weights tensor). calclip refuses such an export_dir before the engine starts, naming the key."""
    model = tiny_llama(recipe)
    out = export_fp8_checkpoint(model, tmp_path / "ok", config_dict=model.config.to_dict())
    assert fp8_engine_kwargs(model, export_dir=out) == {"model": str(out), "quantization": "compressed-tensors"}

    def edited(name, edit):
        config = json.loads((out / "config.json").read_text())
        edit(config["quantization_config"])
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    def per_tensor(qc):
        qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"

    with pytest.raises(ValueError) as info:
        fp8_engine_kwargs(model, export_dir=edited("tensor", per_tensor))
    message = str(info.value)
    assert "not in the format calclip's weight sync sends" in message and "export_fp8_checkpoint" in message
    assert "quantization_config config_groups:" in message and "'strategy': 'tensor'" in message
    with pytest.raises(ValueError, match=r"quantization_config ignore: checkpoint \[\], policy \['lm_head'\]"):
        fp8_engine_kwargs(model, export_dir=edited("head", lambda qc: qc.update(ignore=[])))  # an FP8 head in vLLM
    with pytest.raises(ValueError, match="quantization_config quant_method: checkpoint 'fp8', policy 'compressed"):
        fp8_engine_kwargs(model, export_dir=edited("block", lambda qc: qc.update(quant_method="fp8")))
    # keys vLLM does not serve differently are not compared: the recipe tag, the activations' declared strategy
    harmless = edited("tag", lambda qc: (qc.update(calclip_fp8_recipe="x"),
                                        qc["config_groups"]["group_0"]["input_activations"].update(strategy="token")))
    assert fp8_engine_kwargs(model, export_dir=harmless)["model"] == str(harmless)
    blockwise = quantize_model(transformers.LlamaForCausalLM(model.config).float(), Fp8Config())
    with pytest.raises(ValueError, match="quant_method: checkpoint 'compressed-tensors', policy 'fp8'"):
        fp8_engine_kwargs(blockwise, export_dir=out)  # a blockwise policy, this recipe's checkpoint
    block_out = export_fp8_checkpoint(blockwise, tmp_path / "block_ok", config_dict=blockwise.config.to_dict())
    assert fp8_engine_kwargs(blockwise, export_dir=block_out)["quantization"] == "fp8"  # its own export: served


def test_channel_config_refuses_the_blockwise_recipe():
    with pytest.raises(ValueError, match="'blockwise' exports block-FP8"):
        channel_fp8_quantization_config(recipe="blockwise")


def test_compressed_tensors_validates_the_config():
    quantization = pytest.importorskip("compressed_tensors.quantization")
    for recipe in RECIPES:
        config = channel_fp8_quantization_config(recipe=recipe, modules_to_not_convert=["lm_head"])
        (group,) = config["config_groups"].values()
        weights = quantization.QuantizationArgs.model_validate(group["weights"])
        inputs = quantization.QuantizationArgs.model_validate(group["input_activations"])
        assert weights.strategy == "channel" and not weights.dynamic and inputs.dynamic
        # the whole config, as transformers' CompressedTensorsConfig hands it over (extra keys are dropped)
        whole = quantization.QuantizationConfig.model_validate(config)
        assert whole.ignore == ["lm_head"] and whole.format == "float-quantized"


@pytest.mark.parametrize("recipe", RECIPES)
def test_export_writes_the_sync_tensors_and_the_engine_config(tmp_path, recipe):
    import json

    from safetensors.torch import load_file

    model = tiny_llama(recipe)
    out = export_fp8_checkpoint(model, tmp_path, config_dict=model.config.to_dict())
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == fp8_engine_kwargs(model)["hf_overrides"]["quantization_config"]
    stream = dict(fp8_weight_sync_tensors(model))
    for module_name in fp8_weight_specs(model):
        for leaf in ("weight", "weight_scale"):
            name = f"{module_name}.{leaf}"
            assert tensors[name].dtype == stream[name].dtype  # the fp32 scales are not cast to bf16
            assert torch.equal(tensors[name].view(torch.uint8), stream[name].view(torch.uint8))
    assert tensors["model.norm.weight"].dtype == torch.bfloat16


class ChannelEngine(nn.Module):
    """vLLM 0.24's CompressedTensorsW8A8Fp8 (strategy channel) layout after loading, written out here: every fused
    layer's codes in one [N_total, K] storage that the module exposes transposed ([K, N_total], as
    ``process_weights_after_loading`` leaves ``weight.t()``), its ``weight_scale`` [N_total, 1] as loaded; other
    parameters under their own names. ``load_weights`` writes each shard at its own row offset (OFFSETS).

    layout="copy": the engine keeps a contiguous [K, N] copy instead (another kernel's layout);
    scale_factor != 1: the engine changes the scales after loading (a requantization)."""

    def __init__(self, policy, recorder, *, layout="transposed", scale_factor=1.0):
        super().__init__()
        self.recorder, self.layout, self.scale_factor = recorder, layout, scale_factor
        self.params = {}
        self.storage = {}
        for layer in range(2):
            for fused, rows in FUSED_ROWS.items():
                block = "self_attn" if fused == "qkv_proj" else "mlp"
                k = 256
                self._fp8(f"model.layers.{layer}.{block}.{fused}", rows, k)
            for short, (n, k) in UNFUSED.items():
                block = "self_attn" if short == "o_proj" else "mlp"
                self._fp8(f"model.layers.{layer}.{block}.{short}", n, k)
        for name, p in policy.named_parameters():
            short = name.rsplit(".", 2)[-2]
            if short in FUSED or short in UNFUSED:
                continue
            self.params[name] = nn.Parameter(torch.zeros_like(p), requires_grad=False)

    def _fp8(self, module, n, k):
        storage = torch.zeros(n, k, dtype=FP8)
        self.storage[module] = storage
        weight = storage.t() if self.layout == "transposed" else storage.t().contiguous()
        self.params[f"{module}.weight"] = nn.Parameter(weight, requires_grad=False)
        self.params[f"{module}.weight_scale"] = nn.Parameter(torch.zeros(n, 1), requires_grad=False)

    def named_parameters(self, *args, **kwargs):
        return iter(list(self.params.items()))

    def load_weights(self, weights):
        for name, t in weights:
            self.recorder.events.append(("load", name))
            module, _, leaf = name.rpartition(".")
            parent, _, short = module.rpartition(".")
            start, target = 0, module
            if short in FUSED:
                start, target = OFFSETS[short], f"{parent}.{FUSED[short]}"
            if leaf == "weight" and t.dtype == FP8:
                rows = self.storage[target]
                rows[start:start + t.shape[0]] = t
                if self.layout == "copy":  # a contiguous copy that does not share the loaded storage
                    self.params[f"{target}.weight"].data.copy_(rows.t())
            elif leaf == "weight_scale":
                self.params[f"{target}.weight_scale"].data[start:start + t.shape[0]] = t * self.scale_factor
            else:
                self.params[name].data.copy_(t)


def engine_gen(fake_reload, policy, **options):
    gen = make_generation(policy, "colocate", fake_reload)
    engine = ChannelEngine(policy, fake_reload, **options)
    gen.llm.llm_engine.model_executor.driver_worker.model_runner.model = engine
    return gen, engine


def step(policy, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.01)


def bf16_params_match(engine, policy):
    params = dict(engine.named_parameters())
    compared = [n for n, _ in policy.named_parameters() if n in params and params[n].dtype != FP8]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(compared)
    return all(torch.equal(params[n].data, policy.get_parameter(n).data) for n in compared)


@pytest.mark.parametrize("recipe", RECIPES)
def test_per_channel_engine_holds_the_trainers_codes_and_later_syncs_copy_in_place(fake_reload, caplog, recipe):
    policy = tiny_llama(recipe)
    gen, engine = engine_gen(fake_reload, policy)
    storage = {n: p.data.data_ptr() for n, p in engine.named_parameters()}
    with caplog.at_level(logging.INFO, logger="calclip.rollout.vllm_sync"):
        gen.sync_weights()  # TRL 1.16's own method: the first sync through vLLM's layerwise reload
    kinds = [e[0] for e in fake_reload.events]
    assert kinds[0] == "init" and "finalize" in kinds and "load" in kinds
    assert gen._direct_sync.verified, gen._direct_sync.reason
    assert "later syncs copy in place" in caplog.text
    assert engine_fp8_mismatches(engine, policy) == [] and bf16_params_match(engine, policy)
    # k_proj's codes sit in rows 256..384 of the fused storage, its scales in the same rows of weight_scale
    k = policy.get_submodule("model.layers.0.self_attn.k_proj")
    stream = dict(fp8_weight_sync_tensors(policy))
    assert torch.equal(engine.storage["model.layers.0.self_attn.qkv_proj"][256:384].view(torch.uint8),
                       stream["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8))
    assert torch.equal(engine.params["model.layers.0.self_attn.qkv_proj.weight_scale"][256:384],
                       stream["model.layers.0.self_attn.k_proj.weight_scale"])
    assert k.weight.shape == (128, 256)

    for seed in (1, 2):  # optimizer steps change the codes, the scales and the BF16 tensors
        step(policy, seed)
        assert engine_fp8_mismatches(engine, policy)  # stale before the sync
        fake_reload.events.clear()
        gen.sync_weights()
        assert [e[0] for e in fake_reload.events] == ["reset"]  # in-place copies only
        assert engine_fp8_mismatches(engine, policy) == [] and bf16_params_match(engine, policy)
    assert {n: p.data.data_ptr() for n, p in engine.named_parameters()} == storage


@pytest.mark.parametrize("options, why", [
    (dict(layout="copy"), "model.layers.0.self_attn.q_proj.weight -> model.layers.0.self_attn.qkv_proj.weight: "
                          "engine shape (256, 512), sync shape (256, 256)"),
    (dict(scale_factor=2.0), "q_proj.weight_scale -> model.layers.0.self_attn.qkv_proj.weight_scale: the engine "
                             "holds other values"),
])
def test_an_engine_that_does_not_hold_the_loaded_tensors_keeps_the_reload(fake_reload, caplog, options, why):
    policy = tiny_llama("rowwise")
    gen, engine = engine_gen(fake_reload, policy, **options)
    with caplog.at_level(logging.WARNING, logger="calclip.rollout.vllm_sync"):
        gen.sync_weights()
    assert not gen._direct_sync.verified and why in gen._direct_sync.reason
    assert "stays on vLLM's layerwise reload" in caplog.text
    if options.get("scale_factor"):
        assert engine_fp8_mismatches(engine, policy)  # the mismatch check sees the requantized scales too


def test_expected_engine_tensors_stack_channel_shards_in_vllms_fused_order():
    policy = tiny_llama("tensorwise")
    expected = expected_engine_fp8_tensors(policy)
    assert set(expected) == {f"model.layers.{i}.{m}.{leaf}" for i in range(2) for leaf in ("weight", "weight_scale")
                             for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    scale = expected["model.layers.1.mlp.gate_up_proj.weight_scale"]
    assert tuple(scale.shape) == (768, 1)
    # tensorwise: one scale per shard, gate's in rows 0..384 and up's in 384..768, and they differ
    assert (scale[:384] == scale[0]).all() and (scale[384:] == scale[384]).all() and scale[0] != scale[384]
    gate = policy.get_submodule("model.layers.1.mlp.gate_proj").weight
    assert torch.equal(scale[:384], reference_codes(gate, "tensorwise")[1])


def test_mixed_fused_layers_are_refused_naming_the_layers_and_the_fix():
    policy = tiny_llama("rowwise", keep_patterns=[r"^model\.layers\.1\.self_attn\.k_proj$"])
    with pytest.raises(ValueError) as info:
        check_vllm_compatible(policy, keep_field="fp8_keep_patterns")
    message = str(info.value)
    assert "per-channel FP8 linear (compressed-tensors) cannot serve 2 FP8 layer(s) of recipe 'rowwise'" in message
    assert "model.layers.1.self_attn.q_proj: fused qkv_proj mixes FP8 and BF16 shards" in message
    assert r"'^model\\.layers\\.1\\.self_attn\\.v_proj$'" in message and "fp8_keep_patterns" in message
    check_vllm_compatible(tiny_llama("rowwise"))  # all shards FP8: served


@pytest.mark.parametrize("recipe", ["blockwise", *RECIPES])
def test_an_fp8_lm_head_is_refused_since_vllm_serves_it_in_bf16(recipe):
    """vLLM 0.24 builds the LM head as ParallelLMHead, which neither Fp8Config nor calclip's compressed-tensors
    config quantizes: with the real 0.24 loaders on CPU, an FP8 head's sync failed at ``lm_head.weight_scale`` ("no
    module or parameter named") after its FP8 codes had been cast into the BF16 head. Refused before the engine
    starts, with the keep pattern that fixes it."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=64)
    policy = quantize_model(transformers.LlamaForCausalLM(cfg).float(), Fp8Config(recipe=recipe, keep_patterns=()))
    assert "lm_head" in fp8_weight_specs(policy)  # nothing kept: the head is FP8 in training
    with pytest.raises(ValueError) as info:
        check_vllm_compatible(policy, keep_field="fp8_keep_patterns")
    message = str(info.value)
    assert "cannot serve 1 FP8 layer(s)" in message and "lm_head: the LM head: vLLM serves it in BF16" in message
    assert "'^lm_head$'" in message and "fp8_keep_patterns" in message
    kept = quantize_model(transformers.LlamaForCausalLM(cfg).float(), Fp8Config(recipe=recipe))
    check_vllm_compatible(kept)  # the default keeps lm_head in BF16: served


def test_the_lm_head_rule_follows_the_models_output_embeddings_name():
    shapes = {"a.o_proj": (256, 256), "lm_head": (384, 256), "embed_out": (384, 256)}  # whole 128 blocks
    for problems_of in (vllm_channel_fp8_problems, vllm_block_fp8_problems):
        assert set(problems_of(shapes)) == {"lm_head"}  # the default: the Llama family's name
        assert set(problems_of(shapes, output_head="embed_out")) == {"embed_out"}
        assert problems_of(shapes, output_head=None) == {}

    class Head(nn.Module):  # a model whose LM head is not called lm_head (GPT-NeoX: embed_out)
        def __init__(self):
            super().__init__()
            self.body, self.embed_out = nn.Linear(16, 16), nn.Linear(16, 32)

        def get_output_embeddings(self):
            return self.embed_out

    assert output_head_name(Head()) == "embed_out"
    assert output_head_name(nn.Sequential(nn.Linear(4, 4))) == "lm_head"  # no get_output_embeddings


def test_channel_problems_need_only_an_even_tensor_parallel_split():
    shapes = {"a.q_proj": (96, 48), "a.k_proj": (32, 48), "a.v_proj": (32, 48), "a.o_proj": (48, 96)}
    assert vllm_channel_fp8_problems(shapes) == {}  # no 128 grid: any multiple of 16 loads per channel
    assert vllm_channel_fp8_problems(shapes, tp_size=2) == {}
    assert vllm_channel_fp8_problems({"a.o_proj": (48, 80)}, tp_size=3) == {
        "a.o_proj": "N=48, K=80 do not split evenly over tp_size=3"}


def test_a_tensorwise_engine_start_says_how_its_activations_differ(fake_reload, caplog, monkeypatch):
    gen = make_generation(tiny_llama("tensorwise"), "colocate", fake_reload)
    monkeypatch.setattr(type(gen).__mro__[2], "_start_engine", lambda self: None)  # ColocateEngineMixin's
    with caplog.at_level(logging.WARNING, logger="calclip.rollout.vllm_sync"):
        gen._start_engine()
    assert TENSORWISE_ACTIVATION_NOTE in caplog.text and "per token" in TENSORWISE_ACTIVATION_NOTE
    caplog.clear()
    gen = make_generation(tiny_llama("rowwise"), "colocate", fake_reload)
    with caplog.at_level(logging.WARNING, logger="calclip.rollout.vllm_sync"):
        gen._start_engine()
    assert TENSORWISE_ACTIVATION_NOTE not in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# The trainer (TRL's GRPOTrainer.__init__ with the engine faked, tests/rollout/test_vllm_sync.py's FakeVLLM).


def test_trainer_with_a_rowwise_policy_builds_a_per_channel_engine_and_syncs_its_codes(fake_vllm, tokenizer,
                                                                                     tmp_path):
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8_recipe="rowwise")
    (kw,) = fake_vllm.engine_kwargs
    assert kw["quantization"] == "compressed-tensors" and kw["load_format"] == "dummy"
    config = kw["hf_overrides"]["quantization_config"]
    assert config["ignore"] == BF16_LAYERS and config["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    trainer.vllm_generation.sync_weights()
    loads = {name: t for kind, name, t, *rest in (e for e in fake_vllm.recorder.events if e[0] == "load")}
    policy = trainer.accelerator.unwrap_model(trainer.model)
    for layer in FP8_LAYERS:
        codes, scale = reference_codes(policy.get_submodule(layer).weight, "rowwise")
        assert torch.equal(loads[f"{layer}.weight"].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(loads[f"{layer}.weight_scale"], scale)
    assert all(loads[f"{layer}.weight"].dtype == torch.bfloat16 for layer in BF16_LAYERS)


def vllm_capture_sizes(cap: int) -> list[int]:
    """vLLM 0.24's capture list up to ``cap`` (VllmConfig._set_cudagraph_sizes, no speculative decoding)."""
    sizes = [size for size in (1, 2, 4) if size <= cap] + list(range(8, min(cap + 1, 256), 8))
    return sizes + (list(range(256, cap + 1, 16)) if cap >= 256 else [])


@pytest.mark.parametrize("batch, cap", [(1, 1), (3, 4), (5, 8), (12, 16), (128, 128), (130, 136), (256, 256),
                                        (257, 272), (600, 512)])
def test_the_capture_size_keeps_a_graph_for_the_whole_rollout_batch(batch, cap):
    assert capture_size_for_batch(batch) == cap
    sizes = vllm_capture_sizes(cap)
    assert sizes[-1] == cap  # a size of the list: vLLM keeps it as given (it truncates any other)
    assert cap >= min(batch, 512) and (len(sizes) < 2 or sizes[-2] < batch)  # the smallest such size
    assert len(sizes) <= len(vllm_capture_sizes(min(2 * batch, 512)))  # never more graphs than vLLM's default


def test_engine_kwargs_merge_their_compilation_configs_key_by_key():
    numerics = {"linear_backend": "deep_gemm", "compilation_config": {"pass_config": {"fuse_norm_quant": False}}}
    speed = engine_speed_kwargs(max_cudagraph_capture_size=64, async_scheduling=False)
    assert merge_engine_kwargs({"max_num_seqs": 64, "linear_backend": "cutlass"}, numerics, speed) == {
        "max_num_seqs": 64, "linear_backend": "deep_gemm", "async_scheduling": False,
        "compilation_config": {"pass_config": {"fuse_norm_quant": False}, "max_cudagraph_capture_size": 64}}
    assert "compilation_config" not in engine_speed_kwargs()  # the default: vLLM's capture sizes
    later = merge_engine_kwargs(speed, {"compilation_config": {"max_cudagraph_capture_size": 8}})
    assert later["compilation_config"] == {"max_cudagraph_capture_size": 8}  # a later layer's key wins


OPTIONS = dict(vllm_kv_cache_dtype="fp8", vllm_async_scheduling=False, vllm_max_num_batched_tokens=8192,
               vllm_max_cudagraph_capture_size=24)


@pytest.mark.parametrize("options", [{}, OPTIONS], ids=["defaults", "options"])
@pytest.mark.parametrize("fp8", [True, False])
def test_engine_options_reach_the_engine_and_their_defaults_change_nothing(fake_vllm, tokenizer, tmp_path, fp8,
                                                                          options):
    bf16 = {} if fp8 else dict(fp8_keep_last_n_layers=0)
    make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=fp8, **options, **bf16)
    (kw,) = fake_vllm.engine_kwargs
    assert (kw.get("quantization") == "fp8") == fp8  # the FP8 engine's own arguments are kept
    # the FP8 numerics' compilation passes and the capture size share compilation_config: both reach the engine
    assert ("pass_config" in kw["compilation_config"]) == fp8
    if not options:
        assert not {"kv_cache_dtype", "async_scheduling"} & set(kw)
        assert kw["max_num_batched_tokens"] == 4096  # TRL 1.16's own value
        # graphs up to the rollout batch (TRL's max_num_seqs), not vLLM's twice that
        assert kw["compilation_config"]["max_cudagraph_capture_size"] == capture_size_for_batch(kw["max_num_seqs"])
    else:
        assert kw["kv_cache_dtype"] == "fp8" and kw["async_scheduling"] is False
        assert kw["max_num_batched_tokens"] == 8192
        assert kw["compilation_config"]["max_cudagraph_capture_size"] == 24


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("detokenize, generation_kwargs, expected", [
    (None, None, False),  # default: TRL reads token ids and log-probs only
    (None, {"stop": ["\n\n"]}, True),  # stop strings are matched on the text: vLLM's default stays
    (None, {"detokenize": True, "top_k": 5}, True),  # the user's own SamplingParams argument wins
    (True, None, True),
    (False, {"top_k": 5}, False),
])
def test_colocated_rollouts_skip_detokenizing_unless_asked(fake_vllm, tokenizer, tmp_path, fp8, detokenize,
                                                          generation_kwargs, expected):
    bf16 = {} if fp8 else dict(fp8_keep_last_n_layers=0)
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=fp8, vllm_detokenize=detokenize,
                                generation_kwargs=generation_kwargs, **bf16)
    prompt = tokenizer("ab")["input_ids"]
    trainer.vllm_generation.generate(prompts=[prompt, prompt], images=None, num_generations=1)
    (params,) = fake_vllm.sampling_params  # what TRL's colocated generate gave vLLM's SamplingParams
    assert params.get("detokenize", True) is expected
    assert params["logprobs"] == 0 and params["max_tokens"] == trainer.args.max_completion_length  # TRL's own
    for key, value in (generation_kwargs or {}).items():
        assert params[key] == value
    assert trainer.args.generation_kwargs == generation_kwargs  # the user's config is not rewritten


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("pause", [None, True, False])  # None: the default, paused
def test_colocated_rollouts_run_with_the_garbage_collector_paused_unless_asked_not_to(fake_vllm, tokenizer, tmp_path,
                                                                                     fp8, pause):
    bf16 = {} if fp8 else dict(fp8_keep_last_n_layers=0)
    asked = {} if pause is None else {"vllm_pause_gc": pause}
    trainer = make_vllm_trainer(fake_vllm, tokenizer, tmp_path, fp8=fp8, **asked, **bf16)
    prompt = tokenizer("ab")["input_ids"]
    assert gc.isenabled()
    trainer.vllm_generation.generate(prompts=[prompt], images=None, num_generations=1)
    paused = pause is not False
    assert fake_vllm.gc_enabled == [not paused] and gc.isenabled()  # off inside the engine's generate only
    gc.disable()  # a user who switched the collector off keeps it off
    try:
        trainer.vllm_generation.generate(prompts=[prompt], images=None, num_generations=1)
        assert fake_vllm.gc_enabled[-1] is False and not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_rollout_turns_the_garbage_collector_back_on():
    with pytest.raises(RuntimeError, match="engine died"):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("engine died")
    assert gc.isenabled()


@pytest.mark.parametrize("detokenize, generation_kwargs, message", [
    (False, {"stop": ["</answer>"]}, "vllm_detokenize=False with generation_kwargs\\['stop'\\]"),
    (True, {"detokenize": False}, "vllm_detokenize=True contradicts generation_kwargs\\['detokenize'\\]"),
    ("no", None, "vllm_detokenize must be a boolean"),
])
def test_contradictory_detokenize_settings_are_refused(tmp_path, detokenize, generation_kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, vllm_detokenize=detokenize,
                           generation_kwargs=generation_kwargs)


@pytest.mark.parametrize("field, value", [
    ("vllm_kv_cache_dtype", "int8"), ("vllm_kv_cache_dtype", None), ("vllm_async_scheduling", "yes"),
    ("vllm_max_num_batched_tokens", 0), ("vllm_max_num_batched_tokens", True), ("vllm_max_num_batched_tokens", 1.5),
    ("vllm_max_cudagraph_capture_size", 0), ("vllm_max_cudagraph_capture_size", "512"), ("vllm_pause_gc", "yes"),
])
def test_bad_engine_options_are_named(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        tiny_training_args(CalibratedGRPOConfig, tmp_path, **{field: value})
