"""The worked arithmetic task: each stated answer is what the question's words compute (re-derived here from the
text), each line of the worked answer is true arithmetic ending at that answer, the rows are a pure function of
the seed, the splits are disjoint, and the math reward grades the worked answer."""

import re

import pytest

from maspo_verl.pretrained import arith
from maspo_verl.pretrained import arith_worked as w
from maspo_verl.validation import FieldError


def solve(question: str) -> int:
    """The answer read off the question's words, independently of the generator."""
    total = int(re.match(r"\w+ has (\d+) ", question)[1])
    for sentence in question.split(". ")[1:]:
        if m := re.search(r"gets (\d+) more", sentence):
            total += int(m[1])
        elif m := re.search(r"gives away (\d+)", sentence):
            total -= int(m[1])
            assert total >= 0, question
    return total


def changes(question: str) -> int:
    return len(re.findall(r"gets \d+ more|gives away \d+", question))


@pytest.mark.parametrize("steps,top", [(2, 5), (3, 10), (4, 30), (6, 50)])
def test_answers_are_what_the_words_compute(steps, top):
    triples = w.worked_problems(400, seed=3, steps=steps, max_operand=top)
    assert all(solve(q) == a and a >= 0 and changes(q) == steps for q, _, a in triples)
    kinds = {k for q, _, _ in triples for k in ("gets", "gives") if k in q}
    assert kinds == {"gets", "gives"}
    numbers = [int(n) for q, _, _ in triples for n in re.findall(r"(?:gets|away|has) (\d+)", q)]
    assert min(numbers) >= 1 and max(numbers) <= top
    assert max(numbers) == top  # the top operand is reached (400 problems)


def test_every_line_of_the_working_is_true_and_ends_at_the_answer():
    for q, working, a in w.worked_problems(300, seed=5, steps=4, max_operand=30):
        lines = working.split("\n")
        assert len(lines) == 6  # the start, a line per change, then the answer
        name, amount, item = re.match(r"(\w+) has (\d+) (\w+)\.", q).groups()
        amount = int(amount)
        assert lines[0] == f"{name} starts with {amount} {item}."
        for i, line in enumerate(lines[1:-1], 1):
            sums = re.findall(r"(\d+) ([-+]) (\d+) = (\d+)", line)
            assert len(sums) == 1 and line.startswith(f"Step {i}: "), line
            ((x, op, y, z),) = sums
            assert (int(x) + int(y) if op == "+" else int(x) - int(y)) == int(z), line
            assert int(x) == amount and f"had {amount} {item}" in line, (q, line)  # from the running amount
            amount = int(z)
            assert line.endswith(f"now {name} has {amount} {item}."), line
        assert amount == a and lines[-1] == f"At the end {name} has {a} {item}. The answer is \\boxed{{{a}}}."


def test_same_seed_same_rows_other_seed_or_difficulty_other_rows():
    assert w.rows(20, 1, "train", 3, 20) == w.rows(20, 1, "train", 3, 20)
    assert w.problems(20, 1) != w.problems(20, 2)
    assert w.problems(20, 1, max_operand=10) != w.problems(20, 1, max_operand=40)
    assert w.problems(20, 1, steps=3) != w.problems(20, 1, steps=4)


def test_prompt_shows_a_worked_example_of_the_same_steps_with_both_kinds():
    for steps in range(w.STEPS[0], w.STEPS[1] + 1):
        question, working = w.example(steps, 30)
        assert changes(question) == steps and solve(question) == int(re.search(r"boxed\{(\d+)\}", working)[1])
        assert "gets" in question and "gives" in question
        numbers = re.findall(r"(?:gets|away|has) (\d+)", question)
        assert len(set(numbers)) == len(numbers) == steps + 1
        assert w.EXAMPLE_NAME not in w.NAMES and question.startswith(w.EXAMPLE_NAME)
    turns = w.prompt("Q?", 3, 20)
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"] == w.example(3, 20)[1] and turns[2]["content"].startswith("Q? ")


def test_dataset_files_train_and_val_disjoint(tmp_path):
    import pandas as pd

    paths = w.ensure_dataset(seed=7, steps=3, max_operand=20, cache_dir=tmp_path, n_train=50, n_val=20)
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert (len(train), len(val)) == (50, 20)
    questions = lambda df: {p[-1]["content"] for p in df["prompt"]}  # noqa: E731
    assert not questions(train) & questions(val)
    assert set(val["extra_info"].map(lambda e: e["seed"])) == {7 + arith.VAL_OFFSET}
    assert set(train["data_source"]) == {w.DATA_SOURCE}
    assert w.ensure_dataset(seed=7, steps=3, max_operand=20, cache_dir=tmp_path, n_train=50, n_val=20) == paths
    assert w.N_VAL >= 101  # one validation problem is under 1 % of the accuracy


def test_graded_by_the_math_reward():
    pytest.importorskip("math_verify")
    from maspo_verl.math.reward import compute_score

    for _, working, a in w.worked_problems(20, seed=0, steps=4, max_operand=30):
        assert compute_score(w.DATA_SOURCE, working, str(a))["score"] == 1.0, working
        wrong = working.replace(f"\\boxed{{{a}}}", f"\\boxed{{{a + 1}}}")
        assert compute_score(w.DATA_SOURCE, wrong, str(a))["score"] == 0.0
        # the working's intermediate numbers are not answers: only the box is graded
        assert compute_score(w.DATA_SOURCE, working.rsplit("\n", 1)[0], str(a))["score"] == 0.0


def test_task_by_form_and_bad_settings_named(tmp_path):
    paths, what = w.ensure_task({"form": "worked", "steps": 3, "max_operand": 9}, 2, tmp_path)
    assert what == "arith worked (steps=3, max_operand=9)" and "arith-worked-v1-s3-m9-seed2" in paths["train"]
    paths, what = w.ensure_task({"steps": 1, "max_operand": 7}, 2, tmp_path)  # no form: arith's short answers
    assert what == "arith (steps=1, max_operand=7)" and "arith-v1-s1-m7-seed2" in paths["train"]
    bad = [({"form": "long"}, "maspo.arith.form"), ({"form": "worked", "steps": 1}, "maspo.arith.steps")]
    bad += [({"form": "worked", "steps": 7}, "maspo.arith.steps")]
    bad += [({"form": "worked", "steps": 3, "max_operand": 1}, "maspo.arith.max_operand")]
    for task, field in bad:
        with pytest.raises(FieldError, match=re.escape(field)) as info:
            w.ensure_task(task, 0, tmp_path)
        assert info.value.field == field
