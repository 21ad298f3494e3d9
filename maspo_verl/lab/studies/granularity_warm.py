"""Part 2 of the registered granularity study (docs/results/granularity/PREREGISTRATION.md, "Part 2" and its
amendment of 2026-11-28 (2)): the warm-started speech model, run as resumable pieces of ``lab learn`` in the lab's
engine (``learn_engine``: the trainer run's computation in one process), checked against verl's trainer on a
registered subset (family C, ``confirmation``); its tests, Holm families, margin, decision rules and report
sections are part 1's (``granularity``), read through this part's ``Design``.
The piece engine (``Part``, ``drive``, ``run_piece``, ``on_disk`` and the pieces and tuning tables) runs part 4 too
(``granularity_vllm``).

``python -m maspo_verl.lab granularity --part 2 --phase tune|held|all [--resume] [--pieces N] [--report]``

A *piece* is one arm at one learning rate (clipped as shipped, or unclipped) on one seed group: one ``lab learn``
command, parsed by the lab CLI's own parser and run in this process (an engine run in it too, a trainer run in its
own subprocess), into ``pieces/<name>/`` with its ``learn_runs.csv``. A piece whose seeds all have a row there is
done and is skipped; a stopped piece resumes where it stopped (``lab learn --resume``). Every piece's command is
appended to the folder's ``COMMAND.txt`` with its wall and CPU time and the machine's load.

- ``--phase tune``: every arm at every lr of ``LRS`` on seeds 200-203 (32 pieces). Once all are done it writes
  ``choice.csv``: each arm's lr with the best tuning mean final reward (ties: the smaller), and the lr whose
  tuning KL per update is nearest W = 1's at its chosen lr (``tuning.choose``, part 1's rule).
- ``--phase held``: refuses without ``choice.csv``; then seeds 300-311: every arm at its chosen lr, each window
  unclipped at its chosen lr, each window at its matched-KL lr (where that differs), then the other arms
  unclipped (no registered test reads those), then the trainer's confirmation pieces (``--engine trainer``:
  W = 1 and W = 96 at their chosen lrs).
- ``--report`` (and after every piece): ``README.md``, ``tests.csv``, ``decisions.csv``, ``confirmation.csv``,
  ``pieces.csv``, ``tuning.csv``, ``cells.csv``, ``design.csv`` from what is on disk.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from maspo_verl import choosing
from maspo_verl.lab.engine import journal, learn_engine, stats
from maspo_verl.lab.engine import protocol as reg
from maspo_verl.lab.engine.common import finite_mean, markdown_table, read_csv, write_tables
from maspo_verl.lab.engine.pieces import (
    ON_TRAINER,
    Part,
    Piece,
    builds,
    ending,
    lr_choice_table,
    on_disk,
    pieces_table,
    status_line,
    tuning_pieces,
    tuning_table,
)
from maspo_verl.lab.engine.pieces import run as run_pieces
from maspo_verl.lab.engine.study import Study

WINDOWS = (1, 2, 8, 24, 96)
OFFSET = "maspo_words~offset12"  # the same window with its boundaries moved by half a word (lab/word_grid.py)
STUDY = Study(
    None,
    "part 2 of the pre-registered granularity study: the warm speech model (lab learn --engine lab, "
    "confirmed by verl's trainer)",
    folder="granularity/warm",
    writes=(
        "README.md",
        "tests.csv",
        "decisions.csv",
        "pieces.csv",
        "tuning.csv",
        "cells.csv",
        "confirmation.csv",
        "design.csv",
        "tests.png",
    ),
    arms=(*(f"{reg.FIXED}{w}" for w in WINDOWS), *reg.ADAPTIVE, OFFSET),
    cells=("L96/stale2/U4",),  # lab learn's label of --cells 96/stale2/4
    tune_seeds=tuple(range(200, 204)),
    held_seeds=tuple(range(300, 312)),
)

FOLDER = STUDY.folder
ARMS, (CELL,), TUNE_SEEDS, HELD_SEEDS = STUDY.arms, STUDY.cells, STUDY.tune_seeds, STUDY.held_seeds
TASK = "speechwarm"
# the registered lab learn command of every piece (PREREGISTRATION.md, part 2); --last 5: part 1's final reward
LEARN = (
    "--tasks", TASK, "--cells", "96/stale2/4", "--steps", "20", "--bypass", "--fp32-trainer", "--no-adjust",
    "--last", "5", "--timeout", "1800", "--engine", learn_engine.LAB, "--workers", "2",
)  # fmt: skip
# the amendment of 2026-11-28 (2): the lab engine runs every piece; the trainer (the same command with --engine
# trainer) runs W = 1 and W = whole at their chosen learning rates on the held-out seeds, with the rollout the
# engine reproduces; the rollout each one's runs name (lab learn's ``rollout`` column)
ENGINE = learn_engine.LAB
CONFIRM_ARMS = (reg.TOKEN, f"{reg.FIXED}96")
CONFIRM_COLUMNS = (  # family C's table in the README
    "test",
    "arm",
    "vs",
    "seeds",
    "trainer",
    "lab engine",
    "diff [95 % t]",
    "p_holm",
    "p_tost_holm",
    "outcome",
)
ALIGNED = f"{reg.FIXED}24"  # the warm model's words last exactly 24 frames
LRS = ("1e-4", "3e-4", "1e-3", "3e-3")
FAMILIES = {
    "F1a": "H1, each at its tuned learning rate: window W minus W = 1",
    "F1b": "H1, both unclipped at their tuned learning rates: window W minus W = 1",
    "F1c": "H1, at matched KL per update: window W at the learning rate whose tuning KL is nearest W = 1's, minus "
    "W = 1",
    "F2": "H2, alignment: the window of one word (24 frames) minus the same window offset by 12 frames, each at its "
    "tuned learning rate",
    "F3": "H3, adaptive: each criterion minus the best fixed window W*, each at its tuned learning rate",
}
RATIO_METRICS = ("actor/ratio/corr_lag1", "actor/ratio/vif5", "actor/ratio/vif15", "actor/ratio/vif50")


def start_of(run: dict) -> str:
    """A run's starting point: its step-1 reward, which is the same for every run of a seed that starts from the
    same warm model (same weights, same generator: the trainer's too) and differs between builds of that model."""
    return f"{run['first_reward']:.6f}"


def design() -> reg.Design:
    return reg.Design(
        task=TASK,
        cells=(CELL,),
        windows=WINDOWS,
        aligned=ALIGNED,
        controls=(OFFSET,),
        settings=LRS,
        knob="lr",
        smallest="lowest learning rate",
        tune_seeds=TUNE_SEEDS,
        held_seeds=HELD_SEEDS,
        families=FAMILIES,
        clip_is_knob=False,
    )


def run(args: argparse.Namespace, argv: list[str]) -> None:
    run_pieces(args, argv, part2())


def part2() -> Part:
    """Part 2 (read when called: the tests shrink the module's constants)."""
    return Part(
        2, TASK, CELL, LEARN, ARMS, LRS, TUNE_SEEDS, HELD_SEEDS, "final_reward", held_pieces, report, engine=ENGINE
    )


def held_pieces(choices: list[dict]) -> list[Piece]:
    """The held-out pieces the choice implies, those a registered test reads first (an arm whose every tuning run
    failed has no choice and no held-out piece: its tests stay not run)."""
    pick = {c["loss"]: c for c in choices}
    arms = [a for a in ARMS if a in pick]
    windows = [f"{reg.FIXED}{w}" for w in WINDOWS if f"{reg.FIXED}{w}" in pick]
    pieces = [Piece("held", a, pick[a]["best_band"], HELD_SEEDS) for a in arms]
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, unclipped=True) for a in windows]
    pieces += [
        Piece("held", a, pick[a]["kl_band"], HELD_SEEDS) for a in windows if a != reg.TOKEN and pick[a]["kl_band"]
    ]
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, unclipped=True) for a in arms if a not in windows]
    # the trainer's confirmation, after every piece of the engine; then the engine's runs of its arms again, on the
    # warm models the trainer's runs started from (DEVIATIONS.md)
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, trainer=True) for a in CONFIRM_ARMS if a in pick]
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, again=True) for a in CONFIRM_ARMS if a in pick]
    return list(dict.fromkeys(pieces))  # a matched-KL lr equal to the chosen one is the chosen piece


# ------------------------------------------------------------------ what is on disk


# ------------------------------------------------------------------ the command


# ------------------------------------------------------------------ the report


def cells_table(rows: list[dict], choices: list[dict]) -> list[dict]:
    """W = 1 at its chosen lr on the held-out seeds: final reward, gain, and the loss's measured correlation of its
    log-ratios (lab learn's ``actor/ratio/*``, mean over steps and seeds; 1 = independent)."""
    token = next((c for c in choices if c["loss"] == reg.TOKEN), None)
    if token is None:
        return []
    mine = [
        r
        for r in rows
        if (r["loss"], r["band"]) == (reg.TOKEN, token["best_band"])
        and r["seed"] in HELD_SEEDS
        and r["ok"]
        and not r["again"]
    ]
    return [
        {
            "cell": CELL,
            "token_lr": token["best_band"],
            "seeds": len(mine),
            "token_final": finite_mean(r["final_reward"] for r in mine),
            "token_gain": finite_mean(r["final_reward"] - r["first_reward"] for r in mine),
            **{k.rsplit("/", 1)[-1]: finite_mean(r.get(k) for r in mine) for k in RATIO_METRICS},
        }
    ]


def confirmation(rows: list[dict], choices: list[dict]) -> tuple[list[dict], str]:
    """Family C (the amendment of 2026-11-28 (2)): on the held-out seeds, paired by seed, the trainer minus the lab
    engine for W = 1 and for W = whole at their chosen lrs, and the F1a difference (W = whole minus W = 1) of the
    trainer minus the engine's; TOST at part 1's margin, Holm within C (a test not run yet counts with p = 1). Each
    test also gives the trainer's mean and the engine's over its seeds. The verdict:
    ``choosing.confirmation_verdict``."""
    pick = {c["loss"]: c["best_band"] for c in choices}
    ok = [r | {"start": start_of(r)} for r in rows if r["ok"] and math.isfinite(r["final_reward"])]
    held = stats.held([r for r in ok if r["seed"] in HELD_SEEDS], HELD_SEEDS[0])

    def pairs(arm: str) -> dict[int, tuple[float, float]]:
        """Per seed with both runs from one start (``stats.pairs``): the trainer's final reward and the engine's."""
        lr = pick.get(arm, "")
        both = stats.pairs(held, TASK, CELL, (arm, lr + ON_TRAINER), (arm, lr))
        return {s: (on["final_reward"], off["final_reward"]) for s, (on, off) in both.items()}

    token, whole = (pairs(a) for a in CONFIRM_ARMS)
    comparisons = [
        *(
            (f"{reg.short(a)}, trainer", f"{reg.short(a)}, lab engine", p)
            for a, p in zip(CONFIRM_ARMS, (token, whole), strict=True)
        ),
        (
            f"{reg.short(CONFIRM_ARMS[1])} minus {reg.short(CONFIRM_ARMS[0])}, trainer",
            "the same, lab engine",
            {s: (whole[s][0] - token[s][0], whole[s][1] - token[s][1]) for s in token.keys() & whole.keys()},
        ),
    ]
    out = []
    for arm, vs, p in comparisons:
        seeds = sorted(p)
        row = {"family": "C", "arm": arm, "vs": vs}
        if len(seeds) > 1:
            row |= stats.paired_summary([p[s][0] - p[s][1] for s in seeds], reg.MARGIN)
            row |= {"trainer": finite_mean(p[s][0] for s in seeds), "engine": finite_mean(p[s][1] for s in seeds)}
        out.append(row)
    reg.judge(out, reg.MARGIN, run=lambda r: r.get("seeds", 0) == len(HELD_SEEDS))
    return out, choosing.confirmation_verdict(out)


def prediction(verdicts: list[dict], part1: list[dict]) -> list[dict]:
    """The registered prediction: part 1's verdicts on its longer-unit cell beside this part's; *confirmed* where
    both are reached and read the same."""
    cell = reg.CELLS[-1]
    theirs = {(v["family"], v["arm"]): v["verdict"] for v in part1 if v["cell"] == cell}
    ours = {(v["family"], v["arm"]): v["verdict"] for v in verdicts}
    out = []
    for family, arm in theirs or ours:
        before, now = theirs.get((family, arm), ""), ours.get((family, arm), ours.get((family, ""), reg.NOT_RUN))
        reached = before and reg.NOT_RUN not in (before, now)
        row = {"family": family, "arm": arm, f"part 1, {cell}": before, "part 2": now}
        out.append(row | {"confirmed": now == before if reached else ""})
    return out


def report(out: Path) -> None:
    from maspo_verl.lab.engine import common

    out = Path(out)
    d, p = design(), part2()
    rows, choices, held = on_disk(out, p)
    # a paired test pairs runs of one seed that started from the same warm model (DEVIATIONS.md)
    started = [r | {"start": start_of(r)} for r in rows if r["ok"]]
    tests = reg.tests(started, choices, d)
    verdicts = reg.decisions(tests)
    confirm, confirmed = confirmation(rows, choices)
    pieces = pieces_table(out, tuning_pieces(p) + held, p, builds(started))
    tables = {
        "tests.csv": tests,
        "decisions.csv": verdicts,
        "pieces.csv": pieces,
        "tuning.csv": tuning_table(rows, choices, p),
        "cells.csv": cells_table(rows, choices),
        "confirmation.csv": confirm,
        "design.csv": reg.design_table(d),
    }
    write_tables(out, tables)
    plotted = any(t.get("seeds") for t in tests)
    if plotted:
        reg.plot(tests, out / "tests.png", FAMILIES)
    predicted = prediction(verdicts, read_csv(out.parent / "decisions.csv"))
    text = readme(rows, choices, tables, predicted, confirmed, plotted, journal.read(out), journal.deviations(out))
    (out / "README.md").write_text(text)
    common.report_written(out)


# how this part reads the registration where it is silent or loose, written before any of its runs
READINGS = (
    "Final reward (the primary metric) is part 1's: the mean of verl's `critic/score/mean` over the last 5 of the "
    "20 steps (`lab learn --last 5`; lab learn's own default is 3).",
    "One piece is one arm at one learning rate (clip as shipped, or off) on one seed group: a `lab learn` command "
    "(in `COMMAND.txt`) writing `pieces/<piece>/`. The registered design implies 32 tuning pieces (8 arms x 4 "
    "learning rates x 4 seeds: 128 runs) and 16 to 20 held-out pieces of 12 seeds (every arm at its chosen "
    "learning rate and unclipped at it; each window W >= 2 at its matched-KL learning rate where it differs from "
    'the chosen one): 320 to 368 runs, more than the registration\'s "about 250 runs", which left out the '
    "unclipped and matched-KL runs. Measured time per run: the pieces table.",
    "Ties in the tuning choice go to the smaller learning rate (part 1's rule: the narrower width; "
    "`regimes_tuned.choose`).",
    "Unclipped (F1b): `lab learn --bands ARM=inf`, `regimes_tuned.widen`'s no-clip: the log-space band and the dual "
    "clip opened to exp(±30) (verl clamps log-ratios to ±20), the ratio-space clip to (0, 1e9). It runs on the "
    "held-out seeds only, as F1b reads them. The registration says each arm: the three arms no test reads unclipped "
    "(both adaptive criteria, the offset window) run after every piece a test reads. `maspo_adaptive`'s band "
    "criterion reads the band, so unclipped its windows are the longest allowed (64), as in part 1.",
    "KL per update (matched KL, F1c) is a run's mean of verl's `actor/ppo_kl` over its 20 steps, averaged over the "
    "4 tuning seeds; the matched learning rate is the one nearest in log to W = 1's at its chosen rate (part 1's "
    "rule). Where it equals the chosen rate the test reads the chosen piece's runs (the same configuration).",
    "A run that does not finish (exit code not 0, or fewer than 20 steps) stays in its piece's "
    "`learn_runs.csv`, is counted in the pieces table and left out of the choice and the tests (a test's seed "
    "count shows it); `--resume` does not run it again (remove its piece folder to re-run the piece). A piece whose "
    "every run fails stops the study with the cause.",
    "While a family is partial, a registered test not run yet counts in its Holm correction with p = 1 "
    "(conservative); once every test is run the correction is the registered one.",
    "The registered prediction (part 1's outcome on its longer-unit cell, L96/stale2/U4/lr1/u24) is *confirmed* "
    "for a family where part 2's verdict is the same words.",
    "A trainer run's time limit is 1800 s (`--timeout`; lab learn's default 900 s can stop a run on a shared "
    "machine). CPU time per run (`cpu_s`): the lab engine's, its process's user + system time during the run; the "
    "trainer's (`lab/runs.py`), the user + system time of the run's processes (the trainer's session and its Ray "
    "cluster, read every 0.5 s), or the kernel's count of reaped children where that is larger: a lower bound (a "
    "process's last half second can be missed). Each seed's warm-started model is built once into the local cache "
    "(about a CPU-minute each, not in the runs' times).",
    "Family C's tests pair a seed's trainer run with its engine run of the same arm and learning rate; a seed "
    "missing from either is left out of C (its seed count shows it), and C's verdict waits for all 12 seeds.",
)


def readme(rows, choices, tables, predicted, confirmed: str, plotted: bool, command: str, deviations) -> str:
    d = design()
    pieces = tables["pieces.csv"]
    tuned = [p for p in pieces if p["phase"] == "tune"]
    lines = [
        "# Granularity at matched step size, part 2: the warm speech model (the lab engine, checked against verl's "
        "trainer)",
        "",
        'The protocol is [`PREREGISTRATION.md`](../PREREGISTRATION.md) ("Part 2" and its amendment of 2026-11-28 '
        "(2)), committed before any of these runs; part 1 is [`../README.md`](../README.md). Made by "
        "`python -m maspo_verl.lab granularity --part 2` "
        "(`maspo_verl/lab/studies/granularity_warm.py`: the pieces; `granularity.py`: the tests and decisions, "
        "part 1's): "
        f"`lab learn {' '.join(LEARN)}` per piece, arms {', '.join(ARMS)}, learning "
        f"rates {', '.join(LRS)} on tuning seeds {TUNE_SEEDS[0]}-{TUNE_SEEDS[-1]}, held-out seeds "
        f"{HELD_SEEDS[0]}-{HELD_SEEDS[-1]}, TOST margin ±{reg.MARGIN}.",
        "",
        status_line(pieces, choices, rows, 2),
        "",
        "## Readings of the registration (written before any run)",
        "",
        *(f"- {x}" for x in READINGS),
        "",
        "## Deviations from the pre-registration",
        "",
        *(f"- {x}" for x in deviations),
        "",
        *reg.verdict_section(tables["decisions.csv"]),
        "## The registered prediction: part 1's longer-unit cell",
        "",
        markdown_table(predicted),
        "## The trainer's confirmation of the lab engine (family C)",
        "",
        f"**{confirmed}**. verl's trainer (`--engine trainer`) against the lab engine on the held-out seeds, paired "
        "by seed: final reward of W = 1 and of W = whole, each at its chosen learning rate, and their F1a difference "
        "(`trainer`, `lab engine`: each one's mean over the seeds); "
        f"*equivalent*: Holm-adjusted TOST p < 0.05 (margin ±{reg.MARGIN}); *different*: Holm-adjusted sign-flip p < "
        "0.05 (`confirmation.csv`). Where the engine is contradicted, the verdicts above are the engine's only.",
        "",
        markdown_table(
            [
                {"test": f"C{i}", "arm": r["arm"], "vs": r["vs"], "seeds": r.get("seeds", 0)}
                | (
                    {
                        "trainer": r["trainer"],
                        "lab engine": r["engine"],
                        "diff [95 % t]": f"{r['diff']:+.4f} [{r['low']:+.4f}, {r['high']:+.4f}]",
                    }
                    if r.get("seeds")
                    else {}
                )
                | {k: r[k] for k in ("p_holm", "p_tost_holm") if k in r}
                | {"outcome": r["outcome"]}
                for i, r in enumerate(tables["confirmation.csv"], 1)
            ],
            CONFIRM_COLUMNS,
            digits=4,
        ),
        "## W = 1 at its chosen learning rate, and the measured correlation of its log-ratios",
        "",
        "`corr_lag1`, `vif*`: lab learn's `actor/ratio/*` (the loss's log-ratios; 1 = independent), mean over steps "
        "and held-out seeds.",
        "",
        markdown_table(tables["cells.csv"]),
        *reg.family_sections(tables["tests.csv"], d),
        "## The learning rates chosen on the tuning seeds",
        "",
        lr_choice_table(choices)
        if choices
        else f"Not chosen yet: {sum(p['done'] for p in tuned)} of {len(tuned)} "
        "tuning pieces done; `choice.csv` is written when all are, before any held-out piece runs.\n",
        *([reg.bracket_note(choices, d), ""] if choices else []),
        "Tuning means per arm and learning rate (`tuning.csv`):",
        "",
        markdown_table(tables["tuning.csv"]),
        *ending(
            pieces,
            plotted,
            "`tests.csv` (every registered test), `decisions.csv`, `confirmation.csv` (family C), `pieces.csv`, "
            "`tuning.csv`, `cells.csv`",
            command,
        ),
    ]
    return "\n".join(lines)
