"""docs/choosing.md's decision procedure and the README's "Which loss", generated from the pre-registered study's
verdicts: on a copy of the committed tables each line is checked against values read here from the CSVs, and a
verdict or outcome changed in the copy must change or withdraw the line that rests on it."""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import pytest

from maspo_verl import choosing
from tests.helpers import REPO

STUDY = REPO / choosing.RESULTS / choosing.GRANULARITY
# what a user must not meet on the decision path: cell codes and family labels
CODES = re.compile(r"L\d+/|stale\d|/U\d|\bu\d+\b|\bF[123][abc]?\b|\bG[13]\b|\bP4\b|family C|\bC[123]\b")


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.fixture
def root(tmp_path):
    """A checkout's results of the pre-registered study, copied (part 1's runs cut to one row a cell: the
    decision reads only each cell's learning rate from them)."""
    out = tmp_path / choosing.RESULTS / choosing.GRANULARITY
    shutil.copytree(STUDY, out, ignore=shutil.ignore_patterns("runs.csv", "*.png"))
    first = {}
    for r in _rows(STUDY / "runs.csv"):
        first.setdefault(r["cell"], r)
        if len(first) == 3:
            break
    _write(out / "runs.csv", list(first.values()))
    return tmp_path


def _edit(path: Path, match: dict, change: dict) -> None:
    rows = _rows(path)
    hit = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert hit, (path, match)
    for r in hit:
        r.update(change)
    _write(path, rows)


def _rule(rules: list[dict], head: str) -> dict:
    (rule,) = [r for r in rules if r["text"].startswith(f"**{head}")]
    return rule


def test_the_committed_lines_read_the_tables(root):
    rules = choosing.decision(root)
    choice = {(c["cell"], c["loss"]): c for c in _rows(STUDY / "choice.csv")}
    small_kl = float(choice["L96/stale2/U4", choosing.TOKEN_ARM]["tune_kl"])
    small = _rule(rules, "Small steps")
    assert f"KL per update up to {small_kl:.3f}" in small["text"] and "the table policy, lr 0.2" in small["text"]
    # every H1 test of the small-step cell, counted here: none above, those below by their means
    h1 = [
        t for t in _rows(STUDY / "tests.csv") if t["cell"] == "L96/stale2/U4" and t["family"] in ("F1a", "F1b", "F1c")
    ]
    below = [-float(t["diff"]) for t in h1 if t["outcome"] == "below"]
    assert not any(t["outcome"] == "above" for t in h1)
    assert f"{len(below)} tests below by {min(below):.3f}-{max(below):.3f}" in small["text"]
    large = _rule(rules, "Large or stale steps")
    warm_kl = float(_rows(STUDY / "warm" / "choice.csv")[2]["tune_kl"])  # W = 1's row
    assert _rows(STUDY / "warm" / "choice.csv")[2]["loss"] == choosing.TOKEN_ARM
    assert f"KL per update {warm_kl:.3f}" in large["text"]
    assert "`segment_window` 24 or 32" in large["text"] and "the table policy, lr 0.2" not in large["text"]
    assert "**Untested**: KL per update between" in _rule(rules, "Untested")["text"]
    retune = _rule(rules, "Re-tune")["text"]
    assert "W = 96 in the warm speech model, lr 1e-3 (+0.112 at its tuned step, +0.011 at matched KL" in retune
    assert "W = 8 in the table policy, lr 1, 24-token units" in retune
    assert "in 0 of 7 tests" in _rule(rules, "Aligning")["text"]
    assert "in 0 of 8 tests, below in 6" in _rule(rules, "`maspo_adaptive` never helped")["text"]
    assert all(r["tests"] for r in rules if not r["text"].startswith("**Untested"))


def test_a_small_step_cell_that_turns_supported_moves_to_the_sharing_line(root):
    folder = root / choosing.RESULTS / choosing.GRANULARITY
    _edit(folder / "decisions.csv", {"family": "F1a", "cell": "L96/stale2/U4"}, {"verdict": "supported"})
    _edit(
        folder / "tests.csv",
        {"family": "F1a", "cell": "L96/stale2/U4", "arm": "maspo_fixed@segment_window=2"},
        {"outcome": "above"},
    )
    rules = choosing.decision(root)
    small, large = _rule(rules, "Small steps"), _rule(rules, "Large or stale steps")
    assert "the table policy, lr 0.2" not in small["text"] and "the table policy, lr 0.2" in large["text"]
    # the small steps' bound is now part 4's KL per update, and the untested gap ends at this cell's
    kl4 = max(float(c["tune_kl"]) for c in _rows(STUDY / "vllm" / "choice.csv"))
    kl = float(next(c for c in _rows(STUDY / "choice.csv") if c["cell"] == "L96/stale2/U4")["tune_kl"])
    assert f"KL per update up to {kl4:.3f}" in small["text"]
    assert f"between {kl4:.3f} and {kl:.3f}" in _rule(rules, "Untested")["text"]
    assert "does not separate" not in small["text"]


def test_overlapping_kl_per_update_is_said(root):
    """A small-step setting with a larger KL per update than a setting where sharing helped: KL per update does
    not separate the two lines, both say so and no untested gap is claimed."""
    folder = root / choosing.RESULTS / choosing.GRANULARITY
    _edit(folder / "choice.csv", {"cell": "L96/stale2/U4", "loss": choosing.TOKEN_ARM}, {"tune_kl": "0.5"})
    rules = choosing.decision(root)
    assert "does not separate" in _rule(rules, "Small steps")["text"]
    assert "does not separate" in _rule(rules, "Large or stale steps")["text"]
    assert not [r for r in rules if r["text"].startswith("**Untested")]


def test_the_sharing_line_is_withdrawn_when_no_setting_supports_it(root):
    folder = root / choosing.RESULTS / choosing.GRANULARITY
    for path, cell in (
        (folder / "decisions.csv", "L96/stale2/U4/lr1"),
        (folder / "decisions.csv", "L96/stale2/U4/lr1/u24"),
        (folder / "warm" / "decisions.csv", "L96/stale2/U4"),
    ):
        _edit(path, {"family": "F1a", "cell": cell}, {"verdict": "inconclusive"})
    rules = choosing.decision(root)
    assert _rule(rules, "Large or stale steps")["text"].startswith("**Large or stale steps**: withdrawn")
    assert "no advice (withdrawn" in "\n".join(choosing.which_loss(root))
    assert not [r for r in rules if r["text"].startswith("**Re-tune")]  # no gain left to explain


def test_a_matched_kl_gain_reproduced_leaves_the_step_size_list(root):
    folder = root / choosing.RESULTS / choosing.GRANULARITY
    _edit(
        folder / "tests.csv",
        {"family": "F1c", "cell": "L96/stale2/U4/lr1/u24", "arm": "maspo_fixed@segment_window=8"},
        {"outcome": "above"},
    )
    retune = _rule(choosing.decision(root), "Re-tune")["text"]
    assert "W = 8 in the table policy" not in retune and "W = 16 in the table policy" in retune
    record = "\n".join(choosing.record_lines(root))
    assert "part 1, lr 1, 24-token units, W = 8" not in record and "part 1, lr 1, 24-token units, W = 16" in record


def test_alignment_or_adaptive_above_once_changes_its_never_line(root):
    folder = root / choosing.RESULTS / choosing.GRANULARITY
    _edit(folder / "warm" / "tests.csv", {"family": "F2"}, {"outcome": "above"})
    _edit(
        folder / "tests.csv",
        {"family": "F3", "cell": "L96/stale2/U4/lr1", "arm": "maspo_adaptive"},
        {"outcome": "above"},
    )
    rules = choosing.decision(root)
    texts = "\n".join(r["text"] for r in rules)
    assert "never helped" not in texts
    assert "above their unaligned controls in 1 of 7 tests (the warm speech model, lr 1e-3)" in texts
    assert "**`maspo_adaptive`**: above the best fixed window in 1 of 16 tests." in texts


def test_a_contradicted_engine_takes_part_2_out_of_the_lines(root):
    """Part 2's amendment: where verl's trainer contradicts the lab engine, the guide draws no conclusion from the
    engine's runs."""
    folder = root / choosing.RESULTS / choosing.GRANULARITY / "warm"
    assert "the warm speech model" in "\n".join(r["text"] for r in choosing.decision(root))
    _edit(folder / "confirmation.csv", {"arm": "W=96, trainer"}, {"different": "True", "outcome": "below"})
    text = "\n".join(r["text"] + " ".join(r["tests"]) for r in choosing.decision(root))
    assert "the warm speech model" not in text and "part 2" not in text
    assert "the table policy, lr 1" in _rule(choosing.decision(root), "Large or stale steps")["text"]


def test_the_record_says_which_matched_arms_were_not_matched_and_what_each_family_could_reach(root):
    record = "\n".join(choosing.record_lines(root))
    # part 2's matched-KL arms, their KL ratio to W = 1's computed here from the tuning table
    tuning = {(r["arm"], r["lr"]): float(r["ppo_kl"]) for r in _rows(STUDY / "warm" / "tuning.csv")}
    token = tuning[choosing.TOKEN_ARM, "1e-3"]
    for w, lr in (("2", "1e-3"), ("24", "1e-3"), ("96", "3e-3")):
        ratio = tuning[f"{choosing.WINDOW_ARM}{w}", lr] / token
        assert f"part 2, W = {w} at lr {lr}: {ratio:.2f}" in record
    assert "part 1, lr 1, W = 8" not in record  # matched within the factor
    # 12 seeds, 4 tests exact: 4 x 2/4096; the 90 % half-widths here are all above 0.03
    assert "part 2, F1a: 12 seeds, 4 tests: a difference reachable (smallest adjusted p 0.002)" in record
    assert "within reach (90 % half-width below 0.03) in 0 of 4" in record
    assert "part 4, P4: 4 seeds, 2 tests: no difference reachable (smallest adjusted p 0.25)" in record


def test_setting_words():
    assert (
        choosing.setting_words("L96/stale2/U4/lr1/u24")
        == "96 tokens, the rollout 2 updates stale, 4 updates a batch, lr 1, 24-token units"
    )
    assert choosing.setting_words("L96/stale2/U4", "0.2").endswith("4 updates a batch, lr 0.2")
    assert choosing.setting_words("L12/0.2/U1") == "12 tokens, log-prob noise 0.2, 1 update a batch"
    assert choosing.setting_words("L96/none/U4") == "96 tokens, on-policy rollout, 4 updates a batch"


def test_no_codes_on_the_users_path():
    readme = (REPO / "README.md").read_text()
    which = readme.split("<!-- generated: which_loss")[1].split("<!-- end of generated: which_loss")[0]
    assert len(which.strip().splitlines()) <= 10 + 1  # the marker line's tail, then at most 10 lines
    assert not CODES.findall(which), CODES.findall(which)
    guide = (REPO / choosing.PAGE).read_text()
    section = guide.split(choosing.DECISION_HEAD)[1].split("\n## ")[0]
    assert len([line for line in section.splitlines() if line.strip()]) <= 12
    assert not CODES.findall(section), CODES.findall(section)
    # generated from the same rules: a code in a rule's words would reach both
    for rule in choosing.decision(REPO):
        assert not CODES.findall(rule["text"] + rule["short"] + " ".join(rule["tests"]))
