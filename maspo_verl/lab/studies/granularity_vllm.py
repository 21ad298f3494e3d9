"""Part 4 of the registered granularity study (docs/results/granularity/PREREGISTRATION.md, "Part 4" and its
amendment): SmolLM2-135M-Instruct learning arithmetic in verl's trainer with verl's vLLM rollout, exploratory
(under-powered). Pieces, resuming, the choice written before the held-out seeds and the pieces and tuning tables
are part 2's engine (``granularity_warm``) read through this part's ``Part``; the tests are part 1's
(``granularity.tests``) on this part's ``Design``.

``python -m maspo_verl.lab granularity --part 4 --phase tune|held|all [--resume] [--pieces N] [--report]``

- Arms: ``grpo`` (verl's token ratio, its own code path), W = 1 (``maspo_fixed@segment_window=1``: token
  granularity through our code path) and W = whole (one ratio per response: the window of the model config's
  ``data.max_response_length``), the H1 winner of part 1 by the registered rule (``part1_winner``: the part
  refuses to start where that rule gives another window).
- ``--phase tune``: every arm at every lr of ``LRS`` on seeds 400-401 (9 pieces); then ``choice.csv``: each arm's
  lr with the best tuning mean of the training reward over steps 1-20 (ties: the smaller).
- ``--phase held``: refuses without ``choice.csv``; then every arm at its chosen lr on seeds 500-503 (3 pieces).
- Family P4: W = whole minus W = 1 and W = 1 minus grpo, paired by seed: 95 % t-interval, exact sign-flip p (4
  seeds: never below 1/8, so no difference can pass), TOST at ±``MARGIN``, Holm within P4.
"""

from __future__ import annotations

import statistics
from functools import cache
from pathlib import Path

from maspo_verl.lab.engine import journal, runs, stats
from maspo_verl.lab.engine import pieces as piecewise
from maspo_verl.lab.engine import protocol as reg
from maspo_verl.lab.engine.cells import NO_MISMATCH
from maspo_verl.lab.engine.common import finite_mean, markdown_table, read_csv, write_tables
from maspo_verl.lab.engine.presets import BASELINE
from maspo_verl.lab.engine.study import Study
from maspo_verl.local.learn_tasks import PRETRAINED
from maspo_verl.pretrained import arith

STUDY = Study(
    None,
    "part 4 (exploratory) of the granularity study: SmolLM2-135M RL on the vLLM rollout",
    folder="granularity/vllm",
    writes=(
        "README.md",
        "tests.csv",
        "secondary.csv",
        "arms.csv",
        "pieces.csv",
        "tuning.csv",
        "design.csv",
        "tests.png",
    ),
    tune_seeds=(400, 401),
    held_seeds=tuple(range(500, 504)),
)

FOLDER = STUDY.folder
TUNE_SEEDS, HELD_SEEDS = STUDY.tune_seeds, STUDY.held_seeds
TASK = PRETRAINED  # lab learn --tasks smollm2: model=smollm2 on its arithmetic task, the data from the seed


@cache
def _config(group: str, name: str) -> dict:
    from omegaconf import OmegaConf

    from maspo_verl.util import config_dir

    return OmegaConf.to_container(OmegaConf.load(config_dir() / group / f"{name}.yaml"))


# the model config's answers and the local mode's batch, as `local=cpu model=smollm2` runs them
LENGTH = int(_config("model", PRETRAINED)["data"]["max_response_length"])
BATCH = int(_config("local", "cpu")["data"]["train_batch_size"])  # problems a step
N = int(_config("local", "cpu")["actor_rollout_ref"]["rollout"]["n"])  # answers a problem
UPDATES = BATCH // int(_config("local", "cpu")["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"])  # Adam steps
STEPS = 20
CELL = f"L{LENGTH}/{NO_MISMATCH}/U{UPDATES}"  # lab learn's label of the cell below
# the registered lab learn command of every piece (the amendment of PREREGISTRATION.md, part 4)
LEARN = (
    "--tasks", TASK, "--cells", f"{LENGTH}/{NO_MISMATCH}/{UPDATES}", "--batch", str(BATCH), "--n", str(N),
    "--steps", str(STEPS), "--bypass", "--no-adjust", "--timeout", "3600",
)  # fmt: skip
WHOLE = f"{reg.FIXED}{LENGTH}"  # one ratio per response
ARMS = (BASELINE, reg.TOKEN, WHOLE)
LRS = ("3e-6", "1e-5", "3e-5")  # the model config's 1e-5 in the middle
METRIC = "mean_reward"  # lab learn's mean of critic/score/mean over the run's steps
MARGIN = 0.05  # TOST margin, mean training reward
ENGINE = "vllm"  # every run on verl's vLLM rollout: one the local mode moved to the transformers rollout has failed
# verl's greedy validation accuracy on the task's val split at the last step (the secondary metric)
VALIDATION = f"{runs.VALIDATION}{arith.DATA_SOURCE}/acc/mean@1"
FAMILY = "P4"
PAIRS = ((FAMILY, WHOLE, reg.TOKEN), (FAMILY, reg.TOKEN, BASELINE))
FAMILIES = {
    FAMILY: "exploratory (under-powered): W = whole minus W = 1, and W = 1 minus grpo, each at its tuned learning "
    "rate; mean training reward over steps 1-20"
}
# part 1's H1 winner, as the amendment registers it: the whole response (part 1's longest window)
REGISTERED_WINNER = max(reg.WINDOWS)


def design() -> reg.Design:
    """Part 2's learning-rate design with this part's cell, arms, seeds, metric, margin and its own pairs."""
    return reg.Design(
        task=TASK, cells=(CELL,), windows=(1, LENGTH), aligned="", controls=(), settings=LRS, knob="lr",
        smallest="lowest learning rate", tune_seeds=TUNE_SEEDS, held_seeds=HELD_SEEDS, families=FAMILIES,
        clip_is_knob=False, adaptive=(), metric=METRIC, margin=MARGIN, pairs=PAIRS, largest="highest learning rate",
    )  # fmt: skip


def part() -> piecewise.Part:
    """This part as the piece engine reads it."""
    return piecewise.Part(
        4, TASK, CELL, LEARN, ARMS, LRS, TUNE_SEEDS, HELD_SEEDS, METRIC, held_pieces, report, check, engine=ENGINE
    )


def held_pieces(choices: list[dict]) -> list[piecewise.Piece]:
    """Every arm at its chosen lr on the held-out seeds (an arm whose every tuning run failed has none)."""
    pick = {c["loss"]: c for c in choices}
    return [piecewise.Piece("held", a, pick[a]["best_band"], HELD_SEEDS) for a in ARMS if a in pick]


# ------------------------------------------------------------------ part 1's winner


def part1_winner(tests: list[dict]) -> int:
    """H1's winner of part 1 by the registered rule: the window whose F1a difference (W minus W = 1, held out) has
    the largest mean over part 1's cells (ties: the shorter). Every window must have a test run in every cell."""
    diffs: dict[int, dict[str, float]] = {}
    for t in tests:
        if t["family"] == "F1a" and t.get("seeds"):
            diffs.setdefault(int(t["arm"].removeprefix(reg.FIXED)), {})[t["cell"]] = float(t["diff"])
    missing = [w for w in reg.WINDOWS[1:] if set(diffs.get(w, {})) != set(reg.CELLS)]
    if missing:
        raise SystemExit(f"part 1's tests.csv: F1a is not run in every cell for W = {missing}: part 1 is not done")
    means = {w: statistics.fmean(d.values()) for w, d in diffs.items()}
    return max(means, key=lambda w: (means[w], -w))


def part1_tests() -> Path:
    from maspo_verl.lab.engine.common import default_out

    return default_out(reg.PART1_FOLDER, update_docs=True) / "tests.csv"


def check() -> None:
    """Refuse to start where part 1's committed tests do not give the registered winner."""
    path = part1_tests()
    if not path.is_file():
        raise SystemExit(
            f"--part 4: {path} is missing: part 4's arms follow part 1's H1 winner (run from the checkout)"
        )
    winner = part1_winner(read_csv(path))
    if winner != REGISTERED_WINNER:
        raise SystemExit(
            f"--part 4: part 1's H1 winner by the registered rule is W = {winner} ({path}), not the whole response "
            f"(W = {REGISTERED_WINNER}) that the amendment registered: the design no longer holds"
        )


# ------------------------------------------------------------------ the report


def arms_table(rows: list[dict], choices: list[dict]) -> list[dict]:
    """Per arm at its chosen lr on the held-out seeds: the primary and secondary metrics and the time of a run."""
    pick = {c["loss"]: c["best_band"] for c in choices}
    out = []
    for arm in ARMS:
        mine = [r for r in rows if (r["loss"], r["band"]) == (arm, pick.get(arm)) and r["seed"] in HELD_SEEDS]
        ok = [r for r in mine if r["ok"]]
        out.append(
            {
                "arm": arm,
                "lr": pick.get(arm, ""),
                "seeds": f"{len(ok)}/{len(HELD_SEEDS)}",
                METRIC: finite_mean(r[METRIC] for r in ok),
                "first_reward": finite_mean(r["first_reward"] for r in ok),
                "final_reward": finite_mean(r["final_reward"] for r in ok),
                "val_acc_last_step": finite_mean(r.get(VALIDATION) for r in ok),
                "s_per_step": finite_mean(r["s_per_step"] for r in ok),
                "cpu_s_per_run": finite_mean(r.get("cpu_s") for r in ok),
            }
        )
    return out


def secondary(rows: list[dict], choices: list[dict]) -> list[dict]:
    """P4's pairs on the secondary metric (greedy validation accuracy at the last step): described, not tested."""
    held = stats.held([r for r in rows if r["ok"] and VALIDATION in r], HELD_SEEDS[0])
    out = []
    for _, cell, a, b in reg.comparisons(choices, design()):
        row = stats.paired(held, TASK, cell, a, b, metric=VALIDATION) if a[1] and b[1] else {}
        summary = {k: row[k] for k in ("seeds", "diff", "low", "high") if k in row}
        out.append({"arm": a[0], "lr": a[1], "vs": b[0], "vs_lr": b[1], **summary})
    return out


def report(out: Path) -> None:
    from maspo_verl.lab.engine import common

    out = Path(out)
    p, d = part(), design()
    rows, choices, held = piecewise.on_disk(out, p)
    tests = reg.tests([r for r in rows if r["ok"]], choices, d)
    tables = {
        "tests.csv": tests,
        "secondary.csv": secondary(rows, choices),
        "arms.csv": arms_table(rows, choices),
        "pieces.csv": piecewise.pieces_table(out, piecewise.tuning_pieces(p) + held, p),
        "tuning.csv": piecewise.tuning_table(rows, choices, p),
        "design.csv": reg.design_table(d),
    }
    write_tables(out, tables)
    plotted = any(t.get("seeds") for t in tests)
    if plotted:
        reg.plot(tests, out / "tests.png", FAMILIES, MARGIN, "mean training reward")
    (out / "README.md").write_text(readme(rows, choices, tables, plotted, journal.read(out)))
    common.report_written(out)


RUNS = len(ARMS) * len(LRS) * len(TUNE_SEEDS) + len(ARMS) * len(HELD_SEEDS)
RUN_MIN = 14  # the estimate of a run: 20 steps of about 37 s and about 2 min of start-up

# how this part reads its registration (the amendment), written before any of its runs
READINGS = (
    "Exploratory (under-powered): 4 held-out seeds, so the exact two-sided sign-flip p of a difference is at least "
    "1/8 and no difference test can pass at 0.05 (Holm or not); a TOST at ±0.05 can pass. No decision rule is "
    "registered for this part: every test is reported with its outcome, and none is read as evidence for or "
    "against H1.",
    f"Every run is `python -m maspo_verl.main local=cpu model={PRETRAINED} loss=<arm>` through `lab learn "
    f"--tasks {TASK}`: verl's trainer, verl's vLLM rollout (bf16, bypass mode: the engine's log-probs are the "
    f"old log-probs), the actor's fp32 weights with verl's default bf16 compute; {BATCH} problems x {N} answers a "
    f"step at temperature 1, {UPDATES} mini-batches (Adam updates) a step, answers up to {LENGTH} tokens ending at "
    "EOS (not forced to the length); the model config's arithmetic task (one step, operands up to 5) generated "
    "from the run's seed (`maspo.local_seed`; the validation split from seed + 10000), graded by math-verify. "
    "lab learn runs each mini-batch as one micro-batch (the local config's micro-batches are smaller): the same "
    "gradient, fewer passes.",
    f"Arms as shipped (`--no-adjust`): `grpo` is verl's `vanilla` loss (ratio per token, PPO clip 0.2, dual clip "
    f"3, `token-mean`); W = 1 and W = whole are `maspo_fixed` with its window set (log-space clip exp(±0.2 "
    f"n^-1/2), `seq-mean-token-mean`). W = whole is the window of {LENGTH} tokens, the model config's "
    f"`data.max_response_length`: one ratio per answer, whatever its length. It is part 1's H1 winner by the "
    f"amendment's rule, computed from part 1's `tests.csv` at every start (the part refuses to start where the "
    f"rule gives another window).",
    f"Primary metric: a run's mean of verl's `critic/score/mean` over its {STEPS} steps (`{METRIC}` in lab learn's "
    f"`learn_runs.csv`). Secondary: verl's greedy validation accuracy on the 64 validation problems at step "
    f"{STEPS} (`{VALIDATION}`; lab learn sets `trainer.test_freq={STEPS}` for this task), described with paired "
    "t-intervals (`secondary.csv`), not tested.",
    f"The learning rate of each arm is chosen on the tuning seeds {TUNE_SEEDS[0]}-{TUNE_SEEDS[-1]}: the best mean "
    "of the primary metric over the 2 seeds, ties to the smaller rate; a choice at either end of the grid is "
    "flagged. `choice.csv` (its `tune_final`: the tuning mean of the primary metric) is written when all tuning "
    "pieces are done, before any held-out piece (which refuses to run without it).",
    f"Budget: {len(ARMS) * len(LRS)} tuning pieces ({len(ARMS) * len(LRS) * len(TUNE_SEEDS)} runs) and "
    f"{len(ARMS)} held-out pieces ({len(ARMS) * len(HELD_SEEDS)} runs): {RUNS} runs, estimated at about "
    f"{RUN_MIN} min each (20 steps of about 37 s on 2 quiet cores, docs/local.md, and about 2 min of start-up): "
    f"about {RUNS * RUN_MIN / 60:.0f} h in all, in resumable pieces; each run's time limit is 3600 s. A run "
    "takes about 6 GB and a full core: run the pieces on a machine without other heavy work.",
    "A run the trainer does not finish, or whose start-up line does not name verl's vLLM rollout (the local mode "
    "moves to the transformers rollout where vLLM cannot run, e.g. with too little free memory; lab learn's "
    "`rollout` column), stays in its piece's `learn_runs.csv`, is counted as failed in the pieces table and "
    "left out of the choice and the tests; a piece whose every run fails stops the study with the cause (part 2's "
    "rules). While P4 is partial, a test not run yet counts in its Holm correction with p = 1.",
)


def readme(rows, choices, tables, plotted: bool, command: str) -> str:
    d = design()
    pieces = tables["pieces.csv"]
    lines = [
        "# Granularity, part 4 (exploratory, under-powered): SmolLM2-135M RL through verl's vLLM rollout",
        "",
        'The protocol is [`PREREGISTRATION.md`](../PREREGISTRATION.md) ("Part 4" and its amendment of 2026-11-28), '
        "fixed before any of these runs. Made by `python -m maspo_verl.lab granularity --part 4` "
        "(`maspo_verl/lab/studies/granularity_vllm.py`, on part 2's piece engine `granularity_warm.py`; tests "
        f"`granularity.py`): `lab learn {' '.join(LEARN)}` per piece, arms {', '.join(ARMS)}, learning rates "
        f"{', '.join(LRS)} on tuning seeds {TUNE_SEEDS[0]}-{TUNE_SEEDS[-1]}, held-out seeds "
        f"{HELD_SEEDS[0]}-{HELD_SEEDS[-1]}, TOST margin ±{MARGIN} mean training reward. **Every number here is "
        "exploratory (under-powered).**",
        "",
        piecewise.status_line(pieces, choices, rows, 4),
        "",
        "## Readings of the registration (written before any run)",
        "",
        *(f"- {x}" for x in READINGS),
        "",
        *reg.family_sections(tables["tests.csv"], d),
        f"*Different*: Holm-adjusted sign-flip p < {reg.ALPHA} (with 4 seeds never); *equivalent*: Holm-adjusted TOST "
        f"p < {reg.ALPHA} with margin ±{MARGIN}; `—`: neither. Exploratory (under-powered).",
        "",
        "## Each arm at its chosen learning rate, held-out seeds",
        "",
        "Means over the held-out seeds: the primary metric, the training reward at step 1 and over the last 3 steps, "
        "greedy validation accuracy at the last step, seconds a step and CPU-seconds a run.",
        "",
        markdown_table(tables["arms.csv"]),
        "Secondary metric (greedy validation accuracy at the last step), P4's pairs described (mean and 95 % "
        "t-interval over the held-out seeds; no test):",
        "",
        markdown_table(tables["secondary.csv"]),
        "## The learning rates chosen on the tuning seeds",
        "",
        piecewise.lr_choice_table(choices)
        if choices
        else f"Not chosen yet: {sum(p['done'] for p in pieces)} of {len(piecewise.tuning_pieces(part()))} tuning "
        "pieces done; `choice.csv` is written when all are, before any held-out piece runs.\n",
        *([reg.bracket_note(choices, d), ""] if choices else []),
        f"Tuning means per arm and learning rate (`tuning.csv`; `{METRIC}`: the primary metric):",
        "",
        markdown_table(tables["tuning.csv"]),
        *piecewise.ending(
            pieces, plotted, "`tests.csv` (family P4), `secondary.csv`, `arms.csv`, `pieces.csv`, `tuning.csv`", command
        ),
    ]
    return "\n".join(lines)


def run(args, argv: list[str]) -> None:
    piecewise.run(args, argv, part())
