"""docs/choosing.md's section on the warm-started speech model, from small CSVs made here: each preset's KL per
update and paired test against grpo, the correlation on-policy (step 1) and stale (from step 3), where its bands
and grpo's learning rate came from, and tuning seeds kept apart from held-out ones."""

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
    run = {"task": "speechwarm", "cell": "L96/stale2/U4", "ok": "True", "collapse": ""}
    _write(
        folder / "learn_runs.csv",
        [
            run | {"loss": "grpo", "seed": 0, "band": "4", "first_reward": 0.3, "gain": 0.1, "final_reward": 0.4}
            | {"mean_ppo_kl": 0.3},
            run | {"loss": "grpo", "seed": 1, "band": "4", "first_reward": 0.4, "gain": 0.3, "final_reward": 0.7}
            | {"mean_ppo_kl": 0.1},
            run | {"loss": "gspo", "seed": 0, "band": "inf", "first_reward": 0.3, "gain": 0.2, "final_reward": 0.5}
            | {"mean_ppo_kl": 0.05, "collapse": "drop"},
        ],
    )  # fmt: skip
    cmp = {"task": "speechwarm", "cell": "L96/stale2/U4", "comparison": "vs_grpo", "vs": "grpo"}
    _write(
        folder / "learn_compare.csv",
        [
            cmp
            | {"loss": "gspo", "metric": "final_reward", "seeds": 2, "diff": 0.05, "low": 0.01, "high": 0.09}
            | {"interval_excludes_0": "True", "p_signflip": 0.5},
            cmp
            | {"loss": "gspo", "metric": "mean_reward", "seeds": 2, "diff": 9, "low": 9, "high": 9}
            | {"interval_excludes_0": "True", "p_signflip": 0.5},
        ],
    )
    _write(
        folder / "initial.csv",
        [{"model": "warm", "seed": s, "reward": r} for s, r in ((0, 0.2), (2, 0.4), (100, 0.9))],
    )
    _write(folder / "windows_tuning" / "learn_runs.csv", [{"loss": "maspo_fixed", "seed": 100}])
    _write(
        folder / "tuning.csv",
        [
            {"loss": "grpo", "seed": 100, "lr": lr, "steps": 20, "gain": g}
            for lr, g in (("1e-3", 0.3), ("2e-3", 0.1), ("3e-3", -0.1))
        ],
    )
    grid = tmp_path / choosing.RESULTS / choosing.TUNED / "tuned_choice.csv"
    _write(grid, [{"cell": "L96/stale2/U4", "loss": "grpo", "best_band": "4"}])
    steps = [
        {"loss": loss, "step": step, "actor/ratio/vif15": v, "actor/ratio/vif50": 2 * v}
        for loss, step, v in (("grpo", 1, 1.0), ("grpo", 3, 2.0), ("grpo", 4, 4.0), ("gspo", 1, 1.5), ("gspo", 5, 5))
    ]
    _write(folder / "learn_steps.csv", steps)
    text = "\n".join(choosing.warm_section(tmp_path))
    assert "`grpo` goes from 0.350 at step 1 by +0.200 (mean over 2 seeds)" in text
    # held-out seeds 0, 2 (reward 0.3) apart from tuning seed 100 (0.9)
    assert "| warm | held-out 0, 2 | 0.300 |" in text and "| warm | tuning 100 | 0.900 |" in text
    # gspo: KL 0.05, one collapse, the compare row's interval and p; VIF(15) step 1 1.5, stale 5
    assert "| `gspo` | inf | 0.050 | 1 | **+0.050 [+0.010, +0.090]** | 0.5000 | 1.50 | 5.00 |" in text
    assert "| `grpo` | 4 | 0.200 | 0 | — | — | 1.00 | 3.00 |" in text
    assert "Mean KL per update, lowest first: `gspo` 0.050, `grpo` 0.200" in text
    assert "lr 0.001 gain +0.300, lr 0.002 gain +0.100, lr 0.003 gain -0.100" in text
    assert "(the lowest value tried: the range does not reach below it)" in text
    assert "`grpo` x4 (the choice of `regimes_tuned` in L96/stale2/U4)" in text
    assert "`gspo` xinf (not a grid choice in this cell)" in text
    assert "+9.000" not in text  # only the final reward is compared
    assert choosing.warm_section(tmp_path / "empty") == []
