"""See and calibrate MASPO's segmentation: ``python -m maspo_verl.lab segments --from PATH --out DIR``.

Reads responses from

- inspect files written during training (``policy_loss.inspect_dir``, ``maspo_verl.inspection``): a
  folder of ``step_*.json`` or one such file; the policy-loss settings of the run come with them;
- plain code sequences, before any training: JSONL (one utterance a line) or parquet with ``codes``
  (codec code ids 0..codec_size-1) and optionally ``word_ids`` (one per code, -1 outside words, as the
  speech reward produces them) or ``word_times`` ([[start_s, end_s], ...], turned into word ids by the
  speech reward's own ``word_token_ids`` at ``--frame-rate`` codes/s), and ``old_log_probs``.

Every segmentation is computed by ``maspo_verl.core.segments.compute_segment_ids`` with a
``GranularLossConfig`` (the run's settings, or the defaults, then ``--preset`` and ``--set``), exactly
as the loss computes it; each rule's threshold is swept over a grid. Writes to ``--out``:

- ``distances.png``: adjacent-code distances under each ``tokenval_distance`` (and, for comparison,
  distances between random pairs of codes of the same utterance) with the current threshold;
- ``logprob.png``: old-log-prob drops and per-sample z-scores with ``logprob_threshold``;
- ``segment_lengths.png``: segment-length distribution per rule over its threshold grid;
- ``boundary_f1.png`` (with word ids): boundary precision / recall / F1 against the word boundaries
  (within +-k tokens, one-to-one matching) per threshold, and F1 against mean segment length next to
  fixed windows;
- ``strips.png``: a few responses with each rule's boundaries and the word boundaries;
- ``README.md``: a table per rule and the suggested overrides (the threshold whose mean segment length
  is closest to ``--target-len``; with words, the threshold of best word F1) as ready Hydra overrides;
- ``suggestions.json``: the same, machine-readable; ``grid.csv``: every grid point.

A rule whose boundaries find the words no better than fixed windows of the same mean length (F1 gain
below ``MIN_F1_GAIN``) - or, without words, codes whose neighbours are no closer than random pairs
(``locality`` below ``MIN_LOCALITY``) - is reported as not usable, with that reason, and gets no
suggested threshold. The console shows a headline and the report's path; the report is in ``--out``
(default ``outputs/lab/segments``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from maspo_verl import fsq, inspection
from maspo_verl.batch import NO_WORD, WORD_IDS_KEY, micro_batch_scope
from maspo_verl.core import segments
from maspo_verl.core.losses import token_log_ratios
from maspo_verl.core.segments.rules import logprob, tokenval
from maspo_verl.core.token_sets import inputs_needed
from maspo_verl.lab.engine import common, journal
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    "segments", "see and calibrate the segmentation (inspect files or code sequences): plots, word F1, thresholds"
)
OUT = STUDY.folder
PREFIX = "actor_rollout_ref.actor.policy_loss."
# a rule is usable when its best word F1 beats fixed windows of the same mean length by this much
MIN_F1_GAIN = 0.1
# without words: 1 - mean adjacent distance / mean distance of random pairs of the same utterance
MIN_LOCALITY = 0.2
# fields that decide a segmentation (the overrides printed with each suggestion)
SEGMENTATION_FIELDS = ("segment_rule", "min_segment_len", "max_segment_len")


# ------------------------------------------------------------------ reading
@dataclass
class Corpus:
    """Responses as [N, T] tensors (right-padded), and the policy-loss settings they come with."""

    token_ids: torch.Tensor
    mask: torch.Tensor
    old_log_prob: torch.Tensor | None
    word_ids: torch.Tensor | None
    settings: dict
    source: str
    dumped_segment_ids: list[list[int] | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # the token log-ratios log pi - log pi_old as the loss computed them (inspect files only; ``adaptive`` reads them)
    log_ratio: torch.Tensor | None = None

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(-1).numpy()


def _pad(rows: list[list], fill, dtype) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _files(path: str) -> tuple[list[str], list[str]]:
    """(inspect files, code files) named by ``path`` (a file or a folder)."""
    if os.path.isdir(path):
        dumps = sorted(glob.glob(os.path.join(path, "step_*.json")))
        codes = sorted(glob.glob(os.path.join(path, "*.jsonl")) + glob.glob(os.path.join(path, "*.parquet")))
        if not dumps and not codes:
            raise SystemExit(f"segments: {path} holds no step_*.json, *.jsonl or *.parquet file")
        return dumps, codes
    if not os.path.isfile(path):
        raise SystemExit(f"segments: --from {path} does not exist")
    return ([path], []) if path.endswith(".json") else ([], [path])


def read_dumps(files: list[str]) -> Corpus:
    """The responses of inspect files (``maspo_verl.inspection``), with the run's policy-loss settings."""
    ids, masks, olds, news, words, dumped = [], [], [], [], [], []
    settings, notes, has_words = None, [], False
    for path in files:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("format") != inspection.FORMAT:
            raise SystemExit(f"segments: {path} is not an inspect file (format {doc.get('format')!r})")
        settings = settings or dict(doc["policy_loss"])
        # the segment ids of the configured rule (other loss modes write their own token sets)
        segmented = doc.get("loss_mode") == "maspo"
        for r in doc["responses"]:
            n = len(r["mask"])
            ids.append(r.get("response_ids") or [0] * n)
            masks.append(r["mask"])
            olds.append([-math.inf if x is None else x for x in r["old_log_probs"]])
            news.append([-math.inf if x is None else x for x in r.get("log_probs") or [0.0] * n])
            has_words = has_words or "word_ids" in r
            words.append(r.get("word_ids") or [NO_WORD] * n)
            dumped.append(r.get("segment_ids") if segmented else None)
    if not masks:
        raise SystemExit("segments: the inspect files hold no response")
    mask, old = _pad(masks, 0, torch.long).bool(), _pad(olds, 0.0, torch.float32)
    return Corpus(
        token_ids=_pad(ids, 0, torch.long),
        mask=mask,
        old_log_prob=old,
        word_ids=_pad(words, NO_WORD, torch.long) if has_words else None,
        settings=settings,
        source=f"{len(files)} inspect file(s) of loss_mode={settings.get('loss_mode')!r}",
        dumped_segment_ids=dumped,
        notes=notes,
        log_ratio=token_log_ratios(_pad(news, 0.0, torch.float32), old, mask)[0],
    )


def _rows(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_codes(files: list[str], settings: dict, frame_rate: float) -> Corpus:
    """Utterances of codec codes (``codes``; optional ``word_ids`` / ``word_times``, ``old_log_probs``)."""
    from maspo_verl.speech.asr import TimedWord
    from maspo_verl.speech.spans import word_token_ids

    codes, words, olds = [], [], []
    has_words = has_old = False
    size, offset = settings["codec_size"], settings["codec_offset"]
    for path in files:
        for k, row in enumerate(_rows(path)):
            where = f"{path} line {k + 1}"
            c = row.get("codes")
            if not isinstance(c, list) or not all(isinstance(x, int) for x in c):
                raise SystemExit(f"segments: {where}: 'codes' must be a list of integers")
            if c and not (0 <= min(c) and max(c) < size):
                raise SystemExit(
                    f"segments: {where}: codes must lie in 0..{size - 1} (policy_loss.codec_size={size}; "
                    "set --set codec_size=... fsq_levels=[...] for another codec)"
                )
            w = row.get("word_ids")
            if w is None and row.get("word_times") is not None:
                w = word_token_ids(
                    [TimedWord("", float(a), float(b)) for a, b in row["word_times"]], len(c), frame_rate
                )
            if w is not None and len(w) != len(c):
                raise SystemExit(f"segments: {where}: {len(w)} word ids for {len(c)} codes")
            lp = row.get("old_log_probs")
            if lp is not None and len(lp) != len(c):
                raise SystemExit(f"segments: {where}: {len(lp)} old log-probs for {len(c)} codes")
            has_words |= w is not None
            has_old |= lp is not None
            codes.append([x + offset for x in c])
            words.append(w if w is not None else [NO_WORD] * len(c))
            olds.append(lp if lp is not None else [0.0] * len(c))
    if not codes:
        raise SystemExit("segments: the code files hold no utterance")
    mask = _pad([[1] * len(c) for c in codes], 0, torch.long).bool()
    return Corpus(
        token_ids=_pad(codes, 0, torch.long),
        mask=mask,
        old_log_prob=_pad(olds, 0.0, torch.float32) if has_old else None,
        word_ids=_pad(words, NO_WORD, torch.long) if has_words else None,
        settings=settings,
        source=f"{len(codes)} code sequence(s) from {', '.join(os.path.basename(p) for p in files)}",
        dumped_segment_ids=[None] * len(codes),
    )


# ------------------------------------------------------------------ settings
def base_settings(preset: str | None) -> dict:
    """The policy-loss fields: dataclass defaults, or a loss preset's as the trainer composes them."""
    from maspo_verl.config import GranularLossConfig

    if preset:
        from maspo_verl.lab.engine.presets import discover_presets

        (p,) = discover_presets([preset])
        return {**p.policy_loss, "loss_mode": "maspo"}
    fields = dataclasses.fields(GranularLossConfig)
    out = {}
    for f in fields:
        if not f.init or f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return {**out, "loss_mode": "maspo"}


def parse_sets(items: list[str]) -> dict:
    """``--set key=value`` (YAML values: 3, 2.5, true, [4, 4, 4])."""
    import yaml

    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"segments: --set {item!r}: expected key=value (a policy_loss field)")
        out[key.strip().removeprefix(PREFIX)] = yaml.safe_load(value)
    return out


def loss_config(settings: dict, **changes):
    """A ``GranularLossConfig`` of ``settings`` with ``changes`` (validated as the trainer does)."""
    from maspo_verl.config import GranularLossConfig
    from maspo_verl.validation import reject_unknown

    names = [f.name for f in dataclasses.fields(GranularLossConfig) if f.init]
    values = {k: v for k, v in {**settings, **changes}.items() if k != "_target_"}
    reject_unknown("policy_loss (--set)", values, names, SystemExit, "fields")
    values.update(loss_mode="maspo", inspect_dir=None, compile=False)
    return GranularLossConfig(**values)


# ------------------------------------------------------------------ rules and grids
@dataclass
class Variant:
    """One rule (and distance / mode) whose threshold ``field`` is swept over ``grid``."""

    label: str
    fixed: dict
    field: str
    grid: list


def _in_codec(corpus: Corpus, settings: dict) -> torch.Tensor:
    ids, off = corpus.token_ids, settings["codec_offset"]
    return corpus.mask & (ids >= off) & (ids < off + settings["codec_size"])


def neighbour_distances(corpus: Corpus, settings: dict, distance: str) -> tuple[np.ndarray, np.ndarray]:
    """Distances between neighbouring codes (both in the codec), by the tokenval rule's own code, and
    between random pairs of codes of the same utterance (a fixed shuffle)."""
    cfg = loss_config(settings, tokenval_distance=distance)
    packed = segments.Packed(corpus.mask)
    dist, outside = tokenval.tokenval_scores(
        corpus.token_ids,
        packed,
        codec_offset=cfg.codec_offset,
        codec_size=cfg.codec_size,
        distance=distance,
        fsq_levels=cfg.fsq_levels,
    )
    both = packed.has_previous & ~outside
    adjacent = dist[both].double().numpy()
    # random pairs: each in-codec code against another of the same row, by a seeded permutation
    g = torch.Generator().manual_seed(0)
    inside = _in_codec(corpus, settings)
    codes = corpus.token_ids - settings["codec_offset"]
    keys = torch.rand(codes.shape, generator=g).masked_fill_(~inside, 2.0)
    order = keys.argsort(-1)
    shuffled = codes.gather(-1, order)
    valid = inside.gather(-1, order)
    first, second = shuffled[:, :-1], shuffled[:, 1:]
    pair_ok = valid[:, :-1] & valid[:, 1:]
    if distance == "id":
        far = (first - second).abs()
    else:
        far = fsq.digits_distance(first, second, cfg.fsq_levels, distance)
    return adjacent, far[pair_ok].double().numpy()


def logprob_drop_scores(corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """Old-log-prob drops and their per-sample z-scores, by the logprob rule's own code."""
    packed = segments.Packed(corpus.mask)
    drop, w = logprob.logprob_drops(corpus.old_log_prob, packed)
    n = w.sum(-1, keepdim=True, dtype=torch.float64).clamp(min=1.0)
    mu = drop.sum(-1, keepdim=True, dtype=torch.float64) / n
    sigma = ((drop.double() - mu) * w).square().sum(-1, keepdim=True).div(n).sqrt().clamp(min=logprob.STD_FLOOR)
    z = (drop.double() - mu) / sigma
    on = w.bool()
    return drop[on].double().numpy(), z[on].numpy()


# the rule every other is compared against
BASELINE = "fixed"


def variants(corpus: Corpus, settings: dict, rules: list[str]) -> tuple[list[Variant], list[str]]:
    """The sweeps every rule declares for this corpus (``SegmentRule.sweeps``), those of ``rules`` (rule names,
    or ``rule/distance``) when given, and notes on those left out."""
    out, notes = [], []

    def want(name: str) -> bool:  # a rule asked for, or a distance / mode of one, or a rule of one asked;
        # fixed windows always: every rule is compared against them
        asked = any(r == name or name.startswith(r + "/") or r.startswith(name + "/") for r in rules)
        return not rules or asked or name == BASELINE

    packed = segments.Packed(corpus.mask)
    for name, rule in segments.SEGMENT_RULES.items():
        if not want(name):
            continue
        config = loss_config(settings, segment_rule=name)
        inputs = segments.RuleInputs(corpus.mask, name, corpus.old_log_prob, corpus.token_ids, corpus.log_ratio)
        try:
            declared = rule.sweeps(config, packed, inputs)
        except (ValueError, RuntimeError) as exc:  # an input the corpus does not have
            notes.append(f"{name} left out: {exc}")
            continue
        for sweep in declared:
            if isinstance(sweep, str):
                notes.append(sweep)
            elif want(sweep.label):
                out.append(Variant(sweep.label, dict(sweep.fixed), sweep.knob, list(sweep.grid)))
    return out, notes


# ------------------------------------------------------------------ measuring
def segment_ids(corpus: Corpus, settings: dict, **changes) -> torch.Tensor:
    """The segment ids the loss computes with ``settings`` and ``changes`` (word ids in scope as the
    plugin puts verl's micro-batch there)."""
    cfg = loss_config(settings, **changes)
    batch = {"responses": corpus.token_ids}
    if corpus.word_ids is not None:
        batch[WORD_IDS_KEY] = corpus.word_ids
    with micro_batch_scope(batch):
        return segments.compute_segment_ids(
            corpus.mask, cfg, old_log_prob=corpus.old_log_prob, token_ids=corpus.token_ids, log_ratio=corpus.log_ratio
        )


def boundary_lists(seg_ids: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """Per row, the valid-token positions (counted among valid tokens) where a segment starts, the
    first valid token left out (every rule starts a segment there)."""
    out = []
    for ids, m in zip(seg_ids.numpy(), mask.numpy(), strict=True):
        v = ids[m]
        out.append(np.flatnonzero(v[1:] != v[:-1]) + 1)
    return out


def word_boundaries(corpus: Corpus) -> list[np.ndarray] | None:
    """Per row, where the word id changes between neighbouring valid tokens (a word or a gap starts)."""
    return None if corpus.word_ids is None else boundary_lists(corpus.word_ids, corpus.mask)


def matches(pred: np.ndarray, ref: np.ndarray, k: int) -> int:
    """Largest one-to-one matching of predicted to reference boundaries within +-k positions (greedy in
    order, optimal for points on a line)."""
    i = j = m = 0
    while i < len(pred) and j < len(ref):
        if pred[i] < ref[j] - k:
            i += 1
        elif ref[j] < pred[i] - k:
            j += 1
        else:
            m += 1
            i += 1
            j += 1
    return m


def prf(pred: list[np.ndarray], ref: list[np.ndarray], k: int) -> tuple[float, float, float]:
    """Boundary precision, recall and F1 pooled over rows."""
    hit = sum(matches(p, r, k) for p, r in zip(pred, ref, strict=True))
    n_pred, n_ref = sum(len(p) for p in pred), sum(len(r) for r in ref)
    precision = hit / n_pred if n_pred else 0.0
    recall = hit / n_ref if n_ref else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def length_stats(seg_ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Mean segment length (tokens / segments, as ``actor/ratio/segment_len_mean``), segments per
    response and percentiles of the segment lengths."""
    lengths = []
    for ids, m in zip(seg_ids.numpy(), mask.numpy(), strict=True):
        v = ids[m]
        if len(v):
            lengths.append(np.bincount(v - v.min())[np.unique(v - v.min())])
    sizes = np.concatenate(lengths) if lengths else np.zeros(0)
    rows = max(len(lengths), 1)
    p10, p50, p90 = np.percentile(sizes, [10, 50, 90]) if len(sizes) else (0.0, 0.0, 0.0)
    return {
        "mean_len": float(sizes.sum() / max(len(sizes), 1)),
        "segments_per_response": len(sizes) / rows,
        "p10_len": float(p10),
        "median_len": float(p50),
        "p90_len": float(p90),
    }


def sweep(corpus: Corpus, settings: dict, variant: Variant, refs, tolerances: list[int]) -> list[dict]:
    rows = []
    for value in variant.grid:
        # integer settings (a window, adaptive's longest length) stay integers
        value = int(value) if variant.field == "segment_window" or isinstance(value, int | np.integer) else float(value)
        ids = segment_ids(corpus, settings, **variant.fixed, **{variant.field: value})
        row = {"rule": variant.label, "field": variant.field, "threshold": value, **length_stats(ids, corpus.mask)}
        if refs is not None:
            pred = boundary_lists(ids, corpus.mask)
            for k in tolerances:
                p, r, f = prf(pred, refs, k)
                row.update({f"precision_k{k}": p, f"recall_k{k}": r, f"f1_k{k}": f})
        rows.append(row)
    return rows


def locality(corpus: Corpus, settings: dict, distance: str) -> float:
    """1 - mean adjacent distance / mean distance between random pairs of the same utterance (0: codes
    in random order; near 1: neighbours nearly equal)."""
    adjacent, far = neighbour_distances(corpus, settings, distance)
    if not len(adjacent) or not len(far) or far.mean() == 0:
        return 0.0
    return float(1.0 - adjacent.mean() / far.mean())


# ------------------------------------------------------------------ suggesting
def overrides(settings: dict, variant: Variant, value) -> list[str]:
    """Ready Hydra overrides that give ``variant`` at ``value`` with the settings analysed."""
    fields = {**{k: settings[k] for k in SEGMENTATION_FIELDS}, **variant.fixed, variant.field: value}
    return [f"{PREFIX}{k}={_yaml(v)}" for k, v in fields.items()]


def _yaml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(round(v, 4))
    return str(v)


def closest(rows: list[dict], target: float) -> dict:
    return min(rows, key=lambda r: (abs(r["mean_len"] - target), r["threshold"]))


def suggest(corpus, settings, variant, rows, fixed_rows, args, has_words) -> dict:
    """Per rule: whether it is usable and the suggested thresholds (None where it is not usable)."""
    k = args.tolerance
    by_len = closest(rows, args.target_len)
    out: dict = {"field": variant.field, "fixed": variant.fixed}
    evidence = []
    usable = True
    if variant.label.startswith("tokenval/"):
        out["locality"] = loc = locality(corpus, settings, variant.fixed["tokenval_distance"])
        if not has_words:
            usable = loc >= MIN_LOCALITY
            evidence.append(f"locality {loc:.2f} ({'>=' if usable else '<'} {MIN_LOCALITY})")
    if has_words and variant.label != "fixed":
        best = max(rows, key=lambda r: (r[f"f1_k{k}"], -abs(r["mean_len"] - args.target_len)))
        twin = closest(fixed_rows, best["mean_len"])
        gain = best[f"f1_k{k}"] - twin[f"f1_k{k}"]
        usable = gain >= MIN_F1_GAIN
        out.update(
            best_f1=best[f"f1_k{k}"],
            best_threshold=best["threshold"],
            best_mean_len=best["mean_len"],
            fixed_window_same_len=twin["threshold"],
            fixed_f1_same_len=twin[f"f1_k{k}"],
            f1_gain=gain,
        )
        evidence.append(
            f"best F1 {best[f'f1_k{k}']:.3f} at mean length {best['mean_len']:.1f} vs {twin[f'f1_k{k}']:.3f} for fixed "
            f"windows W={twin['threshold']} (gain {gain:+.3f}, {'>=' if usable else '<'} {MIN_F1_GAIN})"
        )
    elif variant.label.startswith("logprob") and not has_words:
        usable = None  # nothing to check a log-prob drop against without words
        evidence.append("no word ids: a log-prob drop is only a proxy for a boundary, unchecked here")
    out["usable"] = usable
    out["evidence"] = "; ".join(evidence)
    # what the strip plot shows, usable or not: the best-F1 threshold, else the target-length one
    out["shown_threshold"] = out.get("best_threshold", by_len["threshold"])
    if usable is False:
        out["by_target_len"] = out["by_word_f1"] = None
        return out
    out["by_target_len"] = {
        "threshold": by_len["threshold"],
        "mean_len": by_len["mean_len"],
        "overrides": overrides(settings, variant, by_len["threshold"]),
    }
    out["by_word_f1"] = None
    if has_words:
        best = max(rows, key=lambda r: (r[f"f1_k{k}"], -abs(r["mean_len"] - args.target_len)))
        out["by_word_f1"] = {
            "threshold": best["threshold"],
            "mean_len": best["mean_len"],
            f"f1_k{k}": best[f"f1_k{k}"],
            "overrides": overrides(settings, variant, best["threshold"]),
        }
    return out


# ------------------------------------------------------------------ plots
def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _mark_thresholds(ax, current: float | None, label: str, suggestion: dict) -> None:
    """The current threshold (red) and the suggested ones (green) on a histogram; a log y axis and a legend."""
    if current is not None:
        ax.axvline(current, color="r", label=f"{label} {current:g}")
    for key, style in (("by_target_len", ":"), ("by_word_f1", "--")):
        if suggestion.get(key):
            threshold = suggestion[key]["threshold"]
            ax.axvline(threshold, color="g", ls=style, label=f"suggested ({key}) {threshold:g}")
    ax.set_yscale("log")
    _legend(ax)


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plot_distances(out: Path, corpus: Corpus, settings: dict, labels: list[str], suggestions: dict) -> str | None:
    distances = [lab.split("/")[1] for lab in labels if lab.startswith("tokenval/")]
    if not distances:
        return None
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(distances), figsize=(5 * len(distances), 3.6), squeeze=False)
    for ax, distance in zip(axes[0], distances, strict=True):
        adjacent, far = neighbour_distances(corpus, settings, distance)
        top = max(float(np.percentile(np.concatenate([adjacent, far]), 99.5)), 1.0)
        bins = np.arange(0, top + 2) - 0.5 if distance != "id" else np.linspace(0, top, 60)
        ax.hist(adjacent, bins=bins, density=True, alpha=0.6, label="neighbouring codes")
        ax.hist(far, bins=bins, density=True, histtype="step", color="k", label="random pairs, same utterance")
        current = settings["tokenval_threshold"] if settings["tokenval_distance"] == distance else None
        _mark_thresholds(ax, current, "current threshold", suggestions.get(f"tokenval/{distance}", {}))
        ax.set(title=f"tokenval_distance={distance}", xlabel="distance to the previous code", ylabel="density")
    return _save(plt, fig, out, "distances.png")


def plot_logprob(out: Path, corpus: Corpus, settings: dict, suggestions: dict) -> str | None:
    if corpus.old_log_prob is None:
        return None
    plt = common.pyplot()
    drops, z = logprob_drop_scores(corpus)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, values, label, key in (
        (axes[0], drops, "drop lp[t-1] - lp[t] (nats)", "logprob/absolute"),
        (axes[1], z, "per-sample z-score of the drop", "logprob/per_sample"),
    ):
        lo, hi = np.percentile(values, [0.5, 99.5]) if len(values) else (0, 1)
        ax.hist(np.clip(values, lo, hi), bins=60, alpha=0.7)
        per_sample = key.endswith("per_sample")
        current = settings["logprob_threshold"] if settings["logprob_per_sample"] == per_sample else None
        _mark_thresholds(ax, current, "current logprob_threshold", suggestions.get(key, {}))
        ax.set(title=f"logprob_per_sample={'true' if per_sample else 'false'}", xlabel=label, ylabel="tokens")
    return _save(plt, fig, out, "logprob.png")


def plot_lengths(out: Path, table: dict[str, list[dict]], target: float) -> str:
    plt = common.pyplot()
    labels = list(table)
    fig, axes = plt.subplots(1, len(labels), figsize=(4 * len(labels), 3.4), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        rows = table[label]
        x = [r["threshold"] for r in rows]
        ax.fill_between(x, [r["p10_len"] for r in rows], [r["p90_len"] for r in rows], alpha=0.25, label="10-90%")
        ax.plot(x, [r["median_len"] for r in rows], label="median")
        ax.plot(x, [r["mean_len"] for r in rows], "--", label="mean")
        ax.axhline(target, color="r", lw=0.8, label=f"target {target:g}")
        ax.set(title=label, xlabel=rows[0]["field"], ylabel="segment length (tokens)")
        ax.set_yscale("log")
        _legend(ax)
    return _save(plt, fig, out, "segment_lengths.png")


def plot_f1(out: Path, table: dict[str, list[dict]], tolerances: list[int], k: int) -> str:
    plt = common.pyplot()
    labels = [lab for lab in table if lab != "fixed"]
    fig, axes = plt.subplots(1, len(labels) + 1, figsize=(4 * (len(labels) + 1), 3.4), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=False):
        rows = table[label]
        x = [r["threshold"] for r in rows]
        ax.plot(x, [r[f"precision_k{k}"] for r in rows], label=f"precision k={k}")
        ax.plot(x, [r[f"recall_k{k}"] for r in rows], label=f"recall k={k}")
        for kk in tolerances:
            ax.plot(
                x, [r[f"f1_k{kk}"] for r in rows], "-" if kk == k else ":", lw=2 if kk == k else 1, label=f"F1 k={kk}"
            )
        ax.set(title=label, xlabel=rows[0]["field"], ylim=(0, 1.02))
        _legend(ax)
    ax = axes[0][-1]
    for label, rows in table.items():
        ax.plot(
            [r["mean_len"] for r in rows],
            [r[f"f1_k{k}"] for r in rows],
            "k--" if label == "fixed" else "-",
            label=label,
        )
    ax.set(title=f"word-boundary F1 (k={k}) vs mean length", xlabel="mean segment length (tokens)", ylim=(0, 1.02))
    ax.set_xscale("log")
    _legend(ax)
    return _save(plt, fig, out, "boundary_f1.png")


def plot_strips(out: Path, corpus: Corpus, settings: dict, shown: dict[str, dict], count: int = 4) -> str:
    """A few responses: word spans and each rule's boundaries (at its suggested threshold)."""
    plt = common.pyplot()
    n = min(count, corpus.mask.shape[0])
    lanes = list(shown) + (["as trained"] if any(s is not None for s in corpus.dumped_segment_ids[:n]) else [])
    fig, axes = plt.subplots(n, 1, figsize=(12, n * (0.3 * len(lanes) + 0.7)), squeeze=False)
    ids = {lane: segment_ids(corpus, settings, **spec) for lane, spec in shown.items()}
    for i, ax in enumerate(axes[:, 0]):
        m = corpus.mask[i].numpy()
        length = int(m.sum())
        if corpus.word_ids is not None:
            w = corpus.word_ids[i].numpy()[m]
            for word in np.unique(w[w != NO_WORD]):
                where = np.flatnonzero(w == word)
                ax.axvspan(where[0] - 0.5, where[-1] + 0.5, color="C0" if word % 2 else "C1", alpha=0.15)
        for lane_no, lane in enumerate(lanes):
            y = len(lanes) - lane_no
            if lane == "as trained":
                seg = np.asarray(corpus.dumped_segment_ids[i] or [0] * len(m))
            else:
                seg = ids[lane][i].numpy()
            v = seg[m]
            starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
            ax.vlines(starts - 0.5, y - 0.4, y + 0.4, color=f"C{2 + lane_no}")
        ax.set_yticks(range(len(lanes), 0, -1), lanes, fontsize=7)
        ax.set_xlim(-1, length)
        ax.set_ylim(0.4, len(lanes) + 0.6)
        ax.set_title(f"response {i} ({length} tokens; shaded: words)", fontsize=8)
    axes[-1, 0].set_xlabel("token (valid tokens)")
    return _save(plt, fig, out, "strips.png")


# ------------------------------------------------------------------ report
def analyse(args: argparse.Namespace) -> dict:
    """Everything the command writes, as data (``run`` writes it)."""
    dumps, code_files = _files(args.source)
    if dumps and code_files:
        raise SystemExit(f"segments: {args.source} holds both inspect files and code files: name one")
    sets = parse_sets(args.set or [])
    if dumps:
        corpus = read_dumps(dumps)
        settings = {**corpus.settings, **sets}
        corpus.settings = settings
    else:
        settings = {**base_settings(args.preset), **sets}
        corpus = read_codes(code_files, settings, args.frame_rate)
    loss_config(settings)  # bad settings fail here, naming the field
    rules = [r.strip() for r in (args.rule or "").split(",") if r.strip()]
    found, notes = variants(corpus, settings, rules)
    refs = word_boundaries(corpus)
    has_words = refs is not None and any(len(r) for r in refs)
    tolerances = list(range(args.tolerance + 1))
    table = {v.label: sweep(corpus, settings, v, refs if has_words else None, tolerances) for v in found}
    suggestions = {
        v.label: suggest(corpus, settings, v, table[v.label], table[BASELINE], args, has_words) for v in found
    }
    consistency = None
    needs_tokenizer = segments.TOKENIZER in inputs_needed(loss_config(settings))
    if needs_tokenizer and any(s is not None for s in corpus.dumped_segment_ids):
        notes.append(
            f"segment_rule={settings['segment_rule']!r} needs the actor's tokenizer: the run's segment ids are "
            "shown as written, not recomputed"
        )
    elif any(s is not None for s in corpus.dumped_segment_ids):
        ids = segment_ids(corpus, settings).numpy()
        same = [
            list(np.asarray(d)[m]) == list(row[m])
            for d, row, m in zip(corpus.dumped_segment_ids, ids, corpus.mask.numpy(), strict=True)
            if d is not None
        ]
        consistency = (sum(same), len(same))
    return {
        "corpus": corpus,
        "settings": settings,
        "variants": found,
        "table": table,
        "suggestions": suggestions,
        "notes": corpus.notes + notes,
        "has_words": has_words,
        "tolerances": tolerances,
        "consistency": consistency,
    }


SUMMARY_KEYS = ("threshold", "mean_len", "segments_per_response", "p10_len", "median_len", "p90_len")


def why_not_usable(has_words: bool) -> str:
    """Why a rule is not usable: with word ids its F1 gain decides, without them its locality."""
    if has_words:
        return f"no word-boundary F1 gain over fixed windows of the same mean length (< {MIN_F1_GAIN})"
    return f"no usable locality (< {MIN_LOCALITY})"


def headline(result: dict, report: Path) -> str:
    """What the console shows: the corpus, each rule's verdict, and where the report is."""
    lengths = result["corpus"].lengths
    verdicts: dict[str, list[str]] = {}
    for label, s in result["suggestions"].items():
        if label != "fixed":
            verdicts.setdefault({True: "usable", False: "not usable", None: "unchecked"}[s["usable"]], []).append(label)
    said = "; ".join(f"{verdict}: {', '.join(labels)}" for verdict, labels in verdicts.items())
    return (
        f"segments: {len(lengths)} responses, {int(lengths.sum())} tokens, word ids "
        f"{'yes' if result['has_words'] else 'no'}; {said}\n"
        f"report: {report} (tables, figures and the suggested overrides)"
    )


def write_report(out: Path, result: dict, args: argparse.Namespace, figures: list[str], seconds: float) -> None:
    corpus, settings, k = result["corpus"], result["settings"], args.tolerance
    lengths = corpus.lengths
    lines = [
        "# Segmentation calibration",
        "",
        f"Made by the command in `COMMAND.txt` ({seconds:.0f} s) from {corpus.source}: {len(lengths)} responses, "
        f"{int(lengths.sum())} tokens (mean {lengths.mean():.1f} per response); word ids: "
        f"{'yes' if result['has_words'] else 'no'}; "
        f"old log-probs: {'yes' if corpus.old_log_prob is not None else 'no'}. "
        "Segments computed by `maspo_verl.core.segments` with the settings below and each rule's threshold swept; "
        f"mean length = tokens / segments (as `actor/ratio/segment_len_mean`). Boundaries are compared with the "
        f"word boundaries (where the word id changes: a word or a gap starts) within +-k tokens, one-to-one; "
        f"the first token of a response is left out. All grid points: `grid.csv`.",
        "",
        "Settings: "
        + ", ".join(
            f"`{f}={_yaml(settings[f])}`" for f in ("codec_offset", "codec_size", "min_segment_len", "max_segment_len")
        )
        + f", `fsq_levels={settings['fsq_levels']}`.",
        "",
    ]
    if result["consistency"] is not None:
        same, total = result["consistency"]
        lines += [
            f"Segment ids recomputed from the inspect files equal the ones the loss wrote: {same} / {total} responses.",
            "",
        ]
    lines += [f"- {note}" for note in result["notes"]] + ([""] if result["notes"] else [])
    lines += ["## Does the rule find boundaries?", ""]
    summary = []
    for label, s in result["suggestions"].items():
        if label == "fixed":
            continue
        row = {"rule": label, "usable": {True: "yes", False: "NO", None: "unchecked"}[s["usable"]]}
        if "locality" in s:
            row["locality"] = s["locality"]
        if result["has_words"]:
            row.update(
                {
                    f"best F1 (k={k})": s["best_f1"],
                    "at threshold": s["best_threshold"],
                    "mean len": s["best_mean_len"],
                    "fixed W same len": s["fixed_window_same_len"],
                    f"fixed F1 (k={k})": s["fixed_f1_same_len"],
                }
            )
        summary.append(row)
    if summary:
        keys = list(dict.fromkeys(key for row in summary for key in row))
        lines += [common.markdown_table(summary, keys), ""]
    if result["has_words"]:
        lines += [
            "Best word-boundary F1 of each rule at each tolerance, next to fixed windows of the same mean length:",
            "",
            common.markdown_table(best_f1_rows(result), None),
            "",
        ]
    lines += [
        f"A rule is usable when its best F1 beats fixed windows of the same mean length by >= {MIN_F1_GAIN} "
        f"(with word ids), or when neighbouring codes are closer than random pairs (locality >= {MIN_LOCALITY}; "
        "without word ids). A rule that is not usable gets no suggested threshold: its segments would be as "
        "arbitrary as fixed windows.",
        "",
        "## Suggested overrides",
        "",
    ]
    for label, s in result["suggestions"].items():
        if label == "fixed":
            continue
        lines.append(f"**{label}** ({s['evidence'] or 'no check'}):")
        lines.append("")
        if s["usable"] is False:
            window = closest(result["table"]["fixed"], args.target_len)["threshold"]
            lines += [
                f"{why_not_usable(result['has_words'])}: no threshold suggested; fixed windows of the target "
                "length instead:",
                "",
                "```",
                f"{PREFIX}segment_rule=fixed {PREFIX}segment_window={window}",
                "```",
                "",
            ]
            continue
        for key, what in (
            ("by_target_len", f"mean segment length closest to {args.target_len:g} tokens"),
            ("by_word_f1", f"best word-boundary F1 (k={k})"),
        ):
            pick = s.get(key)
            if pick:
                lines += [
                    f"- {what}: threshold {pick['threshold']:g}, mean length {pick['mean_len']:.1f}",
                    "",
                    "```",
                    " ".join(pick["overrides"]),
                    "```",
                    "",
                ]
    lines += ["## Per rule", ""]
    f1_keys = [f"precision_k{k}", f"recall_k{k}", f"f1_k{k}"] if result["has_words"] else []
    for label, rows in result["table"].items():
        shown = rows if label != "fixed" else [r for r in rows if r["threshold"] in FIXED_SHOWN]
        lines += [
            f"### {label} (`{rows[0]['field']}`)",
            "",
            common.markdown_table(shown, [*SUMMARY_KEYS, *f1_keys]),
            "",
        ]
    lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures]
    (out / "README.md").write_text("\n".join(lines) + "\n")


FIXED_SHOWN = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 75, 100)


def best_f1_rows(result: dict) -> list[dict]:
    """Per rule and tolerance k: the best F1 over the grid, its threshold and mean length, and the F1
    of fixed windows of the nearest mean length."""
    table, rows = result["table"], []
    for label, grid in table.items():
        if label == "fixed":
            continue
        for k in result["tolerances"]:
            best = max(grid, key=lambda r: r[f"f1_k{k}"])
            twin = closest(table[BASELINE], best["mean_len"])
            rows.append(
                {
                    "rule": label,
                    "k": k,
                    "best F1": best[f"f1_k{k}"],
                    "threshold": best["threshold"],
                    "mean len": best["mean_len"],
                    "fixed W": twin["threshold"],
                    "fixed F1": twin[f"f1_k{k}"],
                }
            )
    return rows


def suggestions_json(result: dict, args: argparse.Namespace) -> dict:
    return {
        "source": result["corpus"].source,
        "target_len": args.target_len,
        "tolerance": args.tolerance,
        "has_word_ids": result["has_words"],
        "rules": {
            label: {
                key: s.get(key)
                for key in (
                    "usable",
                    "evidence",
                    "locality",
                    "best_f1",
                    "fixed_f1_same_len",
                    "f1_gain",
                    "by_target_len",
                    "by_word_f1",
                )
                if key in s
            }
            for label, s in result["suggestions"].items()
            if label != "fixed"
        },
        "fixed_by_target_len": {
            "overrides": [
                f"{PREFIX}segment_rule=fixed",
                f"{PREFIX}segment_window={closest(result['table']['fixed'], args.target_len)['threshold']}",
            ]
        },
    }


def run(args: argparse.Namespace, argv: list[str]) -> None:
    t0 = time.time()
    torch.set_num_threads(args.threads)
    out = journal.start(args.out or common.default_out(OUT), argv)
    made_by = Path(args.source + ".COMMAND.txt")  # the command that wrote the input, if it says
    if made_by.is_file():
        journal.note(out, f"input made by: {made_by.read_text().strip()}")
    result = analyse(args)
    corpus, settings = result["corpus"], result["settings"]
    common.write_csv(out / "grid.csv", [r for rows in result["table"].values() for r in rows])
    labels = list(result["table"])
    figures = [
        plot_distances(out, corpus, settings, labels, result["suggestions"]),
        plot_logprob(out, corpus, settings, result["suggestions"]),
        plot_lengths(out, result["table"], args.target_len),
    ]
    if result["has_words"]:
        figures.append(plot_f1(out, result["table"], result["tolerances"], args.tolerance))
    shown = {}
    for v in result["variants"]:
        s = result["suggestions"][v.label]
        if v.label != "fixed":
            unusable = " (not usable)" if s["usable"] is False else ""
            shown[f"{v.label}={s['shown_threshold']:g}{unusable}"] = {**v.fixed, v.field: s["shown_threshold"]}
    window = closest(result["table"]["fixed"], args.target_len)["threshold"]
    shown[f"fixed W={window}"] = {"segment_rule": "fixed", "segment_window": window}
    figures.append(plot_strips(out, corpus, settings, shown))
    figures = [f for f in figures if f]
    (out / "suggestions.json").write_text(json.dumps(suggestions_json(result, args), indent=2) + "\n")
    write_report(out, result, args, figures, time.time() - t0)
    print(headline(result, out / "README.md"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", required=True, help="inspect folder/file, or JSONL/parquet of codes")
    p.add_argument(
        "--rule",
        default="",
        help="comma-separated rules to sweep (tokenval, tokenval/fsq_l1, logprob, ...; default all that apply)",
    )
    p.add_argument(
        "--target-len", type=float, default=15.0, help="wanted mean segment length in tokens (15 ~ 300 ms at 50 Hz)"
    )
    p.add_argument(
        "--tolerance", type=int, default=2, help="k: a boundary within +-k tokens of a word boundary matches it"
    )
    p.add_argument(
        "--preset", default=None, help="code files: start from this loss preset's settings (e.g. maspo_tokenval)"
    )
    p.add_argument(
        "--set", action="append", metavar="FIELD=VALUE", help="a policy_loss field for the analysis (repeatable)"
    )
    p.add_argument("--frame-rate", type=float, default=50.0, help="codes per second (word_times -> word ids)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
