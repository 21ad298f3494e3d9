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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from maspo_verl import choosing
from maspo_verl.lab.engine import grid, journal, learn_engine, stats
from maspo_verl.lab.engine import tuning as tuned
from maspo_verl.lab.engine.common import finite_mean, log, markdown_table, read_csv, write_csv, write_tables
from maspo_verl.lab.engine.presets import UNCLIPPED
from maspo_verl.lab.engine.study import Study
from maspo_verl.lab.studies import granularity as g
from maspo_verl.lab.studies import learn

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
    arms=(*(f"{g.FIXED}{w}" for w in WINDOWS), *g.ADAPTIVE, OFFSET),
    cells=("L96/stale2/U4",),  # lab learn's label of --cells 96/stale2/4
    tune_seeds=tuple(range(200, 204)),
    held_seeds=tuple(range(300, 312)),
)

FOLDER = STUDY.folder
ARMS, (CELL,), TUNE_SEEDS, HELD_SEEDS = STUDY.arms, STUDY.cells, STUDY.tune_seeds, STUDY.held_seeds
PIECES = "pieces"  # one folder per piece
TASK = "speechwarm"
# the registered lab learn command of every piece (PREREGISTRATION.md, part 2); --last 5: part 1's final reward
LEARN = (
    "--tasks", TASK, "--cells", "96/stale2/4", "--steps", "20", "--bypass", "--fp32-trainer", "--no-adjust",
    "--last", "5", "--timeout", "1800", "--engine", learn_engine.LAB, "--workers", "2",
)  # fmt: skip
# the amendment of 2026-11-28 (2): the lab engine runs every piece; the trainer (the same command with --engine
# trainer) runs W = 1 and W = whole at their chosen learning rates on the held-out seeds, with the rollout the
# engine reproduces; the rollout each one's runs name (lab learn's ``rollout`` column)
ENGINE, TRAINER_ROLLOUT = learn_engine.LAB, learn_engine.REQUIRED["actor_rollout_ref.rollout.name"]
CONFIRM_ARMS = (g.TOKEN, f"{g.FIXED}96")
ON_TRAINER = "/trainer"  # the setting of a confirmation run: its lr, then this
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
ALIGNED = f"{g.FIXED}24"  # the warm model's words last exactly 24 frames
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


def design() -> g.Design:
    return g.Design(
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


@dataclass(frozen=True)
class Piece:
    """One ``lab learn`` command: ``arm`` at ``lr`` (unclipped: its band and dual clip opened) on ``seeds``."""

    phase: str  # "tune" or "held"
    arm: str
    lr: str
    seeds: tuple[int, ...]
    unclipped: bool = False
    trainer: bool = False  # run by verl's trainer (``--engine trainer``), not the part's engine
    again: bool = False  # a registered piece's command run again (a deviation: the folder's DEVIATIONS.md)

    @property
    def setting(self) -> str:
        """The runs' setting as the analysis keys them: the lr, ``/inf`` where unclipped, ``/trainer`` where the
        trainer runs it."""
        return self.lr + (g.NO_CLIP if self.unclipped else "") + (ON_TRAINER if self.trainer else "")

    @property
    def name(self) -> str:
        suffix = (
            ("_noclip" if self.unclipped else "")
            + ("_trainer" if self.trainer else "")
            + ("_again" if self.again else "")
        )
        return learn.slug(f"{self.phase}_{g.short(self.arm)}_lr{self.lr}{suffix}")

    def argv(self, out: Path, flags: tuple[str, ...]) -> list[str]:
        """The lab CLI's arguments of this piece (``flags``: its part's registered lab learn flags)."""
        assert self.seeds == tuple(range(self.seeds[0], self.seeds[0] + len(self.seeds))), self.seeds
        return [
            "learn", "--out", str(Path(out) / PIECES / self.name), *flags, "--losses", self.arm,
            "--lr", self.lr,
            "--first-seed", str(self.seeds[0]), "--seeds", str(len(self.seeds)),
            *(["--bands", f"{self.arm}={UNCLIPPED}"] if self.unclipped else []),
            *(["--engine", learn_engine.TRAINER, "--workers", "1"] if self.trainer else []),
        ]  # fmt: skip


@dataclass(frozen=True)
class Part:
    """What the piece engine reads of one part run as pieces of ``lab learn``: part 2 (``part2``) here, part 4 in
    ``granularity_vllm``."""

    number: int
    task: str  # the runs' task column
    cell: str  # lab learn's label of the part's one cell
    flags: tuple[str, ...]  # the registered lab learn flags of every piece
    arms: tuple[str, ...]
    lrs: tuple[str, ...]  # the learning rates tuned, the smallest first
    tune_seeds: tuple[int, ...]
    held_seeds: tuple[int, ...]
    metric: str  # the runs' column the choice reads (its best tuning mean; ties: the smaller lr)
    held_pieces: Callable[[list[dict]], list[Piece]]  # the held-out pieces of a choice, those a test reads first
    report: Callable[[Path], None]
    check: Callable[[], None] = lambda: None  # refuses to start where the registration's premise fails
    # the rollout engine a run must name (lab learn's ``rollout`` column); a run on another counts as failed
    engine: str = ""


def part2() -> Part:
    """Part 2 (read when called: the tests shrink the module's constants)."""
    return Part(
        2, TASK, CELL, LEARN, ARMS, LRS, TUNE_SEEDS, HELD_SEEDS, "final_reward", held_pieces, report, engine=ENGINE
    )


def tuning_pieces(part: Part) -> list[Piece]:
    return [Piece("tune", arm, lr, part.tune_seeds) for arm in part.arms for lr in part.lrs]


def held_pieces(choices: list[dict]) -> list[Piece]:
    """The held-out pieces the choice implies, those a registered test reads first (an arm whose every tuning run
    failed has no choice and no held-out piece: its tests stay not run)."""
    pick = {c["loss"]: c for c in choices}
    arms = [a for a in ARMS if a in pick]
    windows = [f"{g.FIXED}{w}" for w in WINDOWS if f"{g.FIXED}{w}" in pick]
    pieces = [Piece("held", a, pick[a]["best_band"], HELD_SEEDS) for a in arms]
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, unclipped=True) for a in windows]
    pieces += [Piece("held", a, pick[a]["kl_band"], HELD_SEEDS) for a in windows if a != g.TOKEN and pick[a]["kl_band"]]
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, unclipped=True) for a in arms if a not in windows]
    # the trainer's confirmation, after every piece of the engine; then the engine's runs of its arms again, on the
    # warm models the trainer's runs started from (DEVIATIONS.md)
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, trainer=True) for a in CONFIRM_ARMS if a in pick]
    pieces += [Piece("held", a, pick[a]["best_band"], HELD_SEEDS, again=True) for a in CONFIRM_ARMS if a in pick]
    return list(dict.fromkeys(pieces))  # a matched-KL lr equal to the chosen one is the chosen piece


# ------------------------------------------------------------------ what is on disk


def piece_rows(out: Path, piece: Piece, part: Part) -> list[dict]:
    """The piece's runs (``lab learn``'s rows), keyed for the analysis: ``band`` is the piece's setting,
    ``ppo_kl`` the run's mean KL per update, ``ok`` false too where the run's rollout engine is not the part's; a
    row that is not this piece's stops with the folder named."""
    folder = Path(out) / PIECES / piece.name
    rows = learn.load_rows(folder / "learn_runs.csv")
    band = UNCLIPPED if piece.unclipped else learn.SHIPPED
    for r in rows:
        mine = (r["task"], r["cell"], r["loss"], r["band"]) == (part.task, part.cell, piece.arm, band)
        if not mine or r["seed"] not in piece.seeds or ("lr" in r and not math.isclose(r["lr"], float(piece.lr))):
            raise SystemExit(
                f"{folder}: a run of {r['loss']} (seed {r['seed']}, band {r['band']}, lr {r.get('lr')}) is not this "
                f"piece's ({piece.arm}, lr {piece.lr}, {band}, seeds {piece.seeds[0]}-{piece.seeds[-1]}): remove it"
            )
    keyed = {"band": piece.setting, "piece": piece.name, "again": piece.again}
    engine = TRAINER_ROLLOUT if piece.trainer else part.engine
    return [
        r | keyed | {"ppo_kl": r["mean_ppo_kl"], "ok": r["ok"] and (not engine or r.get("rollout") == engine)}
        for r in rows
    ]


def covers(piece: Piece, rows: list[dict]) -> bool:
    """Whether ``rows`` (the piece's) hold a run of every seed of the piece."""
    return set(piece.seeds) <= {r["seed"] for r in rows}


def done(out: Path, piece: Piece, part: Part) -> bool:
    return covers(piece, piece_rows(out, piece, part))


def tuning_rows(out: Path, part: Part) -> list[dict]:
    """The runs of every tuning piece on disk."""
    return [r for p in tuning_pieces(part) for r in piece_rows(out, p, part)]


def choose(rows: list[dict], part: Part) -> list[dict]:
    """Each arm's chosen lr and matched-KL lr from the finished tuning runs (``tuning.choose`` on the
    part's metric)."""
    tuning = [r for r in rows if r["seed"] in part.tune_seeds and r["ok"]]
    return tuned.choose(tuning, part.held_seeds[0], baseline=g.TOKEN, metric=part.metric)


def written_choice(out: Path, rows: list[dict], part: Part) -> list[dict]:
    """The choice, once ``choice.csv`` is written (checked against the tuning runs on disk); [] before."""
    path = Path(out) / "choice.csv"
    if not path.is_file():
        return []
    choices = choose(rows, part)
    g.check_choice(path, choices)
    return choices


# ------------------------------------------------------------------ the command


def _engine_defaults() -> dict:
    p = argparse.ArgumentParser()
    grid.engine_arguments(p)
    p.set_defaults(sample_seed=g.SAMPLE_SEED)
    return vars(p.parse_args([]))


def run(args: argparse.Namespace, argv: list[str], part: Part | None = None) -> None:
    p = part or part2()
    changed = [k for k, v in _engine_defaults().items() if getattr(args, k) != v]
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise SystemExit(
            f"--part {p.number}: {flags} set part 1's engine; part {p.number}'s design is fixed (its lab learn flags)"
        )
    if args.pieces < 0:
        raise SystemExit(f"--pieces {args.pieces}: allowed 0 (all) or a number of pieces > 0")
    out = Path(args.out)
    p.check()
    if args.report:
        return p.report(out)
    drive(out, args.phase, args.resume, args.pieces, argv, p)


def drive(out: Path, phase: str, resume: bool, budget: int, argv: list[str], part: Part) -> None:
    """Run the missing pieces of ``phase`` (at most ``budget``, 0: all), the report rebuilt after each."""
    choice = out / "choice.csv"
    tuning = tuning_pieces(part)
    tuned = sum(done(out, p, part) for p in tuning)
    if phase == "held" and not choice.is_file():
        raise SystemExit(
            f"--phase held: {choice} is missing: the held-out seeds wait for the tuning choice; run --phase tune "
            f"(--resume) until its {len(tuning)} pieces are done ({tuned} are)"
        )
    on_disk = sorted(p.name for p in (out / PIECES).iterdir()) if (out / PIECES).is_dir() else []
    if on_disk and not resume:
        raise SystemExit(
            f"{out}: {len(on_disk)} pieces on disk: add --resume to keep them and run the missing ones (or remove "
            "the folder to start again)"
        )
    if resume:
        journal.again(out, argv)
    else:
        journal.start(out, argv)
    ran = 0

    def run_missing(pieces: list[Piece]) -> bool:
        """Run the pieces not done yet, within the budget; whether every one is done."""
        nonlocal ran
        for piece in pieces:
            if done(out, piece, part):
                continue
            if budget and ran >= budget:
                break
            run_piece(out, piece, part)
            ran += 1
            part.report(out)
        return all(done(out, p, part) for p in pieces)

    if phase in ("tune", "all"):
        if run_missing(tuning) and not choice.is_file():
            write_csv(choice, choose(tuning_rows(out, part), part))
            journal.note(out, "tuning done: choice.csv written (before any held-out piece)")
    if phase in ("held", "all"):
        if choice.is_file():
            run_missing(part.held_pieces(written_choice(out, tuning_rows(out, part), part)))
        else:
            tuned = sum(done(out, p, part) for p in tuning)
            log(f"granularity part {part.number}: {tuned} of {len(tuning)} tuning pieces done; held-out pieces wait")
    part.report(out)


def run_piece(out: Path, piece: Piece, part: Part) -> None:
    """One piece: its ``lab learn`` command, parsed by lab learn's parser (a renamed flag fails here) and run."""
    argv = piece.argv(out, part.flags)
    if (Path(out) / PIECES / piece.name / "learn_runs.csv").is_file():
        argv.append("--resume")  # a stopped piece: lab learn runs only its missing seeds
    journal.note(out, f"\npiece {piece.name}: {journal.command_line(argv)}")
    start = time.monotonic()
    learn.run(learn.parse(argv), argv)
    rows = [r for r in piece_rows(out, piece, part) if r["seed"] in piece.seeds]
    cpu = finite_mean(r.get("cpu_s") for r in rows)
    journal.note(
        out,
        f"  {len(rows)} runs on disk, {time.monotonic() - start:.0f} s wall, {cpu:.0f} CPU-s per run (learn_runs.csv "
        f"cpu_s); machine load at the end: {journal.load()}",
    )
    if rows and not any(r["ok"] for r in rows):
        codes = sorted({str(r["exit_code"]) for r in rows})
        engines = sorted({r.get("rollout") or "?" for r in rows})
        raise SystemExit(
            f"piece {piece.name}: every run failed (exit codes {', '.join(codes)}; rollout engines "
            f"{', '.join(engines)}; each run folder is named in the log above): fix the cause, remove "
            f"{Path(out) / PIECES / piece.name} and run again with --resume"
        )


# ------------------------------------------------------------------ the report


def builds(rows: list[dict]) -> dict[str, str]:
    """Per piece: the builds of the seeds' warm models its runs started from (``start`` keyed), each seed's builds
    numbered 1, 2, ... in the order of ``rows``."""
    number: dict[tuple[int, str], int] = {}
    of: dict[str, set[int]] = {}
    for r in rows:
        if r["ok"]:
            key = (r["seed"], r["start"])
            number.setdefault(key, 1 + sum(s == r["seed"] for s, _ in number))
            of.setdefault(r["piece"], set()).add(number[key])
    return {piece: ", ".join(map(str, sorted(b))) for piece, b in of.items()}


def pieces_table(out: Path, pieces: list[Piece], part: Part, build: dict[str, str] | None = None) -> list[dict]:
    """Per piece: its runs on disk, failures, whether done, time per run; with ``build`` (``builds``) also the
    builds of the warm models its runs started from."""
    rows = []
    for p in pieces:
        mine = piece_rows(out, p, part)
        rows.append(
            {
                "piece": p.name,
                "phase": p.phase,
                "arm": p.arm,
                "lr": p.lr,
                "clip": "off" if p.unclipped else "shipped",
                "seeds": f"{p.seeds[0]}-{p.seeds[-1]}",
                "runs": f"{len(mine)}/{len(p.seeds)}",
                "failed": sum(not r["ok"] for r in mine),
                "done": covers(p, mine),
                "wall_s_per_run": finite_mean(r["wall_s"] for r in mine),
                "cpu_s_per_run": finite_mean(r.get("cpu_s") for r in mine),
            }
            | ({"build": build.get(p.name, "")} if build is not None else {})
        )
    return rows


def tuning_table(rows: list[dict], choices: list[dict], part: Part) -> list[dict]:
    """Per arm and lr: the tuning mean of the part's metric and KL per update (what the choice reads)."""
    pick = {c["loss"]: c for c in choices}
    out = []
    for arm in part.arms:
        for lr in part.lrs:
            mine = [r for r in rows if (r["loss"], r["band"]) == (arm, lr) and r["seed"] in part.tune_seeds and r["ok"]]
            chosen = pick.get(arm, {})
            out.append(
                {
                    "arm": arm,
                    "lr": lr,
                    "seeds": len(mine),
                    part.metric: finite_mean(r[part.metric] for r in mine),
                    "ppo_kl": finite_mean(r["ppo_kl"] for r in mine),
                    "chosen": chosen.get("best_band") == lr,
                    "matched_kl": chosen.get("kl_band") == lr,
                }
            )
    return out


def cells_table(rows: list[dict], choices: list[dict]) -> list[dict]:
    """W = 1 at its chosen lr on the held-out seeds: final reward, gain, and the loss's measured correlation of its
    log-ratios (lab learn's ``actor/ratio/*``, mean over steps and seeds; 1 = independent)."""
    token = next((c for c in choices if c["loss"] == g.TOKEN), None)
    if token is None:
        return []
    mine = [
        r
        for r in rows
        if (r["loss"], r["band"]) == (g.TOKEN, token["best_band"])
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
            (f"{g.short(a)}, trainer", f"{g.short(a)}, lab engine", p)
            for a, p in zip(CONFIRM_ARMS, (token, whole), strict=True)
        ),
        (
            f"{g.short(CONFIRM_ARMS[1])} minus {g.short(CONFIRM_ARMS[0])}, trainer",
            "the same, lab engine",
            {s: (whole[s][0] - token[s][0], whole[s][1] - token[s][1]) for s in token.keys() & whole.keys()},
        ),
    ]
    out = []
    for arm, vs, p in comparisons:
        seeds = sorted(p)
        row = {"family": "C", "arm": arm, "vs": vs}
        if len(seeds) > 1:
            row |= stats.paired_summary([p[s][0] - p[s][1] for s in seeds], g.MARGIN)
            row |= {"trainer": finite_mean(p[s][0] for s in seeds), "engine": finite_mean(p[s][1] for s in seeds)}
        out.append(row)
    g.judge(out, g.MARGIN, run=lambda r: r.get("seeds", 0) == len(HELD_SEEDS))
    return out, choosing.confirmation_verdict(out)


def prediction(verdicts: list[dict], part1: list[dict]) -> list[dict]:
    """The registered prediction: part 1's verdicts on its longer-unit cell beside this part's; *confirmed* where
    both are reached and read the same."""
    cell = g.CELLS[-1]
    theirs = {(v["family"], v["arm"]): v["verdict"] for v in part1 if v["cell"] == cell}
    ours = {(v["family"], v["arm"]): v["verdict"] for v in verdicts}
    out = []
    for family, arm in theirs or ours:
        before, now = theirs.get((family, arm), ""), ours.get((family, arm), ours.get((family, ""), g.NOT_RUN))
        reached = before and g.NOT_RUN not in (before, now)
        row = {"family": family, "arm": arm, f"part 1, {cell}": before, "part 2": now}
        out.append(row | {"confirmed": now == before if reached else ""})
    return out


def on_disk(out: Path, part: Part) -> tuple[list[dict], list[dict], list[Piece]]:
    """What a part's report reads (its folder made first): the runs of its pieces on disk (the held-out ones once
    the choice is written), the written choice, and the held-out pieces it implies."""
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = tuning_rows(out, part)
    choices = written_choice(out, rows, part)
    held = part.held_pieces(choices) if choices else []
    return rows + [r for piece in held for r in piece_rows(out, piece, part)], choices, held


def report(out: Path) -> None:
    from maspo_verl.lab.engine import common

    out = Path(out)
    d, p = design(), part2()
    rows, choices, held = on_disk(out, p)
    # a paired test pairs runs of one seed that started from the same warm model (DEVIATIONS.md)
    started = [r | {"start": start_of(r)} for r in rows if r["ok"]]
    tests = g.tests(started, choices, d)
    verdicts = g.decisions(tests)
    confirm, confirmed = confirmation(rows, choices)
    pieces = pieces_table(out, tuning_pieces(p) + held, p, builds(started))
    tables = {
        "tests.csv": tests,
        "decisions.csv": verdicts,
        "pieces.csv": pieces,
        "tuning.csv": tuning_table(rows, choices, p),
        "cells.csv": cells_table(rows, choices),
        "confirmation.csv": confirm,
        "design.csv": g.design_table(d),
    }
    write_tables(out, tables)
    plotted = any(t.get("seeds") for t in tests)
    if plotted:
        g.plot(tests, out / "tests.png", FAMILIES)
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


def status(pieces: list[dict], choices: list[dict]) -> str:
    """A part's pieces done and left (``pieces_table``'s rows), in a sentence."""
    left = [p for p in pieces if not p["done"]]
    runs = sum(int(p["runs"].split("/")[0]) for p in pieces)
    return (
        f"{len(pieces) - len(left)} of {len(pieces)} pieces done ({runs} runs on disk, "
        f"{sum(p['failed'] for p in pieces)} failed); "
        + (
            "the held-out pieces are listed once the tuning choice is written."
            if not choices
            else f"tuning choice written; {len(left)} pieces left."
        )
    )


def lr_choice_table(choices: list[dict]) -> str:
    """``choice.csv`` as a README shows it: its ``*band*`` columns hold learning rates here, named so."""
    names = {"best_band": "lr", "kl_band": "matched_kl_lr", "kl_band_kl": "matched_kl_lr_kl"}
    return markdown_table([{names.get(k, k): v for k, v in c.items()} for c in choices])


def status_line(pieces: list[dict], choices: list[dict], rows: list[dict], number: int) -> str:
    """A part's README status: its pieces done and left, the time a run took, and the command that runs the rest
    (none once every piece is done)."""
    complete = bool(choices) and all(p["done"] for p in pieces)
    rest = (
        ""
        if complete
        else f" The rest: `python -m maspo_verl.lab granularity --part {number} --update-docs --resume --pieces N` "
        "(the next N pieces; tuning first)."
    )
    return (
        f"**Status**: {status(pieces, choices)} Measured per run{'' if complete else ' so far'}: {per_run(rows)}{rest}"
    )


def per_run(rows: list[dict]) -> str:
    """The mean wall and CPU time of the runs on disk, in words."""
    wall, cpu = finite_mean(r["wall_s"] for r in rows), finite_mean(r.get("cpu_s") for r in rows)
    return f"{wall:.0f} s wall, {cpu:.0f} CPU-s." if rows else "nothing yet (no run)."


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
        f"{HELD_SEEDS[0]}-{HELD_SEEDS[-1]}, TOST margin ±{g.MARGIN}.",
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
        *g.verdict_section(tables["decisions.csv"]),
        "## The registered prediction: part 1's longer-unit cell",
        "",
        markdown_table(predicted),
        "## The trainer's confirmation of the lab engine (family C)",
        "",
        f"**{confirmed}**. verl's trainer (`--engine trainer`) against the lab engine on the held-out seeds, paired "
        "by seed: final reward of W = 1 and of W = whole, each at its chosen learning rate, and their F1a difference "
        "(`trainer`, `lab engine`: each one's mean over the seeds); "
        f"*equivalent*: Holm-adjusted TOST p < 0.05 (margin ±{g.MARGIN}); *different*: Holm-adjusted sign-flip p < "
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
        *g.family_sections(tables["tests.csv"], d),
        "## The learning rates chosen on the tuning seeds",
        "",
        lr_choice_table(choices)
        if choices
        else f"Not chosen yet: {sum(p['done'] for p in tuned)} of {len(tuned)} "
        "tuning pieces done; `choice.csv` is written when all are, before any held-out piece runs.\n",
        *([g.bracket_note(choices, d), ""] if choices else []),
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


def ending(pieces: list[dict], plotted: bool, files: str, command: str) -> list[str]:
    """A part's README from its pieces table on: the plot, its files (``files``: those beside the pieces, the
    choice and the design) and the commands that made it."""
    return [
        "## Pieces",
        "",
        markdown_table(pieces),
        *(["![registered tests](tests.png)", ""] if plotted else []),
        "Files: `pieces/<piece>/` (each piece's lab learn output: `learn_runs.csv`, `learn_steps.csv`, its command), "
        f"`choice.csv` (written before the held-out pieces), {files}, `design.csv` (the registered design).",
        "",
        "## Commands",
        "",
        "```",
        command.strip() or "(no piece run yet)",
        "```",
        "",
    ]
