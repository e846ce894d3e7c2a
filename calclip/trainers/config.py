"""Configuration of the calibrated trainers: flat ``GRPOConfig`` fields, so ``TrlParser`` reads YAML and CLI
overrides unchanged.

Every new field is documented once (``metadata["help"]``) and validated in ``__post_init__`` with a message that
names the field and its allowed values. Every ``GRPOConfig`` field keeps its meaning; the few TRL loss options the
calibrated loss does not implement are rejected here (named) rather than silently ignored.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from calclip.calibration import DEFAULT_MIN_TOKENS
from calclip.calibration import SCHEDULES as CALIBRATION_SCHEDULES
from calclip.calibration import UPPER_MODES as CALIBRATION_UPPER_MODES
from calclip.clipping import ClipFields, clip_mode_class, registered_clip_modes
from calclip.fp8.config import BACKWARD_MODES as FP8_BACKWARD_MODES
from calclip.fp8.config import GEMM_BACKENDS as FP8_GEMM_BACKENDS
from calclip.fp8.config import Fp8Config, check_fp8_combination, check_keep_patterns, fp8_recipe_names
from calclip.losses.aggregation import AGGREGATIONS
from calclip.losses.importance import IS_MODES as TIS_MODES
from calclip.rollout.compiled_layers import check_layer_shapes
from calclip.rollout.vllm_sync import colocate_sampling_defaults, linear_backend_problem
from calclip.run.config_file import bounded_repr
from calclip.monitoring.callbacks import SPIKE_WINDOW_MAX
from calclip.run.field_checks import check_field_types, check_inherited_ranges, resume_flag

# The allowed values come from the modules that implement them, so the config and the code cannot disagree.
CLIP_MODES = registered_clip_modes()  # the built-in modes (calclip.clipping's registry at import)
FP8_RECIPES = fp8_recipe_names()
OLD_LOGPS_SOURCES = ("trainer", "rollout")
# vLLM 0.24 kv_cache_dtype values for a dense policy: the model dtype, or FP8 (fp8 is fp8_e4m3 on CUDA).
VLLM_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Aggregations the calibrated loss reproduces exactly (TRL 1.16 normalizations).
SUPPORTED_LOSS_TYPES = AGGREGATIONS
_DEFAULT_RAIL_NOTE = (" (unset, calibration_low_max is 1 - epsilon and calibration_high_min is 1 + epsilon_high: the "
                      "calibrated trust region is never tighter than the static one)")

# The trainer config's fp8_* fields and the Fp8Config option each one sets: the trainer builds its Fp8Config from
# this table (``CalibratedGRPOConfig.fp8_config``) and the config applies Fp8Config's rules between options to the
# same values (``_validate_fp8``), so a new FP8 knob is its field plus one line here. A field is always "fp8_" + the
# option's name (``_fp8_field`` spells Fp8Config's messages that way).
FP8_CONFIG_FIELDS: dict[str, str] = {
    "fp8_recipe": "recipe",
    "fp8_backward": "backward",
    "fp8_gemm": "gemm",
    "fp8_power_of_two_scales": "power_of_two_scales",
    "fp8_keep_first_n_layers": "keep_first_n_layers",
    "fp8_keep_last_n_layers": "keep_last_n_layers",
    "fp8_keep_patterns": "keep_patterns",  # plus "lm_head", always (fp8_config)
    "fp8_decode_fused_max_m": "decode_fused_max_m",
    "fp8_decode_group_siblings": "decode_group_siblings",
    "fp8_share_sibling_inputs": "share_sibling_inputs",
    "fp8_fuse_producers": "fuse_producers",
    "fp8_resident_dgrad_codes": "resident_dgrad_codes",
    "fp8_resident_weight_codes": "resident_weight_codes",
}
# fp8_* fields that are the trainer's own, not Fp8Config options (none yet; ``fp8`` itself switches FP8 on).
TRAINER_ONLY_FP8_FIELDS: tuple[str, ...] = ()
# Fp8Config options with no trainer field, and why: set by the trainer itself, or left at Fp8Config's default.
FP8_OPTIONS_WITHOUT_FIELD: dict[str, str] = {
    "cache_weights": "set by the trainer: off when accelerate shards the parameters (FSDP, ZeRO-3)",
    "block_size": "128: the only block the GPU kernels and vLLM's block-FP8 layers take",
    "keep_last_fraction": "fp8_keep_last_n_layers says it in layers",
    "scaled_mm_row_scales": "automatic: on wherever it applies",
    "refresh_graph": "on; CALCLIP_REFRESH_GRAPH=0 switches it off for the process",
}


def _fp8_field(name: str) -> str:
    """An Fp8Config option's name as a trainer config field (Fp8Config.gemm is fp8_gemm)."""
    return f"fp8_{name}"


def _one_of(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _int_at_least(name: str, value, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {allowed}, got {bounded_repr(value)}")


@dataclass
class CalibratedGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus FP8 block quantization, Calibrated Clipping, rollout correction (TIS) and monitoring.

    The clip bounds are ratio bounds ``[low, high]``. ``static``/``clip_higher``/``dual_clip`` use
    ``[1 - epsilon, 1 + epsilon_high]``; ``calibrated`` starts at ``calibration_init_bounds`` and then applies the
    calibrator's bounds (docs/DESIGN.md, "The calibration, defined exactly"), with ``epsilon``/``epsilon_high`` as the
    BF16 base bounds the calibration matches.
    """

    # ---- clipping ----
    clip_mode: str = field(
        default="calibrated",
        metadata={
            "help": "How the PPO ratio is clipped. 'static': [1-epsilon, 1+epsilon_high] (TRL's). 'clip_higher': the "
            "same with epsilon_high defaulting to 0.28 (DAPO). 'dual_clip': static bounds plus the dual-clip floor "
            "dual_clip_c*A for A<0 tokens. 'calibrated': bounds fitted to BF16 shadow ratio quantiles "
            "(Calibrated Clipping). 'oracle': a reference arm, not a method: per token, clip exactly the tokens "
            "whose BF16 shadow ratio leaves [1-epsilon, 1+epsilon_high] (a BF16 shadow forward on every off-policy "
            "mini-batch); the best any calibration can do."
        },
    )
    dual_clip_c: float = field(
        default=3.0,
        metadata={"help": "Dual-clip constant c > 1: the loss of an A<0 token is at most -c*A. Used by clip_mode "
                  "'dual_clip'."},
    )

    # ---- calibration ----
    calibration_schedule: str = field(
        default="interval",
        metadata={
            "help": "'interval': recalibrate every calibration_interval optimizer steps with two BF16 shadow "
            "forwards and hold [L, H] in between (the paper's). 'every_step': keep alpha and p from the last shadow "
            "calibration and refit L and H on every off-policy mini-batch's FP8 ratios."
        },
    )
    calibration_interval: int = field(
        default=20,
        metadata={"help": "Optimizer steps between BF16 shadow calibrations (also the cadence of the FP8-vs-BF16 "
                  "monitoring in the other clip modes)."},
    )
    calibration_ema: float = field(
        default=0.0,
        metadata={"help": "EMA weight in [0, 1) of the previous bounds: bound <- ema*bound + (1-ema)*new. The first "
                  "calibration replaces the initial bounds."},
    )
    calibration_upper: str = field(
        default="balance",
        metadata={"help": "Upper bound rule: 'balance' (match the BF16 update-mass balance, the paper's), "
                  "'quantile' (BF16 upper-clip share), 'fixed' (1+epsilon_high)."},
    )
    calibration_init_bounds: list[float] = field(
        default_factory=lambda: [0.6, 1.8],
        metadata={"help": "Ratio bounds [low, high] in force before the first calibration."},
    )
    calibration_min_tokens: int = field(
        default=DEFAULT_MIN_TOKENS,
        metadata={"help": "Fewest A<0 tokens (and A>0 tokens, unless calibration_upper is 'fixed') over all ranks that "
                  "a calibration may rest on. Every moved mini-batch of a generation round is pooled, and further "
                  "rounds until the pool holds this many; below it the bounds in force stay (calib/fit 0)."},
    )
    calibration_low_min: float = field(default=0.2, metadata={"help": "Lower rail of the calibrated low bound."})
    calibration_low_max: float | None = field(
        default=None,
        metadata={"help": "Upper rail of the calibrated low bound. None (default): 1 - epsilon, so the calibrated "
                  "trust region is never tighter than the static one below (FP8 noise widens the ratios; a fit above "
                  "1 - epsilon is noise). Up to 1.0 opens the rail."},
    )
    calibration_high_min: float | None = field(
        default=None,
        metadata={"help": "Lower rail of the calibrated high bound. None (default): 1 + epsilon_high (never tighter "
                  "than static above). Down to 1.0 opens the rail."},
    )
    calibration_high_max: float = field(default=5.0, metadata={"help": "Upper rail of the calibrated high bound."})

    # ---- rollout correction ----
    tis_mode: str = field(
        default="none",
        metadata={
            "help": "Rollout-correction importance weights pi_old/pi_rollout multiplying the per-token loss: 'none', "
            "'token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'. Rollout log-probs come from "
            "vLLM or, on the transformers generate path, from the processed scores of the sampled tokens."
        },
    )
    tis_cap: float = field(default=2.0, metadata={"help": "Upper cap C of the TIS/MIS weights (truncate or mask)."})
    tis_lower_cap: float | None = field(
        default=None, metadata={"help": "Optional lower cap of the TIS/MIS weights (truncate or mask below it)."}
    )
    old_logps_source: str = field(
        default="trainer",
        metadata={
            "help": "'trainer': old log-probs from the trainer's forward at generation time (TRL's). 'rollout' "
            "(bypass): the rollout's sampled-token log-probs are the old log-probs, so the ratio also carries the "
            "rollout/trainer mismatch."
        },
    )

    # ---- FP8 ----
    fp8: bool = field(
        default=True,
        metadata={"help": "Quantize the policy's linear layers to FP8 (the recipe of fp8_recipe) for rollout and "
                  "training alike. Off: the policy trains in its own dtype."},
    )
    fp8_recipe: str = field(
        default="blockwise",
        metadata={"help": f"FP8 scaling granularity, one of {FP8_RECIPES}. 'blockwise': calclip's DeepSeek-V3 "
                  "kernels (1x128 activation groups, 128x128 weight blocks; the only recipe with vLLM rollouts). "
                  "'rowwise' / 'tensorwise': torchao's float8 training (pip install \"calclip[torchao]\"), coarser "
                  "scales; they need fp8_backward 'fp8' and fp8_gemm other than 'triton'."},
    )
    fp8_backward: str = field(
        default="fp8", metadata={"help": "'fp8': dgrad/wgrad GEMMs in FP8. 'bf16': straight-through BF16 backward."}
    )
    fp8_gemm: str = field(
        default="auto", metadata={"help": "FP8 GEMM backend: 'auto' (cuBLAS blockwise; calclip's split-K Triton GEMM "
                                  "for forward GEMMs of few rows whose output has too few tiles for the GPU, e.g. "
                                  "decode), 'scaled_mm' (cuBLAS wherever it supports the shape), 'triton' or "
                                  "'emulated' (CPU)."}
    )
    fp8_keep_first_n_layers: int = field(default=0, metadata={"help": "First decoder layers kept in BF16."})
    fp8_keep_last_n_layers: int = field(default=0, metadata={"help": "Last decoder layers kept in BF16."})
    fp8_keep_patterns: list[str] = field(
        default_factory=lambda: ["lm_head"],
        metadata={"help": "Regexes (re.search on module names) of linear layers kept in BF16. The LM head always "
                  "stays BF16 (TRL's fused log-prob head reads lm_head.weight directly)."},
    )
    fp8_power_of_two_scales: bool = field(
        default=False, metadata={"help": "Round every FP8 scale up to a power of two (any fp8_recipe). Off by "
                                 "default: with fp32 master weights loaded from bf16 (or coarser) values, a "
                                 "tiny update moves many FP8 weight codes a whole step (docs/usage.md, FP8 "
                                 "recipes)."}
    )
    fp8_decode_fused_max_m: int | None = field(
        default=None, metadata={"help": "Fused decode: the most tokens a no-grad FP8 forward (rollout decode: batch "
                                "rows) may have to quantize its input inside the GEMM, one kernel launch per linear "
                                "instead of two (Fp8Config.decode_fused_max_m, fp8_recipe 'blockwise', same FP8 "
                                "codes). None (default): eager CUDA generation up to 256 rows, where the H200 "
                                "measured it faster (not inside compile_generation's CUDA graphs, where it measured "
                                "slower); 0: off; N: up to N rows, eager and compiled, on CUDA."}
    )
    fp8_decode_group_siblings: bool = field(
        default=False, metadata={"help": "Experimental (docs/usage.md, Experimental FP8 options): in fused decode "
                                 "calls, run a decoder layer's q/k/v projections as one launch and gate/up as one "
                                 "(Fp8Config.decode_group_siblings, fp8_recipe 'blockwise'; same FP8 codes and "
                                 "outputs). Off until measured on a GPU."}
    )
    fp8_share_sibling_inputs: bool = field(
        default=True, metadata={"help": "A decoder layer's q/k/v projections quantize the input they read once, and "
                                "gate/up once, in training and no-grad forwards (not decode): 4 input "
                                "quantizations per layer instead of 7 and one saved copy of the 128x1 codes "
                                "(Fp8Config.share_sibling_inputs, fp8_recipe 'blockwise'; same FP8 codes, outputs "
                                "and gradients). Faster and lighter on the H200 (docs/benchmarks.md, FP8 at real "
                                "model shapes)."}
    )
    fp8_fuse_producers: bool = field(
        default=False, metadata={"help": "Quantize a decoder layer's shared inputs (RMSNorm -> q/k/v and gate/up, "
                                 "SiLU(gate)*up -> down_proj) in the kernels that produce them (Fp8Config."
                                 "fuse_producers, calclip.fp8.producers; Llama / Mistral / Qwen2 / Qwen3 layers, "
                                 "others keep the separate quantizers). Same outputs, codes and gradients bit for bit "
                                 "(CPU and H100 tests); off: compiled by layer it bought 1.01x and no memory at "
                                 "Qwen2.5-7B dims (H100). Needs fp8_share_sibling_inputs."}
    )
    fp8_resident_dgrad_codes: bool = field(
        default=False, metadata={"help": "Keep the W^T weight codes the backward's dgrad GEMM reads resident beside "
                                 "the W codes (a second 1-byte-per-parameter copy); false (default) transposes them "
                                 "from the W codes in each backward (exact), which measured faster and 0.65 GiB "
                                 "smaller at Qwen2.5-7B dims on the H100 (Fp8Config.resident_dgrad_codes)."}
    )
    fp8_resident_weight_codes: bool = field(
        default=True, metadata={"help": "Keep the FP8 layers' W codes resident between calls (1 byte per FP8 "
                                "parameter); false quantizes each weight in every forward and its W^T in the backward "
                                "(exact, the same codes) and holds codes only during generation, so FP8 keeps no copy "
                                "of the weights through the training step (Fp8Config.resident_weight_codes; not with "
                                "fp8_decode_group_siblings or sharded parameters). On until measured on a GPU."}
    )
    compile_generation: bool = field(
        default=False,
        metadata={"help": "Let transformers compile the HF generate decode step with CUDA graphs (its CompileConfig, "
                  "mode reduce-overhead; CUDA only), which TRL switches off: the FP8 decode is host-bound without it. "
                  "Needs a static cache: sets cache_implementation='static' when none is given. On CUDA the master "
                  "weights must be in the autocast dtype (model_dtype bfloat16 with bf16)."},
    )
    compile_layers: bool | None = field(
        default=None,
        metadata={"help": "Compile the policy's decoder layers one by one (torch.compile per repeated block, "
                  "calclip.fp8.compile_repeated_blocks) for the training forwards and backwards; rollouts and BF16 "
                  "shadow forwards run eager. null (default): on for an FP8 policy of any recipe (fp8_backward 'fp8') "
                  "and for a BF16 policy (fp8 false, the fair baseline) on CUDA, unless torch_compile, "
                  "compile_generation, gradient checkpointing or sharded parameters "
                  "(FSDP, ZeRO-3) are set. The first steps compile one layer (Inductor and Triton keep it on disk "
                  "for the next run; docs/usage.md, Compiled layers)."},
    )
    compile_layers_shapes: str | None = field(
        default=None,
        metadata={"help": "How compile_layers meets each step's new sequence length: 'dynamic' (symbolic sizes, one "
                  "graph) or 'bucketed' (each log-prob forward padded on the right to one of 16 lengths per doubling, "
                  "at most 1/16 more tokens, one static graph per length; the real tokens' results unchanged). null "
                  "(default): 'bucketed' for torchao's recipes (fp8_recipe tensorwise / rowwise, whose fused scaling "
                  "is slower on symbolic sizes), 'dynamic' otherwise (calclip.rollout.compiled_layers)."},
    )
    compile_layers_backend: str = field(
        default="inductor",
        metadata={"help": "torch.compile backend of compile_layers ('inductor'; 'aot_eager' traces without "
                  "generating kernels)."},
    )
    keep_generation_cache: bool = field(
        default=True,
        metadata={"help": "With compile_generation: pass one static KV cache, reset in place, to every rollout instead "
                  "of letting transformers build a new one per call, whose moved addresses make the CUDA graphs "
                  "re-record every decode step (calclip.rollout.generation_cache). The cache stays allocated "
                  "between rollouts."},
    )
    vllm_fp8_linear_backend: str | None = field(
        default="fastest",
        metadata={"help": "With use_vllm and fp8: the colocated vLLM engine's GEMM backend for the FP8 linears "
                  "(vLLM's linear_backend). 'fastest' (default): 'deep_gemm' for fp8_recipe 'blockwise' where vLLM "
                  "can run DeepGEMM (Hopper/Blackwell, and an nvcc for its run-time JIT; measured 1.36x BF16's decode "
                  "at batch 64 on the H200, CUTLASS 1.00x), else 'cutlass'. 'cutlass' serves the policy's FP32 block "
                  "scales unchanged; 'deep_gemm' (vLLM's vendored DeepGEMM) and null (vLLM's automatic choice, "
                  "DeepGEMM first where installed) serve them unchanged too: calclip sets VLLM_USE_DEEP_GEMM_E8M0=0 "
                  "before the engine starts unless every scale is a power of two, and refuses an environment that "
                  "set it to 1, under which DeepGEMM would requantize every weight (docs/vllm.md, Numerics); and "
                  "VLLM_DEEP_GEMM_WARMUP=skip unless set (vLLM's default warm-up JIT-compiles for minutes before "
                  "the first rollout). "
                  "'deep_gemm' and 'triton' serve fp8_recipe 'blockwise' only, 'torch' the other recipes only "
                  "(refused otherwise: vLLM would fail after loading the model). A server is configured on its own "
                  "command line."},
    )
    vllm_fp8_match_trainer_numerics: bool = field(
        default=True,
        metadata={"help": "With use_vllm and fp8: switch off the colocated engine's RMSNorm+quant and SiLU*up+quant "
                  "fusion passes (their kernels quantize an unrounded FP32 SiLU(gate)*up and floor every group "
                  "scale at 1/(448*512)) and let its Inductor round BF16 intermediates as eager PyTorch does, so "
                  "its FP8 linears quantize the activations the trainer quantizes (docs/vllm.md, Numerics). False: "
                  "vLLM's defaults."},
    )
    vllm_kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "With use_vllm and vllm_mode colocate: the engine's KV cache dtype (vLLM's kv_cache_dtype). "
                  "'auto' (default): the model's dtype, off; 'fp8' (= 'fp8_e4m3') or 'fp8_e5m2': an FP8 KV cache "
                  "(unit scales: the policy's checkpoint carries none), which the trainer's forward does not have, so "
                  "it adds to the rollout/training mismatch (docs/vllm.md, Engine options). BF16 and FP8 policies "
                  "alike."},
    )
    vllm_async_scheduling: bool | None = field(
        default=None,
        metadata={"help": "With use_vllm and vllm_mode colocate: vLLM's async_scheduling (the next step is scheduled "
                  "while the current one runs on the GPU). null (default): vLLM's own choice, which vLLM 0.24 turns "
                  "on for TRL's external_launcher engine; true/false force it."},
    )
    vllm_detokenize: bool | None = field(
        default=None,
        metadata={"help": "With use_vllm and vllm_mode colocate: whether vLLM detokenizes the completions as it "
                  "generates (SamplingParams.detokenize). TRL reads only token ids and log-probs, and detokenizing "
                  "(the text and every log-prob's token) was most of vLLM's per-step output processing at 128 "
                  "sequences (docs/vllm.md, Engine options). null (default): off, unless generation_kwargs sets "
                  "'detokenize' or has 'stop' strings (which need it); true/false force it (false with stop strings "
                  "is refused)."},
    )
    vllm_pause_gc: bool = field(
        default=True,
        metadata={"help": "With use_vllm and vllm_mode colocate: switch Python's garbage collector off for each "
                  "rollout and back on after it (default). The colocated engine allocates Python objects for every "
                  "sequence at every decode step, so the collector ran ~230 times per rollout, 61-77 ms of a ~1.03 s "
                  "rollout at 128 x 256 tokens (H100; docs/vllm.md, Engine options). Acyclic garbage is still freed "
                  "at once; false: the collector runs as Python schedules it."},
    )
    vllm_max_num_batched_tokens: int | None = field(
        default=None,
        metadata={"help": "With use_vllm and vllm_mode colocate: vLLM's max_num_batched_tokens (tokens per engine "
                  "step, prefill chunks included). null (default): TRL 1.16's 4096."},
    )
    vllm_max_cudagraph_capture_size: int | None = field(
        default=None,
        metadata={"help": "With use_vllm and vllm_mode colocate: the largest batch the engine captures a CUDA graph "
                  "for (vLLM's compilation_config.max_cudagraph_capture_size). null (default): the rollout batch, "
                  "per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation (the engine's "
                  "max_num_seqs as TRL sets it), rounded up to a size of vLLM's capture list (1, 2, 4, multiples of "
                  "8, from 256 of 16), so no graph is captured for a batch of more sequences than the "
                  "engine ever decodes at once; vLLM's own default is twice that, at most 512 (half its graphs, "
                  "and their compile and capture time, unused in decode). An integer: that size."},
    )
    vllm_fp8_direct_sync: bool = field(
        default=True,
        metadata={"help": "With use_vllm, fp8 and vllm_mode colocate: after the first weight sync (through vLLM's "
                  "layerwise reload) compare the engine with the synced tensors byte for byte; where it holds each "
                  "one as loaded, later syncs are in-place copies into the same storage (faster than the reload on "
                  "the H200; docs/vllm.md). Any "
                  "difference keeps the reload, with a warning naming it. False: every sync through the reload."},
    )

    # ---- data ----
    check_dataset: bool = field(
        default=True,
        metadata={"help": "Check every row of the (map-style) datasets before training: empty prompts, columns the "
                  "reward functions require, prompts too long for the model (calclip.run.data_checks)."},
    )
    truncate_long_prompts: bool = field(
        default=False,
        metadata={"help": "Keep the last max_position_embeddings - max_completion_length tokens of a longer prompt "
                  "(left truncation) instead of failing at start-up."},
    )

    # ---- monitoring ----
    entropy_spike_window: int = field(
        default=20, metadata={"help": "Optimizer steps in the rolling window of the entropy-spike detector."}
    )
    entropy_spike_warmup: int = field(
        default=5, metadata={"help": "Optimizer steps observed before the entropy-spike detector can fire."}
    )
    entropy_spike_z: float = field(
        default=4.0,
        metadata={"help": "z-score of the step entropy (all tokens or A<0 tokens) against the rolling window above "
                  "which a spike is raised."},
    )
    recalibrate_on_spike: bool = field(
        default=True, metadata={"help": "Request an immediate shadow calibration when an entropy spike fires."}
    )
    repeat_ngram_size: int = field(
        default=4,
        metadata={"help": "n of the garbled-output signal completions/repeat_ngram_frac (share of repeated n-grams)."},
    )
    max_nonfinite_grad_skips: int = field(
        default=3,
        metadata={"help": "An optimizer step whose gradient norm is NaN/inf is skipped (weights and optimizer state "
                  "unchanged; logged as grad/nonfinite_skipped, the share of optimizer steps skipped) and after this "
                  "many in a row training stops with an error naming them. 0: off, every step is applied as in TRL "
                  "(one NaN step makes the weights NaN). Costs one host sync per step (it reuses transformers' "
                  "gradient norm). Tested on one process and with FSDP2 gradients (two ranks); not under "
                  "DeepSpeed, whose engine wraps the optimizer."},
    )
    mismatch_dump_threshold: float | None = field(
        default=5.0,
        metadata={"help": "Rollout vs trainer log-prob gap (nats) above which a completion token is appended to "
                  "<output_dir>/mismatch_outliers.jsonl (step, row, position, token, both log-probs, the BF16 "
                  "shadow's where computed, the completion text; largest first, at most 32 a step and 2000 a run). "
                  "null: off. Needs rollout log-probs (transformers generate, or vLLM) and "
                  "old_logps_source='trainer'. The step's largest gap is logged as mismatch/max_abs_logp_diff."},
    )

    def __post_init__(self):
        self.resume_from_checkpoint = resume_flag(self.resume_from_checkpoint)
        # Before TRL's and transformers' own checks, which divide by some of these fields and read others by truthiness.
        check_field_types(self)
        check_inherited_ranges(self)
        super().__post_init__()
        self._validate_calclip_fields()
        self._apply_clip_mode_rules()

    def _apply_clip_mode_rules(self) -> None:
        """The clip mode's own rules (``ClipPolicy.config_rules``, calclip.clipping) on this config's values; a
        default the mode fills in (clip_higher's epsilon_high) is written back."""
        on_policy_reason = None if self.calibration_is_meaningful else (
            f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) is a multiple of steps_per_generation "
            f"* num_iterations ({self.steps_per_generation} * {self.num_iterations}), so no optimizer step falls "
            "inside a generation round, TRL computes no old log-probs and the ratio is exactly 1; calibration never "
            "sees a moved policy and the bounds stay at calibration_init_bounds. Raise steps_per_generation or "
            "num_iterations (or use old_logps_source='rollout' with vLLM).")
        fields = clip_mode_class(self.clip_mode).config_rules(ClipFields(
            epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            importance_sampling_level=self.importance_sampling_level, on_policy_reason=on_policy_reason))
        self.epsilon_high = fields.epsilon_high

        self._warn_on_calibration_that_cannot_work()

    def _warn_on_calibration_that_cannot_work(self) -> None:
        """Calibrated settings a run accepts but cannot act on: said at construction, not found in the metrics."""
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high  # TRL: None means epsilon
        mode = clip_mode_class(self.clip_mode)(eps_low=self.epsilon, eps_high=eps_high, dual_clip_c=self.dual_clip_c)
        if mode.needs_shadow and not self.fp8:  # bounds from the BF16 shadow, which is then the policy itself
            warnings.warn(
                f"clip_mode={self.clip_mode!r} with fp8=False is static clipping: the BF16 shadow is the policy "
                f"itself, so the fitted bounds reproduce the static [1 - epsilon, 1 + epsilon_high] (the oracle clips "
                "exactly where static clipping does), at the cost of a shadow forward. Set fp8=True, or "
                "clip_mode='static'.",
                UserWarning,
                stacklevel=3,
            )
        # Every completion token of every optimizer step pooled, an upper bound: a fit needs calibration_min_tokens
        # A<0 tokens (or POOL_LIMIT_FACTOR times as many of both signs), so below it no fit ever comes, the bounds
        # stay at calibration_init_bounds and the pool (saved with every checkpoint) grows every step.
        completions_per_step = (self.generation_batch_size // self.steps_per_generation
                                * self.gradient_accumulation_steps)
        most_tokens = self.max_steps * completions_per_step * self.max_completion_length
        if mode.uses_calibrator and self.max_steps > 0 and most_tokens < self.calibration_min_tokens:
            warnings.warn(
                f"calibration_min_tokens={self.calibration_min_tokens} cannot be reached: the whole run generates at "
                f"most {most_tokens} completion tokens (max_steps {self.max_steps} x {completions_per_step} "
                f"completions a step x max_completion_length {self.max_completion_length}), so no calibration is "
                "ever fitted and the bounds stay at calibration_init_bounds. Lower calibration_min_tokens or train "
                "longer.",
                UserWarning,
                stacklevel=3,
            )

    @property
    def calibration_is_meaningful(self) -> bool:
        """True when some mini-batches see a policy that moved since the old log-probs (docs/DESIGN.md, Schedules).

        TRL 1.16's own condition for computing old log-probs (GRPOTrainer._generate_and_score_completions): an
        optimizer step falls inside a generation round of steps_per_generation * num_iterations micro-batches
        exactly when gradient_accumulation_steps is not a multiple of it. Bypass mode with vLLM also qualifies (the
        engine's log-probs differ from the trainer's from the start); on the transformers generate path the rollout
        runs the trainer's own modules, so bypass mode moves only where the trainer path does.
        """
        generate_every = self.steps_per_generation * self.num_iterations
        return self.gradient_accumulation_steps % generate_every != 0 or (
            self.old_logps_source == "rollout" and self.use_vllm
        )

    @property
    def clip_epsilon_high(self) -> float:
        """The upper epsilon in force: ``epsilon_high``, or ``epsilon`` when unset (TRL's rule)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def calibration_low_rails(self) -> tuple[float, float]:
        """(calibration_low_min, calibration_low_max) with the default upper rail 1 - epsilon filled in."""
        low_max = 1.0 - self.epsilon if self.calibration_low_max is None else self.calibration_low_max
        return self.calibration_low_min, low_max

    @property
    def calibration_high_rails(self) -> tuple[float, float]:
        """(calibration_high_min, calibration_high_max) with the default lower rail 1 + epsilon_high filled in."""
        high_min = 1.0 + self.clip_epsilon_high if self.calibration_high_min is None else self.calibration_high_min
        return high_min, self.calibration_high_max

    def _check_vllm_detokenize(self) -> None:
        # (its type is checked with every field's: run.field_checks)
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            return  # TRL's own field: its checks, not calclip's
        colocate_sampling_defaults(self.vllm_detokenize, self.generation_kwargs)  # raises on a contradiction

    def _fp8_options(self) -> dict:
        """The Fp8Config options of the fp8_* fields (FP8_CONFIG_FIELDS)."""
        return {option: getattr(self, name) for name, option in FP8_CONFIG_FIELDS.items()}

    def fp8_config(self, **trainer_options) -> Fp8Config:
        """The Fp8Config of the fp8_* fields, with the options the trainer sets itself (``cache_weights``).

        TRL computes log-probs from lm_head.weight directly (fused LM head), so the LM head always stays BF16."""
        options = self._fp8_options()
        options["keep_patterns"] = tuple(dict.fromkeys([*options["keep_patterns"], "lm_head"]))
        return Fp8Config(**options, **trainer_options)

    def _validate_fp8(self) -> None:
        """Fp8Config's rules between options (calclip.fp8.config.check_fp8_combination, the one place they are
        written), on the values ``fp8_config`` hands Fp8Config: a combination refused there is refused here, before
        training, naming the fp8_* fields."""
        rule_options = inspect.signature(check_fp8_combination).parameters  # the options the rules read
        check_fp8_combination(**{option: value for option, value in self._fp8_options().items()
                                 if option in rule_options}, subject=_fp8_field, mention=_fp8_field)

    def _validate_calclip_fields(self) -> None:
        clip_mode_class(self.clip_mode)  # a registered clip mode; ValueError naming clip_mode and the keys otherwise
        _one_of("calibration_schedule", self.calibration_schedule, CALIBRATION_SCHEDULES)
        _one_of("calibration_upper", self.calibration_upper, CALIBRATION_UPPER_MODES)
        _one_of("tis_mode", self.tis_mode, TIS_MODES)
        _one_of("old_logps_source", self.old_logps_source, OLD_LOGPS_SOURCES)
        _one_of("fp8_backward", self.fp8_backward, FP8_BACKWARD_MODES)
        _one_of("fp8_gemm", self.fp8_gemm, FP8_GEMM_BACKENDS)
        _one_of("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _one_of("loss_type", self.loss_type, SUPPORTED_LOSS_TYPES)
        if self.vllm_fp8_linear_backend is not None and (
            not isinstance(self.vllm_fp8_linear_backend, str) or not self.vllm_fp8_linear_backend.strip()
        ):
            raise ValueError("vllm_fp8_linear_backend must be a vLLM linear_backend name (e.g. 'cutlass') or null "
                             f"(vLLM's automatic choice), got {self.vllm_fp8_linear_backend!r}")
        backend_problem = linear_backend_problem(self.fp8_recipe, self.vllm_fp8_linear_backend)
        if self.use_vllm and self.fp8 and backend_problem:  # vLLM would refuse it after loading the model
            raise ValueError(f"vllm_fp8_linear_backend={self.vllm_fp8_linear_backend!r} with "
                             f"fp8_recipe={self.fp8_recipe!r}: {backend_problem}")
        if self.use_vllm and self.vllm_mode == "colocate" and str(self.vllm_model_impl).lower() == "transformers":
            # vLLM's Transformers backend decorates the transformers decoder class itself (support_torch_compile
            # replaces its __init__ and __call__); in colocate mode that is the policy's class, whose instance was
            # built before the engine, and its next forward fails. Seen on the H200 (vLLM 0.24.0, 2026-12-02):
            # AttributeError: 'LlamaModel' object has no attribute 'do_not_compile'.
            raise ValueError(
                "vllm_model_impl='transformers' cannot run with vllm_mode='colocate': vLLM's Transformers backend "
                "patches the transformers model class in this process (its __call__ then expects attributes the "
                "policy was built without), so the policy's own forward fails; use vllm_model_impl='vllm' (TRL's "
                "default) or vllm_mode='server'"
            )
        if self.vllm_kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
            raise ValueError(f"vllm_kv_cache_dtype must be one of {VLLM_KV_CACHE_DTYPES}, got "
                             f"{self.vllm_kv_cache_dtype!r}")
        if self.vllm_async_scheduling is not None and not isinstance(self.vllm_async_scheduling, bool):
            raise ValueError(f"vllm_async_scheduling must be true, false or null (vLLM's choice), got "
                             f"{self.vllm_async_scheduling!r}")
        self._check_vllm_detokenize()
        for name, null in (("vllm_max_num_batched_tokens", "TRL's 4096"),
                           ("vllm_max_cudagraph_capture_size", "the rollout batch")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or null ({null}), got {value!r}")
        for name in ("compile_generation", "keep_generation_cache", "vllm_fp8_match_trainer_numerics",
                     "vllm_fp8_direct_sync"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_layer_shapes(self.compile_layers_shapes)
        if not isinstance(self.compile_layers_backend, str) or not self.compile_layers_backend.strip():
            raise ValueError("compile_layers_backend must be a torch.compile backend name (e.g. 'inductor'), got "
                             f"{self.compile_layers_backend!r}")
        if self.mismatch_dump_threshold is not None and (
            not _is_number(self.mismatch_dump_threshold) or not self.mismatch_dump_threshold > 0
        ):
            raise ValueError(f"mismatch_dump_threshold must be a number of nats > 0, or null (off), got "
                             f"{self.mismatch_dump_threshold!r}")

        if not _is_number(self.dual_clip_c) or self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be a number > 1, got {self.dual_clip_c!r}")
        _int_at_least("calibration_interval", self.calibration_interval, 1)
        if not _is_number(self.calibration_ema) or not 0.0 <= self.calibration_ema < 1.0:
            raise ValueError(f"calibration_ema must be in [0, 1), got {self.calibration_ema!r}")
        _int_at_least("calibration_min_tokens", self.calibration_min_tokens, 1)
        if not 0.0 < self.epsilon < 1.0:
            raise ValueError(f"epsilon must lie in (0, 1) (the lower ratio bound is 1 - epsilon), got {self.epsilon!r}")
        # epsilon_high (finite, > 0 or None) is checked with the inherited fields: field_checks.INHERITED_RANGES
        for name in ("calibration_low_min", "calibration_low_max", "calibration_high_min", "calibration_high_max"):
            value = getattr(self, name)
            if not (_is_number(value) or (value is None and name in ("calibration_low_max", "calibration_high_min"))):
                raise ValueError(f"{name} must be a number, got {value!r}")
        (low_min, low_max), (high_min, high_max) = self.calibration_low_rails, self.calibration_high_rails
        if not 0.0 <= low_min <= low_max <= 1.0:
            raise ValueError(
                "calibration_low_min/calibration_low_max must satisfy 0 <= low_min <= low_max <= 1, got "
                f"({low_min}, {low_max}){_DEFAULT_RAIL_NOTE}"
            )
        if not 1.0 <= high_min <= high_max:
            raise ValueError(
                "calibration_high_min/calibration_high_max must satisfy 1 <= high_min <= high_max, got "
                f"({high_min}, {high_max}){_DEFAULT_RAIL_NOTE}"
            )
        bounds = self.calibration_init_bounds
        if (
            not isinstance(bounds, (list, tuple))
            or len(bounds) != 2
            or not all(_is_number(b) for b in bounds)
            or not bounds[0] < 1.0 < bounds[1]
        ):
            raise ValueError(f"calibration_init_bounds must be [low, high] with low < 1 < high, got {bounds!r}")
        self.calibration_init_bounds = [float(b) for b in bounds]
        if not (low_min <= bounds[0] <= low_max and high_min <= bounds[1] <= high_max):
            raise ValueError(
                f"calibration_init_bounds {bounds} must lie within the rails [calibration_low_min, "
                f"calibration_low_max] = [{low_min}, {low_max}] and [calibration_high_min, calibration_high_max] = "
                f"[{high_min}, {high_max}]{_DEFAULT_RAIL_NOTE}"
            )

        if not _is_number(self.tis_cap) or self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap must be a number > 0, got {self.tis_cap!r}")
        if self.tis_lower_cap is not None and (
            not _is_number(self.tis_lower_cap) or not 0.0 <= self.tis_lower_cap < self.tis_cap
        ):
            raise ValueError(f"tis_lower_cap must be None or in [0, tis_cap), got {self.tis_lower_cap!r}")
        if self.tis_mode != "none" and self.old_logps_source == "rollout":
            raise ValueError(
                "tis_mode must be 'none' when old_logps_source='rollout': the old log-probs are the rollout's, so "
                "the correction weight pi_old/pi_rollout is identically 1"
            )
        if self.old_logps_source == "rollout" and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction must be False when old_logps_source='rollout': the ratio is "
                "already pi/pi_rollout, and TRL's correction would weight the loss by pi_old/pi_rollout a second time"
            )
        needs_rollout_logps = self.tis_mode != "none" or self.old_logps_source == "rollout"
        if self.use_transformers_continuous_batching and needs_rollout_logps:
            raise ValueError(
                "tis_mode and old_logps_source='rollout' need rollout log-probs, which "
                "use_transformers_continuous_batching does not return; use the generate path or vLLM"
            )
        if self.tis_mode != "none" and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "tis_mode and vllm_importance_sampling_correction both correct the rollout mismatch: set "
                "tis_mode='none' (TRL's correction is then applied) or vllm_importance_sampling_correction=False"
            )

        for name in ("fp8_keep_first_n_layers", "fp8_keep_last_n_layers", "fp8_decode_fused_max_m",
                     "repeat_ngram_size", "max_nonfinite_grad_skips"):
            if name == "fp8_decode_fused_max_m" and self.fp8_decode_fused_max_m is None:
                continue  # automatic
            _int_at_least(name, getattr(self, name), 1 if name == "repeat_ngram_size" else 0)
        # fp8_decode_group_siblings and fp8_share_sibling_inputs are bools: check_field_types refuses anything else
        if self.fp8:
            self._validate_fp8()
        if isinstance(self.fp8_keep_patterns, str) or not all(isinstance(p, str) for p in self.fp8_keep_patterns):
            raise ValueError(f"fp8_keep_patterns must be a list of regex strings, got "
                             f"{bounded_repr(self.fp8_keep_patterns)}")
        check_keep_patterns(self.fp8_keep_patterns, subject=_fp8_field)  # Fp8Config's check, at config time
        _int_at_least("entropy_spike_window", self.entropy_spike_window, 2, SPIKE_WINDOW_MAX)
        _int_at_least("entropy_spike_warmup", self.entropy_spike_warmup, 2)
        if self.entropy_spike_warmup > self.entropy_spike_window:
            raise ValueError(f"entropy_spike_warmup ({self.entropy_spike_warmup}) must be <= entropy_spike_window "
                             f"({self.entropy_spike_window}): the detector's history holds at most a window of steps, "
                             "so a longer warmup never fires")
        if not _is_number(self.entropy_spike_z) or self.entropy_spike_z <= 0.0:
            raise ValueError(f"entropy_spike_z must be a number > 0, got {self.entropy_spike_z!r}")

        # TRL loss options the calibrated loss does not implement: fail loudly instead of ignoring them.
        unsupported = {
            "top_entropy_quantile": self.top_entropy_quantile != 1.0,
            "use_adaptive_entropy": self.use_adaptive_entropy,
            "off_policy_mask_threshold": self.off_policy_mask_threshold is not None,
            "delta": self.delta is not None,
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(
                    f"{name} is not supported by CalibratedGRPOTrainer's loss; leave it at its GRPOConfig default "
                    f"(got {getattr(self, name)!r})"
                )


@dataclass
class CalibratedDAPOConfig(CalibratedGRPOConfig):
    """DAPO preset (arXiv 2503.14476): clip-higher base bounds 0.8/1.28, token-level ``dapo`` loss, dynamic sampling,
    overlong filtering and the soft overlong punishment. ``clip_mode`` stays ``calibrated`` (the 0.2/0.28 epsilons
    are the base bounds the calibration matches); ``clip_mode='clip_higher'`` gives plain DAPO.
    The dynamic-sampling and overlong logic lives in ``calclip.trainers.dapo``.
    """

    epsilon: float = field(default=0.2, metadata={"help": "Lower clip epsilon (DAPO: 0.2)."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip epsilon (DAPO: 0.28)."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level loss over the global batch (DAPO)."})
    mask_truncated_completions: bool = field(
        default=True, metadata={"help": "Overlong filtering: truncated completions are masked out of the loss."}
    )
    dynamic_sampling: bool = field(
        default=True,
        metadata={"help": "Drop groups whose rewards all agree and generate more until the batch is full."},
    )
    dynamic_sampling_max_rounds: int = field(
        default=4,
        metadata={"help": "Most generation rounds per batch for dynamic sampling; then the batch is kept as is."},
    )
    overlong_buffer_length: int = field(
        default=64,
        metadata={"help": "L_cache of the soft overlong punishment: completions longer than max_completion_length - "
                  "L_cache are penalized linearly, down to -overlong_penalty_factor at max_completion_length."},
    )
    overlong_penalty_factor: float = field(
        default=1.0, metadata={"help": "Largest soft overlong penalty (0 turns the punishment off)."}
    )

    def __post_init__(self):
        super().__post_init__()
        _int_at_least("dynamic_sampling_max_rounds", self.dynamic_sampling_max_rounds, 1)
        _int_at_least("overlong_buffer_length", self.overlong_buffer_length, 0)
        if self.max_completion_length is not None and self.overlong_buffer_length >= self.max_completion_length:
            raise ValueError(
                f"overlong_buffer_length ({self.overlong_buffer_length}) must be < max_completion_length "
                f"({self.max_completion_length})"
            )
        if not _is_number(self.overlong_penalty_factor) or self.overlong_penalty_factor < 0.0:
            raise ValueError(f"overlong_penalty_factor must be a number >= 0, got {self.overlong_penalty_factor!r}")
