"""calclip's FP8 weight-sync stream through vLLM's REAL loaders and layerwise reload, on a CPU (no GPU, no engine).

    SITE=$(bash benchmarks/vllm_cpu_site.sh .vllm-cpu | tail -n 1)
    PYTHONPATH=$SITE python benchmarks/probe_vllm_reload_cpu.py [--recipe R] [--shape S]

benchmarks/vllm_cpu_site.sh puts on that path the vllm 0.24.0 wheel's Python files (its CUDA libraries are left out
and never loaded) and the pinned packages ``import vllm.engine.arg_utils`` and the FP8 loaders need beyond calclip's
environment (compressed-tensors 0.17.0, the version vLLM 0.24.0 pins; pydantic is already there). Rowwise and
tensorwise need torchao (calclip's test extra). Exit status 1 when any check below failed.

Builds vLLM's own LlamaForCausalLM with the FP8 arguments calclip's trainer gives its colocated engine
(``fp8_engine_kwargs``: ``quantization`` plus ``hf_overrides={"quantization_config": ...}``, dummy weights; and
``linear_backend="cutlass"`` from ``fp8_engine_numerics_kwargs``): ``--recipe block`` is Fp8Config with 128x128
blocks, ``rowwise`` / ``tensorwise`` (torchao's recipes) compressed-tensors with static per-channel FP8 weights and
dynamic activations. Loads calclip's checkpoint-format stream (``fp8_weight_sync_tensors``), then reloads it
``--reloads`` times after perturbing the policy, exactly as ``FP8VLLMGenerationMixin`` does in colocate mode
(``initialize_layerwise_reload``, per-tensor ``model.load_weights``, ``finalize_layerwise_reload``). After each load
it checks every engine parameter, independently of calclip's own checks: each fused qkv_proj / gate_up_proj and
unfused o_proj / down_proj ``weight`` and scale (``weight_scale_inv`` blocks; ``weight_scale`` [N, 1]) equals the
concatenated shard codes/scales calclip sent, byte for byte (per-channel ``weight`` read through the transpose vLLM
keeps, its strides checked); a BF16-kept layer (``--keep``) equals its shards; every other parameter equals its
source; the attention's KV-cache scales (nothing sends them) stay 1.0; no parameter or buffer changed storage,
dtype, shape or strides (what keeps CUDA graphs valid). The policy's rows are spread over about two octaves first,
so tensorwise's q/k/v shards carry different scales (printed), the case vLLM's per-tensor path re-quantizes.

What is patched, and why: vLLM's CPU platform is selected by hand (the GPU wheel reports none on a CPU), and the FP8
kernel classes vLLM 0.24 picks on a Hopper GPU replace the CPU lists, with their ``is_supported`` (CUDA /
capability check) returning True: ``CutlassFp8BlockScaledMMKernel`` for block (``_POSSIBLE_FP8_BLOCK_KERNELS``),
``CutlassFP8ScaledMMLinearKernel`` for per-channel (``_POSSIBLE_FP8_KERNELS``; on CUDA its list is Marlin,
FlashInfer, CUTLASS: Marlin refuses capability >= 89, FlashInfer < 100 and per-channel scales, and
``linear_backend="cutlass"`` leaves only CUTLASS anyway). Nothing else: no GEMM runs; the loaders, the
quantization methods' ``process_weights_after_loading`` and the reload are the CUDA path's code. (The CPU
capability is None, which compressed-tensors' scheme check accepts, as capability 9.0 would for
``CompressedTensorsW8A8Fp8``'s minimum 8.9.)

``--from-export``: the engine starts from calclip's exported checkpoint (``export_fp8_checkpoint``), read by vLLM's own
safetensors loader, instead of dummy weights and a first sync; the checks are the same.

``--direct N``: then calclip's direct sync (``calclip.rollout.vllm_direct_sync``) against this real model: its
layout check after the reloads, and N steps of in-place copies, each compared with what was sent and then byte for
byte with what vLLM's layerwise reload writes for the same weights. ``--engine-weights tensor`` (rowwise /
tensorwise): an engine whose checkpoint says per-tensor weights (not calclip's), to see vLLM's answer to calclip's
per-channel stream.

Shapes: ``llama`` (h256, 4 heads of 64, 2 kv heads: every shard whole blocks), ``straddle`` (h384, 6 heads, 3 kv
heads: q/k/v 384/192/192), ``smollm2`` (SmolLM2-135M's h576, 9 heads, 3 kv heads, i1536).

Seen 2026-12-02 with the vLLM 0.24.0 wheel's Python files, torch 2.13 CPU (block):
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
Seen 2026-12-05 (this version: trainer's engine arguments, every parameter checked, rows spread), torch 2.13 CPU,
compressed-tensors 0.17.0:
  block, ``--reloads 1 --direct 2``: llama all held (0 mismatching, 0 moved, DirectSync verified, 2 x 35 copies
            equal to vLLM's reload); straddle the same narrow() error; smollm2 the same 8-of-9 scale rows and the
            same DirectSync refusal: the 2026-12-02 results, unchanged.
  rowwise and tensorwise, each of llama / straddle / smollm2, ``--reloads 3 --direct 2``: vLLM builds every FP8
            linear as CompressedTensorsLinearMethod / CompressedTensorsW8A8Fp8 / CutlassFP8ScaledMMLinearKernel;
            before loading qkv_proj holds weight e4m3 [N, K] strides (K, 1) and weight_scale fp32 [N, 1]; after
            ``process_weights_after_loading`` weight is [K, N] strides (1, K) (the same storage transposed, no
            padding: every dim a multiple of 16), weight_scale unchanged, no input_scale. Initial load and 3
            reloads: 0 mismatching tensors, 0 moved; DirectSync verified; 2 steps of 35 in-place copies, equal to
            what was sent and byte for byte to vLLM's reload after them; 0 moved: all held, all six. Tensorwise's
            q/k/v scales differed (llama 8.109e-4 / 7.019e-4 / 7.804e-4) and were held as sent: no re-quantization.
            Activations, both recipes: the kernel's key is f8e4m3fn dynamic per_token (tensorwise's per-tensor
            "strategy" is not read: TENSORWISE_ACTIVATION_NOTE); block's is dynamic 1x128 groups.
  rowwise and tensorwise, smollm2 ``--tie`` (SmolLM2's tied head), ``--reloads 2 --direct 2``: all held (34 copies
            per direct step: the tied head is sent once, as embed_tokens; vLLM lists no separate lm_head.weight).
            block smollm2 ``--tie``: the same 8-of-9 scale rows and DirectSync refusal as untied.
  ``--from-export`` (calclip's export_fp8_checkpoint read by vLLM's own safetensors loader, engine arguments
            ``fp8_engine_kwargs(export_dir=...)``, which also passed calclip's export_dir format check), llama
            ``--reloads 1 --direct 1``: block, rowwise, tensorwise all held; smollm2 ``--tie`` rowwise and
            tensorwise all held: the export holds the sync's codes and scales byte for byte.
  rowwise and block, llama ``--keep layers.1.mlp --keep layers.0.self_attn``: the kept layers are
            UnquantizedLinearMethod with their BF16 shards; all held (28 copies per direct step).
  tensorwise ``--engine-weights tensor``: vLLM's per-tensor weight_scale is one value per shard ([3] for qkv_proj);
            loading calclip's [N, 1] shard scale fails in PerTensorScaleParameter._load_into_shard_id with a bare
            ``AssertionError`` (``loaded_weight.shape[0] == 1``). Sending one scale per shard instead (an ad-hoc
            variant of this probe) loads, and then ``process_weights_after_loading`` calls
            ``requantize_with_max_scale`` (which on CPU stops at the missing CUDA op ``static_scaled_fp8_quant``; on
            a GPU it re-quantizes k and v to q's larger scale).
"""

from __future__ import annotations

import argparse
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
# The attention layer's FP8 KV-cache / query scales, registered by both quantization configs' KV-cache methods; no
# checkpoint of calclip carries them (no FP8 KV cache unless asked: vllm_kv_cache_dtype), so they stay at 1.0.
KV_SCALES = ("_q_scale", "_k_scale", "_v_scale", "_prob_scale")
KV_PLACEHOLDERS = ("q_scale", "k_scale", "v_scale", "prob_scale")  # BaseKVCacheMethod's checkpoint slots
RECIPES = {"block": "blockwise", "rowwise": "rowwise", "tensorwise": "tensorwise"}  # --recipe -> Fp8Config.recipe
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",)}


def select_cpu_platform():
    """vLLM's CPU platform, with the CUDA path's FP8 kernel classes put in its kernel lists: on a Hopper GPU vLLM
    0.24 picks CutlassFp8BlockScaledMMKernel (block, under linear_backend "cutlass") and
    CutlassFP8ScaledMMLinearKernel (per-channel: Marlin refuses capability >= 89, FlashInfer < 100). Only their
    ``is_supported`` (which asks for CUDA / a capability) is replaced; their ``process_weights_after_loading`` runs."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    import vllm.model_executor.kernels.linear as kernels
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassFp8BlockScaledMMKernel,
        CutlassFP8ScaledMMLinearKernel,
    )
    from vllm.platforms.interface import PlatformEnum

    supported = classmethod(lambda cls, compute_capability=None: (True, None))
    CutlassFp8BlockScaledMMKernel.is_supported = supported
    CutlassFP8ScaledMMLinearKernel.is_supported = supported
    kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] = [CutlassFp8BlockScaledMMKernel]
    kernels._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU] = [CutlassFP8ScaledMMLinearKernel]


def build_policy(shape: str, out_dir: str, recipe: str = "block", keep: tuple[str, ...] = (), tie: bool = False):
    """A tiny BF16 Llama of ``shape`` saved to ``out_dir`` (config only matters: the engine starts from dummy
    weights, as the trainer's does) and quantized by calclip with ``recipe``. Every linear's rows are spread over
    about two octaves first, so per-row scales differ within a layer and per-tensor scales between the shards of a
    fused layer (what would make vLLM's per-tensor path re-quantize)."""
    import transformers

    from calclip.fp8 import Fp8Config, quantize_model

    hidden, inter, heads, kv = SHAPES[shape]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=64,
                                   max_position_embeddings=64, tie_word_embeddings=tie)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(torch.exp(0.7 * torch.randn(p.shape[0], 1)).to(p.dtype))
    hf.save_pretrained(out_dir)
    policy = quantize_model(hf, Fp8Config(recipe=RECIPES[recipe], keep_patterns=("lm_head", *keep)))
    return cfg, policy


def engine_kwargs(policy) -> dict:
    """The FP8 arguments CalibratedGRPOTrainer's colocated engine gets (``fp8_engine_kwargs``: quantization,
    ``hf_overrides={"quantization_config": ...}``, load_format "dummy"), plus its linear_backend."""
    from calclip.rollout.vllm_sync import fp8_engine_kwargs, fp8_engine_numerics_kwargs

    return {**fp8_engine_kwargs(policy), "linear_backend": fp8_engine_numerics_kwargs()["linear_backend"]}


def build_vllm_model(model_dir: str, kwargs: dict):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.network_utils import get_open_port

    args = EngineArgs(**{"model": model_dir, **kwargs}, skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=64, enforce_eager=True)
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
    """Every parameter and buffer: storage address, dtype, shape and strides (a CUDA graph reads all four)."""
    out = {}
    for module_name, module in model.named_modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                out[f"{module_name}.{name}"] = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
    return out


def scale_leaf(recipe: str) -> str:
    return "weight_scale_inv" if recipe == "block" else "weight_scale"


def mismatches(cfg, model, policy, recipe: str = "block") -> list[str]:
    """Every engine parameter against what calclip sent, independently of calclip's own checks: a fused layer's
    codes and scale are its shards' concatenated in vLLM's order; block keeps ``weight`` [N, K], per-channel
    (vLLM's CompressedTensorsW8A8Fp8, strategy channel) holds ``weight`` as the [K, N] transpose of the loaded
    row-major [N, K] storage (vLLM 0.24 source), so its codes are read through ``.t()`` and its strides checked;
    every other parameter equals the sent tensor under its own name. A parameter nothing was sent for is listed."""
    from calclip.fp8.export import fp8_weight_sync_tensors

    params = dict(model.named_parameters())
    sent = dict(fp8_weight_sync_tensors(policy))
    bad, checked = [], set()
    for i in range(cfg.num_hidden_layers):
        for target, shards in FUSED.items():
            fp8 = f"model.layers.{i}.{shards[0]}.{scale_leaf(recipe)}" in sent  # else kept in BF16 (--keep)
            for leaf in ("weight", scale_leaf(recipe)) if fp8 else ("weight",):
                name = f"model.layers.{i}.{target}.{leaf}"
                want = torch.cat([sent[f"model.layers.{i}.{s}.{leaf}"] for s in shards])
                checked.add(name)
                if name not in params:
                    bad.append(f"{name}: not in the engine")
                    continue
                got = params[name].data
                if not fp8:
                    want = want.to(got.dtype)
                elif leaf == "weight":
                    if recipe != "block":
                        n, k = want.shape
                        if got.shape != (k, n) or got.stride() != (1, k):
                            bad.append(f"{name}: engine {tuple(got.shape)} strides {got.stride()}, expected the "
                                       f"transpose of a row-major {(n, k)}")
                            continue
                        got = got.t()
                    got, want = got.view(torch.uint8), want.view(torch.uint8)
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                    bad.append(f"{name}: engine {got.dtype} {tuple(got.shape)}, sent {want.dtype} {tuple(want.shape)}"
                               + ("" if got.shape != want.shape else " (other values)"))
    for name, p in params.items():
        if name in checked:
            continue
        leaf = name.rpartition(".")[2]
        if leaf in KV_SCALES and name not in sent:  # nothing sends KV-cache scales: must be 1.0
            if not bool((p.data == 1.0).all()):
                bad.append(f"{name}: {p.data.tolist()} where 1.0 (nothing sent) was expected")
            continue
        if leaf in KV_PLACEHOLDERS and name not in sent:  # the loader's slots; the layer reads the _-scales above
            continue
        if name not in sent:
            bad.append(f"{name}: engine parameter that nothing was sent for ({p.dtype} {tuple(p.shape)})")
        elif p.shape != sent[name].shape or not torch.equal(p.data, sent[name].to(p.dtype)):
            bad.append(name)
    return bad


def engine_bits(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter's bytes (FP8 codes as uint8), to compare two ways of loading the same weights."""
    return {n: (p.data.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.data).clone()
            for n, p in model.named_parameters()}


def reload(model, vllm_config, policy) -> None:
    """One sync through vLLM's layerwise reload, tensor by tensor, as FP8VLLMGenerationMixin does in colocate
    (calclip's ``reload_weights_layerwise``: vLLM's initialize / load_weights / finalize, then an FP8 KV cache's
    scales set to 1.0)."""
    from calclip.fp8.export import fp8_weight_sync_tensors
    from calclip.rollout.vllm_sync import reload_weights_layerwise

    reload_weights_layerwise(model, vllm_config.model_config, fp8_weight_sync_tensors(policy))


def kv_scale_problems(model) -> list[str]:
    """Every attention layer with a quantized KV cache whose scales (the tensors its kernels read, and their host
    copies) are not 1.0: calclip's engines carry no KV-cache scale, so 1.0 is what they must run."""
    bad = []
    for name, module in model.named_modules():
        if not str(getattr(module, "kv_cache_dtype", "auto")).startswith("fp8"):
            continue
        for attr in KV_SCALES:
            value = getattr(module, attr, None)
            if isinstance(value, torch.Tensor) and not bool((value == 1.0).all()):
                bad.append(f"{name}.{attr}: {value.detach().flatten()[:2].tolist()} where 1.0 was expected")
            host = getattr(module, attr + "_float", None)
            if isinstance(host, float) and host != 1.0:
                bad.append(f"{name}.{attr}_float: {host} where 1.0 was expected")
    return bad


def kv_scales(model) -> str:
    """The first attention layer's KV-cache scales (tensor, host copy), for the log."""
    for name, module in model.named_modules():
        if hasattr(module, "kv_cache_dtype") and hasattr(module, "_k_scale"):
            return (f"{name} kv_cache_dtype {module.kv_cache_dtype}: _k_scale {float(module._k_scale.detach()):.6g} "
                    f"(host {getattr(module, '_k_scale_float', None)}), _v_scale {float(module._v_scale.detach()):.6g}")
    return "no attention layer with KV-cache scales"


def perturb(policy) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 1e-2)  # an optimizer step's worth of change


def check_direct_sync(cfg, model, vllm_config, policy, steps: int, label: str, recipe: str = "block") -> bool:
    """calclip's direct sync against vLLM's real model: ``DirectSync.verify`` after a reload; then, per step, the
    in-place copies of a perturbed policy, compared byte for byte with what vLLM's layerwise reload writes for the
    same weights, and no parameter moved. Returns whether all of it held."""
    from calclip.fp8.export import LLAMA_PACKED_MODULES, fp8_weight_sync_tensors
    from calclip.rollout.vllm_direct_sync import DirectSync
    from calclip.rollout.vllm_sync import engine_fp8_mismatches

    direct = DirectSync(LLAMA_PACKED_MODULES)
    ok = direct.verify(dict(model.named_parameters()), fp8_weight_sync_tensors(policy))
    print(f"{label} direct sync check after the reload: verified {ok}; reason {direct.reason}; "
          f"engine_fp8_mismatches {engine_fp8_mismatches(model, policy)}")
    if not ok:
        return False
    before = layer_tensors(model)
    for step in range(steps):
        perturb(policy)
        count = direct.copy(dict(model.named_parameters()), fp8_weight_sync_tensors(policy))
        copied = engine_bits(model)
        wrong = mismatches(cfg, model, policy, recipe)
        reload(model, vllm_config, policy)
        reloaded = engine_bits(model)
        differ = [n for n in copied if not torch.equal(copied[n], reloaded[n])]
        moved = [k for k in before if before[k] != layer_tensors(model).get(k)]
        after = mismatches(cfg, model, policy, recipe)
        print(f"{label} direct step {step}: {count} tensors copied; mismatching after the copies {wrong}; differ "
              f"from vLLM's reload {differ}; mismatching after the reload {after}; moved/changed {moved}")
        ok = ok and not (wrong or differ or after or moved)
    return ok


def describe_layers(model, recipe: str) -> str:
    """The quantization method / scheme and FP8 kernel class of one fused layer, and its parameters' layout."""
    layer = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    method = layer.quant_method
    scheme = getattr(layer, "scheme", None)
    kernel = getattr(scheme or method, "fp8_linear", None) or getattr(method, "w8a8_block_fp8_linear", None)
    parts = [type(method).__name__, type(scheme).__name__ if scheme is not None else "-",
             type(kernel).__name__ if kernel is not None else "-"]
    config = getattr(kernel, "config", None)
    if config is not None and hasattr(config, "activation_quant_key"):  # how the engine quantizes activations
        parts.append(f"activations {config.activation_quant_key}")
    layout = {n: (str(p.dtype).removeprefix("torch."), tuple(p.shape), p.stride()) for n, p in layer.named_parameters()}
    return f"{recipe} qkv_proj: {' / '.join(parts)}; {layout}"


def shard_scales(policy, recipe: str) -> str:
    """The distinct dequantization scales calclip sends for layer 0's q/k/v shards (tensorwise: one per shard; the
    shards differ, which vLLM's per-tensor path would re-quantize to the largest)."""
    from calclip.fp8.export import fp8_weight_sync_tensors

    sent = dict(fp8_weight_sync_tensors(policy))
    parts = []
    for shard in ("q_proj", "k_proj", "v_proj"):
        scale = sent.get(f"model.layers.0.self_attn.{shard}.{scale_leaf(recipe)}")
        if scale is not None:
            values = torch.unique(scale)
            parts.append(f"{shard} {len(values)} distinct in [{values.min().item():.4g}, {values.max().item():.4g}]")
    return f"{recipe} layer 0 q/k/v scales sent: {'; '.join(parts) or 'none (BF16)'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="block",
                        help="calclip's FP8 recipe: block (block-FP8, Fp8Config), rowwise / tensorwise (torchao's, "
                             "compressed-tensors per channel)")
    parser.add_argument("--keep", action="append", default=[], metavar="REGEX",
                        help="also keep these linears in BF16 (Fp8Config.keep_patterns; lm_head always is)")
    parser.add_argument("--engine-weights", choices=["channel", "tensor"], default="channel",
                        help="rowwise / tensorwise: the weight strategy of the engine's quantization_config; "
                             "'tensor' builds a per-tensor engine (a checkpoint calclip did not write) to see what "
                             "vLLM does with calclip's per-channel stream there")
    parser.add_argument("--tie", action="store_true",
                        help="tie lm_head to the embeddings (SmolLM2 does): vLLM then loads no lm_head.weight")
    parser.add_argument("--from-export", action="store_true",
                        help="start the engine from calclip's exported checkpoint (export_fp8_checkpoint, "
                             "fp8_engine_kwargs(export_dir=...)) read by vLLM's own safetensors loader, instead of "
                             "dummy weights and a first sync")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the engine's KV cache (the trainer's vllm_kv_cache_dtype), e.g. fp8: every attention "
                             "layer's KV-cache scales are then checked to be 1.0 after each load")
    parser.add_argument("--dummy-start", action="store_true",
                        help="start the engine as the trainer's does: vLLM's dummy loader fills every weight (the "
                             "attention's KV-cache scale placeholders included) and post-processes them, then the "
                             "first sync is a layerwise reload")
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--direct", type=int, default=0, metavar="STEPS",
                        help="then check calclip's direct sync (DirectSync) on this model for STEPS steps")
    opts = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    select_cpu_platform()
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from calclip.fp8.export import fp8_weight_sync_tensors

    label = f"{opts.recipe}/{opts.shape}"
    model_dir = tempfile.mkdtemp()
    cfg, policy = build_policy(opts.shape, model_dir, opts.recipe, tuple(opts.keep), opts.tie)
    kwargs = engine_kwargs(policy)
    if opts.from_export:
        from calclip.fp8.export import export_fp8_checkpoint
        from calclip.rollout.vllm_sync import fp8_engine_kwargs

        export_fp8_checkpoint(policy, model_dir, config_dict=policy.config.to_dict())  # over the BF16 save
        kwargs = {**fp8_engine_kwargs(policy, export_dir=model_dir), "linear_backend": kwargs["linear_backend"]}
    if opts.engine_weights != "channel":
        if opts.recipe == "block":
            parser.error("--engine-weights is for the rowwise / tensorwise recipes")
        kwargs["hf_overrides"]["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = \
            opts.engine_weights
    if opts.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = opts.kv_cache_dtype
        label += f"/kv {opts.kv_cache_dtype}"
    if opts.dummy_start and opts.from_export:
        parser.error("--dummy-start and --from-export are two ways to start the engine: give one")
    print(f"{label} engine kwargs: {kwargs}")
    vllm_config, model = build_vllm_model(model_dir, kwargs)
    print(describe_layers(model, opts.recipe))
    if opts.from_export:  # vLLM's own loader reads the exported safetensors
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        with set_current_vllm_config(vllm_config):
            get_model_loader(vllm_config.load_config).load_weights(model, vllm_config.model_config)
    elif opts.dummy_start:  # vLLM's DummyModelLoader, as the trainer's engine (load_format "dummy") starts
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

        with set_current_vllm_config(vllm_config):
            DummyModelLoader(vllm_config.load_config).load_weights(model, vllm_config.model_config)
    else:
        model.load_weights(fp8_weight_sync_tensors(policy))  # the first load: a checkpoint load
    process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    print(describe_layers(model, opts.recipe) + " (after loading)")
    print(f"{label} KV-cache scales after the engine's load: {kv_scales(model)}")
    if opts.dummy_start:  # the trainer's first sync
        reload(model, vllm_config, policy)
        print(f"{label} KV-cache scales after the first sync: {kv_scales(model)}")
    before = layer_tensors(model)
    print(shard_scales(policy, opts.recipe))
    wrong = mismatches(cfg, model, policy, opts.recipe) + kv_scale_problems(model)
    print(f"{label} initial load: mismatching {wrong}")
    failed = bool(wrong)
    for step in range(opts.reloads):
        perturb(policy)
        reload(model, vllm_config, policy)
        after = layer_tensors(model)
        moved = [k for k in before if before[k] != after.get(k)]
        wrong = mismatches(cfg, model, policy, opts.recipe) + kv_scale_problems(model)
        print(f"{label} reload {step}: mismatching {wrong}; moved/changed {moved}")
        failed = failed or bool(wrong or moved)
    if opts.direct:
        failed = not check_direct_sync(cfg, model, vllm_config, policy, opts.direct, label, opts.recipe) or failed
    print(f"{label}: {'FAILED' if failed else 'all held'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
