"""FP8 export of a calclip FP8 policy: a standard checkpoint and the per-step vLLM weight-sync stream.

Both produce, for every linear layer that calclip trains in FP8 with the blockwise recipe, the tensors a block-FP8
consumer loads:

    <module>.weight            float8_e4m3fn [N, K]
    <module>.weight_scale_inv  float32       [ceil(N / 128), ceil(K / 128)]   (dequantization multiplier)

quantized by calclip's own reference quantizer (``calclip.fp8.reference.quantize_128x128``) with the block size
and power-of-two flag the layer trains with, so the FP8 codes and scales are bit-identical to the ones the
training forward multiplies with. Everything else (embeddings, norms, the BF16-kept linears, lm_head) is
written in BF16 (checkpoint) or passed through unchanged (sync stream; vLLM's loader casts it).

Names and shapes were checked against the consumers' sources (see docs/vllm.md for the citations):

- transformers ``FineGrainedFP8Config`` / ``FP8Linear`` (integrations/finegrained_fp8.py, 5.24): parameters
  ``weight`` (e4m3fn [N, K]) and ``weight_scale_inv`` (fp32 [ceil(N/bn), ceil(K/bk)]); the config reads
  ``quant_method``, ``activation_scheme``, ``weight_block_size``, ``modules_to_not_convert`` (``ignored_layers``
  is accepted as an alias only when ``modules_to_not_convert`` is absent).
- vLLM ``Fp8Config.from_config`` (model_executor/layers/quantization/fp8.py) reads ``quant_method`` ("fp8" in it
  means FP8-serialized), ``activation_scheme``, ``weight_block_size`` and ``ignored_layers``; releases from late
  2025 on fall back to ``modules_to_not_convert`` when ``ignored_layers`` is empty, older ones do not. The export
  therefore writes both keys with the same list. ``Fp8LinearMethod.create_weights`` registers ``weight`` and
  ``weight_scale_inv`` (the checkpoint format) in every version read; the post-load step keeps
  ``weight_scale_inv`` in older releases and renames it to ``weight_scale`` in newer ones, which is why the sync
  stream sends the CHECKPOINT format inside vLLM's layerwise reload (``calclip.rollout.vllm_sync``).

Rowwise and tensorwise (torchao's recipes, ``calclip.fp8.torchao_recipes``) export per output channel instead, in
the ``compressed-tensors`` format vLLM serves with its per-channel FP8 linear (``CompressedTensorsW8A8Fp8``, weights
strategy "channel"):

    <module>.weight            float8_e4m3fn [N, K]
    <module>.weight_scale      float32       [N, 1]   (dequantization multiplier, one per output row)

the codes and scales torchao's weight cast computes in the training forward (``torchao_weight_fp8``). Tensorwise's
one scale is repeated per row: vLLM's per-tensor path (quant_method "fp8" without weight_block_size, or strategy
"tensor") re-quantizes the shards of a fused layer (q/k/v, gate/up) to their largest scale
(``requantize_with_max_scale``), so the engine would not hold the trainer's codes; its per-channel path keeps every
row's codes and scale as loaded (run with vLLM 0.24.0's own loaders on CPU: benchmarks/probe_vllm_reload_cpu.py).
Activations: vLLM 0.24 quantizes them dynamically per token in both paths on CUDA with CUTLASS FP8
(``kFp8DynamicTokenSym``), which is rowwise's scheme; tensorwise's per-tensor activation scale is not available there
(docs/vllm.md says what that changes).

torch + safetensors + json only: no transformers, no vLLM (torchao only for a model that has torchao layers).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from calclip.fp8.config import BLOCK, FP8_DTYPE, Fp8Recipe, get_fp8_recipe
from calclip.fp8.linear import FP8BlockLinear
from calclip.fp8.recipes import torchao_linears
from calclip.fp8.reference import quantize_128x128

# Checkpoint-format scale name: DeepSeek-V3's, transformers' FP8Linear's and vLLM's Fp8LinearMethod.create_weights'.
SCALE_NAME = "weight_scale_inv"
# The name vLLM releases with the refactored post-load step give the processed scale (kernel format). Only useful
# for in-place kernel-format updates; see docs/vllm.md before using it.
VLLM_PROCESSED_SCALE_NAME = "weight_scale"
# The per-channel scale's name in compressed-tensors checkpoints and vLLM's CompressedTensorsW8A8Fp8 (rowwise,
# tensorwise); vLLM keeps it, as loaded, after loading.
CHANNEL_SCALE_NAME = "weight_scale"

# Parameter-name wrappers that training frameworks insert and checkpoints never contain (TRL strips the same ones).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")

# vLLM fuses these projections into one column-parallel layer (Llama-family ``packed_modules_mapping``).
LLAMA_PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class Fp8WeightSpec:
    """How one linear layer's weight is quantized in training (and therefore in the export).

    recipe: "blockwise" (calclip's 128x128 blocks; block_size applies), "rowwise" or "tensorwise" (torchao's
    weight cast; block_size is not used)."""

    block_size: int = BLOCK
    power_of_two_scales: bool = False
    recipe: str = Fp8Recipe.BLOCKWISE.value

    @property
    def blockwise(self) -> bool:
        return self.recipe == Fp8Recipe.BLOCKWISE.value

    @property
    def scale_name(self) -> str:
        """The checkpoint name of this layer's scale tensor."""
        return SCALE_NAME if self.blockwise else CHANNEL_SCALE_NAME


def clean_param_name(name: str) -> str:
    """Strip framework wrapper prefixes (activation checkpointing, FSDP1, torch.compile) from a name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def fp8_weight_specs(model: nn.Module) -> dict[str, Fp8WeightSpec]:
    """Module name (wrapper prefixes stripped) -> quantization spec, for every FP8 linear in ``model``: calclip's
    FP8BlockLinear (recipe blockwise) and torchao's rowwise / tensorwise layers (their scale rounding read from the
    torchao config the layer's forward runs with)."""
    specs = {
        clean_param_name(name): Fp8WeightSpec(module.fp8_config.block_size, module.fp8_config.power_of_two_scales)
        for name, module in model.named_modules()
        if isinstance(module, FP8BlockLinear)
    }
    for name, module in torchao_linears(model):
        specs[clean_param_name(name)] = Fp8WeightSpec(
            power_of_two_scales=bool(module.config.round_scales_to_power_of_2),
            recipe=get_fp8_recipe(module.fp8_config.recipe).value)
    return specs


def shared_recipe(fp8_modules: Mapping[str, Fp8WeightSpec]) -> str:
    """The one FP8 recipe of ``fp8_modules`` (a checkpoint's ``quantization_config`` and a vLLM engine serve one);
    raises when there are no FP8 linears or their recipes differ."""
    if not fp8_modules:
        raise ValueError("model has no FP8 linear layers: convert it with calclip.fp8.quantize_model first")
    recipes = {spec.recipe for spec in fp8_modules.values()}
    if len(recipes) != 1:
        raise ValueError(f"all FP8 linears must share one FP8 recipe for export and vLLM, got {sorted(recipes)}")
    return recipes.pop()


def bf16_linear_names(model: nn.Module, fp8_modules: Mapping[str, Fp8WeightSpec]) -> list[str]:
    """Names of the nn.Linear modules that stay in high precision (``modules_to_not_convert``), in model order."""
    names = []
    for name, module in model.named_modules():
        name = clean_param_name(name)
        if isinstance(module, nn.Linear) and name not in fp8_modules:
            names.append(name)
    return names


def block_fp8_quantization_config(*, block_size: int = BLOCK, modules_to_not_convert: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` of a block-FP8 checkpoint, readable by transformers and vLLM.

    ``fmt`` is not read by either loader (transformers keeps unknown keys out of FineGrainedFP8Config, vLLM
    ignores it); it is written because DeepSeek-V3-style checkpoints carry it and tools grep for it.
    """
    skip = list(modules_to_not_convert)
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block_size, block_size],
        "modules_to_not_convert": skip,
        # vLLM releases before the modules_to_not_convert fallback read only this key.
        "ignored_layers": list(skip),
    }


def channel_fp8_quantization_config(*, recipe: str, modules_to_not_convert: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` of a rowwise / tensorwise checkpoint: compressed-tensors, every nn.Linear not in
    ``modules_to_not_convert`` (``ignore``) FP8 with static per-channel weight scales and dynamic activations.

    Read by vLLM's ``CompressedTensorsConfig`` (0.24: ``_is_fp8_w8a8`` -> ``CompressedTensorsW8A8Fp8``; a dynamic
    input scheme runs per token whatever its strategy) and validated by compressed-tensors' ``QuantizationArgs``.
    ``input_activations.strategy`` says what the trainer does (rowwise "token", tensorwise "tensor"); vLLM 0.24
    reads only ``dynamic`` there. ``modules_to_not_convert`` is written too, for readers that look for it.
    """
    recipe = get_fp8_recipe(recipe)
    if not recipe.uses_torchao:
        raise ValueError(f"recipe {recipe.value!r} exports block-FP8 (block_fp8_quantization_config), not per channel")
    skip = list(modules_to_not_convert)
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "channel", "dynamic": False},
                "input_activations": {**fp8, "strategy": "token" if recipe is Fp8Recipe.ROWWISE else "tensor",
                                      "dynamic": True},
            }
        },
        "ignore": skip,
        "modules_to_not_convert": list(skip),
        "calclip_fp8_recipe": recipe.value,
    }


def fp8_quantization_config_for(fp8_modules: Mapping[str, Fp8WeightSpec], modules_to_not_convert: Iterable[str]
                                ) -> dict:
    """The ``quantization_config`` of ``fp8_modules``' one recipe: block-FP8 for blockwise (their one block size),
    compressed-tensors per channel for rowwise / tensorwise."""
    recipe = shared_recipe(fp8_modules)
    if recipe == Fp8Recipe.BLOCKWISE.value:
        return block_fp8_quantization_config(block_size=shared_block_size(fp8_modules),
                                             modules_to_not_convert=modules_to_not_convert)
    return channel_fp8_quantization_config(recipe=recipe, modules_to_not_convert=modules_to_not_convert)


def quantize_weight_for_export(weight: Tensor, spec: Fp8WeightSpec) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (q float8_e4m3fn [N, K], scale float32): the training quantizer's own codes and scales.

    blockwise: ``weight_scale_inv`` [ceil(N/b), ceil(K/b)] from calclip's reference quantizer; rowwise / tensorwise:
    ``weight_scale`` [N, 1] from torchao's weight cast (``calclip.fp8.torchao_recipes.torchao_weight_fp8``).
    Raises on non-finite scales (a NaN scale would silently turn every output of the layer NaN in the engine).
    """
    if spec.blockwise:
        q, s = quantize_128x128(weight.detach(), block=spec.block_size, pow2=spec.power_of_two_scales)
    else:
        from calclip.fp8.torchao_recipes import torchao_weight_fp8  # torchao only where a torchao layer exists

        q, s = torchao_weight_fp8(weight, spec.recipe, power_of_two_scales=spec.power_of_two_scales)
    if not bool(torch.isfinite(s).all()):
        raise ValueError("weight has non-finite values: refusing to export NaN scales")
    return q, s


def live_fp8_layers(model: nn.Module) -> dict[str, FP8BlockLinear]:
    """Module name (wrapper prefixes stripped) -> FP8BlockLinear, for the layers of ``model`` whose codes a sync
    stream may send as they are (``quantize_named_params(live_layers=...)``): those that keep codes between calls
    (``Fp8Config.cache_weights``; sharded parameters, gathered for each call, do not) and hold their whole weight."""
    return {clean_param_name(name): module for name, module in model.named_modules()
            if isinstance(module, FP8BlockLinear) and module.fp8_config.cache_weights
            and tuple(module.weight.shape) == (module.out_features, module.in_features)}


def _streams_weight_of(tensor: Tensor, layer: FP8BlockLinear) -> bool:
    """Whether ``tensor`` is ``layer``'s weight itself (its ``.data``: same storage, layout and dtype), not a gathered
    or edited copy of it."""
    w = layer.weight
    return (tensor.device == w.device and tensor.dtype == w.dtype and tensor.shape == w.shape
            and tensor.stride() == w.stride() and tensor.data_ptr() == w.data_ptr())


def requantize_live_layers(layers: Mapping[str, FP8BlockLinear]) -> None:
    """Bring every layer's weight codes up to date with its weight as it is now (``FP8BlockLinear.requantize``: the
    codes its next forward multiplies with) and raise naming the layers whose weight holds a NaN or an Inf, reading
    all their flags back at once (one host sync, before anything is sent)."""
    if not layers:
        return
    names = list(layers)
    flags = [layers[name].requantize() for name in names]
    device = flags[0].device
    bad = torch.stack([flag.to(device) for flag in flags]).tolist()
    nonfinite = [name for name, is_bad in zip(names, bad) if is_bad]
    if nonfinite:
        raise ValueError(f"weight has non-finite values in {len(nonfinite)} FP8 layer(s): {nonfinite}; refusing to "
                         "send NaN scales")


def quantize_named_params(
    named_params: Iterable[tuple[str, Tensor]],
    fp8_modules: Mapping[str, Fp8WeightSpec],
    *,
    scale_name: str = SCALE_NAME,
    live_layers: Mapping[str, FP8BlockLinear] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Rewrite a (name, tensor) stream: ``<fp8 module>.weight`` becomes the FP8 codes plus its scale tensor,
    ``<module>.<scale_name>`` for blockwise layers, ``<module>.weight_scale`` for rowwise / tensorwise ones.

    Every other tensor passes through unchanged. Names are matched after stripping wrapper prefixes, and the
    cleaned name is yielded. Lazy: one weight is quantized at a time, while the caller's gather (FSDP/ZeRO-3) for
    that parameter is still open.

    live_layers (``live_fp8_layers``): where a streamed tensor is such a layer's weight itself, the stream sends the
    layer's own codes, brought up to date before the first tensor is yielded (``requantize_live_layers``, which
    refuses a non-finite weight of any of them before anything is sent). That is one fused kernel per weight instead
    of the reference quantizer's passes over an FP32 copy and a host sync per weight, and the training forward that
    follows finds its codes current. The codes are the same bits either way (the kernels are tested against the
    reference). Any other tensor (a gathered or edited copy) is quantized by the reference quantizer, as without.
    """
    if live_layers:
        requantize_live_layers(live_layers)
    for name, tensor in named_params:
        name = clean_param_name(name)
        module_name, _, leaf = name.rpartition(".")
        spec = fp8_modules.get(module_name) if leaf == "weight" else None
        if spec is None:
            yield name, tensor
            continue
        layer = live_layers.get(module_name) if live_layers else None
        if layer is not None and spec.blockwise and _streams_weight_of(tensor, layer):
            q, s, _ = layer.quantized_weight()
        else:
            try:
                q, s = quantize_weight_for_export(tensor, spec)
            except ValueError as err:
                raise ValueError(f"{module_name}: {err}") from None
        yield name, q
        yield f"{module_name}.{scale_name if spec.blockwise else spec.scale_name}", s


def fp8_weight_sync_tensors(
    model: nn.Module,
    *,
    fp8_modules: Mapping[str, Fp8WeightSpec] | None = None,
    scale_name: str = SCALE_NAME,
    live_codes: bool = False,
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every parameter of ``model`` as vLLM's block-FP8 checkpoint loader expects them.

    FP8 linears: ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/128), ceil(K/128)];
    other parameters unchanged (tied parameters once, as ``named_parameters`` yields them). Send these inside
    vLLM's layerwise reload (checkpoint format); ``calclip.rollout.vllm_sync`` does that for TRL.
    live_codes: send the layers' own codes, brought up to date (``quantize_named_params``' ``live_layers``), instead
    of quantizing every weight again with the reference quantizer: the same bits, faster.
    """
    if fp8_modules is None:
        fp8_modules = fp8_weight_specs(model)
    yield from quantize_named_params(
        ((n, p.data) for n, p in model.named_parameters()), fp8_modules, scale_name=scale_name,
        live_layers=live_fp8_layers(model) if live_codes else None,
    )


def fp8_state_dict(
    model: nn.Module,
    *,
    fp8_modules: Mapping[str, Fp8WeightSpec] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Tensor]:
    """The checkpoint tensors: FP8 codes + scales for FP8 linears, ``dtype`` for every other floating tensor.

    Persistent buffers are included (as in ``state_dict``); a tensor that shares storage with one already
    written (tied embeddings) is written once, under its first name, as transformers' ``save_pretrained`` does.
    """
    if fp8_modules is None:
        fp8_modules = fp8_weight_specs(model)
    out: dict[str, Tensor] = {}
    seen_storage: set[tuple[int, int, tuple[int, ...]]] = set()
    scale_names = {f"{module}.{spec.scale_name}" for module, spec in fp8_modules.items()}
    for name, tensor in quantize_named_params(model.state_dict().items(), fp8_modules):
        if tensor.dtype not in (FP8_DTYPE,) and name not in scale_names:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if tensor.device.type != "meta" and key in seen_storage:
                continue
            seen_storage.add(key)
            if tensor.is_floating_point():
                tensor = tensor.detach().to(dtype)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def shared_block_size(fp8_modules: Mapping[str, Fp8WeightSpec]) -> int:
    """The one block size of ``fp8_modules`` (``weight_block_size`` is per checkpoint and per vLLM engine);
    raises when there are no FP8 linears or their block sizes differ."""
    if not fp8_modules:
        raise ValueError("model has no FP8 linear layers: convert it with calclip.fp8.quantize_model first")
    if not all(spec.blockwise for spec in fp8_modules.values()):
        raise ValueError(f"weight_block_size is for recipe 'blockwise' only; these layers are "
                         f"{shared_recipe(fp8_modules)!r} (fp8_quantization_config_for picks their format)")
    blocks = {spec.block_size for spec in fp8_modules.values()}
    if len(blocks) != 1:
        raise ValueError(f"all FP8 linears must share one block size for weight_block_size, got {sorted(blocks)}")
    return blocks.pop()


def export_fp8_checkpoint(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    config_dict: Mapping,
    fp8_modules: Mapping[str, Fp8WeightSpec] | None = None,
    modules_to_not_convert: Iterable[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of an FP8 checkpoint to ``out_dir``: block-FP8 for the blockwise
    recipe, compressed-tensors per channel for rowwise / tensorwise (``fp8_quantization_config_for``).

    config_dict: the model's HF config as a dict (``model.config.to_dict()``); its ``quantization_config`` is
        replaced and its dtype keys set to ``dtype``.
    modules_to_not_convert: defaults to every nn.Linear that is not an FP8 linear (lm_head and the layers kept
        in BF16 by ``Fp8Config``).
    All FP8 linears must share one recipe, and blockwise ones one block size (both are per checkpoint).
    Returns the output directory. Tokenizer files are the caller's (``tokenizer.save_pretrained(out_dir)``).
    """
    from safetensors.torch import save_file

    if fp8_modules is None:
        fp8_modules = fp8_weight_specs(model)
    if modules_to_not_convert is None:
        modules_to_not_convert = bf16_linear_names(model, fp8_modules)
    quantization_config = fp8_quantization_config_for(fp8_modules, modules_to_not_convert)  # checks before writing

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = fp8_state_dict(model, fp8_modules=fp8_modules, dtype=dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads(json.dumps(dict(config_dict), default=str))  # deep copy, JSON-clean
    config["quantization_config"] = quantization_config
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def vllm_block_fp8_problems(
    linear_shapes: Mapping[str, tuple[int, int]],
    *,
    block_size: int = BLOCK,
    packed_modules: Mapping[str, tuple[str, ...]] = LLAMA_PACKED_MODULES,
    tp_size: int = 1,
    output_head: str | None = "lm_head",
) -> dict[str, str]:
    """Which FP8 linears vLLM's block-FP8 linear method cannot serve, and why (empty dict: all fine).

    linear_shapes: module name -> (N, K) of every FP8 linear. Rules, from vLLM's fp8 path (docs/vllm.md):
    - K % block_size == 0: the activation quantizer (per_token_group_quant_fp8) asserts the last dim of x is a
      multiple of the group size.
    - a projection fused by vLLM (q/k/v -> qkv_proj, gate/up -> gate_up_proj) needs N % block_size == 0 for
      every shard: the shards are quantized separately, so a ragged shard's last 128-row block and the next
      shard's first one would share one scale row of the fused weight. vLLM 0.24 does not refuse this
      (``ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch`` skips ``validate_fp8_block_shape`` for a
      fused layer with a ragged shard); its scale loader then rounds each shard's row offset up
      (``adjust_block_scale_shard``) and either fails in ``narrow`` or overwrites scale rows (seen on CPU with the
      real 0.24 loaders: q/k/v = 576/192/192 sends 9 scale rows into 8, k's second row lost). All shards of a
      fused layer must be FP8 or none (is_layer_skipped raises on a mixed fused layer).
    - with tensor parallelism, N / tp_size (column-parallel) and K / tp_size (row-parallel) must also be
      multiples of block_size; checked conservatively for both dims when tp_size > 1.
    - ``output_head`` (the LM head's module name; None: none) is served in BF16 (``_output_head_problems``).
    Keep the reported modules in BF16 for training too (``Fp8Config.keep_patterns``) so that rollout and
    training still run the same graph.
    """
    problems: dict[str, str] = {}
    shard_to_fused = {shard: fused for fused, shards in packed_modules.items() for shard in shards}
    for name, (n, k) in linear_shapes.items():
        reasons = []
        if k % block_size:
            reasons.append(f"K={k} is not a multiple of {block_size} (activation groups)")
        leaf = name.rpartition(".")[2]
        if leaf in shard_to_fused and n % block_size:
            reasons.append(f"N={n} is not a multiple of {block_size} in fused {shard_to_fused[leaf]} (its "
                           f"{block_size}-row scale blocks would straddle the shard boundary in the fused weight)")
        if tp_size > 1 and ((n // tp_size) % block_size or (k // tp_size) % block_size or n % tp_size or k % tp_size):
            reasons.append(f"N={n}, K={k} do not split into {block_size}-multiples over tp_size={tp_size}")
        if reasons:
            problems[name] = "; ".join(reasons)
    _mixed_fused_problems(linear_shapes, packed_modules, problems)
    _output_head_problems(linear_shapes, output_head, problems)
    return problems


def _mixed_fused_problems(linear_shapes: Mapping[str, tuple[int, int]], packed_modules: Mapping[str, tuple[str, ...]],
                          problems: dict[str, str]) -> None:
    """A fused layer must be all-FP8 or all-BF16 in vLLM (``is_layer_skipped`` / ``should_ignore_layer`` raise on
    a fused layer whose shards are split between quantized and ignored)."""
    shard_to_fused = {shard: fused for fused, shards in packed_modules.items() for shard in shards}
    for name in linear_shapes:
        parent, _, leaf = name.rpartition(".")
        fused = shard_to_fused.get(leaf)
        if fused is None:
            continue
        for sibling in packed_modules[fused]:
            sibling_name = f"{parent}.{sibling}" if parent else sibling
            if sibling_name not in linear_shapes:
                problems.setdefault(name, f"fused {fused} mixes FP8 and BF16 shards ({sibling_name} is BF16)")


def _output_head_problems(linear_shapes: Mapping[str, tuple[int, int]], output_head: str | None,
                          problems: dict[str, str]) -> None:
    """An FP8 LM head: vLLM 0.24 builds it as ``ParallelLMHead`` (an embedding, not a ``LinearBase``), which
    ``Fp8Config.get_quant_method`` never quantizes and compressed-tensors quantizes only when a config group targets
    it by name (calclip's target "Linear" does not match it), so the engine holds a BF16 head and the sync's
    ``lm_head.weight_scale(_inv)`` has no parameter to load into (seen on CPU with the real 0.24 loaders:
    benchmarks/probe_vllm_reload_cpu.py's docstring)."""
    if output_head is not None and output_head in linear_shapes:
        problems[output_head] = ("the LM head: vLLM serves it in BF16 (ParallelLMHead is quantized by neither "
                                 "block FP8 nor calclip's compressed-tensors config), so it cannot load FP8 codes")


def vllm_channel_fp8_problems(
    linear_shapes: Mapping[str, tuple[int, int]],
    *,
    packed_modules: Mapping[str, tuple[str, ...]] = LLAMA_PACKED_MODULES,
    tp_size: int = 1,
    output_head: str | None = "lm_head",
) -> dict[str, str]:
    """Which rowwise / tensorwise FP8 linears vLLM's per-channel FP8 linear cannot serve as trained (empty: all).

    Per-channel scales have no block grid: any N and K load, fused shards included (each shard's rows and their
    scale rows go to their own offsets; vLLM 0.24 ``CompressedTensorsW8A8Fp8`` keeps both as loaded). torchao
    already requires both dims to be multiples of 16 (``check_scaled_mm_shape``), which is what CUTLASS needs
    without padding the weight. Left: the shards of a fused layer are all FP8 or all BF16, with tensor
    parallelism N and K split evenly over ``tp_size`` (checked for both dims, as for block FP8), and the LM head
    (``output_head``) in BF16 (``_output_head_problems``)."""
    problems: dict[str, str] = {}
    for name, (n, k) in linear_shapes.items():
        if tp_size > 1 and (n % tp_size or k % tp_size):
            problems[name] = f"N={n}, K={k} do not split evenly over tp_size={tp_size}"
    _mixed_fused_problems(linear_shapes, packed_modules, problems)
    _output_head_problems(linear_shapes, output_head, problems)
    return problems


def vllm_fp8_problems(
    linear_shapes: Mapping[str, tuple[int, int]],
    fp8_modules: Mapping[str, Fp8WeightSpec],
    *,
    packed_modules: Mapping[str, tuple[str, ...]] = LLAMA_PACKED_MODULES,
    tp_size: int = 1,
    output_head: str | None = "lm_head",
) -> dict[str, str]:
    """``vllm_block_fp8_problems`` or ``vllm_channel_fp8_problems``, by the one recipe of ``fp8_modules``."""
    recipe = shared_recipe(fp8_modules)
    if recipe == Fp8Recipe.BLOCKWISE.value:
        return vllm_block_fp8_problems(linear_shapes, block_size=shared_block_size(fp8_modules),
                                       packed_modules=packed_modules, tp_size=tp_size, output_head=output_head)
    return vllm_channel_fp8_problems(linear_shapes, packed_modules=packed_modules, tp_size=tp_size,
                                     output_head=output_head)


def vllm_keep_patterns(problems: Mapping[str, str], packed_modules=LLAMA_PACKED_MODULES) -> tuple[str, ...]:
    """Regexes for ``Fp8Config.keep_patterns`` that keep every problem module (and its fused siblings) in BF16."""
    shard_to_fused = {shard: fused for fused, shards in packed_modules.items() for shard in shards}
    names = set()
    for name in problems:
        parent, _, leaf = name.rpartition(".")
        for sibling in packed_modules.get(shard_to_fused.get(leaf, ""), (leaf,)):
            names.add(f"{parent}.{sibling}" if parent else sibling)
    return tuple(f"^{re.escape(n)}$" for n in sorted(names))


def linear_shapes(model: nn.Module, fp8_modules: Mapping[str, Fp8WeightSpec] | None = None) -> dict[str, tuple]:
    """Module name -> (out_features, in_features) of the FP8 linears (input to ``vllm_block_fp8_problems``)."""
    if fp8_modules is None:
        fp8_modules = fp8_weight_specs(model)
    return {
        clean_param_name(name): (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if clean_param_name(name) in fp8_modules
    }
