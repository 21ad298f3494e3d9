"""Every registered segment rule (a contributor's included) against its own plain loop (``SegmentRule.reference``,
run by ``maspo_verl.core.segments.reference``): random rows (right or left padding, holes, empty rows), random
settings drawn from what the rule declares, with and without ``min_segment_len`` / ``max_segment_len``.

The worked examples pin what a rule does on the cases its author thought of; this pins the vectorised code to the
loop on the cases nobody did (long rows, many segments, ties). Log-probs and thresholds are multiples of 1/16, exact
in float32, so both sides compare the same numbers and ties happen. Ties are also drawn on purpose, so that a `>`
that should be `>=`, a window one off or a floor that should round fails here:

- settings at their bounds (an integer's minimum and maximum, a number's closed ends) and at round values
  (0, +-1/2, +-1, 2: a z-score of 1, a quantile of 1/2), and 1 - 2^-30, a hair under one;
- rows whose values sit exactly at a per-row cutoff: old log-probs alternating between two values, whose drops
  are +-d with mean 0 and standard deviation d on an odd number of tokens (a z-score of 1 is the drop d itself),
  and log-ratios constant over the row (every window's mean is the row's);
- short rows (1 to 3 tokens) next to long ones, and lengths that make q L a half-integer.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from maspo_verl.batch import NO_WORD, WORD_IDS_KEY, micro_batch_scope
from maspo_verl.config import LOSS_SETTINGS, actor_config
from maspo_verl.core.segments import SEGMENT_RULES, compute_segment_ids, rules_in_use
from maspo_verl.core.segments.reference import reference_segment_ids
from maspo_verl.validation import Bool, Choice, Float, Int, Ints, Strings
from tests.helpers import random_mask

SEEDS = range(100)
# a small vocabulary (id -> text) for the rules that read text; ids len(TEXTS) and beyond are unknown to it
TEXTS = ["a", "b", " ", ".", "\n", "Step", ". ", "\n\n", "ab", "b.", " S", "tep", "?", "! "]
STRINGS = ["\n", ". ", "Step", "ab", "b.", "a"]  # each occurs in TEXTS, inside a token or across two


# round values a number is drawn at a fifth of the time: cutoffs that data in multiples of 1/16 hit exactly, and
# one just below 1 (a float64 cutoff a hair under a value, which float32 would round onto it)
ROUND = (0.0, 0.5, -0.5, 1.0, -1.0, 2.0, 1.0 - 2.0**-30)


def draw(setting, g: random.Random):
    """A value of ``setting`` that its allowed values accept: its default a quarter of the time, else often at
    a bound or a round value (``ROUND``)."""
    allowed = setting.allowed
    if g.random() < 0.25:
        return setting.default
    if isinstance(allowed, Bool):
        return g.random() < 0.5
    if isinstance(allowed, Choice):
        return g.choice(allowed.choices)
    if isinstance(allowed, Int):
        top = allowed.minimum + 6 if allowed.maximum is None else min(allowed.maximum, allowed.minimum + 6)
        if g.random() < 0.2:  # at a bound
            return allowed.minimum if allowed.maximum is None or g.random() < 0.5 else allowed.maximum
        return g.randint(allowed.minimum, top)
    if isinstance(allowed, Float):
        lo, hi = max(allowed.lo, -2.0), min(allowed.hi, 4.0)
        ends = [v for v in (allowed.lo, allowed.hi) if math.isfinite(v) and not (v == allowed.lo and allowed.lo_open)]
        if ends and g.random() < 0.15:
            return g.choice(ends)
        inside = [v for v in ROUND if lo <= v <= hi and not (allowed.lo_open and v <= allowed.lo)]
        if inside and g.random() < 0.25:
            return g.choice(inside)
        value = round((lo + (hi - lo) * g.random()) * 16) / 16
        return min(max(value, lo + (allowed.lo_open and value <= lo) / 16), hi)
    if isinstance(allowed, Strings):
        return g.sample(STRINGS, g.randint(1, 3))
    if isinstance(allowed, Ints):
        return [g.randint(allowed.minimum, allowed.minimum + 3) for _ in range(g.randint(1, 4))]
    return setting.default


# the clip band's settings, which a rule may read (adaptive's band criterion)
CLIP = ("clip_schedule", "clip_exponent", "log_clip_low", "log_clip_high")


def random_config(name: str, g: random.Random):
    """The rule's policy-loss config with random settings (its own, its fallback's, the lengths, the clip band),
    redrawn until they pass validation (checks across fields)."""
    clip = [s for s in LOSS_SETTINGS if s.name in CLIP]
    for _ in range(200):
        fields = {s.name: draw(s, g) for rule in SEGMENT_RULES.values() for s in (*rule.settings, *clip)}
        if "fsq_levels" in fields and g.random() < 0.5:  # a codebook of those levels (tokenval's FSQ distances)
            fields["codec_size"] = math.prod(fields["fsq_levels"])
        if fields["adaptive_criterion"] == "band" and g.random() < 0.8:  # mostly a band it accepts
            fields.update(clip_exponent=-abs(fields["clip_exponent"]) or -0.5)
        low = g.choice([0, 0, 0, 2, 3])
        fields.update(min_segment_len=low, max_segment_len=g.choice([0, 0, 0, max(low, 2) + g.randint(0, 4)]))
        try:
            return actor_config(loss_mode="maspo", segment_rule=name, **fields).policy_loss
        except ValueError:
            continue
    return actor_config(loss_mode="maspo", segment_rule=name).policy_loss


def random_inputs(config, g: random.Random):
    """A random [B, T] mask and what the rules in use read: log-probs, response ids (codec codes in slow random
    walks when a rule reads codes, else ids of ``TEXTS``), word ids (runs, gaps, rows without words)."""
    gen = torch.Generator().manual_seed(g.randrange(2**31))
    B, T = g.randint(1, 4), g.choice([g.randint(1, 3), g.randint(1, 30), g.randint(1, 30)])  # short rows too
    mask = random_mask(B, T, g.choice(["right", "left", "holes"]), gen)
    old = -torch.randint(0, 64, (B, T), generator=gen).float() / 16
    shape = g.random()
    if shape < 0.3:  # runs of equal log-probs: equal drops and surprisals, ties
        old = old[:, :1].expand(B, T) + (torch.randint(0, 3, (B, T), generator=gen) == 0) * old
    elif shape < 0.5:  # two values alternating over the valid tokens: drops +-d, at the per-row z = +-1 cutoffs
        parity = (torch.cumsum(mask, -1) % 2).bool()
        old = torch.where(parity, old[:, :1], old[:, 1:2] if T > 1 else old[:, :1] - 0.5)
    if any(rule.reads_codec for rule in rules_in_use(config)):
        offset, size = config.codec_offset, config.codec_size
        steps = torch.randint(-3, 4, (B, T), generator=gen) * torch.randint(1, 6, (B, 1), generator=gen) ** 2
        codes = (torch.randint(0, size, (B, 1), generator=gen) + steps.cumsum(-1)).remainder(size)
        text = torch.rand(B, T, generator=gen) < 0.1  # tokens outside the codec
        ids = torch.where(text, torch.randint(0, max(offset, 1), (B, T), generator=gen), codes + offset)
    else:
        ids = torch.randint(0, len(TEXTS) + 2, (B, T), generator=gen)
    words = torch.full((B, T), NO_WORD)
    for b in range(B):
        if g.random() < 0.25:
            continue  # no words: the fallback rule
        word, t = 0, 0
        while t < T:
            run = g.randint(1, 5)
            if g.random() < 0.7:
                words[b, t : t + run] = word
                word += 1
            t += run
    # log-ratios (multiples of 1/16): independent, in runs of equal values (correlated), all zero, or one value
    # per row (every window's mean is the row's: at a band's edge when that value is one)
    kind = g.choice(["white", "runs", "zero", "constant"])
    delta = (torch.randint(-32, 33, (B, T), generator=gen) / 16).double()
    if kind == "runs":
        run = torch.randint(1, 9, (B, 1), generator=gen)
        delta = delta.gather(-1, (torch.arange(T) // run * run).clamp(max=T - 1))
    elif kind == "zero":
        delta.zero_()
    elif kind == "constant":
        delta = delta[:, :1].expand(B, T).clone()
    return mask, old, delta, {"responses": ids, WORD_IDS_KEY: words}


def lengths(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [torch.bincount(row[m]).tolist() if m.any() else [] for row, m in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(SEGMENT_RULES))
def test_rule_equals_its_reference(name, seed):
    g = random.Random(f"{name}-{seed}")
    config = random_config(name, g)
    mask, old, delta, data = random_inputs(config, g)
    with micro_batch_scope(data, TEXTS):
        got = compute_segment_ids(mask, config, old_log_prob=old, log_ratio=delta)
        want = reference_segment_ids(mask, config, old_log_prob=old, log_ratio=delta)
    if not torch.equal(got, want):
        row = next(b for b in range(mask.shape[0]) if not torch.equal(got[b], want[b]))
        settings = {s.name: getattr(config, s.name) for rule in rules_in_use(config) for s in rule.settings}
        pytest.fail(
            f"segment rule {name!r} differs from its reference on row {row} with {settings}, "
            f"min/max_segment_len {config.min_segment_len}/{config.max_segment_len}: segment lengths "
            f"{lengths(got, mask)[row]} (vectorised) vs {lengths(want, mask)[row]} (reference); mask "
            f"{mask[row].int().tolist()}, old log-probs {old[row].tolist()}, ids {data['responses'][row].tolist()}, "
            f"word ids {data[WORD_IDS_KEY][row].tolist()}, log-ratios {delta[row].tolist()}"
        )


def test_the_draws_reach_every_setting():
    """The random settings are not stuck at the defaults: every declared setting takes another value somewhere."""
    seen = {s.name: set() for rule in SEGMENT_RULES.values() for s in rule.settings}
    for name in SEGMENT_RULES:
        for seed in SEEDS:
            config = random_config(name, random.Random(f"{name}-{seed}"))
            for setting in seen:
                seen[setting].add(repr(getattr(config, setting)))
    single = [setting for setting, values in seen.items() if len(values) < 2]
    assert not single, f"settings never drawn away from one value: {single}"
