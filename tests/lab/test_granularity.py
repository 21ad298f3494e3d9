"""The pre-registered granularity study (``maspo_verl.lab.studies.granularity``): its segment controls, the task's unit
length, its decision rules, resuming, and the command end to end on a tiny configuration."""

import csv
from dataclasses import replace

import pytest
import torch

from maspo_verl.lab.__main__ import parse
from maspo_verl.lab.engine import grid, protocol
from maspo_verl.lab.engine.common import full_log
from maspo_verl.lab.engine.tuning import choose
from maspo_verl.lab.studies import granularity as g


def _units(lengths):
    return torch.tensor([k for k, n in enumerate(lengths) for _ in range(n)])[None, None, :]


def _lengths(ids):
    return torch.unique_consecutive(ids.flatten(), return_counts=True)[1].tolist()


def test_unit_segments_align_offset_by_half_a_unit_and_shuffle_the_lengths():
    units = _units([4, 6, 2, 8])  # starts 0, 4, 10, 12; midpoints 2, 7, 11, 16
    gen = torch.Generator().manual_seed(0)
    runs = torch.zeros_like(units)
    assert torch.equal(grid.unit_segments("units", runs, units, gen), units)
    offset = grid.unit_segments("units_offset", runs, units, gen)
    assert _lengths(offset) == [2, 5, 4, 5, 4]  # boundaries at the midpoints 2, 7, 11, 16
    for _ in range(5):
        shuffled = grid.unit_segments("units_shuffled", runs, units, gen)
        assert sorted(_lengths(shuffled)) == [2, 4, 6, 8]
    assert torch.equal(grid.unit_segments("", runs, units, gen), runs)
    with pytest.raises(ValueError, match="allowed"):
        grid.unit_segments("unit", runs, units, gen)


def test_the_unit_median_sets_the_speech_units_lengths():
    short = grid.make_task("speech", 96, list(range(40)))
    long = grid.make_task("speech", 96, list(range(40)), unit=24)
    lengths = {24: [], 6: []}
    for task, m in ((short, 6), (long, 24)):
        for row in task.unit_id:
            lengths[m] += _lengths(row)[:-1]  # the last unit is cut at the response's end
    assert min(lengths[6]) >= 3 and max(lengths[6]) <= 15
    assert min(lengths[24]) >= 12 and max(lengths[24]) <= 60
    assert sorted(lengths[24])[len(lengths[24]) // 2] == pytest.approx(24, abs=3)
    assert sorted(lengths[6])[len(lengths[6]) // 2] == pytest.approx(6, abs=1)


def _t(diff, different, equivalent):
    return {"diff": diff, "different": different, "equivalent": equivalent}


def test_the_decision_rules_are_the_registered_ones():
    up, down, same, none = _t(0.05, True, False), _t(-0.05, True, False), _t(0.0, False, True), _t(0.01, False, False)
    assert protocol.verdict("F1a", [none, up, down]) == "supported"
    assert protocol.verdict("F1a", [same, down]) == "falsified"
    assert protocol.verdict("F1a", [same, none]) == "inconclusive"
    assert protocol.verdict("F1a", [_t(0.01, True, True), same]) == f"supported (every gain within ±{protocol.MARGIN})"
    assert protocol.verdict("F2", [up, up]) == "supported"
    assert protocol.verdict("F2", [up, none]) == "inconclusive"
    assert protocol.verdict("F2", [up, down]) == "falsified"
    assert protocol.verdict("F2", [same, same]) == "falsified"
    rows = [r | {"family": "F3", "cell": "c", "arm": a, "outcome": "x"} for r, a in ((same, "a"), (down, "b"))]
    rows.append(_t(-0.01, True, True) | {"family": "F3", "cell": "c", "arm": "d", "outcome": "x"})
    assert [v["verdict"] for v in protocol.decisions(rows)] == [
        "holds",
        "falsified",
        f"falsified (below, within ±{protocol.MARGIN})",
    ]


def test_the_registered_seeds_are_fresh_and_disjoint():
    used = set(range(32))  # every committed grid study: seeds 0-31 (tables s, targets 1000 + s)
    generators = lambda seeds: set(seeds) | {1000 + s for s in seeds}  # noqa: E731
    assert not generators(protocol.TUNE_SEEDS) & generators(protocol.HELD_SEEDS)
    assert not (generators(protocol.TUNE_SEEDS) | generators(protocol.HELD_SEEDS)) & generators(used)
    assert len(protocol.HELD_SEEDS) >= 64


def test_the_command_tunes_then_judges_and_resumes(tmp_path):
    small = replace(
        protocol.part1(), cells=("L12/stale1/U2/lr0.5",), windows=(1, 2, 12), settings=("1", "inf"), tune_seeds=(7, 8),
        held_seeds=(20, 21, 22),
    )  # fmt: skip

    def main(argv):  # the lab command, on the small design
        with full_log(tmp_path / "lab.log"):
            g.run(parse(argv), argv, small)

    base = ["granularity", "--out", str(tmp_path), "--steps", "3", "--workers", "1", "--groups", "2",
            "--group-size", "2"]  # fmt: skip
    main([*base, "--phase", "tune"])
    assert (tmp_path / "choice.csv").is_file() and not (tmp_path / "tests.csv").exists()
    with open(tmp_path / "runs.csv") as f:
        choices = choose(list(csv.DictReader(f)), 20, baseline=protocol.TOKEN)
    order = [g._key(j) for j in g.tested_first(g.jobs_of(small, small.held_seeds), choices, small)]
    read = {
        (c, *arm) for _, c, *arms in protocol.comparisons(choices, small) for arm in arms
    }  # by hand, not _read_by_tests
    assert set(order[: len(read)]) == read and not set(order[len(read) :]) & read  # what a test reads runs first
    main([*base, "--phase", "held", "--resume"])
    with open(tmp_path / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 8 * 2 * 5  # arms (windows 3, units 3, adaptive 2) x widths x seeds
    assert {int(r["seed"]) for r in runs} == {7, 8, 20, 21, 22}
    with open(tmp_path / "tests.csv") as f:
        tests = list(csv.DictReader(f))
    assert [r["family"] for r in tests].count("F1a") == 2 and [r["family"] for r in tests].count("F2") == 2
    assert all(r["seeds"] == "3" and r["signflip"] == "exact" for r in tests)
    assert "## F3" in (tmp_path / "README.md").read_text()
    before = (tmp_path / "runs.csv").read_text()
    main([*base, "--phase", "all", "--resume"])  # nothing missing: no job runs again
    assert (tmp_path / "runs.csv").read_text() == before
