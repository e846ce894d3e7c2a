"""Run 5's pre-registered analysis (docs/evidence/run5/plan.md), fixed before any of its data.

    python docs/evidence/run5/analysis.py runs/run5              # a `calclip compare` folder
    python docs/evidence/run5/analysis.py docs/evidence/run5     # or a folder holding its data.csv.gz

Primary endpoint: a run's mean `reward` over steps 76-100. Primary contrast: fp8_calibrated_tis - fp8_static,
two-sided permutation p of the difference of arm means (Monte Carlo, 20,000 draws, seed 0, at 14 vs 14 seeds), 95%
percentile bootstrap interval (10,000 resamples). Secondary contrasts, Holm-adjusted among themselves. A failed run
counts as degenerated and enters the endpoint with the lowest endpoint of the comparison (the worst rank, so a
collapse counts against its arm rather than dropping out). The analysis refuses to run until every run has finished
all 100 steps (`calclip compare` resumes interrupted runs), unless told to report the gap as a deviation.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
from pathlib import Path

from calclip.compare.report import (
    DEGENERATE_LENGTH,
    DEGENERATE_REPEAT,
    Run,
    Window,
    bootstrap_interval,
    permutation_p,
    window_mean,
)

HERE = Path(__file__).resolve().parent
STEPS = 100
PRIMARY_WINDOW = Window(76, STEPS)
ARMS = ("bf16_static", "fp8_static", "fp8_tis", "fp8_calibrated_tis")
PRIMARY = ("fp8_calibrated_tis", "fp8_static")
SECONDARY = (("fp8_tis", "fp8_static"), ("fp8_calibrated_tis", "fp8_tis"), ("fp8_calibrated_tis", "bf16_static"))
ALPHA = 0.05


def load(path: Path) -> list[Run]:
    """The runs of a `calclip compare` folder, or of a folder's compact data.csv.gz (docs/evidence/reproduce.py)."""
    path = Path(path)
    if (path / "comparison.json").exists():
        from calclip.compare.report import load_runs

        return load_runs(path)[1]
    spec = importlib.util.spec_from_file_location("evidence_reproduce", HERE.parent / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_runs(path)


def degenerated(run: Run) -> bool:
    """A failed run, or a finished one whose steps 76-100 average more than 32 tokens per completion or a repeated-
    4-gram share above 0.25 (run 4's rule, unchanged)."""
    if run.status == "failed":
        return True
    length = window_mean(run.rows, "completions/mean_length", PRIMARY_WINDOW) or 0.0
    repeat = window_mean(run.rows, "completions/repeat_ngram_frac", PRIMARY_WINDOW) or 0.0
    return length > DEGENERATE_LENGTH or repeat > DEGENERATE_REPEAT


def endpoints(runs: list[Run]) -> dict[str, list[float]]:
    """Per arm, per seed in order: the primary endpoint; a failed run (or one without reward in the window) gets
    the lowest endpoint of the comparison."""
    values = {(run.arm, run.seed): None if run.status == "failed" else window_mean(run.rows, "reward", PRIMARY_WINDOW)
              for run in runs}
    worst = min(v for v in values.values() if v is not None)
    out: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for run in sorted(runs, key=lambda run: run.seed):
        value = values[(run.arm, run.seed)]
        out[run.arm].append(worst if value is None else value)
    return out


def holm(p_values: list[float]) -> list[float]:
    """Holm-adjusted p values, in the input order."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def contrast(values: dict[str, list[float]], arm: str, reference: str) -> dict:
    a, b = values[arm], values[reference]
    p, how = permutation_p(a, b)
    return {"difference": statistics.fmean(a) - statistics.fmean(b), "interval": bootstrap_interval(a, b), "p": p,
            "how": how, "n": (len(a), len(b))}


def analyse(runs: list[Run], *, allow_incomplete: bool = False) -> dict:
    unfinished = [(run.arm, run.seed, run.status, run.last_step) for run in runs
                  if run.status != "failed" and (run.status != "finished" or run.last_step < STEPS)]
    if unfinished and not allow_incomplete:
        raise ValueError(f"{len(unfinished)} run(s) have not finished all {STEPS} steps (resume them with the same "
                         f"calclip compare command): {unfinished}")
    values = endpoints(runs)
    degenerate = {arm: [run.seed for run in sorted(runs, key=lambda r: r.seed) if run.arm == arm and degenerated(run)]
                  for arm in ARMS}
    seeds = {arm: sum(run.arm == arm for run in runs) for arm in ARMS}
    regime = contrast(values, "fp8_static", "bf16_static")
    # FP8 static fails if it earns less than BF16 (p < 0.05), or if at least a quarter of its seeds degenerate while
    # at most one BF16 seed does.
    static_fails = (regime["difference"] < 0 and regime["p"] < ALPHA) or (
        len(degenerate["fp8_static"]) >= math.ceil(seeds["fp8_static"] / 4) and len(degenerate["bf16_static"]) <= 1)
    primary = contrast(values, *PRIMARY)
    if primary["p"] < ALPHA:
        verdict = "calibrated + TIS earns more than static" if primary["difference"] > 0 else \
            "calibrated + TIS earns less than static"
    else:
        low, high = primary["interval"]
        verdict = f"no separation (95% interval {low:+.3f} to {high:+.3f})"
    secondary = {f"{a} - {b}": contrast(values, a, b) for a, b in SECONDARY}
    for entry, adjusted in zip(secondary.values(), holm([entry["p"] for entry in secondary.values()])):
        entry["p_holm"] = adjusted
    return {"unfinished": unfinished, "endpoints": values, "degenerated": degenerate, "seeds": seeds,
            "regime": regime, "static_fails": static_fails, "primary": primary, "verdict": verdict,
            "secondary": secondary}


def render(result: dict) -> str:
    lines = ["# Run 5: pre-registered analysis", ""]
    if result["unfinished"]:
        lines += [f"**Deviation:** {len(result['unfinished'])} run(s) did not finish: {result['unfinished']}", ""]
    lines += ["| arm | seeds | endpoint mean ± std | degenerated |", "|---|---|---|---|"]
    for arm in ARMS:
        v = result["endpoints"][arm]
        spread = f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""
        lines.append(f"| {arm} | {result['seeds'][arm]} | {statistics.fmean(v):.3f}{spread} | "
                     f"{len(result['degenerated'][arm])} ({', '.join(map(str, result['degenerated'][arm])) or '-'}) |")
    r, p = result["regime"], result["primary"]
    lines += ["", f"FP8 static fails in this regime: {'yes' if result['static_fails'] else 'no'} (static - BF16 "
              f"{r['difference']:+.3f}, p = {r['p']:.3f})", "",
              f"Primary: {PRIMARY[0]} - {PRIMARY[1]} = {p['difference']:+.3f}, 95% bootstrap "
              f"[{p['interval'][0]:+.3f}, {p['interval'][1]:+.3f}], permutation p = {p['p']:.4f} ({p['how']}): "
              f"{result['verdict']}.", "", "| secondary contrast | difference | 95% bootstrap | p | Holm p |",
              "|---|---|---|---|---|"]
    for name, c in result["secondary"].items():
        lines.append(f"| {name} | {c['difference']:+.3f} | [{c['interval'][0]:+.3f}, {c['interval'][1]:+.3f}] | "
                     f"{c['p']:.4f} | {c['p_holm']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run 5's pre-registered analysis")
    parser.add_argument("folder", help="a calclip compare folder, or a folder with data.csv.gz")
    parser.add_argument("--allow-incomplete", action="store_true", help="analyse although runs did not finish "
                        "(reported as a deviation from the plan)")
    options = parser.parse_args(argv)
    print(render(analyse(load(Path(options.folder)), allow_incomplete=options.allow_incomplete)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
