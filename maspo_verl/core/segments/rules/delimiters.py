"""delimiters: text steps and sentences, from strings found in the actor tokenizer's vocabulary."""

from __future__ import annotations

import torch

from maspo_verl import vocab
from maspo_verl.core.segments.rule import (
    RESPONSE_IDS,
    TOKENIZER,
    Candidates,
    Example,
    Packed,
    SegmentRule,
    previous,
)
from maspo_verl.core.segments.text_tables import device_tables, driver_tokenizer, text_tables
from maspo_verl.core.tensors import float_mask
from maspo_verl.util import warn_once
from maspo_verl.validation import Setting, Strings, fail

# paragraph and line breaks, sentence ends
DEFAULT_DELIMITERS = ("\n\n", "\n", ". ", "? ", "! ")
# a boundary's strength for min_segment_len (a step marker outranks a delimiter)
DELIMITER_SCORE, MARKER_SCORE = 1.0, 2.0


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


class DelimitersRule(SegmentRule):
    """Text steps and sentences: a segment ends after a token where one of `delimiters` occurs, and a new one starts at
    a token where one of `step_markers` occurs.

    A string occurs inside a token or across it and the next valid token (``maspo_verl.vocab``). The strings are
    resolved against the actor's tokenizer once per process; start-up resolves them on the driver too, logs what
    each matched and refuses a string that occurs nowhere.
    """

    name = "delimiters"
    needs = frozenset({RESPONSE_IDS, TOKENIZER})
    settings = (
        Setting(
            "delimiters",
            list(DEFAULT_DELIMITERS),
            Strings(),
            "strings after which a segment ends (`delimiters`; default: paragraph/line breaks, sentence ends)",
        ),
        Setting("step_markers", [], Strings(), "strings at which a new segment starts (`delimiters`, e.g. Step)"),
    )
    # ids of a toy vocabulary: 0 "a", 1 "\n", 2 "Step", 3 " b", 4 "."
    examples = (
        Example(
            "a segment ends after the line break and a new one starts at the step marker",
            ((1,) * 7,),
            ((3, 1, 3),),
            {"delimiters": ["\n"], "step_markers": ["Step"]},
            {RESPONSE_IDS: ((0, 0, 1, 0, 2, 3, 3),), TOKENIZER: ("a", "\n", "Step", " b", ".")},
        ),
        Example(
            "'. ' across two tokens ends the segment after the first",
            ((1,) * 4,),
            ((2, 2),),
            {"delimiters": [". "]},
            {RESPONSE_IDS: ((0, 4, 3, 0),), TOKENIZER: ("a", "\n", "Step", " b", ".")},
        ),
        Example(
            "at the edges: a delimiter on the first token ends a one-token segment; one on the last starts nothing",
            ((1,) * 4,),
            ((1, 3),),
            {"delimiters": ["\n"]},
            {RESPONSE_IDS: ((1, 0, 0, 1),), TOKENIZER: ("a", "\n", "Step", " b", ".")},
        ),
    )

    def candidates(self, config, packed, inputs):
        tables = device_tables(inputs.get(TOKENIZER), config.delimiters, config.step_markers, packed.valid.device)
        return Candidates(*text_boundaries(inputs.get(RESPONSE_IDS), packed, tables))

    def reference(self, config, row):
        texts = [row.texts[i] if 0 <= i < len(row.texts) else None for i in row.response_ids]  # None: unknown id

        def occurs(strings, p):  # inside token p, or across it and the next valid token
            here = texts[p]
            after = texts[p + 1] if p + 1 < len(texts) else None
            if here is None:
                return False
            if any(s in here for s in strings):
                return True
            return after is not None and any(
                here.endswith(s[:k]) and after.startswith(s[k:]) for s in strings for k in range(1, len(s))
            )

        out = []
        for p in range(len(texts)):
            marker = occurs(config.step_markers, p)
            after_delimiter = p > 0 and occurs(config.delimiters, p - 1)
            out.append(MARKER_SCORE if marker else DELIMITER_SCORE if after_delimiter else None)
        return out

    def validate(self, config):
        if config.segment_rule == self.name and not (config.delimiters or config.step_markers):
            fail("delimiters", config.delimiters, "at least one string in delimiters or step_markers")
        if vocab.split_count(config.delimiters + config.step_markers) > vocab.MAX_SPLITS:
            fail(
                "step_markers",
                config.step_markers,
                f"strings with at most {vocab.MAX_SPLITS} characters after the first in all, delimiters included",
            )

    def startup(self, trainer_config):
        """Resolve the strings against the tokenizer verl's actor will load, log what each matched and
        refuse one that occurs nowhere (``FieldError``). Not in a dry run, which opens no model."""
        from verl.utils.config import omega_conf_to_dataclass

        policy_loss = omega_conf_to_dataclass(trainer_config.actor_rollout_ref.actor.policy_loss)  # validates
        model = trainer_config.actor_rollout_ref.model
        if (trainer_config.get("maspo", {}) or {}).get("dry_run"):
            path = model.get("tokenizer_path") or model.get("path")
            print(f"maspo_verl: segment_rule=delimiters resolves its strings against {path}'s tokenizer at launch")
            return []
        try:
            tokenizer, path = driver_tokenizer(trainer_config)
        except Exception as exc:  # noqa: BLE001 - the workers load it their way (remote paths) and resolve there
            path = model.get("tokenizer_path") or model.get("path")
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
