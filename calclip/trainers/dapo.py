"""DAPO on top of CalibratedGRPOTrainer: dynamic sampling, overlong filtering, soft overlong punishment.

DAPO (Yu et al., 2025) adds to GRPO:

- clip-higher (eps_low 0.2, eps_high 0.28) and the token-level ``dapo`` loss: config values
  (`CalibratedDAPOConfig` sets them);
- overlong filtering: truncated completions are masked out of the loss. TRL's ``mask_truncated_completions``
  already does exactly that, so the DAPO config turns it on and nothing here re-implements it;
- the soft overlong punishment reward: `soft_overlong_punishment` below;
- dynamic sampling: a group whose completions all got the same reward has zero advantage everywhere and only
  dilutes the batch. Such groups are dropped and more prompts are generated until the generation batch is full
  again, with a cap on the extra rounds. TRL has no such option.

The seam for dynamic sampling is `_generate_and_score_completions`: TRL's `_prepare_inputs` calls it once per
generation batch and splits its output into `steps_per_generation` mini-batches. The override calls `super()`
(so the calibrated trainer's rollout log-probs, old log-probs and advantages are computed as usual), keeps the
rows of informative groups, calls `super()` again on freshly drawn prompts while rows are missing, and returns a
batch of the original size. The group rewards come from a thin `_calculate_rewards` override that records what
`super()` returns. No TRL method body is copied.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from calclip.trainers.grpo import CalibratedGRPOTrainer

# Two rewards closer than this count as equal when deciding whether a group carries signal.
REWARD_TIE_TOLERANCE = 1e-6


def soft_overlong_punishment(
    max_completion_length: int, cache_length: int, *, penalty_factor: float = 1.0
) -> Callable[..., list[float]]:
    """The DAPO paper's soft overlong punishment as a TRL reward function (reads ``completion_ids``).

    With L_max = ``max_completion_length`` and L_cache = ``cache_length``, a completion of |y| tokens gets

        0                                   if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                  if |y| > L_max

    times ``penalty_factor``: the penalty ramps linearly from 0 to -penalty_factor over the last L_cache tokens of
    the budget. (A generate call stops at L_max tokens, so the last branch only fires for externally produced
    completions.)
    """
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
    if not 0 < cache_length <= max_completion_length:
        raise ValueError(
            f"overlong cache_length must be in (0, max_completion_length={max_completion_length}], got {cache_length}"
        )
    if not penalty_factor >= 0.0:
        raise ValueError(f"overlong penalty_factor must be >= 0, got {penalty_factor}")
    expected_length = max_completion_length - cache_length

    def soft_overlong_punishment_reward(completion_ids: Sequence[Sequence[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= expected_length:
                rewards.append(0.0)
            elif length <= max_completion_length:
                rewards.append(penalty_factor * (expected_length - length) / cache_length)
            else:
                rewards.append(-penalty_factor)
        return rewards

    # TRL logs each reward function under its __name__ (rewards/<name>/mean).
    soft_overlong_punishment_reward.__name__ = "soft_overlong_punishment"
    return soft_overlong_punishment_reward


def informative_rows(
    rewards_per_func: torch.Tensor,  # [N, F] rewards of every completion (all processes), NaN = not scored
    reward_weights: torch.Tensor,  # [F]
    num_generations: int,
    *,
    tolerance: float = REWARD_TIE_TOLERANCE,
) -> torch.Tensor:
    """[N] bool: True for the completions of groups (``num_generations`` consecutive rows) whose weighted reward
    is not constant. A group whose rows are all NaN (unscorable) is uninformative too."""
    if rewards_per_func.size(0) % num_generations:
        raise ValueError(f"{rewards_per_func.size(0)} rewards do not split into groups of {num_generations}")
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)
    rewards = rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))
    grouped = rewards.view(-1, num_generations)
    # nan-aware spread: NaN rows neither raise the max nor lower the min.
    spread = grouped.nan_to_num(-math.inf).amax(dim=1) - grouped.nan_to_num(math.inf).amin(dim=1)
    informative = torch.isfinite(spread) & (spread > tolerance)
    return informative.repeat_interleave(num_generations)


def select_rows(batch: dict, rows: torch.Tensor) -> dict:
    """The rows (a 1-D index or bool tensor) of every per-row entry of a scored batch; scalars pass through."""
    index = rows.nonzero(as_tuple=True)[0] if rows.dtype == torch.bool else rows
    num_rows = batch["completion_ids"].size(0)
    selected = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == num_rows:
            selected[key] = value[index.to(value.device)]
        elif isinstance(value, list) and len(value) == num_rows:
            selected[key] = [value[i] for i in index.tolist()]
        else:
            selected[key] = value
    return selected


def concat_batches(parts: Sequence[dict], *, pad_token_id: int) -> dict:
    """Concatenate scored batches row-wise. Sequence tensors are re-padded to the longest part: entries named
    ``prompt*`` on the left (TRL left-pads prompts), all others on the right; ``*_ids`` with ``pad_token_id``,
    everything else (masks, log-probs) with 0. Per-row lists are concatenated; scalars are taken from the first
    part (the caller recomputes ``num_items_in_batch``)."""
    parts = [part for part in parts if part["completion_ids"].size(0) > 0] or list(parts[:1])
    merged = {}
    for key, first in parts[0].items():
        values = [part[key] for part in parts]
        row_counts = [part["completion_ids"].size(0) for part in parts]
        if isinstance(first, torch.Tensor) and first.dim() > 0 and first.size(0) == row_counts[0]:
            if first.dim() >= 2:
                width = max(v.size(1) for v in values)
                pad_value = pad_token_id if key.endswith("_ids") else 0
                left = key.startswith("prompt")
                values = [
                    F.pad(v, (width - v.size(1), 0) if left else (0, width - v.size(1)), value=pad_value)
                    if v.dim() == 2
                    else v
                    for v in values
                ]
            merged[key] = torch.cat(values, dim=0)
        elif isinstance(first, list) and len(first) == row_counts[0]:
            merged[key] = [item for value in values for item in value]
        else:
            merged[key] = first
    return merged


# Batch keys of TRL 1.16's vision-language path whose first dimension counts images or patches, not rows.
_PER_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "num_images",
                   "spatial_shapes", "num_tiles", "image_position_ids")


class CalibratedDAPOTrainer(CalibratedGRPOTrainer):
    """`CalibratedGRPOTrainer` plus DAPO's dynamic sampling and soft overlong punishment.

    Use with `CalibratedDAPOConfig`. Config fields read here: ``dynamic_sampling`` (bool),
    ``dynamic_sampling_max_rounds`` (most generation rounds per generation batch, the first included; when they
    run out the batch is topped up with uninformative rows, which have zero advantage, so its size and the
    ``steps_per_generation`` split stay as TRL expects), ``overlong_buffer_length`` and ``overlong_penalty_factor``
    (when both are > 0 the soft overlong punishment is appended to the reward functions with weight 1; a
    ``reward_weights`` list in the config gets that 1 appended).

    Logged (under train/): ``dynamic_sampling/rounds`` (generation rounds, 1 = nothing dropped),
    ``dynamic_sampling/dropped_groups``, ``dynamic_sampling/underfilled_rows`` (rows, over all processes, that had
    to be filled with uninformative samples).
    """

    def __init__(self, model, reward_funcs, args=None, *pos, **kwargs):
        cache_length = getattr(args, "overlong_buffer_length", 0)
        penalty_factor = getattr(args, "overlong_penalty_factor", 0.0)
        if cache_length > 0 and penalty_factor > 0:
            reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
            reward_funcs.append(
                soft_overlong_punishment(args.max_completion_length, cache_length, penalty_factor=penalty_factor)
            )
            if args.reward_weights is not None and len(args.reward_weights) == len(reward_funcs) - 1:
                args.reward_weights = [*args.reward_weights, 1.0]
        super().__init__(model, reward_funcs, args, *pos, **kwargs)
        self._last_rewards_per_func: torch.Tensor | None = None
        # Refill prompts differ across processes (each process draws whole groups of its own).
        self._refill_rng = random.Random(f"{self.args.seed}-{self.accelerator.process_index}")
        if self._dynamic_sampling_enabled and isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("dynamic_sampling needs a map-style train_dataset "
                             "(an IterableDataset cannot be resampled)")

    @property
    def _dynamic_sampling_enabled(self) -> bool:
        return bool(getattr(self.args, "dynamic_sampling", False))

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._last_rewards_per_func = rewards_per_func  # gathered over processes: [num_processes * len(prompts), F]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if not (self._dynamic_sampling_enabled and self.model.training):
            return super()._generate_and_score_completions(inputs)

        target = len(inputs)
        group_size = self.num_generations
        max_rounds = self.args.dynamic_sampling_max_rounds
        kept_parts, dropped_parts = [], []
        # Rows kept so far on every process. All processes see the same gathered rewards, so they take the same
        # decisions and call the (collective) generation the same number of times.
        kept_per_process = torch.zeros(self.accelerator.num_processes, dtype=torch.long)
        dropped_groups = 0
        rounds = 0
        batch_inputs = inputs
        while True:
            rounds += 1
            batch = super()._generate_and_score_completions(batch_inputs)
            image_keys = sorted(key for key in _PER_IMAGE_KEYS if key in batch)
            if image_keys:
                # These tensors are indexed per image or patch, not per row: row selection would misalign them.
                raise NotImplementedError(
                    f"dynamic_sampling does not support multimodal batches (found {image_keys}); set "
                    "dynamic_sampling=False for vision-language models"
                )
            keep = informative_rows(self._last_rewards_per_func, self.reward_weights, group_size).cpu()
            dropped_groups += int((~keep).sum()) // group_size
            keep_by_process = keep.view(self.accelerator.num_processes, -1)
            local_keep = keep_by_process[self.accelerator.process_index]
            kept_parts.append(select_rows(batch, local_keep))
            dropped_parts.append(select_rows(batch, ~local_keep))
            kept_per_process += keep_by_process.sum(dim=1)

            missing = target - int(kept_per_process.min())
            if missing <= 0 or rounds >= max_rounds:
                break
            batch_inputs = self._draw_refill_inputs(math.ceil(missing / group_size))

        pad_token_id = self.processing_class.pad_token_id
        if pad_token_id is None:  # processors (VLMs) keep the tokenizer inside
            pad_token_id = self._tokenizer.pad_token_id
        # Informative rows first; if the rounds ran out, top up with uninformative (zero-advantage) rows.
        merged = concat_batches(kept_parts + dropped_parts, pad_token_id=pad_token_id)
        output = select_rows(merged, torch.arange(target))
        local_kept = int(kept_per_process[self.accelerator.process_index])
        underfilled = self.accelerator.gather(torch.tensor([max(target - local_kept, 0)],
                                                           device=self.accelerator.device))

        loss_mask = output["completion_mask"]
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]
        output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()

        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(float(rounds))
        metrics["dynamic_sampling/dropped_groups"].append(float(dropped_groups))
        metrics["dynamic_sampling/underfilled_rows"].append(float(underfilled.sum()))
        return output

    def _draw_refill_inputs(self, num_groups: int) -> list[dict]:
        """``num_groups`` random prompts of the train dataset, each repeated ``num_generations`` times in a row,
        the layout TRL's RepeatSampler gives a generation batch."""
        dataset = self.train_dataset
        rows = []
        for _ in range(num_groups):
            example = dataset[self._refill_rng.randrange(len(dataset))]
            rows.extend(dict(example) for _ in range(self.num_generations))
        return rows
