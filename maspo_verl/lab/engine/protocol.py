"""The registered granularity study's protocol, which its parts and re-judgings share (``PREREGISTRATION.md`` of
``docs/results/granularity/``): a part's ``Design``, part 1's registered design (the reference the later parts
and re-judgings read), the comparisons of every family, the tests on held-out seeds with Holm's correction within
each family, the decision rules, and the report's sections (design table, verdicts, families, plot)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from maspo_verl import choosing
from maspo_verl.lab.engine import stats
from maspo_verl.lab.engine.common import markdown_table, pyplot, read_csv
from maspo_verl.lab.engine.presets import UNCLIPPED

PART1_FOLDER = "granularity"  # part 1's command and results folder (docs/results/granularity/)
CELLS = ("L96/stale2/U4", "L96/stale2/U4/lr1", "L96/stale2/U4/lr1/u24")
TUNE_SEEDS = tuple(range(20000, 20032))
HELD_SEEDS = tuple(range(30000, 30064))
WINDOWS = (1, 2, 4, 8, 16, 32, 96)
FIXED = "maspo_fixed@segment_window="
TOKEN = f"{FIXED}1"  # H1's reference: token granularity in log space, the same code path as every window
ALIGNED, OFFSET, SHUFFLED = "maspo_words~units", "maspo_words~units_offset", "maspo_words~units_shuffled"
ADAPTIVE = ("maspo_adaptive", "maspo_adaptive@adaptive_criterion=correlation")
WIDTHS = ("0.015625", "0.0625", "0.25", "1", "4", "16", "inf")
SAMPLE_SEED = 52
MARGIN = 0.03  # TOST margin, final reward
ALPHA = 0.05
NOT_RUN = choosing.NOT_RUN
NO_CLIP = f"/{UNCLIPPED}"  # a learning-rate setting with the clip off (the dual clip too): "1e-3/inf"


@dataclass(frozen=True)
class Design:
    """One part's registered design, as the shared analysis reads it: its comparisons, tests, decisions and the
    report's sections are the same code for every part (part 1, part 2, part 4)."""

    task: str  # the runs' task column
    cells: tuple[str, ...]
    windows: tuple[int, ...]  # H1's windows, W = 1 first
    aligned: str  # H2's arm aligned with the units the reward scores ...
    controls: tuple[str, ...]  # ... and its controls
    settings: tuple[str, ...]  # the tuned step-size knob's values, the smallest step first
    knob: str  # what a setting is: "width" (the clip band's scale) or "lr" (Adam's learning rate)
    smallest: str  # the smallest setting in words ("narrowest width"): a choice there is not bracketed below
    tune_seeds: tuple[int, ...]
    held_seeds: tuple[int, ...]
    families: dict  # family -> what it compares
    clip_is_knob: bool  # unclipped is the knob's value inf (part 1), else the chosen setting with the clip off
    adaptive: tuple[str, ...] = ADAPTIVE  # H3's criteria (both, in parts 1 and 2)
    metric: str = "final_reward"  # the runs' column the tests compare
    margin: float = MARGIN  # TOST margin, in the metric's units
    # (family, arm, vs): tests of two arms each at its chosen setting, in place of H1-H3's (part 4)
    pairs: tuple[tuple[str, str, str], ...] = ()
    largest: str = ""  # the largest setting in words, where a choice there is flagged too ("": not flagged)

    def unclipped(self, chosen: str) -> str:
        """The setting of an arm's unclipped runs, given its chosen one ("" where none is chosen yet)."""
        if self.clip_is_knob:
            return UNCLIPPED
        return f"{chosen}{NO_CLIP}" if chosen else ""

    def show(self, setting: str) -> str:
        """A setting as the report prints it beside its arm."""
        if self.clip_is_knob:
            return f"x{setting}"
        return f"lr {setting.removesuffix(NO_CLIP)}" + (", no clip" if setting.endswith(NO_CLIP) else "")


FAMILIES = {
    "F1a": "H1, each at its tuned width: window W minus W = 1",
    "F1b": "H1, both unclipped: window W minus W = 1",
    "F1c": "H1, at matched KL per update: window W at the width whose tuning KL is nearest W = 1's, minus W = 1",
    "F2": "H2, alignment: unit-aligned segments minus offset / shuffled ones, each at its tuned width",
    "F3": "H3, adaptive: each criterion minus the best fixed window W*, each at its tuned width",
}


def part1() -> Design:
    """Part 1's registered design (a test passes a smaller one to ``run``)."""
    return Design(
        "speech", CELLS, WINDOWS, ALIGNED, (OFFSET, SHUFFLED), WIDTHS, "width", "narrowest width", TUNE_SEEDS,
        HELD_SEEDS, FAMILIES, clip_is_knob=True,
    )  # fmt: skip


def windows_of(choices: list[dict], cell: str) -> list[dict]:
    return [c for c in choices if c["cell"] == cell and c["loss"].startswith(FIXED)]


def best_window(choices: list[dict], cell: str) -> dict | None:
    """W*: the window with the best tuning mean at its chosen setting (ties: the shorter); None before a choice."""
    windows = windows_of(choices, cell)
    return max(windows, key=lambda c: (c["tune_final"], -int(c["loss"][len(FIXED) :]))) if windows else None


def comparisons(choices: list[dict], design: Design | None = None) -> list[tuple[str, str, tuple, tuple]]:
    """(family, cell, arm a, arm b) of every registered test; an arm is (loss, setting), the setting "" where
    ``choices`` has none yet (the test is listed, not run)."""
    d = design or part1()
    pick = {(c["cell"], c["loss"]): c for c in choices}

    def arm(cell: str, loss: str, key: str = "best_band") -> tuple[str, str]:
        return loss, str(pick.get((cell, loss), {}).get(key, ""))

    if d.pairs:
        return [(family, cell, arm(cell, a), arm(cell, b)) for cell in d.cells for family, a, b in d.pairs]
    out = []
    for cell in d.cells:
        token = arm(cell, TOKEN)
        for w in d.windows[1:]:
            loss = f"{FIXED}{w}"
            out += [
                ("F1a", cell, arm(cell, loss), token),
                ("F1b", cell, (loss, d.unclipped(arm(cell, loss)[1])), (TOKEN, d.unclipped(token[1]))),
                ("F1c", cell, arm(cell, loss, "kl_band"), token),
            ]
        for control in d.controls:
            out.append(("F2", cell, arm(cell, d.aligned), arm(cell, control)))
        star = best_window(choices, cell)
        for name in d.adaptive:
            out.append(("F3", cell, arm(cell, name), (star["loss"], star["best_band"]) if star else ("W*", "")))
    return out


def tests(runs: list[dict], choices: list[dict], design: Design | None = None) -> list[dict]:
    """Every registered test on the held-out seeds, with Holm's correction within each family (sign-flip p for
    a difference, TOST p for equivalence). A test whose runs are not on disk yet stays, as "not run", and counts
    in its family's correction with p = 1 (conservative while a part is partial; no effect once it is run)."""
    d = design or part1()
    held = stats.held(runs, d.held_seeds[0])
    rows = []
    for family, cell, a, b in comparisons(choices, d):
        row = stats.paired(held, d.task, cell, a, b, metric=d.metric, margin=d.margin)
        rows.append(
            {"family": family, "cell": cell, "arm": a[0], d.knob: a[1], "vs": b[0], f"vs_{d.knob}": b[1], **row}
        )
    return judge(rows, d.margin)


def judge(rows: list[dict], margin: float, run=lambda r: bool(r.get("seeds"))) -> list[dict]:
    """Holm's correction within each family of ``rows`` (``stats.paired_summary`` rows with a ``family``), for the
    difference tests (sign-flip p) and the equivalence tests (TOST p), a test not ``run`` yet counting with p = 1;
    then each run test's outcome (``NOT_RUN`` for the others)."""
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        for key, out in (("p_signflip", "p_holm"), ("p_tost", "p_tost_holm")):
            adjusted = stats.holm([r[key] if run(r) else 1.0 for r in mine])
            for r, p in zip(mine, adjusted, strict=True):
                if run(r):
                    r[out] = p
    for r in rows:
        if not run(r):
            r["outcome"] = NOT_RUN
            continue
        r["different"] = r["p_holm"] < ALPHA
        r["equivalent"] = r["p_tost_holm"] < ALPHA
        side = ("above" if r["diff"] > 0 else "below") if r["different"] else ""
        within = f"within ±{margin}" if r["equivalent"] else ""
        r["outcome"] = ", ".join(x for x in (side, within) if x) or "—"
    return rows


def _above(r: dict) -> bool:
    return bool(r["different"]) and r["diff"] > 0


def _below(r: dict) -> bool:
    return bool(r["different"]) and r["diff"] < 0


def verdict(family: str, rows: list[dict], margin: float = MARGIN) -> str:
    """The registered rule for one family and cell. H1 (F1a/b/c): supported if some window is above W = 1,
    falsified if every one is equivalent or below. H2 (F2): supported if aligned is above both controls, falsified
    if equivalent to both or below either. Where a difference is also within the margin, the verdict says so."""
    if family == "F2":
        supported = all(_above(r) for r in rows)
        falsified = all(r["equivalent"] for r in rows) or any(_below(r) for r in rows)
    else:
        supported = any(_above(r) for r in rows)
        falsified = all(r["equivalent"] or _below(r) for r in rows)
    if supported:
        small = all(r["equivalent"] for r in rows if _above(r))
        return "supported" + (f" (every gain within ±{margin})" if small else "")
    return "falsified" if falsified else "inconclusive"


def decisions(rows: list[dict], margin: float = MARGIN) -> list[dict]:
    """The pre-registered decision rules per family and cell; H3 (F3) per criterion: holds if equivalent to W*
    or above it, falsified if below (said so where the shortfall is also within the margin)."""
    out = []
    for (family, cell), mine in _groups(rows).items():
        if any(r["outcome"] == NOT_RUN for r in mine):
            out.append({"family": family, "cell": cell, "arm": "", "verdict": NOT_RUN})
            continue
        if family != "F3":
            out.append({"family": family, "cell": cell, "arm": "", "verdict": verdict(family, mine, margin)})
            continue
        for r in mine:
            if _below(r):
                v = "falsified" + (f" (below, within ±{margin})" if r["equivalent"] else "")
            else:
                v = "holds" if r["equivalent"] or _above(r) else "inconclusive"
            out.append({"family": family, "cell": cell, "arm": r["arm"], "verdict": v})
    return out


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["cell"]), []).append(r)
    return groups


def check_choice(path: Path, choices: list[dict]) -> None:
    """The choice written before the held-out runs (``path``) must be the one its tuning runs make now."""
    keys = ("cell", "loss", "best_band", "kl_band")
    written = read_csv(path)
    if written and [[str(c[k]) for k in keys] for c in written] != [[str(c[k]) for k in keys] for c in choices]:
        raise SystemExit(f"{path} differs from the choice its tuning runs make: re-run --phase tune")


def design_table(d: Design) -> list[dict]:
    """A part's registered design as a table (``docs/choosing.md`` reads part 1's): seeds, settings, margin,
    families."""
    rows = {
        "tune_seeds": f"{d.tune_seeds[0]}-{d.tune_seeds[-1]}",
        "held_seeds": f"{d.held_seeds[0]}-{d.held_seeds[-1]}",
        "held_count": len(d.held_seeds),
        f"{d.knob}s": ", ".join(d.settings),
        "margin": d.margin,
        **d.families,
    }
    return [{"key": k, "value": v} for k, v in rows.items()]


def plot(rows: list[dict], path: Path, families: dict, margin: float = MARGIN, what: str = "final reward") -> None:
    plt = pyplot()
    families = list(families)
    fig, axes = plt.subplots(1, len(families), figsize=(4 * len(families), 4), squeeze=False)
    for ax, family in zip(axes[0], families, strict=True):
        mine = [r for r in rows if r["family"] == family and r.get("seeds")]
        for k, r in enumerate(mine):
            color = "tab:blue" if _above(r) else "tab:red" if _below(r) else "tab:green" if r["equivalent"] else "grey"
            ax.errorbar(k, r["diff"], yerr=[[r["diff"] - r["low"]], [r["high"] - r["diff"]]], fmt="o", color=color)
        ax.axhline(0, color="k", lw=0.8)
        for m in (-margin, margin):
            ax.axhline(m, color="tab:green", lw=0.6, ls="--")
        ax.set_xticks(range(len(mine)), [f"{r['cell']}\n{short(r['arm'])}" for r in mine], rotation=90, fontsize=5)
        ax.set_title(family, fontsize=9)
    axes[0][0].set_ylabel(f"held-out {what} difference (95 % t-interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def short(arm: str) -> str:
    return arm.replace(FIXED, "W=").replace("maspo_words~", "").replace("maspo_adaptive@adaptive_criterion=", "")


def verdict_section(verdicts: list[dict]) -> list[str]:
    """The report's verdicts under the pre-registered decision rules (every part's)."""
    return [
        "## Verdicts (the pre-registered decision rules)",
        "",
        markdown_table(verdicts),
        f"*Different*: Holm-adjusted sign-flip p < {ALPHA} within the family; *equivalent*: Holm-adjusted TOST p < "
        f"{ALPHA} with margin ±{MARGIN} final reward; `—`: neither.",
        "",
    ]


def family_sections(rows: list[dict], d: Design) -> list[str]:
    """Every registered test of each family, run or not (every part's)."""
    arm, vs = f"arm ({d.knob})", f"vs ({d.knob})"

    def fmt_row(r: dict) -> dict:
        if not r.get("seeds"):
            return {"cell": r["cell"], arm: short(r["arm"]), vs: short(r["vs"])} | {"outcome": NOT_RUN}
        return {
            "cell": r["cell"],
            arm: f"{short(r['arm'])} ({d.show(r[d.knob])})",
            vs: f"{short(r['vs'])} ({d.show(r[f'vs_{d.knob}'])})",
            "diff [95 % t]": f"{r['diff']:+.4f} [{r['low']:+.4f}, {r['high']:+.4f}]",
            "p sign-flip": r["p_signflip"],
            "Holm": r["p_holm"],
            "p TOST": r["p_tost"],
            "TOST Holm": r["p_tost_holm"],
            "outcome": r["outcome"],
        }

    lines = []
    for family, what in d.families.items():
        mine = [fmt_row(r) for r in rows if r["family"] == family]
        lines += [f"## {family}: {what}", "", markdown_table(mine, digits=4)]
    return lines


def bracket_note(choices: list[dict], d: Design) -> str:
    """Which arms' choices sit at the smallest setting (flagged *not bracketed below*), and at the largest where
    the design flags it (*not bracketed above*)."""
    edges = [(d.settings[0], d.smallest, "below")] + ([(d.settings[-1], d.largest, "above")] if d.largest else [])
    notes = []
    for setting, words, side in edges:
        arms = ", ".join(f"{c['cell']} {c['loss']}" for c in choices if c["best_band"] == setting)
        notes.append(
            f"Chosen at the {words} (not bracketed {side}): {arms}."
            if arms
            else f"No arm's choice is at the {words} (every choice is bracketed {side})."
        )
    return " ".join(notes)
