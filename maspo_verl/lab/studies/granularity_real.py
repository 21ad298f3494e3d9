"""Part 5 of the registered granularity study (docs/results/granularity/PREREGISTRATION.md, "Part 5"):
SmolLM2-135M-Instruct on the worked arithmetic task in verl's trainer with verl's vLLM rollout, two regimes (N: one
Adam update a batch; S: 2 mini-batches x 2 PPO epochs), arms ``grpo``, W = 16 and ``gspo``.

``python -m maspo_verl.lab.granularity_real [--out DIR | --update-docs] [--gate] [--pieces N] [--report]``

- ``--gate`` first: one registered run of regime S at a seed no study uses; ``--pieces`` refuses to run until a
  gate run has cost at most ``GATE_CPU_S`` CPU-s (the budget's share of a run).
- Pieces, in the registered order: every tuning piece (one arm at one learning rate in one regime, seeds 600-601),
  then the edge pieces of choices at an end of the grid, then ``choice.csv``, then the held-out pieces (one arm at
  its chosen rate, the regime's held-out seeds; S before N), then K5's (``k5_pieces``) while the budget has room.
  A piece's runs go to ``pieces/<piece>/runs.csv``, one row as each run ends; a piece runs only its missing seeds
  (resumable).
- Each run is one ``python -m maspo_verl.main local=cpu ...`` through the lab's runner (``runs.run_local``); its row
  holds the primary outcome (greedy validation accuracy after the last step), the diagnostics (KL per update, clip
  fraction, VIF(15), engine mismatch), the hash of its step-1 prompts (the pairing check), its CPU-s and rollout.
- The report: ``choice.csv``, ``matched_kl.csv``, ``tests.csv`` (families S5, N5 and K5: a sharing arm minus
  ``grpo``, paired by seed; t-interval, exact sign-flip p, TOST at ``MARGIN``, Holm within each family),
  ``pairing.csv``, ``arms.csv`` and ``README.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from maspo_verl.lab.engine import journal, stats, tuning
from maspo_verl.lab.engine.common import default_out, finite_mean, markdown_table, read_csv, write_csv
from maspo_verl.lab.engine.presets import BASELINE

FOLDER = "granularity/real"
STEPS, BATCH, N = 16, 4, 4  # steps a run, problems a step, answers a problem
LENGTH, PROMPT = 192, 256  # data.max_response_length, data.max_prompt_length
TASK = ("maspo.arith.form=worked", "maspo.arith.steps=2", "maspo.arith.max_operand=5")
ARMS = {
    "grpo": ("loss=grpo",),
    "W16": ("loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.segment_window=16"),
    "gspo": ("loss=gspo",),
}
TUNE_SEEDS = (600, 601)
MARGIN = 0.08  # TOST margin, greedy accuracy (10 of 128 problems)
ACCURACY = "val-core/maspo_arith_worked/acc/mean@1"
ENGINE = "vllm"
BUDGET_CPU_S = 20 * 3600  # the registered budget: about 20 CPU-hours
GATE_SEED, GATE_CPU_S = 950, 600  # the cost gate's run (no study's seed) and the budget's share of a run
LADDER = ("1e-7", "3e-7", "1e-6", "3e-6", "1e-5", "3e-5", "1e-4", "3e-4", "1e-3")  # half-decades: an edge's next


@dataclass(frozen=True)
class Regime:
    name: str
    mini_batches: int
    epochs: int
    lrs: tuple[str, ...]
    held: tuple[int, ...]
    family: str


REGIMES = {
    "S": Regime("S", 2, 2, ("1e-5", "3e-5", "1e-4"), tuple(range(700, 716)), "S5"),
    "N": Regime("N", 1, 1, ("1e-6", "3e-6", "1e-5"), tuple(range(700, 708)), "N5"),
}


@dataclass(frozen=True)
class Piece:
    phase: str  # tune | held
    regime: str
    arm: str
    lr: str
    seeds: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.phase}_{self.regime}_{self.arm}_lr{self.lr}"


def overrides(regime: str, arm: str, lr: str, seed: int, run_dir: Path) -> list[str]:
    """The registered command's overrides of one run."""
    r = REGIMES[regime]
    return [
        "model=smollm2",
        *ARMS[arm],
        "maspo.local_dtype=fp32",
        f"actor_rollout_ref.rollout.name={ENGINE}",
        "algorithm.rollout_correction.bypass_mode=true",
        *TASK,
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={LENGTH}",
        f"data.train_batch_size={BATCH}",
        f"actor_rollout_ref.rollout.n={N}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH // r.mini_batches}",
        f"actor_rollout_ref.actor.ppo_epochs={r.epochs}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.total_epochs=1",
        f"trainer.test_freq={STEPS}",
        f"data.seed={seed}",
        f"maspo.local_seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        f"trainer.experiment_name=part5_{regime}_{arm}",
    ]


def first_prompts(run_dir: Path) -> str:
    """12 hex digits of the sorted step-1 prompts verl dumped (``rollouts/1.jsonl``); "" where there are none."""
    path = Path(run_dir) / "rollouts" / "1.jsonl"
    if not path.is_file():
        return ""
    prompts = sorted(json.loads(line)["input"] for line in path.read_text().splitlines() if line.strip())
    return hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:12]


def run_row(result, piece: Piece, seed: int) -> dict:
    """One run's row: the outcome, the diagnostics averaged over its steps, the pairing hash and its cost."""
    from maspo_verl.local import engine_of

    steps = result.steps
    last = steps.get(max(steps), {}) if steps else {}

    def mean(key: str) -> float:
        return finite_mean(m.get(key) for m in steps.values())

    rollout = engine_of(result.log) or ""
    accuracy = last.get(ACCURACY, math.nan)
    return {
        "regime": piece.regime,
        "arm": piece.arm,
        "lr": piece.lr,
        "seed": seed,
        "ok": result.returncode == 0 and rollout == ENGINE and len(steps) == STEPS and math.isfinite(accuracy),
        "accuracy": accuracy,
        "first_reward": steps.get(1, {}).get("critic/score/mean", math.nan),
        "mean_reward": mean("critic/score/mean"),
        "ppo_kl": mean("actor/ppo_kl"),
        "clipfrac": mean("actor/pg_clipfrac"),
        "vif15": mean("actor/ratio/vif15"),
        "mismatch_rms": mean("actor/engine_mismatch/rms"),
        "length": mean("response_length/mean"),
        "first_prompts": first_prompts(result.run_dir),
        "steps": len(steps),
        "rollout": rollout,
        "cpu_s": result.cpu_s,
        "wall_s": result.wall_s,
    }


def piece_rows(out: Path, piece: Piece) -> list[dict]:
    return read_csv(Path(out) / "pieces" / piece.name / "runs.csv")


def run_piece(out: Path, piece: Piece, runner: Callable | None = None, timeout_s: float = 3600) -> list[dict]:
    """Run the piece's seeds that have no row yet, one at a time, each row written as its run ends."""
    from maspo_verl.lab.engine.runs import local_command, run_local

    runner = runner or run_local
    folder = Path(out) / "pieces" / piece.name
    rows = read_csv(folder / "runs.csv")
    done = {int(r["seed"]) for r in rows}
    for seed in (s for s in piece.seeds if s not in done):
        run_dir = folder / f"seed{seed}"
        ov = overrides(piece.regime, piece.arm, piece.lr, seed, run_dir)
        journal.again(folder, local_command(ov, run_dir), how=f"seed {seed}")
        result = runner(ov, run_dir, timeout_s=timeout_s)
        rows.append(run_row(result, piece, seed))
        write_csv(folder / "runs.csv", rows)
        if rows[-1]["ok"]:  # its row holds what the study reads; a failed run's folder stays to be read
            shutil.rmtree(run_dir, ignore_errors=True)
        journal.note(folder, f"  {journal.load()}")
    return rows


# ------------------------------------------------------------------ the choice


def edge_lr(lr: str, up: bool) -> str:
    """The rate one half-decade beyond ``lr`` (``LADDER``)."""
    i = LADDER.index(lr) + (1 if up else -1)
    if not 0 <= i < len(LADDER):
        raise SystemExit(f"learning rate {lr}: no rate beyond it in {LADDER}")
    return LADDER[i]


def tuning_means(rows: list[dict], regime: str, arm: str) -> dict[str, float]:
    """Per rate, the mean primary outcome over the tuning seeds (only rates whose every tuning run is ok)."""
    out = {}
    for lr in {r["lr"] for r in rows if (r["regime"], r["arm"]) == (regime, arm)}:
        mine = [r for r in rows if (r["regime"], r["arm"], r["lr"]) == (regime, arm, lr) and r["ok"] in (True, "True")]
        if {int(r["seed"]) for r in mine} >= set(TUNE_SEEDS):
            out[lr] = finite_mean(float(r["accuracy"]) for r in mine if int(r["seed"]) in TUNE_SEEDS)
    return out


def choose(rows: list[dict], regime: str, arm: str) -> tuple[dict | None, str | None]:
    """(the choice, or None) and the edge rate still to run (or None): the best tuning mean (ties: the smaller
    rate); a choice at an end of the grid asks once for the rate beyond it, then is chosen again."""
    grid = REGIMES[regime].lrs
    means = tuning_means(rows, regime, arm)
    if not set(grid) <= set(means):
        return None, None
    tried = sorted(means, key=float)
    best = tuning.best(means)
    extended = [lr for lr in tried if lr not in grid]
    if not extended and best in (grid[0], grid[-1]):
        return None, edge_lr(best, up=best == grid[-1])
    choice = {
        "regime": regime,
        "arm": arm,
        "lr": best,
        "tune_accuracy": means[best],
        "tune_kl": tuning_kl(rows, regime, arm, best),
        "rates_tried": " ".join(tried),
        "bracketed": tried[0] != best != tried[-1],
    }
    return choice, None


def tuning_kl(rows: list[dict], regime: str, arm: str, lr: str) -> float:
    return finite_mean(
        float(r["ppo_kl"]) for r in rows if (r["regime"], r["arm"], r["lr"]) == (regime, arm, lr) and r["ppo_kl"] != ""
    )


def matched_kl(rows: list[dict], choices: list[dict]) -> list[dict]:
    """Per sharing arm, the rate whose tuning KL per update is nearest in log to ``grpo``'s at its chosen rate."""
    out = []
    for c in choices:
        base = next((b for b in choices if (b["regime"], b["arm"]) == (c["regime"], BASELINE)), None)
        target = float(base["tune_kl"]) if base else math.nan
        if c["arm"] == BASELINE or not target > 0:
            continue
        rates = {lr: tuning_kl(rows, c["regime"], c["arm"], lr) for lr in c["rates_tried"].split()}
        lr = tuning.nearest_kl(rates, target)
        out.append({"regime": c["regime"], "arm": c["arm"], "chosen_lr": c["lr"], "matched_lr": lr})
    return out


# ------------------------------------------------------------------ the pieces in order


def next_pieces(out: Path) -> list[Piece]:
    """The pieces not yet done, in the registered order; held-out pieces only once every choice is made."""
    rows = tuning_rows(out)
    todo, choices = [], []
    for regime in REGIMES:
        for arm in ARMS:
            for lr in REGIMES[regime].lrs:
                p = Piece("tune", regime, arm, lr, TUNE_SEEDS)
                if not covered(out, p):
                    todo.append(p)
            choice, edge = choose(rows, regime, arm)
            if edge:
                todo.append(Piece("tune", regime, arm, edge, TUNE_SEEDS))
            elif choice:
                choices.append(choice)
    if todo or len(choices) < len(REGIMES) * len(ARMS):
        return todo
    write_csv(Path(out) / "choice.csv", choices)
    held = [Piece("held", c["regime"], c["arm"], c["lr"], REGIMES[c["regime"]].held) for c in choices]
    todo = [p for p in held if not covered(out, p)]
    return todo or [p for p in k5_pieces(out, rows, choices) if not covered(out, p)]


def k5_pieces(out: Path, tuning: list[dict], choices: list[dict]) -> list[Piece]:
    """Family K5's pieces (regime S): each sharing arm whose chosen rate differs from ``grpo``'s, at its matched
    rate, while the budget has room for all its runs (at the mean CPU-s of a run so far)."""
    base = next(c["lr"] for c in choices if (c["regime"], c["arm"]) == ("S", BASELINE))
    seeds = REGIMES["S"].held
    pieces = [
        Piece("held", "S", m["arm"], m["matched_lr"], seeds)
        for m in matched_kl(tuning, choices)
        if m["regime"] == "S" and m["chosen_lr"] != base and m["matched_lr"]
    ]
    cost = [float(r["cpu_s"]) for r in all_rows(out, gate=True) if r["cpu_s"] != ""]
    spent, per_run = sum(cost), finite_mean(cost)
    room = []
    for p in pieces:
        missing = len(set(seeds) - {int(r["seed"]) for r in piece_rows(out, p)})
        if spent + missing * per_run <= BUDGET_CPU_S:
            spent += missing * per_run
            room.append(p)
    return room


def covered(out: Path, piece: Piece) -> bool:
    return {int(r["seed"]) for r in piece_rows(out, piece)} >= set(piece.seeds)


def all_rows(out: Path, gate: bool = False) -> list[dict]:
    """Every run on disk, its piece's phase added (the cost gate's run only with ``gate``)."""
    rows = []
    for path in sorted((Path(out) / "pieces").glob("*/runs.csv")):
        phase = path.parent.name.split("_", 1)[0]
        rows += [r | {"phase": phase} for r in read_csv(path)] if gate or phase != "gate" else []
    return rows


def tuning_rows(out: Path) -> list[dict]:
    return [r for r in all_rows(out) if r["phase"] == "tune"]


# ------------------------------------------------------------------ the tests


def pairing(rows: list[dict]) -> list[dict]:
    """Per regime and held-out seed: whether every arm's step-1 prompts are the same."""
    out = []
    for regime in REGIMES:
        for seed in REGIMES[regime].held:
            mine = {r["arm"]: r["first_prompts"] for r in rows if r["regime"] == regime and int(r["seed"]) == seed}
            if mine:
                same = len(set(mine.values())) == 1 and "" not in mine.values()
                out.append({"regime": regime, "seed": seed, "arms": len(mine), "same": same})
    return out


def tests(rows: list[dict], choices: list[dict]) -> list[dict]:
    """Families S5 and N5 (each sharing arm minus ``grpo``, each at its chosen rate) and K5 (in S, a sharing arm
    whose chosen rate differs from ``grpo``'s, at its matched rate, minus ``grpo``), on the held-out seeds where
    the two arms' step-1 prompts agree, paired by seed; Holm within each family (difference and equivalence apart)."""
    pick = {(c["regime"], c["arm"]): c["lr"] for c in choices}
    tuning = [x for x in rows if x["phase"] == "tune"]
    base = pick.get(("S", BASELINE))
    matched = [m for m in matched_kl(tuning, choices) if m["regime"] == "S" and m["chosen_lr"] != base]
    comparisons = [
        *((r.family, regime, arm, pick.get((regime, arm))) for regime, r in REGIMES.items() for arm in ARMS),
        *(("K5", "S", m["arm"], m["matched_lr"]) for m in matched),
    ]
    out = []
    for family, regime, arm, lr in (c for c in comparisons if c[2] != BASELINE):
        held = [x for x in rows if x["phase"] == "held" and x["regime"] == regime and x["ok"] in (True, "True")]
        runs = {(x["arm"], x["lr"], int(x["seed"])): x for x in held}
        mine, theirs = (arm, lr), (BASELINE, pick.get((regime, BASELINE)))
        pairs = [(runs.get((*mine, s)), runs.get((*theirs, s))) for s in REGIMES[regime].held]
        # the pairing check: both runs there, with the same step-1 prompts
        pairs = [(x, y) for x, y in pairs if x and y and x["first_prompts"] == y["first_prompts"] != ""]
        d = [float(x["accuracy"]) - float(y["accuracy"]) for x, y in pairs]
        row = {"family": family, "regime": regime, "arm": arm, "lr": lr, "vs": BASELINE, "vs_lr": theirs[1]}
        none = {"seeds": len(d), "p_signflip": 1.0, "p_tost": 1.0}  # not run yet: p = 1 in its Holm
        out.append(row | (stats.paired_summary(d, MARGIN) if len(d) >= 2 else none))
    stats.holm_by(out, "family", "p_signflip", "p_holm")
    stats.holm_by(out, "family", "p_tost", "p_tost_holm")
    for row in out:
        row["different"] = row["p_holm"] < 0.05
        row["equivalent"] = row["p_tost_holm"] < 0.05
    return out


# ------------------------------------------------------------------ the report


def arms_table(rows: list[dict], choices: list[dict]) -> list[dict]:
    """Per regime and arm at its chosen rate, held out: the outcome, the diagnostics and the cost of a run."""
    out = []
    for c in choices:
        mine = [
            r
            for r in rows
            if r["phase"] == "held" and (r["regime"], r["arm"], r["lr"]) == (c["regime"], c["arm"], c["lr"])
        ]
        ok = [r for r in mine if r["ok"] in (True, "True")]
        keys = ("accuracy", "first_reward", "ppo_kl", "vif15", "mismatch_rms", "length", "cpu_s")
        out.append(
            {"regime": c["regime"], "arm": c["arm"], "lr": c["lr"], "runs": f"{len(ok)}/{len(mine)}"}
            | {k: finite_mean(float(r[k]) for r in ok if r[k] != "") for k in keys}
        )
    return out


def report(out: Path) -> None:
    out = Path(out)
    left = next_pieces(out)  # writes choice.csv once every tuning piece is done
    rows = all_rows(out)
    choices = read_csv(out / "choice.csv")
    tables = {
        "choice.csv": choices,
        "matched_kl.csv": matched_kl(rows, choices),
        "pairing.csv": pairing(rows),
        "tests.csv": tests(rows, choices) if choices else [],
        "arms.csv": arms_table(rows, choices),
    }
    for name, table in tables.items():
        if table:
            write_csv(out / name, table)
    pieces = len({(r["phase"], r["regime"], r["arm"], r["lr"]) for r in rows})
    lines = [
        "# Granularity, part 5: sharing a ratio on SmolLM2-135M in two regimes",
        "",
        'The protocol is [`PREREGISTRATION.md`](../PREREGISTRATION.md) ("Part 5"), committed before any of these '
        "runs. Made by `python -m maspo_verl.lab.granularity_real` (`maspo_verl/lab/studies/granularity_real.py`); "
        "each "
        "piece's command, versions and load are in its folder's `COMMAND.txt`.",
        "",
        f"**Status**: {pieces} pieces on disk ({len(rows)} runs, "
        f"{sum(r['ok'] not in (True, 'True') for r in rows)} failed); choice "
        f"{'written' if choices else 'not written yet'}; pieces left: {len(left)}.",
        "",
    ]
    for name, title in (
        ("tests.csv", "Tests (families S5, N5 and K5, held out, paired by seed)"),
        ("arms.csv", "Each arm at its chosen learning rate, held out"),
        ("choice.csv", "The learning rates chosen on the tuning seeds"),
        ("matched_kl.csv", "Matched KL per update (tuning seeds)"),
        ("pairing.csv", "The pairing check: the same step-1 prompts for every arm of a seed"),
    ):
        if tables[name]:
            lines += [f"## {title}", "", markdown_table(tables[name])]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def gate(out: Path, runner: Callable | None = None) -> dict:
    """The cost gate before the first piece: one registered run of regime S (``grpo`` at 3e-5, seed
    ``GATE_SEED``), its CPU-s against ``GATE_CPU_S``, written to ``gate.csv`` and the journal."""
    piece = Piece("gate", "S", BASELINE, "3e-5", (GATE_SEED,))
    row = run_piece(out, piece, runner)[-1]
    row["cpu_s_allowed"] = GATE_CPU_S
    row["passed"] = row["ok"] in (True, "True") and float(row["cpu_s"]) <= GATE_CPU_S
    write_csv(Path(out) / "gate.csv", [row])
    journal.note(out, f"cost gate: {float(row['cpu_s']):.0f} CPU-s (allowed {GATE_CPU_S}), passed: {row['passed']}")
    return row


def gate_passed(out: Path) -> bool:
    return any(r["passed"] == "True" for r in read_csv(Path(out) / "gate.csv"))


def main(argv: list[str] | None = None, runner: Callable | None = None) -> None:
    import sys

    p = argparse.ArgumentParser(prog="python -m maspo_verl.lab.granularity_real", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help=f"output folder (default {default_out(FOLDER)})")
    p.add_argument("--update-docs", action="store_true", help=f"write {default_out(FOLDER, update_docs=True)}")
    p.add_argument("--pieces", type=int, default=0, help="run the next N pieces (0: none)")
    p.add_argument("--report", action="store_true", help="write the report from the runs on disk")
    p.add_argument("--gate", action="store_true", help=f"run the cost gate (a run must cost <= {GATE_CPU_S} CPU-s)")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    out = Path(args.out) if args.out else default_out(FOLDER, args.update_docs)
    if args.gate:
        journal.again(out, ["python -m maspo_verl.lab.granularity_real", *argv], how="cost gate")
        gate(out, runner)
    if args.pieces and not gate_passed(out):
        raise SystemExit(
            f"{out}: no passed cost gate (gate.csv): run --gate first; a run must cost <= {GATE_CPU_S} CPU-s"
        )
    for _ in range(args.pieces):
        todo = next_pieces(out)
        if not todo:
            break
        piece = todo[0]
        journal.again(out, ["python -m maspo_verl.lab.granularity_real", *argv], how=f"piece {piece.name}")
        run_piece(out, piece, runner)
    if args.report or args.pieces:
        report(out)


if __name__ == "__main__":
    main()
