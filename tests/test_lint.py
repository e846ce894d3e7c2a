"""The code passes ruff's pycodestyle and pyflakes rules (E, F, W at 120 columns: pyproject.toml's [tool.ruff]), so a
long line, an unused import or an undefined name fails the fast test set instead of piling up. ruff is in the test
extra, pinned: a newer ruff may add findings."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "calclip", "tests", "benchmarks"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"
