"""``CalibratedGRPOTrainer``: TRL's ``GRPOTrainer`` with a block-FP8 policy, Calibrated Clipping, rollout
correction (TIS/MIS) and the monitoring of DESIGN.md.

Seams (TRL 1.16; every override calls ``super()`` except the loss):

- ``__init__``: after ``super().__init__()`` the policy's linear layers are swapped for FP8 ones
  (``calclip.fp8.quantize_model`` reuses the Parameters, and the optimizer and ``accelerator.prepare`` only run in
  ``train()``, so swapping after TRL's set-up is safe). The same quantized modules serve generation and training:
  one precision flow. The reference model (``beta > 0``) stays in its own dtype. With ``use_vllm`` the rollout engine
  runs the same FP8 codes (``calclip.rollout.vllm_sync``): TRL's generation object is built block-FP8, its colocated
  engine starts only after the quantization (its ``modules_to_not_convert`` are the quantized model's BF16 linears),
  and every weight sync sends FP8 codes + ``weight_scale_inv`` for exactly the FP8 layers. With or without FP8, a
  colocated engine of a policy without a loadable ``name_or_path`` starts from the config and tokenizer written
  under ``output_dir`` and the weights TRL syncs before the first rollout.
- ``__init__``: the policy's (and reference model's) backbone gets a pre-hook that gives TRL's log-prob forwards the
  positions ``generate`` used for left-padded rows (``calclip.rollout.positions``): with TRL's own positions the
  rollout's and the trainer's FP8 log-probs of the same tokens differed by over 1 nat on some tokens.
- ``__init__`` / ``_tokenize_prompts``: the datasets are checked before training (``calclip.run.data_checks``:
  empty prompts, columns the rewards require, prompts too long for the model's positions); with
  ``truncate_long_prompts`` TRL's prompt token ids are left-truncated to fit.
- ``_generate_single_turn``: on the transformers ``generate`` path TRL has no rollout log-probs. We ask ``generate``
  for its processed scores (the exact distribution each token was sampled from, after temperature, top-k, top-p,
  min-p and repetition penalty) and keep the sampled tokens' log-probs. Nothing is recomputed, so these are the
  rollout engine's log-probs in the same sense as vLLM's ``processed_logprobs``, and TRL carries them on as
  ``sampling_per_token_logps``. Cost: the scores of one generation (B x T x V floats) are held until it ends.
  The call runs inside ``frozen_fp8_weights`` (FP8 codes refreshed once; no refresh graph break in compiled decode),
  and with ``compile_generation`` gets one static KV cache kept across rollouts (``keep_generation_cache``,
  ``calclip.rollout.generation_cache``: a new cache per call re-records the CUDA graphs of every decode step).
- ``_generate_and_score_completions``: after ``super()``, when a shadow calibration may fall in the optimizer steps
  this generation batch feeds, the BF16 shadow old log-probs are computed with the same (not yet updated) weights
  TRL just used for ``old_per_token_logps``; also logs the garbled-output signal.
- ``_calculate_rewards``: after ``super()``, a completion with a +-inf reward is made unscorable like TRL's ``None``
  rewards (``calclip.run.reward_checks``), counted in ``reward/nonfinite_count`` and warned about by function name.
- ``_compute_loss`` (replaced; TRL's body is not copied): per-token log-probs from TRL's
  ``_get_per_token_logps_and_entropies``, bounds from the clip mode / calibrator, then
  ``calclip.losses.clipped_surrogate`` with TRL's normalization (``grpo``/``bnpo``/``dr_grpo`` divided by the
  accumulation steps; ``dapo`` by ``num_items_in_batch / num_processes * accumulation / steps_per_generation``),
  plus TRL's KL term, static entropy bonus and MoE aux loss. With clip_mode static, fp8 off and no TIS the loss and
  gradients equal ``GRPOTrainer``'s (tests/trainers/test_parity.py).
- ``training_step``: after ``super()``, at the end of a generation round, the calibrator commits: one calibration on
  the tokens pooled from every moved mini-batch of the round (and earlier rounds while below
  ``calibration_min_tokens``), in force from the next round on (DESIGN.md step 8).
- ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``: calibrator and spike-detector state in every
  checkpoint (``calclip_state.pt``, written with the optimizer state, so before the hub push and checkpoint
  rotation), restored on ``resume_from_checkpoint`` (read with ``weights_only=True``: calclip.run.checkpoint).
- ``create_optimizer``: after ``super()``, an optimizer step pre-hook skips steps whose gradients are NaN/inf and stops
  the run after ``max_nonfinite_grad_skips`` in a row (``calclip.run.grad_guard``); ``_get_grad_norm`` (after
  ``super()``) hands it transformers' norm of the step, so finite steps cost the guard no second norm.
- The loss step's metrics (below) are computed and reduced over ranks by ``calclip.trainers.metrics.LossMetrics``,
  a mixin of this class.
- ``train``: ``resume_from_checkpoint=True`` resolves to the latest complete checkpoint (incomplete ones, left by a
  kill during a save, are skipped with a warning), then ``super().train()``.

Calibration pools only mini-batches whose policy moved since the old log-probs were taken (DESIGN.md,
Schedules): a micro-batch is exactly on-policy (r = 1) while the optimizer step is still the one at which its
generation batch was produced (``self.state.global_step`` recorded in ``_generate_and_score_completions``), unless
the old log-probs come from a separate vLLM engine (bypass).
On such a moved mini-batch, while the calibrator says a shadow calibration is due, one extra no-grad forward under
``bf16_shadow`` gives the BF16 current log-probs; with the BF16 old log-probs from generation time they form the
BF16 ratios, and the FP8 ratios are the ones the loss uses; the calibrator pools both. The bounds fitted on the pool
apply from the next round on, so every mini-batch is trained and scored with bounds fitted on other tokens. With
``clip_mode="oracle"`` the shadow runs on every moved mini-batch and the loss clips per token exactly where the BF16
shadow ratio leaves [1-epsilon, 1+epsilon_high] (a reference arm). With FP8
off the shadow policy is the policy itself, so the BF16 ratios are the FP8 ones and no extra forward runs. In the
non-calibrated clip modes the same shadow forwards run on the same schedule when FP8 is on, for monitoring only.

Metrics (under ``train/``, through TRL's ``self._metrics``): ``calib/low``, ``calib/high`` (bounds in force),
``calib/alpha``, ``calib/balance_p``, ``calib/neg_tokens``, ``calib/pos_tokens`` (calibration steps: the statistics
and the A<0 / A>0 token counts the fit used), ``clip/neg_low_frac_fp8`` (share of A<0 tokens whose ratio is
below the lower bound in force: the penalties dropped), ``clip/neg_low_frac_bf16`` (shadow steps: share of A<0
tokens whose BF16 shadow ratio is below 1 - epsilon, i.e. what BF16 training would drop, the calibration's target),
``clip/neg_low_frac_fp8_static`` (shadow steps: the same share for the FP8 ratios, what static clipping drops),
``clip/pos_high_frac``, ``clip/dual_frac``, ``calib/fit`` (round ends: 1 when the pooled calibration replaced the
bounds, 0 below the minimum, with ``calib/pool_neg_tokens``), ``calib/bf16_low_clipped_tokens``, ``oos/*`` (moved
mini-batches: A<0 tokens and those below the bound in force; shadow mini-batches: the same beside BF16's drops at
1 - epsilon, ``oos/drop_recall``, ``oos/drop_precision``; calclip.calibration.drops), ``time/bf16_shadow``,
``mismatch/token_mult_prob_error``, ``mismatch/kl_k3`` and ``mismatch/gap_gt_1nat_frac`` (old vs rollout log-probs; the
last the share of tokens more than 1 nat apart), ``mismatch/max_abs_logp_diff`` (the largest such gap of the logging
window, every rank's tokens), ``mismatch/fp8_bf16_token_mult_prob_error`` (shadow steps), ``tis/*``, ``entropy``,
``entropy/neg_adv``, ``entropy/spike``, ``fp8/nonfinite_tokens`` (tokens whose FP8 linear output was non-finite),
``loss/nonfinite_tokens``, ``reward/nonfinite_count``, ``grad/nonfinite_skipped`` (share of optimizer steps skipped
for non-finite gradients), ``completions/repeat_ngram_frac``; and TRL's ``clip_ratio/*``, ``kl``,
``policy_loss``, ``aux_loss``. TRL's metrics keep TRL's names and reductions (token-weighted global means,
``clip_ratio/low_min``/``high_max`` over every rank's sequences); calclip's token-level metrics are token-weighted
global means too (one all-reduce of (sum, count) pairs), counts are summed, per-micro-batch scalars averaged, and
minima/maxima (``tis/weight_min``, ``tis/weight_max``, ``mismatch/max_abs_logp_diff``) are the extreme over ranks and
over the micro-batches of the logging window.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
import warnings
import weakref

import torch
from trl import GRPOTrainer
from trl.generation import vllm_generation as trl_vllm_generation
from trl.trainer.utils import is_async_callable

from calclip.calibration import ClipCalibrator, torch_distributed_all_gather
from calclip.calibration.pool import StarvationWatch
from calclip.calibration.state import FIT_SETTINGS, check_state, check_state_against_run
from calclip.clipping import ClipPolicy, clip_policy_from_fields
from calclip.fp8 import bf16_shadow, compile_repeated_blocks, frozen_fp8_weights, quantize_model
from calclip.fp8.regional_compile import eager_blocks, repeated_blocks
from calclip.losses import (
    aggregate,
    clipped_surrogate,
    importance_ratio,
    rollout_correction_weights,
    token_log_ratio,
    token_mult_prob_error,
)
from calclip.monitoring.ratio_distributions import split_ratios
from calclip.monitoring.callbacks import EntropySpikeDetector, repeated_ngram_counts
from calclip.run.run_lock import claim_output_dir
from calclip.run.checkpoint import (
    CALCLIP_STATE_NAME,
    CalclipStateError,
    check_resume_checkpoint,
    check_resume_step,
    latest_complete_checkpoint,
    load_calclip_state,
    save_calclip_state,
)
from calclip.rollout.compiled_layers import (BUCKETED_RECOMPILE_LIMIT, bucket_overflow, inductor_options,
                                             pad_to_bucket, raise_recompile_limit, resolve_compile_layers,
                                             resolve_layer_shapes)
from calclip.trainers.config import CalibratedGRPOConfig
from calclip.trainers.metrics import BF16_OLD_LOGPS_KEY, LossMetrics, sum_count
from calclip.run.data_checks import (
    PROMPT_COLUMN,
    check_rows,
    check_train_rows,
    long_prompt_message,
    prompt_token_counts,
)
from calclip.rollout.generation_cache import KeptStaticCache, generate_wrapped
from calclip.run.grad_guard import NonfiniteGradGuard
from calclip.monitoring.mismatch_outliers import MismatchOutlierLog
from calclip.rollout.positions import use_rollout_positions
from calclip.run.reward_checks import checked_reward_function, exclude_nonfinite_rewards
from calclip.monitoring.ratio_histograms import attach_ratio_histograms
from calclip.rollout.vllm_sync import (
    ENGINE_MODEL_DIRNAME,
    check_vllm_compatible,
    colocate_sampling_defaults,
    engine_speed_kwargs,
    fp8_engine_numerics_kwargs,
    use_fp8_vllm_generation,
    use_vllm_generation,
)

logger = logging.getLogger(__name__)


# Inputs TRL forwards to the model besides input_ids/attention_mask (multimodal models).
_FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
# _get_per_token_logps_and_entropies' own options (every other argument is a model input)
_LOGPS_OPTIONS = ("batch_size", "compute_entropy", "compute_aux_loss")


class _SampledLogprobRecorder:
    """Makes ``model.generate`` also return the sampled tokens' log-probs under the processed scores.

    Installed as an instance attribute for the duration of one TRL generation call and removed afterwards, so TRL's
    own generate call (and its arguments) stay untouched: the wrapper adds ``output_scores`` and
    ``return_dict_in_generate``, keeps the log-probs, and returns the token tensor TRL expects.
    """

    def __init__(self, synced_gpus: bool = False) -> None:
        self.logprobs: torch.Tensor | None = None  # [B, T_generated]
        self.synced_gpus = synced_gpus

    def attached(self, model):
        return generate_wrapped(model, self._wrap)

    def _wrap(self, original):
        def generate(*args, **kwargs):
            if kwargs.get("generation_config") is not None:
                config = copy.deepcopy(kwargs["generation_config"])
                config.output_scores = config.return_dict_in_generate = True
                kwargs["generation_config"] = config
            else:
                kwargs.update(output_scores=True, return_dict_in_generate=True)
            if self.synced_gpus:
                kwargs.setdefault("synced_gpus", True)
            out = original(*args, **kwargs)
            prompt_length = out.sequences.size(1) - len(out.scores)
            tokens = out.sequences[:, prompt_length:]
            self.logprobs = torch.stack(
                [
                    torch.log_softmax(score.float(), dim=-1).gather(-1, tokens[:, t : t + 1]).squeeze(-1)
                    for t, score in enumerate(out.scores)
                ],
                dim=1,
            )
            return out.sequences

        return generate


def compiled_generation_problem(device_type: str, master_dtype: torch.dtype, bf16: bool, fp16: bool) -> str | None:
    """Why compile_generation cannot run with these settings, or None.

    Measured on the H200 (2026-12-01, torch 2.11, transformers 5.17, docs/benchmarks.md): with float32 master
    weights and bf16 autocast, the CUDA-compiled decode step writes bf16 keys into the static KV cache that the eager
    prefill allocated in float32, and generate fails (`index_copy_(): ... Float and BFloat16`), for BF16 and FP8
    policies alike. The same settings run on CPU, where transformers does not compile the decode step."""
    autocast = torch.bfloat16 if bf16 else torch.float16 if fp16 else None
    if device_type != "cuda" or autocast is None or master_dtype == autocast:
        return None
    name = "bf16" if bf16 else "fp16"
    return (f"compile_generation with {str(master_dtype).removeprefix('torch.')} master weights under {name} "
            f"autocast fails in transformers' CUDA-graphed decode (its static KV cache is allocated in the prefill's "
            f"dtype, the compiled decode step writes {name} keys): load the policy in the autocast dtype "
            f"(model_dtype: {'bfloat16' if bf16 else 'float16'}), or set compile_generation: false")


class CalibratedGRPOTrainer(LossMetrics, GRPOTrainer):
    """Drop-in ``GRPOTrainer`` (same arguments) that takes a ``CalibratedGRPOConfig``.

    Attributes: ``calibrator`` (``calclip.calibration.ClipCalibrator``), ``spike_detector``
    (``EntropySpikeDetector``), ``clip_policy`` (the run's ``calclip.clipping.ClipPolicy``, from ``clip_mode``; the
    trainer asks it, never the mode's name), ``clip_mode`` (its registry key), ``clip_bounds`` (the (low, high) in
    force).
    """

    _tag_names = [*GRPOTrainer._tag_names, "calclip"]
    _name = "CalibratedGRPO"

    def __init__(self, model, reward_funcs=None, args: CalibratedGRPOConfig | None = None, *posargs, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = CalibratedGRPOConfig(f"{str(model_name).split('/')[-1]}-CalibratedGRPO")
        if not isinstance(args, CalibratedGRPOConfig):
            raise TypeError(
                f"{type(self).__name__} takes a CalibratedGRPOConfig (every GRPOConfig field works there), "
                f"got {type(args).__name__}"
            )
        # Inputs that cannot train, refused before the model loads: a dataset of no rows (one too small for a
        # generation batch is refused by train(): a trainer built to compute losses needs none), and vLLM rollouts
        # without vLLM (TRL fails on it later with an AttributeError that names neither).
        check_train_rows(posargs[0] if posargs else kwargs.get("train_dataset"), prompts_per_generation=1)
        if args.use_vllm and not trl_vllm_generation.is_vllm_available():  # TRL's own test (tests patch it there)
            raise ImportError("use_vllm=True needs the vllm package, which is not installed: pip install "
                              "'calclip[vllm]' (or use_vllm=False to generate with transformers)")
        # One run per output_dir, and a writable one, before TRL loads the model (calclip.run.run_lock).
        self._output_dir_lock = claim_output_dir(args)
        if self._output_dir_lock is not None:
            weakref.finalize(self, self._output_dir_lock.release)
        fp8_vllm = args.use_vllm and args.fp8
        # A colocated engine of a policy without a loadable name_or_path (built from a config) is started from its
        # config and tokenizer written here, and the weights TRL syncs (calclip.rollout.vllm_sync).
        engine_model_root = os.path.join(args.output_dir, ENGINE_MODEL_DIRNAME)
        engine_options = engine_speed_kwargs(kv_cache_dtype=args.vllm_kv_cache_dtype,
                                             async_scheduling=args.vllm_async_scheduling,
                                             max_num_batched_tokens=args.vllm_max_num_batched_tokens,
                                             max_cudagraph_capture_size=args.vllm_max_cudagraph_capture_size)
        sampling_defaults = colocate_sampling_defaults(args.vllm_detokenize, args.generation_kwargs)
        if fp8_vllm:
            # vLLM rollouts on the policy's own FP8 codes (docs/vllm.md): TRL builds its vLLM generation inside
            # super().__init__(), before the policy is quantized below, so the colocated engine starts afterwards.
            vllm_hook = use_fp8_vllm_generation(
                defer_engine=True, check_vllm_shapes=False, engine_model_root=engine_model_root,
                direct_sync=args.vllm_fp8_direct_sync, engine_options=engine_options,
                sampling_defaults=sampling_defaults, pause_gc=args.vllm_pause_gc,
                engine_kwargs=fp8_engine_numerics_kwargs(linear_backend=args.vllm_fp8_linear_backend,
                                                         match_trainer=args.vllm_fp8_match_trainer_numerics,
                                                         recipe=args.fp8_recipe))
        elif args.use_vllm:
            vllm_hook = use_vllm_generation(engine_model_root=engine_model_root, engine_options=engine_options,
                                            sampling_defaults=sampling_defaults, pause_gc=args.vllm_pause_gc)
        else:
            vllm_hook = contextlib.nullcontext()
        with vllm_hook:
            super().__init__(model, reward_funcs, args, *posargs, **kwargs)
        self._check_reward_outputs()
        # TRL's log-prob forwards number a left-padded row's positions as generate did (calclip.rollout.positions)
        for policy in (self.model, self.ref_model):
            if policy is not None:
                use_rollout_positions(self.accelerator.unwrap_model(policy))
        self._clip_policy = self._build_clip_policy()  # at init, so an unregistered clip_mode fails here
        self._prompt_token_limit = self._max_prompt_tokens()
        if args.check_dataset:
            self._check_datasets()
        if args.fp8:
            self._quantize_policy()
        self._generation_cache: KeptStaticCache | None = None
        if args.compile_generation:
            self._allow_compiled_generation()
        self._layers_compiled = self._compile_policy_layers()
        if fp8_vllm:
            self._start_fp8_vllm()
        self.calibrator = self._build_calibrator()
        self._starvation = StarvationWatch(args.calibration_min_tokens,
                                           needs_positive=args.calibration_upper != "fixed")
        self.spike_detector = EntropySpikeDetector(
            window=args.entropy_spike_window, warmup=args.entropy_spike_warmup, z_threshold=args.entropy_spike_z
        )
        self._step_entropies: list[tuple[float, float]] = []  # (entropy, A<0 entropy) of this step's micro-batches
        self._shadow_seconds = 0.0  # BF16 shadow forwards since the last optimizer step (time/bf16_shadow)
        self._outlier_log: MismatchOutlierLog | None = None  # created at the first outlier check
        self._old_logps_step: int | None = None  # global_step at which the buffered generation batch was produced
        # W&B histograms of the calibration ratios; None (no cost) unless W&B reports this run.
        self._ratio_histograms = attach_ratio_histograms(self)

    def _build_calibrator(self) -> ClipCalibrator:
        """A fresh calibrator with this run's settings."""
        return ClipCalibrator(
            eps_low=self.args.epsilon,
            eps_high=self.args.clip_epsilon_high,
            upper=self.args.calibration_upper,
            schedule=self.args.calibration_schedule,
            interval=self.args.calibration_interval,
            ema=self.args.calibration_ema,
            init_low=self.args.calibration_init_bounds[0],
            init_high=self.args.calibration_init_bounds[1],
            low_rails=self.args.calibration_low_rails,
            high_rails=self.args.calibration_high_rails,
            min_tokens=self.args.calibration_min_tokens,
            # Statistics over the tokens of every rank, so every rank applies the same bounds (DESIGN.md step 7).
            all_gather=torch_distributed_all_gather() if self.accelerator.num_processes > 1 else None,
        )

    # ------------------------------------------------------------------------------------------ optimizer

    def create_optimizer(self, *args, **kwargs):
        """transformers' optimizer, with the non-finite-gradient guard (``max_nonfinite_grad_skips``) as a step
        pre-hook: a NaN/inf gradient step is skipped instead of making the weights NaN (calclip.run.grad_guard)."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.args.max_nonfinite_grad_skips and optimizer is not None and not hasattr(optimizer, "_calclip_guard"):
            hint = (" FP8 is on: fp8/nonfinite_tokens counts the tokens whose FP8 linear output was non-finite; "
                    "compare with fp8=False to see whether the FP8 path causes it.") if self.args.fp8 else ""
            guard = NonfiniteGradGuard(self.args.max_nonfinite_grad_skips, step_of=lambda: self.state.global_step + 1,
                                       on_step=self._log_grad_guard, hint=hint, known_norm=self._step_grad_norm)
            optimizer.register_step_pre_hook(guard)
            optimizer._calclip_guard = guard  # once per optimizer, however often it is handed back
        return optimizer

    def _get_grad_norm(self, model, grad_norm=None):
        """transformers' norm of this step's gradients (pre-clip), kept for the guard, which then needs no norm of
        its own: transformers computes it right before ``optimizer.step()`` whether or not it clips. (A transformers
        without this method never calls it; the guard then computes the norm itself.)"""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._grad_norm_of_step = (self.state.global_step, grad_norm)
        return grad_norm

    def _step_grad_norm(self):
        """The norm ``_get_grad_norm`` kept for the optimizer step now running, or None (another step's, or none)."""
        step, grad_norm = self.__dict__.pop("_grad_norm_of_step", (None, None))
        return grad_norm if step == self.state.global_step else None

    def _log_grad_guard(self, skipped: bool) -> None:
        self._metrics["train"]["grad/nonfinite_skipped"].append(float(skipped))
        if skipped:
            warnings.warn(f"optimizer step {self.state.global_step + 1}: the gradients are non-finite; the step is "
                          f"skipped (weights and optimizer state unchanged)", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------------------ data

    def _max_prompt_tokens(self) -> int | None:
        """Prompt tokens that leave room for max_completion_length in the model's positions (None: no known limit)."""
        config = self.accelerator.unwrap_model(self.model).config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        positions = self._model_positions = getattr(config, "max_position_embeddings", None)
        if not isinstance(positions, int) or self.max_completion_length is None:
            return None
        if self.max_completion_length >= positions:
            # TRL runs this (rotary models go past their trained positions); only a prompt that alone exceeds the
            # positions is refused then.
            warnings.warn(
                f"max_completion_length ({self.max_completion_length}) is not below the model's "
                f"max_position_embeddings ({positions}): long completions go past the positions the model was "
                "trained for",
                UserWarning,
                stacklevel=3,
            )
            return positions
        return positions - self.max_completion_length

    def _check_reward_outputs(self) -> None:
        """Wrap every reward function (reward models aside) so what it returns is checked naming it
        (calclip.run.reward_checks.checked_reward_function)."""
        self.reward_funcs = [
            func if isinstance(func, torch.nn.Module) or getattr(func, "calclip_checked", False)
            else checked_reward_function(func, name, is_async=is_async_callable(func))
            for func, name in zip(self.reward_funcs, self.reward_func_names, strict=True)
        ]

    def _check_datasets(self) -> None:
        """calclip.run.data_checks on the train and eval datasets, before anything is generated."""
        splits = [("train_dataset", self.train_dataset)]
        if isinstance(self.eval_dataset, dict):
            splits += [(f"eval_dataset[{name!r}]", dataset) for name, dataset in self.eval_dataset.items()]
        else:
            splits.append(("eval_dataset", self.eval_dataset))
        for split, dataset in splits:
            if dataset is None or not hasattr(dataset, "column_names") or not hasattr(dataset, "__len__"):
                continue  # an IterableDataset cannot be scanned ahead
            check_rows(dataset, self.reward_funcs, self.reward_func_names, split=split)
            self._check_prompt_lengths(dataset, split)

    def _check_prompt_lengths(self, dataset, split: str) -> None:
        limit = self._prompt_token_limit
        if limit is None or self._is_vlm or self.environment_factories is not None:
            return  # image tokens and per-environment tool schemas are only known at generation time
        tokenize = super()._tokenize_prompts  # TRL's own prompt tokenization (chat template, tools), untruncated
        counts = prompt_token_counts(list(dataset[PROMPT_COLUMN]), lambda prompts: tokenize(prompts)[0])
        long = [(index, tokens) for index, tokens in enumerate(counts) if tokens > limit]
        if not long:
            return
        if not self.args.truncate_long_prompts:
            raise ValueError(long_prompt_message(split, *long[0], limit, self.max_completion_length,
                                                 self._model_positions))  # fmt: skip
        warnings.warn(
            f"{split}: {len(long)} prompts (first: row {long[0][0]}, {long[0][1]} tokens) are longer than {limit} "
            "tokens and are left-truncated to their last tokens (truncate_long_prompts)",
            UserWarning,
            stacklevel=3,
        )

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = self._prompt_token_limit
        if self.args.truncate_long_prompts and limit is not None and not multimodal_fields:
            # Keep the end: the latest turn and the generation prompt the completion follows (TRL's left truncation).
            prompt_ids = [ids[-limit:] if len(ids) > limit else ids for ids in prompt_ids]
        return prompt_ids, images, multimodal_fields

    # ------------------------------------------------------------------------------------------ FP8 policy

    def _quantize_policy(self) -> None:
        # The fp8_* fields through the config's one table (CalibratedGRPOConfig.fp8_config). Sharded parameters
        # (FSDP, ZeRO-3) reach a layer's forward as a full weight all-gathered for that call and freed after it:
        # cached codes would keep a full FP8 copy of every layer on every rank (undoing the sharding), keyed on a
        # gather buffer whose pointer and version do not follow the weight's content.
        fp8_config = self.args.fp8_config(cache_weights=not self._params_sharded())
        quantize_model(self.accelerator.unwrap_model(self.model), fp8_config)

    def _params_sharded(self) -> bool:
        """Whether accelerate shards the policy's parameters over ranks (FSDP, DeepSpeed ZeRO-3)."""
        if self.is_fsdp_enabled:
            return True
        plugin = self.accelerator.state.deepspeed_plugin if self.is_deepspeed_enabled else None
        return plugin is not None and plugin.zero_stage == 3

    def _allow_compiled_generation(self) -> None:
        """TRL builds its GenerationConfig with disable_compile=True; compile_generation undoes exactly that, so
        transformers' own auto-compile (static cache, CUDA) captures the decode step. The FP8 layers' weight codes
        are refreshed in place by the eager prefill and the root pre-hook, so replays follow the training."""
        config = getattr(self, "generation_config", None)
        if config is None:  # vLLM or paged generation: no HF generate to compile
            warnings.warn("compile_generation has no effect with vLLM or paged generation", stacklevel=3)
            return
        policy = self.accelerator.unwrap_model(self.model)
        problem = compiled_generation_problem(self.accelerator.device.type, next(policy.parameters()).dtype,
                                              self.args.bf16, self.args.fp16)
        if problem:
            raise ValueError(problem)
        config.disable_compile = False
        if config.cache_implementation is None:
            config.cache_implementation = "static"
            self.generation_kwargs["cache_implementation"] = "static"
        if self.args.keep_generation_cache:
            self._generation_cache = KeptStaticCache()  # addresses the CUDA graphs replay with (generation_cache.py)

    def _compile_policy_layers(self) -> bool:
        """Compile the policy's decoder layers for the training forwards (``compile_layers``; null chooses,
        calclip.rollout.compiled_layers); return whether they are."""
        args = self.args
        on, why = resolve_compile_layers(
            args.compile_layers, device_type=self.accelerator.device.type, fp8=args.fp8,
            torch_compile=args.torch_compile, compile_generation=args.compile_generation,
            # transformers 5.2x renamed it activation_checkpointing (and keeps both names in step)
            gradient_checkpointing=bool(getattr(args, "activation_checkpointing", False)
                                        or args.gradient_checkpointing),
            sharded=self._params_sharded(), fp8_backward=args.fp8_backward)
        policy = self.accelerator.unwrap_model(self.model)
        if on and args.compile_layers is None and not repeated_blocks(policy):
            on, why = False, f"compile_layers auto: off, {type(policy).__name__} has no decoder layer list"
        self._layer_buckets = False
        self._bucket_shapes: set[tuple[int, int]] = set()  # (batch, padded length) the bucketed layers have met
        self._bucket_overflow_warned = False
        if on:  # an explicit true on a model without layers raises here, naming the model's class
            shapes, shapes_why = resolve_layer_shapes(args.compile_layers_shapes, fp8=args.fp8,
                                                      recipe=args.fp8_recipe)
            self._layer_buckets = shapes == "bucketed"
            if self._layer_buckets:
                raise_recompile_limit(BUCKETED_RECOMPILE_LIMIT)
            count = compile_repeated_blocks(policy, backend=args.compile_layers_backend,
                                            dynamic=not self._layer_buckets,
                                            options=inductor_options(args.compile_layers_backend))
            why += f": {count} layers, backend {args.compile_layers_backend}; {shapes_why}"
        logger.info(why)
        return on

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob forward; with ``compile_layers_shapes`` bucketed, on the policy, its sequence padded on the
        right to a bucket length (calclip.rollout.compiled_layers.pad_to_bucket) and the pads' columns cut off the
        log-probs and entropies. Multimodal inputs (their own token-aligned tensors) are passed through unpadded."""
        extras = [*args[3:], *(v for k, v in kwargs.items() if k not in _LOGPS_OPTIONS)]  # args: the options first
        if (not getattr(self, "_layer_buckets", False) or any(v is not None for v in extras)
                or self.accelerator.unwrap_model(model) is not self.accelerator.unwrap_model(self.model)):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        pad_id = getattr(self._tokenizer, "pad_token_id", None)  # masked out; any id in the vocabulary serves
        pad_id = pad_id if pad_id is not None else 0
        input_ids, attention_mask, pad = pad_to_bucket(input_ids, attention_mask, pad_id)
        shape = tuple(input_ids.shape)
        if shape not in self._bucket_shapes:  # a new static graph per grad mode
            self._bucket_shapes.add(shape)
            overflow = bucket_overflow(len(self._bucket_shapes))
            if overflow and not self._bucket_overflow_warned:
                self._bucket_overflow_warned = True
                warnings.warn(overflow, RuntimeWarning, stacklevel=2)
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep + pad, *args, **kwargs)
        if pad:
            logps = logps[:, :logits_to_keep]
            entropies = None if entropies is None else entropies[:, :logits_to_keep]
        return logps, entropies, aux_loss

    def _start_fp8_vllm(self) -> None:
        """Refuse FP8 layers vLLM's block-FP8 linear cannot serve, then start the deferred colocated engine.

        The engine's quantization_config (modules_to_not_convert) and every sync's FP8 tensors are read from the
        quantized policy, so both are exactly the layers trained in FP8. A server's tensor parallelism is its own.
        """
        tp = self.args.vllm_tensor_parallel_size if self.vllm_mode == "colocate" else 1
        check_vllm_compatible(self.vllm_generation.model, tensor_parallel_size=tp, keep_field="fp8_keep_patterns")
        self.vllm_generation.start_fp8_engine()

    def _bf16_shadow(self):
        """The BF16 shadow of the policy (quantization switched off); a no-op context without FP8."""
        if not self.args.fp8:
            return contextlib.nullcontext()
        return bf16_shadow(self.accelerator.unwrap_model(self.model))

    # ------------------------------------------------------------------------------------------ bounds

    @property
    def clip_policy(self) -> ClipPolicy:
        """The run's clip policy (calclip.clipping), built from the config's clip fields. The trainer has always read
        ``args.epsilon`` and ``args.epsilon_high`` at each step, so a change to them during training (a callback's
        schedule) still takes effect: the policy is rebuilt when those fields change, and only then."""
        if self._clip_fields() != self._clip_policy_fields:
            self._clip_policy = self._build_clip_policy()
        return self._clip_policy

    def _clip_fields(self) -> tuple:
        args = self.args
        return args.clip_mode, args.epsilon, args.clip_epsilon_high, args.dual_clip_c

    def _build_clip_policy(self) -> ClipPolicy:
        self._clip_policy_fields = clip_mode, epsilon, epsilon_high, dual_clip_c = self._clip_fields()
        return clip_policy_from_fields(clip_mode, epsilon=epsilon, epsilon_high=epsilon_high, dual_clip_c=dual_clip_c)

    @property
    def clip_mode(self) -> str:
        """The clip mode's registry key (``clip_mode`` of the config)."""
        return self.clip_policy.name

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """(low, high) ratio bounds in force."""
        return self.clip_policy.bounds_in_force(self.calibrator)

    @property
    def _generate_every(self) -> int:
        return self.args.steps_per_generation * self.num_iterations

    def _policy_moved(self, inputs) -> bool:
        """Whether this training micro-batch's policy moved since its old log-probs were taken."""
        if self.args.old_logps_source == "rollout" and self.use_vllm:
            return True  # a separate rollout engine: its log-probs differ from the trainer's from the start
        # The policy moved only if an optimizer step ran since the generation batch was produced (on the generate
        # path the rollout runs the trainer's own quantized modules, so this holds in bypass mode too). Comparing
        # optimizer steps, not micro-batch positions, stays right when generation rounds and accumulation windows
        # are misaligned (e.g. steps_per_generation 3, gradient_accumulation_steps 2).
        if self._old_logps_step is None or self.state.global_step <= self._old_logps_step:
            return False
        # Without old log-probs TRL uses the detached current ones: the ratio is exactly 1, nothing to calibrate.
        return self.args.old_logps_source == "rollout" or "old_per_token_logps" in inputs

    def _shadow_active(self) -> bool:
        """Shadow forwards run where the clip mode's bounds need them, and with FP8 for FP8-vs-BF16 monitoring."""
        return self.args.fp8 or self.clip_policy.needs_shadow

    def _shadow_due_this_round(self) -> bool:
        """Whether a shadow calibration may fall in the optimizer steps fed by the generation happening now."""
        if not (self._shadow_active() and self.args.calibration_is_meaningful):
            return False
        if self.clip_policy.needs_shadow_this_step(calibration_due=False):
            return True  # a mode whose bounds need the shadow on every moved mini-batch (the oracle)
        # The round's micro-batches are self._step ... self._step + generate_every - 1; count the optimizer steps they
        # span (one more than generate_every / GA when a round straddles a step boundary).
        accumulation = self.args.gradient_accumulation_steps
        num_steps = (self._step + self._generate_every - 1) // accumulation - self._step // accumulation + 1
        first = self.state.global_step
        return any(self.calibrator.needs_calibration(step) for step in range(first, first + num_steps))

    # ------------------------------------------------------------------------------------------ generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        # transformers syncs the decode loop across ranks for ZeRO-3 and for models it sharded itself, not for
        # accelerate's FSDP: there a rank whose sequences all ended would stop calling forward while the others wait
        # in FSDP's all-gather of the next decode step.
        recorder = _SampledLogprobRecorder(synced_gpus=self.is_fsdp_enabled and self.accelerator.num_processes > 1)
        policy = self.accelerator.unwrap_model(self.model)
        # No weight changes during generate: the FP8 codes are refreshed once, and a compiled decode step
        # (compile_generation) runs without the refresh check's graph break in front of it.
        cache = self._generation_cache
        kept = cache.attached(policy) if cache is not None else contextlib.nullcontext()
        # Rollouts run the layers eager (compile_layers): one token per call, a new shape every decode step.
        with kept, recorder.attached(policy), frozen_fp8_weights(policy), eager_blocks(policy):
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if logprobs is None and recorder.logprobs is not None:
            sampled = recorder.logprobs.cpu()
            logprobs = [sampled[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            # The optimizer step whose weights gave this batch's old log-probs (TRL buffers one batch per round).
            self._old_logps_step = self.state.global_step
        if mode == "train" and self.args.fp8 and self._shadow_due_this_round():
            output[BF16_OLD_LOGPS_KEY] = self._shadow_logps(output)
        self._log_repeated_ngrams(output, mode)
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL's rewards (gathered over ranks, so the count below is global), with +-inf handled like None.
        rewards_per_func, counts = exclude_nonfinite_rewards(
            super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        )
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["reward/nonfinite_count"].append(float(counts.sum().item()))
        bad = {name: int(n) for name, n in zip(self.reward_func_names, counts.tolist()) if n}
        if bad:
            warnings.warn(
                f"reward function(s) returned +-inf: {bad} (completions of {len(rewards_per_func)}); those completions "
                "are excluded like None rewards (advantage 0), the rest of their groups keep their advantages",
                RuntimeWarning,
                stacklevel=2,
            )
        return rewards_per_func

    def _shadow_logps(self, batch) -> torch.Tensor:
        """BF16 shadow log-probs of the batch's completion tokens under the current weights (no grad).

        Its wall time (device work included: synchronized before and after) adds to the step's ``time/bf16_shadow``,
        the cost of the shadow statistics, to read against ``step_time``."""
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        sync = torch.cuda.synchronize if input_ids.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.no_grad(), self._bf16_shadow(), eager_blocks(self.model):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                batch["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
                **{key: batch.get(key) for key in _FORWARD_KEYS},
            )
        sync()
        self._shadow_seconds += time.perf_counter() - start
        return logps

    def _log_repeated_ngrams(self, batch, mode: str) -> None:
        mask = batch["completion_mask"].bool().cpu()
        sequences = [ids[keep].tolist() for ids, keep in zip(batch["completion_ids"].cpu(), mask)]
        repeated, total = repeated_ngram_counts(sequences, self.args.repeat_ngram_size)
        counts = torch.tensor([repeated, total], dtype=torch.float64, device=self.accelerator.device)
        repeated, total = self.accelerator.reduce(counts, reduction="sum").tolist()
        self._metrics[mode]["completions/repeat_ngram_frac"].append(repeated / total if total else 0.0)

    # ------------------------------------------------------------------------------------------ loss

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{key: inputs.get(key) for key in _FORWARD_KEYS},
        )
        advantages = inputs["advantages"]
        old_logps = self._old_logps(inputs, logps)
        stats: dict[str, torch.Tensor] = {}  # per-micro-batch scalars
        token_sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (sum, count) of token-level metrics
        calibration_stats, ratio_fp8, ratio_bf16 = ({}, None, None)
        if mode == "train":
            calibration_stats, ratio_fp8, ratio_bf16 = self._calibrate(inputs, logps, old_logps, advantages, mask)
        low, high, dual_clip_c = self.clip_policy.batch_bounds(self.clip_bounds, ratio_fp8=ratio_fp8,
                                                               ratio_bf16=ratio_bf16, advantages=advantages)
        if ratio_fp8 is not None:
            self._log_drop_scores(ratio_fp8, ratio_bf16, advantages, mask, low)
        is_weights = self._rollout_correction(inputs, old_logps, mask, stats)

        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        window_scale = 1.0
        if self.loss_type == "dapo":
            # TRL: num_items_in_batch spans the generation batch of all ranks, clamped at 1 and rescaled to one
            # accumulation window (x GA / steps_per_generation). The window factor is applied to the loss below,
            # not folded into num_items, so aggregate()'s clamp at 1 cannot cut it (exact parity with TRL as long
            # as the global batch has at least one token per rank).
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                window_scale = self.args.steps_per_generation / accumulation
        loss, surrogate_stats = clipped_surrogate(
            logps,
            old_logps,
            advantages,
            mask,
            low=low,
            high=high,
            dual_clip_c=dual_clip_c,
            level=self.importance_sampling_level,
            aggregation=self.loss_type,
            max_completion_length=self.max_completion_length,
            num_items=num_items,
            is_weights=is_weights,
        )
        loss = loss * window_scale
        policy_loss = loss.detach()
        if self.loss_type != "dapo":
            loss = loss / accumulation

        if self.beta != 0.0:
            kl = self._kl_term(inputs, logps, old_logps, mask, num_items, token_sums)
            loss = loss + self.beta * window_scale * kl / (1 if self.loss_type == "dapo" else accumulation)
        if self._entropy_bonus_enabled:
            # TRL's bonus: the mean per-token entropy, scaled only for gradient accumulation. Non-finite entropies
            # are left out like non-finite log-probs in the policy loss.
            keep = (mask != 0) & torch.isfinite(entropies)
            mean_entropy = torch.where(keep, entropies, 0.0).sum() / keep.sum().clamp(min=1)
            loss = loss - self.entropy_coef * mean_entropy / accumulation
            stats["policy_loss"] = policy_loss
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            stats["aux_loss"] = aux_loss.detach()

        self._log_loss_metrics(mode, stats, token_sums, surrogate_stats, calibration_stats, inputs, logps, old_logps,
                               entropies, advantages, mask, (low, high))  # fmt: skip
        return loss

    def _old_logps(self, inputs, logps) -> torch.Tensor:
        if self.args.old_logps_source == "rollout":
            if "sampling_per_token_logps" not in inputs:
                raise RuntimeError(
                    "old_logps_source='rollout' needs rollout log-probs, but this generation path returned none "
                    "(transformers continuous batching does not expose them)"
                )
            return inputs["sampling_per_token_logps"]
        # TRL skips the old log-prob forward when every mini-batch is on-policy: then old == current (detached).
        old = inputs.get("old_per_token_logps")
        return logps.detach() if old is None else old

    def _rollout_correction(self, inputs, old_logps, mask, stats) -> torch.Tensor | None:
        if self.args.tis_mode == "none":
            # TRL's own vLLM correction, applied exactly as GRPOTrainer does when it is on.
            return inputs.get("importance_sampling_ratio")
        if "sampling_per_token_logps" not in inputs:
            raise RuntimeError(
                f"tis_mode={self.args.tis_mode!r} needs rollout log-probs; this generation path returned none"
            )
        weights, tis_stats = rollout_correction_weights(
            old_logps,
            inputs["sampling_per_token_logps"],
            mask,
            mode=self.args.tis_mode,
            cap=self.args.tis_cap,
            lower_cap=self.args.tis_lower_cap,
        )
        stats.update(tis_stats)
        return weights

    def _kl_term(self, inputs, logps, old_logps, mask, num_items, token_sums) -> torch.Tensor:
        """TRL's k3 KL to the reference model, aggregated like the policy loss (before accumulation scaling)."""
        ref = inputs["ref_per_token_logps"]
        # A non-finite log-prob (policy, reference or old) leaves the KL term like it leaves the policy loss; the
        # inputs are replaced before exp so that no NaN reaches the backward pass either.
        valid = (mask != 0) & torch.isfinite(logps) & torch.isfinite(ref) & torch.isfinite(old_logps)
        logps, ref = torch.where(valid, logps, 0.0), torch.where(valid, ref, 0.0)
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if self.args.use_bias_correction_kl:
            ratio, _ = importance_ratio(logps, torch.where(valid, old_logps, 0.0), valid,
                                        level=self.importance_sampling_level)
            per_token_kl = per_token_kl * ratio
        token_sums["kl"] = sum_count(per_token_kl, valid)
        return aggregate(
            per_token_kl, valid, self.loss_type, max_completion_length=self.max_completion_length, num_items=num_items
        )

    # ------------------------------------------------------------------------------------------ calibration

    def _calibrate(self, inputs, logps, old_logps, advantages, mask):
        """On a moved mini-batch: its ratios; pool its tokens for the calibration when one is due (or for the
        every_step refit), and compute the BF16 shadow ratios where the calibration or the oracle needs them.

        Returns (stats, ratio_fp8, ratio_bf16): the shadow step's stats, and the ratios (None on a mini-batch that
        is on-policy, and ratio_bf16 None without a shadow forward). The bounds in force are not changed here: a
        calibration commits when the next generation round starts (``_commit_calibration``), so every mini-batch is
        trained and scored with bounds fitted on other tokens.
        """
        if not self._policy_moved(inputs):
            return {}, None, None
        ratio_fp8 = torch.exp(token_log_ratio(logps.detach(), old_logps))
        if not self._shadow_active():
            return {}, ratio_fp8, None  # a BF16 run with static bounds: its own drops are still scored
        due = self.calibrator.needs_calibration(self.state.global_step)
        if self.clip_policy.needs_shadow_this_step(due):
            ratio_bf16, bf16_logps = self._shadow_ratio(inputs, logps, ratio_fp8)
            if ratio_bf16 is None:  # no shadow old log-probs for this round: stays due, the next round has them
                return {}, ratio_fp8, None
            if due:
                self.calibrator.observe(ratio_bf16, ratio_fp8, advantages, mask)
            if self._ratio_histograms is not None:
                self._ratio_histograms.record(split_ratios(ratio_fp8, ratio_bf16, advantages, mask))
            stats = self._static_drop_shares(ratio_bf16, ratio_fp8, advantages, mask)
            if bf16_logps is not None:
                count = ((mask != 0) & torch.isfinite(logps) & torch.isfinite(bf16_logps)).sum()
                local_mean = token_mult_prob_error(logps, bf16_logps, mask)
                name = "mismatch/fp8_bf16_token_mult_prob_error"
                stats.update(self._global_token_means({name: (local_mean * count, count)}))
            return stats, ratio_fp8, ratio_bf16
        if self.args.calibration_schedule == "every_step" and self.clip_policy.uses_calibrator:
            if self.calibrator.calibrated:
                self.calibrator.observe(None, ratio_fp8, advantages, mask)
        return {}, ratio_fp8, None

    def training_step(self, model, inputs, num_items_in_batch):
        loss = super().training_step(model, inputs, num_items_in_batch)  # TRL counts the micro-batch (self._step)
        if self._step % self._generate_every == 0:
            self._commit_calibration()
        return loss

    def _commit_calibration(self) -> None:
        """Fit the bounds on the tokens pooled since the last commit, after the last micro-batch of a generation
        round (DESIGN.md step 8), so they apply from the next round on and every mini-batch is trained with bounds
        fitted on other tokens; below calibration_min_tokens the bounds in force stay (calib/fit 0). Every rank
        commits together; the pool is global, so they agree."""
        stats = self.calibrator.commit(self.state.global_step)
        for name, value in stats.items():
            if name not in ("calib/low", "calib/high"):  # the bounds in force are logged with every loss
                self._metrics["train"][name].append(float(value))
        self._report_starvation(stats)

    def _shadow_ratio(self, inputs, logps, ratio_fp8):
        """BF16 shadow ratios of the mini-batch (and the BF16 current log-probs), or (None, None) without data."""
        if not self.args.fp8:
            return ratio_fp8, None  # the shadow of an unquantized policy is the policy itself
        bf16_old = inputs.get(BF16_OLD_LOGPS_KEY)
        if bf16_old is None:
            return None, None  # stays due; the next generation computes the shadow old log-probs
        bf16_logps = self._shadow_logps(inputs)
        return torch.exp(token_log_ratio(bf16_logps, bf16_old)), bf16_logps

    # ------------------------------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # resume_from_checkpoint=True: the latest *complete* checkpoint, where transformers' get_last_checkpoint takes
        # the highest-numbered folder even when a kill during its save left it half-written.
        # An explicit path gets the same check (refused, not skipped: the caller named it) instead of going straight
        # to transformers, which resumes a folder without optimizer.pt with a fresh optimizer.
        if resume_from_checkpoint is True:
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True: no complete checkpoint-N folder in output_dir "
                    f"{self.args.output_dir!r}"
                )
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = check_resume_checkpoint(os.fspath(resume_from_checkpoint))
        if isinstance(resume_from_checkpoint, str):
            check_resume_step(resume_from_checkpoint, self.args.max_steps)
        per_generation = self.args.generation_batch_size // self.num_generations  # distinct prompts a round draws
        check_train_rows(self.train_dataset, prompts_per_generation=per_generation)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._generation_cache is not None:
                self._generation_cache.release()  # the KV cache kept across rollouts is not needed after training

    def _calibration_settings(self) -> dict:
        """The trainer settings besides the calibrator's own under which its bounds were fitted."""
        return {"fp8": self.args.fp8, "fp8_recipe": self.args.fp8_recipe, "clip_mode": self.clip_mode}

    def calclip_state_dict(self) -> dict:
        return {"calibrator": self.calibrator.state_dict(), "spike_detector": self.spike_detector.state_dict(),
                "settings": self._calibration_settings()}  # fmt: skip

    def load_calclip_state_dict(self, state: dict) -> None:
        """Restore the calibrator and spike detector. A saved calibration made under other clip settings (epsilons,
        calibration_upper, rails, calibration_min_tokens; or fp8, fp8_recipe, clip_mode) is not applied: the
        calibrator starts fresh with a calibration due at once, and a warning names the changed settings."""
        if not isinstance(state, dict):
            raise ValueError(f"the state must be a dict, got {type(state).__name__}")
        check_state(state["calibrator"])
        check_state_against_run(state["calibrator"], **self._resume_limits())
        detector = state.get("spike_detector")
        # One update per optimizer step, credited to a step not after the checkpoint's (one more update allowed: a
        # count does not depend on whether the steps are numbered from 0 or 1).
        for name, most in (("num_steps", self.state.global_step + 1), ("last_spike_step", self.state.global_step)):
            value = detector.get(name) if isinstance(detector, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                raise ValueError(f"spike_detector.{name} ({value}) is beyond the checkpoint's global_step "
                                 f"({self.state.global_step}): the state is not this run's")
        changed = self.calibrator.load_state_dict(state["calibrator"])
        saved = state.get("settings", {})
        if not isinstance(saved, dict):
            raise ValueError(f"'settings' must be a dict, got {type(saved).__name__}")
        current = self._calibration_settings()
        trainer_changed = [name for name in current if saved.get(name) != current[name]]
        if trainer_changed:
            self.calibrator.reset()
        self.spike_detector.load_state_dict(state["spike_detector"])
        if changed or trainer_changed:
            fitted = [name for name in changed if name in FIT_SETTINGS] + trainer_changed
            action = ("the saved bounds are discarded and a calibration is due at once" if fitted else
                      "the saved bounds are kept under the new cadence")
            warnings.warn(f"resuming with changed calibration settings {changed + trainer_changed}: {action}",
                          UserWarning, stacklevel=2)

    def _resume_limits(self) -> dict:
        """What this run could have left in a calibrator state by the resumed ``global_step``
        (calclip.calibration.state.check_state_against_run)."""
        every, accumulation = self._generate_every, self.args.gradient_accumulation_steps
        return {
            "global_step": self.state.global_step,
            "step_slack": (every - 1) // accumulation + 1,  # _shadow_due_this_round asks about the round's steps
            "max_commits": self.state.global_step * accumulation // every + 1,
            "max_pool_tokens_per_round": every * self.args.per_device_train_batch_size
            * self.args.max_completion_length * self.accelerator.num_processes,
        }

    def _save_optimizer_and_scheduler(self, output_dir):
        # Written with the optimizer state it resumes with (the mirror of _load_optimizer_and_scheduler), inside
        # Trainer._save_checkpoint: before the checkpoint is pushed to the hub or older ones are rotated away.
        # (With save_only_model neither is saved, and such a checkpoint cannot resume.)
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            save_calclip_state(self.calclip_state_dict(), os.path.join(output_dir, CALCLIP_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CALCLIP_STATE_NAME)
        if os.path.exists(path):
            state = load_calclip_state(path)  # weights_only: a crafted pickle is refused, never run
            try:
                self.load_calclip_state_dict(state)
            except (KeyError, TypeError, ValueError) as err:
                reason = f"its calibrator/spike-detector state is incomplete or malformed ({err})"
                raise CalclipStateError(
                    f"{path}: {reason}. Either resume from an earlier checkpoint, or delete {path} to resume with a "
                    "fresh calibrator.",
                    reason,
                ) from err
        else:
            warnings.warn(f"{path} not found: calibrator and spike detector start fresh", UserWarning, stacklevel=2)
