"""What a `calclip train` run leaves for whoever supervises it (``calclip compare``, a cluster script): the per-run
metrics file, and the exit status of a run that a SIGTERM stopped after a checkpoint (``run_callbacks``).

The metrics file: one JSON line per logged optimizer step. Keys are the trainer's own log names (docs/DESIGN.md "Metric
names", TRL's where calclip adds none); a metric not logged at a step is ``null`` (reward exists only on generating
steps, the FP8-static and BF16-shadow drop shares only on shadow-calibration steps); a non-finite value is kept (written
as NaN/Infinity, which Python's json and pandas read back), so a collapse shows. ``time`` is wall seconds since training
began, resumed runs continuing the clock of the step they resumed from.
"""

from __future__ import annotations

import json
from pathlib import Path

# (key, what it is). The order is the file's column order.
METRIC_FIELDS: tuple[tuple[str, str], ...] = (
    ("step", "optimizer step"),
    ("time", "wall seconds since training began"),
    ("reward", "mean total reward of the generated completions"),
    ("reward_std", "std of the total reward"),
    ("entropy", "mean token entropy of the policy"),
    ("entropy/neg_adv", "mean token entropy on A<0 tokens"),
    ("clip/neg_low_frac_fp8", "share of A<0 tokens below the lower bound in force (their penalty is dropped)"),
    ("clip/neg_low_frac_fp8_static", "share of A<0 tokens whose FP8 ratio is below 1-epsilon (calibration steps)"),
    ("clip/neg_low_frac_bf16", "share of A<0 tokens whose BF16 shadow ratio is below 1-epsilon (calibration steps)"),
    ("calib/low", "lower clip bound in force"),
    ("calib/high", "upper clip bound in force"),
    ("calib/fit", "1 when a calibration replaced the bounds at the end of a round, 0 when the pool was below "
                  "calibration_min_tokens (the bounds stayed)"),
    ("calib/neg_tokens", "A<0 tokens the calibration rested on (fit rounds)"),
    ("calib/pool_tokens", "tokens pooled towards the next calibration at a round's end (calibrated runs)"),
    ("calib/short_rounds", "generation rounds in a row that ended below calibration_min_tokens (calibrated runs)"),
    ("oos/neg_tokens", "A<0 tokens of the off-policy mini-batches of the step"),
    ("oos/fp8_drops", "of those, below the lower bound in force: penalties dropped (bounds fitted on other tokens)"),
    ("oos/neg_drop_frac", "oos/fp8_drops / oos/neg_tokens"),
    ("oos/shadow_neg_tokens", "A<0 tokens of the step's BF16-shadow mini-batches"),
    ("oos/shadow_fp8_drops", "of those, below the lower bound in force"),
    ("oos/shadow_bf16_drops", "of those, BF16 shadow ratio below 1-epsilon (what BF16 training would drop)"),
    ("oos/shadow_both_drop", "of those, dropped by both"),
    ("oos/drop_recall", "share of the BF16 drops that the bound in force drops too (shadow mini-batches)"),
    ("oos/drop_precision", "share of the bound's drops that BF16 drops too (shadow mini-batches)"),
    ("mismatch/token_mult_prob_error", "rollout vs trainer token-mult-prob-error (1.0 = identical)"),
    ("mismatch/fp8_bf16_token_mult_prob_error", "FP8 vs BF16 shadow token-mult-prob-error (calibration steps)"),
    ("mismatch/max_abs_logp_diff", "largest rollout vs trainer per-token log-prob gap (nats; mismatch_outliers.jsonl)"),
    ("mismatch/gap_gt_1nat_frac", "share of completion tokens whose rollout and trainer log-probs differ by > 1 nat"),
    ("completions/mean_length", "mean completion length in tokens"),
    ("completions/repeat_ngram_frac", "share of repeated n-grams in completions (garbled output)"),
    ("entropy/spike", "1 when the entropy-spike detector fired"),
    ("loss", "training loss"),
    ("step_time", "seconds of the optimizer step (TRL's step_time)"),
    ("time/bf16_shadow", "seconds of BF16 shadow forwards in the step (generation-time shadow included)"),
)
FIELD_NAMES = tuple(key for key, _ in METRIC_FIELDS)
METRICS_FILE = "metrics.jsonl"
# EX_TEMPFAIL: a run stopped on SIGTERM after saving a checkpoint (run_callbacks.CheckpointOnSigtermCallback); the
# same command resumes it.
EXIT_STOPPED = 75


def metrics_row(logs: dict, step: int, time: float) -> dict | None:
    """The metrics-file row of one trainer log dict, or None for a log without training metrics (the
    end-of-training summary)."""
    if not any(key in logs for key in FIELD_NAMES[2:]):
        return None
    row = {"step": int(step), "time": round(float(time), 3)}
    for key in FIELD_NAMES[2:]:
        row[key] = _float_or_none(logs.get(key))
    return row


class MetricsFileError(ValueError):
    """A metrics file line that calclip did not write (the message names the file and the line)."""


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics file, in step order, the last row of a step winning (a resumed run re-logs the
    steps after its checkpoint). An unterminated last line that does not parse (a killed writer) is ignored; any
    other line must be a JSON object with an integer ``step`` and numbers or nulls as values, else
    MetricsFileError names the file, the line and what is wrong (a report must not silently skip or mix in
    foreign rows)."""
    rows: dict[int, dict] = {}
    path = Path(path)
    if not path.exists():
        return []
    with path.open(errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if not line.endswith("\n"):  # the writer was killed mid-line: the last line only
                    continue
                raise MetricsFileError(f"{path}:{number}: not a JSON line: {_shown(line.strip())}") from None
            step = _checked_row(row, path, number)
            rows[step] = row
    return [rows[step] for step in sorted(rows)]


def _checked_row(row, path: Path, number: int) -> int:
    if not isinstance(row, dict):
        raise MetricsFileError(f"{path}:{number}: a row must be a JSON object, got {type(row).__name__}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MetricsFileError(f"{path}:{number}: 'step' must be an integer >= 0, got {_shown(step)}")
    for key, value in row.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise MetricsFileError(f"{path}:{number}: {_shown(key)} must be a number or null, got {_shown(value)} "
                                   f"({type(value).__name__})")
    return step


def _shown(value, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit]) + "..."
    return text if len(text) <= limit + 10 else text[:limit] + "..."


def last_step(path: str | Path) -> int:
    """The last complete step in a metrics file (0 when there is none), reading only the file's tail."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 8192))
            tail = handle.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(tail):
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return 0


def truncate_metrics(path: str | Path, max_step: int) -> None:
    """Keep the rows with step <= max_step (a run resuming from the checkpoint of max_step)."""
    path = Path(path)
    if not path.exists():
        return
    rows = [row for row in read_metrics(path) if row["step"] <= max_step]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    tmp.replace(path)


def _float_or_none(value):
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
