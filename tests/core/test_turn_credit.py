"""Turn credit (``maspo_turn_grpo``): verl's ``grpo`` exactly without per-turn scores, a float64 loop reference
with verl's ``turn_scores`` layout (the object arrays verl's agent loop writes into the non-tensor batch), the
per-turn term's sum, the token-score fallback, and the hook around verl's ``compute_advantage``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn

import maspo_verl.plugin  # noqa: F401  (registers maspo_turn_grpo, installs the hooks)
from maspo_verl.advantages import TURN_GRPO, turn_scores_scope
from maspo_verl.local import turns as env


def algo(lam=0.5, norm=True):
    return OmegaConf.create({"norm_adv_by_std_in_grpo": norm, "turn_credit": {"lam": lam}})


def episodes(seed=0, B=8, group=4, turns=3, turn_tokens=3, dtype=torch.float32):
    """Multi-turn rows as the toy loop builds them (turns of ``turn_tokens`` with 2 masked tokens between),
    right-padded; per-turn scores as verl's agent loop records them (some rows cut short: fewer scores); the
    outcome reward (mean turn score) on the last valid token."""
    rng = np.random.default_rng(seed)
    T = turns * turn_tokens + (turns - 1) * 2 + 2
    mask = torch.zeros(B, T, dtype=dtype)
    rewards = torch.zeros(B, T, dtype=dtype)
    scores, spans = [], []
    for i in range(B):
        n = int(rng.integers(1, turns + 1)) if i % 3 == 2 else turns
        s = [float(rng.integers(0, turn_tokens + 1)) / turn_tokens for _ in range(n)]
        row_spans = [(k * (turn_tokens + 2), k * (turn_tokens + 2) + turn_tokens) for k in range(n)]
        for a, b in row_spans:
            mask[i, a:b] = 1
        rewards[i, row_spans[-1][1] - 1] = sum(s) / turns
        scores.append(s)
        spans.append(row_spans)
    index = np.array([f"p{i // group}" for i in range(B)], dtype=object)
    return rewards, mask, index, scores, spans


def estimator(rewards, mask, index, config, scores=None):
    fn = get_adv_estimator_fn(TURN_GRPO)
    return fn(token_level_rewards=rewards, response_mask=mask, config=config, index=index, turn_scores=scores)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_no_turn_scores_is_verl_grpo_exactly(norm, seed):
    rewards, mask, index, _, _ = episodes(seed)
    verl, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    for scores in (None, [[] for _ in range(len(mask))], [None] * len(mask)):
        ours, returns = estimator(rewards, mask, index, algo(lam=1.0, norm=norm), scores)
        assert torch.equal(ours, verl) and torch.equal(returns, verl)
    ours, _ = estimator(rewards, mask, index, algo(lam=0.0, norm=norm), episodes(seed)[3])
    assert torch.equal(ours, verl)


@pytest.mark.parametrize("seed", range(4))
def test_against_a_float64_loop_and_the_documented_sum(seed):
    rewards, mask, index, scores, spans = episodes(seed, dtype=torch.float64)
    lam = 0.7
    ours, _ = estimator(rewards, mask, index, algo(lam=lam), scores)
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    # loop reference: e_ik = s_ik - mean_k s_ik, scaled by the group's largest |e|
    terms = [[s - sum(row) / len(row) for s in row] for row in scores]
    scale = {}
    for g, row in zip(index, terms, strict=True):
        scale[g] = max(scale.get(g, 0.0), max(abs(e) for e in row))
    expected = grpo.clone()
    for i, (row, row_spans) in enumerate(zip(terms, spans, strict=True)):
        for e, (a, b) in zip(row, row_spans, strict=True):
            if scale[index[i]] > 0:
                expected[i, a:b] += lam * e / scale[index[i]]
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    # the per-turn term sums to zero over each response's turns (one value per turn), lies in [-lam, lam]
    local = ours - grpo
    for i, row_spans in enumerate(spans):
        per_turn = [local[i, a].item() for a, _ in row_spans]
        assert all(torch.allclose(local[i, a:b], local[i, a].expand(b - a)) for a, b in row_spans)
        assert sum(per_turn) == pytest.approx(0.0, abs=1e-12)
        assert max(abs(x) for x in per_turn) <= lam + 1e-12
    assert (local.abs() > 1e-6).any()  # the term is not planted away


def test_token_scores_fallback_are_turn_sums_of_the_local_scores():
    """No turn scores, per-token reward scores: the turn term is the turn's sum of span credit's d_it."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.float64)
    rewards = torch.tensor([[0.2, 0.0, 0, -0.1, 0.5, 0], [0.0, 0.1, 0, 0.1, 0.0, 0]], dtype=torch.float64)
    index = np.array(["a", "a"], dtype=object)
    ours, _ = estimator(rewards, mask, index, algo(lam=1.0))
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    # d_it: rewards minus the row total on the last valid token; turn sums e = [0.2, -0.2], [0.1, -0.1]
    scale = 0.2
    expected = grpo + torch.tensor([[0.2, 0.2, 0, -0.2, -0.2, 0], [0.1, 0.1, 0, -0.1, -0.1, 0]]) / scale
    torch.testing.assert_close(ours, expected.to(ours.dtype), rtol=1e-12, atol=1e-12)


def test_verl_non_tensor_layout_through_compute_advantage():
    """verl's agent loop writes ``turn_scores`` as an object array of lists (empty for loops that score no
    turn); verl's own ``compute_advantage`` (the legacy trainer's entry; the v1 trainer's calls it too) hands
    the estimator tensors only, the hook puts the scores in scope."""
    from verl.trainer.ppo import ray_trainer

    rewards, mask, index, scores, _ = episodes(1)
    turn_scores = np.empty(len(scores), dtype=object)
    turn_scores[:] = [list(s) for s in scores]
    tool_rewards = np.empty(len(scores), dtype=object)
    tool_rewards[:] = [[] for _ in scores]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": index, "turn_scores": turn_scores, "tool_rewards": tool_rewards},
    )
    out = ray_trainer.compute_advantage(data, adv_estimator=TURN_GRPO, config=algo(lam=0.5))
    direct, _ = estimator(rewards, mask, index, algo(lam=0.5), scores)
    assert torch.equal(out.batch["advantages"], direct)
    # tool_rewards stand in where turn_scores are empty
    data.non_tensor_batch["turn_scores"][:] = [[] for _ in scores]
    data.non_tensor_batch["tool_rewards"][:] = [list(s) for s in scores]
    again = ray_trainer.compute_advantage(data, adv_estimator=TURN_GRPO, config=algo(lam=0.5))
    assert torch.equal(again.batch["advantages"], direct)


def test_scope_feeds_the_estimator():
    rewards, mask, index, scores, _ = episodes(2)
    with turn_scores_scope(scores):
        scoped, _ = estimator(rewards, mask, index, algo())
    assert torch.equal(scoped, estimator(rewards, mask, index, algo(), scores)[0])


def test_toy_environment_turn_scores():
    """The toy loop's per-turn scores are the environment's turn scores, whose mean is the reward."""
    refs = env.references(0, 3, 4)
    ids = [7, 100, 130, 250]
    assert env.turn_score(ids, refs[0]) == sum(int(s) == t // 64 for s, t in zip(refs[0], ids, strict=True)) / 4
