"""``lab adaptive``'s comparison on runs whose answer is known: the best fixed window is chosen on the tuning seeds
(not the held-out ones), each preset at its own tuned band, and adaptive judged against that window and grpo on the
held-out seeds, paired by seed; each adaptive variant judged on its own; on the warm-started model, the window
chosen on the tuning runs."""

from __future__ import annotations

import pytest

from maspo_verl.lab.studies.adaptive import best_window, grid_rows, warm_rows

W2, W4 = "maspo_fixed@segment_window=2", "maspo_fixed@segment_window=4"
# (loss, band) -> final reward on the tuning seeds 0-1 and on the held-out seeds 2-3
FINAL = {
    ("grpo", "1"): (0.50, 0.50),
    ("grpo", "4"): (0.40, 0.40),
    (W2, "1"): (0.55, 0.55),
    (W2, "4"): (0.50, 0.50),
    (W4, "1"): (0.30, 0.30),
    (W4, "4"): (0.60, 0.45),  # best on the tuning seeds, worse than W2 on the held-out ones
    ("maspo_adaptive", "1"): (0.52, 0.52),
    ("maspo_adaptive", "4"): (0.30, 0.30),
}


def runs() -> list[dict]:
    out = []
    for (loss, band), (tune, held) in FINAL.items():
        for seed in range(4):
            final = (tune if seed < 2 else held) + 0.01 * seed  # a seed effect shared by every preset
            adaptive = loss == "maspo_adaptive"
            out.append(
                {"task": "speech", "cell": "L96/none/U4", "loss": loss, "band": band, "seed": str(seed),
                 "final_reward": str(final), "ppo_kl": "0.01", "adaptive_len": "1.5" if adaptive else "nan",
                 "adaptive_vif": "1.2" if adaptive else "nan", "drift_vif15": "1.3" if loss == "grpo" else "nan"}
            )  # fmt: skip
    return out


def test_the_best_window_is_chosen_on_tuning_seeds_and_adaptive_judged_on_held_out_ones():
    (row,) = grid_rows(runs(), tune=2)
    assert (row["best_window"], row["best_window_band"], row["adaptive_band"]) == (4, "4", "1")
    assert row["vs_fixed"] == pytest.approx(0.52 - 0.45) and row["within"]
    assert row["vs_fixed_low"] == pytest.approx(0.07) and row["vs_fixed_high"] == pytest.approx(0.07)
    assert row["vs_grpo"] == pytest.approx(0.02) and row["seeds"] == 2
    assert (row["adaptive_len"], row["adaptive_vif"], row["drift_vif15"]) == (1.5, 1.2, 1.3)


def test_adaptive_below_the_best_window_is_not_within():
    rows = [dict(r) for r in runs()]
    for r in rows:
        if r["loss"] == "maspo_adaptive" and int(r["seed"]) >= 2:
            r["final_reward"] = str(float(r["final_reward"]) - 0.2)
    (row,) = grid_rows(rows, tune=2)
    assert row["vs_fixed"] == pytest.approx(0.32 - 0.45) and not row["within"]


def test_each_adaptive_variant_is_judged_at_its_own_band():
    """A variant (the other criterion) with other finals: a row of its own, its own band and difference."""
    variant = "maspo_adaptive@adaptive_criterion=correlation"
    rows = runs()
    rows += [dict(r, loss=variant, band={"1": "4", "4": "1"}[r["band"]]) for r in rows if r["loss"] == "maspo_adaptive"]
    shipped, other = grid_rows(rows, tune=2)
    assert (shipped["adaptive"], other["adaptive"]) == ("maspo_adaptive", variant)
    assert (shipped["adaptive_band"], other["adaptive_band"]) == ("1", "4")
    assert other["vs_fixed"] == pytest.approx(0.52 - 0.45) and other["best_window"] == 4


def learn_runs(finals: dict[str, list[float]], first_seed: int = 0) -> list[dict]:
    return [
        {
            "loss": loss,
            "seed": str(first_seed + i),
            "ok": "True",
            "final_reward": str(v),
            "actor/ratio/adaptive_len": "3",
        }
        for loss, values in finals.items()
        for i, v in enumerate(values)
    ]


def test_the_warm_model_window_is_chosen_on_the_tuning_runs_and_judged_on_held_out_ones():
    tuning = learn_runs({W2: [0.5, 0.6], W4: [0.7, 0.6], "maspo_fixed@segment_window=8": [0.6, 0.7]}, 100)
    assert best_window(tuning) == W4  # ties (W4, W8 at 0.65): the shorter
    held = learn_runs({"grpo": [0.4, 0.5, 0.6], W4: [0.5, 0.5, 0.5], W2: [0.9, 0.9, 0.9], "maspo_adaptive": [0.6] * 3})
    (row,) = warm_rows(held, tuning)
    assert row["best_window"] == 4 and row["seeds"] == 3 and row["adaptive_len"] == 3.0
    assert row["vs_fixed"] == pytest.approx(0.1) and row["within"]  # W2's better held-out runs do not count
    assert row["vs_grpo"] == pytest.approx(0.1)
    # differences 0.2, 0.1, 0.0: sd 0.1, t(0.975, 2) = 4.302653 by table; sign flips: |±0.2 ± 0.1| >= 0.3 in 4 of 8
    half = 4.302653 * 0.1 / 3**0.5
    assert row["vs_grpo_low"] == pytest.approx(0.1 - half) and row["vs_grpo_high"] == pytest.approx(0.1 + half)
    assert row["vs_grpo_p"] == pytest.approx(0.5)
