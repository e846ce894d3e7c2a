"""``calclip train | demo | diagnose | compare``: one module per command (train.py, demo.py, diagnose.py,
compare.py). The arguments they share are ``calclip.trainers.arguments`` (re-exported as arguments.py), which
``calclip.compare`` reads too, so the imports run one way: cli -> compare -> trainers. ``main`` imports only the
command it runs, so the usage text and ``calclip compare --list-arms`` start without torch or TRL.

- ``calclip train --config configs/fp8_calibrated.yaml [--field value ...]``: a training run (train.py).
- ``calclip demo``: the embedded default run on SmolLM2-135M-Instruct, CPU, with a closing table (demo.py).
- ``calclip compare``: arms x seeds over one config, a table and a figure (calclip.compare).
- ``calclip diagnose``: the environment, and the FP8-vs-BF16 log-ratio spread of a model (diagnose.py).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

# command -> (module, function); the function takes the remaining argv
COMMANDS = {
    "train": ("calclip.cli.train", "train"),
    "demo": ("calclip.cli.demo", "demo"),
    "diagnose": ("calclip.cli.diagnose", "diagnose"),
    "compare": ("calclip.cli.compare", "compare"),
}
USAGE = (
    "usage: calclip {train,demo,diagnose,compare} ...\n"
    "  train     --config configs/X.yaml [--field value ...]   (TrlParser: YAML, then flags)\n"
    "  demo      [--max-steps N] [--report-to wandb|none] [--model default|tiny|DIR]\n"
    "  diagnose  [--model tiny|default|DIR] [--plot ratios.png]\n"
    "  compare   --config configs/X.yaml --arms A,B --seeds 0,1 [--parallel N] [--field value ...]  "
    "(or --plot-only DIR)"
)


@contextlib.contextmanager
def usage_errors():
    """Marks a ValueError raised inside as the command line's fault (a field, a value, a resume path refused before
    any run starts): ``main`` then prints it and exits 2, as argparse does. The error itself is re-raised unchanged,
    so callers of the command's function (tests, scripts) see the same exception."""
    try:
        yield
    except ValueError as err:
        err.calclip_usage_error = True
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"calclip: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    module, function = COMMANDS[command]
    try:
        result = getattr(importlib.import_module(module), function)(rest)
    except ValueError as err:
        if not getattr(err, "calclip_usage_error", False):
            raise  # a failure of the run itself keeps its traceback
        print(f"calclip {command}: error: {err}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0  # compare returns its exit status; the others objects

