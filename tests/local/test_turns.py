"""The local mode's multi-turn toy environment (``task=turns``) without Ray: the environment's rules
against hand-derived values, ``prepare_task`` on the composed config, and verl's agent loop (the one
registered under ``maspo_toy_turns``) driving the real HF rollout server in-process, with the reward
manager scoring what it produced."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from maspo_verl import local
from maspo_verl.local import assets, tasks, turns
from maspo_verl.validation import FieldError
from tests.helpers import compose_config

L = 4  # tokens per turn in these tests
# a byte id in each symbol's block (symbol s: bytes 64 s .. 64 s + 63), and one that is right for none
RIGHT = {0: 7, 1: 100, 2: 130, 3: 250}
SPECIAL = 258


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return assets.ensure_assets(seed=0, cache_dir=tmp_path_factory.mktemp("assets"))


def test_references_are_fixed_by_the_seed():
    refs = turns.references(3, turns=5, turn_tokens=L)
    assert refs == turns.references(3, turns=5, turn_tokens=L)
    assert refs != turns.references(4, turns=5, turn_tokens=L)
    assert len(refs) == 5 and all(len(r) == L and set(r) <= set("0123") for r in refs)
    # more turns extend the same sequence of references
    assert turns.references(3, turns=7, turn_tokens=L)[:5] == refs


def test_turn_score_by_hand():
    ref = "0213"
    assert turns.turn_score([RIGHT[0], RIGHT[2], RIGHT[1], RIGHT[3]], ref) == 1.0
    assert turns.turn_score([RIGHT[0], RIGHT[2], RIGHT[1], SPECIAL], ref) == 0.75  # a special id is wrong
    assert turns.turn_score([RIGHT[1], RIGHT[2], RIGHT[1], RIGHT[0]], ref) == 0.5
    assert turns.turn_score([RIGHT[0]], ref) == 0.25  # missing tokens are wrong
    # the blocks' edges: 63 is symbol 0, 64 symbol 1, 191 symbol 2 (not 3), 255 symbol 3
    assert turns.turn_score([63, 64, 191, 255], "0133") == 0.75


def _response(refs: list[str], right: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """A response whose turn k has its first ``right[k]`` tokens right and the rest wrong, with the
    environment's observations between turns: (ids, mask, starts, ends)."""
    ids, mask, starts, ends = [], [], [], []
    for k, ref in enumerate(refs):
        if k:
            obs = turns.observation_ids(ref)
            ids += obs
            mask += [0] * len(obs)
        starts.append(len(ids))
        ids += [RIGHT[int(s)] if t < right[k] else RIGHT[(int(s) + 1) % 4] for t, s in enumerate(ref)]
        mask += [1] * len(ref)
        ends.append(len(ids))
    return ids, mask, starts, ends


def test_reward_is_the_mean_over_every_turn():
    refs = turns.references(0, turns=3, turn_tokens=L)
    ids, mask, starts, ends = _response(refs, right=[4, 1, 2])
    assert len(ids) == turns.response_length(3, L) == 3 * 4 + 2 * 6
    value, scores = turns.reward(ids, starts, ends, refs)
    assert scores == [1.0, 0.25, 0.5]
    assert value == pytest.approx((1.0 + 0.25 + 0.5) / 3)
    # every turn moves the reward, the first as much as the last
    for k in range(3):
        right = [4, 1, 2]
        right[k] -= 1
        changed, _ = turns.reward(_response(refs, right)[0], starts, ends, refs)
        assert changed == pytest.approx(value - 0.25 / 3)
    # a turn the budget left out scores 0
    value, scores = turns.reward(ids[: ends[1]], starts[:2], ends[:2], refs)
    assert scores == [1.0, 0.25, 0.0] and value == pytest.approx(1.25 / 3)
    with pytest.raises(ValueError, match="turn starts"):
        turns.reward(ids, starts + [0], ends + [1], refs)


def test_mask_runs_are_the_turns():
    refs = turns.references(0, turns=3, turn_tokens=L)
    ids, mask, starts, ends = _response(refs, right=[0, 0, 0])
    assert turns.mask_runs(mask) == list(zip(starts, ends, strict=True)) == [(0, 4), (10, 14), (20, 24)]
    assert turns.mask_runs([0, 1, 1, 0, 0, 1, 0, 0]) == [(1, 3), (5, 6)]  # padding and holes
    assert turns.mask_runs([0, 0]) == []


@pytest.mark.parametrize(("key", "value"), [("turns", 0), ("turn_tokens", -1), ("turns", "two"), ("turns", True)])
def test_settings_are_checked(key, value):
    settings = {"turns": 2, "turn_tokens": L, key: value}
    with pytest.raises(FieldError, match=rf"maspo.{key}=.* is invalid: allowed a positive integer"):
        turns.check_settings(settings["turns"], settings["turn_tokens"])


# -- prepare_task on the composed config ----------------------------------------------------------


def test_prepare_task_fills_lengths_and_data(tmp_path):
    config = compose_config("local=cpu", "task=turns", "maspo.turns=3", f"maspo.local_cache_dir={tmp_path}")
    assert config.data.max_response_length is None and config.data.max_prompt_length is None
    tasks.prepare_task(config)
    assert config.data.max_response_length == 3 * L + 2 * (L + 2)
    assert config.data.max_prompt_length == turns.prompt_length(L)
    import pandas as pd

    rows = pd.read_parquet(config.data.train_files)
    assert config.data.train_files.startswith(str(tmp_path)) and len(rows) == 64
    refs = turns.references(0, 3, L)
    assert [list(r["ground_truth"]) for r in rows["reward_model"]] == [refs] * 64
    assert set(rows["agent_name"]) == {turns.AGENT_NAME}
    assert rows["prompt"][0][0]["content"] == f"Say: {refs[0]}"
    assert len(pd.read_parquet(config.data.val_files)) == 16


def test_prepare_task_refuses_what_cannot_run(tmp_path):
    short = compose_config(
        "local=cpu", "task=turns", "data.max_response_length=13", f"maspo.local_cache_dir={tmp_path}"
    )
    with pytest.raises(FieldError, match=r"data.max_response_length=13 is too short .* allowed >= 14"):
        tasks.prepare_task(short)
    short = compose_config("local=cpu", "task=turns", "data.max_prompt_length=20", f"maspo.local_cache_dir={tmp_path}")
    with pytest.raises(FieldError, match=r"data.max_prompt_length=20 is too short for the prompt .* allowed >= 28"):
        tasks.prepare_task(short)
    with pytest.raises(FieldError, match="task=turns is a toy task of the local mode: add local=cpu"):
        tasks.prepare_task(compose_config("task=turns"))
    with pytest.raises(FieldError, match=r"maspo.task='chess' is invalid: allowed \['speechwarm', 'turns'\]"):
        tasks.prepare_task(compose_config("local=cpu", "task=turns", "maspo.task=chess"))
    mine = compose_config("local=cpu", "task=turns", "data.train_files=a.parquet", "data.val_files=b.parquet")
    tasks.prepare_task(mine)
    assert (mine.data.train_files, mine.data.val_files) == ("a.parquet", "b.parquet")  # the user's data


# -- verl's agent loop and reward manager, on the real HF server ----------------------------------


class ServerClient:
    """verl's server manager interface (``generate(request_id, *, prompt_ids, sampling_params)``) in
    front of one in-process HF server (no Ray); it records the requests."""

    def __init__(self, server):
        self.server, self.requests = server, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.requests.append((list(prompt_ids), dict(sampling_params)))
        return await self.server.generate(prompt_ids, sampling_params, request_id=request_id)


def _run_loop(built, n_turns: int, budget: int | None = None, logprobs: bool = True):
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry

    from maspo_verl.local.hf_rollout import HFServer

    local.activate()  # what a Ray worker does on `import verl` in the local mode: registers the loop
    budget = budget or turns.response_length(n_turns, L)
    config = compose_config("local=cpu", "task=turns", f"maspo.turns={n_turns}", f"data.max_response_length={budget}")
    config.actor_rollout_ref.model.path = built["model"]
    rollout = SimpleNamespace(prompt_length=64, response_length=budget, max_model_len=None, seed=0)
    client = ServerClient(HFServer(rollout, SimpleNamespace(local_path=built["model"], trust_remote_code=False)))
    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    import hydra

    loop = hydra.utils.instantiate(
        _agent_loop_registry[turns.AGENT_NAME],
        trainer_config=DictConfigWrap(config),
        server_manager=client,
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
    )
    refs = turns.references(0, n_turns, L)
    row = turns.rows(refs, 1, "train")[0]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": logprobs, "ignore_eos": True}
    out = asyncio.run(loop.run(params, raw_prompt=row["prompt"], reward_model=row["reward_model"], index=0))
    return out, refs, client, tokenizer


@pytest.mark.parametrize("n_turns", [1, 3])
def test_agent_loop_alternates_turns_and_observations(built, n_turns):
    out, refs, client, tokenizer = _run_loop(built, n_turns)
    # the prompt is the row's chat, as the tokenizer's template renders it
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Say: {refs[0]}"}], add_generation_prompt=True, tokenize=False
    )
    assert out.prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    assert len(out.prompt_ids) == turns.prompt_length(L)  # what prepare_task gives data.max_prompt_length
    assert (
        len(out.response_ids)
        == len(out.response_mask)
        == len(out.response_logprobs)
        == turns.response_length(n_turns, L)
    )
    runs = turns.mask_runs(out.response_mask)
    assert runs == list(zip(out.extra_fields["turn_starts"], out.extra_fields["turn_ends"], strict=True))
    assert [b - a for a, b in runs] == [L] * n_turns
    # between turns, exactly the environment's observation of the next turn's reference, masked out
    for k in range(1, n_turns):
        gap = out.response_ids[runs[k - 1][1] : runs[k][0]]
        assert gap == turns.observation_ids(refs[k])
        assert all(out.response_logprobs[t] == 0.0 for t in range(runs[k - 1][1], runs[k][0]))
    # one request per turn, each on the prompt and everything so far, for that turn's tokens
    assert len(client.requests) == n_turns
    for k, (prompt, params) in enumerate(client.requests):
        assert prompt == out.prompt_ids + out.response_ids[: runs[k][0]] and params["max_tokens"] == L
    assert out.num_turns == 2 * n_turns


def test_agent_loop_stops_at_the_response_budget(built):
    # room for turn 1, the observation and 2 tokens of turn 2
    out, refs, client, _ = _run_loop(built, 3, budget=L + (L + 2) + 2, logprobs=False)
    assert turns.mask_runs(out.response_mask) == [(0, L), (2 * L + 2, 2 * L + 4)]
    assert out.response_logprobs is None and [p["max_tokens"] for _, p in client.requests] == [L, 2]


def test_reward_manager_scores_the_loop_output(built):
    import torch
    from verl.protocol import DataProto

    from maspo_verl.local.turns_agent import TurnsRewardManager

    out, refs, _, tokenizer = _run_loop(built, 3)

    def score(response_ids):
        # the DataProto verl's agent loop hands the reward loop (``AgentLoopWorker._compute_score``)
        prompts, responses = torch.tensor(out.prompt_ids), torch.tensor(response_ids)
        data = DataProto.from_dict(
            tensors={
                "prompts": prompts[None],
                "responses": responses[None],
                "input_ids": torch.cat([prompts, responses])[None],
                "attention_mask": torch.ones(1, len(prompts) + len(responses), dtype=torch.long),
            },
            non_tensors={
                "reward_model": [{"ground_truth": refs}],
                "tool_extra_fields": [dict(out.extra_fields)],
            },
        )
        manager = TurnsRewardManager(config=None, tokenizer=tokenizer)
        return asyncio.run(manager.run_single(data))

    result = score(out.response_ids)
    runs = turns.mask_runs(out.response_mask)
    # by hand: per turn, the share of tokens whose byte is in the reference symbol's block
    by_hand = [
        sum(t < 256 and t // 64 == int(s) for t, s in zip(out.response_ids[a:b], ref, strict=True)) / L
        for (a, b), ref in zip(runs, refs, strict=True)
    ]
    assert result["reward_score"] == pytest.approx(sum(by_hand) / 3)
    info = result["reward_extra_info"]
    assert (info["turns"], info["first_turn"], info["last_turn"]) == (3.0, by_hand[0], by_hand[-1])
    # setting the first turn right raises the reward by its missing share over the 3 turns
    fixed = list(out.response_ids)
    fixed[runs[0][0] : runs[0][1]] = [RIGHT[int(s)] for s in refs[0]]
    assert score(fixed)["reward_score"] == pytest.approx((1.0 + sum(by_hand[1:])) / 3)
