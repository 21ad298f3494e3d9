"""The worked examples every rule and every surrogate declares (``SegmentRule.examples``,
``Surrogate.examples``), run for each registered one: what a rule or a surrogate *does*, next to the limits
(``test_limits.py``) that only bound it. The expected values are worked out by hand from each definition."""

from __future__ import annotations

import pytest
import torch

from maspo_verl.batch import WORD_IDS_KEY, micro_batch_scope
from maspo_verl.config import actor_config
from maspo_verl.core.segments import (
    LOG_RATIO,
    OLD_LOG_PROB,
    RESPONSE_IDS,
    SEGMENT_RULES,
    TOKENIZER,
    WORD_IDS,
    compute_segment_ids,
)
from maspo_verl.core.segments.reference import reference_segment_ids
from maspo_verl.core.surrogates import SURROGATES

RULE_EXAMPLES = [
    pytest.param(name, i, id=f"{name}-{i}") for name, rule in SEGMENT_RULES.items() for i in range(len(rule.examples))
]
SURROGATE_EXAMPLES = [
    pytest.param(name, i, id=f"{name}-{i}")
    for name, surrogate in SURROGATES.items()
    for i in range(len(surrogate.examples))
]


@pytest.mark.parametrize("name", list(SEGMENT_RULES))
def test_every_rule_declares_examples(name):
    assert SEGMENT_RULES[name].examples, f"segment rule {name!r} declares no worked example (SegmentRule.examples)"


@pytest.mark.parametrize("name", list(SURROGATES))
def test_every_surrogate_declares_examples(name):
    assert SURROGATES[name].examples, f"surrogate {name!r} declares no worked example (Surrogate.examples)"


def segment_lengths(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row's segment lengths in token order, from its segment ids over the valid tokens."""
    rows = []
    for row_ids, row_mask in zip(ids.tolist(), mask.tolist(), strict=True):
        lengths: list[int] = []
        last = None
        for seg, valid in zip(row_ids, row_mask, strict=True):
            if valid:
                if seg != last:
                    lengths.append(0)
                    last = seg
                lengths[-1] += 1
        rows.append(tuple(lengths))
    return rows


@pytest.mark.parametrize(("name", "index"), RULE_EXAMPLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rule_example(name, index, dtype):
    example = SEGMENT_RULES[name].examples[index]
    mask = torch.tensor(example.mask, dtype=torch.bool)
    config = actor_config(**{"segment_rule": name, **example.settings}).policy_loss
    inputs = example.inputs
    old = inputs.get(OLD_LOG_PROB)
    old = None if old is None else torch.tensor(old, dtype=dtype)
    delta = inputs.get(LOG_RATIO)
    delta = None if delta is None else torch.tensor(delta, dtype=dtype)
    data = {}
    if RESPONSE_IDS in inputs:
        data["responses"] = torch.tensor(inputs[RESPONSE_IDS])
    if WORD_IDS in inputs:
        data[WORD_IDS_KEY] = torch.tensor(inputs[WORD_IDS])
    tokenizer = list(inputs[TOKENIZER]) if TOKENIZER in inputs else None
    with micro_batch_scope(data, tokenizer):
        ids = compute_segment_ids(mask, config, old_log_prob=old, log_ratio=delta)
        plain = reference_segment_ids(mask, config, old_log_prob=old, log_ratio=delta)
    assert segment_lengths(ids, mask) == [tuple(row) for row in example.lengths], example.why
    assert segment_lengths(plain, mask) == [tuple(row) for row in example.lengths], f"reference: {example.why}"
    assert (ids[~mask] == 0).all()


@pytest.mark.parametrize(("name", "index"), SURROGATE_EXAMPLES)
def test_surrogate_example(name, index):
    """Per-token loss and d loss / d log pi of the surrogate on the example's shared ratios, in float64."""
    surrogate = SURROGATES[name]
    example = surrogate.examples[index]
    actor = actor_config(**example.actor, surrogate=name, **example.settings)
    pl = actor.policy_loss
    shape = (1, len(example.ratio))
    ratio = torch.tensor(example.ratio, dtype=torch.float64).reshape(shape)
    adv = torch.tensor(example.advantage, dtype=torch.float64).reshape(shape)
    log_prob = torch.tensor(example.log_prob or (-1.0,) * shape[1], dtype=torch.float64).reshape(shape).requires_grad_()
    sizes = None if example.sizes is None else torch.tensor(example.sizes, dtype=torch.float64).reshape(shape)
    score = log_prob - log_prob.detach()  # value 0, gradient grad log pi
    if example.token_log_ratio is not None:  # the row is one set: step 3 of the call, then its geometric mean
        delta = torch.tensor(example.token_log_ratio, dtype=torch.float64).reshape(shape)
        clip = surrogate.clip_tokens(pl, actor, delta, adv)
        shared = clip.delta.mean(-1, keepdim=True).expand(shape).exp()
        torch.testing.assert_close(shared, ratio, rtol=1e-12, atol=1e-12, msg=f"shared ratio: {example.why}")
        if clip.keeps_grad is not None:
            score = score * clip.keeps_grad
    set_log_prob = None
    if surrogate.reads_set_probability:  # the example's set log-probability, else each token a set of its own
        given = example.old_log_prob
        set_log_prob = (log_prob.detach() - ratio.log()) if given is None else torch.tensor(given, dtype=torch.float64)
        set_log_prob = set_log_prob.reshape(shape)
    params = surrogate.params(pl, actor, sizes, set_log_prob)
    # the loss's stop-gradient ratio r = exp(sg[l] + log pi - sg[log pi]): value r, gradient r grad log pi
    token = surrogate.loss(ratio * score.exp(), ratio.log() + score, adv, log_prob, params)
    (grad,) = torch.autograd.grad(token.loss.sum(), log_prob)
    expected_loss = torch.tensor(example.loss, dtype=torch.float64).reshape(shape)
    expected_grad = torch.tensor(example.grad, dtype=torch.float64).reshape(shape)
    torch.testing.assert_close(token.loss.detach(), expected_loss, rtol=1e-12, atol=1e-12, msg=example.why)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12, msg=example.why)
