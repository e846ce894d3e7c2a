"""Run 5's seeds per arm (docs/evidence/run5/plan.md): the power calculation on run 4's per-arm seed SDs.

    python docs/evidence/run5/power.py

The primary endpoint is a run's mean reward over steps 76-100 (run 4's last quarter; its stopped runs read to their
last step). Run 4 had no calibrated + TIS arm, so the primary contrast's SD is taken as the larger of the two
FP8 arms it combines (fp8_calibrated 0.082, fp8_tis 0.100), pooled with fp8_static's (0.078): the design must
detect DIFFERENCE at POWER with the noisier of the two. Seeds per arm: calclip.compare.report.seeds_for_power
(two-sided alpha 0.05, normal approximation plus Guenther's small-sample term: the t test's n within one).
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

from calclip.compare.report import ALPHA, POWER, seeds_for_power, two_sample_power

HERE = Path(__file__).resolve().parent
DIFFERENCE = 0.10
PRIMARY = ("fp8_calibrated_tis", "fp8_static")
# Run 4 arms standing in for run 5's calibrated + TIS arm (run 4 ran the two halves separately).
STAND_INS = ("fp8_calibrated", "fp8_tis")


def _reproduce():
    spec = importlib.util.spec_from_file_location("evidence_reproduce", HERE.parent / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run4_sds() -> dict[str, float]:
    """Run 4's per-arm sample SD (n - 1) of the last-quarter reward over its 4 seeds."""
    reproduce = _reproduce()
    numbers = reproduce.run4_numbers(reproduce.load_runs(reproduce.RUN4))
    return {arm: statistics.stdev(values) for arm, values in numbers["reward_last_quarter"].items()}


def design(sds: dict[str, float], difference: float = DIFFERENCE) -> dict:
    """The primary contrast's assumed SD (the noisier stand-in pooled with static's) and the seeds per arm, plus
    every stand-in's own numbers for the record."""
    rows = {}
    for arm in STAND_INS:
        pooled = math.sqrt((sds[arm] ** 2 + sds["fp8_static"] ** 2) / 2)
        rows[arm] = {"pooled_sd": pooled, "seeds": seeds_for_power(pooled, difference),
                     "power_at_4": two_sample_power(4, pooled, difference)}
    primary_sd = max(row["pooled_sd"] for row in rows.values())
    seeds = seeds_for_power(primary_sd, difference)
    return {"stand_ins": rows, "primary_sd": primary_sd, "seeds_per_arm": seeds,
            "power_at_seeds": two_sample_power(seeds, primary_sd, difference)}


def main() -> int:
    sds = run4_sds()
    result = design(sds)
    print("run 4 last-quarter reward SD per arm: " + ", ".join(f"{arm} {sd:.4f}" for arm, sd in sds.items()))
    for arm, row in result["stand_ins"].items():
        print(f"  {arm} with fp8_static: pooled SD {row['pooled_sd']:.4f}, power at 4 seeds {row['power_at_4']:.2f}, "
              f"seeds for {DIFFERENCE:g} at {POWER:.0%}: {row['seeds']}")
    print(f"primary contrast {PRIMARY[0]} - {PRIMARY[1]}: assumed SD {result['primary_sd']:.4f}; "
          f"{result['seeds_per_arm']} seeds per arm (two-sided alpha {ALPHA:g}); power at {DIFFERENCE:g}: "
          f"{result['power_at_seeds']:.2f} (normal approximation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
