"""Recompute the numbers of docs/evidence.md from the compact data files (``<run folder>/data.csv.gz``).

    python docs/evidence/reproduce.py                      # run 4's numbers (the page's run-4 sections and summary)
    python docs/evidence/reproduce.py --tables DIR         # DIR's window tables, as its report.md has them
    python docs/evidence/reproduce.py --old-oos DIR        # runs 2-3: out-of-sample shares ("Corrections")

Each data file holds, per run (arm x seed) and logged optimizer step, the metrics the runs wrote to their
``metrics.jsonl`` (every field of calclip.run.run_outputs but ``time``, ``loss``, ``reward_std``; 7 significant
digits, counts exact) and the run's status when the folder was packed (``finished``, or ``interrupted``: the device
time ran out). The raw per-seed files (metrics.jsonl, train.log.xz, status.json, command.json,
mismatch_outliers.jsonl) left the tree on 2026-12-04; they are in the git history (docs/evidence/ at commit 8843ffb).

Windows are inclusive step ranges; a run's window mean is the mean of its logged values there; an out-of-sample
share is the quotient of the counts summed over the window (calclip.compare.report).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import statistics
import sys
from pathlib import Path

from calclip.compare.report import (
    DEGENERATE_LENGTH,
    bootstrap_interval,
    DEGENERATE_REPEAT,
    Run,
    Window,
    permutation_p,
    seeds_for_power,
    two_sample_power,
    window_mean,
    window_share,
)

HERE = Path(__file__).resolve().parent
RUN4 = HERE / "2026-12-02-smollm2-tensorwise"
DATA_FILE = "data.csv.gz"
RUN4_STEPS = 100
RUN4_ARMS = ("bf16_static", "fp8_static", "fp8_tis", "fp8_calibrated", "fp8_oracle")
LAST_QUARTER = Window(76, RUN4_STEPS)  # pre-registered; a stopped run is read to its last step
REACHED_BY_ALL = Window(76, 92)  # the last-quarter steps every run reached
DROPS_WINDOW = Window(1, 92)  # the drop shares: steps every run reached
TARGET_DIFFERENCE = 0.10


def load_runs(folder: Path) -> list[Run]:
    """The runs of one data file, in file order (arm, then seed)."""
    text = gzip.decompress((Path(folder) / DATA_FILE).read_bytes()).decode()
    runs: dict[tuple[str, int], Run] = {}
    for row in csv.DictReader(io.StringIO(text)):
        key = (row.pop("arm"), int(row.pop("seed")))
        status = row.pop("status")
        values = {name: (float(value) if value != "" else None) for name, value in row.items()}
        values["step"] = int(values["step"])
        runs.setdefault(key, Run(key[0], key[1], status, [])).rows.append(values)
    return list(runs.values())


def to_last_step(run: Run, window: Window) -> Window:
    """``window`` cut at the run's last logged step (the page's reading of a stopped run)."""
    return Window(window.first, min(window.last, run.last_step))


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values)


def by_arm(runs: list[Run]) -> dict[str, list[Run]]:
    return {arm: sorted((run for run in runs if run.arm == arm), key=lambda run: run.seed) for arm in RUN4_ARMS}


def degenerated(run: Run, window: Window) -> bool:
    """The pre-registered rule's test on one run's window (the rule also requires a finished run)."""
    length = window_mean(run.rows, "completions/mean_length", window) or 0.0
    repeat = window_mean(run.rows, "completions/repeat_ngram_frac", window) or 0.0
    return length > DEGENERATE_LENGTH or repeat > DEGENERATE_REPEAT


def run4_numbers(runs: list[Run]) -> dict:
    """Every run-4 number the page states, by name."""
    arms = by_arm(runs)
    out: dict = {"steps_logged": sum(run.last_step for run in runs), "steps_planned": len(runs) * RUN4_STEPS,
                 "finished": {arm: [run.seed for run in rs if run.status == "finished"] for arm, rs in arms.items()},
                 "last_steps": {arm: [run.last_step for run in rs] for arm, rs in arms.items()}}

    def per_seed(metric: str, window: Window) -> dict[str, list[float]]:
        return {arm: [window_mean(run.rows, metric, to_last_step(run, window)) for run in rs]
                for arm, rs in arms.items()}

    quarter = per_seed("reward", LAST_QUARTER)
    out["reward_last_quarter"] = quarter
    out["reward_last_quarter_mean_std"] = {arm: mean_std(v) for arm, v in quarter.items()}
    out["length_last_quarter"] = per_seed("completions/mean_length", LAST_QUARTER)
    out["repeat_last_quarter"] = per_seed("completions/repeat_ngram_frac", LAST_QUARTER)
    out["repeat_70_92"] = per_seed("completions/repeat_ngram_frac", Window(70, 92))
    # Degeneration: the pre-registered rule counts finished runs; the page (before 2026-12-04) also counted the
    # stopped ones over steps 76 to their last step.
    out["degenerated_preregistered"] = {
        arm: ([run.seed for run in rs if run.status == "finished" and degenerated(run, LAST_QUARTER)],
              sum(run.status == "finished" for run in rs)) for arm, rs in arms.items()}
    out["degenerated_incl_stopped"] = {
        arm: [run.seed for run in rs if degenerated(run, to_last_step(run, LAST_QUARTER))] for arm, rs in arms.items()}
    lowest_bf16 = min(quarter["bf16_static"])
    out["bf16_lowest"] = lowest_bf16
    out["fp8_not_below_bf16_lowest"] = [(arm, seed, value) for arm in RUN4_ARMS[1:]
                                        for seed, value in enumerate(quarter[arm]) if value >= lowest_bf16]
    # Contrasts on the last-quarter reward (two-sided exact permutation p, 4 vs 4 seeds: 70 relabellings).
    out["vs_static"] = {arm: (statistics.fmean(quarter[arm]) - statistics.fmean(quarter["fp8_static"]),
                              permutation_p(quarter[arm], quarter["fp8_static"])[0]) for arm in RUN4_ARMS[2:]}
    reached = per_seed("reward", REACHED_BY_ALL)
    out["reward_76_92_mean"] = {arm: statistics.fmean(v) for arm, v in reached.items()}
    out["vs_bf16_76_92"] = {arm: (statistics.fmean(reached[arm]) - statistics.fmean(reached["bf16_static"]),
                                  permutation_p(reached[arm], reached["bf16_static"])[0]) for arm in RUN4_ARMS[1:]}
    # The summary table's reward contrasts: difference, 95% bootstrap interval over seeds, exact permutation p.
    def contrast(values: dict[str, list[float]], arm: str, reference: str) -> tuple[float, tuple[float, float], float]:
        a, b = values[arm], values[reference]
        return (statistics.fmean(a) - statistics.fmean(b), bootstrap_interval(a, b), permutation_p(a, b)[0])

    out["contrasts_last_quarter"] = {f"{arm} - {ref}": contrast(quarter, arm, ref) for arm, ref in (
        ("fp8_static", "bf16_static"), ("fp8_tis", "fp8_static"), ("fp8_calibrated", "fp8_static"),
        ("fp8_oracle", "fp8_static"), ("fp8_tis", "bf16_static"), ("fp8_calibrated", "bf16_static"),
        ("fp8_oracle", "bf16_static"))}
    out["contrasts_76_92"] = {f"{arm} - bf16_static": contrast(reached, arm, "bf16_static") for arm in RUN4_ARMS[1:]}
    out["smallest_p_4_vs_4"] = permutation_p([1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0])[0]
    # Power of run 4's design (4 seeds) and the seeds a 0.10 difference needs at 80% power, per contrast.
    sd = {arm: mean_std(v)[1] for arm, v in quarter.items()}
    out["sd_last_quarter"] = sd
    pooled = {arm: math.sqrt((sd[arm] ** 2 + sd["fp8_static"] ** 2) / 2) for arm in RUN4_ARMS[2:]}
    out["pooled_sd_vs_static"] = pooled
    out["power_at_4_seeds"] = {arm: two_sample_power(4, s, TARGET_DIFFERENCE) for arm, s in pooled.items()}
    # 80% power at two-sided 0.05 with n = 4: the difference is (z_.975 + z_.8) * sd * sqrt(2/4) = 1.98 sd.
    out["detectable_at_4_seeds"] = {arm: 2.8016 * s * math.sqrt(2 / 4) for arm, s in pooled.items()}
    out["seeds_for_0.10"] = {arm: seeds_for_power(s, TARGET_DIFFERENCE) for arm, s in pooled.items()}

    # Out-of-sample drop shares, steps 1-92 (every run reached them): per run the pooled quotient, then mean, std.
    def share(numerator: str, denominator: str) -> dict[str, tuple[float, float] | None]:
        result = {}
        for arm, rs in arms.items():
            values = [v for run in rs for v in [window_share(run.rows, numerator, denominator, DROPS_WINDOW)]
                      if v is not None]
            result[arm] = mean_std(values) if len(values) > 1 else None
        return result

    dropped = share("oos/fp8_drops", "oos/neg_tokens")
    shadow = share("oos/shadow_bf16_drops", "oos/shadow_neg_tokens")
    out["oos_dropped"], out["oos_shadow"] = dropped, shadow
    out["oos_recall"] = share("oos/shadow_both_drop", "oos/shadow_bf16_drops")
    out["oos_precision"] = share("oos/shadow_both_drop", "oos/shadow_fp8_drops")
    # Calibrated's dropped share minus its own shadow's, per seed (the same tokens), and a bootstrap over seeds.
    paired = [window_share(run.rows, "oos/fp8_drops", "oos/neg_tokens", DROPS_WINDOW)
              - window_share(run.rows, "oos/shadow_bf16_drops", "oos/shadow_neg_tokens", DROPS_WINDOW)
              for run in arms["fp8_calibrated"]]
    out["calibrated_minus_shadow"] = (statistics.fmean(paired), bootstrap_interval(paired, [0.0]))
    static, calibrated = dropped["fp8_static"][0], dropped["fp8_calibrated"][0]
    # Share of static's excess that the calibrated bound removed, against two floors: the BF16 arm's own drop
    # share (a different population: BF16 training's own ratios) and static's own BF16 shadow (the same tokens
    # static dropped, what BF16 would have dropped of them).
    out["excess_removed_vs_bf16_arm"] = (static - calibrated) / (static - dropped["bf16_static"][0])
    out["excess_removed_vs_static_shadow"] = (static - calibrated) / (static - shadow["fp8_static"][0])
    fits = [run for run in arms["fp8_calibrated"]]
    out["calib_fit_share_1_92"] = mean_std([window_mean(r.rows, "calib/fit", DROPS_WINDOW) for r in fits])
    out["calib_tokens_per_fit_1_92"] = mean_std([window_mean([row for row in r.rows if row.get("calib/fit") == 1.0],
                                                             "calib/neg_tokens", DROPS_WINDOW) for r in fits])
    return out


def old_runs_oos(runs: list[Run]) -> dict[str, list[float]]:
    """Runs 2-3 ("Corrections (2026-12-02)"): per arm and seed, the mean of ``clip/neg_low_frac_fp8`` over the
    off-policy steps that are not calibration steps (steps 1, 5, 9, ... are on-policy with steps_per_generation 4; a
    calibration step, ``clip/neg_low_frac_fp8_static`` logged, scored the bounds on their own tokens), as
    benchmarks/probes/oos_old_runs.py read the raw files."""
    shares: dict[str, list[float]] = {}
    for run in sorted(runs, key=lambda run: (run.arm, run.seed)):
        values = [row["clip/neg_low_frac_fp8"] for row in run.rows if (row["step"] - 1) % 4 != 0
                  and row.get("clip/neg_low_frac_fp8_static") is None and row.get("clip/neg_low_frac_fp8") is not None]
        shares.setdefault(run.arm, []).append(math.fsum(values) / len(values))
    return shares


def print_run4(numbers: dict) -> None:
    for name, value in numbers.items():
        print(f"{name}: {_show(value)}")


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def window_tables(folder: Path, windows: list[Window]) -> str:
    """The report's window tables (calclip.compare.report.markdown_tables) drawn from the data file; runs that
    ended early count for a window their steps reach (`--partial`), as run 4's report was drawn."""
    from calclip.compare.report import markdown_tables

    runs = load_runs(folder)
    arms = {run.arm: {} for run in runs}
    seeds = sorted({run.seed for run in runs})
    return markdown_tables({"arms": arms, "seeds": seeds}, runs, windows, partial=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", metavar="DIR", help="print DIR's window tables instead of run 4's numbers")
    parser.add_argument("--windows", default="", help="with --tables: FIRST-LAST,... (default: the report's)")
    parser.add_argument("--old-oos", metavar="DIR", help="print runs 2-3's out-of-sample shares of DIR")
    options = parser.parse_args(argv)
    if options.old_oos:
        for arm, values in old_runs_oos(load_runs(Path(options.old_oos))).items():
            print(f"{arm}: {statistics.fmean(values):.2%} +- {statistics.stdev(values):.2%} per seed "
                  + ", ".join(f"{v:.2%}" for v in values))
        return 0
    if options.tables:
        from calclip.compare.report import parse_windows

        folder = Path(options.tables)
        steps = max(run.last_step for run in load_runs(folder))
        windows = parse_windows(options.windows) if options.windows else [Window(1, steps, "all"),
                                                                          Window(steps * 3 // 4 + 1, steps)]
        print(window_tables(folder, windows))
        return 0
    print_run4(run4_numbers(load_runs(RUN4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
