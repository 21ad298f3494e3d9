"""Run ``maspo_verl.lab.studies.megatron_update`` on the CPU: a test harness, not a supported mode.

``python tests/lab/megatron_cpu.py [--plant-wrong-loss] [megatron_update arguments]``

megatron-core assumes CUDA in a few places its local layer spec still reaches (buffers made with
``device='cuda'``, ``torch.cuda.current_device()``, CUDA streams and RNG states, ``'torch.cuda.FloatTensor'``
type checks); this process maps them to the CPU and selects the local mode's ``cpu`` platform for verl (gloo).
The engine, the loss path and the check are the module's own. ``--plant-wrong-loss`` makes verl's registry
answer ``maspo`` with verl's ``vanilla``: the check must fail.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode


class _Stream:
    def wait_event(self, *args):
        pass

    def wait_stream(self, *args):
        pass

    def synchronize(self):
        pass


class CudaOnCpu(TorchFunctionMode):
    """Tensors asked for on ``cuda`` are made on the CPU; ``.cuda()`` is a no-op; ``.type()`` answers as CUDA's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def on_cpu() -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    from verl.plugin.platform import platform_manager

    from maspo_verl.local.platform import PlatformCPU

    platform_manager.PlatformRegistry.register(platform="cpu")(PlatformCPU)
    platform_manager._current_platform = PlatformCPU()

    import megatron.core.tensor_parallel.random as megatron_random
    import verl.utils.megatron_utils as megatron_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    megatron_utils.get_device_id = lambda: 0  # verl moves the model to f"{device}:{id}"
    CudaOnCpu().__enter__()


def plant_wrong_loss() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import maspo_verl.plugin  # noqa: F401  (registers ours; it does not register again)

    POLICY_LOSS_REGISTRY["maspo"] = POLICY_LOSS_REGISTRY["vanilla"]


if __name__ == "__main__":
    argv = sys.argv[1:]
    on_cpu()
    if "--plant-wrong-loss" in argv:
        argv.remove("--plant-wrong-loss")
        plant_wrong_loss()
    from maspo_verl.lab.studies.megatron_update import main

    raise SystemExit(main(argv))
