"""Part 5's power analysis (PREREGISTRATION.md, part 5): the observed spreads of paired per-seed differences in
parts 4 and 2, and the power of the registered tests by simulation: per-seed differences ~ Normal(delta, sigma),
the exact two-sided sign-flip p (all 2^n sign vectors, n <= 16; 20 000 random ones above) and TOST at margin D,
each at Holm's stricter level alpha / 2 (a family of two). Run from the repository root:
``python docs/results/granularity/real/prep/power.py`` (writes power.csv and spreads.csv beside this file)."""

import csv
import functools
import itertools
import math
import statistics
from pathlib import Path

import numpy as np

from maspo_verl.lab.engine import stats

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1]  # docs/results/granularity
ALPHA, FAMILY = 0.05, 2


def spreads() -> list[dict]:
    runs = {}
    for arm in ("grpo", "W_1", "W_64"):
        for r in csv.DictReader(open(RESULTS / f"vllm/pieces/held_{arm}_lr1e-5/learn_runs.csv")):
            runs[(arm, int(r["seed"]))] = r
    out = []
    for key in ("val-core/maspo_arith/acc/mean@1", "final_reward", "mean_reward"):
        for a, b in (("W_64", "W_1"), ("W_1", "grpo"), ("W_64", "grpo")):
            d = [float(runs[(a, s)][key]) - float(runs[(b, s)][key]) for s in range(500, 504)]
            out.append({"part": 4, "measure": key, "arm": a, "vs": b, "seeds": 4, "sd": statistics.stdev(d)})
    for r in csv.DictReader(open(RESULTS / "warm/tests.csv")):
        n, half = int(r["seeds"]), (float(r["high"]) - float(r["low"])) / 2
        sd = half * math.sqrt(n) / stats.t_quantile(0.975, n - 1)
        out.append({"part": 2, "measure": r["family"], "arm": r["arm"], "vs": r["vs"], "seeds": n, "sd": sd})
    return out


@functools.cache
def _signs(n: int) -> np.ndarray:
    if n <= 16:  # every sign vector: the exact test
        return np.array(list(itertools.product([1.0, -1.0], repeat=n)))
    return np.random.default_rng(n).choice([-1.0, 1.0], size=(20_000, n))


def power(n: int, sigma: float, delta: float, margin: float, sims: int, seed: int = 0) -> tuple[float, float]:
    """(P[sign-flip p < alpha/2], P[TOST p < alpha/2]) for n seeds."""
    rng = np.random.default_rng(seed)
    d = rng.normal(delta, sigma, size=(sims, n))
    obs = np.abs(d.sum(1))
    signs = _signs(n)
    hits = (np.abs(d @ signs.T) >= obs[:, None] - 1e-12).sum(1)
    p = hits / len(signs) if n <= 16 else (hits + 1) / (len(signs) + 1)
    mean, se = d.mean(1), d.std(1, ddof=1) / math.sqrt(n)
    p_tost = [
        max(1 - stats.t_cdf((m + margin) / s, n - 1), 1 - stats.t_cdf((margin - m) / s, n - 1))
        for m, s in zip(mean, se, strict=True)
    ]
    level = ALPHA / FAMILY
    return float((p < level).mean()), float((np.array(p_tost) < level).mean())


def main() -> None:
    rows = spreads()
    with open(HERE / "spreads.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    table = []
    for n in (8, 12, 16, 20, 24):
        sims = 2000 if n <= 16 else 1000
        for sigma in (0.08, 0.10, 0.14):
            row = {"seeds": n, "sigma": sigma}
            for delta in (0.05, 0.10, 0.15):
                row[f"difference_power_at_{delta:g}"] = power(n, sigma, delta, 0.08, sims)[0]
            row["false_difference_at_0"] = power(n, sigma, 0.0, 0.08, sims)[0]
            for margin in (0.05, 0.08):
                row[f"equivalence_power_margin_{margin:g}"] = power(n, sigma, 0.0, margin, sims)[1]
            table.append(row)
            print(row, flush=True)
    with open(HERE / "power.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)


if __name__ == "__main__":
    main()
