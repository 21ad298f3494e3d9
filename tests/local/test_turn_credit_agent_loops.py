"""Turn credit on the per-turn fields of real agent-loop outputs, through verl's own ``compute_advantage``:

- verl's ``ToolAgentLoop`` (``tool_agent``), run with the embedded tokenizer, a scripted server (the assistant's
  turns are hermes tool calls, then an answer) and a tool that returns a reward: it records ``tool_rewards``
  (one per call) and an empty ``turn_scores``; the assistant's turns are the runs of its response mask;
- the toy environment's loop (``maspo_toy_turns``) on the HF server: ``turn_scores``, one per turn.

The non-tensor batch is laid out as verl's agent loop lays it out (one object array per key)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import maspo_verl.plugin  # noqa: F401  (registers maspo_turn_grpo, installs the hooks)
from maspo_verl.advantages import TURN_GRPO
from maspo_verl.local import assets, turns
from tests.helpers import compose_config

LAM = 0.5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return assets.ensure_assets(seed=0, cache_dir=tmp_path_factory.mktemp("assets"))


def tool_loop_output(built, guesses: list[int]):
    """verl's ToolAgentLoop with one assistant turn per guess (a tool call each), then a final answer."""
    import hydra
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
    from verl.workers.rollout.replica import TokenOutput

    tokenizer = AutoTokenizer.from_pretrained(built["model"])
    texts = [f'g<tool_call>{{"name": "judge", "arguments": {{"guess": {g}}}}}</tool_call>' for g in guesses]
    texts.append("done")

    class Scripted:
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            ids = tokenizer.encode(texts.pop(0), add_special_tokens=False)
            return TokenOutput(token_ids=ids, log_probs=[-1.0] * len(ids), stop_reason="completed")

    class Judge(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="ok"), float(parameters["guess"]) / 10, {}

    schema = OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": "judge",
                "description": "scores a guess",
                "parameters": {"type": "object", "properties": {"guess": {"type": "integer", "description": "g"}}},
            },
        }
    )
    config = compose_config("local=cpu")
    config.actor_rollout_ref.model.path = built["model"]
    config.actor_rollout_ref.rollout.multi_turn.format = "hermes"
    config.actor_rollout_ref.rollout.prompt_length = 256
    config.actor_rollout_ref.rollout.response_length = 512
    events = asyncio.new_event_loop()  # the loop binds the running event loop when built
    asyncio.set_event_loop(events)
    try:
        loop = hydra.utils.instantiate(
            _agent_loop_registry["tool_agent"],
            trainer_config=DictConfigWrap(config),
            server_manager=Scripted(),
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=None,
            data_config=DictConfigWrap(config.data),
            tools=ToolListWrap([Judge(config={}, tool_schema=schema)]),
        )
        return events.run_until_complete(loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "hi"}]))
    finally:
        events.close()
        asyncio.set_event_loop(None)


def advantages_of(outputs, scores: list[float], index: list[str]):
    """verl's compute_advantage on the outputs: masks right-padded, the outcome score on the last valid token,
    the outputs' extra fields as verl's agent loop writes them into the non-tensor batch."""
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer

    T = max(len(o.response_mask) for o in outputs)
    mask = torch.zeros(len(outputs), T)
    rewards = torch.zeros(len(outputs), T)
    for i, o in enumerate(outputs):
        mask[i, : len(o.response_mask)] = torch.tensor(o.response_mask, dtype=torch.float32)
        rewards[i, max(t for t, m in enumerate(o.response_mask) if m)] = scores[i]
    fields = {}
    for key in ("turn_scores", "tool_rewards"):
        fields[key] = np.empty(len(outputs), dtype=object)
        fields[key][:] = [o.extra_fields.get(key) for o in outputs]
    uid = np.array(index, dtype=object)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": uid, **fields}
    )
    config = compose_config("credit=turns").algorithm
    config.turn_credit.lam = LAM
    # (verl writes the advantages into ``data`` and returns it)
    ours = ray_trainer.compute_advantage(data, adv_estimator=TURN_GRPO, config=config).batch["advantages"].clone()
    grpo = ray_trainer.compute_advantage(data, adv_estimator="grpo", config=config).batch["advantages"]
    return ours, grpo, mask


def expected_terms(per_turn: list[list[float]], n_runs: list[int]) -> list[list[float]]:
    """By hand: centred scores on the first len(scores) turns, 0 after; divided by the group's largest."""
    terms = [
        [s - sum(row) / len(row) for s in row] + [0.0] * (n - len(row)) for row, n in zip(per_turn, n_runs, strict=True)
    ]
    scale = max(abs(e) for row in terms for e in row)
    return [[LAM * e / scale for e in row] for row in terms]


def check(outputs, per_turn, ours, grpo, mask):
    runs = [turns.mask_runs([int(m) for m in row.tolist()]) for row in mask]
    expected = expected_terms(per_turn, [len(r) for r in runs])
    for i, row_runs in enumerate(runs):
        for (a, b), e in zip(row_runs, expected[i], strict=True):
            torch.testing.assert_close(ours[i, a:b] - grpo[i, a:b], torch.full((b - a,), e), rtol=1e-5, atol=1e-6)
    assert torch.equal(ours * (1 - mask), torch.zeros_like(ours))


def test_tool_agent_loop_tool_rewards(built):
    guesses = [[3, 7], [5, 5], [9, 1], [2]]
    outputs = [tool_loop_output(built, g) for g in guesses]
    for o, g in zip(outputs, guesses, strict=True):
        # verl's layout: no turn scores from the tool loop, one tool reward per call, a turn per call and the answer
        assert o.extra_fields["turn_scores"] == [] and o.extra_fields["tool_rewards"] == [x / 10 for x in g]
        assert len(turns.mask_runs(o.response_mask)) == len(g) + 1
    ours, grpo, mask = advantages_of(outputs, [0.5, 0.5, 0.2, 0.9], ["p"] * 4)
    check(outputs, [[x / 10 for x in g] for g in guesses], ours, grpo, mask)
    assert not torch.allclose(ours, grpo)


def test_toy_loop_turn_scores(built):
    from tests.local.test_turns import _run_loop

    outputs = [_run_loop(built, 3)[0] for _ in range(4)]
    per_turn = [o.extra_fields["turn_scores"] for o in outputs]
    for o, scores in zip(outputs, per_turn, strict=True):
        refs = turns.references(0, 3, 4)
        runs = turns.mask_runs(o.response_mask)
        assert scores == [turns.turn_score(o.response_ids[a:b], r) for (a, b), r in zip(runs, refs, strict=True)]
    rewards = [sum(s) / 3 for s in per_turn]
    ours, grpo, mask = advantages_of(outputs, rewards, ["p"] * 4)
    if max(max(s) - min(s) for s in per_turn) == 0:
        pytest.skip("every turn scored alike in this sample")
    check(outputs, per_turn, ours, grpo, mask)
