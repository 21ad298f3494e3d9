"""Who shares a ratio: contiguous segments of a response (docs/algorithms.md, "Segmentation rules").

A rule (a ``SegmentRule`` in ``SEGMENT_RULES``, selected by ``policy_loss.segment_rule``) turns
[B, T] inputs into a boolean *boundary* tensor (True where a new segment starts), a boundary
*score* used by ``min_segment_len`` suppression and the boundaries that must stay; the boundaries'
running count gives the segment ids. Rules read their settings from the policy-loss config
(``maspo_verl.config.GranularLossConfig``), the one source of defaults. All functions are vectorised
over [B, T]: no Python loop over tokens or samples, no host sync.

Masks may be right- or left-padded and may contain holes (multi-turn tool outputs); "previous
token" always means the previous *valid* token, and positions count valid tokens only. Rules
work on *packed* rows (``Packed``): each row's valid tokens moved to its front, so the previous
valid token is the previous column and a position is a column index; the segment ids go back to
token order at the end. For CPU tensors ``compute_segments`` runs the rules that have a C version
(``native_code``) in C instead (``maspo_verl.native``, the same ids); these torch ops are the
definition and the GPU path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from maspo_verl import fsq, native, vocab
from maspo_verl.batch import NO_WORD, current_response_ids, current_tokenizer, current_word_ids
from maspo_verl.ratios import float_mask
from maspo_verl.util import registrar, warn_once

TOKENVAL_DISTANCES = ("id", "fsq_l1", "fsq_hamming")
# policy_loss.segment_kernel: the C library where it applies, or always torch ops
SEGMENT_KERNELS = ("auto", "torch")
# Per-sample logprob rule: sigma floor (nats) so a sample whose drops are all equal gets no boundaries.
STD_FLOOR = 1e-3
# Words rule: share of the rows with valid tokens and no word that took the fallback rule.
WORDS_FALLBACK_METRIC = "actor/ratio/words_fallback_frac"
# Drops of non-finite log-probs (-inf old log-prob) are clamped to this magnitude.
MAX_DROP = 1e4
# the logprob rule (own or as the words fallback) without old log-probs
NEEDS_OLD_LOG_PROB = "segment_rule='logprob' needs old_log_prob"
# min-length suppression: the key of a token that is no boundary
_FLOOR = torch.finfo(torch.float32).max


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


def fixed_boundaries(packed: Packed, window: int) -> torch.Tensor:
    """Boundary where (index among valid tokens) mod W == 0."""
    return packed.valid & (packed.columns % window == 0)


def logprob_drops(old_log_prob: torch.Tensor, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """d_p = lp_{p-1} - lp_p over valid neighbours (packed), zero where there is no previous token;
    returns (drops, has_previous as 0/1 floats)."""
    lp = packed.pack(old_log_prob).float().nan_to_num_(nan=0.0, neginf=-MAX_DROP, posinf=MAX_DROP)
    drop = torch.zeros_like(lp)
    torch.sub(lp[:, :-1], lp[:, 1:], out=drop[:, 1:])
    # zero where there is no previous valid token (a product: finite drops, cheaper than a select)
    w = float_mask(packed.has_previous)
    return drop.clamp_(-MAX_DROP, MAX_DROP).mul_(w), w


def per_sample_cutoffs(drop: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each row's drop cutoff mu + threshold * max(sigma, ``STD_FLOOR``) [B, 1], float64: mu and sigma
    the mean and population standard deviation of the row's drops (``w``: 0/1, which are drops)."""
    n = w.sum(-1, keepdim=True, dtype=torch.float64).clamp(min=1.0)
    mu = drop.sum(-1, keepdim=True, dtype=torch.float64) / n
    var = drop.double().sub_(mu).mul_(w).square_().sum(-1, keepdim=True) / n
    return mu + threshold * var.sqrt().clamp(min=STD_FLOOR)


def above(x: torch.Tensor, cutoffs: torch.Tensor) -> torch.Tensor:
    """float32 x > float64 cutoffs exactly, compared in float32: against each cutoff rounded down to a
    float32 (a float32 exceeds c exactly when it exceeds the largest float32 <= c)."""
    low = cutoffs.float()
    low = torch.where(low.double() > cutoffs, torch.nextafter(low, low.new_tensor(-math.inf)), low)
    return x > low


def logprob_candidates(
    old_log_prob: torch.Tensor, packed: Packed, threshold: float, per_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries, scores) of the logprob rule (packed): a boundary where the drop exceeds
    ``threshold``, or with ``per_sample`` the row's cutoff (``per_sample_cutoffs``: a z-score above
    ``threshold``, decided in float64). The score is the drop itself, which orders a row's boundaries
    as their z-scores do."""
    drop, w = logprob_drops(old_log_prob, packed)
    above_cut = above(drop, per_sample_cutoffs(drop, w, threshold)) if per_sample else drop > threshold
    return above_cut.logical_and_(packed.valid), drop


# one definition, in maspo_verl.fsq
fsq_digits_distance = fsq.digits_distance


def tokenval_scores(
    token_ids: torch.Tensor,
    packed: Packed,
    *,
    codec_offset: int,
    codec_size: int,
    distance: str,
    fsq_levels: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distance between neighbouring codec codes (packed, an integer type); returns (distance,
    outside_codec_boundary).

    A token outside [codec_offset, codec_offset + codec_size) (text, special tokens), and the
    token after it, start segments of their own: the second tensor marks them.
    """
    # int32 when the ids fit: several times faster than int64 on CPU
    dtype = torch.int32 if codec_offset + codec_size < 2**31 else torch.long
    ids = packed.pack(token_ids.to(dtype))
    in_codec = (ids >= codec_offset).logical_and_(ids < codec_offset + codec_size)
    # code + 1 inside the codec, 0 outside: the previous column brings the previous code and membership
    code1 = ids.sub_(codec_offset - 1).mul_(in_codec)
    prev_code1 = previous(code1)
    has_prev = packed.has_previous
    both = (prev_code1 > 0).logical_and_(in_codec).logical_and_(has_prev)
    if distance == "id":
        dist = (code1 - prev_code1).abs_()
    else:
        dist = fsq.distance(code1.sub_(1).clamp_(min=0), prev_code1.sub_(1).clamp_(min=0), fsq_levels, distance)
    return dist.mul_(both), has_prev & ~both


def suppress_close(
    boundaries: torch.Tensor, scores: torch.Tensor, min_len: int, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Non-maximum suppression on packed rows: drop a boundary within ``min_len - 1`` tokens of a
    stronger one.

    Boundaries are ordered by score, ties going to the earlier one (a strict total order);
    boundaries that must stay (the first valid token, tokens outside the codec: ``forced``, a subset
    of ``boundaries``) carry score +inf; ``scores`` are otherwise finite. A boundary survives when it
    is the strongest of all boundaries within ``min_len - 1`` valid tokens on either side,
    *suppressed ones included*, so no two survivors are closer than ``min_len``. Two consequences: a
    boundary can be dropped by a stronger neighbour that is itself dropped (in 9 . 8 . 9 with
    min_len 3 the 9s survive, the 8 goes, but in 7 . 8 . 9 only the 9 survives: the 7 is dropped by
    the 8, which the 9 drops), and the row's last segment may be shorter than ``min_len``. Forced
    boundaries next to each other suppress each other like equal scores (the caller keeps them).

    Linear in T: the strongest earlier and later neighbours come from one sliding-window max over
    the packed rows (strictly stronger than every earlier neighbour, at least as strong as every
    later one).
    """
    if min_len <= 1:
        return boundaries
    B, T = boundaries.shape
    pad = min_len - 1
    keys = torch.empty((B, T + 2 * pad), device=boundaries.device)
    keys[:, :pad] = -math.inf
    keys[:, pad + T :] = -math.inf
    own = keys[:, pad : pad + T]
    # the score on boundaries, the float32 floor elsewhere, as arithmetic (faster than a select)
    on = float_mask(boundaries)
    torch.addcmul(on.sub(1.0).mul_(_FLOOR), scores, on, out=own)
    if forced is not None:  # + inf where forced (0 * inf is nan: made 0)
        own.add_(float_mask(forced).mul_(math.inf).nan_to_num_(nan=0.0, posinf=math.inf))
    # window max over the pad columns before each column; column p's later neighbours are the window at p + min_len
    window = torch.nn.functional.max_pool1d(keys.unsqueeze(1), pad, stride=1).squeeze(1)
    keep = (own > window[:, :T]).logical_and_(own >= window[:, min_len : min_len + T])
    return keep.logical_and_(boundaries)


def split_long(boundaries: torch.Tensor, packed: Packed, max_len: int) -> torch.Tensor:
    """Add a boundary every ``max_len`` valid tokens inside each segment (packed; the first valid
    token must be a boundary; what it adds past a row's length is never unpacked)."""
    if max_len <= 0:
        return boundaries
    columns = packed.columns
    # distance to the last boundary, in valid tokens (exact in float32 below 2**24); a multiple of
    # max_len when its quotient is a whole number
    last = torch.cummax(float_mask(boundaries, torch.int32).mul_(columns), dim=-1).values
    since = torch.sub(columns.float(), last).div_(max_len)
    return boundaries | (since.frac_() == 0)


def fixed_window_ids(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Segment ids of the fixed rule without min/max length effects: (valid position) // W."""
    mask = mask.bool()
    # floor((count - 1) / W) in float32: exact for counts below 2**24; 0 on padding
    pos = torch.cumsum(mask, dim=-1, dtype=torch.int32).sub_(1).mul_(mask).float()
    return pos.div_(window).floor_().long()


@dataclass
class Candidates:
    """What a rule proposes on the packed rows: boundaries, their strength for min-length
    suppression, the boundaries that must stay whatever their neighbours (None: only the first valid
    token), and metrics of the rule (name -> 0-d tensor, moved to the host with the loss's other
    metrics). Boundaries stand on valid tokens only; scores are finite. The tensors are the rule's
    own: the segmentation modifies them in place."""

    boundaries: torch.Tensor
    scores: torch.Tensor
    forced: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


# What a rule reads besides the mask (``SegmentRule.needs``). The old log-probs come with every loss
# call; the response ids, word ids and the actor's tokenizer from the verl micro-batch in scope
# (``maspo_verl.batch``), which the plugin's hooks provide.
OLD_LOG_PROB, RESPONSE_IDS, WORD_IDS, TOKENIZER = "old_log_prob", "response_ids", "word_ids", "tokenizer"
FROM_MICRO_BATCH = frozenset({RESPONSE_IDS, WORD_IDS, TOKENIZER})


class RuleInputs:
    """The inputs of a segmentation ([B, T] tensors in token order; the tokenizer), each fetched when a
    rule first asks for it."""

    def __init__(self, mask: torch.Tensor, old_log_prob=None, response_ids=None):
        self.mask = mask
        self._given = {OLD_LOG_PROB: old_log_prob, RESPONSE_IDS: response_ids}

    def get(self, name: str) -> Any:
        value = self._given.get(name)
        if value is not None:
            return value
        if name == OLD_LOG_PROB:
            raise ValueError(NEEDS_OLD_LOG_PROB)
        fetch = {RESPONSE_IDS: current_response_ids, WORD_IDS: current_word_ids}.get(name)
        value = fetch(self.mask) if fetch is not None else current_tokenizer()
        self._given[name] = value
        return value


class SegmentRule:
    """A segmentation rule: ``candidates`` on the packed rows (``Packed``) from its inputs and the
    policy-loss config. A rule declares what it reads and how it falls back, and everything else (the
    plugin's start-up checks and hooks, the local mode, the C path, the speech reward) asks it:

    - ``needs``: the inputs it reads (``OLD_LOG_PROB``, ``RESPONSE_IDS``, ``WORD_IDS``);
    - ``fallback_field``: the policy-loss field naming the rule for rows it cannot segment (None: none);
      its metric ``fallback_metric`` is the share of rows that took it;
    - ``reads_codec``: it reads codec codes (``codec_offset``, ``codec_size``, ``fsq_levels``);
    - ``native_code``: its number in the C library (``maspo_verl/csrc/segment_ids.c``; None: torch ops);
    - ``startup(trainer_config)``: work and checks on the composed trainer config before Ray starts.
    """

    name: ClassVar[str]
    needs: ClassVar[frozenset[str]] = frozenset()
    fallback_field: ClassVar[str | None] = None
    fallback_metric: ClassVar[str | None] = None
    reads_codec: ClassVar[bool] = False
    native_code: ClassVar[int | None] = None

    def candidates(self, config: Any, packed: Packed, inputs: RuleInputs) -> Candidates:
        raise NotImplementedError

    def direct_ids(self, config: Any, mask: torch.Tensor) -> torch.Tensor | None:
        """Segment ids (token order) by a closed formula when there is one (None: go through the boundaries)."""
        return None

    def startup(self, trainer_config: Any) -> list[str]:
        """Start-up work on the composed trainer config (before Ray); returns the warnings issued."""
        return []


SEGMENT_RULES: dict[str, SegmentRule] = {}
# class decorator: the rule becomes selectable as ``policy_loss.segment_rule=<cls.name>``
register_segment_rule = registrar(SEGMENT_RULES)


def fallback_rules() -> tuple[str, ...]:
    """The rules that may serve as another's fallback: those with no fallback of their own."""
    return tuple(name for name, rule in SEGMENT_RULES.items() if rule.fallback_field is None)


@register_segment_rule
class FixedRule(SegmentRule):
    """A new segment every ``segment_window`` valid tokens."""

    name = "fixed"
    native_code = 0

    def candidates(self, config, packed, inputs):
        boundaries = fixed_boundaries(packed, config.segment_window)
        return Candidates(boundaries, torch.ones(boundaries.shape, device=boundaries.device))

    def direct_ids(self, config, mask):
        # min/max lengths cannot move boundaries that are W apart when min <= W and (max 0 or >= W)
        window, min_len, max_len = config.segment_window, config.min_segment_len, config.max_segment_len
        if min_len <= window and (max_len == 0 or max_len >= window):
            return fixed_window_ids(mask, window)
        return None


@register_segment_rule
class LogprobRule(SegmentRule):
    """A new segment where the old policy's log-prob drops by more than ``logprob_threshold``
    (``logprob_per_sample``: in units of the sample's own drop mean and standard deviation)."""

    name = "logprob"
    needs = frozenset({OLD_LOG_PROB})
    native_code = 1

    def candidates(self, config, packed, inputs):
        boundaries, scores = logprob_candidates(
            inputs.get(OLD_LOG_PROB), packed, config.logprob_threshold, config.logprob_per_sample
        )
        return Candidates(boundaries, scores)


@register_segment_rule
class TokenvalRule(SegmentRule):
    """A new segment where neighbouring codec codes differ by more than ``tokenval_threshold``;
    tokens outside the codec range are segments of their own."""

    name = "tokenval"
    needs = frozenset({RESPONSE_IDS})
    reads_codec = True
    native_code = 2

    def candidates(self, config, packed, inputs):
        dist, outside = tokenval_scores(
            inputs.get(RESPONSE_IDS),
            packed,
            codec_offset=config.codec_offset,
            codec_size=config.codec_size,
            distance=config.tokenval_distance,
            fsq_levels=config.fsq_levels,
        )
        scores = dist.float()
        return Candidates(packed.valid & (scores > config.tokenval_threshold), scores, outside)


@register_segment_rule
class WordsRule(SegmentRule):
    """One segment per recognised word: a new segment wherever the word id (``maspo_verl.batch``:
    the index of the ASR word a token belongs to, -1 between words) differs from the previous valid
    token's. Gaps between words (silence, breaths, tokens outside the codec) are segments of their
    own; a word start outranks a gap start, so with ``min_segment_len`` a gap shorter than that joins
    the word before it. A row with no word among its valid tokens (no word times: ASR returned
    none, non-speech, decode failure, ids absent) takes ``words_fallback_rule`` instead, counted in
    ``actor/ratio/words_fallback_frac``. The fallback's candidates are computed for the whole batch
    and selected per row (no host sync)."""

    name = "words"
    needs = frozenset({WORD_IDS})
    fallback_field = "words_fallback_rule"
    fallback_metric = WORDS_FALLBACK_METRIC
    native_code = 3

    def candidates(self, config, packed, inputs):
        # the fallback first, so that its temporaries are freed before ours exist (peak memory)
        fallback = SEGMENT_RULES[config.words_fallback_rule].candidates(config, packed, inputs)
        words = packed.pack(inputs.get(WORD_IDS).to(torch.int32), NO_WORD)
        starts = packed.has_previous & (words != previous(words))
        is_word = words != NO_WORD
        del words
        has_words = (packed.valid & is_word).any(-1, keepdim=True)
        # per row: the words' candidates (score 2 on a word start, 1 on a gap start) or the fallback's,
        # selected by 0/1 products (exact, faster than selects)
        use = float_mask(has_words)
        scores = float_mask(is_word).add_(1.0).mul_(use).add_(fallback.scores.float().mul_(1.0 - use))
        del is_word
        boundaries = (starts & has_words) | (fallback.boundaries & ~has_words)
        forced = None if fallback.forced is None else fallback.forced & ~has_words
        rows = packed.lengths > 0
        fell_back = (rows & ~has_words).sum().to(torch.float64) / rows.sum().clamp(min=1).to(torch.float64)
        return Candidates(boundaries, scores, forced, {**fallback.metrics, WORDS_FALLBACK_METRIC: fell_back})


# segment_rule=delimiters: a boundary's strength for min_segment_len (a step marker outranks a delimiter)
DELIMITER_SCORE, MARKER_SCORE = 1.0, 2.0
# (id(tokenizer), delimiters, step_markers) -> (tokenizer, vocab.TextTables, {device: tensors})
_TEXT_TABLES: dict[tuple, tuple[Any, vocab.TextTables, dict]] = {}


def _text_entry(tokenizer: Any, delimiters: Sequence[str], step_markers: Sequence[str]) -> tuple:
    key = (id(tokenizer), tuple(delimiters), tuple(step_markers))
    if key not in _TEXT_TABLES:
        tables = vocab.resolve(vocab.vocabulary_texts(tokenizer), delimiters, step_markers)
        _TEXT_TABLES[key] = (tokenizer, tables, {})  # the tokenizer is kept so that its id stays unique
    return _TEXT_TABLES[key]


def text_tables(tokenizer: Any, delimiters: Sequence[str], step_markers: Sequence[str]) -> vocab.TextTables:
    """``vocab.resolve`` of the strings over ``tokenizer``'s vocabulary (an HF tokenizer, or the text of
    each id), once per process."""
    return _text_entry(tokenizer, delimiters, step_markers)[1]


def _device_tables(tokenizer, config, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The tables of ``config``'s strings as int64 tensors on ``device`` (moved once), and the split masks."""
    _, tables, on_device = _text_entry(tokenizer, config.delimiters, config.step_markers)
    if device not in on_device:
        on_device[device] = tuple(
            torch.tensor(t, dtype=torch.int64, device=device) for t in (tables.inside, tables.ends, tables.starts)
        )
    return (*on_device[device], tables.delimiter_splits, tables.marker_splits)


def text_boundaries(token_ids: torch.Tensor, packed: Packed, tables) -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries, scores) of the delimiters rule on the packed rows: a boundary on the token after
    one where a delimiter occurs, and on a token where a step marker occurs (``maspo_verl.vocab``: inside
    the token, or across it and the next valid token). Ids outside the tables match nothing."""
    inside, ends, starts, delimiter_splits, marker_splits = tables
    size = inside.shape[0]
    ids = packed.pack(token_ids.long())
    known = (ids >= 0).logical_and_(ids < size).logical_and_(packed.valid).long()
    ids.clamp_(0, size - 1)
    own = inside[ids].mul_(known)
    head = ends[ids].mul_(known)
    tail = torch.zeros_like(head)  # the next valid token's ``starts`` (none after the row's last)
    tail[:, :-1] = starts[ids[:, 1:]].mul_(known[:, 1:])
    across = head.bitwise_and_(tail)
    delimiter = ((own & vocab.DELIMITER) != 0).logical_or_((across & delimiter_splits) != 0)
    marker = ((own & vocab.STEP_MARKER) != 0).logical_or_((across & marker_splits) != 0)
    boundaries = previous(delimiter).logical_or_(marker).logical_and_(packed.valid)
    scores = float_mask(marker).mul_(MARKER_SCORE - DELIMITER_SCORE).add_(DELIMITER_SCORE)
    return boundaries, scores


def surprisal_candidates(
    old_log_prob: torch.Tensor, packed: Packed, quantile: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries, scores) of the surprisal rule on the packed rows: the k = floor(q L + 1/2) tokens of
    largest surprisal -log pi_old (float32; ties to the earlier token) of each row of L valid tokens
    start segments. The score is the surprisal."""
    B, T = packed.valid.shape
    lp = packed.pack(old_log_prob).float().nan_to_num_(nan=0.0, neginf=-MAX_DROP, posinf=MAX_DROP)
    surprisal = lp.neg_().clamp_(-MAX_DROP, MAX_DROP).mul_(float_mask(packed.valid))
    ranked = surprisal.masked_fill(~packed.valid, -math.inf)  # padding ranks last
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=order.device).expand(B, T))
    count = packed.lengths.double().mul_(quantile).add_(0.5).floor_().long()
    return (rank < count).logical_and_(packed.valid), surprisal


@register_segment_rule
class DelimitersRule(SegmentRule):
    """Text steps and sentences: a segment ends after a token where one of ``delimiters`` occurs, and a
    new one starts at a token where one of ``step_markers`` occurs (``maspo_verl.vocab``). The strings
    are resolved against the actor's tokenizer once per process; start-up resolves them on the driver
    too, logs what each matched and refuses a string that occurs nowhere."""

    name = "delimiters"
    needs = frozenset({RESPONSE_IDS, TOKENIZER})

    def candidates(self, config, packed, inputs):
        tables = _device_tables(inputs.get(TOKENIZER), config, packed.valid.device)
        return Candidates(*text_boundaries(inputs.get(RESPONSE_IDS), packed, tables))

    def startup(self, trainer_config):
        """Resolve the strings against the tokenizer verl's actor will load, log what each matched and
        refuse one that occurs nowhere (``FieldError``). Not in a dry run, which opens no model."""
        from verl.utils.config import omega_conf_to_dataclass

        policy_loss = omega_conf_to_dataclass(trainer_config.actor_rollout_ref.actor.policy_loss)  # validates
        model = trainer_config.actor_rollout_ref.model
        path = model.get("tokenizer_path") or model.get("path")
        if (trainer_config.get("maspo", {}) or {}).get("dry_run"):
            print(f"maspo_verl: segment_rule=delimiters resolves its strings against {path}'s tokenizer at launch")
            return []
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(model.get("trust_remote_code")))
        except Exception as exc:  # noqa: BLE001 - the workers load it their way (remote paths) and resolve there
            message = (
                f"segment_rule=delimiters: the tokenizer at {path} did not load on the driver ({type(exc).__name__}: "
                f"{exc}); the actor workers resolve policy_loss.delimiters / step_markers against theirs"
            )
            warn_once(message)
            return [message]
        tables = text_tables(tokenizer, policy_loss.delimiters, policy_loss.step_markers)
        print(f"maspo_verl: segment_rule=delimiters on {path}'s tokenizer ({len(tables.inside)} ids):")
        print(tables.summary())
        return []


@register_segment_rule
class SurprisalRule(SegmentRule):
    """Forking tokens: the ``surprisal_quantile`` share of each response's tokens with the largest
    surprisal -log pi_old start segments (0: one segment, GSPO; 1: every token, GRPO)."""

    name = "surprisal"
    needs = frozenset({OLD_LOG_PROB})

    def candidates(self, config, packed, inputs):
        return Candidates(*surprisal_candidates(inputs.get(OLD_LOG_PROB), packed, config.surprisal_quantile))


def setting(config: Any, name: str, default: Any = None) -> Any:
    """A policy-loss setting of a config object or a (Dict)Config mapping."""
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def _rule(config: Any) -> SegmentRule:
    rule = SEGMENT_RULES.get(setting(config, "segment_rule"))
    if rule is None:
        allowed = ", ".join(SEGMENT_RULES)
        raise ValueError(f"segment_rule={setting(config, 'segment_rule')!r} is invalid: allowed {allowed}")
    return rule


def rules_in_use(config: Any) -> tuple[SegmentRule, ...]:
    """The rules a segmentation with ``config`` runs: ``segment_rule`` and its fallback, if it has one."""
    rule = _rule(config)
    if rule.fallback_field is None:
        return (rule,)
    name = setting(config, rule.fallback_field)
    fallback = SEGMENT_RULES.get(name)
    if fallback is None or fallback.fallback_field is not None:
        raise ValueError(f"{rule.fallback_field}={name!r} is invalid: allowed {', '.join(fallback_rules())}")
    return (rule, fallback)


def inputs_needed(config: Any) -> frozenset[str]:
    """Everything the rules in use read (``SegmentRule.needs``)."""
    return frozenset().union(*(rule.needs for rule in rules_in_use(config)))


def packed_boundaries(packed: Packed, config: Any, inputs: RuleInputs, metrics: dict | None = None) -> torch.Tensor:
    """Boundaries (packed) of ``config.segment_rule``, then ``min_segment_len`` / ``max_segment_len``;
    the rule's metrics go into ``metrics`` when given. Boundaries past a row's length are left as they
    fall (never unpacked)."""
    found = _rule(config).candidates(config, packed, inputs)
    if metrics is not None:
        metrics.update(found.metrics)
    forced = found.forced
    b = found.boundaries if forced is None else found.boundaries | forced
    b[:, :1] = packed.valid[:, :1]  # the first valid token starts a segment
    if config.min_segment_len > 1:
        # forced boundaries outrank every other (+inf) and stay even next to each other
        scores = found.scores.float()
        scores[:, :1].masked_fill_(b[:, :1], math.inf)
        b = suppress_close(b, scores, config.min_segment_len, forced)
        if forced is not None:
            b |= forced
    return split_long(b, packed, config.max_segment_len)


def compute_boundaries(
    mask: torch.Tensor, config: Any, *, old_log_prob=None, token_ids=None, metrics=None
) -> torch.Tensor:
    """``packed_boundaries`` in token order (``token_ids``: the response ids, else the micro-batch's)."""
    packed = Packed(mask)
    inputs = RuleInputs(mask, old_log_prob, token_ids)
    return packed.unpack(packed_boundaries(packed, config, inputs, metrics), False)


def compute_segments(
    mask: torch.Tensor,
    config: Any,
    *,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    metrics: dict[str, torch.Tensor] | None = None,
    sizes_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Segment ids (token order; 0 on padding) of ``packed_boundaries`` (``token_ids``: the response ids,
    else the micro-batch's), and each segment's number of valid tokens at its id ([B, T] in
    ``sizes_dtype``) when the C library computed them along (None otherwise). By the C library for CPU
    tensors (``maspo_verl.native``; ``segment_kernel``), else by the rule's closed formula where it has
    one, else by the torch ops above."""
    inputs = RuleInputs(mask, old_log_prob, token_ids)
    if _native_wanted(config, mask):
        spec = native.config_for(config, rules_in_use(config), STD_FLOOR, MAX_DROP)
        if spec is not None:
            return native.compute_segments(mask, spec, rules_in_use(config), inputs, metrics, sizes_dtype)
    direct = _rule(config).direct_ids(config, mask)
    if direct is not None:
        return direct, None
    packed = Packed(mask)
    ids = torch.cumsum(packed_boundaries(packed, config, inputs, metrics), dim=-1, dtype=torch.int32).sub_(1)
    ids = packed.unpack(ids)
    del packed  # its int64 index before the int64 ids exist (peak memory)
    return ids.long(), None


def compute_segment_ids(mask: torch.Tensor, config: Any, **inputs) -> torch.Tensor:
    """The segment ids of ``compute_segments`` (``inputs``: its keyword arguments)."""
    return compute_segments(mask, config, **inputs)[0]


def _native_wanted(config: Any, mask: torch.Tensor) -> bool:
    """The C path is wanted: ``segment_kernel=auto``, CPU tensors, eager mode, and the library builds
    (warned once when it does not)."""
    if getattr(config, "segment_kernel", "auto") != "auto" or mask.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():  # traced as torch ops
        return False
    reason = native.unavailable()
    if reason is not None:
        warn_once(f"segmentation runs on torch ops: the C path is unavailable ({reason})")
    return reason is None
