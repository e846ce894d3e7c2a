"""``calclip compare``: arms x seeds over one config, each an ordinary `calclip train` run; a table and a figure.

    calclip compare --config configs/compare_smollm2.yaml --arms bf16_static,fp8_static,fp8_tis,fp8_calibrated \\
        --seeds 0,1,2 --parallel 12 [--field value ...]
    calclip compare --plot-only runs/compare-compare_smollm2

Unrecognised ``--field value`` flags go to every run's `calclip train` (TrlParser: they replace the YAML's values);
a flag that an arm sets, or one that compare sets per run (seed, output_dir, ...), is refused. Exit status: 0 all
runs finished, 1 some failed, 3 stopped by --time-limit or SIGTERM (run the same command to continue), 2 bad input,
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
from pathlib import Path

from calclip.compare import folder, report
from calclip.compare.arms import (
    DEFAULT_ARMS, PRESETS, RUN_FIELDS, Arm, arm_fields, looks_like_a_flag, parse_arm_spec, resolve_arms,
)
from calclip.compare.runner import FAILED, FINISHED, RunSpec, run_grid
from calclip.trainers.arguments import ScriptArguments, parse_train_args
from calclip.run.field_checks import SEED_MAX
from calclip.run.run_outputs import METRICS_FILE

EXIT_OK, EXIT_FAILED_RUNS, EXIT_USAGE, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="calclip compare", allow_abbrev=False,  # no prefix matching: --seed must not become --seeds
        description="Run arms (named config override sets) x seeds of one config as separate `calclip train` runs; "
        "write per-run metrics files, a Markdown table of window means +- std over seeds and a figure.",
        epilog="Other --field value flags go to every run's `calclip train`. Presets: "
        + "; ".join(f"{arm.name}: {_overrides_text(arm)}" for arm in PRESETS.values()),
    )
    parser.add_argument("--config", help="the shared `calclip train` YAML config")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="comma-separated arm names (presets or "
                        "--arm names); default: %(default)s")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="define an arm (repeatable); a list value is space-separated")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; default: %(default)s")
    parser.add_argument("--output-dir", help="comparison folder (default: runs/compare-<config name>)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (they share the GPU; a 135M model "
                        "fits many on one H200); default 1 (one after another)")
    parser.add_argument("--gpus", help="comma-separated GPU ids to spread the runs over (CUDA_VISIBLE_DEVICES per "
                        "run); default: every run sees the GPUs this process sees")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS", help="stop after this long: running runs "
                        "save a checkpoint and exit; the same command continues later")
    parser.add_argument("--stop-timeout", type=float, default=180.0, metavar="SECONDS",
                        help="how long a stopping run may take to checkpoint before it is killed; default %(default)s")
    parser.add_argument("--wandb-group", help="W&B group of the runs (default: the comparison folder's name)")
    parser.add_argument("--windows", help="table windows as FIRST-LAST steps, comma-separated (default: all steps "
                        "and the last quarter)")
    parser.add_argument("--smooth", type=int, default=1, help="figure: trailing moving average over this many "
                        "logged steps per seed; default 1 (none)")
    parser.add_argument("--plot-only", metavar="DIR", help="redraw the table and figure of an existing comparison")
    parser.add_argument("--partial", action="store_true", help="table and figure also read runs that ended before "
                        "max_steps without failing (time limit, killed machine): a run counts for a window its "
                        "logged steps reach, and is drawn up to its last step")
    parser.add_argument("--list-arms", action="store_true", help="print the preset arms and their fields")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, train_flags = argument_parser().parse_known_args(argv)
    try:
        if options.list_arms:
            for arm in PRESETS.values():
                print(f"{arm.name:20s} {_overrides_text(arm):60s} {arm.description}")
            return EXIT_OK
        windows = report.parse_windows(options.windows) if options.windows else None
        if options.smooth < 1:
            raise ValueError(f"--smooth must be >= 1, got {options.smooth}")
        if options.plot_only:
            if options.config or train_flags:
                raise ValueError("--plot-only redraws an existing comparison: give no --config or train flags")
            return _redraw(Path(options.plot_only), windows, options.smooth, options.partial)
        return _compare(options, train_flags, windows)
    except (ValueError, RuntimeError) as error:
        print(f"calclip compare: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # the runner has killed the runs and said how to continue
        return EXIT_INTERRUPTED


def _compare(options, train_flags: list[str], windows) -> int:
    if not options.config:
        raise ValueError("--config is required (or --plot-only DIR)")
    if not Path(options.config).is_file():
        raise ValueError(f"--config {options.config!r}: no such file")
    if options.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {options.parallel}")
    # A NaN or negative time made the runner stop at once or never (a NaN compares false with every deadline).
    if options.time_limit is not None and not (math.isfinite(options.time_limit) and options.time_limit > 0):
        raise ValueError(f"--time-limit must be a finite number of seconds > 0, got {options.time_limit}")
    if not (math.isfinite(options.stop_timeout) and options.stop_timeout >= 0):
        raise ValueError(f"--stop-timeout must be a finite number of seconds >= 0, got {options.stop_timeout}")
    arms = resolve_arms(_split(options.arms, "--arms"), [parse_arm_spec(spec) for spec in options.arm])
    seeds = [_int(seed, "--seeds") for seed in _split(options.seeds, "--seeds")]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds lists a seed twice: {options.seeds}")
    refused = [seed for seed in seeds if not 0 <= seed <= SEED_MAX]
    if refused:  # checked for every seed: the configs are resolved with seed 0 only
        raise ValueError(f"--seeds: {refused[0]} is not a seed calclip train takes (0 to 2**32 - 1: transformers' "
                         "set_seed seeds numpy)")
    _check_train_flags(train_flags, arms)
    root = Path(options.output_dir or f"runs/compare-{Path(options.config).stem}")
    _check_output_dir(root)
    config_path = str(Path(options.config).resolve())

    print(f"calclip compare: resolving {len(arms)} arm configs ...", flush=True)
    resolved = {arm.name: _resolve(arm, config_path, train_flags, root) for arm in arms}
    configs = {name: folder.comparable(config) for name, config in resolved.items()}
    steps = {name: int(config["max_steps"]) for name, config in resolved.items()}
    bad = [name for name, value in steps.items() if value < 1]
    if bad:
        raise ValueError(f"max_steps must be >= 1 (runs are compared step by step); arms {', '.join(bad)} have "
                         f"{steps[bad[0]]}")

    with folder.FolderLock(root):
        previous = folder.load(root)
        group = options.wandb_group or (previous or {}).get("group") or root.resolve().name
        folder.check_or_create(root, config_path=options.config, arms=arms, configs=configs, seeds=seeds, group=group,
                               defaults=_field_defaults())
        if not (root / "config.yaml").exists():
            shutil.copyfile(config_path, root / "config.yaml")
        specs = [
            RunSpec(arm.name, seed, folder.run_directory(root, arm.name, seed),
                    _train_argv(arm, config_path, train_flags, seed, folder.run_directory(root, arm.name, seed)),
                    steps[arm.name])
            for arm in arms for seed in seeds
        ]
        print(f"calclip compare: {len(arms)} arms x {len(seeds)} seeds = {len(specs)} runs in {root} "
              f"(parallel {options.parallel}); logs: {root}/<arm>/seed<S>/train.log", flush=True)
        outcomes = run_grid(
            specs, parallel=options.parallel, gpus=_split(options.gpus, "--gpus") if options.gpus else None,
            group=group, time_limit_s=options.time_limit, stop_timeout_s=options.stop_timeout,
            threads_per_run=_threads_per_run(options.parallel),
        )
    report_path, figure, note = report.write_report(root, windows=windows, smooth=options.smooth,
                                                    partial=options.partial)
    _print_summary(root, report_path, figure, note, windows, options.partial)
    failed = [label for label, outcome in outcomes.items() if outcome.status == FAILED]
    unfinished = [label for label, outcome in outcomes.items() if outcome.status != FINISHED]
    if failed:
        print(f"calclip compare: {len(failed)} run(s) failed: {', '.join(failed)} (the others went on)")
        return EXIT_FAILED_RUNS
    if unfinished:
        print(f"calclip compare: {len(unfinished)} run(s) not finished; run the same command to continue")
        return EXIT_INCOMPLETE
    return EXIT_OK


def _check_output_dir(root: Path) -> None:
    """The comparison folder, or the nearest of its parents that exists, must be a folder: a file there failed with a
    traceback after the arm configs were resolved."""
    existing = next((path for path in (root, *root.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == root else f"lies under {existing}, which is a file"
        raise ValueError(f"--output-dir {root} {where}, not a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output-dir {root}: {existing} is not writable")


def _redraw(root: Path, windows, smooth: int, partial: bool) -> int:
    if not (root / folder.COMPARISON_FILE).exists():
        raise ValueError(f"--plot-only {root}: no {folder.COMPARISON_FILE} there (not a calclip compare folder)")
    differences = folder.command_differences(root, folder.load(root))
    if differences:
        shown = differences[:10] + ([f"... and {len(differences) - 10} more"] if len(differences) > 10 else [])
        raise ValueError(f"--plot-only {root}: runs whose recorded command differs from the comparison (a report "
                         "over them would compare other configs):\n  " + "\n  ".join(shown))
    report_path, figure, note = report.write_report(root, windows=windows, smooth=smooth, partial=partial)
    _print_summary(root, report_path, figure, note, windows, partial)
    return EXIT_OK if figure is not None else EXIT_FAILED_RUNS


def _print_summary(root, report_path, figure, note, windows, partial: bool = False) -> None:
    record, runs = report.load_runs(root)
    windows = windows or report.default_windows(report.max_steps(record))
    print()
    print(report.markdown_tables(record, runs, windows[-1:], partial))
    print(f"report: {report_path}")
    print(f"figure: {figure}" if figure is not None else f"figure: {note}")


def _resolve(arm: Arm, config_path: str, train_flags: list[str], root: Path) -> dict:
    """The `calclip train` config of the arm's runs (ScriptArguments + trainer config fields), as TrlParser
    resolves it; a refused value raises ValueError naming the arm."""
    argv = _train_argv(arm, config_path, train_flags, 0, folder.run_directory(root, arm.name, 0))
    try:
        script_args, training_args = parse_train_args(argv)
    except SystemExit as error:  # argparse already printed why (a value of the wrong type)
        raise ValueError(f"arm {arm.name!r}: calclip train refused its arguments (exit {error.code}, see above)")
    except (ValueError, TypeError) as error:
        raise ValueError(f"arm {arm.name!r}: {error}") from None
    return {**dataclasses.asdict(script_args), **training_args.to_dict()}


def _field_defaults() -> dict:
    """Every `calclip train` field with a plain default (ScriptArguments, CalibratedGRPOConfig), JSON-normalized like
    the folder's configs: what a field the folder's record lacks stood at when that folder was made."""
    from calclip.trainers.config import CalibratedGRPOConfig  # imports TRL: only when asked for

    defaults = {}
    for cls in (ScriptArguments, CalibratedGRPOConfig):
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                defaults[field.name] = field.default
    return folder.comparable(defaults)


def _train_argv(arm: Arm, config_path: str, train_flags: list[str], seed: int, directory: Path) -> list[str]:
    return [
        "--config", config_path, *train_flags, *arm.train_flags(),
        "--seed", str(seed), "--output_dir", str(directory), "--run_name", f"{arm.name}-seed{seed}",
        "--metrics_file", str(directory / METRICS_FILE), "--checkpoint_on_sigterm", "true",
    ]


def _check_train_flags(flags: list[str], arms: list[Arm]) -> None:
    # argparse (calclip train's parser) takes --field and --field-with-dashes alike: compare whole, normalized names
    names = [flag[2:].split("=", 1)[0].replace("-", "_") for flag in flags if flag.startswith("--")]
    stray = [flag for flag in flags[:1] if not flag.startswith("--")]
    if stray:
        raise ValueError(f"unexpected argument {stray[0]!r} (train flags are --field value)")
    single_dash = [flag for flag in flags if flag.startswith("-") and not flag.startswith("--")
                   and looks_like_a_flag(flag)]
    if single_dash:
        raise ValueError(f"unexpected argument {single_dash[0]!r} (train flags are --field value)")
    known = _train_field_names()
    unknown = [name for name in names if name not in known and name != "config"]
    if unknown:
        raise ValueError(f"--{unknown[0]} is not a `calclip train` field (flags are whole field names, never "
                         "abbreviations: calclip compare checks which fields they set)")
    reserved = [name for name in names if name in RUN_FIELDS or name == "config"]
    if reserved:
        hint = " (use --output-dir)" if "output_dir" in reserved else ""
        raise ValueError(f"--{reserved[0]} is set by calclip compare per run{hint}")
    by_arms = arm_fields(arms)
    clashing = [name for name in names if name in by_arms]
    if clashing:
        setters = [arm.name for arm in arms if clashing[0] in arm.overrides]
        raise ValueError(f"--{clashing[0]} is an arm field (set by {', '.join(setters)}); define an arm with "
                         f"--arm NAME:{clashing[0]}=VALUE,... instead")


def _train_field_names() -> set[str]:
    """Every field `calclip train` takes (ScriptArguments and the DAPO config, a superset of the GRPO one)."""
    from calclip.trainers.config import CalibratedDAPOConfig  # imports TRL: only when asked for

    return {field.name for cls in (ScriptArguments, CalibratedDAPOConfig) for field in dataclasses.fields(cls)}


def _threads_per_run(parallel: int) -> int | None:
    """Runs side by side split the CPU cores (torch would give each process all of them, as torchrun avoids by
    setting OMP_NUM_THREADS); an OMP_NUM_THREADS already set wins."""
    return None if parallel == 1 else max(1, (os.cpu_count() or 1) // parallel)


def _split(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"{option} {text!r}: empty item")
    return items


def _int(text: str, option: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{option}: {text!r} is not an integer") from None


def _overrides_text(arm: Arm) -> str:
    return ", ".join(f"{k}={v}" for k, v in arm.overrides.items())
