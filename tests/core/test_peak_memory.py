"""Peak memory of one loss call (forward and backward) beyond its inputs, as ``bench.peak_memory`` measures it on CPU:
the allocator events torch.profiler records, so the same on every run whatever the machine's load (no timing).

In [B, T] float32 units against verl's vanilla loss on the same inputs: every preset and surrogate row within the
bench's target (``extra_BT_vs_vanilla`` <= 4) in float32; in bfloat16 the loss computes in float32 as in float32, so
its peak is its float32 peak (verl's vanilla computes in bfloat16: half its float32 peak, no fixed bound against it).
"""

from __future__ import annotations

import pytest
import torch

from maspo_verl.lab.studies import bench

B, T = 16, 512
UNIT = B * T * 4  # one [B, T] float32 tensor, in bytes
TARGET = 4.0  # [B, T] float32 above verl's vanilla: the bench's target (its README)
ENTRIES = bench.preset_entries()
OURS = [e for e in ENTRIES if e.label != bench.BASELINE] + bench.surrogate_entries(ENTRIES)


def peak(entry, dtype) -> float:
    """The entry's peak in [B, T] float32 units, after one warm-up call (caches a rule builds once, such as
    vocabulary tables, are not per call)."""
    inputs = bench.make_inputs(B, T, dtype, "cpu", seed=0)
    fn, cfg = bench.loss_fn(entry), bench.entry_config(entry)
    bench.call(fn, cfg, inputs)
    return bench.peak_memory(fn, cfg, inputs, "cpu")[0] / UNIT


@pytest.fixture(scope="module")
def vanilla() -> float:
    (baseline,) = [e for e in ENTRIES if e.label == bench.BASELINE]
    return peak(baseline, torch.float32)


def test_measures_allocations(vanilla):
    # verl's vanilla holds several [B, T] tensors at once (ratio, clipped losses, their masks): a measurement that
    # saw no allocation would pass every bound below
    assert vanilla >= 4.0


@pytest.mark.parametrize("entry", OURS, ids=lambda e: e.label)
def test_peak_within_target(entry, vanilla):
    fp32 = peak(entry, torch.float32)
    assert fp32 - vanilla <= TARGET, f"{entry.label}: {fp32:.2f} [B, T] at peak, vanilla {vanilla:.2f}"
    bf16 = peak(entry, torch.bfloat16)
    assert bf16 <= fp32 + 0.25, f"{entry.label}: {bf16:.2f} [B, T] at peak in bfloat16, {fp32:.2f} in float32"
