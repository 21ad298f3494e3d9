"""End-to-end: the README's multi-turn local run (``local=cpu task=turns``), 2 steps of verl's real
trainer. verl's agent-loop workers run the toy environment's loop (``maspo_toy_turns``, registered in
each Ray worker by the local mode), which alternates the HF server's assistant turns with masked
environment observations; the reward manager scores every turn. The loss's inspection samples show
what reached the loss: the response ids and mask of each row, and the segments ``loss=maspo_turns`` used."""

from __future__ import annotations

import json
import math

import pytest

from maspo_verl.local import turns

pytestmark = pytest.mark.e2e

TURNS, TURN_TOKENS = 2, 4  # hydra_configs/task/turns.yaml
LOSS = "loss=maspo_turns"


@pytest.mark.slow
def test_multi_turn_command_two_steps(local_run, tmp_path):
    inspect = tmp_path / "inspect"
    run = local_run(
        [
            "task=turns",
            LOSS,
            f"actor_rollout_ref.actor.policy_loss.inspect_dir={inspect}",
            "actor_rollout_ref.actor.policy_loss.inspect_every=1",
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    assert sorted(run.steps) == [1, 2], context
    refs = turns.references(0, TURNS, TURN_TOKENS)  # maspo.local_seed=0
    length = turns.response_length(TURNS, TURN_TOKENS)
    for step, m in run.steps.items():
        where = f"step {step}{context}"
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), where
        assert m["response_length/mean"] == length, where
        # verl counts the user's turn, the assistant's turns and the observations between them
        assert m["training/num_turns/mean"] == 1 + TURNS + (TURNS - 1), where
        # the reward is the mean over both turns: with 2 turns, the mean of the first and last turn scores
        assert m["reward/turns/mean"] == TURNS, where
        assert 0.0 <= m["critic/score/mean"] <= 1.0, where
        mean_of_turns = (m["reward/first_turn/mean"] + m["reward/last_turn/mean"]) / 2
        assert m["critic/score/mean"] == pytest.approx(mean_of_turns, abs=1e-6), where
        assert m["actor/ratio/segments_per_seq"] == pytest.approx(TURNS), where
    assert run.some_step_had_a_gradient, context
    for step in (1, 2):
        sample = json.loads((inspect / f"step_{step:06d}.json").read_text())
        for row in sample["responses"]:
            mask, ids = row["mask"], row["response_ids"]
            runs = turns.mask_runs(mask)
            # the assistant's turns: runs of mask 1, each its turn's length, the environment's
            # observation of the next turn's reference between them, masked out
            assert runs == [(0, TURN_TOKENS), (TURN_TOKENS + TURN_TOKENS + 2, length)], (step, row["row"], mask)
            assert ids[runs[0][1] : runs[1][0]] == turns.observation_ids(refs[1]), (step, row["row"], ids)
            # the segments the loss used are the turns
            segs = row["segments"]
            assert [(a, a + n) for a, n in zip(segs["start"], segs["length"], strict=True)] == runs, (step, segs)
