"""Which tokens share a ratio, and how their summed log-ratio is normalised (docs/algorithms.md).

Each registered ``TokenSet`` is one loss of this package: the plugin registers every name in
``TOKEN_SETS`` in verl's policy-loss registry, with the one loss body of ``maspo_verl.core.losses``.

| name    | token set S(t)          | exponent alpha of l_t = sum_{S(t)} delta / abs(S(t))^alpha |
|---------|-------------------------|-------------------------------------------------------------|
| `maspo` | segment of t            | `length_exponent` (1 = segment mean)                        |
| `ctpo`  | prefix {1..t}           | `ctpo_mode`: cumprod 0, geomean 1                           |
| `pgspo` | whole response          | `length_exponent` (1 = GSPO)                                |

A new loss is one subclass here, decorated with ``@register_token_set``, plus a preset in
``hydra_configs/loss/``; the settings it owns go in its class's ``settings``, like a segment rule's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from maspo_verl.core import segments
from maspo_verl.core.tensors import float_mask
from maspo_verl.util import registrar
from maspo_verl.validation import Choice, Setting


@dataclass
class SetSums:
    """The sums of delta over each set (``totals``) and the set sizes abs(S) (``sizes``), [B, T], in float32 or
    wider, indexed by set: by segment id where the sets are segments (``segment_ids`` given: slot k holds segment
    k), by token where each token has a set of its own (prefixes). ``at_tokens`` reads any such tensor per token."""

    totals: torch.Tensor
    sizes: torch.Tensor
    alpha: float
    segment_ids: torch.Tensor | None
    # metrics of the segmentation rule (name -> 0-d tensor), reported with the loss's metrics
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def at_tokens(self, per_set: torch.Tensor) -> torch.Tensor:
        """``per_set`` [B, T], indexed like ``totals``, read at each token's own set: [B, T]."""
        return per_set if self.segment_ids is None else per_set.gather(-1, self.segment_ids)


class TokenSet:
    """A token set and its normalisation: one loss."""

    name: ClassVar[str]
    # its own policy-loss fields (``Setting``), like a segment rule's
    settings: ClassVar[tuple[Setting, ...]] = ()
    # the sets partition each response (segment aggregation is defined)
    partition: ClassVar[bool] = True

    def sums(self, policy_loss: Any, old_log_prob: torch.Tensor, mask: torch.Tensor, delta: torch.Tensor) -> SetSums:
        """The sums of ``delta`` [B, T] (zero outside ``mask`` [B, T] bool) over each token's set, and the set sizes
        (``SetSums``, [B, T] each); ``old_log_prob`` [B, T] for the rules that read it."""
        raise NotImplementedError

    def sum_sets(self, sets: SetSums, values: torch.Tensor) -> torch.Tensor:
        """``values`` [B, T] (zero outside the mask) summed over each set of ``sets`` (``sums``' result), indexed like
        its ``totals``; by default over its segment ids."""
        return torch.zeros_like(values).scatter_add_(-1, sets.segment_ids, values)

    def segment_ids(self, policy_loss: Any, old_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The segment ids [B, T] of the tokens in ``mask`` (None for sets that are not segments); a rule that reads
        the token log-ratios fails here, naming them (only ``sums`` has them)."""
        return None

    def token_level(self, policy_loss: Any) -> bool:
        """True when the settings give every token its own ratio (GRPO's granularity)."""
        return False

    def segment_rules(self, policy_loss: Any) -> tuple[segments.SegmentRule, ...]:
        """The segmentation rules the settings run (none for sets that are not segments)."""
        return ()


TOKEN_SETS: dict[str, TokenSet] = {}
# class decorator: the plugin registers ``cls.name`` as a verl policy loss
register_token_set = registrar(TOKEN_SETS)


def segment_rules(policy_loss: Any) -> tuple[segments.SegmentRule, ...]:
    """The segmentation rules a policy-loss config (object or mapping) runs; none for other losses."""
    token_set = TOKEN_SETS.get(segments.setting(policy_loss, "loss_mode"))
    return token_set.segment_rules(policy_loss) if token_set else ()


def inputs_needed(policy_loss: Any) -> frozenset[str]:
    """What the loss reads besides log-probs and the mask (``maspo_verl.core.segments.SegmentRule.needs``)."""
    return frozenset().union(*(rule.needs for rule in segment_rules(policy_loss)))


@register_token_set
class Segments(TokenSet):
    """MASPO: contiguous segments from ``policy_loss.segment_rule`` (maspo_verl.core.segments)."""

    name = "maspo"

    def sums(self, policy_loss, old_log_prob, mask, delta):
        metrics: dict[str, torch.Tensor] = {}
        ids = segments.compute_segment_ids(
            mask, policy_loss, old_log_prob=old_log_prob, metrics=metrics, log_ratio=delta.detach()
        )
        # per segment id (indexed like the tokens): the sum of delta (zero outside mask), the number of tokens
        total = torch.zeros_like(delta).scatter_add_(-1, ids, delta)
        sizes = torch.zeros_like(delta).scatter_add_(-1, ids, float_mask(mask, delta.dtype))
        return SetSums(total, sizes, policy_loss.length_exponent, ids, metrics)

    def segment_ids(self, policy_loss, old_log_prob, mask):
        return segments.compute_segment_ids(mask, policy_loss, old_log_prob=old_log_prob)

    def segment_rules(self, policy_loss):
        return segments.rules_in_use(policy_loss)

    def token_level(self, policy_loss):
        return segments.token_level(policy_loss)


@register_token_set
class Prefixes(TokenSet):
    """CTPO: the prefix {1..t}; cumprod is the full prefix product, geomean its geometric mean."""

    name = "ctpo"
    settings = (
        Setting(
            "ctpo_mode", "cumprod", Choice(("cumprod", "geomean")), "`ctpo`: the prefix product (α 0) or its mean (α 1)"
        ),
    )
    partition = False

    def sums(self, policy_loss, old_log_prob, mask, delta):
        total, sizes = torch.cumsum(delta, dim=-1), torch.cumsum(float_mask(mask, delta.dtype), dim=-1)
        return SetSums(total, sizes, 0.0 if policy_loss.ctpo_mode == "cumprod" else 1.0, None)

    def sum_sets(self, sets, values):
        return torch.cumsum(values, dim=-1)


@register_token_set
class WholeResponse(TokenSet):
    """P-GSPO: one set per response, normalised by its length to the power ``length_exponent``."""

    name = "pgspo"

    def sums(self, policy_loss, old_log_prob, mask, delta):
        ids = self.segment_ids(policy_loss, old_log_prob, mask)  # one segment: sums as in ``Segments``
        total = torch.zeros_like(delta).scatter_add_(-1, ids, delta)
        sizes = torch.zeros_like(delta).scatter_add_(-1, ids, float_mask(mask, delta.dtype))
        return SetSums(total, sizes, policy_loss.length_exponent, ids)

    def segment_ids(self, policy_loss, old_log_prob, mask):
        return torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
