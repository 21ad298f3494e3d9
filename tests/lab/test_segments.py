"""``python -m maspo_verl.lab segments`` on code streams with known boundaries: piecewise-stable FSQ digits
(XCodec2's [4]*8) with small within-unit jitter and old-log-prob dips at unit starts. The suggested
thresholds are applied here with the project's segmentation and scored against the true unit starts by
exact set intersection; codes in random order are reported as having no usable locality."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from maspo_verl.config import GranularLossConfig
from maspo_verl.core.segments import compute_segment_ids
from maspo_verl.lab.__main__ import main
from maspo_verl.lab.studies import segments as lab

LEVELS = [4] * 8
OFFSET = 128264  # the default codec_offset: the command adds it to the codes


def stream(n: int, seed: int, random_order: bool = False) -> list[dict]:
    """Utterances of units 5-20 codes long: one base code per unit, each digit moved by +-1 with
    probability 0.1 per frame; old log-probs ~ -0.5 inside a unit, -4 on its first token. With
    ``random_order`` the codes of each utterance are shuffled and the log-probs have no dips."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        codes, words, lps = [], [], []
        unit = 0
        while len(codes) < 100:
            base = rng.integers(0, 4, len(LEVELS))
            for t in range(int(rng.integers(5, 21))):
                d = base.copy()
                moved = rng.random(len(LEVELS)) < 0.1
                d[moved] = np.clip(d[moved] + rng.choice([-1, 1], int(moved.sum())), 0, 3)
                codes.append(int(sum(int(x) << (2 * k) for k, x in enumerate(d))))
                words.append(unit)
                lps.append(float(rng.normal(-4.0, 0.2) if t == 0 else rng.normal(-0.5, 0.1)))
            unit += 1
        if random_order:
            codes = [int(c) for c in rng.permutation(codes)]
            lps = [float(rng.normal(-0.5, 0.3)) for _ in lps]
        rows.append({"codes": codes, "word_ids": words, "old_log_probs": lps})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_command(tmp_path, rows, *extra) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = write_jsonl(tmp_path / "codes.jsonl", rows)
    out = tmp_path / "out"
    main(["segments", "--from", str(src), "--out", str(out), *extra])
    return json.loads((out / "suggestions.json").read_text())


def apply(overrides: list[str], rows: list[dict]) -> list[set[int]]:
    """Segment starts (first token left out) of the suggested overrides, by the project's segmentation."""
    fields = {}
    for item in overrides:
        key, _, value = item.removeprefix(lab.PREFIX).partition("=")
        fields[key] = yaml.safe_load(value)
    cfg = GranularLossConfig(loss_mode="maspo", **fields)
    width = max(len(r["codes"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    old = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["codes"])
        ids[i, :n] = torch.tensor(r["codes"]) + OFFSET
        old[i, :n] = torch.tensor(r["old_log_probs"])
        mask[i, :n] = True
    seg = compute_segment_ids(mask, cfg, old_log_prob=old, token_ids=ids)
    return [{t for t in range(1, len(r["codes"])) if seg[i, t] != seg[i, t - 1]} for i, r in enumerate(rows)]


def true_starts(rows) -> list[set[int]]:
    return [{t for t in range(1, len(r["word_ids"])) if r["word_ids"][t] != r["word_ids"][t - 1]} for r in rows]


def exact_f1(pred: list[set[int]], ref: list[set[int]]) -> float:
    hit = sum(len(p & r) for p, r in zip(pred, ref, strict=True))
    precision, recall = hit / sum(map(len, pred)), hit / sum(map(len, ref))
    return 2 * precision * recall / (precision + recall)


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    rows = stream(40, seed=1)
    return rows, run_command(tmp_path_factory.mktemp("units"), rows)


@pytest.mark.parametrize("rule", ["tokenval/fsq_l1", "tokenval/fsq_hamming", "logprob/absolute", "logprob/per_sample"])
def test_suggested_thresholds_recover_the_true_boundaries(rule, units):
    rows, suggestions = units
    s = suggestions["rules"][rule]
    assert s["usable"] is True, s
    f1 = exact_f1(apply(s["by_word_f1"]["overrides"], rows), true_starts(rows))
    assert f1 >= 0.9, (rule, f1, s)


def test_target_length_suggestion_is_the_grid_point_closest_to_the_target(units, tmp_path_factory):
    rows, suggestions = units
    pick = suggestions["rules"]["tokenval/fsq_l1"]["by_target_len"]
    tokens = sum(len(r["codes"]) for r in rows)
    lengths = {}
    for threshold in range(24):
        overrides = [o for o in pick["overrides"] if "tokenval_threshold" not in o]
        starts = apply([*overrides, f"{lab.PREFIX}tokenval_threshold={threshold}"], rows)
        lengths[threshold] = tokens / (len(rows) + sum(map(len, starts)))
    best = min(lengths, key=lambda t: (abs(lengths[t] - 15.0), t))
    assert pick["threshold"] == best and pick["mean_len"] == pytest.approx(lengths[best])


def test_random_code_order_has_no_usable_locality(tmp_path):
    suggestions = run_command(tmp_path, stream(40, seed=2, random_order=True))
    for rule in ("tokenval/id", "tokenval/fsq_l1", "tokenval/fsq_hamming"):
        s = suggestions["rules"][rule]
        assert s["usable"] is False and s["by_word_f1"] is None and s["by_target_len"] is None, s
        assert abs(s["locality"]) < 0.05
    report = (tmp_path / "out" / "README.md").read_text()
    # with word ids the F1 gain decides, and the report says so (not "no usable locality")
    assert "no word-boundary F1 gain over fixed windows of the same mean length (< 0.1)" in report
    assert "no usable locality" not in report


def test_the_reason_given_is_the_one_that_decided(tmp_path, capsys):
    """Ordered codes with words that do not follow them: locality is high (above the 0.2 cut-off) but
    the F1 gain is not, and the report names the F1 gain; the console shows a headline and the path,
    not the report."""
    rows = stream(30, seed=4)
    rng = np.random.default_rng(0)
    for r in rows:  # word boundaries at random places: no rule finds them better than windows
        cuts = np.sort(rng.choice(np.arange(1, len(r["codes"])), size=len(r["codes"]) // 16, replace=False))
        r["word_ids"] = [int(np.searchsorted(cuts, t, side="right")) for t in range(len(r["codes"]))]
    s = run_command(tmp_path, rows)["rules"]["tokenval/fsq_l1"]
    assert s["usable"] is False and s["locality"] > 0.2 and s["f1_gain"] < 0.1, s
    report = (tmp_path / "out" / "README.md").read_text()
    assert "no usable locality" not in report and "no word-boundary F1 gain" in report
    console = capsys.readouterr().out.strip().splitlines()
    assert len(console) == 3 and len(report.splitlines()) > 20  # the headline, the report, the folder
    assert console[0].startswith("segments: 30 responses") and "not usable: " in console[0]
    assert console[1].startswith(f"report: {tmp_path / 'out' / 'README.md'}")


def test_without_words_locality_decides(tmp_path):
    rows = [{"codes": r["codes"]} for r in stream(20, seed=3)]
    shuffled = [{"codes": r["codes"]} for r in stream(20, seed=3, random_order=True)]
    ordered = run_command(tmp_path / "a", rows)["rules"]["tokenval/fsq_l1"]
    noise = run_command(tmp_path / "b", shuffled)["rules"]["tokenval/fsq_l1"]
    assert ordered["usable"] is True and ordered["locality"] > 0.5 and ordered["by_word_f1"] is None
    assert noise["usable"] is False
    assert "no usable locality (< 0.2)" in (tmp_path / "b" / "out" / "README.md").read_text()


def test_grid_rows_match_independent_counts(units, tmp_path_factory):
    """grid.csv's fixed-window rows: mean length = tokens / sum ceil(L / W); exact-match F1 against the
    unit starts from set intersection."""
    rows, _ = units
    out = next(p for p in tmp_path_factory.getbasetemp().rglob("grid.csv") if "units" in str(p))
    grid = {int(float(r["threshold"])): r for r in csv.DictReader(open(out)) if r["rule"] == "fixed"}
    ref = true_starts(rows)
    for window in (1, 4, 15):
        n = [len(r["codes"]) for r in rows]
        assert float(grid[window]["mean_len"]) == pytest.approx(sum(n) / sum(math.ceil(x / window) for x in n))
        pred = [set(range(window, x, window)) for x in n]
        assert float(grid[window]["f1_k0"]) == pytest.approx(exact_f1(pred, ref))


def _max_matching(pred, ref, k) -> int:
    """Maximum bipartite matching by augmenting paths (a reference for ``lab.matches``)."""
    owner: dict[int, int] = {}

    def augment(i, seen):
        for j, r in enumerate(ref):
            if abs(pred[i] - r) <= k and j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return sum(augment(i, set()) for i in range(len(pred)))


def test_greedy_matching_is_a_maximum_matching():
    rng = np.random.default_rng(0)
    for _, k in itertools.product(range(200), (0, 1, 2, 3)):
        pred = np.unique(rng.integers(0, 30, rng.integers(0, 12)))
        ref = np.unique(rng.integers(0, 30, rng.integers(0, 12)))
        assert lab.matches(pred, ref, k) == _max_matching(list(pred), list(ref), k)


def test_bad_input_names_the_problem(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"codes": [1, 2, 70000]}])
    with pytest.raises(SystemExit, match="codes must lie in 0..65535"):
        main(["segments", "--from", str(src), "--out", str(tmp_path / "o")])
    src = write_jsonl(tmp_path / "good.jsonl", [{"codes": [1, 2, 3]}])
    with pytest.raises(SystemExit, match="unknown fields.*tokenval_treshold"):
        main(["segments", "--from", str(src), "--out", str(tmp_path / "o"), "--set", "tokenval_treshold=3"])


def test_parquet_with_word_times_gives_the_speech_rewards_word_ids(tmp_path):
    """word_times in seconds become word ids by the speech reward's own rule (50 codes/s)."""
    from maspo_verl.speech.asr import TimedWord
    from maspo_verl.speech.spans import word_token_ids
    from maspo_verl.util import write_parquet

    times = [[0.0, 0.21], [0.25, 0.6], [0.61, 0.9]]
    write_parquet([{"codes": list(range(50)), "word_times": times}], str(tmp_path / "c.parquet"))
    corpus = lab.read_codes([str(tmp_path / "c.parquet")], lab.base_settings(None), 50.0)
    expected = word_token_ids([TimedWord("", a, b) for a, b in times], 50)
    assert corpus.word_ids[0].tolist() == expected and corpus.old_log_prob is None
    assert corpus.token_ids[0].tolist() == [OFFSET + c for c in range(50)]


def test_the_calibration_guide_says_where_the_report_puts_the_overrides():
    """docs/calibration.md names the report's section with the overrides and what comes before and after
    it; the committed report (docs/results/segments/) has that layout."""
    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs" / "calibration.md").read_text()
    assert (
        'in its section\n"Suggested overrides" (after the boundary check at the top, before the per-rule tables'
        in guide
    )
    headings = [
        line for line in (root / "docs/results/segments/README.md").read_text().splitlines() if line.startswith("## ")
    ]
    assert headings.index("## Suggested overrides") == 1 and headings[-2:] == ["## Per rule", "## Figures"], headings
