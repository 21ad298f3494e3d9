"""What the local mode relies on in Ray, on a live Ray head (one private 2-CPU cluster for the module, ~10 s to
start; the tests ~10 s more on 2 cores):

- the trainer workers' threads (``ray_cluster.threads_env``): Ray gives an actor that asks for no CPUs
  ``OMP_NUM_THREADS=1`` (torch then runs on one core) and keeps a value set in its environment from the start;
- the rollout watchdog (``maspo_verl.local.watchdog``): a server actor killed as Ray's OOM killer kills one
  (SIGKILL) stops the run with the actor's name and Ray's cause; a server that ends with its owner (verl's
  TaskRunner at the end of a run) does not, nor an actor of another name or of another job; Ray's records of
  a death (its protobuf, no head needed) read in one line."""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from maspo_verl.local import ray_cluster, watchdog  # noqa: E402


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


def test_rays_death_causes_in_one_line():
    """Ray's records of an actor's death, as its GCS keeps them: the OOM killer's, a killed process's, and the ends
    of a run (its owner gone, its handles dropped), which are none."""
    from ray.core.generated import common_pb2 as ray_pb

    oom = ray_pb.ActorDeathCause(
        oom_context=ray_pb.OomContext(error_message="Task was killed due to the node running low on memory.\nMemory on")
    )
    assert watchdog.death_cause(oom) == "OOM: Task was killed due to the node running low on memory. Memory on"
    died = ray_pb.ActorDiedErrorContext(reason=ray_pb.ActorDiedErrorContext.WORKER_DIED, error_message="x" * 400)
    said = watchdog.death_cause(ray_pb.ActorDeathCause(actor_died_error_context=died))
    assert said == f"WORKER_DIED: {'x' * 300} ..."
    for reason in watchdog.RUN_ENDED:
        ended = ray_pb.ActorDiedErrorContext(reason=ray_pb.ActorDiedErrorContext.Reason.Value(reason))
        assert watchdog.death_cause(ray_pb.ActorDeathCause(actor_died_error_context=ended)) is None
    assert watchdog.death_cause(ray_pb.ActorDeathCause()) == "no cause recorded"


def _wait_for_death(name: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(info.get("Name") == name for info in ray._private.state.actors(actor_state_name="DEAD").values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} is not dead after {timeout_s} s")


class _Stopped(KeyboardInterrupt):
    pass


def _stop(signum, frame):  # as the local session's SIGTERM handler does
    raise _Stopped


@pytest.fixture(params=["SIGINT", "SIGTERM"])
def interrupts(request):
    """The driver's main thread as the watchdog finds it: Python's SIGINT handler (a terminal), or SIGINT ignored
    (a background job, ``nohup``) and the session's SIGTERM handler."""
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    if request.param == "SIGINT":
        signal.signal(signal.SIGINT, signal.default_int_handler)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _stop)
    try:
        yield request.param
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_a_killed_rollout_server_stops_the_run_with_its_name_and_cause(cluster, capsys, interrupts):
    """SIGKILL, as Ray's OOM killer ends a worker: the watchdog interrupts the run within a few polls, by SIGINT or,
    where SIGINT is ignored, SIGTERM."""
    assert watchdog._interrupting_signal() == getattr(signal, interrupts)
    name = f"{watchdog.SERVER_ACTOR_PREFIX}test_{interrupts}_0"
    server = Probe.options(name=name).remote()
    pid = ray.get(server.pid.remote())
    start = time.monotonic()
    with pytest.raises(watchdog.RolloutServerDied) as stopped:
        with watchdog.watching((name,), every_s=0.5):  # this server only: the other case's is dead too
            os.kill(pid, signal.SIGKILL)
            time.sleep(30)
    assert time.monotonic() - start < 20
    assert f"the rollout server actor {name} died (WORKER_DIED: The actor is dead because" in str(stopped.value)
    assert f"(pid {pid})" in str(stopped.value)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith(watchdog.DIED)]
    assert len(said) == 1 and said[0].startswith(f"{watchdog.DIED}{name} died (WORKER_DIED: "), said  # as it happens


def test_servers_ending_with_their_owner_or_other_actors_dying_do_not_stop_the_run(cluster):
    """A server whose owner ended (the run's own end: verl's TaskRunner owns its servers) and a dead actor of
    another name are not the watchdog's."""
    watched = (f"{watchdog.SERVER_ACTOR_PREFIX}owned_",)  # not the server the test above killed, in this cluster
    owner = Probe.remote()
    server = f"{watched[0]}0_0"
    ray.get(owner.start.remote(server))
    other = Probe.options(name="not_a_server").remote()
    other_pid = ray.get(other.pid.remote())
    with watchdog.watching(watched, every_s=0.5) as dog:
        ray.kill(owner)
        os.kill(other_pid, signal.SIGKILL)
        _wait_for_death(server)
        _wait_for_death("not_a_server")
        time.sleep(2.0)  # polls that see both dead
    assert dog.death is None and not dog.is_alive()
    assert watchdog.dead_servers(watched) == [] and len(watchdog.dead_servers(("not_a_",))) == 1


def test_only_the_runs_own_job_is_watched(cluster, monkeypatch):
    """A joined cluster keeps other jobs' dead actors: a dead server seen from another job is not the run's."""
    name = f"{watchdog.SERVER_ACTOR_PREFIX}job_0_0"
    server = Probe.options(name=name).remote()  # held: an actor whose handles are all gone ends OUT_OF_SCOPE
    os.kill(ray.get(server.pid.remote()), signal.SIGKILL)
    _wait_for_death(name)
    assert [found for found, _ in watchdog.dead_servers((name,))] == [name]
    monkeypatch.setattr(ray.runtime_context.RuntimeContext, "get_job_id", lambda self: "7f000000")
    assert watchdog.dead_servers((name,)) == []


class _EngineCores:
    """vLLM's ``CoreEngineProcManager`` as far as the watchdog reads it: its engine core processes (real ones
    here, sleeping) and ``finished_procs``, the exit code of each that ended."""

    def __init__(self):
        import multiprocessing

        self.processes = [multiprocessing.Process(target=time.sleep, args=(600,), name="EngineCore_DP0", daemon=True)]
        self.processes[0].start()

    def finished_procs(self):
        return {p.name: p.exitcode for p in self.processes if p.exitcode is not None}


class _EngineClient:
    """vLLM's ``AsyncLLM`` as verl's server keeps it (``engine``): ``errored`` once an engine core ended."""

    def __init__(self):
        from types import SimpleNamespace

        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=_EngineCores()))

    @property
    def errored(self):
        return bool(self.engine_core.resources.engine_manager.finished_procs())


@ray.remote
class EngineServer:
    """An async actor holding an engine client, as verl's ``vLLMHttpServer`` does."""

    def __init__(self):
        self.engine = _EngineClient()

    async def core_pid(self):
        return self.engine.engine_core.resources.engine_manager.processes[0].pid

    async def shut_down_by_the_run(self):
        from maspo_verl.local import vllm_cpu

        setattr(self, vllm_cpu.SHUT_DOWN, True)


def test_a_dead_engine_in_a_live_server_stops_the_run_naming_it_and_how_it_ended(cluster, capsys, interrupts):
    """The server lives on, its engine core SIGKILLed (as the kernel's OOM killer ends one): the watchdog asks the
    server, names the server and the engine core's end, mutes the console and interrupts the run."""
    name = f"{watchdog.SERVER_ACTOR_PREFIX}engine_{interrupts}_0"
    server = EngineServer.options(name=name).remote()
    core = ray.get(server.core_pid.remote())
    muted = []
    start = time.monotonic()
    with pytest.raises(watchdog.EngineDied) as stopped:
        with watchdog.watching((name,), every_s=0.5, on_death=muted.append):
            time.sleep(2.0)  # a running engine: no death
            os.kill(core, signal.SIGKILL)
            time.sleep(30)
    assert time.monotonic() - start < 20
    said = f"the vLLM engine of the rollout server {name} died (its engine core EngineCore_DP0 killed by SIGKILL"
    assert str(stopped.value).startswith(said), str(stopped.value)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(watchdog.ENGINE_DIED)]
    assert (
        len(lines) == 1
        and lines[0].startswith(f"{watchdog.ENGINE_DIED}{name} died (its engine core ")
        and lines[0].endswith("; the run stops")
    ), lines
    assert muted == ["the rollout server's death"]
    ray.kill(server)


def test_an_engine_the_run_shut_down_is_no_death(cluster):
    name = f"{watchdog.SERVER_ACTOR_PREFIX}engine_shut_0"
    server = EngineServer.options(name=name).remote()
    core = ray.get(server.core_pid.remote())
    with watchdog.watching((name,), every_s=0.5) as dog:
        ray.get(server.shut_down_by_the_run.remote())
        os.kill(core, signal.SIGKILL)
        time.sleep(3.0)  # polls that ask the server
    assert dog.death is None
    ray.kill(server)


def test_the_kernels_oom_kills_are_counted_from_the_runs_start(tmp_path, monkeypatch):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 10\noom_kill 3\nthp_fault_alloc 0\n")
    monkeypatch.setattr(watchdog, "VMSTAT", str(vmstat))
    assert watchdog.oom_kills() == 3
    dog = watchdog.Watchdog()
    assert dog._oom_note() == ""
    vmstat.write_text("pgfault 10\noom_kill 5\n")
    assert dog._oom_note() == "; the kernel's OOM killer ended 2 processes since the run began (dmesg names them)"
    vmstat.write_text("pgfault 10\n")
    assert watchdog.oom_kills() is None and dog._oom_note() == ""
    assert watchdog.exit_said(-9) == "killed by SIGKILL" and watchdog.exit_said(1) == "exited with status 1"


def test_the_trainers_step_stops_on_a_dead_engine_before_training(cluster):
    """The check verl's trainer runs before each step trains (``install_step_guard`` wraps ``_balance_batch``): the
    step goes on while the engines run, and raises ``EngineDied`` naming the server once one's engine died."""
    name = f"{watchdog.SERVER_ACTOR_PREFIX}engine_guard_0"
    server = EngineServer.options(name=name).remote()
    core = ray.get(server.core_pid.remote())
    trained = []
    step = watchdog._engines_checked_before(lambda self, batch: trained.append(batch) or batch)
    assert step(None, "batch 1") == "batch 1"
    os.kill(core, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not watchdog.dead_engines() and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(watchdog.EngineDied, match=f"the vLLM engine of the rollout server {name} died \\(its engine"):
        step(None, "batch 2")
    assert trained == ["batch 1"]
    ray.kill(server)
