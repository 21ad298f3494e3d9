"""The engine-mismatch metrics and the conformance check (maspo_verl.plugin.engine_mismatch), against numpy on
the same deltas, and the check's verdicts on mismatches of known size."""

import math

import numpy as np
import pytest
import torch

from maspo_verl.plugin import engine_mismatch as em
from maspo_verl.plugin.engine_mismatch import LOGGED, PREFIX, EngineCheck
from maspo_verl.validation import FieldError


def _batch(seed, rows=6, cols=20, sigma=0.05):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    delta = sigma * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    lengths = torch.randint(3, cols + 1, (rows,), generator=g)
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    return old + delta, old, mask


def _collect(batches, minibatches=2):
    """What one actor update reports: the first mini-batch's micro-batches ``batches``, then others."""
    with em.update():
        for k in range(minibatches):
            with em.minibatch():
                for log_prob, old, mask in batches if k == 0 else [_batch(99, sigma=5.0)]:
                    if em.collecting():
                        em.observe(log_prob, old, mask)
        return em._state.metrics


def test_metrics_equal_numpy_over_micro_batches_and_only_the_first_mini_batch_counts():
    batches = [_batch(1), _batch(2), _batch(3)]
    metrics = _collect(batches)
    deltas = np.concatenate([(lp - old)[mask].numpy() for lp, old, mask in batches])
    assert metrics[f"{PREFIX}tokens"] == deltas.size
    assert metrics[f"{PREFIX}mean"] == pytest.approx(deltas.mean(), abs=1e-12)
    assert metrics[f"{PREFIX}sd"] == pytest.approx(deltas.std(ddof=1), rel=1e-10)
    assert metrics[f"{PREFIX}rms"] == pytest.approx(math.sqrt((deltas**2).mean()), rel=1e-10)
    assert metrics[f"{PREFIX}max_abs"] == pytest.approx(np.abs(deltas).max(), rel=1e-12)
    assert metrics[f"{PREFIX}nonfinite"] == 0
    # lag-1 of the row-centred deltas, pooled as the loss's ratio-correlation metric defines it
    num = den = 0.0
    pairs = 0
    for lp, old, mask in batches:
        for row, keep in zip(lp - old, mask, strict=True):
            x = row[keep].numpy()
            x = x - x.mean()
            num, den, pairs = num + float((x[1:] * x[:-1]).sum()), den + float((x * x).sum()), pairs + len(x) - 1
    assert metrics[f"{PREFIX}corr_lag1"] == pytest.approx((num / pairs) / (den / deltas.size), rel=1e-9)
    assert f"{PREFIX}vif5" in metrics


def test_non_finite_engine_log_probs_are_counted_not_averaged():
    log_prob, old, mask = _batch(4)
    old[0, 1] = float("nan")
    old[1, 0] = float("-inf")
    metrics = _collect([(log_prob, old, mask)])
    assert metrics[f"{PREFIX}nonfinite"] == 2
    assert math.isfinite(metrics[f"{PREFIX}rms"])


def test_attach_puts_the_metrics_in_the_update_output_once():
    from verl.utils import tensordict_utils as tu

    em._state.metrics = {f"{PREFIX}rms": 0.5}
    out = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {"actor/pg_loss": [1.0]}}).cpu()
    em.attach(out)
    em.attach(out)  # nothing twice
    assert tu.get(out, "metrics") == {"actor/pg_loss": [1.0], f"{PREFIX}rms": [0.5]}


@pytest.mark.parametrize(
    "sigma, nan, fires",
    [
        (0.05, False, False),  # a bf16 engine against an fp32 trainer measures ~0.05
        (1e-5, False, False),  # an fp32 engine
        (0.5, False, True),  # planted: noise on the engine's log-probs
        (1e-5, True, True),  # planted: a non-finite engine log-prob
    ],
)
def test_conformance_check_verdicts(sigma, nan, fires):
    log_prob, old, mask = _batch(5, rows=16, cols=40, sigma=sigma)
    if nan:
        old[2, 3] = float("nan")
    metrics = _collect([(log_prob, old, mask)])
    problem = EngineCheck().problem(metrics)
    assert (problem is not None) == fires
    if fires:
        assert (
            "not finite" in problem
            if nan
            else f"rms {metrics[f'{PREFIX}rms']:.4g} > maspo.engine_check.max_rms=0.2" in problem
        )


def test_on_step_warns_stops_or_drops(capsys):
    bad = {f"{LOGGED}rms": 0.7, f"{LOGGED}tokens": 40.0, f"{LOGGED}nonfinite": 0.0, "actor/pg_loss": 1.0}
    data = dict(bad)
    em.on_step(data, 1, bypass=True, check=EngineCheck(mode="warn"))
    assert "maspo_verl engine check (step 1)" in capsys.readouterr().out and data == bad
    with pytest.raises(RuntimeError, match="engine check \\(step 10\\).*rms 0.7 > maspo.engine_check.max_rms=0.2"):
        em.on_step(dict(bad), 10, bypass=True, check=EngineCheck(mode="stop", every=5))
    em.on_step(dict(bad), 7, bypass=True, check=EngineCheck(mode="stop", every=5))  # not due
    em.on_step(dict(bad), 1, bypass=True, check=EngineCheck(mode="off"))
    data = dict(bad)
    em.on_step(data, 1, bypass=False, check=EngineCheck(mode="stop"))  # the old log-probs are the trainer's
    assert data == {"actor/pg_loss": 1.0}


@pytest.mark.parametrize(
    "section, field",
    [({"mode": "loud"}, "maspo.engine_check.mode"), ({"every": 0}, "maspo.engine_check.every"),
     ({"max_rms": -1}, "maspo.engine_check.max_rms"), ({"treshold": 1}, "maspo.engine_check")],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_field(section, field):
    with pytest.raises((FieldError, ValueError), match=field):
        EngineCheck.from_config({"maspo": {"engine_check": section}})
