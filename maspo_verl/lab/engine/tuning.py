"""Tuning on tuning seeds: each arm's setting chosen from the runs of the seeds below the held-out ones."""

from __future__ import annotations

import math

import numpy as np

from maspo_verl.lab.engine.common import as_float as _f
from maspo_verl.lab.engine.presets import BASELINE


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
        best = max(options, key=lambda o: (o[1], -float(o[0])))
        out.append(
            {"task": task, "cell": cell, "loss": loss, "best_band": best[0], "tune_final": best[1], "tune_kl": best[2]}
        )
    base = {(c["task"], c["cell"]): c for c in out if c["loss"] == baseline}
    for c in out:
        target = base.get((c["task"], c["cell"]))
        options = groups[(c["task"], c["cell"], c["loss"])]
        finite = [o for o in options if o[2] > 0 and math.isfinite(o[2])]
        if target is None or not finite or not target["tune_kl"] > 0:
            c["kl_band"], c["kl_band_kl"] = "", float("nan")
            continue
        near = min(finite, key=lambda o: abs(math.log(o[2] / target["tune_kl"])))
        c["kl_band"], c["kl_band_kl"] = near[0], near[2]
    return out
