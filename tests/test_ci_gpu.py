""".ci/gpu, the GPU test runner: it lists every test file that asks for CUDA or Triton's interpreter, and its summary
names what passed, what failed and what a time limit cut short (a device call that ends early still says which tests
ran). Runs the script on this CPU with small test files of its own."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu"
# what makes a test file behave differently on a GPU: a CUDA check, or the interpreter tests/conftest.py turns on
# without CUDA
GPU_SENSITIVE = re.compile(r"torch\.cuda\.is_available\(\)|INTERPRET")


def _listed(block: str) -> list[str]:
    text = SCRIPT.read_text()
    start = text.index(block) + len(block)
    body = text[start:text.index('"', start)]
    return [line.split()[0] for line in body.strip().splitlines() if line.strip()]


def _run(tmp_path: Path, files: str, *words: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *words], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPU_TEST_FILES": files, "OUT": str(tmp_path / "out"), **env})


def test_every_test_file_that_asks_for_cuda_or_the_interpreter_is_run_or_excused():
    run, cpu_only = _listed('FILES=${GPU_TEST_FILES:-"'), _listed('CPU_ONLY="')
    assert len(run) == len(set(run)) and len(cpu_only) == len(set(cpu_only)), "a file listed twice"
    assert not set(run) & set(cpu_only), set(run) & set(cpu_only)
    missing = [f for f in run + cpu_only if not (ROOT / f).is_file()]
    assert not missing, f".ci/gpu lists files that do not exist: {missing}"
    sensitive = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                 if GPU_SENSITIVE.search(p.read_text())}
    unlisted = sorted(sensitive - set(run) - set(cpu_only))
    assert not unlisted, f"test files that check for CUDA, neither run by .ci/gpu nor in its CPU_ONLY list: {unlisted}"
    assert all(f.startswith("tests/") and f.endswith(".py") for f in run)


def test_summary_names_failures_and_what_a_time_limit_cut_short(tmp_path):
    (tmp_path / "test_mixed.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n")
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_first():\n    pass\n\ndef test_sleeps():\n    time.sleep(120)\n")
    (tmp_path / "test_clean.py").write_text("def test_one():\n    pass\n")
    # test_slow.py's 15 s leave room for pytest's start on a loaded 2-core CI machine before its first test passes
    files = f"{tmp_path}/test_mixed.py 60\n{tmp_path}/test_slow.py 15\n{tmp_path}/test_clean.py 60\n"
    done = _run(tmp_path, files)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if line.startswith(str(tmp_path))}
    mixed, slow, clean = (lines[f"{tmp_path}/{name}.py"] for name in ("test_mixed", "test_slow", "test_clean"))
    assert "FAILED (pytest exit 1)" in mixed and "1 failed, 1 passed" in mixed and "failed: test_bad" in mixed
    assert "TIMEOUT after 15 s" in slow and "1 passed so far; cut in test_sleeps" in slow, slow
    assert "cut in" not in mixed and "cut in" not in clean
    assert "passed in" in clean and "1 passed" in clean, clean
    assert "assert 1 == 2" in done.stdout  # the failure's first lines follow its summary line
    logs = sorted(p.name for p in (tmp_path / "out" / "gpu-tests").iterdir())
    assert len(logs) == 3 and all(name.endswith(".log") for name in logs)


def test_words_pick_files_and_the_budget_lists_what_it_left_out(tmp_path):
    files = "tests/a_kernel.py 100\ntests/b_vllm.py 300\ntests/c_kernel.py 150\ntests/d_kernel.py 50\n"
    done = _run(tmp_path, files, "kernel", DRY="1", BUDGET="200")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "plan: tests/a_kernel.py (limit 100 s, ends by 100 s)",
        "plan: tests/d_kernel.py (limit 50 s, ends by 150 s)",
        "tests/c_kernel.py: not run (budget 200 s)",
    ]
    everything = _run(tmp_path, files, DRY="1")
    assert [line.split()[1] for line in everything.stdout.splitlines()] == [
        "tests/a_kernel.py", "tests/b_vllm.py", "tests/c_kernel.py", "tests/d_kernel.py"]
