"""The arithmetic task: deterministic rows whose stated answer is what the question's words compute
(re-derived here from the text), graded by the math recipe's reward."""

import re

import pytest

from maspo_verl.pretrained import arith


def solve(question: str) -> int:
    """The answer read off the question's words, independently of the generator."""
    if m := re.search(r"has (\d+) bags with (\d+) ", question):
        return int(m[1]) * int(m[2])
    total = int(re.search(r"has (\d+) ", question)[1])
    for verb, n in re.findall(r"(gets|gives away) (\d+)", question):
        total += int(n) if verb == "gets" else -int(n)
    return total


@pytest.mark.parametrize("steps", [1, 2])
def test_answers_are_what_the_words_compute(steps):
    pairs = arith.problems(300, seed=3, steps=steps, max_operand=30)
    assert all(solve(q) == a and a >= 0 for q, a in pairs)
    kinds = {("bags" in q, "gets" in q, "gives" in q) for q, _ in pairs}
    assert len(kinds) >= (3 if steps == 1 else 2)  # every operation occurs


def test_same_seed_same_rows_other_seed_other_rows():
    assert arith.rows(20, 1, "train") == arith.rows(20, 1, "train")
    assert arith.problems(20, 1) != arith.problems(20, 2)
    assert arith.problems(20, 1, max_operand=10) != arith.problems(20, 1, max_operand=40)


def test_dataset_files_train_and_val_disjoint(tmp_path):
    import pandas as pd

    paths = arith.ensure_dataset(seed=0, cache_dir=tmp_path, n_train=50, n_val=10)
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert (len(train), len(val)) == (50, 10)
    questions = lambda df: {p[-1]["content"] for p in df["prompt"]}  # noqa: E731
    assert not questions(train) & questions(val)
    assert arith.ensure_dataset(seed=0, cache_dir=tmp_path, n_train=50, n_val=10) == paths


def test_graded_by_the_math_reward():
    pytest.importorskip("math_verify")
    from maspo_verl.math.reward import compute_score

    row = arith.rows(1, 0, "train")[0]
    truth = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], f"So it is \\boxed{{{truth}}}", truth)["score"] == 1.0
    assert compute_score(row["data_source"], f"So it is \\boxed{{{int(truth) + 1}}}", truth)["score"] == 0.0


@pytest.mark.parametrize("kwargs", [{"steps": 3}, {"max_operand": 1}, {"max_operand": "9"}])
def test_bad_difficulty_names_the_setting(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        arith.problems(4, 0, **kwargs)
