"""What the local mode relies on in Ray, on a live Ray head (one private 2-CPU cluster for the module, ~10 s to
start):

- the trainer workers' threads (``ray_cluster.threads_env``): Ray gives an actor that asks for no CPUs
  ``OMP_NUM_THREADS=1`` (torch then runs on one core) and keeps a value set in its environment from the start."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from maspo_verl.local import ray_cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    saved = os.environ.pop(ray_cluster.THREADS_ENV, None)  # the workers inherit the head's environment
    temp = tmp_path_factory.mktemp("ray")
    try:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        if saved is not None:
            os.environ[ray_cluster.THREADS_ENV] = saved


@ray.remote
class Probe:
    def threads(self):
        import torch

        return os.environ.get(ray_cluster.THREADS_ENV), torch.get_num_threads(), ray_cluster.thread_metrics()

    def pid(self):
        return os.getpid()

    def start(self, name):
        """An actor this one owns (as verl's TaskRunner owns its rollout servers)."""
        self.owned = Probe.options(name=name).remote()
        return ray.get(self.owned.pid.remote())


def test_ray_gives_an_actor_one_thread_unless_its_environment_sets_them(cluster):
    """Without the local mode's variable verl's workers (actors asking no CPUs) get one thread: if Ray stops doing
    so, or stops keeping a set value, the local mode's setting is to be looked at again."""
    assert ray.get(Probe.remote().threads.remote())[:2] == ("1", 1)
    env = ray_cluster.threads_env(workers=1, environ={}, cpus=2)
    assert env == {ray_cluster.THREADS_ENV: "2"}
    seen = ray.get(Probe.options(runtime_env={"env_vars": env}).remote().threads.remote())
    assert seen == ("2", 2, {ray_cluster.THREADS_METRIC: 2.0})
