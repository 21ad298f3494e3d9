"""The estimator lab's exact expectations, checked against hand computation and autograd."""

import itertools
import math

import pytest
import torch

from maspo_verl.lab.engine.exact import (
    DTYPE,
    enumerate_sequences,
    moments,
    per_sample_gradients,
    token_log_probs,
)
from maspo_verl.lab.studies import estimators as E


def test_enumeration_counts_and_masks():
    tokens, mask = enumerate_sequences(2, 2)
    assert tokens.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert mask.all()
    tokens, mask = enumerate_sequences(4, 3, eos=3)  # 3 content tokens
    assert tokens.shape[0] == 1 + 3 + 9 + 27
    assert len({tuple(t) for t in tokens.tolist()}) == tokens.shape[0]
    lengths = mask.sum(-1)
    # k content tokens + EOS, capped at L
    assert sorted(set(lengths.tolist())) == [1, 2, 3]
    assert (tokens[~mask] == 3).all()


def _hand_case():
    # V=2, L=2, no EOS: rows 0, 1 = after token 0 / 1, row 2 = after BOS
    old = torch.tensor([[0.3, -0.2], [1.0, 0.0], [0.0, 0.5]], dtype=DTYPE)
    new = old + torch.tensor([[0.4, -0.1], [-0.3, 0.2], [0.25, -0.25]], dtype=DTYPE)
    return old, new


def _softmax(row):
    z = [math.exp(v) for v in row]
    s = sum(z)
    return [v / s for v in z]


def test_token_ratio_estimator_by_hand():
    """V=2, L=2: every sequence, probability, ratio and score written out in plain Python."""
    old, new = _hand_case()
    o, n = old.tolist(), new.tolist()
    reward = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.0, (1, 1): 1.0}  # "both tokens equal"
    seqs = list(itertools.product([0, 1], repeat=2))
    p_old = {}
    p_new = {}
    for y in seqs:
        po = _softmax(o[2])[y[0]] * _softmax(o[y[0]])[y[1]]
        pn = _softmax(n[2])[y[0]] * _softmax(n[y[0]])[y[1]]
        p_old[y], p_new[y] = po, pn
    base = sum(p_old[y] * reward[y] for y in seqs)

    def score(y, t):  # d log pi_new(y_t | prev) / d table, flattened [3 x 2]
        row = 2 if t == 0 else y[0]
        probs = _softmax(n[row])
        g = [0.0] * 6
        for v in range(2):
            g[row * 2 + v] = (1.0 if v == y[t] else 0.0) - probs[v]
        return g

    def ratio(y, t):
        row = 2 if t == 0 else y[0]
        return _softmax(n[row])[y[t]] / _softmax(o[row])[y[t]]

    true = [0.0] * 6
    mean_tok = [0.0] * 6
    second = 0.0
    for y in seqs:
        a = reward[y] - base
        g_tok = [0.0] * 6
        for t in range(2):
            s = score(y, t)
            for k in range(6):
                true[k] += p_new[y] * a * s[k]
                g_tok[k] += ratio(y, t) * a * s[k]
        for k in range(6):
            mean_tok[k] += p_old[y] * g_tok[k]
        second += p_old[y] * sum(v * v for v in g_tok)
    var_tok = second - sum(v * v for v in mean_tok)

    tokens, mask = enumerate_sequences(2, 2)
    rewards = torch.tensor([reward[tuple(y)] for y in tokens.tolist()], dtype=DTYPE)
    case = E.Case(tokens, mask, old, new, rewards)
    info, rows = E.analyse(case, [E.Estimator("token", "segments", window=1)])
    lp_old = token_log_probs(old, tokens, mask)
    lp_new = token_log_probs(new, tokens, mask)
    adv = rewards - base
    w = E.estimator_weights(E.Estimator("token", "segments", window=1), lp_new, lp_old, mask)
    mean, var = moments(per_sample_gradients(new, tokens, mask, w * adv[:, None]), lp_old.sum(-1).exp())
    assert torch.allclose(mean, torch.tensor(mean_tok, dtype=DTYPE), atol=1e-12)
    assert var == pytest.approx(var_tok, abs=1e-12)
    norm = math.sqrt(sum(v * v for v in true))
    assert info["grad_norm"] == pytest.approx(norm, rel=1e-12)
    bias = math.sqrt(sum((a - b) ** 2 for a, b in zip(mean_tok, true, strict=True))) / norm
    assert rows[0]["bias_rel"] == pytest.approx(bias, rel=1e-10)


def test_per_sample_gradients_match_autograd():
    tokens, mask = enumerate_sequences(4, 4, eos=3)
    theta = E.behaviour_logits("speech") + 0.2 * E.drift_direction()
    coef = torch.randn(tokens.shape, dtype=DTYPE, generator=torch.Generator().manual_seed(0))
    grads = per_sample_gradients(theta, tokens, mask, coef)
    for i in [0, 5, 17, tokens.shape[0] - 1]:
        th = theta.clone().requires_grad_()
        (token_log_probs(th, tokens[i : i + 1], mask[i : i + 1]) * coef[i : i + 1]).sum().backward()
        assert torch.allclose(grads[i], th.grad.flatten(), atol=1e-12)


@pytest.mark.parametrize("policy", ["speech", "text"])
@pytest.mark.parametrize("reward", ["verifier", "length"])
def test_identities(policy, reward):
    """Full product: unbiased for grad J; cumprod: unbiased for g_pc; W >= L segment == GSPO."""
    info, rows = E.analyse(E.make_case(policy, reward, 5, 0.4))
    by = {r["estimator"]: r for r in rows}
    assert info["prob_sum_err"] < 1e-12
    assert by["full product"]["bias_rel"] < 1e-10
    assert by["cumulative cumprod (CTPO)"]["bias_pc_rel"] < 1e-10
    assert by["token (GRPO)"]["bias_rel"] > 1e-3  # the drift is large enough to show bias
    big = E.analyse(E.make_case(policy, reward, 5, 0.4), [E.Estimator("W=8", "segments", window=8)])[1][0]
    assert big["bias_rel"] == pytest.approx(by["GSPO (geo-mean)"]["bias_rel"], rel=1e-10)
    assert big["var"] == pytest.approx(by["GSPO (geo-mean)"]["var"], rel=1e-10)


def test_zero_drift_every_estimator_is_reinforce():
    info, rows = E.analyse(E.make_case("text", "verifier", 4, 0.0))
    for r in rows:
        assert r["bias_rel"] < 1e-10, r["estimator"]
        assert r["var"] == pytest.approx(rows[0]["var"], rel=1e-10)
    assert info["kl_seq"] == pytest.approx(0.0, abs=1e-14)


@pytest.mark.parametrize(
    "loss_mode, est, extra",
    [
        ("ctpo", E.Estimator("cumprod", "prefix", alpha=0.0), {"ctpo_mode": "cumprod"}),
        ("ctpo", E.Estimator("geomean", "prefix", alpha=1.0), {"ctpo_mode": "geomean"}),
        ("maspo", E.Estimator("W=2", "segments", window=2), {"segment_window": 2}),
        (
            "maspo",
            E.Estimator("logprob", "segments", rule="logprob", threshold=1.0),
            {"segment_rule": "logprob", "logprob_threshold": 1.0},
        ),
        ("pgspo", E.Estimator("p", "sequence", alpha=0.5), {"length_exponent": 0.5}),
    ],
)
def test_lab_weights_are_the_loss_gradient(loss_mode, est, extra):
    """Without active clipping, d loss / d log_prob of the registered loss is -A * w_t (token-sum)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.race import Contender, contender_config

    tokens, mask = enumerate_sequences(4, 4, eos=3)
    old = E.behaviour_logits("speech")
    lp_old = token_log_probs(old, tokens, mask)
    lp_new = token_log_probs(old + 0.05 * E.drift_direction(), tokens, mask)
    adv = torch.linspace(-1, 1, tokens.shape[0], dtype=DTYPE)[:, None].expand(tokens.shape).contiguous()
    cfg = contender_config(Contender("x", loss_mode, clip_low=0.99, clip_high=1e6, policy_loss=extra))
    object.__setattr__(cfg, "clip_ratio_c", 1e9)
    lp = lp_new.clone().requires_grad_()
    loss, _ = get_policy_loss_fn(loss_mode)(lp_old, lp, adv, mask, "token-sum", cfg, None)
    loss.backward()
    w = E.estimator_weights(est, lp_new, lp_old, mask)
    assert torch.allclose(lp.grad, -adv * w * mask, atol=1e-10)
