"""The report's contrasts (calclip.compare.report): permutation p, bootstrap interval, power and seeds per arm,
checked on hand-worked small examples and against independent references (brute-force enumeration, scipy's
noncentral t)."""

import itertools
import math

import pytest

from calclip.compare.report import (
    EXACT_PERMUTATION_LIMIT,
    Run,
    Window,
    bootstrap_interval,
    contrasts_table,
    permutation_p,
    seeds_for_power,
    two_sample_power,
)


def test_permutation_p_two_against_two_by_hand():
    # Pooled 1, 2, 3, 4 into groups of 2: 6 relabellings with |mean difference| 2, 1, 0, 0, 1, 2 for {1,2}, {1,3},
    # {1,4}, {2,3}, {2,4}, {3,4}. The observed 2 is reached by 2 of them.
    assert permutation_p([1.0, 2.0], [3.0, 4.0]) == (pytest.approx(2 / 6), "exact, 6 relabellings")


def test_permutation_p_complete_separation_of_four_seeds_is_two_in_seventy():
    p, how = permutation_p([5.0, 6.0, 7.0, 8.0], [1.0, 2.0, 3.0, 4.0])
    assert p == pytest.approx(2 / 70) and how == "exact, 70 relabellings"


def test_permutation_p_of_identical_groups_is_one():
    assert permutation_p([0.3, 0.5, 0.4], [0.4, 0.5, 0.3])[0] == pytest.approx(1.0)


def test_permutation_p_three_against_one_by_hand():
    # Pooled 0, 0, 0, 1; groups of 3 and 1: 4 relabellings. Observed a = [0, 0, 1], b = [0]: |1/3 - 0| = 1/3.
    # Relabellings with b = the 1: |0 - 1| = 1 (>= 1/3); b = a 0 (three of them): 1/3. All four reach it.
    assert permutation_p([0.0, 0.0, 1.0], [0.0])[0] == pytest.approx(1.0)
    # a = [0, 0, 0], b = [1]: observed 1; only the relabelling that puts the 1 alone reaches it: 1/4.
    assert permutation_p([0.0, 0.0, 0.0], [1.0])[0] == pytest.approx(0.25)


def test_monte_carlo_permutation_p_agrees_with_brute_force_enumeration():
    a = [0.41, 0.52, 0.38, 0.47, 0.55, 0.36, 0.49, 0.44, 0.51, 0.40]
    b = [0.39, 0.35, 0.45, 0.33, 0.42, 0.37, 0.30, 0.46, 0.34, 0.43]
    assert math.comb(20, 10) > EXACT_PERMUTATION_LIMIT  # so the report draws
    pooled, observed = a + b, abs(sum(a) / 10 - sum(b) / 10)
    total = sum(pooled)
    hits = sum(abs(2 * sum(pooled[i] for i in c) / 10 - total / 10) >= observed * (1 - 1e-12)
               for c in itertools.combinations(range(20), 10))
    exact = hits / math.comb(20, 10)
    p, how = permutation_p(a, b, draws=20_000)
    assert how == "Monte Carlo, 20000 draws"
    assert abs(p - exact) < 4 * math.sqrt(exact * (1 - exact) / 20_000) + 1 / 20_000
    # complete separation of 12 vs 12: the Monte Carlo p is (1 + hits) / (1 + draws), never 0
    p_sep, _ = permutation_p([float(i) for i in range(12, 24)], [float(i) for i in range(12)], draws=1000)
    assert p_sep == pytest.approx(1 / 1001)


def test_bootstrap_interval_by_hand():
    assert bootstrap_interval([1.0, 1.0, 1.0], [0.0, 0.0]) == (1.0, 1.0)
    # a = [0, 1] resamples to a mean of 0, 0.5 or 1 (1/4, 1/2, 1/4); b = [0] always 0: the 95% interval is [0, 1].
    assert bootstrap_interval([0.0, 1.0], [0.0]) == (0.0, 1.0)


def test_power_by_hand_and_against_the_t_test():
    # n = 4, sd 0.08, difference 0.10: 0.10 / (0.08 * sqrt(2/4)) = 1.7678; minus z_0.975 = 1.9600 -> -0.1922;
    # Phi(-0.1922) = 0.4238.
    assert two_sample_power(4, 0.08) == pytest.approx(0.4238, abs=5e-4)
    # Seeds per arm for 80% power at 0.10 with run 4's two FP8 arms' SDs (~0.08): n = 2 sd^2 (1.96 + 0.8416)^2 /
    # 0.01 + 1.96^2 / 4 = 9.92 + 0.96 = 10.88 -> 11 at sd 0.0795.
    assert seeds_for_power(0.0795) == 11
    assert seeds_for_power(0.032) == 3  # run 4 BF16 arm: 2 * 0.032^2 * 7.849 / 0.01 + 0.96 = 1.61 + 0.96 -> 3
    stats = pytest.importorskip("scipy.stats")

    def t_power(n, sd, d=0.10):
        df, nc = 2 * n - 2, d / (sd * math.sqrt(2 / n))
        crit = stats.t.ppf(0.975, df)
        return 1 - stats.nct.cdf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)

    for sd in (0.05, 0.0795, 0.10, 0.12):
        n = seeds_for_power(sd)
        assert t_power(n, sd) >= 0.80 - 0.01 and t_power(n - 1, sd) < 0.80  # the t test's n within one


def test_contrasts_table_against_the_reference_arm():
    window = Window(3, 4)

    def run(arm, seed, rewards):  # window mean = mean of steps 3-4
        return Run(arm, seed, "finished", [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)])

    runs = [run("fp8_static", 0, [0, 0, 0.1, 0.3]), run("fp8_static", 1, [0, 0, 0.3, 0.3]),
            run("fp8_calibrated_tis", 0, [0, 0, 0.5, 0.5]), run("fp8_calibrated_tis", 1, [0, 0, 0.4, 0.6]),
            run("bf16_static", 0, [0, 0, 0.2, 0.2]), Run("bf16_static", 1, "failed", [])]
    record = {"arms": {"bf16_static": {}, "fp8_static": {}, "fp8_calibrated_tis": {}}}
    table = contrasts_table(record, runs, window).splitlines()
    assert table[0].startswith("| arm - fp8_static | n |")
    # static 0.2, 0.3 (mean 0.25); calibrated+TIS 0.5, 0.5 (0.5): +0.250; 2 vs 2 complete separation: p 2/6
    row = next(line for line in table if line.startswith("| fp8_calibrated_tis"))
    assert "| 2 vs 2 | +0.250 |" in row and "0.333 (exact, 6 relabellings)" in row
    # the failed BF16 seed does not count: 1 vs 2, no SD and no power
    row = next(line for line in table if line.startswith("| bf16_static"))
    assert "| 1 vs 2 | -0.050 |" in row and row.endswith("| - | - |")
    with pytest.raises(ValueError, match="reference arm 'nope'"):
        contrasts_table(record, runs, window, reference="nope")
