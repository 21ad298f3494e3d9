"""The local mode's adaptations of verl: the ``cpu`` platform, the ``hf`` rollout and the toy multi-turn agent loop
registered in verl's registries, the process-group backend de-duplicated, FSDP2's offload unpinned, and the
update metrics and worker hooks installed (``activate``, in the driver and every Ray worker); each verl internal
they rely on is checked first (``missing_features``), and the mode refused with the list of what is missing.

Nothing of verl at import time: ``maspo_verl.local`` imports this module, and a Ray worker may import that
package first (``autoload`` then needs ``activate``).
"""

from __future__ import annotations

import os

_activated = False


# verl attributes the local mode relies on: (module, attribute path)
REQUIRED_FEATURES = (
    ("verl.plugin.platform.platform_manager", "PlatformRegistry.register"),
    ("verl.plugin.platform.platform_manager", "_current_platform"),
    ("verl.plugin.platform.platform_base", "PlatformBase"),
    ("verl.workers.rollout.base", "_ROLLOUT_REGISTRY"),
    ("verl.workers.rollout.base", "BaseRollout"),
    ("verl.workers.rollout.replica", "RolloutReplicaRegistry.register"),
    ("verl.workers.rollout.replica", "RolloutReplica"),
    ("verl.workers.rollout.replica", "TokenOutput"),
    ("verl.utils.distributed", "initialize_global_process_group_ray"),
    # the multi-turn toy task's agent loop and reward manager (``turns_agent``)
    ("verl.experimental.agent_loop.agent_loop", "register"),
    ("verl.experimental.agent_loop.agent_loop", "AgentLoopBase"),
    ("verl.experimental.reward_loop.reward_manager.base", "RewardManagerBase"),
)
PROCESS_GROUP_PARAMS = ("timeout_second", "backend")


def missing_features() -> list[str]:
    """What of the verl internals the local mode patches is missing from the installed verl."""
    import importlib
    import inspect

    missing = []
    for module_name, path in REQUIRED_FEATURES:
        try:
            obj = importlib.import_module(module_name)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{module_name}.{path} ({type(exc).__name__}: {exc})")
    if not missing:
        from verl.utils import distributed

        target = getattr(distributed.initialize_global_process_group_ray, "__maspo_original__", None)
        params = tuple(inspect.signature(target or distributed.initialize_global_process_group_ray).parameters)
        if params != PROCESS_GROUP_PARAMS:
            name = "verl.utils.distributed.initialize_global_process_group_ray"
            missing.append(f"{name}{params}, expected {PROCESS_GROUP_PARAMS}")
    return missing


def check_verl_features() -> None:
    """Raise RuntimeError naming every verl internal the local mode needs and cannot find."""
    missing = missing_features()
    if missing:
        import verl

        raise RuntimeError(
            f"maspo_verl local mode cannot run on the installed verl {getattr(verl, '__version__', '?')}: it patches "
            "checks hard-coded in verl (platform, rollout registry, process-group backend) and these are missing: "
            + "; ".join(missing)
        )


def dedup_backend(backend: str | None) -> str | None:
    """'cpu:gloo,cpu:gloo' -> 'cpu:gloo' (torch rejects a device type listed twice)."""
    if not backend or "," not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.partition(":")
        seen.setdefault(device.strip(), part.strip())
    return ",".join(seen.values())


def _dedup_process_group_backend(original):
    from verl.utils import device

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        backend = backend or f"cpu:gloo,{device.get_device_name()}:{device.get_nccl_backend()}"
        return original(timeout_second=timeout_second, backend=dedup_backend(backend))

    return initialize_global_process_group_ray


def activate() -> None:
    """Register the cpu platform and the hf rollout in verl's registries (idempotent)."""
    global _activated
    if _activated:
        return
    from maspo_verl.local import vllm_cpu

    vllm_cpu.activate()  # before verl's vLLM rollout module asks for vllm's version
    if os.environ.get(vllm_cpu.ENGINE_ENV) == "vllm":
        from maspo_verl.local import watchdog

        watchdog.install_step_guard()  # no step trained on the samples of a dead engine
    check_verl_features()
    from verl.plugin.platform import platform_manager
    from verl.utils import distributed
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from maspo_verl.local.platform import PlatformCPU
    from maspo_verl.local.ray_cluster import thread_metrics
    from maspo_verl.plugin.hooks import patch, register_update_metrics

    platform_manager.PlatformRegistry.register(platform="cpu")(PlatformCPU)
    current = platform_manager._current_platform
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu" and (
        current is not None and not isinstance(current, PlatformCPU)
    ):
        platform_manager._current_platform = PlatformCPU()  # detected before we registered
    rollout_base._ROLLOUT_REGISTRY[("hf", "async")] = "maspo_verl.local.hf_rollout.HFServerAdapter"

    def _load_hf():
        from maspo_verl.local.hf_rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register("hf", _load_hf)
    problem = patch(
        "process_group_backend", distributed, "initialize_global_process_group_ray", _dedup_process_group_backend
    )
    if problem:
        raise RuntimeError(f"maspo_verl local mode: {problem}")
    _unpin_fsdp2_offload()
    register_update_metrics(thread_metrics)  # actor/torch_threads: what the run's OMP_NUM_THREADS gave the update
    from maspo_verl.local.speechwarm import fingerprint_metrics

    register_update_metrics(fingerprint_metrics)  # task=speechwarm: the warm model's fingerprint, every step
    from maspo_verl.local import turns_agent  # noqa: F401 - registers the toy multi-turn agent loop
    from maspo_verl.local.console import install_worker_hooks

    install_worker_hooks()
    _activated = True


def _unpin_fsdp2_offload() -> None:
    """verl's FSDP2 engine shards forward-only models (the reference policy of ``use_kl_loss``) with
    ``CPUOffloadPolicy(pin_memory=True)``; pinning host memory needs an accelerator. On the host the
    parameters live in host memory anyway: the same policy, unpinned."""
    from verl.workers.engine.fsdp import transformer_impl

    from maspo_verl.plugin.hooks import patch

    def _unpinned(original):
        def policy(pin_memory: bool = True, **kwargs):
            return original(pin_memory=False, **kwargs)

        return policy

    patch("fsdp2_offload_unpinned", transformer_impl, "CPUOffloadPolicy", _unpinned)  # logs if refused
