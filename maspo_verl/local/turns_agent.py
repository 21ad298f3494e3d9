"""verl's side of the multi-turn toy environment (``maspo_verl.local.turns``): the agent loop, registered
in verl as ``maspo_toy_turns`` on import (``maspo_verl.local.activate`` imports this module in the driver
and in every Ray worker), and the reward manager.

- ``TurnsAgentLoop``: for each turn, the observation (response_mask 0, after the first turn), then the
  assistant's turn from the rollout server through verl's server manager (``max_tokens`` = the turn's
  length, response_mask 1), until every turn is done or ``rollout.response_length`` is spent. It
  records each turn's score (``extra_fields["turn_scores"]``, one float per assistant turn generated, as
  verl's tool/interaction agent loop records them; turn credit reads them) and span of the response
  (``turn_starts``, ``turn_ends``), which verl hands the reward as ``tool_extra_fields``.
- ``TurnsRewardManager``: scores each turn's span of the response ids against its reference and
  returns the mean (``maspo_verl.local.turns.reward``), plus ``turns`` (turns done), ``first_turn``
  and ``last_turn`` scores, which the plugin logs as ``reward/<name>/mean``.
"""

from __future__ import annotations

import time
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from maspo_verl.local import turns as env
from maspo_verl.plugin.rewards import RewardManager

SPAN_KEYS = ("turn_starts", "turn_ends")


def references_of(reward_model) -> list[str]:
    """The per-turn references of a row (``reward_model.ground_truth``, a list: parquet gives an array)."""
    truth = (reward_model or {}).get("ground_truth") if hasattr(reward_model, "get") else None
    if truth is None or isinstance(truth, str) or not hasattr(truth, "__len__") or not len(truth):
        raise ValueError(
            f"the {env.AGENT_NAME} agent loop needs rows whose reward_model.ground_truth lists one reference per "
            f"turn (task=turns writes them); got {truth!r}"
        )
    return [str(r) for r in truth]


@register(env.AGENT_NAME)
class TurnsAgentLoop(AgentLoopBase):
    """Alternating assistant turns and environment observations (``maspo_verl.local.turns``)."""

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(self.apply_chat_template_kwargs or {})
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        refs = references_of(kwargs.get("reward_model"))
        budget = int(self.rollout_config.response_length)
        prompt_ids = self._prompt_ids([dict(m) for m in kwargs["raw_prompt"]])
        request_id = uuid4().hex
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        with_logprobs = True
        starts: list[int] = []
        ends: list[int] = []
        scores: list[float] = []
        extra: dict[str, Any] = {}
        generate_s, preempted = 0.0, -1
        for k, ref in enumerate(refs):
            if k:
                obs = env.observation_ids(ref)[: budget - len(response)]
                response += obs
                mask += [0] * len(obs)
                logprobs += [0.0] * len(obs)
            room = min(len(ref), budget - len(response))
            if room <= 0:
                break
            start = time.perf_counter()
            out = await self.server_manager.generate(
                request_id, prompt_ids=prompt_ids + response, sampling_params={**sampling_params, "max_tokens": room}
            )
            generate_s += time.perf_counter() - start
            if out.num_preempted is not None:
                preempted = max(preempted, 0) + int(out.num_preempted)
            ids = [int(t) for t in out.token_ids][:room]
            scores.append(env.turn_score(ids, ref))  # the environment scores the turn, as verl's interactions do
            starts.append(len(response))
            response += ids
            ends.append(len(response))
            mask += [1] * len(ids)
            if out.log_probs is None:
                with_logprobs = False
            else:
                logprobs += [float(x) for x in out.log_probs[: len(ids)]]
            if not extra:
                extra.update(out.extra_fields or {})
            elif (out.extra_fields or {}).get("max_global_steps") is not None:
                extra["max_global_steps"] = out.extra_fields["max_global_steps"]
        # the schema of verl's own loops (a score per assistant turn, tool_rewards), and the turns' spans
        extra.update({"turn_scores": scores, "tool_rewards": [], SPAN_KEYS[0]: starts, SPAN_KEYS[1]: ends})
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response,
            response_mask=mask,
            response_logprobs=logprobs if with_logprobs else None,
            num_turns=1 + len(starts) + max(len(starts) - 1, 0),  # user, assistant turns, observations
            metrics={"generate_sequences": generate_s, "num_preempted": preempted},
            extra_fields=extra,
        )


class TurnsRewardManager(RewardManager):
    """verl reward manager of the toy environment: the mean turn score over all turns."""

    async def run_single(self, data) -> dict:
        item, ids = self.response(data)
        refs = references_of(item.non_tensor_batch["reward_model"])
        fields = item.non_tensor_batch.get("tool_extra_fields") or {}
        if any(key not in fields for key in SPAN_KEYS):
            raise ValueError(
                f"{type(self).__name__} scores the turns of the {env.AGENT_NAME} agent loop, whose spans "
                f"({', '.join(SPAN_KEYS)}) are missing: run it with task=turns"
            )
        starts, ends = [int(x) for x in fields[SPAN_KEYS[0]]], [int(x) for x in fields[SPAN_KEYS[1]]]
        value, scores = env.reward(ids, starts, ends, refs)
        info = {"score": value, "turns": float(len(starts)), "first_turn": scores[0], "last_turn": scores[-1]}
        return {"reward_score": value, "reward_extra_info": info}
