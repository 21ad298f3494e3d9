"""A planted fault for tests/e2e/test_local_vllm.py (on PYTHONPATH only there): in vLLM's worker, verl's weight sync
receives every bucket and loads none of it, and vLLM keeps its unpacked weights, so the engine goes on sampling
with the weights it started with: a sync that silently kept the old weights."""

import importlib.abc
import importlib.util
import os
import sys


def _stale(module):
    module.vLLMColocateWorkerExtension._update_weights = lambda self, *args, **kwargs: None


def _keep_weights(module):
    original = module.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
        return original(layer, False, *args, **kwargs)

    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


class _After(importlib.abc.MetaPathFinder):
    def __init__(self, name, plant):
        self.name, self.plant = name, plant

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run, plant = spec.loader.exec_module, self.plant

        def exec_module(module):
            run(module)
            plant(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MASPO_VERL_ROLLOUT_ENGINE") == "vllm":
    sys.meta_path.insert(0, _After("verl.workers.rollout.vllm_rollout.utils", _stale))
    sys.meta_path.insert(0, _After("vllm.model_executor.layers.utils", _keep_weights))
