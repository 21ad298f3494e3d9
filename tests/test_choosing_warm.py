"""docs/choosing.md's section on the warm-started speech model, from small CSVs made here: each gap as a share of
grpo's mean gain, the correlation on-policy (step 1) and stale (from step 3), and a verdict read from the intervals."""

from __future__ import annotations

import csv

from maspo_verl import choosing


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_warm_section_reads_the_study(tmp_path):
    folder = tmp_path / choosing.RESULTS / choosing.WARM
    run = {"task": "speechwarm", "cell": "L96/stale2/U4", "ok": "True"}
    _write(
        folder / "learn_runs.csv",
        [
            run | {"loss": "grpo", "seed": 0, "band": "4", "first_reward": 0.3, "gain": 0.1},
            run | {"loss": "grpo", "seed": 1, "band": "4", "first_reward": 0.4, "gain": 0.3},
            run | {"loss": "gspo", "seed": 0, "band": "inf", "first_reward": 0.3, "gain": 0.2},
        ],
    )
    cmp = {"task": "speechwarm", "cell": "L96/stale2/U4", "comparison": "vs_grpo", "vs": "grpo"}
    _write(
        folder / "learn_compare.csv",
        [
            cmp
            | {"loss": "gspo", "metric": "final_reward", "seeds": 2, "diff": 0.05, "low": 0.01, "high": 0.09}
            | {"interval_excludes_0": "True"},
            cmp
            | {"loss": "gspo", "metric": "mean_reward", "seeds": 2, "diff": 9, "low": 9, "high": 9}
            | {"interval_excludes_0": "True"},
        ],
    )
    steps = [
        {"loss": loss, "step": step, "actor/ratio/vif15": v, "actor/ratio/vif50": 2 * v}
        for loss, step, v in (("grpo", 1, 1.0), ("grpo", 3, 2.0), ("grpo", 4, 4.0), ("gspo", 1, 1.5), ("gspo", 5, 5))
    ]
    _write(folder / "learn_steps.csv", steps)
    text = "\n".join(choosing.warm_section(tmp_path))
    assert "`grpo` goes from 0.350 at step 1 by +0.200 (mean over 2 seeds)" in text
    # gspo: +0.05 of a 0.2 gain = +0.25 [+0.05, +0.45]; VIF(15) step 1 1.5, stale 5, VIF(50) stale 10
    assert "| `gspo` | inf | **+0.050 [+0.010, +0.090]** | +0.25 [+0.05, +0.45] | 2 | 1.50 | 5.00 | 10.00 |" in text
    assert "| `grpo` | 4 | — | — | 2 | 1.00 | 3.00 | 6.00 |" in text
    assert "`gspo` ends above `grpo` (+25% of grpo's gain, interval excludes 0)" in text
    assert "2 seeds paired (under 5" in text
    assert "+9.000" not in text  # only the final reward is compared
    assert choosing.warm_section(tmp_path / "empty") == []
