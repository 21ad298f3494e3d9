"""The fields of ``maspo_verl.config.GranularLossConfig`` as annotations, for type checkers and IDEs (the dataclass
itself is built at import time from the declared settings, which static tools cannot see). Generated between the
markers by ``python -m maspo_verl generate``; ``--check`` and ``tests/test_reference.py`` fail when it is out of
date. Imported only under ``TYPE_CHECKING``."""

from __future__ import annotations


class GranularLossFields:
    """One annotation per declared setting (``maspo_verl.config.SETTINGS``), in declaration order."""

    # generated (python -m maspo_verl generate): one annotation per declared setting
    segment_rule: str
    min_segment_len: int
    max_segment_len: int
    adaptive_min_len: int
    adaptive_max_len: int
    adaptive_criterion: str
    delimiters: list[str]
    step_markers: list[str]
    segment_window: int
    logprob_threshold: float
    logprob_per_sample: bool
    surprisal_quantile: float
    tokenval_threshold: float
    tokenval_distance: str
    codec_offset: int
    codec_size: int
    fsq_levels: list[int]
    turn_window: int
    words_fallback_rule: str
    length_exponent: float
    clip_schedule: str
    log_clip_low: float
    log_clip_high: float
    log_clip_dual: float
    clip_exponent: float
    agg_mode: str
    position_buckets: int
    compile: bool
    inspect_dir: str | None
    inspect_every: int
    ctpo_mode: str
    surrogate: str
    # end of generated fields
