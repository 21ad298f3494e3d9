"""The span-credit lab: its exact expected reward and gradient against full enumeration, its per-token
scores, and the command end to end on tiny settings."""

import itertools

import numpy as np
import pytest
import torch

from maspo_verl.lab.__main__ import main
from maspo_verl.lab.engine import race
from maspo_verl.lab.studies import credit


@pytest.mark.parametrize("name", ["speech", "text"])
def test_exact_reward_and_gradient_match_enumeration(name):
    T = 8
    task = race.make_task(name, T)
    theta = race.init_policy(task, T, seed=3)
    ys = torch.tensor(list(itertools.product(range(race.VOCAB), repeat=T)))  # all 4^8 responses
    logp = race.log_probs(theta, ys).sum(-1)
    enumerated = (logp.exp() * task.reward(ys)).sum()
    assert float(logp.exp().sum()) == pytest.approx(1.0, abs=1e-5)
    exact = credit.exact_reward(theta, task)
    assert float(exact) == pytest.approx(float(enumerated), abs=1e-5)
    (g_exact,) = torch.autograd.grad(exact, theta)
    (g_enum,) = torch.autograd.grad(enumerated, theta)
    torch.testing.assert_close(g_exact, g_enum, rtol=1e-4, atol=1e-6)


def test_task_token_scores_are_centred_span_penalties_plus_the_reward():
    task = race.make_task("speech", 16)
    y = task.target.repeat(3, 1)
    y[1, 5] = (y[1, 5] + 1) % race.VOCAB  # second run wrong
    scores = task.token_scores(y)
    torch.testing.assert_close(scores.sum(-1), task.reward(y))
    assert torch.equal(scores[0, :-1], torch.zeros(15))
    inside, outside = scores[1, 4:8], torch.cat([scores[1, :4], scores[1, 8:-1]])
    assert inside.max() < outside.min() and np.ptp(inside.numpy()) == 0


def test_credit_command(tmp_path):
    args = ["credit", "--out", str(tmp_path), "--seeds", "1", "--steps", "2", "--length", "8", "--groups", "2"]
    main(args + ["--group-size", "4", "--epochs", "1", "--minibatches", "1", "--batches", "3", "--warm-steps", "1"])
    for name in ["README.md", "COMMAND.txt", "gradients.csv", "race_summary.csv", "race_reward.png"]:
        assert (tmp_path / name).exists(), name
    text = (tmp_path / "README.md").read_text()
    assert "span lam=0.5" in text and "relative gradient variance GRPO" in text
