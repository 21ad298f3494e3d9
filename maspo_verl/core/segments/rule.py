"""What a segment rule is: the declarations a rule module makes and the one function it implements.

A rule (one module in ``maspo_verl/core/segments/rules/``) subclasses ``SegmentRule`` and declares:

- ``name``: the value of ``policy_loss.segment_rule`` that selects it; its docstring's first paragraph says
  what it does (the README's rules table shows it);
- ``settings``: its policy-loss fields (``Setting``: name, default, allowed values, one line each). The config
  dataclass, its validation, the Hydra defaults and the docs table are built from them;
- ``needs``: the inputs it reads besides the mask (``OLD_LOG_PROB``, ``LOG_RATIO``, ``RESPONSE_IDS``, ``WORD_IDS``,
  ``TOKENIZER``);
- ``limits``: settings under which it ends a segment at every valid token (``"token"``: GRPO's ratio) or never
  (``"sequence"``: GSPO's), for any inputs; the limit tests run each one it declares, and ``token_level`` asks
  the first;
- ``examples`` (required): small worked examples of what it does (``Example``: settings, a mask and the inputs
  -> the expected segment lengths of each row), worked out by hand from the rule's definition. The discovered
  tests run every example of every registered rule, so a rule that segments wrongly fails them even when it
  keeps its limits;
- ``reference`` (required): the rule written as a plain loop over one row's valid tokens (``Row``), which the
  discovered test holds ``candidates`` equal to on random rows and settings (the oracle; loops are fine there);
- optionally ``fallback_field`` (the field naming the rule for rows it cannot segment) and ``fallback_metric``,
  ``reads_codec`` (it reads codec codes), ``validate`` (checks across fields), ``startup`` (work on the
  composed trainer config before Ray) and ``sweeps`` (how the calibration lab varies its threshold on a corpus).

``candidates`` gets the config, the rows packed (``Packed``: each row's valid tokens moved to its front, so "the
previous valid token" is the previous column whatever the padding) and its inputs, and proposes boundaries with their
strengths; ``min_segment_len`` and ``max_segment_len`` apply to every rule unchanged. ``previous`` (here) and
``maspo_verl.core.tensors.float_mask`` are the tensor helpers rules share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from maspo_verl.batch import current_response_ids, current_tokenizer, current_word_ids
from maspo_verl.validation import Setting

# What a rule reads besides the mask. The old log-probs come with every loss call; the response ids, word ids
# and the actor's tokenizer from the verl micro-batch in scope (``maspo_verl.batch``), which the plugin's hooks
# provide.
OLD_LOG_PROB, RESPONSE_IDS, WORD_IDS, TOKENIZER = "old_log_prob", "response_ids", "word_ids", "tokenizer"
# the detached token log-ratios log pi - log pi_old (after the surrogate's per-token step): given by the loss
# (``Segments.sums``) and nothing else
LOG_RATIO = "log_ratio"
FROM_MICRO_BATCH = frozenset({RESPONSE_IDS, WORD_IDS, TOKENIZER})
LIMITS = ("token", "sequence")
# the quantiles of a corpus statistic a calibration sweep tries as thresholds
QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99)


class Packed:
    """The valid tokens of each row of a [B, T] mask moved to the front of the row, in order.

    Column p of a packed tensor holds the row's valid token number p, so the previous valid token is
    the previous column and a position counted in valid tokens is the column index; columns from the
    row's length on are padding. ``pack`` is one scatter, ``unpack`` one gather.
    """

    def __init__(self, mask: torch.Tensor):
        self.mask = mask = mask.bool()  # token order
        B, T = mask.shape
        count = torch.cumsum(mask, dim=-1, dtype=torch.int32)  # int32: several times faster than int64 on CPU
        self.lengths = count[:, -1:].clone() if T else count.new_zeros(B, 1)
        # each token's column; padding goes to a dump column T, cut off after packing
        self.slot = torch.where(mask, count.sub_(1), T).long()
        self.columns = torch.arange(T, device=mask.device, dtype=torch.int32)
        self.valid = self.columns < self.lengths
        # valid tokens with a previous valid token: all but column 0
        self.has_previous = self.valid.clone()
        self.has_previous[:, :1] = False

    def pack(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """x [B, T] in token order -> packed [B, T] (``fill`` past each row's length)."""
        B, T = x.shape
        return x.new_full((B, T + 1), fill).scatter_(-1, self.slot, x)[:, :T]

    def unpack(self, y: torch.Tensor, fill=0) -> torch.Tensor:
        """Packed y -> token order, ``fill`` on padding."""
        B, T = y.shape
        ext = y.new_empty((B, T + 1))
        ext[:, T] = fill
        ext[:, :T] = y
        return torch.gather(ext, -1, self.slot)


def previous(x: torch.Tensor) -> torch.Tensor:
    """Packed x shifted by one column: each valid token sees the previous valid token's value (0 in
    column 0, which has none)."""
    out = torch.empty_like(x)
    out[:, :1] = 0
    out[:, 1:] = x[:, :-1]
    return out


@dataclass
class Candidates:
    """What a rule proposes on the packed rows: boundaries, their strength for min-length
    suppression, the boundaries that must stay whatever their neighbours (None: only the first valid
    token), and metrics of the rule (name -> 0-d tensor, or a (sum, count) pair reported as their ratio and
    left out where the count is 0; moved to the host with the loss's other metrics). Boundaries stand on
    valid tokens only; scores are finite. The tensors are the rule's own: the segmentation modifies them
    in place."""

    boundaries: torch.Tensor
    scores: torch.Tensor
    forced: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


# a boundary that stays whatever min_segment_len says (``Row`` references; ``Candidates.forced``)
FORCED = math.inf


@dataclass
class Row:
    """One row's valid tokens in order, as Python values: what a rule's ``reference`` reads. ``positions``: each
    token's column in the [B, T] row (a gap between two is a hole); ``old_log_prob`` as float32 values (the
    precision the rules compute in); ``response_ids``, ``word_ids``; ``texts``: the text of each vocabulary id (the
    tokenizer's); ``log_ratio``: the token log-ratios as float64 values. An input the rule does not read is None."""

    positions: list[int]
    old_log_prob: list[float] | None = None
    response_ids: list[int] | None = None
    word_ids: list[int] | None = None
    texts: list[str] | None = None
    log_ratio: list[float] | None = None


@dataclass(frozen=True)
class Example:
    """A worked example of a rule: with ``settings`` (policy-loss fields over the defaults; ``segment_rule`` is
    the rule's own) the valid tokens of each row of ``mask`` (1: valid) form segments of ``lengths``, in token
    order. ``inputs`` holds the rows of what the rule reads (``OLD_LOG_PROB``, ``RESPONSE_IDS``, ``WORD_IDS``:
    one value per token, padding included; ``TOKENIZER``: the text of each id). ``why`` says what it shows."""

    why: str
    mask: tuple[tuple[int, ...], ...]
    lengths: tuple[tuple[int, ...], ...]
    settings: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sweep:
    """A calibration sweep of a rule (``python -m maspo_verl.lab segments``): the settings it fixes, the one it
    varies (``knob``) and the values it tries."""

    label: str
    fixed: dict[str, Any]
    knob: str
    grid: tuple[float, ...]


def quantile_grid(values: torch.Tensor, digits: int | None = None) -> tuple[float, ...]:
    """The distinct ``QUANTILES`` of ``values`` (rounded to ``digits``, or down to integers when None), sorted."""
    if values.numel() == 0:
        return ()
    q = torch.quantile(values.double().flatten(), torch.tensor(QUANTILES, dtype=torch.float64))
    q = q.floor() if digits is None else q.round(decimals=digits)
    return tuple(sorted(set(q.tolist())))


class RuleInputs:
    """The inputs of one segmentation ([B, T] tensors in token order; the tokenizer), each fetched when a rule
    first asks for it. ``configured`` names the configured rule in errors; ``for_rule`` gives the view a rule
    reads through, which names the rule that asked too when it is another (a fallback)."""

    def __init__(self, mask: torch.Tensor, configured: str, old_log_prob=None, response_ids=None, log_ratio=None):
        self.mask = mask
        self.configured = configured
        self._given = {OLD_LOG_PROB: old_log_prob, RESPONSE_IDS: response_ids, LOG_RATIO: log_ratio}
        self._asking = configured

    def for_rule(self, rule: SegmentRule) -> RuleInputs:
        view = object.__new__(RuleInputs)
        view.__dict__.update(self.__dict__)
        view._asking = rule.name
        return view

    @property
    def who(self) -> str:
        """The configured rule (and the rule asking, when it is its fallback), for error messages."""
        own = f"segment_rule={self.configured!r}"
        return own if self._asking == self.configured else f"{own} (through its fallback {self._asking!r})"

    def get(self, name: str) -> Any:
        value = self._given.get(name)
        if value is not None:
            return value
        if name == OLD_LOG_PROB:
            raise ValueError(f"{self.who} needs old_log_prob")
        if name == LOG_RATIO:
            raise ValueError(
                f"{self.who} needs log_ratio, the token log-ratios log pi - log pi_old, which only the loss has "
                "(compute_segment_ids(..., log_ratio=...))"
            )
        if name == RESPONSE_IDS:
            value = current_response_ids(self.mask, self.who)
        elif name == WORD_IDS:
            value = current_word_ids(self.mask, self.who)
        else:
            value = current_tokenizer(self.who)
        self._given[name] = value
        return value


class SegmentRule:
    """A segmentation rule: its declarations (module docstring of ``maspo_verl.core.segments.rule``) and
    ``candidates`` on the packed rows."""

    name: ClassVar[str]
    settings: ClassVar[tuple[Setting, ...]] = ()
    needs: ClassVar[frozenset[str]] = frozenset()
    limits: ClassVar[dict[str, dict[str, Any]]] = {}
    fallback_field: ClassVar[str | None] = None
    fallback_metric: ClassVar[str | None] = None
    reads_codec: ClassVar[bool] = False
    examples: ClassVar[tuple[Example, ...]] = ()

    @classmethod
    def summary(cls) -> str:
        """What the rule does, in one line: its docstring's first paragraph."""
        return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())

    def candidates(self, config: Any, packed: Packed, inputs: RuleInputs) -> Candidates:
        raise NotImplementedError

    def reference(self, config: Any, row: Row) -> list[float | None]:
        """``candidates`` written plainly for one row: per valid token, None (no boundary) or the strength of the
        boundary it starts (``FORCED``: one that must stay). The first token's entry is ignored (it always
        starts a segment)."""
        raise NotImplementedError(f"segment rule {self.name!r} declares no reference (SegmentRule.reference)")

    def token_level(self, config: Any) -> bool:
        """True when the settings give every token its own segment: they equal the declared ``"token"`` limit."""
        limit = self.limits.get("token")
        return bool(limit) and all(getattr(config, k, None) == v for k, v in limit.items())

    def validate(self, config: Any) -> None:
        """Checks across fields (each field alone is checked by its ``Setting``); raise ``FieldError``."""

    def sweeps(self, config: Any, packed: Packed, inputs: RuleInputs) -> list[Sweep | str]:
        """How ``python -m maspo_verl.lab segments`` calibrates the rule on a corpus (its rows packed, its inputs):
        the sweeps, and notes on what it leaves out (strings). None by default."""
        return []

    def startup(self, trainer_config: Any) -> list[str]:
        """Start-up work on the composed trainer config (before Ray); returns the warnings issued."""
        return []
