"""benchmarks/h200_session.sh: every command the next H200 hold runs parses here, so no device call is lost to a
stale flag or file name (two of this session's seven were)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "h200_session.sh"
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "probes")]


def _commands() -> list[list[str]]:
    """The argv of every ``run LIMIT LOG CMD...`` line (continuations joined)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip().lstrip("(")
        if line.startswith("run ") and not line.startswith("run()"):
            argv = shlex.split(line.rstrip(")"))[3:]
            out.append(argv)
    return out


def test_script_is_valid_bash_and_names_its_steps():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    bad = subprocess.run(["bash", str(SCRIPT), "99"], capture_output=True, text=True, env={"OUT": "/tmp/h200_session_test",
                                                                                       "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "usage" in bad.stdout
    text = SCRIPT.read_text()
    steps = re.search(r"usage: bash benchmarks/h200_session.sh ([\d|]+)", text).group(1).split("|")
    assert len(_commands()) >= len(steps)  # a measurement per step at least
    assert all(re.search(rf"^{n}\)", text, re.M) for n in steps), steps  # every step named has its branch


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a[:3]))
def test_every_command_parses(argv, capsys):
    assert argv[0] == "python"
    if argv[1] == "-m":  # pytest: the files exist and -k selects something there
        files = [a for a in argv if a.endswith(".py")]
        assert files and all((ROOT / f).is_file() for f in files)
        if "-k" in argv:
            pattern = argv[argv.index("-k") + 1]
            assert any(re.search(rf"def test_\w*{pattern}", (ROOT / f).read_text()) for f in files), pattern
        return
    script, args = ROOT / argv[1], argv[2:]
    assert script.is_file(), script
    if script.name == "bench_speed.py":
        import bench_speed
        bench_speed.parse_args(args)  # exits (SystemExit) on a bad flag or value
    elif script.name == "bench_vllm.py":
        import bench_vllm
        bench_vllm.parse_args(args)
    elif script.name == "profile_model_step.py":
        import profile_model_step
        assert profile_model_step.main(args) == 2  # arguments accepted; then it stops for want of CUDA
        assert "no CUDA device" in capsys.readouterr().out
    elif script.name == "quant_in_situ.py":
        import quant_in_situ
        assert quant_in_situ.main(args) == 2  # arguments accepted; nothing timed without CUDA
    else:
        assert args == [] or script.name == "sweep_quant.py"

