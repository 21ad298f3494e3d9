"""spike: a segment ends after a surprisal spike, a token whose sampled-token surprisal -log pi_old(y_t) exceeds a
threshold (a worked example of a segment rule). A rule is given the sampled token's old log-prob, not the
distribution over the vocabulary, so it cannot compute an entropy.

To use it, copy this file into ``maspo_verl/core/segments/rules/``, add a preset
``hydra_configs/loss/maspo_spike.yaml``
(``loss_mode: maspo``, ``segment_rule: spike``), run ``python -m maspo_verl generate`` and
``pytest tests/core --rule spike``: the rule is discovered, its field ``policy_loss.spike_threshold`` is validated,
documented and settable from the CLI, and the discovered tests (its worked examples, its plain reference on random
rows with ties, limits, validation, the reference loss, fuzz, data parallelism, the preset) cover it.
``tests/test_example_rule.py`` does exactly this in a copy of the repository, under a name the code has never seen.
"""

from __future__ import annotations

import math

from maspo_verl.core.segments.rule import OLD_LOG_PROB, Candidates, Example, SegmentRule, previous
from maspo_verl.core.tensors import float_mask
from maspo_verl.validation import Float, Setting

# non-finite old log-probs count as this much surprisal
MAX_SURPRISAL = 1e4


class SpikeRule(SegmentRule):
    """A segment ends after a token whose old-policy surprisal −log πold(y_t) exceeds `spike_threshold`."""

    name = "spike"  # policy_loss.segment_rule=spike
    needs = frozenset({OLD_LOG_PROB})  # what it reads besides the mask
    settings = (Setting("spike_threshold", 2.0, Float(), "surprisal (nats) after which a segment ends (`spike`)"),)
    # surprisal is clamped to [-MAX_SURPRISAL, MAX_SURPRISAL]: below that every token ends a segment, above it none
    limits = {"token": {"spike_threshold": -2 * MAX_SURPRISAL}, "sequence": {"spike_threshold": 2 * MAX_SURPRISAL}}
    # required: what the rule does, worked out by hand (the discovered tests run each one)
    examples = (
        Example(
            "surprisals 0.5 3.0 0.1 0.2 2.5 0.3, threshold 2: segments end after the 3.0 and the 2.5",
            mask=((1,) * 6,),
            lengths=((2, 3, 1),),
            settings={"spike_threshold": 2.0},
            inputs={OLD_LOG_PROB: ((-0.5, -3.0, -0.1, -0.2, -2.5, -0.3),)},
        ),
        Example(
            "a hole is skipped: the token after the surprising one is the next valid token",
            mask=((1, 1, 0, 1),),
            lengths=((2, 1),),
            settings={"spike_threshold": 2.0},
            inputs={OLD_LOG_PROB: ((-0.5, -3.0, -9.0, -0.1),)},
        ),
        Example(
            "at the cutoff: a surprisal of exactly 2.0 does not exceed the threshold 2, so no segment ends after it",
            mask=((1,) * 4,),
            lengths=((3, 1),),
            settings={"spike_threshold": 2.0},
            inputs={OLD_LOG_PROB: ((-2.0, -0.5, -2.5, -0.1),)},
        ),
    )

    def candidates(self, config, packed, inputs):
        # packed rows: column p is the row's valid token p, so the previous column is the previous valid token
        lp = packed.pack(inputs.get(OLD_LOG_PROB)).float().nan_to_num_(nan=0.0, neginf=-MAX_SURPRISAL)
        surprisal = lp.neg_().clamp_(-MAX_SURPRISAL, MAX_SURPRISAL).mul_(float_mask(packed.valid))
        after = previous(surprisal)  # the surprisal of the token before each one
        # compared in float64, the setting's precision: against a float32 tensor torch would round the threshold to
        # float32 first (1 - 2^-30 to 1.0, which a surprisal of exactly 1.0 would then not exceed)
        boundaries = packed.has_previous & (after.double() > config.spike_threshold)
        # the strength of a boundary, for min_segment_len: the surprisal that made it
        return Candidates(boundaries, after, None)

    # required: the same rule as a plain loop over one row's valid tokens (the tests hold candidates equal to it)
    def reference(self, config, row):
        lp = [0.0 if math.isnan(x) else max(x, -MAX_SURPRISAL) for x in row.old_log_prob]
        surprisal = [max(-MAX_SURPRISAL, min(MAX_SURPRISAL, -x)) for x in lp]
        # a boundary (of that strength) on the token after a surprising one
        return [None] + [s if s > config.spike_threshold else None for s in surprisal[:-1]]
