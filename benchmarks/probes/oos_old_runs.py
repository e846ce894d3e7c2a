"""Out-of-sample dropped shares of the committed evidence runs 2 and 3 (docs/evidence.md, "Corrections").

The runs' metrics files log clip/neg_low_frac_fp8 (share of A<0 tokens below the lower bound in force) at every
step. Steps 1, 5, 9, ... are on-policy (steps_per_generation 4, one mini-batch per step: r = 1 exactly); the
calibration steps (clip/neg_low_frac_fp8_static logged) scored the bounds on the tokens they were fitted on. What is
left, the off-policy steps that are not calibration steps, scores the bounds in force out of sample. The BF16 arm
has no calibration steps: its own off-policy drops are the baseline.

    python benchmarks/probes/oos_old_runs.py docs/evidence/2026-12-01-smollm2 docs/evidence/2026-12-01-smollm2-lr3e-5
"""

import json
import statistics
import sys
from pathlib import Path


def oos_share(path: Path) -> tuple[float, int]:
    rows = [json.loads(line) for line in path.open()]
    values = [row["clip/neg_low_frac_fp8"] for row in rows
              if (row["step"] - 1) % 4 != 0 and row.get("clip/neg_low_frac_fp8_static") is None
              and row.get("clip/neg_low_frac_fp8") is not None]
    return sum(values) / len(values), len(values)


def main(folders: list[str]) -> None:
    for folder in map(Path, folders):
        print(f"## {folder.name}")
        shares = {}
        for arm in sorted(p.name for p in folder.iterdir() if p.is_dir()):
            per_seed = [oos_share(metrics) for metrics in sorted((folder / arm).glob("seed*/metrics.jsonl"))]
            values = [share for share, _ in per_seed]
            shares[arm] = statistics.mean(values)
            spread = statistics.stdev(values) if len(values) > 1 else float("nan")
            print(f"{arm:16s} {100 * shares[arm]:.2f}% +- {100 * spread:.2f}  per seed "
                  f"{', '.join(f'{100 * v:.2f}%' for v in values)}  ({per_seed[0][1]} steps each)")
        if {"bf16_static", "fp8_static", "fp8_calibrated"} <= set(shares):
            excess = shares["fp8_static"] - shares["bf16_static"]
            removed = (shares["fp8_static"] - shares["fp8_calibrated"]) / excess
            print(f"calibrated removed {100 * removed:.0f}% of FP8 static's excess over BF16, out of sample")


if __name__ == "__main__":
    main(sys.argv[1:])
