"""calclip's FP8 weight-sync stream through vLLM's REAL loaders and layerwise reload, on a CPU (no GPU, no engine).

    PYTHONPATH=<vllm 0.24 site>:<deps> python benchmarks/probe_vllm_reload_cpu.py [--shape S]

<vllm 0.24 site>: a folder holding the vllm 0.24.0 wheel's ``vllm/`` (the GPU bundle's copy works; its CUDA
libraries are never loaded); <deps>: ``pip install --no-deps --target <deps>`` aiohappyeyeballs aiohttp aiosignal
attrs cachetools cbor2 cloudpickle compressed-tensors frozenlist loguru msgspec multidict openai openai-harmony
prometheus-client propcache pybase64 pyzmq uvloop yarl (what ``import vllm.engine.arg_utils`` needs beyond
calclip's environment; pydantic is already there).

Builds vLLM's own LlamaForCausalLM with its Fp8Config (block 128x128, the ``quantization_config`` calclip's trainer
puts in ``hf_overrides``), loads calclip's checkpoint-format stream (``fp8_weight_sync_tensors``), then reloads it
three times after perturbing the policy, exactly as ``FP8VLLMGenerationMixin`` does in colocate mode
(``initialize_layerwise_reload``, per-tensor ``model.load_weights``, ``finalize_layerwise_reload``). After each
load it checks that every fused qkv_proj / gate_up_proj weight and weight_scale_inv equals the concatenated shard
codes/scales calclip sent, every other tensor equals its source, and no parameter or buffer changed storage,
dtype or shape (what keeps CUDA graphs valid).

What is patched, and why: vLLM's CPU platform is selected by hand (the GPU wheel reports none on a CPU), and the
block-FP8 kernel class is CutlassFp8BlockScaledMMKernel with its CUDA-capability check bypassed (vLLM's CPU kernel
needs AMX). Nothing runs a GEMM; the loading and post-processing code is the CUDA path's (the CUTLASS kernel's
process_weights_after_loading keeps weight and weight_scale_inv as they are on NVIDIA GPUs).

``--direct N``: then calclip's direct sync (``calclip.rollout.vllm_direct_sync``) against this real model: its
layout check after the reloads, and N steps of in-place copies, each compared byte for byte with what vLLM's
layerwise reload writes for the same weights.

Shapes: ``llama`` (h256, 4 heads of 64, 2 kv heads: every shard whole blocks), ``straddle`` (h384, 6 heads, 3 kv
heads: q/k/v 384/192/192), ``smollm2`` (SmolLM2-135M's h576, 9 heads, 3 kv heads, i1536).

Seen 2026-12-02 with the vLLM 0.24.0 wheel's Python files, torch 2.13 CPU:
  llama:    initial load and 3 reloads: 0 mismatching tensors, 0 tensors moved (RotaryEmbedding logs "Failed to
            load weights": its cos/sin cache is not in a checkpoint; the layerwise reload puts it back unchanged)
  straddle: vLLM builds the layer (its block-shape check is skipped for fused layers with a ragged shard), then
            the scale loader fails: "start (5) + length (2) exceeds dimension size (6)"
  smollm2:  loads without an error, but qkv_proj.weight_scale_inv has 8 rows where the shards sent 9: a
            scale row is overwritten (calclip refuses these layers: vllm_block_fp8_problems)
Seen 2026-12-02 (fourteenth session) with ``--reloads 1 --direct 2``:
  llama:    DirectSync verified; 2 steps of 35 in-place copies each, byte for byte what vLLM's reload then wrote
            for the same weights; no tensor moved
  smollm2:  DirectSync refused: "model.layers.0.self_attn.k_proj.weight_scale_inv -> ...qkv_proj.weight_scale_inv:
            the engine holds other values than the ones just synced" (the overwritten scale row above)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

SHAPES = {  # hidden, intermediate, heads, kv heads (head_dim 64)
    "llama": (256, 384, 4, 2),
    "straddle": (384, 384, 6, 3),
    "smollm2": (576, 1536, 9, 3),
}


def select_cpu_platform():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    import vllm.model_executor.kernels.linear as kernels
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import CutlassFp8BlockScaledMMKernel
    from vllm.platforms.interface import PlatformEnum

    CutlassFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] = [CutlassFp8BlockScaledMMKernel]


def build_policy(shape: str, out_dir: str):
    import transformers

    from calclip.fp8 import Fp8Config, quantize_model
    from calclip.rollout.vllm_sync import fp8_quantization_config

    hidden, inter, heads, kv = SHAPES[shape]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=64,
                                   max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    hf.save_pretrained(out_dir)
    policy = quantize_model(hf, Fp8Config())
    config = json.loads(Path(out_dir, "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config(policy)
    Path(out_dir, "config.json").write_text(json.dumps(config))
    return cfg, policy


def build_vllm_model(model_dir: str):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.network_utils import get_open_port

    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                      max_model_len=64, enforce_eager=True, quantization="fp8")
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cpu"):
                model = initialize_model(vllm_config)  # records the reload metadata, as vLLM's loader does
        finally:
            torch.set_default_dtype(torch.float32)
    return vllm_config, model


def layer_tensors(model) -> dict[str, tuple]:
    out = {}
    for module_name, module in model.named_modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                out[f"{module_name}.{name}"] = (t.data_ptr(), t.dtype, tuple(t.shape))
    return out


def mismatches(cfg, model, policy) -> list[str]:
    from calclip.fp8.export import fp8_weight_sync_tensors

    params = dict(model.named_parameters())
    sent = dict(fp8_weight_sync_tensors(policy))
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",)}
    bad = []
    for i in range(cfg.num_hidden_layers):
        for target, shards in fused.items():
            for leaf in ("weight", "weight_scale_inv"):
                want = torch.cat([sent[f"model.layers.{i}.{s}.{leaf}"] for s in shards])
                got = params[f"model.layers.{i}.{target}.{leaf}"].data
                if leaf == "weight":
                    got, want = got.view(torch.uint8), want.view(torch.uint8)
                if got.shape != want.shape or not torch.equal(got, want):
                    bad.append(f"model.layers.{i}.{target}.{leaf}: engine {tuple(got.shape)}, sent {tuple(want.shape)}")
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        if not torch.equal(params[name].data, sent[name].to(params[name].dtype)):
            bad.append(name)
    return bad


def engine_bits(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter's bytes (FP8 codes as uint8), to compare two ways of loading the same weights."""
    return {n: (p.data.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.data).clone()
            for n, p in model.named_parameters()}


def check_direct_sync(cfg, model, vllm_config, policy, steps: int, label: str) -> None:
    """calclip's direct sync against vLLM's real model: ``DirectSync.verify`` after a reload; then, per step, the
    in-place copies of a perturbed policy, compared byte for byte with what vLLM's layerwise reload writes for the
    same weights, and no parameter moved."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from calclip.fp8.export import LLAMA_PACKED_MODULES, fp8_weight_sync_tensors
    from calclip.rollout.vllm_direct_sync import DirectSync

    direct = DirectSync(LLAMA_PACKED_MODULES)
    ok = direct.verify(dict(model.named_parameters()), fp8_weight_sync_tensors(policy))
    print(f"{label} direct sync check after the reload: verified {ok}; reason {direct.reason}")
    if not ok:
        return
    before = layer_tensors(model)
    for step in range(steps):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        count = direct.copy(dict(model.named_parameters()), fp8_weight_sync_tensors(policy))
        copied = engine_bits(model)
        initialize_layerwise_reload(model)
        for name, tensor in fp8_weight_sync_tensors(policy):
            model.load_weights([(name, tensor)])
        finalize_layerwise_reload(model, vllm_config.model_config)
        reloaded = engine_bits(model)
        differ = [n for n in copied if not torch.equal(copied[n], reloaded[n])]
        moved = [k for k in before if before[k] != layer_tensors(model).get(k)]
        print(f"{label} direct step {step}: {count} tensors copied; differ from vLLM's reload {differ}; "
              f"mismatching {mismatches(cfg, model, policy)}; moved/changed {moved}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--direct", type=int, default=0, metavar="STEPS",
                        help="then check calclip's direct sync (DirectSync) on this model for STEPS steps")
    opts = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    select_cpu_platform()
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from calclip.fp8.export import fp8_weight_sync_tensors

    model_dir = tempfile.mkdtemp()
    cfg, policy = build_policy(opts.shape, model_dir)
    vllm_config, model = build_vllm_model(model_dir)
    model.load_weights(fp8_weight_sync_tensors(policy))  # the first load: a checkpoint load
    process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    before = layer_tensors(model)
    print(f"{opts.shape} initial load: mismatching {mismatches(cfg, model, policy)}")
    for step in range(opts.reloads):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 1e-2)  # an optimizer step's worth of change
        initialize_layerwise_reload(model)
        for name, tensor in fp8_weight_sync_tensors(policy):
            model.load_weights([(name, tensor)])
        finalize_layerwise_reload(model, vllm_config.model_config)
        after = layer_tensors(model)
        moved = [k for k in before if before[k] != after.get(k)]
        print(f"{opts.shape} reload {step}: mismatching {mismatches(cfg, model, policy)}; moved/changed {moved}")
    if opts.direct:
        check_direct_sync(cfg, model, vllm_config, policy, opts.direct, opts.shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
