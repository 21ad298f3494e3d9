"""Tuning on tuning seeds: each arm's setting chosen from the runs of the seeds below the held-out ones."""

from __future__ import annotations

import math

import numpy as np

from maspo_verl.lab.engine.common import as_float as _f
from maspo_verl.lab.engine.presets import BASELINE


def best(means: dict[str, float]) -> str:
    """The setting (a width or learning rate, as text) with the best mean; ties: the smaller setting."""
    return max(means, key=lambda s: (means[s], -float(s)))


def nearest_kl(kls: dict[str, float], target: float) -> str:
    """The setting whose KL per update is nearest ``target`` in log (positive finite KLs only); "" where none is."""
    finite = {s: kl for s, kl in kls.items() if kl > 0 and math.isfinite(kl)}
    if not finite or not target > 0:
        return ""
    return min(finite, key=lambda s: abs(math.log(finite[s] / target)))


def choose(runs: list[dict], tune: int, baseline: str = BASELINE, metric: str = "final_reward") -> list[dict]:
    """Per (task, cell, loss): the width with the best mean ``metric`` (final reward) on the tuning seeds (those
    below ``tune``; ties: the narrower), and the width whose mean KL per update is nearest ``baseline``'s at its
    chosen width (log scale)."""
    per_band: dict[tuple, dict] = {}
    for r in runs:
        if int(r["seed"]) < tune:
            s = per_band.setdefault((r["task"], r["cell"], r["loss"], r["band"]), {"final": [], "kl": []})
            s["final"].append(_f(r[metric]))
            s["kl"].append(_f(r["ppo_kl"]))
    groups: dict[tuple, list] = {}
    for (task, cell, loss, band), s in per_band.items():
        groups.setdefault((task, cell, loss), []).append((band, float(np.mean(s["final"])), float(np.nanmean(s["kl"]))))
    out = []
    for (task, cell, loss), options in sorted(groups.items()):
        band = best({o[0]: o[1] for o in options})
        final, kl = next(o[1:] for o in options if o[0] == band)
        out.append({"task": task, "cell": cell, "loss": loss, "best_band": band, "tune_final": final, "tune_kl": kl})
    base = {(c["task"], c["cell"]): c for c in out if c["loss"] == baseline}
    for c in out:
        target = base.get((c["task"], c["cell"]))
        kls = {o[0]: o[2] for o in groups[(c["task"], c["cell"], c["loss"])]}
        c["kl_band"] = nearest_kl(kls, target["tune_kl"]) if target else ""
        c["kl_band_kl"] = kls[c["kl_band"]] if c["kl_band"] else float("nan")
    return out
