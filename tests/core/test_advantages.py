"""maspo_span_grpo against verl's GRPO, a float64 loop reference, and its edge cases."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import compute_advantage

import maspo_verl.plugin  # noqa: F401  (registers maspo_span_grpo)
from maspo_verl.advantages import SPAN_GRPO
from maspo_verl.speech.spans import token_scores


def algo(lam=0.5, norm=True):
    return OmegaConf.create({"norm_adv_by_std_in_grpo": norm, "span_credit": {"lam": lam}})


def span_batch(seed=0, B=12, T=10, group=4, dtype=torch.float32):
    """Per-token scores as the speech reward builds them: random spans of penalty, centred, score last."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T + 1, B)
    rows, spans = [], []
    for n in lengths:
        pen = [0.0] * n
        bad = []
        for _ in range(rng.integers(0, 3)):
            a = int(rng.integers(0, n))
            b = int(rng.integers(a + 1, n + 1))
            bad.append((a, b))
            for t in range(a, b):
                pen[t] -= 1.0 / (b - a)
        rows.append(token_scores(float(rng.random()), pen) + [0.0] * (T - n))
        spans.append(bad)
    mask = torch.arange(T)[None] < torch.as_tensor(lengths)[:, None]
    index = np.array([f"p{i // group}" for i in range(B)], dtype=object)
    return torch.tensor(rows, dtype=dtype), mask.to(dtype), index, spans


def estimator(rewards, mask, index, config):
    return get_adv_estimator_fn(SPAN_GRPO)(token_level_rewards=rewards, response_mask=mask, config=config, index=index)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_lambda_zero_is_verl_grpo_exactly(norm, seed):
    rewards, mask, index, _ = span_batch(seed)
    ours, returns = estimator(rewards, mask, index, algo(lam=0.0, norm=norm))
    verl, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    assert torch.equal(ours, verl) and torch.equal(returns, verl)


def test_outcome_only_rewards_are_verl_grpo_for_any_lambda():
    """A scalar score on the last token carries no local signal: the estimator is GRPO."""
    rewards, mask, index, _ = span_batch(1)
    outcome = torch.zeros_like(rewards)
    last = mask.sum(-1).long() - 1
    outcome[torch.arange(len(last)), last] = rewards.sum(-1)
    ours, _ = estimator(outcome, mask, index, algo(lam=2.0))
    verl, _ = compute_grpo_outcome_advantage(outcome, mask, index)
    assert torch.equal(ours, verl)


def test_matches_float64_loop_reference():
    rewards, mask, index, _ = span_batch(2, dtype=torch.float64)
    lam = 0.7
    ours, _ = estimator(rewards, mask, index, algo(lam=lam))
    B, T = rewards.shape
    totals = [float(rewards[i].sum()) for i in range(B)]
    local = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = int(mask[i].sum())
        for t in range(n):
            local[i][t] = float(rewards[i, t]) - (totals[i] if t == n - 1 else 0.0)
    expected = torch.zeros(B, T, dtype=torch.float64)
    for g in set(index):
        rows = [i for i in range(B) if index[i] == g]
        scores = torch.tensor([totals[i] for i in rows], dtype=torch.float64)
        mean, std = scores.mean(), scores.std()
        scale = max(abs(v) for i in rows for v in local[i])
        for i in rows:
            n = int(mask[i].sum())
            for t in range(n):
                expected[i, t] = (totals[i] - mean) / (std + 1e-6) + lam * (local[i][t] / scale if scale else 0.0)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_groups_by_index_value_as_verls_grpo_does():
    from maspo_verl.advantages import group_ids

    index = np.array([1, "1", 1.0, "a", "1", np.int64(1)], dtype=object)
    ids, n = group_ids(index, torch.device("cpu"))
    verl_groups: dict = {}  # verl's grpo keys its groups by the index values themselves
    expected = [verl_groups.setdefault(key, len(verl_groups)) for key in index]
    assert ids.tolist() == expected == [0, 1, 0, 2, 1, 0] and n == 3


def test_bad_span_tokens_get_lower_advantages_and_credit_only_moves_within_an_utterance():
    rewards, mask, index, spans = span_batch(3)
    ours, _ = estimator(rewards, mask, index, algo(lam=0.5))
    verl, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    checked = 0
    for i, bad in enumerate(spans):
        n = int(mask[i].sum())
        inside = torch.zeros(n, dtype=torch.bool)
        for a, b in bad:
            inside[a:b] = True
        if bad and not inside.all():
            assert ours[i, :n][inside].max() < ours[i, :n][~inside].min()
            checked += 1
        # the local term sums to zero over the response: the utterance's total credit is GRPO's
        assert float(ours[i, :n].sum()) == pytest.approx(float(verl[i, :n].sum()), abs=1e-4)
        assert torch.all(ours[i, n:] == 0)
    assert checked >= 3


def test_local_term_is_bounded_by_lambda():
    rewards, mask, index, _ = span_batch(4)
    ours, _ = estimator(rewards, mask, index, algo(lam=0.3))
    verl, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    diff = (ours - verl).abs()
    assert diff.max() <= 0.3 + 1e-6 and diff.max() >= 0.3 - 1e-6  # the largest |d| in a group maps to lam


def test_no_nan_with_identical_rewards_empty_spans_and_empty_rows():
    T = 6
    same = torch.tensor([token_scores(0.5, [0.0] * T)] * 4)
    mask = torch.ones(4, T)
    index = np.array(["a"] * 4, dtype=object)
    adv, _ = estimator(same, mask, index, algo(lam=1.0))
    assert torch.equal(adv, torch.zeros_like(adv))
    # identical scores and identical spans: GRPO part 0, local part still orders the tokens, finite
    pen = [0.0, -0.5, -0.5, 0.0, 0.0, 0.0]
    twins = torch.tensor([token_scores(0.5, pen)] * 4)
    adv, _ = estimator(twins, mask, index, algo(lam=1.0))
    assert torch.isfinite(adv).all() and adv[0, 1] < adv[0, 0]
    # an all-padding row, a single-sample group, all-zero rewards
    rewards = torch.zeros(3, T)
    mask = torch.tensor([[1.0] * T, [0.0] * T, [1.0] * 3 + [0.0] * 3])
    adv, _ = estimator(rewards, mask, np.array(["a", "a", "b"], dtype=object), algo(lam=1.0))
    assert torch.equal(adv, torch.zeros_like(adv))


def test_dispatched_by_verls_compute_advantage_with_the_composed_config():
    from tests.core.test_config import compose_config

    cfg = compose_config("credit=span", "algorithm.span_credit.lam=0.25")
    assert cfg.algorithm.adv_estimator == SPAN_GRPO
    rewards, mask, index, _ = span_batch(5)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": index}
    )
    out = compute_advantage(data, adv_estimator=cfg.algorithm.adv_estimator, config=cfg.algorithm)
    ours, _ = estimator(rewards, mask, index, algo(lam=0.25))
    assert torch.equal(out.batch["advantages"], ours)
    assert not torch.equal(ours, compute_grpo_outcome_advantage(rewards, mask, index)[0])


@pytest.mark.parametrize(
    "section,message",
    [({"lam": -1.0}, "algorithm.span_credit.lam=-1.0 is invalid"), ({"lambda": 1.0}, "unknown keys ['lambda']")],
)
def test_bad_span_credit_config_names_the_field(section, message):
    rewards, mask, index, _ = span_batch(0)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        estimator(rewards, mask, index, OmegaConf.create({"span_credit": section}))
