"""benchmarks/bench_speed.py: its statistics helpers, argument checks, and a CPU smoke run of two sections.

The benchmark is a GPU script, not a timed test; these only check that it computes what its tables claim
and that it still runs against the current calclip API (so a refactor of calclip.fp8 cannot silently break it).
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_speed  # noqa: E402


def test_fmt_stat_is_median_with_min_max_and_skips_nan():
    assert bench_speed.fmt_stat([3.0, 1.0, 2.0]) == "2.000 [1.000-3.000]"
    assert bench_speed.fmt_stat([4.0, math.nan, 1.0], digits=1) == "2.5 [1.0-4.0]"
    assert bench_speed.fmt_stat([7.25]) == "7.250"
    assert bench_speed.fmt_stat([math.nan]) == "-"


def test_paired_ratio_pairs_rounds_and_takes_the_median():
    base = bench_speed.Arm("BF16", samples={"ms": [10.0, 20.0, 40.0]})
    arm = bench_speed.Arm("FP8", samples={"ms": [5.0, 40.0, 20.0]})
    # per-round ratios 2.0, 0.5, 2.0 -> median 2.0 (the ratio of medians would be 20/20 = 1.0)
    assert bench_speed.paired_ratio(base, arm, "ms") == "2.00 [0.50-2.00]x"
    failed = bench_speed.Arm("FP8", error="setup: boom")
    assert bench_speed.paired_ratio(base, failed, "ms") == "err"
    assert bench_speed.cell(failed, "ms") == "err"
    assert bench_speed.paired_ratio(base, None, "ms") == "-"


def test_interleave_samples_arms_in_turn_and_drops_a_failing_arm():
    order = []

    def sampler(name, fail_on=None):
        def sample():
            order.append(name)
            if len([o for o in order if o == name]) == fail_on:
                raise RuntimeError("kernel exploded")
            return {"ms": float(len(order))}
        return sample

    a, b = bench_speed.Arm("A", sampler("A")), bench_speed.Arm("B", sampler("B", fail_on=2))
    bench_speed.interleave([a, b], repeats=3)
    assert order == ["A", "B", "A", "B", "A"]
    assert a.values("ms") == [1.0, 3.0, 5.0] and b.values("ms") == [2.0]
    assert b.sample is None and "kernel exploded" in b.error


def test_time_calls_on_cpu_reports_wall_and_host_per_call():
    calls = []
    result = bench_speed.time_calls(lambda: calls.append(1), 4, torch.device("cpu"))
    assert len(calls) == 4
    assert result["wall"] >= result["host"] > 0
    assert math.isnan(result["gpu"])


def test_parse_args_rejects_unknown_sections_and_zero_counts(capsys):
    with pytest.raises(SystemExit):
        bench_speed.parse_args(["--only", "layer,typo"])
    assert "typo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_speed.parse_args(["--warmup", "0"])
    assert "--warmup" in capsys.readouterr().err
    opts = bench_speed.parse_args(["--tiny", "--repeats", "4"])
    assert opts.repeats == 4 and opts.layer_calls == bench_speed.COUNT_DEFAULTS["layer_calls"][1]
    assert opts.compile_backend == "aot_eager"
    assert bench_speed.parse_args([]).compile_backend == "inductor"


def _cells(table_row: str) -> list[str]:
    return [c.strip() for c in table_row.strip().strip("|").split("|")]


@pytest.mark.slow
def test_tiny_run_prints_layer_and_decode_tables_with_numbers():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_speed.py"), "--tiny", "--only", "layer,decode",
         "--repeats", "1", "--decode-repeats", "1", "--layer-calls", "1", "--warmup", "1"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.startswith("bench_speed ") and "commit " in out and "torch " in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| M ") and "BF16 ms" in line)
    columns = _cells(lines[header])
    rows = [_cells(line) for line in lines[header + 2: header + 2 + len(bench_speed.TINY_LAYER_SHAPES)]]
    assert [tuple(map(int, r[:3])) for r in rows] == list(bench_speed.TINY_LAYER_SHAPES)
    for row in rows:
        for name in ("BF16 ms", "FP8 eager ms", "BF16/FP8 eager"):
            assert re.fullmatch(r"\d+\.\d+x?", row[columns.index(name)]), (name, row)
    decode = next(i for i, line in enumerate(lines) if line.startswith("| batch "))
    decode_rows = [_cells(line) for line in lines[decode + 2: decode + 6]]
    assert [(r[0], r[1]) for r in decode_rows] == [("2", "eager"), ("2", "graphed"), ("4", "eager"), ("4", "graphed")]
    for row in decode_rows:
        assert all(re.fullmatch(r"\d+(\.\d+)?", v) for v in row[2:6]), row


def test_summarize_runs_ratios_of_medians_and_means_in_either_direction():
    times = {"bf16_static": [1.0, 2.0, 3.0], "fp8_static": [2.0, 4.0, 9.0], "broken": []}
    rows = bench_speed.summarize_runs(times, "bf16_static")
    assert rows[1] == ["fp8_static", "4.000 [2.000-9.000]", "5.000", "0.50x", "0.40x"]  # 2/4, 2/5
    assert rows[2] == ["broken", "err", "err", "-", "-"]
    inverted = bench_speed.summarize_runs(times, "bf16_static", run_over_base=True)
    assert inverted[1][3:] == ["2.00x", "2.50x"]
