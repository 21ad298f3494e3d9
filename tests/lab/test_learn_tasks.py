"""The learn command's toy tasks: decoding, the reward, the per-token scores (no trainer)."""

import random

import pytest

from maspo_verl.lab.engine.runs import parse_steps
from maspo_verl.lab.studies.learn import steps_to
from maspo_verl.local import learn_tasks as lt


def test_decode_text_and_speech():
    ids = [0, 5, 70, 71, 300, 65, 200]  # ka ka lo lo <special> lo nu
    assert [w for w, _, _ in lt.decode("text", ids)] == ["ka", "ka", "lo", "lo", "lo", "nu"]
    assert lt.decode("speech", ids) == [("ka", 0, 2), ("lo", 2, 4), ("lo", 5, 6), ("nu", 6, 7)]
    with pytest.raises(ValueError, match="allowed"):
        lt.decode("music", ids)


def test_edit_distance_by_hand():
    assert lt.edit_distance("ka lo mi".split(), "ka mi".split()) == 1
    assert lt.edit_distance([], "ka lo".split()) == 2
    assert lt.edit_distance("ka lo mi".split(), "lo ka mi nu".split()) == 3


def test_score_and_token_scores():
    # speech: ka (3 tokens) lo (2) nu (1) EOS vs "ka lo mi": one substitution -> 1 - 1/3
    ids = [0, 1, 2, 70, 71, 200, 258]
    value, per_token = lt.token_scores_of("speech", ids, "ka lo mi")
    assert value == pytest.approx(2 / 3)
    assert sum(per_token) == pytest.approx(value)
    assert len(per_token) == len(ids)
    assert min(per_token) == per_token[5]  # the substituted word's token carries the penalty
    assert lt.score("text", [0, 70, 130], "ka lo mi")[0] == 1.0
    assert lt.score("text", [], "ka lo mi")[0] == 0.0


def test_random_responses_give_a_rankable_reward():
    rng = random.Random(0)
    for task in lt.TASKS:
        values = {round(lt.score(task, [rng.randrange(264) for _ in range(12)], "ka lo mi")[0], 6) for _ in range(50)}
        assert len(values) > 3 and max(values) < 1


def test_dataset(tmp_path):
    import pandas as pd

    paths = lt.write_dataset(tmp_path, "speech", seed=1, n_train=8, n_val=2)
    train = pd.read_parquet(paths["train"])
    assert len(train) == 8 and len(pd.read_parquet(paths["val"])) == 2
    assert {r["ground_truth"] for r in train["reward_model"]} == {paths["sentence"]}  # one sentence per run
    words = paths["sentence"].split()
    assert len(words) == lt.RESPONSE_TOKENS // lt.FRAMES_PER_WORD and set(words) <= set(lt.WORDS)
    assert all(a != b for a, b in zip(words, words[1:], strict=False))  # a held word is one word
    row = train.iloc[0]
    assert row["prompt"][0]["content"] == "Say: " + paths["sentence"]
    assert row["data_source"] == "maspo_learn_speech"
    text = lt.write_dataset(tmp_path, "text", seed=1)["sentence"].split()
    assert len(text) == lt.RESPONSE_TOKENS
    # the sentence said exactly, as each task decodes it, scores 1
    ids = [lt.WORDS.index(w) * lt.BLOCK for w in text]
    assert lt.score("text", ids, " ".join(text))[0] == 1.0
    held = [lt.WORDS.index(w) * lt.BLOCK + f for w in words for f in range(lt.FRAMES_PER_WORD)]
    assert lt.score("speech", held, paths["sentence"])[0] == 1.0


def test_parse_verl_step_lines():
    log = (
        "(TaskRunner pid=1) step:1 - critic/score/mean:np.float64(0.25) - timing_s/step:3.5 - note:x\n"
        "noise\nstep:2 - critic/score/mean:0.5\n"
    )
    assert parse_steps(log) == {1: {"critic/score/mean": 0.25, "timing_s/step": 3.5}, 2: {"critic/score/mean": 0.5}}
    assert steps_to([0.1, 0.6, 0.4], 0.5) == 2 and steps_to([0.1], 0.5) is None


def test_word_ids_follow_the_decoded_words():
    from maspo_verl.local.learn_tasks import decode, word_ids

    ids = [0, 1, 64, 65, 65, 999, 130]  # block 0 twice, block 1 three times, an unknown id, block 2
    assert word_ids(decode("speech", ids), len(ids)) == [0, 0, 1, 1, 1, -1, 2]
    assert word_ids(decode("text", ids), len(ids)) == [0, 1, 2, 3, 4, -1, 5]
