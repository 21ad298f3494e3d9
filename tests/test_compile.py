"""``policy_loss.compile=true`` on CPU: the compiled loss equals the eager one (loss, gradient and every
metric), across micro-batch lengths, and once compiled with the one host transfer of the eager loss.

Inductor compiles C++ kernels here (a C compiler is needed), ~15-30 s per preset and dtype; the CUDA
counterpart is ``tests/core/test_cuda.py``. Outside ``tests/core`` so that CI runs it once.
"""

from __future__ import annotations

import pytest
import torch

from maspo_verl.core.surrogates import DEFAULT, SURROGATES
from maspo_verl.lab.studies import bench

# segments with min/max length; prefixes; each other surrogate on fixed segments (CI compiles the first and
# sapo's, whose temperatures are params; the rest are slow tests)
CASES = [("maspo_logprob", torch.float64, DEFAULT), ("ctpo", torch.float32, DEFAULT)]
CASES += [("maspo_fixed", torch.float64, s) for s in SURROGATES if s != DEFAULT]
CASES = [
    pytest.param(*c, id=f"{c[0]}-{c[2]}", marks=() if c[0] == "maspo_logprob" or c[2] == "sapo" else pytest.mark.slow)
    for c in CASES
]


def _run(entry, inputs):
    loss, lp, metrics = bench.loss_grad_metrics(bench.loss_fn(entry), bench.entry_config(entry), inputs)
    return loss, lp.grad, metrics


@pytest.mark.parametrize(("preset", "dtype", "surrogate"), CASES)
def test_compiled_equals_eager(preset, dtype, surrogate):
    entry = bench.preset_entries([preset])[0]
    if surrogate != DEFAULT:
        entry = bench.with_surrogate(entry, surrogate)
    compiled = bench.compiled(entry)
    assert bench.entry_config(compiled).policy_loss.compile is True
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    for T in (96, 160):  # a second length reuses the dynamic-shape kernels
        inputs = bench.make_inputs(6, T, dtype, "cpu", seed=T)
        loss, grad, metrics = _run(entry, inputs)
        _run(compiled, inputs)  # compiles on first use (tracing reads some values on the host)
        with bench.count_host_syncs() as syncs:
            loss_c, grad_c, metrics_c = _run(compiled, inputs)
        assert syncs["by"] == {"tolist": 1}, syncs
        torch.testing.assert_close(loss_c, loss, **tol)
        torch.testing.assert_close(grad_c, grad, **tol)
        assert list(metrics_c) == list(metrics)
        for key, value in metrics.items():
            assert metrics_c[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
