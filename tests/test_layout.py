"""The repository holds the product, not the lab notebook (issue 39): no raw device output under docs/, no large
files, no benchmark script that nothing exercises or cites, and CI runs every test command README.md gives.
Import cycles are tests/test_import_graph.py's."""

import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 300_000
# Per-run evidence figures are kept (issue 39: "pre-registration, config, summary table, figure" per run).
LARGE_ALLOWED = ("docs/evidence/*/figure.png",)
# docs/evidence/ is compacted by its own change (its raw per-seed logs leave with it); until then its files are
# held to the size rule only.
RAW_EXEMPT = ("docs/evidence/*",)
RAW_SUFFIXES = (".log", ".log.gz", ".log.xz", ".out", ".err", ".nsys-rep", ".pt.trace.json")


def tracked_files() -> list[str]:
    """Files git tracks (what a clone holds); without git, every file under the repository minus what .gitignore
    would leave out (approximated by the usual build and cache folders)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "wandb",
                "outputs", "runs", ".device-out", "calclip-demo"}
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
                and not p.name.endswith(".egg-info")]


def test_no_raw_device_output_under_docs():
    raw = [p for p in tracked_files() if p.startswith("docs/") and p.endswith(RAW_SUFFIXES)
           and not any(fnmatch.fnmatch(p, pattern) for pattern in RAW_EXEMPT)]
    assert not raw, f"raw output belongs in the git-ignored .device-out/, numbers in docs/benchmarks.md: {raw}"
    assert not (ROOT / "docs" / "h200").exists()
    assert ".device-out/" in (ROOT / ".gitignore").read_text().split()


def test_no_large_files_but_the_allowed_figures():
    large = {p: (ROOT / p).stat().st_size for p in tracked_files()
             if (ROOT / p).stat().st_size > MAX_BYTES and not any(fnmatch.fnmatch(p, g) for g in LARGE_ALLOWED)}
    assert not large, f"files over {MAX_BYTES} bytes: {large}"


def test_every_benchmark_script_is_tested_or_cited_and_indexed():
    """Each script in benchmarks/ is named by a test under tests/ (which imports or runs it), cited as the command
    of a measurement in docs/benchmarks.md or docs/usage.md, or run by benchmarks/run_all.sh; and benchmarks/README.md
    lists it. A one-off probe that answered its question leaves (its answer goes to docs/, the script to git
    history at 8843ffb)."""
    bench = ROOT / "benchmarks"
    assert not (bench / "probes").exists()
    scripts = sorted(p.name for p in bench.iterdir()
                     if p.suffix in (".py", ".sh") and not p.name.startswith("_"))
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    cited = "\n".join((ROOT / path).read_text()
                      for path in ("docs/benchmarks.md", "docs/usage.md", "benchmarks/run_all.sh"))
    index = (bench / "README.md").read_text()
    loose = [s for s in scripts if Path(s).stem not in tests_text and s not in cited]
    unindexed = [s for s in scripts if f"`{s}" not in index and f"benchmarks/{s}" not in index]
    assert not loose, f"benchmarks that no test, measurement in docs/ or run_all.sh uses: {loose}"
    assert not unindexed, f"benchmarks/README.md does not list: {unindexed}"


def test_ci_runs_every_test_command_of_the_readme():
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set up a fresh machine"):]
    block = setup[setup.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    commands = [re.sub(r"^.*&& ", "", line).strip() for line in block.strip().splitlines() if "pytest" in line]
    assert commands == ['python -m pytest -q -m "not slow" tests', "python -m pytest -q -m slow tests"], commands
    ci = (ROOT / ".ci" / "run").read_text()
    ci_commands = [line.split("||")[0].strip() for line in ci.splitlines()
                   if line.lstrip().startswith("python -m pytest")]
    assert ci_commands == commands


def test_fresh_install_times_the_readme_set_up_commands():
    """benchmarks/fresh_install.sh measures README.md's set-up (docs/usage.md quotes its times): every install step of
    README's first two lines, and the demo itself, is a step it times, so a changed README cannot leave it timing
    the old commands."""
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set up a fresh machine"):]
    block = setup[setup.index("```bash") + len("```bash"):]
    lines = block[:block.index("```")].strip().splitlines()
    script = (ROOT / "benchmarks" / "fresh_install.sh").read_text()
    steps = [line.split(None, 2)[2].strip() for line in script.splitlines() if line.strip().startswith("step ")]
    parts = [part.strip() for line in lines[:2] for part in line.split("&&") if "pytest" not in part]
    assert parts and all(part in steps for part in parts), (parts, steps)


LATEST_CELL_MAX = 1_000  # characters; the longest cell was 933 when the rule came in (2026-12-06)


def test_benchmarks_page_keeps_the_latest_figure_per_target():
    """docs/benchmarks.md is the latest row per target (docs/DESIGN.md's layout): a "latest" cell holds the status,
    the newest figure per device and what would close the gap. Earlier sessions' figures go to docs/benchmarks-log.md;
    cells that had grown to 2,400 characters of session history were cut back on 2026-12-06."""
    long_cells = []
    columns = None
    for number, line in enumerate((ROOT / "docs" / "benchmarks.md").read_text().splitlines(), 1):
        cells = re.split(r"(?<!\\)\|", line)
        if not line.startswith("|"):
            columns = None
        elif "latest" in [c.strip() for c in cells]:
            columns = [c.strip() for c in cells]
        elif columns and not set(line) <= set("|-: "):
            assert len(cells) == len(columns), f"docs/benchmarks.md:{number}: {len(cells) - 2} cells, header has " \
                                               f"{len(columns) - 2}"
            latest = cells[columns.index("latest")]
            if len(latest) > LATEST_CELL_MAX:
                long_cells.append(f"docs/benchmarks.md:{number} ({cells[1].strip()[:60]}): {len(latest)}")
    assert not long_cells, f"'latest' cells over {LATEST_CELL_MAX} characters (history goes to the log): {long_cells}"
