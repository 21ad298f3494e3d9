"""A ``cpu`` platform for verl's platform registry (selected by ``VERL_PLATFORM=cpu``).

verl ships cuda/npu/rocm platforms only. This one runs everything on the host: device ``cpu``,
process groups on ``gloo``, and a ``torch.cpu``-based device module with the ``torch.cuda``-style
helpers verl calls (memory statistics, RNG state, streams). It reports the Ray resource ``GPU``
because verl's resource checks count GPUs only: start Ray with a logical GPU
(``ray_kwargs.ray_init.num_gpus=1``; hydra_configs/local/cpu.yaml does).
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def _free_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _total_memory() // 2


class _Props:
    def __init__(self) -> None:
        self.name = "cpu"
        self.total_memory = _total_memory()
        self.major, self.minor = 0, 0
        self.multi_processor_count = os.cpu_count() or 1


def _zero(*args, **kwargs) -> int:
    return 0


def _none(*args, **kwargs) -> None:
    return None


class CPUDeviceModule(ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-style functions verl calls on ``get_torch_device()``."""

    def __init__(self) -> None:
        super().__init__("maspo_verl_cpu_device")
        self.memory_allocated = _zero
        self.memory_reserved = _zero
        self.max_memory_allocated = _zero
        self.max_memory_reserved = _zero
        self.reset_peak_memory_stats = _none
        self.reset_max_memory_allocated = _none
        self.empty_cache = _none
        self.ipc_collect = _none
        self.set_device = _none
        self.synchronize = _none
        self.current_device = _zero
        self.device_count = lambda: 1
        self.is_available = lambda: True
        self.is_initialized = lambda: True
        self.mem_get_info = lambda *a, **k: (_free_memory(), _total_memory())
        self.get_device_properties = lambda *a, **k: _Props()
        self.get_device_name = lambda *a, **k: "cpu"
        self.get_device_capability = lambda *a, **k: (0, 0)
        self.memory_stats = lambda *a, **k: {}
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.get_rng_state_all = lambda: [torch.get_rng_state()]
        self.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
        self.manual_seed = lambda seed: torch.manual_seed(seed)
        self.manual_seed_all = lambda seed: torch.manual_seed(seed)
        self.seed = lambda: torch.seed()
        self.initial_seed = lambda: torch.initial_seed()

    def __getattr__(self, name: str) -> Any:
        # torch.cpu has Stream, stream, current_stream, device_count, synchronize, amp ...
        return getattr(torch.cpu, name)


DEVICE_MODULE = CPUDeviceModule()


class PlatformCPU(PlatformBase):
    """Host-only platform; registered as ``cpu`` by ``maspo_verl.local.activate``."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # never auto-detected: only an explicit VERL_PLATFORM=cpu selects it
        return False

    def current_device(self) -> str:
        # verl passes this to ``.to(...)`` / ``torch.device(...)``; an int would mean cuda:N
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def get_device_uuid(self, device_id):
        return f"cpu-{device_id}"

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        """The rollout server's environment: vLLM's temp files (its ``file://`` rendezvous) in the Ray cluster's
        temp dir (a private cluster's is removed at the end of the run), its caches in the local mode's cache
        (nothing new in HOME), no usage report."""
        import ray

        from maspo_verl.util import default_cache_dir

        tmp = os.path.join(ray.get_runtime_context().get_temp_dir(), "rollout_tmp")
        os.makedirs(tmp, exist_ok=True)
        cache = default_cache_dir() / "vllm"
        return {
            "TMPDIR": tmp,
            "VLLM_CACHE_ROOT": str(cache),
            "VLLM_CONFIG_ROOT": str(cache / "config"),
            "VLLM_NO_USAGE_STATS": "1",
        }

    def get_collective_module(self) -> Any:
        return None

    def cudart(self) -> Any:
        return None
