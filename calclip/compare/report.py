"""The comparison's Markdown table and figure, computed from the runs' metrics files only.

Window mean of a metric for one run: the mean of its logged values at steps a..b (steps where it was not logged
are skipped; a NaN logged there makes the mean NaN). The table shows, per arm, the mean over the finished seeds
of those window means +- their sample standard deviation (n-1; none for one seed). The figure has one panel per
metric: per arm the mean over seeds at each logged step (after an optional trailing moving average per seed) and
a band from the seeds' minimum to maximum.

``partial=True`` (``calclip compare --partial``) also reads runs that ended before max_steps without failing
(stopped by a time limit, or interrupted: status ``running`` with no live compare on the folder): such a run
counts for a window only when its logged steps reach the window's last step, and the figure draws it up to its
last logged step. A failed run never counts.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from calclip.compare import folder
from calclip.compare.runner import FAILED, FINISHED, RUNNING, STOPPED, read_status
from calclip.run.run_outputs import FIELD_NAMES, METRIC_FIELDS, METRICS_FILE, read_metrics

REPORT_FILE = "report.md"
FIGURE_FILE = "figure.png"
MATPLOTLIB_MISSING = "matplotlib is not installed: no figure (pip install 'calclip[plot]' or pip install matplotlib)"

TABLE_METRICS = (
    "reward", "entropy", "entropy/neg_adv", "clip/neg_low_frac_fp8", "clip/neg_low_frac_fp8_static",
    "clip/neg_low_frac_bf16", "calib/low", "calib/high", "mismatch/token_mult_prob_error",
    "mismatch/fp8_bf16_token_mult_prob_error", "mismatch/max_abs_logp_diff", "mismatch/gap_gt_1nat_frac",
    "completions/mean_length", "completions/repeat_ngram_frac", "entropy/spike", "calib/fit", "calib/neg_tokens",
    "step_time", "time/bf16_shadow",
)
PLOT_METRICS = (
    "reward", "entropy", "entropy/neg_adv", "clip/neg_low_frac_fp8", "clip/neg_low_frac_fp8_static",
    "clip/neg_low_frac_bf16", "oos/neg_drop_frac", "calib/low", "calib/high", "mismatch/token_mult_prob_error",
    "completions/mean_length", "completions/repeat_ngram_frac", "step_time",
)
# The per-seed tables' columns: what tells one seed's drift or garbling from its arm's spread.
PER_SEED_METRICS = (
    "reward", "entropy", "clip/neg_low_frac_fp8", "clip/neg_low_frac_fp8_static", "clip/neg_low_frac_bf16",
    "mismatch/token_mult_prob_error", "completions/mean_length", "completions/repeat_ngram_frac", "entropy/spike",
)
# Out-of-sample drop shares (docs/DESIGN.md step 10): per run, the quotient of the counts summed over the window's steps
# (an exact share over all its tokens, where a mean of per-step shares would weight a step of 3 tokens like one of
# 300). name -> (numerator, denominator, what it is).
POOLED_SHARES = {
    "oos: A<0 dropped, all off-policy": ("oos/fp8_drops", "oos/neg_tokens",
                                         "share of off-policy A<0 tokens below the lower bound in force"),
    "oos: A<0 dropped, shadow batches": ("oos/shadow_fp8_drops", "oos/shadow_neg_tokens",
                                         "the same share on the mini-batches with a BF16 shadow"),
    "oos: BF16 would drop": ("oos/shadow_bf16_drops", "oos/shadow_neg_tokens",
                             "share of the same tokens whose BF16 shadow ratio is below 1-epsilon"),
    "oos: recall of BF16's drops": ("oos/shadow_both_drop", "oos/shadow_bf16_drops",
                                    "share of BF16's drops that the bound in force drops too"),
    "oos: precision vs BF16": ("oos/shadow_both_drop", "oos/shadow_fp8_drops",
                               "share of the bound's drops that BF16 drops too"),
}
# A run degenerates (docs/evidence.md, run 4's pre-registered rule) when over the last quarter of its steps its mean
# completion length exceeds DEGENERATE_LENGTH tokens or its mean share of repeated n-grams exceeds DEGENERATE_REPEAT:
# the long, repetitive completions of run 3's degenerated seed (63.5 tokens, against 11-17 for every BF16 seed).
DEGENERATE_LENGTH = 32.0
DEGENERATE_REPEAT = 0.25
# Drawn on a log y axis: one burst (a token-mult-prob-error of 1e3, a first step that compiles kernels) would
# otherwise flatten the rest of the curve.
LOG_SCALE_METRICS = frozenset({"mismatch/token_mult_prob_error", "step_time"})
assert set(TABLE_METRICS) <= set(FIELD_NAMES) and set(PLOT_METRICS) <= set(FIELD_NAMES)
assert set(PER_SEED_METRICS) <= set(TABLE_METRICS)
assert LOG_SCALE_METRICS <= set(PLOT_METRICS)
DESCRIPTIONS = dict(METRIC_FIELDS)


INTERRUPTED = "interrupted"  # status "running" in the file, but no calclip compare holds the folder


@dataclass
class Run:
    arm: str
    seed: int
    status: str  # finished, failed, stopped, running, interrupted, not started
    rows: list[dict]

    @property
    def last_step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0


def counts(run: Run, window: "Window | None" = None, partial: bool = False) -> bool:
    """Whether ``run`` enters the table for ``window`` (the figure when None): finished runs always; with
    ``partial``, a stopped or interrupted run whose logged steps reach the window's last step (any logged step
    for the figure)."""
    if run.status == FINISHED:
        return True
    if not partial or run.status not in (STOPPED, RUNNING, INTERRUPTED) or not run.rows:
        return False
    return window is None or run.last_step >= window.last


@dataclass(frozen=True)
class Window:
    first: int
    last: int
    label: str = ""

    def title(self) -> str:
        return f"steps {self.first}-{self.last}" + (f" ({self.label})" if self.label else "")


def load_runs(root: Path) -> tuple[dict, list[Run]]:
    """The folder's record and every arm x seed it names, in record order."""
    record = folder.load(root)
    if record is None:
        raise ValueError(f"{root}: no {folder.COMPARISON_FILE} (not a calclip compare folder)")
    live = folder.FolderLock(root).held_by_live_process()
    runs = []
    for arm in record["arms"]:
        for seed in record["seeds"]:
            directory = folder.run_directory(root, arm, seed)
            status = (read_status(directory) or {}).get("status", "not started")
            if status == RUNNING and not live:
                status = INTERRUPTED
            runs.append(Run(arm, seed, status, read_metrics(directory / METRICS_FILE)))
    return record, runs


def max_steps(record: dict) -> int:
    return max(int(entry["config"].get("max_steps", 0)) for entry in record["arms"].values())


def default_windows(steps: int) -> list[Window]:
    """The whole run and its last quarter (at least its last step)."""
    if steps < 1:
        return []
    windows = [Window(1, steps, "all")]
    first = steps - max(1, steps // 4) + 1
    if first > 1:
        windows.append(Window(first, steps, f"last {steps - first + 1} steps"))
    return windows


def parse_windows(spec: str) -> list[Window]:
    """``"1-64,237-300"`` -> windows (inclusive step ranges)."""
    windows = []
    for part in spec.split(","):
        first, sep, last = part.strip().partition("-")
        if not sep or not first.strip().isdigit() or not last.strip().isdigit():
            raise ValueError(f"--windows: {part!r} is not FIRST-LAST (steps, e.g. 1-64)")
        window = Window(int(first), int(last))
        if not 1 <= window.first <= window.last:
            raise ValueError(f"--windows: {part!r} needs 1 <= FIRST <= LAST")
        windows.append(window)
    return windows


def window_mean(rows: list[dict], metric: str, window: Window) -> float | None:
    values = [row[metric] for row in rows if window.first <= row["step"] <= window.last and row.get(metric) is not None]
    return math.fsum(values) / len(values) if values else None


def window_share(rows: list[dict], numerator: str, denominator: str, window: Window) -> float | None:
    """sum(numerator) / sum(denominator) over the window's steps where both were logged; None without tokens."""
    pairs = [(row[numerator], row[denominator]) for row in rows if window.first <= row["step"] <= window.last
             and row.get(numerator) is not None and row.get(denominator) is not None]
    total = math.fsum(d for _, d in pairs)
    return math.fsum(n for n, _ in pairs) / total if total > 0 else None


def degenerated(run: Run, steps: int) -> bool:
    """The pre-registered rule (DEGENERATE_LENGTH, DEGENERATE_REPEAT) over the last quarter of ``steps``."""
    window = default_windows(steps)[-1]
    length = window_mean(run.rows, "completions/mean_length", window)
    repeat = window_mean(run.rows, "completions/repeat_ngram_frac", window)
    return (length or 0.0) > DEGENERATE_LENGTH or (repeat or 0.0) > DEGENERATE_REPEAT


def arm_summary(runs: list[Run], metric: str | tuple[str, str], window: Window,
                partial: bool = False) -> tuple[float, float | None, int] | None:
    """(mean, sample std or None, n) over the counted seeds' window means (`counts`); None when none logged it.
    A (numerator, denominator) pair is a pooled share (`window_share`) per seed."""
    if isinstance(metric, tuple):
        per_run = lambda run: window_share(run.rows, *metric, window)  # noqa: E731
    else:
        per_run = lambda run: window_mean(run.rows, metric, window)  # noqa: E731
    means = [m for run in runs if counts(run, window, partial) for m in [per_run(run)] if m is not None]
    if not means:
        return None
    mean = math.fsum(means) / len(means)
    std = statistics.stdev(means) if len(means) > 1 else None
    return mean, std, len(means)


# The contrasts section (`contrasts_table`): each arm against REFERENCE_ARM (or the comparison's first arm when it has
# none) on the primary endpoint, `reward` over the last window. Permutation p: exact over every relabelling while
# there are at most EXACT_PERMUTATION_LIMIT of them (4 vs 4 seeds: 70), else Monte Carlo with MONTE_CARLO_PERMUTATIONS
# random relabellings, p = (1 + hits) / (1 + draws) (never 0). Bootstrap: percentile interval of the difference of
# means over BOOTSTRAP_RESAMPLES resamples of each arm's seeds. Power: the chance this design (its n per arm, the two
# arms' pooled seed SD) detects a true difference of DETECTABLE_DIFFERENCE at two-sided ALPHA (normal approximation).
REFERENCE_ARM = "fp8_static"
PRIMARY_METRIC = "reward"
EXACT_PERMUTATION_LIMIT = 20_000
MONTE_CARLO_PERMUTATIONS = 20_000
BOOTSTRAP_RESAMPLES = 10_000
DETECTABLE_DIFFERENCE = 0.10
ALPHA = 0.05
POWER = 0.80


def permutation_p(a: list[float], b: list[float], *, draws: int = MONTE_CARLO_PERMUTATIONS,
                  seed: int = 0) -> tuple[float, str]:
    """Two-sided permutation p of mean(a) - mean(b): the share of relabellings of the pooled values into groups of
    len(a) and len(b) whose |difference of means| is at least the observed one (a 1e-12 relative tolerance, so ties
    count). Returns (p, how): "exact, N relabellings" or "Monte Carlo, N draws"."""
    if len(a) < 1 or len(b) < 1:
        raise ValueError(f"permutation_p needs at least one value per group, got {len(a)} and {len(b)}")
    pooled = [*a, *b]
    total, n_a = math.fsum(pooled), len(a)

    def difference(first_sum: float) -> float:
        return abs(first_sum / n_a - (total - first_sum) / len(b))

    observed = difference(math.fsum(a)) * (1 - 1e-12)
    relabellings = math.comb(len(pooled), n_a)
    if relabellings <= EXACT_PERMUTATION_LIMIT:
        hits = sum(difference(math.fsum(pooled[i] for i in chosen)) >= observed
                   for chosen in itertools.combinations(range(len(pooled)), n_a))
        return hits / relabellings, f"exact, {relabellings} relabellings"
    rng = random.Random(seed)
    hits = sum(difference(math.fsum(rng.sample(pooled, n_a))) >= observed for _ in range(draws))
    return (1 + hits) / (1 + draws), f"Monte Carlo, {draws} draws"


def bootstrap_interval(a: list[float], b: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile interval of mean(a) - mean(b), each arm's seeds resampled with replacement."""
    if len(a) < 1 or len(b) < 1:
        raise ValueError(f"bootstrap_interval needs at least one value per group, got {len(a)} and {len(b)}")
    rng = random.Random(seed)
    diffs = sorted(math.fsum(rng.choices(a, k=len(a))) / len(a) - math.fsum(rng.choices(b, k=len(b))) / len(b)
                   for _ in range(resamples))
    tail = (1 - level) / 2
    return diffs[int(math.floor(tail * (resamples - 1)))], diffs[int(math.ceil((1 - tail) * (resamples - 1)))]


def two_sample_power(n: int, sd: float, difference: float = DETECTABLE_DIFFERENCE, alpha: float = ALPHA) -> float:
    """Power of a two-sided two-sample test with n per arm and seed SD ``sd`` to detect ``difference`` (normal
    approximation: Phi(d / (sd * sqrt(2 / n)) - z_(1 - alpha/2)), the far tail neglected)."""
    if n < 1 or not sd > 0:
        raise ValueError(f"two_sample_power needs n >= 1 and sd > 0, got n={n!r}, sd={sd!r}")
    normal = statistics.NormalDist()
    return normal.cdf(difference / (sd * math.sqrt(2.0 / n)) - normal.inv_cdf(1 - alpha / 2))


def seeds_for_power(sd: float, difference: float = DETECTABLE_DIFFERENCE, alpha: float = ALPHA,
                    power: float = POWER) -> int:
    """Seeds per arm for a two-sided two-sample test to reach ``power`` at ``difference``: the normal-approximation
    n = 2 sd^2 (z_(1-alpha/2) + z_power)^2 / difference^2 plus z_(1-alpha/2)^2 / 4 (Guenther's correction for
    estimating sd from the seeds: it matches the t test's n within one), rounded up."""
    if not sd > 0 or not difference > 0:
        raise ValueError(f"seeds_for_power needs sd > 0 and difference > 0, got sd={sd!r}, difference={difference!r}")
    normal = statistics.NormalDist()
    z_alpha, z_power = normal.inv_cdf(1 - alpha / 2), normal.inv_cdf(power)
    n = 2 * sd**2 * (z_alpha + z_power) ** 2 / difference**2 + z_alpha**2 / 4
    return math.ceil(n - 1e-9)


def endpoint_values(runs: list[Run], window: Window, partial: bool = False,
                    metric: str = PRIMARY_METRIC) -> list[float]:
    """Per counted run (`counts`), its window mean of ``metric``: the values a contrast compares."""
    return [m for run in runs if counts(run, window, partial) for m in [window_mean(run.rows, metric, window)]
            if m is not None]


def contrasts_table(record: dict, runs: list[Run], window: Window, partial: bool = False,
                    reference: str | None = None) -> str:
    """Each arm against ``reference`` on the primary endpoint over ``window``: difference of means, its bootstrap
    interval, the permutation p, the pooled seed SD and the power this design had to detect DETECTABLE_DIFFERENCE."""
    arms = list(record["arms"])
    reference = reference or (REFERENCE_ARM if REFERENCE_ARM in arms else arms[0])
    if reference not in arms:
        raise ValueError(f"reference arm {reference!r} is not one of this comparison's arms {arms}")
    base = endpoint_values([run for run in runs if run.arm == reference], window, partial)
    lines = [f"| arm - {reference} | n | difference | 95% bootstrap interval | permutation p | pooled seed SD | "
             f"power at {DETECTABLE_DIFFERENCE:g} |", "|---|---|---|---|---|---|---|"]
    for arm in arms:
        if arm == reference:
            continue
        values = endpoint_values([run for run in runs if run.arm == arm], window, partial)
        if not values or not base:
            lines.append(f"| {arm} | {len(values)} vs {len(base)} | - | - | - | - | - |")
            continue
        diff = math.fsum(values) / len(values) - math.fsum(base) / len(base)
        low, high = bootstrap_interval(values, base)
        p, how = permutation_p(values, base)
        if len(values) > 1 and len(base) > 1:
            sd = math.sqrt((statistics.variance(values) + statistics.variance(base)) / 2)
            sd_text = f"{sd:.3f}"
            power = f"{two_sample_power(min(len(values), len(base)), sd):.2f}" if sd > 0 else "-"
        else:
            sd_text = power = "-"
        lines.append(f"| {arm} | {len(values)} vs {len(base)} | {diff:+.3f} | [{low:+.3f}, {high:+.3f}] | "
                     f"{p:.3f} ({how}) | {sd_text} | {power} |")
    return "\n".join(lines)


def format_cell(summary) -> str:
    if summary is None:
        return "-"
    mean, std, _ = summary
    return f"{mean:.4g}" if std is None else f"{mean:.4g} ± {std:.2g}"


def arm_header(arm: str, runs: list[Run], window: Window | None = None, partial: bool = False) -> str:
    counted = [run for run in runs if counts(run, window, partial)]
    header = f"{arm} (n={len(counted)})"
    notes = [f"seed {run.seed} to step {run.last_step} ({run.status})" for run in counted if run.status != FINISHED]
    notes += [f"seed {run.seed} {'FAILED' if run.status == FAILED else run.status}"
              + (f" at step {run.last_step}" if run.rows and run.status != FAILED else "")
              for run in runs if not counts(run, window, partial)]
    return header + (" " + "; ".join(notes) if notes else "")


def _table_cell(arm_runs: list[Run], metric: str | tuple[str, str], window: Window, partial: bool) -> str:
    if any(counts(run, window, partial) for run in arm_runs):
        return format_cell(arm_summary(arm_runs, metric, window, partial))
    if any(run.status == FAILED for run in arm_runs):
        return "failed"
    reached = "not reached" if partial else "unfinished"
    return reached if any(run.rows for run in arm_runs) else "not run"


def markdown_tables(record: dict, runs: list[Run], windows: list[Window], partial: bool = False) -> str:
    by_arm = {arm: [run for run in runs if run.arm == arm] for arm in record["arms"]}
    rows = [(f"`{metric}`", metric) for metric in TABLE_METRICS]
    rows += [(name, (numerator, denominator)) for name, (numerator, denominator, _) in POOLED_SHARES.items()]
    lines = []
    for window in windows:
        lines += [f"### {window.title()}", ""]
        lines.append("| metric | " + " | ".join(arm_header(arm, arm_runs, window, partial)
                                               for arm, arm_runs in by_arm.items()) + " |")
        lines.append("|---" * (len(by_arm) + 1) + "|")
        for label, metric in rows:
            cells = [_table_cell(arm_runs, metric, window, partial) for arm_runs in by_arm.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def degenerate_table(record: dict, runs: list[Run]) -> str:
    """Per arm: how many finished seeds degenerated under the pre-registered rule, and which."""
    steps = max_steps(record)
    lines = ["| arm | degenerated seeds | which |", "|---|---|---|"]
    for arm in record["arms"]:
        finished = [run for run in runs if run.arm == arm and run.status == FINISHED]
        bad = [run.seed for run in finished if degenerated(run, steps)]
        lines.append(f"| {arm} | {len(bad)} of {len(finished)} | {', '.join(map(str, bad)) or '-'} |")
    return "\n".join(lines)


def per_seed_tables(record: dict, runs: list[Run], windows: list[Window], partial: bool = False) -> str:
    """Per window, one row per counted run (``counts``): its window mean of each PER_SEED_METRICS metric, the
    numbers the arm's mean ± std is computed from."""
    lines = []
    for window in windows:
        header = "| arm | seed | " + " | ".join(f"`{m}`" for m in PER_SEED_METRICS) + " |"
        lines += [f"### {window.title()}", "", header, "|---|---|" + "---|" * len(PER_SEED_METRICS)]
        for arm in record["arms"]:
            for run in (run for run in runs if run.arm == arm and counts(run, window, partial)):
                means = (window_mean(run.rows, metric, window) for metric in PER_SEED_METRICS)
                cells = ["-" if mean is None else f"{mean:.4g}" for mean in means]
                lines.append(f"| {arm} | {run.seed} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def runs_table(runs: list[Run], root: Path) -> str:
    lines = ["| arm | seed | status | steps logged | wall |", "|---|---|---|---|---|"]
    for run in runs:
        status = read_status(folder.run_directory(root, run.arm, run.seed)) or {}
        wall = status.get("wall_s")
        wall_text = "-" if wall is None else f"{wall:.0f} s"
        lines.append(f"| {run.arm} | {run.seed} | {run.status} | {run.last_step} | {wall_text} |")
    failed = [run for run in runs if run.status == FAILED]
    for run in failed:
        tail = (read_status(folder.run_directory(root, run.arm, run.seed)) or {}).get("error_tail") or []
        lines += ["", f"{run.arm} seed {run.seed} failed; the end of its log "
                  f"({run.arm}/seed{run.seed}/train.log):", "", "```", *tail[-8:], "```"]
    return "\n".join(lines)


def render_report(root: Path, record: dict, runs: list[Run], windows: list[Window], figure: Path | None,
                  figure_note: str | None = None, partial: bool = False) -> str:
    arms = record["arms"]
    lines = [f"# calclip compare: {Path(root).name}", ""]
    lines.append(f"Config `{record['config_path']}`, seeds {', '.join(map(str, record['seeds']))}, "
                 f"{max_steps(record)} optimizer steps per run. W&B group `{record.get('group', '')}`.")
    lines += ["", "| arm | overrides |", "|---|---|"]
    for name, entry in arms.items():
        overrides = ", ".join(f"`{k}={_show(v)}`" for k, v in entry["overrides"].items())
        lines.append(f"| {name} | {overrides} |")
    lines += ["", "## Runs", "", runs_table(runs, root), ""]
    lines += ["## Window means ± std over seeds", "",
              "Per run, the mean of a metric over the steps of the window where it was logged; then the mean over "
              + ("the seeds whose run reached the window's last step (finished, or stopped/interrupted later: "
                 "`--partial`)" if partial else "finished seeds")
              + " ± their sample standard deviation (n-1; no ± with one seed). `-`: never logged in the window.", ""]
    lines.append(markdown_tables(record, runs, windows, partial))
    primary = windows[-1] if windows else None
    if primary is not None and len(arms) > 1:
        lines += [f"## Primary endpoint: `{PRIMARY_METRIC}` over {primary.title()}, each arm against the reference",
                  "", f"Per run its window mean; difference of the arms' means; {BOOTSTRAP_RESAMPLES} bootstrap "
                  "resamples of the seeds; two-sided permutation p of the difference of means (exact while there are "
                  f"at most {EXACT_PERMUTATION_LIMIT} relabellings, else Monte Carlo); power: the chance that this "
                  f"many seeds at the two arms' pooled SD detect a true difference of {DETECTABLE_DIFFERENCE:g} "
                  f"(two-sided alpha {ALPHA:g}, normal approximation).", "",
                  contrasts_table(record, runs, primary, partial), ""]
    lines += ["## Degenerated runs", "",
              "A finished run degenerated when, over the last quarter of its steps, its mean completion length "
              f"exceeds {DEGENERATE_LENGTH:g} tokens or its mean share of repeated n-grams exceeds "
              f"{DEGENERATE_REPEAT:g}.", "",
              degenerate_table(record, runs), ""]
    lines += ["## Per seed", "", "Each counted run's window mean (the numbers behind the ± above), for the metrics "
              "where one seed can drift or garble on its own.", ""]
    lines.append(per_seed_tables(record, runs, windows, partial))
    lines += ["## Figure", ""]
    if figure is not None:
        lines += [f"![comparison]({figure.name})", ""]
        lines.append("Mean over finished seeds per arm; band: minimum to maximum over seeds." if not partial else
                     "Mean per arm over the seeds logged at each step (`--partial`: runs that ended early are drawn "
                     "up to their last step, so the mean's seed set shrinks where they end); band: minimum to "
                     "maximum over those seeds.")
    else:
        lines.append(figure_note or "no figure")
    lines += ["", "## Metrics", ""]
    lines += [f"- `{metric}`: {DESCRIPTIONS[metric]}" for metric in TABLE_METRICS]
    lines += [f"- {name}: {what} (`{num}` / `{den}` summed over the window)"
              for name, (num, den, what) in POOLED_SHARES.items()]
    return "\n".join(lines) + "\n"


def _smoothed(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(math.fsum(chunk) / len(chunk))
    return out


def curve(runs: list[Run], metric: str, smooth: int = 1,
          partial: bool = False) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over the counted runs (`counts`) at every step where at least one logged ``metric``."""
    per_step: dict[int, list[float]] = {}
    for run in runs:
        if not counts(run, None, partial):
            continue
        points = [(row["step"], row[metric]) for row in run.rows if row.get(metric) is not None]
        values = _smoothed([value for _, value in points], smooth)
        for (step, _), value in zip(points, values):
            per_step.setdefault(step, []).append(value)
    steps = sorted(per_step)
    return (steps, [math.fsum(per_step[s]) / len(per_step[s]) for s in steps],
            [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps])


def plot(record: dict, runs: list[Run], path: Path, smooth: int = 1, partial: bool = False) -> Path:
    """Write the figure; ImportError (with `MATPLOTLIB_MISSING`) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(MATPLOTLIB_MISSING) from error
    columns = 4
    rows = math.ceil(len(PLOT_METRICS) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, metric in enumerate(PLOT_METRICS):
        ax = axes[index // columns][index % columns]
        for arm_index, arm in enumerate(record["arms"]):
            steps, mean, low, high = curve([run for run in runs if run.arm == arm], metric, smooth, partial)
            if not steps:
                continue
            color = colors[arm_index % len(colors)]
            ax.plot(steps, mean, color=color, linewidth=1.2, label=arm, marker="." if len(steps) < 20 else None)
            ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        if metric in LOG_SCALE_METRICS and ax.has_data():
            ax.set_yscale("log")
            ax.set_title(f"{metric} (log)", fontsize=9)
        else:
            ax.set_title(metric, fontsize=9)
            ax.ticklabel_format(axis="y", useOffset=False)  # 1.0312, not 0.0312 + 1
        ax.tick_params(labelsize=7)
        ax.set_xlabel("step", fontsize=7)
    for index in range(len(PLOT_METRICS), rows * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9, frameon=False)
    seeds = ", ".join(map(str, record["seeds"]))
    smooth_note = f", moving average over {smooth} logged steps" if smooth > 1 else ""
    partial_note = "; runs that ended early drawn to their last step" if partial else ""
    figure.suptitle(f"mean over seeds {seeds} (band: min-max){smooth_note}{partial_note}", fontsize=9, y=0.005,
                    va="bottom")
    figure.tight_layout(rect=(0, 0.02, 1, 0.95))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_report(root: Path, *, windows: list[Window] | None = None, smooth: int = 1,
                 partial: bool = False) -> tuple[Path, Path | None, str | None]:
    """Write ``report.md`` and ``figure.png`` from the folder's runs; return (report, figure or None, note)."""
    root = Path(root)
    record, runs = load_runs(root)
    windows = windows or default_windows(max_steps(record))
    figure, note = None, None
    try:
        figure = plot(record, runs, root / FIGURE_FILE, smooth, partial)
    except ImportError as error:
        note = str(error)
    report = root / REPORT_FILE
    report.write_text(render_report(root, record, runs, windows, figure, note, partial))
    return report, figure, note


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(_show, value))
    return str(value)
