"""vLLM rollouts on the same FP8 weights the policy trains with (TRL 1.16's ``VLLMGeneration``).

TRL pushes BF16 parameters into vLLM, which would then quantize them again with its own arithmetic (or, for an
FP8 engine, fail to load them). Three small seams change that, and nothing of TRL's generation code is copied:

1. ``_iter_named_params`` (the one stream both sync paths read): every FP8 linear's ``weight`` is replaced by
   calclip's FP8 codes + ``weight_scale_inv`` (``calclip.fp8.export.quantize_named_params``), i.e. the
   checkpoint format of a block-FP8 model. TRL derives the server-mode metadata (name, dtype, shape) from this
   same stream, so server mode announces ``float8_e4m3fn`` / ``float32`` tensors by itself.
2. Colocate mode: TRL calls ``model.load_weights`` tensor by tensor. vLLM's FP8 layers are post-processed after
   loading (``weight_scale_inv`` becomes ``weight_scale`` in newer releases, scales may be re-laid out for
   DeepGEMM), so the checkpoint-format tensors are loaded inside vLLM's layerwise reload: the stream calls
   ``initialize_layerwise_reload(model)`` before its first tensor and ``finalize_layerwise_reload(model,
   model_config)`` after its last one — exactly what vLLM's own weight-transfer engine does on
   ``start_weight_update`` / ``finish_weight_update``. Server mode needs nothing: TRL 1.16's client already wraps
   every ``update_named_params`` in ``/start_weight_update`` ... ``/finish_weight_update``. After the first reload
   the engine's layout is checked byte for byte; where it holds every tensor as loaded, later colocate syncs are
   in-place copies instead (``calclip.rollout.vllm_direct_sync``, ``fp8_direct_sync``).
3. ``_init_vllm``: the engine is built block-FP8: ``quantization="fp8"`` plus ``hf_overrides`` carrying the
   checkpoint's ``quantization_config`` (weight_block_size [128, 128], ignored layers) and ``load_format="dummy"``
   (TRL syncs the real weights before the first rollout: ``_last_loaded_step`` starts at -1), or, with
   ``export_dir``, the engine loads a checkpoint written by ``calclip.fp8.export.export_fp8_checkpoint``. TRL
   builds ``LLM(...)`` with fixed arguments, so the extra ones are merged in by wrapping the ``LLM`` name that
   ``trl.generation.vllm_generation`` calls, for the duration of ``_init_vllm`` only. The engine's layer split is
   read from the quantized model; a trainer that quantizes after ``GRPOTrainer.__init__`` (which constructs the
   generation object) defers the engine start to ``start_fp8_engine()`` (``fp8_defer_engine``).
4. Engine numerics (``fp8_engine_numerics_kwargs``, merged in the same place): vLLM 0.24's defaults would not run
   the trainer's arithmetic on the trainer's codes. ``linear_backend="cutlass"`` keeps the FP32 block scales (on
   Hopper with DeepGEMM installed vLLM's automatic choice requantizes every weight to power-of-two UE8M0 scales,
   ``VLLM_USE_DEEP_GEMM_E8M0`` defaulting to 1); the ``fuse_norm_quant`` / ``fuse_act_quant`` passes are switched
   off (their kernels quantize SiLU(gate)*up from unrounded FP32 values and floor every group scale at
   1/(448*512)), and Inductor emulates eager's BF16 rounding of intermediates (``emulate_precision_casts``), as
   the trainer's HF forward rounds them. docs/vllm.md lists each difference with its source.

5. A policy without a loadable ``name_or_path`` (built from a config: ``''``), FP8 or not: TRL would hand vLLM
   ``LLM(model='')``, which vLLM tries to download from the Hub. ``ColocateEngineMixin`` writes the policy's config
   and tokenizer to ``<output_dir>/_vllm_engine_model/rank-<process index>`` and merges ``model=<that directory>``,
   ``load_format="dummy"``: the weights come from TRL's first sync, as in 3. A hub id or an existing path is TRL's.

6. Rowwise and tensorwise (torchao's recipes) take the same path with another format: the stream carries each FP8
   linear's torchao codes and per-row ``weight_scale`` [N, 1] (tensorwise: its one scale repeated), the engine is
   built ``quantization="compressed-tensors"`` with static per-channel weights and dynamic activations
   (``calclip.fp8.export.channel_fp8_quantization_config``), which vLLM 0.24 serves with its per-channel CUTLASS
   FP8 GEMM keeping every shard's codes and scales as loaded; the direct sync compares its transposed ``weight``
   through the transpose (``vllm_direct_sync.rows_view``). Run on CPU through vLLM 0.24.0's own compressed-tensors
   loaders, post-processing and layerwise reload (benchmarks/probe_vllm_reload_cpu.py --recipe rowwise|tensorwise):
   byte for byte, reloads and in-place syncs alike. An ``export_dir`` of another format is refused
   (``check_export_config``), and so is an FP8 LM head (vLLM serves it in BF16). vLLM 0.24 quantizes the
   activations of these layers per token (the rowwise scheme); tensorwise's per-tensor activation scale has no
   dynamic equivalent there on CUDA (``TENSORWISE_ACTIVATION_NOTE``).

Log-probs: TRL requests ``logprobs_mode="processed_logprobs"`` and returns them as ``sampling_per_token_logps``;
they now come from the FP8 engine, so TIS / bypass corrections compare FP8 rollout and FP8 training forward.

vLLM is imported lazily (only inside the engine hooks); this module imports without vLLM.
Version notes and everything that has not run against a live engine: docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from calclip.fp8.export import (
    CHANNEL_SCALE_NAME,
    LLAMA_PACKED_MODULES,
    SCALE_NAME,
    Fp8WeightSpec,
    bf16_linear_names,
    clean_param_name,
    fp8_quantization_config_for,
    fp8_weight_specs,
    fp8_weight_sync_tensors,
    linear_shapes,
    live_fp8_layers,
    quantize_named_params,
    shared_recipe,
    vllm_fp8_problems,
    vllm_keep_patterns,
)
from calclip.rollout.vllm_direct_sync import DirectSync, engine_name, rows_view

# The two hooks of vLLM's layerwise reload (vllm/model_executor/model_loader/reload/__init__.py, the releases
# TRL 1.16 supports: vllm>=0.22,<=0.31).
_RELOAD_MODULE = "vllm.model_executor.model_loader.reload"
_logger = logging.getLogger(__name__)


# The engine's GEMM for the FP8 linears (docs/vllm.md, "Numerics" and "Performance"): "fastest" is
# calclip's measured choice, resolved when the engine's arguments are built (``resolve_linear_backend``): DeepGEMM for
# the blockwise recipe where vLLM can run it (H200, 2026-12-05: 1.36x / 1.23x BF16's decode at batch 64 / 256, where
# CUTLASS measured 1.00x / 1.14x), CUTLASS elsewhere. Both serve the trainer's FP32 block scales unchanged.
FASTEST_LINEAR_BACKEND = "fastest"
DEFAULT_LINEAR_BACKEND = FASTEST_LINEAR_BACKEND


def deep_gemm_runs_here(env: Mapping[str, str] = os.environ) -> bool:
    """vLLM's own test for DeepGEMM (``vllm.utils.deep_gemm.is_deep_gemm_supported``: a Hopper or Blackwell GPU,
    DeepGEMM importable, ``VLLM_USE_DEEP_GEMM`` on), and a CUDA compiler for DeepGEMM's run-time JIT (``nvcc_found``:
    vLLM's test does not look, and DeepGEMM fails at its first GEMM without one); False where vLLM is not installed."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_supported
    except ImportError:
        return False
    return bool(is_deep_gemm_supported()) and nvcc_found(env)


def nvcc_found(env: Mapping[str, str] = os.environ) -> bool:
    """Whether DeepGEMM's JIT finds ``nvcc`` where it looks (vllm/third_party/deep_gemm ``_find_cuda_home``):
    ``$CUDA_HOME`` or ``$CUDA_PATH``, else the ``nvcc`` on PATH, else /usr/local/cuda."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return os.path.exists(os.path.join(home, "bin", "nvcc"))
    return shutil.which("nvcc", path=env.get("PATH")) is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def resolve_linear_backend(linear_backend: str | None, recipe: str = "blockwise",
                           deep_gemm: bool | None = None) -> str | None:
    """``linear_backend`` as vLLM gets it: "fastest" becomes "deep_gemm" for the blockwise recipe where DeepGEMM runs
    (``deep_gemm``, default ``deep_gemm_runs_here()``) and "cutlass" otherwise (vLLM 0.24 has no per-channel
    DeepGEMM kernel; ``linear_backend_problem``); any other value is the user's and passes unchanged."""
    if linear_backend != FASTEST_LINEAR_BACKEND:
        return linear_backend
    if recipe != "blockwise":
        return "cutlass"
    return "deep_gemm" if (deep_gemm_runs_here() if deep_gemm is None else deep_gemm) else "cutlass"


# What an engine of the tensorwise recipe does differently from the trainer (logged when one starts).
TENSORWISE_ACTIVATION_NOTE = (
    "fp8_recipe 'tensorwise' on vLLM 0.24: the engine holds the trainer's FP8 weight codes and scales exactly, but "
    "quantizes activations per token (CompressedTensorsW8A8Fp8 and Fp8LinearMethod pick dynamic per-token scales on "
    "CUDA with CUTLASS FP8; no per-tensor dynamic mode is reachable), where the trainer uses one scale per tensor; "
    "the rollout/training mismatch includes that difference: on SmolLM2-135M's real weights token-mult-prob-error "
    "+1.05 over BF16 rollouts against rowwise's +0.25 (H100, 2026-12-07); fp8_recipe 'rowwise' quantizes "
    "activations per token like the engine (docs/vllm.md, Rowwise and tensorwise)")


def fp8_engine_numerics_kwargs(*, linear_backend: str | None = DEFAULT_LINEAR_BACKEND,
                               match_trainer: bool = True, recipe: str = "blockwise") -> dict[str, Any]:
    """``vllm.LLM`` arguments (vLLM 0.24 names) that make an FP8 engine of ``recipe`` run the trainer's arithmetic.

    linear_backend: vLLM's ``kernel_config.linear_backend`` for the FP8 linears. "fastest" (default) is resolved
        here (``resolve_linear_backend``: DeepGEMM for blockwise where it runs, else CUTLASS); "cutlass" and
        "deep_gemm" serve the checkpoint's FP32 block scales as they are (DeepGEMM with ``VLLM_USE_DEEP_GEMM_E8M0=0``,
        which the engine hook sets: ``apply_deep_gemm_e8m0``); None leaves vLLM's automatic choice, which on Hopper
        with DeepGEMM installed and the environment's default requantizes the weights to power-of-two scales unless
        that hook runs.
    match_trainer: switch off the RMSNorm+quant and SiLU*up+quant fusion passes (whose kernels quantize values
        the trainer never sees: an unrounded FP32 SiLU(gate)*up, scales floored at 1/(448*512)) and let Inductor
        round BF16 intermediates as eager PyTorch (the trainer's HF forward) does. False: vLLM's defaults.
    """
    kwargs: dict[str, Any] = {}
    linear_backend = resolve_linear_backend(linear_backend, recipe)
    if linear_backend is not None:
        kwargs["linear_backend"] = linear_backend
    if match_trainer:
        kwargs["compilation_config"] = {
            "pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False},
            "inductor_compile_config": {"emulate_precision_casts": True},
        }
    return kwargs


# vLLM 0.24's linear_backend names (``_LINEAR_BACKEND_KERNEL_MAP`` in vllm/model_executor/kernels/linear/__init__.py)
# whose CUDA FP8 kernels serve one kind of layer only: "deep_gemm" and "triton" hold block-FP8 kernels and no
# per-channel / per-tensor one, "torch" the reverse. Given the other kind, vLLM refuses to build the engine ("no
# '<backend>' kernel exists for this layer type"), after the model was loaded.
_BLOCK_ONLY_LINEAR_BACKENDS = ("deep_gemm", "triton")
_SCALED_ONLY_LINEAR_BACKENDS = ("torch",)


def linear_backend_problem(recipe: str, linear_backend: str | None) -> str | None:
    """Why vLLM 0.24 cannot serve an engine of ``recipe`` (an FP8 recipe name) with ``linear_backend``, or None."""
    if linear_backend in _BLOCK_ONLY_LINEAR_BACKENDS and recipe != "blockwise":
        return (f"vLLM's linear_backend {linear_backend!r} has block-FP8 kernels only, and the {recipe!r} recipe is "
                f"served by vLLM's per-channel FP8 kernels: use 'fastest' (the default), 'cutlass' or null "
                f"(vLLM's choice)")
    if linear_backend in _SCALED_ONLY_LINEAR_BACKENDS and recipe == "blockwise":
        return (f"vLLM's linear_backend {linear_backend!r} has no block-FP8 kernel: use 'fastest' (the default), "
                f"'deep_gemm', 'cutlass' or null (vLLM's choice)")
    return None


# vLLM's switch for DeepGEMM's UE8M0 path (vllm/envs.py; default 1): with it on, DeepGEMM's post-processing
# requantizes every block-FP8 weight to power-of-two scales (``requant_weight_ue8m0_inplace``) and rounds the
# activation scales up to powers of two, so the engine would no longer hold the trainer's codes. With it off, on
# Hopper, DeepGEMM keeps the checkpoint's FP32 128x128 weight scales and codes as loaded, and its activation
# quantizer computes FP32 1x128 scales as calclip's does (docs/vllm.md, Numerics).
DEEP_GEMM_E8M0_ENV = "VLLM_USE_DEEP_GEMM_E8M0"
_DEEP_GEMM_BACKENDS = (None, "auto", "deep_gemm")  # the choices under which vLLM 0.24 may pick DeepGEMM


def deep_gemm_e8m0_setting(linear_backend: str | None, power_of_two_scales: bool,
                           env: Mapping[str, str]) -> str | None:
    """The value ``VLLM_USE_DEEP_GEMM_E8M0`` must take before a block-FP8 engine starts, or None to leave it.

    Under a backend that may run DeepGEMM and a policy whose scales are not all powers of two, UE8M0 must be off;
    an environment that switched it on explicitly is refused (the engine would silently serve requantized weights).
    Power-of-two policies are served bit for bit either way, so their setting is the user's."""
    if linear_backend not in _DEEP_GEMM_BACKENDS or power_of_two_scales:
        return None
    value = env.get(DEEP_GEMM_E8M0_ENV)
    if value is None:
        return "0"
    if value.strip() not in ("0", ""):
        raise ValueError(
            f"{DEEP_GEMM_E8M0_ENV}={value} makes vLLM's DeepGEMM requantize the policy's FP8 weights to power-of-two "
            f"scales, so the engine would not run the trainer's codes: unset it (calclip then sets 0), train with "
            f"power_of_two_scales (fp8_power_of_two_scales), or set vllm_fp8_linear_backend='cutlass'")
    return None


def set_deep_gemm_e8m0_env(value: str | None) -> None:
    """Set ``VLLM_USE_DEEP_GEMM_E8M0`` to ``value`` (None: unset, vLLM's default) before an engine starts (vLLM reads
    it when the engine picks its kernels), and make vLLM read it again if an earlier engine of this process cached
    the old value."""
    if value is None:
        os.environ.pop(DEEP_GEMM_E8M0_ENV, None)
    else:
        os.environ[DEEP_GEMM_E8M0_ENV] = value
    cached = getattr(sys.modules.get("vllm.utils.deep_gemm"), "is_deep_gemm_e8m0_used", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()


# vLLM's DeepGEMM warm-up before the first request (vllm/envs.py, default "relax"): it JIT-compiles the GEMM for a
# ladder of token counts per weight shape. On a fresh H200 (2026-12-05) "relax" ran 1,749 warm-up GEMMs for a 32-layer
# Llama-3-8B-dims engine and had not finished after 280 s (the GRPO benchmark's worker timed out in it); with "skip"
# the kernels compile as first used (CUDA-graph capture included) and that engine started and decoded in ~85 s.
DEEP_GEMM_WARMUP_ENV = "VLLM_DEEP_GEMM_WARMUP"


def apply_deep_gemm_warmup(linear_backend: str | None, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Before an FP8 engine that may run DeepGEMM starts: ``VLLM_DEEP_GEMM_WARMUP=skip`` unless the environment chose
    a warm-up itself. Returns the value set, or None where nothing was set (another backend, or the user's choice)."""
    if linear_backend not in _DEEP_GEMM_BACKENDS or DEEP_GEMM_WARMUP_ENV in env:
        return None
    env[DEEP_GEMM_WARMUP_ENV] = "skip"
    return "skip"


# Added to the error of an FP8 engine that failed to start on DeepGEMM: DeepGEMM compiles its kernels when first used
# (nvcc, the CUDA toolkit's headers), inside the engine's start, so a machine where that fails stops there, with an
# error from deep inside vLLM and DeepGEMM that names no calclip field.
DEEP_GEMM_START_NOTE = (
    "calclip: this FP8 vLLM engine ran its block-FP8 linears on DeepGEMM (vllm_fp8_linear_backend 'fastest' picks it "
    "where vLLM reports DeepGEMM usable and nvcc is found; or 'deep_gemm' set explicitly). DeepGEMM compiles its "
    "kernels with nvcc as they are first used; if this error comes from there, set vllm_fp8_linear_backend: cutlass "
    "(vLLM's CUTLASS block-FP8 GEMM: the same codes and scales, slower decode; docs/vllm.md, Engine configuration)")


def add_exception_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)`` (Python 3.11+), or, on 3.10, the note appended to its message (its ``args[0]``)."""
    if hasattr(err, "add_note"):
        err.add_note(note)
    elif err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{note}", *err.args[1:])


def apply_deep_gemm_e8m0(linear_backend: str | None, power_of_two_scales: bool) -> None:
    """``VLLM_USE_DEEP_GEMM_E8M0`` as ``deep_gemm_e8m0_setting`` says, before a block-FP8 engine starts
    (``set_deep_gemm_e8m0_env``); left alone where that says nothing."""
    value = deep_gemm_e8m0_setting(linear_backend, power_of_two_scales, os.environ)
    if value:
        set_deep_gemm_e8m0_env(value)


def vllm_engine_model(llm) -> tuple[nn.Module, Any]:
    """(the in-process model, its ModelConfig) of a ``vllm.LLM`` whose engine core runs in this process
    (colocate: TRL's ``external_launcher``, or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); TRL 1.16 reads the same path."""
    engine = llm.llm_engine
    runner = engine.model_executor.driver_worker.model_runner
    # With full CUDA graphs (vLLM 0.24's default FULL_AND_PIECEWISE) runner.model is a CUDAGraphWrapper that forwards
    # attribute access to the model; get_model() returns the nn.Module itself (same parameters either way).
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return model, engine.model_config


class _RotaryReloadNotice(logging.Filter):
    """Drops vLLM 0.24's "RotaryEmbedding: Failed to load weights" (``reload/layerwise.py``, a warning on every
    reload, not once): a rotary layer holds a cos/sin cache built from the config, which no checkpoint carries, and
    the reload puts that cache back unchanged (its fallback for layers that loaded nothing). Seen on the H200 at
    every sync, i.e. every optimizer step. Any other layer that loads nothing still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and "Rotary" in str(args[0]))


_RELOAD_LOGGER = _RELOAD_MODULE + ".layerwise"


def reload_weights_layerwise(model: nn.Module, model_config, named_tensors: Iterable[tuple[str, torch.Tensor]]
                             ) -> int:
    """Load checkpoint-format tensors into a live vLLM ``model`` through vLLM's layerwise reload: every layer is
    restored to its ``create_weights`` layout, loaded by its own weight loaders (q/k/v and gate/up shards into the
    fused layers, ``weight_scale_inv`` blocks included), post-processed again, and copied into the storage the
    engine's CUDA graphs read. Returns the number of tensors loaded."""
    reload = __import__(_RELOAD_MODULE, fromlist=["initialize_layerwise_reload"])
    count = 0
    stream = layerwise_reload_stream(named_tensors, begin=lambda: reload.initialize_layerwise_reload(model),
                                     end=lambda: finish_layerwise_reload(model, model_config))
    logger, notice = logging.getLogger(_RELOAD_LOGGER), _RotaryReloadNotice()
    logger.addFilter(notice)
    try:
        for name, tensor in stream:
            model.load_weights([(name, tensor)])
            count += 1
    finally:
        logger.removeFilter(notice)
    return count


# The attention layer's scales that vLLM 0.24 reads for a quantized KV cache: tensors (what the FlashAttention and
# Triton backends' kernels read) and, as ``<name>_float``, their host copies (FlashInfer's).
_KV_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def unit_kv_cache_scales_(model: nn.Module) -> list[str]:
    """Set every FP8 KV-cache attention layer's k/v/q/prob scales to 1.0 in place, the unit scales calclip's
    engines are documented to run (their checkpoints and sync streams carry no KV-cache scale); return the names of
    the layers that held other values.

    Why: the colocated FP8 engine starts from dummy weights (``fp8_engine_kwargs``), and vLLM 0.24's dummy loader
    fills every floating parameter, the attention's k_scale / v_scale / q_scale placeholders included, with uniform
    values in (-1e-3, 1e-3) from a fixed seed. The block-FP8 engine's KV method reads two negative placeholders as
    "none loaded" (1.0; a positive draw would be taken as the scale); the compressed-tensors one (rowwise / tensorwise
    engines) takes them as the scales whatever their sign, so the KV cache was written and read at a scale of about
    -0.001: on the H100 (2026-12-07) such an engine's samples got a mean log-prob of -18.8 under the trainer against
    -4.9 under the engine, greedy agreement 0 (run with vLLM 0.24's own classes on CPU: the placeholder -0.00094
    became the scale). Tensors are filled in place, so the FlashAttention and Triton backends' captured CUDA graphs
    read 1.0; the host copies are set too, but a backend that baked them into a graph at capture (FlashInfer, not in
    the GPU bundle) is not covered. A layer without a quantized KV cache is left alone."""
    fixed = []
    for name, module in model.named_modules():
        dtype = getattr(module, "kv_cache_dtype", None)
        if not isinstance(dtype, str) or not dtype.startswith("fp8"):
            continue
        changed = False
        for attr in _KV_SCALES:
            scale = getattr(module, attr, None)
            if isinstance(scale, torch.Tensor) and not bool((scale == 1.0).all()):
                with torch.no_grad():
                    scale.fill_(1.0)
                changed = True
            host = attr + "_float"
            if isinstance(getattr(module, host, None), float) and getattr(module, host) != 1.0:
                setattr(module, host, 1.0)
                changed = True
        if changed:
            fixed.append(name)
    if fixed:
        _logger.info("vLLM FP8 KV cache: %d attention layer(s) held KV-cache scales other than 1.0 (dummy-weight "
                     "placeholders, e.g. %s); set to 1.0", len(fixed), fixed[0])
    return fixed


def finish_layerwise_reload(model: nn.Module, model_config) -> None:
    """End of every layerwise reload calclip runs: vLLM's ``finalize_layerwise_reload`` (the layers post-processed
    and copied into the storage the CUDA graphs read), then an FP8 KV cache's scales back to 1.0
    (``unit_kv_cache_scales_``), whatever the engine's start or the reload left there."""
    reload = __import__(_RELOAD_MODULE, fromlist=["finalize_layerwise_reload"])
    reload.finalize_layerwise_reload(model, model_config)
    unit_kv_cache_scales_(model)


def sync_fp8_weights(llm, policy: nn.Module, fp8_modules: Mapping[str, Fp8WeightSpec] | None = None) -> int:
    """Push ``policy``'s FP8 codes + scales (and its other parameters) into a colocated block-FP8 ``llm`` the way
    ``FP8VLLMGenerationMixin`` does inside TRL, then reset the prefix cache (its KV blocks were computed with the
    old weights). For scripts and tests that drive ``vllm.LLM`` without TRL. Returns the number of tensors sent."""
    policy = unwrap_model(policy)
    model, model_config = vllm_engine_model(llm)
    count = reload_weights_layerwise(model, model_config,
                                     fp8_weight_sync_tensors(policy, fp8_modules=fp8_modules, live_codes=True))
    llm.reset_prefix_cache()
    return count


def expected_engine_fp8_tensors(policy: nn.Module, packed_modules: Mapping[str, tuple[str, ...]] = LLAMA_PACKED_MODULES,
                                fp8_modules: Mapping[str, Fp8WeightSpec] | None = None) -> dict[str, torch.Tensor]:
    """The FP8 tensors an FP8 vLLM model must hold after a sync of ``policy``, under vLLM's names, in the checkpoint's
    orientation: each fused layer's ``weight`` (codes viewed as uint8, [N, K]) and scale (``weight_scale_inv``
    blocks; ``weight_scale`` [N, 1] for rowwise / tensorwise) are its shards' stacked along dim 0 in
    ``packed_modules`` order (q, k, v; gate, up); unfused FP8 linears keep their own."""
    policy = unwrap_model(policy)
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in fp8_weight_sync_tensors(policy, fp8_modules=fp8_modules):
        leaf = name.rpartition(".")[2]
        if leaf not in ("weight", SCALE_NAME, CHANNEL_SCALE_NAME) or (
                leaf == "weight" and tensor.dtype != torch.float8_e4m3fn):
            continue
        target, _, index = engine_name(name, packed_modules)
        groups.setdefault(target, {})[index] = tensor.view(torch.uint8) if leaf == "weight" else tensor
    return {name: torch.cat([parts[i] for i in sorted(parts)]) for name, parts in groups.items()}


def engine_fp8_mismatches(vllm_model: nn.Module, policy: nn.Module) -> list[str]:
    """Names of the FP8 tensors of a live vLLM model that differ (shape or bits) from what a sync of ``policy``
    sends (``expected_engine_fp8_tensors``); empty when the engine serves exactly the trainer's codes and scales.
    A per-channel engine's FP8 weight, held as the transpose of the loaded [N, K] storage, is compared through
    that transpose (``vllm_direct_sync.rows_view``)."""
    params = dict(vllm_model.named_parameters())
    bad = []
    for name, want in expected_engine_fp8_tensors(policy).items():
        got = params.get(name)
        if got is None:
            bad.append(f"{name}: missing in the engine")
            continue
        got = rows_view(got.data)
        got = got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got
        if (tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype
                or not torch.equal(got, want.to(got.device))):
            bad.append(f"{name}: engine {got.dtype} {tuple(got.shape)}, trainer {want.dtype} {tuple(want.shape)}")
    return bad


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's (DDP/accelerate ``.module``, torch.compile)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def fp8_quantization_config(model: nn.Module, fp8_modules: Mapping[str, Fp8WeightSpec] | None = None) -> dict:
    """The ``quantization_config`` for ``model``'s FP8 recipe, the other linears ignored: block-FP8 (its FP8 linears'
    block size) for blockwise, compressed-tensors per channel for rowwise / tensorwise (calclip.fp8.export)."""
    model = unwrap_model(model)
    if fp8_modules is None:
        fp8_modules = fp8_weight_specs(model)
    return fp8_quantization_config_for(fp8_modules, bf16_linear_names(model, fp8_modules))


# vLLM's ``quantization`` name of each recipe's checkpoint format.
_VLLM_QUANTIZATION = {"blockwise": "fp8", "rowwise": "compressed-tensors", "tensorwise": "compressed-tensors"}
_VLLM_LINEAR = {"blockwise": "block-FP8 linear", "rowwise": "per-channel FP8 linear (compressed-tensors)",
                "tensorwise": "per-channel FP8 linear (compressed-tensors)"}


def output_head_name(model: nn.Module) -> str:
    """The module name (wrapper prefixes stripped) of ``model``'s LM head: transformers' ``get_output_embeddings()``
    where the model has one, else "lm_head" (the Llama family's, what vLLM builds as ``ParallelLMHead``)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        for name, module in model.named_modules():
            if module is head:
                return clean_param_name(name)
    return "lm_head"


def check_vllm_compatible(
    model: nn.Module, *, tensor_parallel_size: int = 1, keep_field: str = "Fp8Config.keep_patterns"
) -> None:
    """Raise with the modules to keep in BF16 when vLLM's FP8 linear for the model's recipe (block-FP8 for
    blockwise, per-channel for rowwise / tensorwise) cannot serve the model's FP8 layers as trained.

    keep_field: the setting the message tells the user to extend (the trainer passes its config field,
    ``fp8_keep_patterns``); the message lists ready-made regexes for it (``vllm_keep_patterns``).
    """
    model = unwrap_model(model)
    specs = fp8_weight_specs(model)
    if not specs:
        return
    recipe = shared_recipe(specs)
    problems = vllm_fp8_problems(linear_shapes(model, specs), specs, tp_size=tensor_parallel_size,
                                 output_head=output_head_name(model))
    if problems:
        lines = "\n".join(f"  {name}: {why}" for name, why in sorted(problems.items()))
        patterns = list(vllm_keep_patterns(problems))
        raise ValueError(
            f"vLLM's {_VLLM_LINEAR[recipe]} cannot serve {len(problems)} FP8 layer(s) of recipe {recipe!r}; keep "
            f"them in BF16 (with their "
            f"fused siblings) for training too, one precision flow, by adding these regexes to {keep_field}:\n"
            f"  {patterns}\nLayers:\n{lines}"
        )


def fp8_engine_kwargs(
    model: nn.Module, *, export_dir: str | None = None, fp8_modules: Mapping[str, Fp8WeightSpec] | None = None
) -> dict[str, Any]:
    """Extra ``vllm.LLM`` arguments that make the engine FP8 with calclip's layer split and the policy's recipe
    (block-FP8, ``quantization="fp8"``; rowwise / tensorwise: per-channel, ``quantization="compressed-tensors"``).

    Without ``export_dir``: keep the engine's model directory (TRL's ``model=<name_or_path>``, or the one
    ``engine_model_kwargs`` writes), override the HF config's ``quantization_config`` and start from dummy weights;
    the first sync loads calclip's codes.
    With ``export_dir`` (a checkpoint from ``export_fp8_checkpoint`` + tokenizer files): load it as is, after
    checking that its ``config.json`` (where the directory has one) carries the format the sync sends
    (``export_config_problems``); a checkpoint of another format raises ValueError naming the keys.
    """
    if fp8_modules is None:
        fp8_modules = fp8_weight_specs(unwrap_model(model))
    quantization = _VLLM_QUANTIZATION[shared_recipe(fp8_modules)]
    if export_dir is not None:
        check_export_config(model, export_dir, fp8_modules)
        return {"model": str(export_dir), "quantization": quantization}
    return {
        "quantization": quantization,
        "hf_overrides": {"quantization_config": fp8_quantization_config(model, fp8_modules)},
        "load_format": "dummy",
    }


def _engine_format(config: Mapping) -> dict[str, Any]:
    """The keys of a ``quantization_config`` that decide how vLLM 0.24 builds, loads and post-processes the FP8
    linears (which method and scheme, which scale parameters, which layers stay BF16); the rest (``fmt``,
    ``quantization_status``, ``calclip_fp8_recipe``) changes nothing there."""
    method = config.get("quant_method")
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        return {
            "quant_method": method,
            "format": config.get("format"),
            "config_groups": {name: {"targets": group.get("targets"), "weights": group.get("weights"),
                                     "input_activations.dynamic": (group.get("input_activations") or {}).get("dynamic")}
                              for name, group in groups.items()},
            "ignore": sorted(config.get("ignore") or []),
        }
    return {
        "quant_method": method,
        "activation_scheme": config.get("activation_scheme"),
        "weight_block_size": config.get("weight_block_size"),
        # vLLM 0.24 reads ignored_layers, falling back to modules_to_not_convert when that is empty
        "ignored_layers": sorted(config.get("ignored_layers") or config.get("modules_to_not_convert") or []),
    }


def export_config_problems(expected: Mapping, found: Mapping | None) -> list[str]:
    """How a checkpoint's ``quantization_config`` (``found``) differs from the one calclip writes for the policy
    (``expected``, ``fp8_quantization_config``) where vLLM would serve it differently (``_engine_format``); empty
    when it serves the sync's format. E.g. compressed-tensors weights of strategy "tensor" instead of "channel":
    vLLM keeps one scale per shard, re-quantizes q/k/v and gate/up to their largest (``requantize_with_max_scale``),
    and refuses the sync's [N, 1] shard scales with a bare AssertionError (benchmarks/probe_vllm_reload_cpu.py,
    ``--engine-weights tensor``)."""
    if not isinstance(found, Mapping):
        return [f"quantization_config: checkpoint {found!r}, policy {expected.get('quant_method')!r}"]
    want, have = _engine_format(expected), _engine_format(found)
    problems = []
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            problems.append(f"quantization_config {key}: checkpoint {have.get(key)!r}, policy {want.get(key)!r}")
    return problems


def check_export_config(model: nn.Module, export_dir: str | os.PathLike,
                        fp8_modules: Mapping[str, Fp8WeightSpec] | None = None) -> None:
    """Raise ValueError when ``export_dir/config.json`` exists and its ``quantization_config`` is not the format
    calclip's sync sends for ``model`` (``export_config_problems``). A directory without one (or a Hub id) is vLLM's
    to read."""
    import json

    path = os.path.join(os.fspath(export_dir), "config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        found = json.load(f).get("quantization_config")
    problems = export_config_problems(fp8_quantization_config(model, fp8_modules), found)
    if problems:
        lines = "\n".join(f"  {line}" for line in problems)
        raise ValueError(
            f"the FP8 engine's checkpoint {path} is not in the format calclip's weight sync sends for this policy, "
            f"so vLLM would hold other codes than the trainer's (or refuse the sync):\n{lines}\nWrite it with "
            "calclip.fp8.export.export_fp8_checkpoint from this policy, or start the engine without export_dir.")


# Under the trainer's output_dir; a leading "_" keeps it out of transformers' hub uploads (ignore_patterns "_*").
ENGINE_MODEL_DIRNAME = "_vllm_engine_model"


def loadable_model_name(name: Any) -> bool:
    """Whether vLLM can take ``name`` as ``LLM(model=...)``: an existing local path, or a valid Hub repo id (which
    vLLM downloads; whether that repo exists is not checked, TRL does not check it either)."""
    if not isinstance(name, (str, os.PathLike)):
        return False
    name = os.fspath(name)
    if os.path.exists(name):
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def write_engine_model_dir(model: nn.Module, processing_class: Any, directory: str) -> str:
    """Write what vLLM reads from a model directory besides the weights into ``directory`` (emptied first): the
    policy's config with ``architectures`` and ``dtype`` filled in as ``save_pretrained`` does, its generation
    config, and the processing class's files (tokenizer, processor). Returns ``directory``."""
    model = unwrap_model(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the wrapped model
    config = copy.deepcopy(base.config)
    config.architectures = config.architectures or [type(base).__name__.removeprefix("FSDP")]
    config.dtype = str(base.dtype).removeprefix("torch.")  # vLLM's dtype="auto" reads it
    shutil.rmtree(directory, ignore_errors=True)  # no file of an earlier run's model is left for vLLM to read
    os.makedirs(directory)
    config.save_pretrained(directory)
    generation_config = getattr(base, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    processing_class.save_pretrained(directory)
    return directory


def engine_model_kwargs(model: nn.Module, processing_class: Any, directory: str | None) -> dict[str, Any]:
    """Extra ``vllm.LLM`` arguments for a colocated engine of ``model``, whose ``LLM(model=model.name_or_path)``
    TRL builds: none when ``name_or_path`` is an existing path or a Hub id (TRL's engine, untouched); otherwise
    (a policy built from a config has ``''``) ``model=<directory>`` written by ``write_engine_model_dir`` and
    ``load_format="dummy"``: TRL syncs the policy's weights before the first rollout (``_last_loaded_step``
    starts at -1). Raises ValueError naming ``model.name_or_path`` when there is nothing to write the directory
    from, or nowhere to write it."""
    name = getattr(model, "name_or_path", None)
    if loadable_model_name(name):
        return {}
    if directory is None:
        problem = "no directory was given to write its config and tokenizer to"
    elif processing_class is None or not hasattr(processing_class, "save_pretrained"):
        problem = "there is no processing class (tokenizer) to write next to its config for vLLM"
    elif not hasattr(getattr(unwrap_model(model), "config", None), "save_pretrained"):
        problem = "the policy has no transformers config to write for vLLM"
    else:
        return {"model": write_engine_model_dir(model, processing_class, directory), "load_format": "dummy"}
    raise ValueError(
        f"vLLM's colocated engine is built from model.name_or_path, which is {name!r} (neither an existing local path "
        f"nor a Hub repo id), and {problem}. Save the policy and its tokenizer with save_pretrained(<dir>) and set "
        "model.name_or_path = <dir> before building the trainer."
    )


@contextlib.contextmanager
def merged_call_kwargs(namespace: Any, attr: str, extra: Mapping[str, Any]):
    """Temporarily replace ``namespace.attr`` (a callable) by one that merges ``extra`` into its kwargs
    (``merge_engine_kwargs``)."""
    original = getattr(namespace, attr)

    def call(*args, **kwargs):
        return original(*args, **merge_engine_kwargs(kwargs, extra))

    setattr(namespace, attr, call)
    try:
        yield
    finally:
        setattr(namespace, attr, original)


def layerwise_reload_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    begin: Callable[[], None],
    end: Callable[[], None],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``named_tensors``, calling ``begin()`` before the first item and ``end()`` after the last one.

    ``end`` runs only when the stream is exhausted: a sync that fails half-way leaves vLLM in reload state and
    the exception propagates (the engine must not generate from half-loaded weights).
    """
    begin()
    yield from named_tensors
    end()


def engine_speed_kwargs(*, kv_cache_dtype: str = "auto", async_scheduling: bool | None = None,
                        max_num_batched_tokens: int | None = None,
                        max_cudagraph_capture_size: int | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments for the colocated engine's speed options, only those that differ from what TRL 1.16
    builds today (``LLM(...)`` without kv_cache_dtype / async_scheduling / compilation_config,
    ``max_num_batched_tokens=4096``), so the defaults change nothing. kv_cache_dtype "auto" is the model's dtype;
    async_scheduling None is vLLM's choice; max_cudagraph_capture_size None gives no argument (the colocated
    engine then captures up to its max_num_seqs, ``ColocateEngineMixin``; vLLM's own default is twice that, at most
    512: sizes a batch of at most max_num_seqs decoding sequences never replays)."""
    kwargs: dict[str, Any] = {}
    if kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if async_scheduling is not None:
        kwargs["async_scheduling"] = bool(async_scheduling)
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = int(max_num_batched_tokens)
    if max_cudagraph_capture_size is not None:
        kwargs["compilation_config"] = {"max_cudagraph_capture_size": int(max_cudagraph_capture_size)}
    return kwargs


# The process-wide cache directories vLLM 0.24 moves to its own compile cache when an engine compiles
# (``InductorAdaptor.initialize_cache``: ``<VLLM_CACHE_ROOT>/torch_compile_cache/<hash>/rank_<r>_<dp>``, the hash
# covering the model's path and config): Inductor's (FX graphs, AOTAutograd, autotuning) and Triton's (compiled kernels,
# and the autotuning timings ``triton.autotune(cache_results=True)`` keeps there).
COMPILE_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@contextlib.contextmanager
def compile_cache_dirs_kept():
    """Around a colocated engine's start: afterwards the trainer's compile and Triton caches are where they were
    (``COMPILE_CACHE_ENV`` restored, unset if they were, and Inductor's memoized paths cleared, as torch's own
    ``temporary_cache_dir`` does). Without it every compile after the engine's start (``compile_layers``' graphs,
    calclip's Triton kernels and their autotuning) lands in the engine's cache directory, a new one whenever the
    engine's model path is new (each run's ``engine-model`` directory, a temporary one), so each such process
    compiled and autotuned everything again (docs/vllm.md, Engine options)."""
    saved = {name: os.environ.get(name) for name in COMPILE_CACHE_ENV}
    try:
        yield
    finally:
        moved = [name for name, value in saved.items() if os.environ.get(name) != value]
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        clear = getattr(sys.modules.get("torch._inductor.utils"), "clear_caches", None)
        if moved and clear is not None:
            clear()
        if moved:
            _logger.info("the vLLM engine's start moved %s; restored for the trainer's own compiles",
                         ", ".join(moved))


@contextlib.contextmanager
def gc_paused(pause: bool = True):
    """Python's garbage collector off for the block (a colocated rollout), back on after it, unless it was off
    already or ``pause`` is False. vLLM's engine allocates Python objects for every sequence at every decode step
    (outputs, log-prob lists), so the collector runs hundreds of times per rollout, each run walking the objects of
    the trainer process that vLLM's start-up did not freeze. Reference counting still frees everything acyclic
    at once; cycles made during the rollout wait for the first collection after it."""
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def colocate_sampling_defaults(detokenize: bool | None, generation_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``SamplingParams`` defaults of the colocated engine's rollouts, applied under the user's
    ``generation_kwargs`` (the trainer's ``vllm_detokenize``). TRL reads only token ids and log-probs, so by default
    (None) vLLM does not detokenize, unless ``generation_kwargs`` sets ``detokenize`` itself or has ``stop``
    strings, which vLLM matches on the text. True / False: that value. Raises ValueError (naming both fields)
    where ``generation_kwargs`` contradicts an explicit value or has stop strings that False would refuse."""
    kwargs = dict(generation_kwargs or {})
    if "detokenize" in kwargs:
        if detokenize is not None and bool(kwargs["detokenize"]) != detokenize:
            raise ValueError(f"vllm_detokenize={detokenize} contradicts generation_kwargs['detokenize']="
                             f"{kwargs['detokenize']!r}: set one of them")
        return {}
    stop = kwargs.get("stop")
    if stop and detokenize is False:
        raise ValueError(f"vllm_detokenize=False with generation_kwargs['stop']={stop!r}: vLLM matches stop strings "
                         f"on the detokenized text; use null (on when stop strings are given) or true")
    if detokenize is None:
        return {} if stop else {"detokenize": False}
    return {"detokenize": bool(detokenize)}


def capture_size_for_batch(max_num_seqs: int) -> int:
    """The smallest ``max_cudagraph_capture_size`` whose capture list (vLLM 0.24: 1, 2, 4, multiples of 8 below 256,
    multiples of 16 from 256) still holds a graph for a batch of ``max_num_seqs`` decoding sequences: the batch
    rounded up to the next size of that list, at most vLLM's own 512. (vLLM truncates any other value down to a
    size of the list, which would leave the full batch without a graph.)"""
    n = int(max_num_seqs)
    if n <= 4:
        return next(size for size in (1, 2, 4) if size >= n)
    step = 8 if n <= 256 else 16
    return min(-(-n // step) * step, 512)


def merge_engine_kwargs(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from ``layers``, later ones winning, except that their ``compilation_config``
    dicts are merged key by key (the FP8 numerics' pass switches and a speed option's capture size both live
    there; a plain update would drop one)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key == "compilation_config" and isinstance(merged.get(key), Mapping) and isinstance(value, Mapping):
                value = {**merged[key], **value}
            merged[key] = value
    return merged


class ColocateEngineMixin:
    """Mix in before TRL's ``VLLMGeneration``: the colocated engine starts for a policy without a loadable
    ``name_or_path`` too (``engine_model_kwargs``); server mode and policies with a path get TRL's ``_init_vllm``.

    Attributes read (set them on the class or instance before ``__init__`` runs ``_init_vllm``):
      engine_model_root: where a pathless policy's engine directory is written, one ``rank-<process index>``
        folder per process (each colocated process builds its own engine); None: such a policy is refused.
      engine_options: extra ``vllm.LLM`` arguments of the colocated engine, BF16 and FP8 alike (the trainer's
        ``vllm_kv_cache_dtype`` / ``vllm_async_scheduling`` / ``vllm_max_num_batched_tokens`` /
        ``vllm_max_cudagraph_capture_size``, through ``engine_speed_kwargs``); merged over TRL's arguments and the
        mixin's default capture size, ``capture_size_for_batch`` of TRL's ``max_num_seqs``.
      sampling_defaults: ``SamplingParams`` arguments of the colocated engine's rollouts under the user's
        ``generation_kwargs`` (``colocate_sampling_defaults``: detokenization off); server mode keeps TRL's.
      pause_gc: the garbage collector is off during each colocated rollout (``gc_paused``; default True).
    """

    engine_model_root: str | None = None
    engine_options: Mapping[str, Any] | None = None
    sampling_defaults: Mapping[str, Any] | None = None
    pause_gc: bool = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mode == "colocate" and self.sampling_defaults:
            # TRL's colocated generate updates its SamplingParams arguments with self.generation_kwargs
            self.generation_kwargs = {**self.sampling_defaults, **self.generation_kwargs}

    def _init_vllm(self):
        return self._start_engine()

    def generate(self, *args, **kwargs):
        with gc_paused(self.pause_gc and self.mode == "colocate"):
            return super().generate(*args, **kwargs)

    def _engine_kwargs(self) -> dict[str, Any]:
        """The extra ``vllm.LLM`` arguments of the colocated engine."""
        root = self.engine_model_root
        directory = None if root is None else os.path.join(root, f"rank-{self.accelerator.process_index}")
        return engine_model_kwargs(self.model, self.processing_class, directory)

    def _start_engine(self):
        if self.mode != "colocate":
            return super()._init_vllm()
        import trl.generation.vllm_generation as trl_vllm_generation

        # CUDA graphs up to the batch this engine decodes (TRL's max_num_seqs), unless the options give a size
        seqs = getattr(self, "max_num_seqs", None)
        capture = ({"compilation_config": {"max_cudagraph_capture_size": capture_size_for_batch(seqs)}}
                   if isinstance(seqs, int) else {})
        extra = merge_engine_kwargs(self._engine_kwargs(), capture, self.engine_options or {})
        with merged_call_kwargs(trl_vllm_generation, "LLM", extra), compile_cache_dirs_kept():
            return super()._init_vllm()  # TRL's: LLM(...), sleep mode, barrier


class FP8VLLMGenerationMixin(ColocateEngineMixin):
    """Mix in before TRL's ``VLLMGeneration``: FP8 weights + scales in the sync, an FP8 engine of the policy's recipe.

    Attributes read (set them on the class or instance before ``__init__`` runs ``_init_vllm``), besides
    ``ColocateEngineMixin``'s:
      fp8_export_dir: optional checkpoint directory for the engine (see ``fp8_engine_kwargs``).
      fp8_check_vllm_shapes: raise early when vLLM cannot serve an FP8 layer (default True).
      fp8_engine_extra: extra ``vllm.LLM`` arguments merged into the colocated engine's (default:
        ``fp8_engine_numerics_kwargs()``); the trainer passes its ``vllm_fp8_*`` fields through it.
      fp8_defer_engine: colocate mode only: ``__init__`` does not start the engine; ``start_fp8_engine()`` does,
        once the policy has been quantized (default False). TRL constructs the generation object inside
        ``GRPOTrainer.__init__``, before a trainer can quantize its policy; the engine's layer split
        (``modules_to_not_convert``) must come from the quantized model, not be predicted from a config.
      fp8_direct_sync: colocate mode only: after the first sync (through vLLM's layerwise reload), check the
        engine's layout and, where it holds every tensor as loaded, do the later syncs as in-place copies
        (``calclip.rollout.vllm_direct_sync``; default True). False: every sync goes through the reload.
    """

    fp8_export_dir: str | None = None
    fp8_check_vllm_shapes: bool = True
    fp8_defer_engine: bool = False
    fp8_engine_extra: Mapping[str, Any] | None = None
    fp8_direct_sync: bool = True
    _fp8_engine_pending: bool = False
    _direct_sync: DirectSync | None = None
    _fp8_linear_backend: str | None = None  # the backend of the engine last started (``_engine_kwargs``)

    def _fp8_specs(self) -> dict[str, Fp8WeightSpec]:
        specs = getattr(self, "_calclip_fp8_specs", None)
        if specs is None:
            specs = fp8_weight_specs(unwrap_model(self.model))
            if not specs:  # an FP8 engine would be fed BF16 weights it cannot load
                raise ValueError("FP8 vLLM generation needs an FP8 policy: convert it with quantize_model first")
            self._calclip_fp8_specs = specs
        return specs

    def _init_vllm(self):
        if self.mode == "colocate" and self.fp8_defer_engine:
            self._fp8_engine_pending = True  # start_fp8_engine() builds it
            return None
        return self._start_engine()

    def start_fp8_engine(self) -> None:
        """Start the engine deferred by ``fp8_defer_engine`` (no-op when none is pending, e.g. server mode)."""
        if self._fp8_engine_pending:
            self._start_engine()
            self._fp8_engine_pending = False

    def _start_engine(self):
        if self.mode == "colocate":  # a server was started from the exported checkpoint (docs/vllm.md)
            if self.fp8_check_vllm_shapes:
                check_vllm_compatible(self.model, tensor_parallel_size=self.tensor_parallel_size)
            self._calclip_fp8_specs = None  # the model's layer split as it is now, for the engine and every sync
            self._direct_sync = None  # a new engine: its layout is checked again after its first sync
            if shared_recipe(self._fp8_specs()) == "tensorwise":
                _logger.warning(TENSORWISE_ACTIVATION_NOTE)
        self._fp8_linear_backend = None
        try:
            return super()._start_engine()
        except Exception as err:
            if self._fp8_linear_backend == "deep_gemm":
                add_exception_note(err, DEEP_GEMM_START_NOTE)
            raise

    def _engine_kwargs(self) -> dict[str, Any]:
        specs = self._fp8_specs()
        fp8 = fp8_engine_kwargs(self.model, export_dir=self.fp8_export_dir, fp8_modules=specs)
        recipe = shared_recipe(specs)
        numerics = (fp8_engine_numerics_kwargs(recipe=recipe) if self.fp8_engine_extra is None
                    else self.fp8_engine_extra)
        backend = numerics.get("linear_backend")
        problem = linear_backend_problem(recipe, backend)
        if problem:  # vLLM would refuse it only after loading the model
            raise ValueError(f"vllm_fp8_linear_backend: {problem}")
        self._fp8_linear_backend = backend  # what the engine about to start runs (a failed start names it)
        block_specs = [spec for spec in specs.values() if spec.blockwise]  # DeepGEMM serves block layers only
        if block_specs:
            apply_deep_gemm_e8m0(backend, all(spec.power_of_two_scales for spec in block_specs))
            apply_deep_gemm_warmup(backend)
        model_dir = {} if self.fp8_export_dir is not None else super()._engine_kwargs()  # the export has its own
        return {**model_dir, **numerics, **fp8}

    def sync_weights(self):
        if self._fp8_engine_pending:
            raise RuntimeError("the FP8 vLLM engine has not been started: call start_fp8_engine() after quantizing")
        return super().sync_weights()

    def _vllm_model_and_config(self):
        return vllm_engine_model(self.llm)

    def _checkpoint_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """TRL's parameter stream with every FP8 linear's weight as codes + ``weight_scale_inv``: the layers' own
        codes, brought up to date (``quantize_named_params``' ``live_layers``), except under PEFT, whose merge and
        unmerge write the weights through ``.data`` around the stream (codes refreshed from the merged weights would
        look current to the next training forward): there each weight is quantized again, as exported."""
        model = unwrap_model(self.model)
        live = None if getattr(model, "peft_config", None) else live_fp8_layers(model)
        return quantize_named_params(super()._iter_named_params(), self._fp8_specs(), scale_name=SCALE_NAME,
                                     live_layers=live)

    def _iter_named_params(self):
        stream = self._checkpoint_stream()
        if self.mode != "colocate":
            return stream
        model, model_config = self._vllm_model_and_config()
        if self.fp8_direct_sync and self._direct_sync is None:
            self._direct_sync = DirectSync(LLAMA_PACKED_MODULES)
        direct = self._direct_sync if self.fp8_direct_sync else None
        if direct is not None and direct.verified:
            return _consume(lambda: direct.copy(dict(model.named_parameters()), stream))
        reload = __import__(_RELOAD_MODULE, fromlist=["initialize_layerwise_reload"])

        def end() -> None:
            finish_layerwise_reload(model, model_config)
            if direct is not None and not direct.checked:
                self._check_direct_sync(direct, model)

        return layerwise_reload_stream(stream, begin=lambda: reload.initialize_layerwise_reload(model), end=end)

    def _check_direct_sync(self, direct: DirectSync, model: nn.Module) -> None:
        """After the engine's first reload: compare it with a second pass of the stream (``DirectSync.verify``)."""
        if direct.verify(dict(model.named_parameters()), self._checkpoint_stream()):
            _logger.info("vLLM weight sync: the engine holds every tensor as loaded; later syncs copy in place")
        else:
            _logger.warning("vLLM weight sync stays on vLLM's layerwise reload (slower): %s", direct.reason)


def _consume(work: Callable[[], Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """An empty stream that runs ``work`` when iterated: TRL's colocate loop then loads nothing itself."""
    work()
    yield from ()


def vllm_generation_class(base: type | None = None) -> type:
    """``CalclipVLLMGeneration``: ``ColocateEngineMixin`` over TRL's ``VLLMGeneration`` (BF16 rollouts)."""
    if base is None:
        from trl.generation.vllm_generation import VLLMGeneration as base
    return type("CalclipVLLMGeneration", (ColocateEngineMixin, base), {})


def fp8_vllm_generation_class(base: type | None = None) -> type:
    """``FP8VLLMGeneration``: the mixin over TRL's ``VLLMGeneration`` (imported lazily; TRL needs no vLLM)."""
    if base is None:
        from trl.generation.vllm_generation import VLLMGeneration as base
    return type("FP8VLLMGeneration", (FP8VLLMGenerationMixin, base), {})


@contextlib.contextmanager
def _grpo_generation_class(make: Callable[[type], type], **attributes):
    """While active, ``GRPOTrainer.__init__`` builds ``make(TRL's VLLMGeneration)`` with ``attributes`` set on the
    class. ``trl.trainer.grpo_trainer`` imports ``VLLMGeneration`` into its namespace and calls it once there."""
    import trl.trainer.grpo_trainer as grpo_module

    original = grpo_module.VLLMGeneration
    cls = make(original)
    for name, value in attributes.items():
        setattr(cls, name, value)
    grpo_module.VLLMGeneration = cls
    try:
        yield cls
    finally:
        grpo_module.VLLMGeneration = original


def use_vllm_generation(*, engine_model_root: str | None = None, engine_options: Mapping[str, Any] | None = None,
                        sampling_defaults: Mapping[str, Any] | None = None, pause_gc: bool = True):
    """While active, ``GRPOTrainer.__init__`` builds a ``CalclipVLLMGeneration``: TRL's BF16 engine and sync, which
    also starts for a policy without a loadable ``name_or_path`` (its directory written under
    ``engine_model_root``, see ``ColocateEngineMixin``), with ``engine_options`` merged into its ``LLM(...)``,
    ``sampling_defaults`` under its rollouts' ``generation_kwargs`` and the garbage collector paused during its
    colocated rollouts with ``pause_gc``."""
    return _grpo_generation_class(vllm_generation_class, engine_model_root=engine_model_root,
                                  engine_options=None if engine_options is None else dict(engine_options),
                                  sampling_defaults=None if sampling_defaults is None else dict(sampling_defaults),
                                  pause_gc=bool(pause_gc))


def use_fp8_vllm_generation(
    *, export_dir: str | None = None, check_vllm_shapes: bool = True, defer_engine: bool = False,
    engine_kwargs: Mapping[str, Any] | None = None, engine_model_root: str | None = None, direct_sync: bool = True,
    engine_options: Mapping[str, Any] | None = None, sampling_defaults: Mapping[str, Any] | None = None,
    pause_gc: bool = True,
):
    """While active, ``GRPOTrainer.__init__`` builds an ``FP8VLLMGeneration`` instead of TRL's class.

    ``engine_kwargs``: the colocated engine's extra ``vllm.LLM`` arguments (None: ``fp8_engine_numerics_kwargs()``).
    ``engine_model_root``: see ``ColocateEngineMixin`` (a policy without a loadable ``name_or_path``).
    ``direct_sync``: ``FP8VLLMGenerationMixin.fp8_direct_sync`` (in-place syncs once the engine's layout is checked).
    ``engine_options``: ``ColocateEngineMixin.engine_options`` (``engine_speed_kwargs``); ``sampling_defaults``:
    ``ColocateEngineMixin.sampling_defaults`` (``colocate_sampling_defaults``); ``pause_gc``:
    ``ColocateEngineMixin.pause_gc``.
    With ``defer_engine`` (what ``CalibratedGRPOTrainer`` uses, since it quantizes after ``super().__init__()``):

        with use_fp8_vllm_generation(defer_engine=True):
            super().__init__(...)
        quantize_model(self.model, fp8_config)
        self.vllm_generation.start_fp8_engine()
    """
    return _grpo_generation_class(
        fp8_vllm_generation_class, fp8_export_dir=export_dir, fp8_check_vllm_shapes=check_vllm_shapes,
        fp8_defer_engine=defer_engine, fp8_engine_extra=None if engine_kwargs is None else dict(engine_kwargs),
        engine_model_root=engine_model_root, fp8_direct_sync=direct_sync,
        engine_options=None if engine_options is None else dict(engine_options),
        sampling_defaults=None if sampling_defaults is None else dict(sampling_defaults), pause_gc=bool(pause_gc),
    )
