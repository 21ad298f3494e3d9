"""The piece engine: a registered part run as resumable pieces, each one ``lab learn`` command (an arm at one
learning rate on one seed group) writing ``pieces/<piece>/``; the tuning pieces first, the choice written
(``choice.csv``) before any held-out piece, the report rebuilt after each piece; and the tables and README
sections every such part shows (pieces, tuning, status, files and commands)."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from maspo_verl.lab.engine import grid, journal, learn_engine, protocol, study
from maspo_verl.lab.engine.common import finite_mean, log, markdown_table, write_csv
from maspo_verl.lab.engine.presets import SHIPPED, UNCLIPPED
from maspo_verl.lab.engine.runs import load_rows, slug
from maspo_verl.lab.engine.tuning import choose as tuning_choice

PIECES = "pieces"  # one folder per piece
ON_TRAINER = "/trainer"  # the setting of a confirmation run: its lr, then this
TRAINER_ROLLOUT = learn_engine.REQUIRED["actor_rollout_ref.rollout.name"]  # the rollout a trainer run names


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
        return self.lr + (protocol.NO_CLIP if self.unclipped else "") + (ON_TRAINER if self.trainer else "")

    @property
    def name(self) -> str:
        suffix = (
            ("_noclip" if self.unclipped else "")
            + ("_trainer" if self.trainer else "")
            + ("_again" if self.again else "")
        )
        return slug(f"{self.phase}_{protocol.short(self.arm)}_lr{self.lr}{suffix}")

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
    """What the piece engine reads of one part run as pieces of ``lab learn`` (parts 2 and 4)."""

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


def tuning_pieces(part: Part) -> list[Piece]:
    return [Piece("tune", arm, lr, part.tune_seeds) for arm in part.arms for lr in part.lrs]


def piece_rows(out: Path, piece: Piece, part: Part) -> list[dict]:
    """The piece's runs (``lab learn``'s rows), keyed for the analysis: ``band`` is the piece's setting,
    ``ppo_kl`` the run's mean KL per update, ``ok`` false too where the run's rollout engine is not the part's; a
    row that is not this piece's stops with the folder named."""
    folder = Path(out) / PIECES / piece.name
    rows = load_rows(folder / "learn_runs.csv")
    band = UNCLIPPED if piece.unclipped else SHIPPED
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
    return tuning_choice(tuning, part.held_seeds[0], baseline=protocol.TOKEN, metric=part.metric)


def written_choice(out: Path, rows: list[dict], part: Part) -> list[dict]:
    """The choice, once ``choice.csv`` is written (checked against the tuning runs on disk); [] before."""
    path = Path(out) / "choice.csv"
    if not path.is_file():
        return []
    choices = choose(rows, part)
    protocol.check_choice(path, choices)
    return choices


def _engine_defaults() -> dict:
    p = argparse.ArgumentParser()
    grid.engine_arguments(p)
    p.set_defaults(sample_seed=protocol.SAMPLE_SEED)
    return vars(p.parse_args([]))


def run(args: argparse.Namespace, argv: list[str], p: Part) -> None:
    """A part's command: its pieces of ``phase`` (``--resume``, at most ``--pieces``), or its report (``--report``)."""
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
    study.run_command(argv)
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


def on_disk(out: Path, part: Part) -> tuple[list[dict], list[dict], list[Piece]]:
    """What a part's report reads (its folder made first): the runs of its pieces on disk (the held-out ones once
    the choice is written), the written choice, and the held-out pieces it implies."""
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = tuning_rows(out, part)
    choices = written_choice(out, rows, part)
    held = part.held_pieces(choices) if choices else []
    return rows + [r for piece in held for r in piece_rows(out, piece, part)], choices, held


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
