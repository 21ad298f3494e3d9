"""End-to-end: segment_rule=words in verl's real trainer on CPU. The word ids travel from a reward manager
through verl's agent loop, TransferQueue, data-parallel split and micro-batching to the loss
(maspo_verl.batch documents the path); the segments the loss finds are checked against the count the
reward computed from the same response tokens. The same run writes inspect files
(``policy_loss.inspect_dir``), which ``python -m maspo_verl.lab segments`` turns into plots and a report;
both are checked against values computed here from the same files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tests.e2e.conftest import manager_overrides

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_word_ids_reach_the_loss_aligned_with_the_tokens(local_run, tmp_path):
    """Known word ids (depending on each response's tokens) and, as the score, the segment count they
    give: the loss's segments per sequence equal the mean score (2 mini-batches of 8 responses, so
    verl's mean over micro-batches is the batch mean). A shifted, truncated or misrouted row would
    change the count. One response in four has no ids and takes the fallback (fixed, W=8)."""
    from tests.e2e.reward_managers import WINDOW

    manager = Path(__file__).with_name("reward_managers.py")
    pl = "actor_rollout_ref.actor.policy_loss"
    run = local_run(
        [
            "loss=maspo_words",
            f"{pl}.words_fallback_rule=fixed",
            f"{pl}.segment_window={WINDOW}",
            f"{pl}.min_segment_len=0",
            f"{pl}.max_segment_len=0",
            f"{pl}.inspect_dir={tmp_path / 'inspect'}",
            f"{pl}.inspect_every=1",
            *manager_overrides(manager, "KnownWordsRewardManager"),
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    metrics = run.steps[1]
    assert metrics["response_length/mean"] == 32, context
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx(metrics["critic/score/mean"], abs=1e-6), context
    assert metrics["actor/ratio/words_fallback_frac"] == pytest.approx(0.25, abs=1e-9), context
    assert metrics["actor/ratio/segments_per_seq"] > math.ceil(32 / WINDOW), context  # words, not the window
    assert "word ids do not match" not in run.full_log, context
    check_inspection(tmp_path / "inspect", tmp_path / "report")


def starts(values: list[int]) -> set[int]:
    """Where a new run of equal values begins (the first position left out)."""
    return {t for t in range(1, len(values)) if values[t] != values[t - 1]}


def check_inspection(folder: Path, out: Path) -> None:
    """The loss wrote step 1 on rank 0: response ids and word ids aligned as the reward made them, the
    words rule's segments (fixed W for rows without words) and each segment's ratio exp(mean(lp - old));
    the lab command's report and grid agree with counts made here from the same file."""
    from maspo_verl.lab.__main__ import main
    from tests.e2e.reward_managers import WINDOW, known_words

    assert sorted(p.name for p in folder.iterdir()) == ["step_000001.json"]
    doc = json.loads((folder / "step_000001.json").read_text())
    assert doc["loss_mode"] == "maspo" and doc["policy_loss"]["segment_rule"] == "words"
    lengths, word_starts, with_words = [], [], 0
    for resp in doc["responses"]:
        n = sum(resp["mask"])
        ids, words = resp["response_ids"][:n], resp["word_ids"][:n]
        has_words = any(w != -1 for w in words)
        with_words += has_words
        if has_words:
            assert words == known_words(ids)
            expected = starts(words)
        else:
            expected = set(range(WINDOW, n, WINDOW))
        assert starts(resp["segment_ids"][:n]) == expected
        seg = resp["segments"]
        for start, size, ratio in zip(seg["start"], seg["length"], seg["ratio"], strict=True):
            delta = [resp["log_probs"][t] - resp["old_log_probs"][t] for t in range(start, start + size)]
            assert ratio == pytest.approx(math.exp(sum(delta) / size), rel=1e-4)
        lengths.append(n)
        word_starts.append(starts(words))
    assert 0 < with_words

    main(["segments", "--from", str(folder), "--out", str(out)])
    for name in ("README.md", "suggestions.json", "grid.csv", "segment_lengths.png", "boundary_f1.png", "strips.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "README.md").read_text()
    rows = len(doc["responses"])
    assert f"equal the ones the loss wrote: {rows} / {rows} responses" in report
    grid = {int(float(r["threshold"])): r for r in csv.DictReader(open(out / "grid.csv")) if r["rule"] == "fixed"}
    for window in (2, 4, 8):
        mean_len = sum(lengths) / sum(math.ceil(n / window) for n in lengths)
        pred = [set(range(window, n, window)) for n in lengths]
        hit = sum(len(p & r) for p, r in zip(pred, word_starts, strict=True))
        precision, recall = hit / sum(map(len, pred)), hit / sum(map(len, word_starts))
        f1 = 2 * precision * recall / (precision + recall) if hit else 0.0
        assert float(grid[window]["mean_len"]) == pytest.approx(mean_len)
        assert float(grid[window]["f1_k0"]) == pytest.approx(f1)
        # the report's fixed-window table shows the same numbers (3 decimals)
        assert f"| {window} | {mean_len:.3f} |" in report
