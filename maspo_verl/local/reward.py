"""Reward of the local toy task ("Repeat: <letters>"), used through
``reward.custom_reward_function.path``.

A 0/1 exact-match reward on a random model gives every response of a group the same score, so
GRPO advantages (and gradients) are all zero. A dense shaping term makes scores differ inside a
group: the share of response characters that belong to the target's letters, and a bonus for
the target appearing verbatim.
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    text = solution_str or ""
    target = str(ground_truth)
    letters = set(target)
    dense = sum(ch in letters for ch in text) / max(len(text), 1)
    exact = 1.0 if target in text else 0.0
    return float(exact + dense)
