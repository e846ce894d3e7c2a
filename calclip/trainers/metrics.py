"""The trainer's loss-step metrics (``CalibratedGRPOTrainer``'s monitoring, DESIGN.md "Metrics"): token-level
sums reduced over ranks as exact global means, per-micro-batch scalars, window extremes, the out-of-sample drop
scores, TIS summaries, the mismatch outliers, calibration starvation and entropy-spike detection.

A mixin of ``CalibratedGRPOTrainer`` (calclip.trainers.grpo), which holds the state these methods read and write
(``_metrics``, ``accelerator``, ``args``, ``calibrator``, ``spike_detector``, ``_starvation``, ``_outlier_log``,
``_step_entropies``, ``_shadow_seconds``); the metric names are listed in that module's docstring.
"""

from __future__ import annotations

import math
import warnings

import torch
from trl.trainer.utils import nanmax, nanmin

from calclip.calibration import drop_counts, drop_shares
from calclip.fp8 import pop_nonfinite_count
from calclip.losses import importance_ratio, kl_k3, token_mult_prob_error
from calclip.monitoring.callbacks import send_wandb_alert
from calclip.monitoring.mismatch_outliers import MismatchOutlierLog, burst_counts, logp_gaps, outlier_path

BF16_OLD_LOGPS_KEY = "bf16_old_per_token_logps"  # the BF16 shadow old log-probs in a batch (the trainer's key)

# Logged on every mini-batch; the calibrator's copies of them are not logged a second time.
_PER_STEP_STATS = ("calib/low", "calib/high", "clip/neg_low_frac_fp8", "clip/pos_high_frac")
# Stats summed over ranks (counts); every other stat is averaged over ranks.
_SUMMED_STATS = ("fp8/nonfinite_tokens", "loss/nonfinite_tokens", "tis/nonfinite_tokens")
# Reduced over ranks, and over the micro-batches of a logging window, by their extreme, not their mean.
_MIN_STATS, _MAX_STATS = ("tis/weight_min",), ("tis/weight_max", "mismatch/max_abs_logp_diff")


def sum_count(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of x over keep, |keep|) with values outside keep ignored even if non-finite."""
    x = x.detach().to(torch.promote_types(x.dtype, torch.float32))  # a bfloat16 sum of many tokens is coarse
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(), keep.sum()


class LossMetrics:
    """The loss step's metrics and monitoring; mixed into CalibratedGRPOTrainer."""

    def _report_starvation(self, stats: dict) -> None:
        """calib/short_rounds and calib/pool_tokens at each round end of a calibrated run, and a warning when rounds
        in a row stay below calibration_min_tokens (StarvationWatch: once, then rate-limited)."""
        if not self.clip_policy.uses_calibrator:
            return  # modes whose bounds are not the calibrator's never apply a fit: a short pool changes nothing
        metrics, message = self._starvation.record(stats)
        for name, value in metrics.items():
            self._metrics["train"][name].append(value)
        if message and self.accelerator.is_main_process:
            warnings.warn(message, UserWarning, stacklevel=3)

    def _log_drop_scores(self, ratio_fp8, ratio_bf16, advantages, mask, low) -> None:
        """Out-of-sample scores of the lower bound in force (DESIGN.md step 10) on a moved mini-batch: counts
        summed over ranks, and the shares.

        oos/neg_tokens, oos/fp8_drops: A<0 tokens, and those below the bound in force (their penalty dropped);
        oos/neg_drop_frac is their quotient. On shadow mini-batches also oos/shadow_neg_tokens,
        oos/shadow_fp8_drops, oos/shadow_bf16_drops (BF16 shadow ratio below 1 - epsilon), oos/shadow_both_drop, and
        oos/drop_recall (share of BF16's drops that FP8 drops too) and oos/drop_precision (share of FP8's drops that
        BF16 drops too) where defined. A window's share is the quotient of the summed counts.
        """
        counts = drop_counts(ratio_fp8, advantages, mask, low, ratio_bf16=ratio_bf16, base_low=1.0 - self.args.epsilon)
        counts = self.accelerator.reduce(counts, reduction="sum")
        shares = drop_shares(counts)
        neg, fp8, bf16, both = counts.tolist()
        metrics = self._metrics["train"]
        metrics["oos/neg_tokens"].append(neg)
        metrics["oos/fp8_drops"].append(fp8)
        metrics["oos/neg_drop_frac"].append(shares["neg_drop_frac"])
        if ratio_bf16 is None:
            return  # no shadow: the BF16 counts are zeros, not measurements
        for name, value in (("neg_tokens", neg), ("fp8_drops", fp8), ("bf16_drops", bf16), ("both_drop", both)):
            metrics[f"oos/shadow_{name}"].append(value)
        for name in ("drop_recall", "drop_precision"):
            if name in shares:
                metrics[f"oos/{name}"].append(shares[name])

    def _static_drop_shares(self, ratio_bf16, ratio_fp8, advantages, mask) -> dict[str, float]:
        """Global shares of A<0 tokens whose ratio is below the static bound 1 - epsilon, BF16 shadow vs FP8: what
        BF16 training would drop, and what static clipping drops under FP8 noise (the gradient dropout that the
        calibrated bound removes)."""
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        neg = (mask != 0) & (adv < 0)
        base_low = 1.0 - self.args.epsilon
        counts = torch.stack([(neg & (ratio_bf16 < base_low)).sum(), (neg & (ratio_fp8 < base_low)).sum(), neg.sum()])
        hits_bf16, hits_fp8, total = self.accelerator.reduce(counts.to(torch.float64), reduction="sum").tolist()
        return {
            "clip/neg_low_frac_bf16": hits_bf16 / total if total else 0.0,
            "clip/neg_low_frac_fp8_static": hits_fp8 / total if total else 0.0,
        }

    def _log_loss_metrics(self, mode, stats, token_sums, surrogate_stats, calibration_stats, inputs, logps, old_logps,
                          entropies, advantages, mask, bounds) -> None:  # fmt: skip
        low, high = bounds  # the loss's bounds (per token for the oracle)
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        in_mask = mask != 0
        # Token-level metrics are (sum, count) pairs reduced over ranks: token-weighted global means, like TRL's
        # global_masked_mean (a per-rank mean averaged over ranks would overweight ranks with few tokens).
        token_sums = dict(token_sums)
        finite_entropy = in_mask & torch.isfinite(entropies)
        token_sums["entropy"] = sum_count(entropies, finite_entropy)
        token_sums["entropy/neg_adv"] = sum_count(entropies, finite_entropy & torch.isfinite(adv) & (adv < 0))
        # calclip.losses reports shares over the tokens its surrogate kept (finite inputs) and their populations
        # (A<0 and A>0 tokens); weighted by those, the shares reduce as exact global shares.
        neg, pos = surrogate_stats["neg_tokens"], surrogate_stats["pos_tokens"]
        token_sums["clip/neg_low_frac_fp8"] = (surrogate_stats["clip/neg_low_frac"] * neg, neg)
        token_sums["clip/pos_high_frac"] = (surrogate_stats["clip/pos_high_frac"] * pos, pos)
        token_sums["clip/dual_frac"] = (surrogate_stats["clip/dual_frac"] * neg, neg)
        # Tokens the loss dropped for a non-finite log-prob/advantage, and (FP8) tokens whose FP8 linear output was
        # non-finite in any forward since the last loss step (generation and shadow forwards included).
        stats["loss/nonfinite_tokens"] = surrogate_stats["nonfinite_tokens"]
        if self.args.fp8:
            stats["fp8/nonfinite_tokens"] = pop_nonfinite_count(self.accelerator.unwrap_model(self.model)).to(
                logps.device
            )
        # TRL's clip_ratio/* (shares of all completion tokens, or of sequences for a sequence-level ratio [B, 1]),
        # against the bounds in force (TRL's own bounds in the static modes).
        ratio, _ = importance_ratio(logps.detach(), old_logps, mask, level=self.importance_sampling_level)
        is_low = (ratio < low) & (adv < 0)
        is_high = (ratio > high) & (adv > 0)
        keep = in_mask if is_low.size(-1) == mask.size(-1) else torch.ones_like(is_low)
        token_sums["clip_ratio/low_mean"] = sum_count(is_low.float(), keep)
        token_sums["clip_ratio/high_mean"] = sum_count(is_high.float(), keep)
        token_sums["clip_ratio/region_mean"] = sum_count((is_low | is_high).float(), keep)
        if "sampling_per_token_logps" in inputs and self.args.old_logps_source == "trainer":
            rollout = inputs["sampling_per_token_logps"]
            both_finite = in_mask & torch.isfinite(old_logps) & torch.isfinite(rollout)
            count = both_finite.sum()
            token_sums["mismatch/token_mult_prob_error"] = (token_mult_prob_error(old_logps, rollout, mask) * count,
                                                            count)  # fmt: skip
            token_sums["mismatch/kl_k3"] = (kl_k3(old_logps, rollout, mask) * count, count)
            self._mismatch_outliers(mode, inputs, old_logps, rollout, mask, stats, token_sums)
        if "tis/weight_mean" in stats:
            self._tis_token_sums(inputs, old_logps, mask, stats, token_sums)

        values = self._global_token_means(token_sums)
        # TRL's clip_ratio/low_min and high_max: extremes over every rank's sequences of the per-sequence share.
        for name, selected, extreme in (("clip_ratio/low_min", is_low, nanmin), ("clip_ratio/high_max", is_high,
                                                                                 nanmax)):  # fmt: skip
            if selected.size(-1) == 1:
                per_sequence = selected.float().squeeze(-1)
            else:
                per_sequence = (selected.float() * mask).sum(-1) / mask.sum(-1)  # NaN for an empty row, as in TRL
            values[name] = extreme(self.accelerator.gather(per_sequence)).item()
        # Per-micro-batch scalars (losses, TIS summaries): one collective; counts are summed, the rest averaged.
        names = sorted(stats)
        if names:
            local = torch.stack([stats[name].detach().float().reshape(()) for name in names])
            gathered = self.accelerator.gather(local.unsqueeze(0)).view(-1, len(names))
            for i, name in enumerate(names):
                column = gathered[:, i]
                if name in _SUMMED_STATS:
                    values[name] = column.sum().item()
                elif name in _MIN_STATS or name in _MAX_STATS:
                    values[name] = (nanmin if name in _MIN_STATS else nanmax)(column).item()
                else:
                    values[name] = column.nanmean().item()
        for name in sorted(values):
            if name in _MIN_STATS or name in _MAX_STATS:
                self._keep_window_extreme(mode, name, values[name])
            else:
                self._metrics[mode][name].append(values[name])
        for name, value in calibration_stats.items():
            if name not in _PER_STEP_STATS:  # the bounds in force and the FP8 clip shares are logged every step
                self._metrics[mode][name].append(float(value))
        in_force = self.clip_bounds  # scalars (the oracle's static base bounds)
        self._metrics[mode]["calib/low"].append(in_force[0])
        self._metrics[mode]["calib/high"].append(in_force[1])

        if mode == "train":
            self._step_entropies.append((values["entropy"], values["entropy/neg_adv"]))
            if self.accelerator.sync_gradients:
                self._end_of_step_monitoring()
                if self._shadow_active():
                    self._metrics[mode]["time/bf16_shadow"].append(self._shadow_seconds)
                self._shadow_seconds = 0.0

    def _keep_window_extreme(self, mode, name, value: float) -> None:
        """Keep one value under ``name`` for the logging window: the smallest (_MIN_STATS) or largest seen, NaN
        (no data) skipped. TRL's log() averages each list, which would make a max over micro-batches their mean."""
        window = self._metrics[mode][name]
        seen = [v for v in (*window, value) if not math.isnan(v)]
        window[:] = [(min if name in _MIN_STATS else max)(seen)] if seen else [value]

    def _mismatch_outliers(self, mode, inputs, old_logps, rollout, mask, stats, token_sums) -> None:
        """mismatch/max_abs_logp_diff, mismatch/gap_gt_1nat_frac, and in training the tokens above
        mismatch_dump_threshold written out (calclip.monitoring.mismatch_outliers)."""
        old_logps = old_logps.detach()
        gaps = logp_gaps(old_logps, rollout, mask)
        stats["mismatch/max_abs_logp_diff"] = gaps.max() if gaps.numel() else gaps.new_zeros(())
        token_sums["mismatch/gap_gt_1nat_frac"] = burst_counts(gaps, old_logps, rollout, mask)
        threshold = self.args.mismatch_dump_threshold
        if threshold is None or mode != "train":
            return
        if self._outlier_log is None:
            path = outlier_path(self.args.output_dir, self.accelerator.process_index)
            self._outlier_log = MismatchOutlierLog(path, threshold)
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        step = self.state.global_step + 1  # the optimizer step this loss feeds (the metrics files' step)
        found = self._outlier_log.record(
            step=step, rank=self.accelerator.process_index, gaps=gaps, completion_ids=inputs["completion_ids"],
            trainer_logps=old_logps, rollout_logps=rollout, mask=mask,
            shadow_logps=inputs.get(BF16_OLD_LOGPS_KEY), decode=getattr(tokenizer, "decode", None),
        )
        if found and self._outlier_log.seen == found:  # the first outliers of the run
            warnings.warn(f"{found} completion token(s) at step {step} have rollout and trainer log-probs more than "
                          f"{threshold} nats apart (max {float(gaps.max()):.3g}): written to "
                          f"{self._outlier_log.path} (warned once; the file keeps them)", stacklevel=2)

    def _tis_token_sums(self, inputs, old_logps, mask, stats, token_sums) -> None:
        """TIS means over their weighted units (tokens, or sequences in the sequence modes) as (sum, count) pairs;
        weight_min/max become NaN on a rank without data so the reduction over ranks skips it. tis/ess stays a
        per-rank value averaged over ranks, tis/nonfinite_tokens a count summed over ranks."""
        rollout = inputs["sampling_per_token_logps"]
        counted = (mask != 0) & torch.isfinite(old_logps) & torch.isfinite(rollout)
        if self.args.tis_mode.startswith("sequence"):
            counted = counted.any(-1)
        count = counted.sum()
        for name in ("tis/weight_mean", "tis/clipped_frac"):
            token_sums[name] = (stats.pop(name) * count, count)
        no_data = torch.tensor(float("nan"), device=count.device)
        for name in ("tis/weight_min", "tis/weight_max"):
            stats[name] = torch.where(count > 0, stats[name].float(), no_data)

    def _global_token_means(self, token_sums: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """sum / count over the tokens of every rank for each (local sum, local count) pair, in one all-reduce;
        0 over no tokens (TRL's clamp of the count at 1). Keys depend only on the config, so every rank agrees."""
        names = sorted(token_sums)
        local = torch.stack(
            [torch.stack([s.detach().double().reshape(()), c.detach().double().reshape(())])
             for s, c in (token_sums[name] for name in names)]
        )  # fmt: skip
        totals = self.accelerator.reduce(local, reduction="sum")
        means = totals[:, 0] / totals[:, 1].clamp(min=1.0)
        return dict(zip(names, means.tolist()))

    def _end_of_step_monitoring(self) -> None:
        """Entropy-spike detection on the optimizer step's entropy (all ranks hold the same values)."""
        entropy = sum(e for e, _ in self._step_entropies) / len(self._step_entropies)
        entropy_neg = sum(e for _, e in self._step_entropies) / len(self._step_entropies)
        self._step_entropies = []
        step = self.state.global_step
        report = self.spike_detector.update(entropy, entropy_neg, step=step)
        self._metrics["train"]["entropy/spike"].append(float(report.spike))
        if not report.spike:
            return
        message = report.message(step, entropy, entropy_neg)
        if self.args.recalibrate_on_spike and self.clip_policy.uses_calibrator:
            self.calibrator.request_recalibration()
            message += "; recalibration requested"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        if self.accelerator.is_main_process and "wandb" in (self.args.report_to or []):
            send_wandb_alert("calclip: entropy spike", message)
