"""The speech-like task on a warm-started model (``speechwarm``): its data and decoding against the task's
rules, the chat-template ids against the real tokenizer, the warm start's determinism and cache on a tiny
size, the local mode's and lab learn's selection of it, and (slow) the initial-reward criterion."""

from __future__ import annotations

import random

import pytest

from maspo_verl.lab.engine.cells import Cell
from maspo_verl.local import learn_tasks as lt
from maspo_verl.local import speechwarm as sw

TINY = {"steps": 3, "batch": 2, "lr": 1e-3, "warmup": 1}


def test_responses_hold_each_word_over_a_quarter_of_the_frames():
    rng = random.Random(0)
    for length in (8, 12, 96, 98):
        ids = sw.response_ids("mi ka nu ka", length, rng)
        assert len(ids) == length and all(0 <= i < lt.NUM_CODES for i in ids)
        words = lt.decode(lt.WARM, ids)
        assert [w for w, _, _ in words] == ["mi", "ka", "nu", "ka"]
        spans = [end - start for _, start, end in words]
        assert sum(spans) == length and max(spans) - min(spans) <= 1  # each word length / 4 frames
        assert lt.score(lt.WARM, ids, "mi ka nu ka")[0] == 1.0
    # every frame's id is drawn within its block, not one id per word
    assert len(set(sw.response_ids("ka lo mi nu", 96, rng)[:24])) > 10


def test_speechwarm_decodes_and_scores_as_speech():
    ids = [0, 5, 70, 71, 300, 65, 200]
    assert lt.decode(lt.WARM, ids) == lt.decode("speech", ids)
    assert lt.token_scores_of(lt.WARM, ids, "ka lo mi") == lt.token_scores_of("speech", ids, "ka lo mi")


def test_prompt_ids_are_the_chat_templates_tokens(tmp_path):
    """Against the embedded tokenizer's own chat template (what verl's dataset tokenises)."""
    from transformers import AutoTokenizer

    from maspo_verl.local.assets import write_tokenizer

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "Say: ka mi nu lo"}]
    assert (
        sw.prompt_ids("ka mi nu lo")
        == tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]
    )


def test_training_examples_do_not_teach_the_prompts_sentence():
    rng = random.Random(3)
    pairs = [sw.example(rng, 12) for _ in range(200)]
    said = [" ".join(w for w, _, _ in lt.decode(lt.WARM, r)) for _, r in pairs]
    asked = [bytes(p[p.index(ord(":")) + 2 : p.index(258)]).decode() for p, _ in pairs]
    assert all(len(s.split()) == lt.SPEECH_WORDS for s in said)
    # independent sentences (108 possible): equal about 1 time in 108, not always
    assert sum(a == s for a, s in zip(asked, said, strict=True)) < 10
    assert len(set(said)) > 50


def _weights(path):
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def test_warm_start_is_deterministic_cached_and_trains(tmp_path, monkeypatch):
    import torch

    from maspo_verl.local.assets import write_model

    a = sw.ensure_model(seed=1, length=8, cache_dir=tmp_path / "a", train_settings=TINY)
    b = sw.ensure_model(seed=1, length=8, cache_dir=tmp_path / "b", train_settings=TINY)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    write_model(tmp_path / "init", 1)
    init = _weights(tmp_path / "init")
    assert any(not torch.equal(wa[k], init[k]) for k in wa)  # the training moved the embedded model
    other = _weights(sw.ensure_model(seed=2, length=8, cache_dir=tmp_path / "a", train_settings=TINY))
    assert any(not torch.equal(wa[k], other[k]) for k in wa)  # the seed sets it
    # built once: a second call reads the cache
    monkeypatch.setattr(sw, "write_warm_model", lambda *a, **k: pytest.fail("rebuilt a cached model"))
    assert sw.ensure_model(seed=1, length=8, cache_dir=tmp_path / "a", train_settings=TINY) == a


def test_bad_settings_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"length=2: allowed >= 4"):
        sw.ensure_model(length=2, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"train_settings keys .* allowed exactly"):
        sw.ensure_model(length=8, cache_dir=tmp_path, train_settings={"steps": 1})


def test_initial_reward_reads_groups_by_hand(tmp_path, monkeypatch):
    """Groups of n responses: each group's own target; spread = mean over groups of the std within one."""
    targets = []

    def fake_sample(model_path, prompts, length, seed):
        targets.extend(bytes(p[p.index(ord(":")) + 2 : p.index(258)]).decode() for p in prompts)
        rng = random.Random(0)
        # group g: its first response says the target, the others say a fixed other sentence
        out = []
        for i, _ in enumerate(prompts):
            said = targets[i] if i % 2 == 0 else "ka lo ka lo"
            out.append(sw.response_ids(said, length, rng))
        return out

    monkeypatch.setattr(sw, "sample", fake_sample)
    got = sw.initial_reward("unused", 12, seed=0, groups=3, n=2)
    wrong = [lt.score(lt.WARM, sw.response_ids("ka lo ka lo", 12, random.Random(0)), t)[0] for t in targets[1::2]]
    assert got["reward"] == pytest.approx((3 + sum(wrong)) / 6)
    assert got["spread"] == pytest.approx(sum((1 - w) / 2 for w in wrong) / 3)
    assert got["words"] == 4


def test_lab_learn_selects_the_warm_model(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from maspo_verl.lab.studies import learn

    monkeypatch.setattr(sw, "ensure_model", lambda seed, length, cache_dir=None: f"/cache/warm-{seed}-{length}")
    data = learn.task_data(tmp_path, lt.WARM, 3, 96)
    assert data["model"] == "/cache/warm-3-96" and len(data["sentence"].split()) == lt.SPEECH_WORDS
    args = SimpleNamespace(
        batch=8, n=4, bypass=True, fp32_trainer=True, lr=1e-3, steps=2, bands=["grpo=4"], no_adjust=True
    )
    over = learn.overrides_for(args, lt.WARM, "grpo", 3, data, Cell(96, "stale2", 4))
    assert "actor_rollout_ref.model.path=/cache/warm-3-96" in over
    assert "data.max_response_length=96" in over and "maspo.local_mismatch.stale_syncs=2" in over
    # grpo's clip band (0.2 as shipped) scaled by 4
    assert (
        "actor_rollout_ref.actor.clip_ratio_low=0.8" in over and "actor_rollout_ref.actor.clip_ratio_high=0.8" in over
    )
    speech = lt.write_dataset(tmp_path, "speech", length=96)
    plain = learn.overrides_for(args, "speech", "grpo", 3, speech, Cell(96, "none", 4))
    assert not any(o.startswith("actor_rollout_ref.model.path=") for o in plain)


def test_local_mode_task_fills_the_warm_model_and_data(tmp_path, monkeypatch):
    import pandas as pd

    from maspo_verl.local.tasks import prepare_task
    from maspo_verl.validation import FieldError
    from tests.helpers import compose_config

    built = []
    monkeypatch.setattr(
        sw, "ensure_model", lambda seed, length, cache_dir=None: built.append((seed, length)) or f"/w/{seed}-{length}"
    )
    config = compose_config("local=cpu", "task=speechwarm", "maspo.local_seed=2", f"maspo.local_cache_dir={tmp_path}")
    prepare_task(config)
    assert config.actor_rollout_ref.model.path == "/w/2-96" and (2, 96) in built
    rows = pd.read_parquet(config.data.train_files)
    target = lt.write_dataset(tmp_path / "ref", lt.WARM, seed=2, length=96)["sentence"]
    assert {r["ground_truth"] for r in rows["reward_model"]} == {target}
    assert set(rows["data_source"]) == {"maspo_learn_speechwarm"}
    assert config.reward.reward_manager.name == "LearnRewardManager"
    mine = compose_config(
        "local=cpu", "task=speechwarm", "actor_rollout_ref.model.path=/m", "data.train_files=a", "data.val_files=b"
    )
    prepare_task(mine)
    assert (mine.actor_rollout_ref.model.path, mine.data.train_files) == ("/m", "a")  # the user's own
    with pytest.raises(FieldError, match=r"data.max_response_length=2: allowed >= 4"):
        prepare_task(compose_config("local=cpu", "task=speechwarm", "data.max_response_length=2"))


@pytest.mark.slow
def test_warm_model_starts_with_a_reward_and_a_spread():
    """The criterion of the task: reward >= 0.2 with a spread >= 0.05 within groups at 96 frames (the untrained
    model: about 0.06 and 0.003); builds the default model into the cache on first use (about a minute)."""
    got = sw.initial_reward(sw.ensure_model(seed=0, length=96), 96, seed=0, groups=16, n=4)
    assert got["reward"] >= 0.2 and got["spread"] >= 0.05
    assert 3 <= got["words"] <= 8


def test_drift_correlation_measures_the_models_own_update(tmp_path):
    """No update: delta is 0 (nothing to correlate, no metric); one update moves the log-probs of the sampled
    tokens, and the metrics are those of the core's correlation on them."""
    path = sw.ensure_model(seed=1, length=8, cache_dir=tmp_path, train_settings=TINY)
    still = sw.drift_correlation(path, 8, seed=0, updates=0, groups=2, n=2)
    assert still["delta_sd"] == 0.0 and "vif5" not in still
    moved = sw.drift_correlation(path, 8, seed=0, updates=1, lr=1e-2, groups=2, n=2)
    assert moved["delta_sd"] > 0 and moved["vif5"] > 0 and -1 <= moved["corr_lag1"] <= 1
