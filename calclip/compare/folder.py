"""The comparison folder and its config fingerprint.

``DIR/comparison.json`` records, per arm, its overrides and the resolved `calclip train` config of its runs (every
ScriptArguments and config field except `UNCOMPARED_FIELDS`), plus the seeds run so far. A later call into the
same folder must resolve to the same configs: an arm already in the folder is compared field by field, a new arm
on every field no arm sets. A difference is refused with the fields named. Arms and seeds may be added.

Layout: ``DIR/<arm>/seed<S>/`` per run (`calclip.compare.runner`), ``DIR/report.md``, ``DIR/figure.png``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from calclip.compare.arms import RUN_FIELDS, Arm

COMPARISON_FILE = "comparison.json"
LOCK_FILE = ".compare.lock"
FORMAT_VERSION = 1

# Fields that name, place, report or checkpoint a run without changing what it trains.
UNCOMPARED_FIELDS = frozenset(RUN_FIELDS) | {
    "logging_dir", "report_to", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
    "hub_revision", "save_strategy", "save_steps", "save_total_limit", "save_on_each_node", "save_only_model",
    "save_final_model", "disable_tqdm", "log_level", "log_level_replica", "log_on_each_node",
    "log_completions", "log_completions_hub_repo", "num_completions_to_print", "dataloader_num_workers",
    "mismatch_dump_threshold",  # where outlier tokens are written out, not what is trained
    # One kernel launch or two per FP8 decode linear: the same FP8 codes and scales (at most the fp32 accumulation
    # order of the GEMM differs), so runs before and after its automatic default compare as one config.
    "fp8_decode_fused_max_m", "fp8_decode_group_siblings",
    # Quantizing q/k/v's (gate/up's) shared input once or per linear: the same codes, outputs and gradients.
    "fp8_share_sibling_inputs",
    # Quantizing in the producing kernels, or keeping W / W^T's codes resident: bit-equal outputs and gradients too.
    "fp8_fuse_producers", "fp8_resident_dgrad_codes", "fp8_resident_weight_codes",
    # Engine speed options of the colocated vLLM engine (the FP8 KV cache is not: it changes the rollouts).
    "vllm_async_scheduling", "vllm_max_num_batched_tokens", "vllm_max_cudagraph_capture_size",
    # Whether vLLM also writes the completions' text: the same token ids and log-probs either way.
    "vllm_detokenize",
    # The garbage collector off during rollouts: when Python frees memory, not what is generated or trained.
    "vllm_pause_gc",
}


def run_directory(root: Path, arm: str, seed: int) -> Path:
    return Path(root) / arm / f"seed{seed}"


def comparable(config: dict) -> dict:
    """The fingerprinted part of a resolved config, JSON-normalized (tuples become lists, objects strings)."""
    kept = {key: value for key, value in config.items() if key not in UNCOMPARED_FIELDS}
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def load(root: Path) -> dict | None:
    path = Path(root) / COMPARISON_FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {record.get('format')!r}, this calclip reads format {FORMAT_VERSION}")
    return record


def config_differences(record: dict, arms: list[Arm], configs: dict[str, dict],
                       defaults: dict | None = None) -> list[str]:
    """One line per field in which ``configs`` (arm -> comparable config) differs from the folder's record.

    ``defaults`` (field -> comparable default): a field the folder's record lacks (a calclip that added it since
    the folder was made) is no difference while its value now is its default, which is how that calclip ran."""
    defaults = defaults or {}
    stored = record["arms"]
    set_by_arms = {field for arm in arms for field in arm.overrides}
    set_by_arms |= {field for entry in stored.values() for field in entry["overrides"]}
    reference_arm = next(iter(stored))
    differing: dict[str, list[tuple[str, object, object]]] = {}
    for arm in arms:
        config = configs[arm.name]
        if arm.name in stored:
            reference, fields = stored[arm.name]["config"], set(config) | set(stored[arm.name]["config"])
        else:
            reference = stored[reference_arm]["config"]
            fields = (set(config) | set(reference)) - set_by_arms
        for field in sorted(fields):
            old, new = reference.get(field, "<unset>"), config.get(field, "<unset>")
            if field not in reference and field in defaults and new == defaults[field]:
                continue
            if old != new:
                differing.setdefault(field, []).append((arm.name, old, new))
    lines = []
    for field, entries in differing.items():
        values = {(json.dumps(old), json.dumps(new)) for _, old, new in entries}
        arm_names = ", ".join(name for name, _, _ in entries)
        for old, new in sorted(values):
            lines.append(f"{field}: {old} in the folder, {new} now (arms: {arm_names})")
    return lines


def check_or_create(root: Path, *, config_path: str, arms: list[Arm], configs: dict[str, dict], seeds: list[int],
                    group: str, defaults: dict | None = None) -> dict:
    """Refuse a folder of a different config (ValueError naming the fields); else record the arms and seeds."""
    root = Path(root)
    record = load(root)
    if record is None:
        if root.exists() and any(path.name != LOCK_FILE for path in root.iterdir()):
            raise ValueError(f"{root} is not empty and holds no {COMPARISON_FILE}: not a calclip comparison folder; "
                             "pick another --output-dir")
        record = {"format": FORMAT_VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "group": group,
                  "config_path": str(config_path), "arms": {}, "seeds": []}
    else:
        differences = config_differences(record, arms, configs, defaults)
        if differences:
            raise ValueError(
                f"{root} holds runs of a different config:\n  " + "\n  ".join(differences)
                + "\nUse another --output-dir, or the folder's config (recorded in " + COMPARISON_FILE + ")."
            )
    for arm in arms:
        record["arms"].setdefault(arm.name, {"overrides": _normalized(arm.overrides), "description": arm.description,
                                             "config": configs[arm.name]})
    record["seeds"] = sorted(set(record["seeds"]) | set(seeds))
    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / COMPARISON_FILE, record)
    return record


COMMAND_FILE = "command.json"  # a run's `calclip train` argv (calclip.compare.runner writes it at every launch)


def command_differences(root: Path, record: dict) -> list[str]:
    """One line per run whose ``command.json`` does not match the comparison (``--plot-only`` refuses them).

    A run's argv must hold its arm's overrides (recorded in ``comparison.json``) with their recorded values, its
    seed and run name; and every run must share the same remaining flags (the config file and the shared
    ``--field value`` flags, which the record does not hold): a run copied in from another comparison, or re-run
    by hand with other flags, differs in one of these. A run without a command.json (never launched) is skipped."""
    lines, shared_reference = [], None
    set_by_arms = {field for entry in record["arms"].values() for field in entry["overrides"]}
    for arm, entry in record["arms"].items():
        expected = _argv_flags(Arm(arm, entry["overrides"]).train_flags())
        for seed in record["seeds"]:
            path = run_directory(root, arm, seed) / COMMAND_FILE
            if not path.exists():
                continue
            try:
                argv = json.loads(path.read_text())["train_argv"]
                if not isinstance(argv, list) or not all(isinstance(item, str) for item in argv):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                lines.append(f"{path}: not a command file calclip compare wrote (a JSON object with train_argv, "
                             "a list of strings)")
                continue
            flags = _argv_flags(argv)
            wanted = {**expected, "seed": [str(seed)], "run_name": [f"{arm}-seed{seed}"]}
            for name, values in wanted.items():
                if flags.get(name) != values:
                    lines.append(f"{path}: --{name} {_show_values(flags.get(name))}, the comparison's {arm} "
                                 f"seed {seed} has {_show_values(values)}")
            shared = {name: values for name, values in flags.items()
                      if name not in RUN_FIELDS and name not in set_by_arms}
            if shared_reference is None:
                shared_reference = (path, shared)
            elif shared != shared_reference[1]:
                other_path, other = shared_reference
                names = sorted(name for name in set(shared) | set(other) if shared.get(name) != other.get(name))
                lines.append(f"{path}: shared flags differ from {other_path}: " + "; ".join(
                    f"--{name} {_show_values(shared.get(name))} vs {_show_values(other.get(name))}"
                    for name in names[:5]))
    return lines


def _argv_flags(argv: list[str]) -> dict[str, list[str]]:
    """``--a=b`` / ``--a b c`` / ``--a-b x`` -> {"a": ["b"], ..., "a_b": ["x"]} (a repeated flag: the last wins,
    as in argparse)."""
    flags: dict[str, list[str]] = {}
    name = None
    for item in argv:
        if item.startswith("--"):
            name, eq, value = item[2:].partition("=")
            name = name.replace("-", "_")
            flags[name] = [value] if eq else []
            if eq:
                name = None
        elif name is not None:
            flags[name].append(item)
    return flags


def _show_values(values) -> str:
    if values is None:
        return "unset"
    text = " ".join(values) if values else "(no value)"
    return text if len(text) <= 80 else text[:77] + "..."


class FolderLock:
    """``DIR/.compare.lock`` holding ``pid host`` of the `calclip compare` running in the folder. A lock whose
    process is gone, or that was written on another host (a folder copied between machines), is stale and taken
    over."""

    def __init__(self, root: Path):
        self.path = Path(root) / LOCK_FILE

    def _holder(self) -> int | None:
        """The pid of a live calclip compare on this host holding the folder, else None."""
        try:
            pid_text, _, host = self.path.read_text().strip().partition(" ")
            pid = int(pid_text)
        except (FileNotFoundError, ValueError):
            return None
        return pid if host == socket.gethostname() and _alive(pid) else None

    def held_by_live_process(self) -> bool:
        """Whether a calclip compare (this one included) is running in the folder now."""
        return self._holder() is not None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        pid = self._holder()
        if pid is not None and pid != os.getpid():
            raise RuntimeError(f"another calclip compare (pid {pid}) is running in {self.path.parent}")
        self.path.write_text(f"{os.getpid()} {socket.gethostname()}\n")
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _normalized(value):
    return json.loads(json.dumps(value, default=str))


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
