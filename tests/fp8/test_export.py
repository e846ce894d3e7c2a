"""Block-FP8 export checked against independent consumers: transformers' fine-grained FP8 loader (installed
transformers 5.24) and the tensor spec vLLM's block-FP8 linear method registers (read from vLLM's source).

Sources read (citations for the expected values below):
- transformers 5.24 ``utils/quantization_config.py`` ``FineGrainedFP8Config.__init__``: fields quant_method,
  activation_scheme, weight_block_size, dequantize, modules_to_not_convert (``ignored_layers`` only as an alias
  when modules_to_not_convert is None), scale_fmt.
- transformers 5.24 ``quantizers/quantizer_finegrained_fp8.py`` ``validate_environment``: without CUDA/XPU a
  pre-quantized checkpoint is loaded with ``dequantize=True`` (CPU path), via
  ``integrations/finegrained_fp8.py`` ``Fp8Dequantize._dequantize_one`` which derives the block size as
  rows // scale_rows and raises "not divisible by scale grid" for ragged shapes (see the ragged test).
- vLLM ``vllm/model_executor/layers/quantization/fp8.py`` (vllm-project/vllm, read at commits 0071b24b
  [v0.9/0.10 era] and 1436674b [late-2025 main]): ``Fp8Config.from_config`` reads quant_method ("fp8" in it ->
  fp8-serialized), activation_scheme, ignored_layers, weight_block_size, and (1436674b only) falls back to
  modules_to_not_convert; ``Fp8LinearMethod.create_weights`` with block quant registers
  ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)] in both.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

transformers = pytest.importorskip("transformers")

from calclip.fp8 import Fp8Config, FP8BlockLinear, dequantize_128x128, quantize_model  # noqa: E402
from calclip.fp8.export import (  # noqa: E402
    SCALE_NAME,
    block_fp8_quantization_config,
    export_fp8_checkpoint,
    fp8_state_dict,
    fp8_weight_specs,
    fp8_weight_sync_tensors,
    linear_shapes,
    vllm_block_fp8_problems,
    vllm_keep_patterns,
)
from calclip.fp8.reference import quantize_128x128  # noqa: E402

FP8 = torch.float8_e4m3fn


def cdiv(a, b):
    return -(-a // b)


def tiny_llama(hidden, intermediate, *, seed=0, tie=False):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    # Spread the weights so blocks have different scales (init std 0.02 gives near-identical amax everywhere).
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(torch.exp(torch.randn(()) ))
    return model, cfg


def expected_vllm_spec(model):
    """What vLLM's Fp8LinearMethod.create_weights registers per FP8 linear (block quant, fp8-serialized)."""
    spec = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8BlockLinear):
            n, k = m.out_features, m.in_features
            spec[f"{name}.weight"] = (FP8, (n, k))
            spec[f"{name}.weight_scale_inv"] = (torch.float32, (cdiv(n, 128), cdiv(k, 128)))
    return spec


def test_quantization_config_fields_read_by_transformers_and_vllm():
    qc = block_fp8_quantization_config(modules_to_not_convert=["lm_head", "model.layers.0.mlp.down_proj"])
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [128, 128]
    assert qc["modules_to_not_convert"] == qc["ignored_layers"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    hf = transformers.FineGrainedFP8Config.from_dict(dict(qc))
    assert hf.quant_method == "fp8" and list(hf.weight_block_size) == [128, 128]
    assert (hf.activation_scheme == "dynamic"
            and hf.modules_to_not_convert == ["lm_head", "model.layers.0.mlp.down_proj"])
    # vLLM Fp8Config.from_config: "fp8" in quant_method; block quant needs dynamic activations and 2 dims.
    assert "fp8" in qc["quant_method"] and len(qc["weight_block_size"]) == 2


@pytest.mark.parametrize("hidden,intermediate", [(256, 384), (192, 320)])
def test_export_tensors_are_training_codes(tmp_path, hidden, intermediate):
    model, cfg = tiny_llama(hidden, intermediate)
    quantize_model(model, Fp8Config())
    out = export_fp8_checkpoint(model, tmp_path, config_dict=cfg.to_dict())
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["modules_to_not_convert"] == ["lm_head"] and config["dtype"] == "bfloat16"
    assert config["hidden_size"] == hidden and config["model_type"] == "llama"

    fp8_names = [n for n, m in model.named_modules() if isinstance(m, FP8BlockLinear)]
    assert len(fp8_names) == 14  # 7 projections x 2 layers; lm_head stays BF16
    for name in fp8_names:
        module = model.get_submodule(name)
        q_train, s_train, _ = module.quantized_weight()  # what the training forward multiplies with
        q, s = tensors[f"{name}.weight"], tensors[f"{name}.{SCALE_NAME}"]
        assert q.dtype == FP8 and s.dtype == torch.float32
        assert q.shape == module.weight.shape and s.shape == (cdiv(q.shape[0], 128), cdiv(q.shape[1], 128))
        assert torch.equal(q.view(torch.uint8), q_train.view(torch.uint8)) and torch.equal(s, s_train)
    others = {k: v for k, v in tensors.items() if not any(k.startswith(n + ".") for n in fp8_names)}
    assert set(others) == {n for n, _ in model.named_parameters()} - {f"{n}.weight" for n in fp8_names}
    for key, value in others.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, model.get_parameter(key).detach().bfloat16())


def test_pow2_scales_follow_the_layer_config(tmp_path):
    model, _ = tiny_llama(256, 384)
    quantize_model(model, Fp8Config(power_of_two_scales=True))
    tensors = fp8_state_dict(model)
    s = tensors[f"model.layers.0.mlp.up_proj.{SCALE_NAME}"]
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # every scale an exact power of two
    q_ref, s_ref = quantize_128x128(model.get_parameter("model.layers.0.mlp.up_proj.weight"), pow2=True)
    assert torch.equal(s, s_ref) and torch.equal(tensors["model.layers.0.mlp.up_proj.weight"].view(torch.uint8),
                                                 q_ref.view(torch.uint8))


CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="transformers dequantizes block-FP8 checkpoints on load only where CUDA is absent; the GPU load is "
    "checked against calclip's codes by benchmarks/check_export_gpu.py",
)


@CPU_ONLY
def test_transformers_loader_dequantizes_exactly_on_cpu(tmp_path):
    """transformers' own block-FP8 loader (CPU falls back to dequantize=True) == calclip's dequantization."""
    model, cfg = tiny_llama(256, 384, tie=True)
    quantize_model(model, Fp8Config())
    out = export_fp8_checkpoint(model, tmp_path, config_dict=cfg.to_dict())
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))  # tied: written once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    params = dict(loaded.named_parameters())
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, FP8BlockLinear):
            q, s, _ = module.quantized_weight()
            assert torch.equal(params[f"{name}.weight"], dequantize_128x128(q, s)), name
            checked += 1
    assert checked == 14
    assert torch.equal(params["model.embed_tokens.weight"], model.model.embed_tokens.weight.bfloat16().float())
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@CPU_ONLY
def test_ragged_blocks_transformers_cpu_dequantizer_refuses_but_its_block_dequant_matches(tmp_path):
    """transformers 5.24's CPU path infers block = rows // scale_rows, so ragged grids (320 rows, 3 scale rows)
    fail to load; its block-aware helper ``_dequantize_fp8_weight`` (the FP8Linear backward path) takes the
    block size explicitly and must agree with calclip exactly on the exported ragged tensors."""
    finegrained_fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(finegrained_fp8, "_dequantize_fp8_weight"):  # added after transformers 5.17
        pytest.skip(f"transformers {transformers.__version__} has no _dequantize_fp8_weight")
    _dequantize_fp8_weight = finegrained_fp8._dequantize_fp8_weight

    model, cfg = tiny_llama(192, 320)
    quantize_model(model, Fp8Config())
    out = export_fp8_checkpoint(model, tmp_path, config_dict=cfg.to_dict())
    with pytest.raises((ValueError, RuntimeError)):
        transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    for name in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        q, s = tensors[f"{name}.weight"], tensors[f"{name}.{SCALE_NAME}"]
        theirs = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
        assert torch.equal(theirs, dequantize_128x128(q, s)), name


def test_sync_tensors_match_vllm_block_fp8_registration():
    model, _ = tiny_llama(256, 384, tie=True)
    quantize_model(model, Fp8Config())
    expected = expected_vllm_spec(model)
    got = {}
    for name, tensor in fp8_weight_sync_tensors(model):
        assert name not in got, f"{name} sent twice"
        got[name] = (tensor.dtype, tuple(tensor.shape))
    assert {k: v for k, v in got.items() if k in expected} == expected
    rest = set(got) - set(expected)
    # everything else is an ordinary parameter, sent unchanged; tied lm_head once (named_parameters dedups)
    assert rest == {n for n, _ in model.named_parameters()} - set(expected)
    assert all(got[n][0] == torch.float32 for n in rest)


def test_sync_stream_strips_wrapper_prefixes_and_refuses_nonfinite_weights():
    model, _ = tiny_llama(256, 384)
    quantize_model(model, Fp8Config())
    specs = fp8_weight_specs(model)
    from calclip.fp8.export import quantize_named_params

    w = model.get_parameter("model.layers.0.self_attn.o_proj.weight").data
    out = dict(quantize_named_params([("model.layers.0._checkpoint_wrapped_module.self_attn.o_proj.weight", w)],
                                     {"model.layers.0.self_attn.o_proj": specs["model.layers.0.self_attn.o_proj"]}))
    assert set(out) == {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv"}
    bad = w.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        list(quantize_named_params([("x.weight", bad)], {"x": specs["model.layers.0.self_attn.o_proj"]}))


def test_vllm_shape_rules_flag_ragged_models_and_mixed_fused_layers():
    aligned, _ = tiny_llama(256, 384)
    quantize_model(aligned, Fp8Config())
    assert vllm_block_fp8_problems(linear_shapes(aligned)) == {}
    ragged, _ = tiny_llama(192, 320)
    quantize_model(ragged, Fp8Config())
    problems = vllm_block_fp8_problems(linear_shapes(ragged))
    # K=192 everywhere except down_proj (K=320): every projection is flagged
    assert set(problems) == set(linear_shapes(ragged))
    assert "K=192" in problems["model.layers.0.self_attn.o_proj"]
    assert "fused qkv_proj" in problems["model.layers.0.self_attn.k_proj"]
    # keep only q_proj in BF16: k/v now sit in a mixed fused layer
    shapes = {n: s for n, s in linear_shapes(aligned).items() if not n.endswith("q_proj")}
    mixed = vllm_block_fp8_problems(shapes)
    assert set(mixed) == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "v_proj")}
    patterns = vllm_keep_patterns(mixed)
    assert r"^model\.layers\.0\.self_attn\.q_proj$" in patterns and len(patterns) == 6
    assert vllm_block_fp8_problems({"a.k_proj": (256, 256)}, tp_size=4)  # 256/4 = 64 per rank


def test_export_refuses_a_model_without_fp8_layers(tmp_path):
    model, cfg = tiny_llama(256, 384)
    with pytest.raises(ValueError, match="quantize_model"):
        export_fp8_checkpoint(model, tmp_path, config_dict=cfg.to_dict())
    assert not isinstance(model.lm_head, FP8BlockLinear) and isinstance(model.lm_head, nn.Linear)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers' CUDA refresh kernels")
def test_live_sync_codes_are_the_reference_codes_and_leave_the_next_step_nothing_to_quantize_on_cuda(monkeypatch):
    """On CUDA the layers' own codes come from the Triton refresh kernels (sibling groups' stacked buffers
    included): after AdamW steps the live stream sends the reference quantizer's bits, and the next training step
    quantizes no weight before its optimizer step."""
    from tests.fp8._quant_calls import count_weight_quantizations

    model, _ = tiny_llama(256, 384)
    model = quantize_model(model.to("cuda", torch.bfloat16).train(), Fp8Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 320, (2, 64), device="cuda")
    for _ in range(2):
        model(ids).logits.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    live = dict(fp8_weight_sync_tensors(model, live_codes=True))
    reference = dict(fp8_weight_sync_tensors(model))
    assert live.keys() == reference.keys()
    for name, tensor in reference.items():
        got = live[name]
        if tensor.dtype == FP8:
            got, tensor = got.view(torch.uint8), tensor.view(torch.uint8)
        assert torch.equal(got, tensor), name
    calls = count_weight_quantizations(monkeypatch)
    model(ids).logits.float().pow(2).mean().backward()
    assert calls == []
