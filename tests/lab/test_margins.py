"""``lab margins``: part 1's registered tests re-judged at other equivalence margins. At the registered margin it
is part 1's committed tests and verdicts; a wider margin can only make more tests equivalent; the command writes
its tables and names what changed."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from maspo_verl.lab.engine import protocol as g
from maspo_verl.lab.studies import margins

PART1 = Path(__file__).resolve().parents[2] / "docs" / "results" / "granularity"


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def judged():
    return margins.judged(_csv(PART1 / "runs.csv"), _csv(PART1 / "choice.csv"), [0.02, 0.05])


def test_the_registered_margin_gives_part_1s_committed_tests_and_verdicts(judged):
    outcomes, verdicts = judged
    mine = [r for r in outcomes if r["margin"] == g.MARGIN]
    committed = _csv(PART1 / "tests.csv")
    assert len(mine) == len(committed) == 66
    for r, c in zip(mine, committed, strict=True):
        assert (r["family"], r["cell"], r["arm"], r["outcome"]) == (c["family"], c["cell"], c["arm"], c["outcome"])
        assert r["p_tost_holm"] == float(c["p_tost_holm"])
    registered = [{k: v[k] for k in ("family", "cell", "arm", "verdict")} for v in verdicts if v["margin"] == g.MARGIN]
    assert registered == _csv(PART1 / "decisions.csv")


def test_a_wider_margin_never_makes_a_test_less_equivalent(judged):
    outcomes, _ = judged
    p = {(r["margin"], r["family"], r["cell"], r["arm"]): r["p_tost_holm"] for r in outcomes}
    keys = {k[1:] for k in p}
    assert all(p[(0.02, *k)] >= p[(0.03, *k)] >= p[(0.05, *k)] for k in keys)
    assert any(p[(0.02, *k)] > p[(0.05, *k)] for k in keys)
    within = {m: sum("within" in r["outcome"] for r in outcomes if r["margin"] == m) for m in (0.02, 0.03, 0.05)}
    assert within[0.02] <= within[0.03] <= within[0.05], within


def test_changed_lists_only_what_moved_beside_the_registered_value():
    rows = [
        {"margin": g.MARGIN, "family": "F1a", "verdict": "inconclusive"},
        {"margin": 0.05, "family": "F1a", "verdict": "falsified"},
        {"margin": 0.02, "family": "F1a", "verdict": "inconclusive"},
        {"margin": g.MARGIN, "family": "F3", "verdict": "falsified"},
        {"margin": 0.05, "family": "F3", "verdict": "falsified (below, within ±0.05)"},
    ]
    assert margins.changed(rows, "verdict", ("family",), margins._verdict) == [
        {"family": "F1a", "margin": "±0.05", "registered": "inconclusive", "verdict": "falsified"}
    ]
    assert len(margins.changed(rows, "verdict", ("family",))) == 2  # every word counts without ``word``
    assert margins._outcome("below, within ±0.02") == margins._outcome("below, within ±0.03") != "below"


def test_the_command_writes_its_tables_and_refuses_a_folder_without_runs(tmp_path):
    from maspo_verl.lab.__main__ import main

    main(["margins", "--from", str(PART1), "--margins", "0.05", "--out", str(tmp_path / "out")])
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "±0.05" in readme and "## Verdicts that change" in readme
    assert {r["margin"] for r in _csv(tmp_path / "out" / "verdicts.csv")} == {"0.03", "0.05"}
    with pytest.raises(SystemExit, match="runs.csv and choice.csv"):
        main(["margins", "--from", str(tmp_path), "--out", str(tmp_path / "none")])
