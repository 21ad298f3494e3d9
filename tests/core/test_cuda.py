"""Every loss preset on a CUDA GPU (skipped without one): the same numbers as on CPU, and at most one
device-to-host sync per call (the batched metrics transfer), as CUDA's own sync detector counts them.

The CPU suite cannot see syncs hidden inside operators (a boolean-mask index, ``nonzero``); CUDA's
``set_sync_debug_mode`` warns on each of them.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.lab.studies import bench

pytestmark = pytest.mark.gpu

ENTRIES = bench.preset_entries()
B, T = 8, 512


def _loss_and_grad(entry, inputs):
    loss, lp, metrics = bench.loss_grad_metrics(bench.loss_fn(entry), bench.entry_config(entry), inputs)
    return loss.double().cpu(), lp.grad.double().cpu(), metrics


def _inputs(dtype, device, seed=3):
    return bench.make_inputs(B, T, dtype, device, seed=seed)


def _to(inputs, device, dtype=None):
    return [x.to(device, dtype) if dtype is not None and x.is_floating_point() else x.to(device) for x in inputs]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.label for e in ENTRIES])
def test_cuda_equals_cpu(entry):
    # float64: the same arithmetic on both devices up to reduction order
    loss_cpu, grad_cpu, _ = _loss_and_grad(entry, _inputs(torch.float64, "cpu"))
    loss_gpu, grad_gpu, _ = _loss_and_grad(entry, _inputs(torch.float64, "cuda"))
    torch.testing.assert_close(loss_gpu, loss_cpu, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_gpu, grad_cpu, rtol=1e-10, atol=1e-12)
    if entry.loss_mode not in TOKEN_SETS:
        return  # verl's own losses (the references) compute in the input dtype: no float32 sums to check in bf16
    # bfloat16 inputs on the GPU against float64 on CPU of the same (bf16-rounded) values: what is
    # left is the loss's own arithmetic (sums in float32) and the bf16 gradient's rounding
    bf = _inputs(torch.bfloat16, "cuda")
    loss_bf, grad_bf, _ = _loss_and_grad(entry, bf)
    loss_ref, grad_ref, _ = _loss_and_grad(entry, _to(bf, "cpu", torch.float64))
    assert torch.isfinite(loss_bf) and torch.isfinite(grad_bf).all()
    torch.testing.assert_close(loss_bf, loss_ref, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(grad_bf, grad_ref, rtol=1e-2, atol=1e-3 * grad_ref.abs().max().item())


OURS = [e for e in ENTRIES if e.loss_mode in TOKEN_SETS]


@pytest.mark.parametrize("entry", OURS, ids=[e.label for e in OURS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_compiled_equals_eager(entry, dtype):
    """policy_loss.compile=true: the same loss, gradient and metrics as the eager loss."""
    inputs = _inputs(dtype, "cuda", seed=5)
    loss, grad, metrics = _loss_and_grad(entry, inputs)
    for _ in range(2):  # the first call compiles; the second runs the compiled kernels
        loss_c, grad_c, metrics_c = _loss_and_grad(bench.compiled(entry), inputs)
    tol = (
        dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6 * grad.abs().max().item())
    )
    torch.testing.assert_close(loss_c, loss, **tol)
    torch.testing.assert_close(grad_c, grad, **tol)
    assert metrics_c.keys() == metrics.keys()
    for key in metrics:
        assert metrics_c[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("entry", OURS + [bench.compiled(e) for e in OURS], ids=lambda e: e.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_at_most_one_host_sync(entry, dtype):
    fn, cfg = bench.loss_fn(entry), bench.entry_config(entry)
    inputs = _inputs(dtype, "cuda", seed=4)
    bench.call(fn, cfg, inputs)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            bench.call(fn, cfg, inputs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) <= 1, syncs
