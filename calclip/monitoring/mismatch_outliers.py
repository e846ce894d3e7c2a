"""Completion tokens whose rollout and trainer log-probs disagree by more than a threshold, written to a JSONL file.

The mean rollout-vs-trainer ``mismatch/token_mult_prob_error`` says that the two forwards disagree, not where.
The first H200 comparison (docs/evidence.md, 2026-12-01) showed it jump by orders of magnitude for a few mini-batches
of two FP8 runs, and never in BF16. That means a few tokens with gaps of 7+ nats, and the metrics files cannot say
which. With ``mismatch_dump_threshold`` set (default 5 nats, a probability ratio of ~148), the trainer appends
every such token to ``<output_dir>/mismatch_outliers.jsonl`` (``.rank<R>`` before ``.jsonl`` on rank R > 0 of a
multi-process run). Each row holds: step, rank, the row and position in the micro-batch, the token id and text, the
rollout and trainer log-probs, the BF16 shadow's where that step computed it, the completion's length and text.
The largest gaps come first, at most ``per_step`` rows a call and ``total`` a run, so a diverging run cannot fill
the disk. The caller passes the tensors; this module needs only torch and json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

FILE_NAME = "mismatch_outliers.jsonl"
# mismatch/gap_gt_1nat_frac counts tokens whose rollout and trainer probabilities differ by more than a factor e: far
# above what two forwards of the same weights should give (the BF16 evidence runs stayed below it: docs/evidence.md).
BURST_NATS = 1.0
PER_STEP_ROWS = 32
TOTAL_ROWS = 2000
TEXT_CHARS = 600


def outlier_path(output_dir: str | Path, rank: int) -> Path:
    name = FILE_NAME if rank == 0 else FILE_NAME.replace(".jsonl", f".rank{rank}.jsonl")
    return Path(output_dir) / name


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def logp_gaps(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|trainer - rollout| per token [B, T]; 0 where masked or either value is non-finite."""
    valid = (mask != 0) & torch.isfinite(trainer_logps) & torch.isfinite(rollout_logps)
    return torch.where(valid, (trainer_logps - rollout_logps).abs(), torch.zeros_like(trainer_logps))


def burst_counts(gaps: torch.Tensor, trainer_logps: torch.Tensor, rollout_logps: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens with a gap above BURST_NATS, tokens compared): masked tokens and tokens with a non-finite log-prob
    count in neither, like in mismatch/token_mult_prob_error. ``gaps`` from ``logp_gaps``."""
    compared = (mask != 0) & torch.isfinite(trainer_logps) & torch.isfinite(rollout_logps)
    return (compared & (gaps > BURST_NATS)).sum(), compared.sum()


class MismatchOutlierLog:
    """Appends outlier tokens to one JSONL file, at most ``per_step`` rows a call and ``total`` rows in all."""

    def __init__(self, path: str | Path, threshold: float, *, per_step: int = PER_STEP_ROWS, total: int = TOTAL_ROWS):
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0 nats, got {threshold!r}")
        self.path, self.threshold, self.per_step, self.total = Path(path), float(threshold), per_step, total
        self.written = 0
        self.seen = 0  # outlier tokens found, written or not

    def record(self, *, step: int, rank: int, gaps: torch.Tensor, completion_ids: torch.Tensor,
               trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
               shadow_logps: torch.Tensor | None = None, decode=None) -> int:
        """Write the tokens of ``gaps`` [B, T] above the threshold, largest first; returns how many were found.

        ``decode`` (token ids -> str, e.g. a tokenizer's ``decode``) adds the token and completion text."""
        hits = (gaps > self.threshold).nonzero()
        found = int(hits.shape[0])
        self.seen += found
        room = min(self.per_step, self.total - self.written)
        if found == 0 or room <= 0:
            return found
        values = gaps[hits[:, 0], hits[:, 1]]
        order = torch.argsort(values, descending=True)[:room]
        lengths = (mask != 0).sum(-1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            for row, pos in hits[order].tolist():
                token = int(completion_ids[row, pos])
                entry = {
                    "step": int(step), "rank": int(rank), "row": row, "position": pos, "token_id": token,
                    "rollout_logp": _number(float(rollout_logps[row, pos])),
                    "trainer_logp": _number(float(trainer_logps[row, pos])),
                    "abs_gap": float(gaps[row, pos]),
                    "shadow_logp": None if shadow_logps is None else _number(float(shadow_logps[row, pos])),
                    "completion_length": int(lengths[row]),
                }
                if decode is not None:
                    ids = completion_ids[row][mask[row] != 0].tolist()
                    entry["token"] = decode([token])
                    entry["completion"] = decode(ids)[:TEXT_CHARS]
                handle.write(json.dumps(entry) + "\n")
                self.written += 1
        return found
