"""The driver's watchdog over the run's rollout servers and their vLLM engines.

verl's trainer waits on its rollout servers without a timeout: when one dies mid-run (Ray's OOM killer ends the
largest worker when the host runs low on memory, and a vLLM server holding its engine's KV cache is the usual
one), the next weight sync or rollout waits for it forever. When only the server's vLLM engine dies (its engine core
or a worker of it killed, by the kernel's OOM killer or anyone) the server lives on, answers every request with an
``EngineDeadError`` (a traceback each on the console), verl fills the batch with synthetic padding and then waits
forever too.

``watching`` (around the local run, in the driver) polls from a daemon thread, every few seconds once the driver
has joined Ray: the Ray cluster's actor table (one call to the GCS, ``ray._private.state.actors``, which carries
each dead actor's death cause), and each live vLLM server of the run, asked through Ray whether its engine still
runs (``engine_death``: vLLM's own flag, and its engine core processes' exit codes). When a server actor
(``SERVED``: verl's vLLM servers and the transformers rollout's) is dead for a cause other than the run's own end,
or a vLLM server's engine is, it prints one line naming the actor (the engine) and the cause, with the kernel's
OOM kills since the run began where there were any, mutes the console (what the dying run prints goes to run.log
only, counted in the closing block) and interrupts the driver's main thread; the run then ends as a stopped run
does (the session's clean-up: Ray, its processes, /dev/shm, the run's temp dir), with ``RolloutServerDied`` (or
``EngineDied``) in the closing block and exit status 1.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

from maspo_verl.local.run_log import RunStopped
from maspo_verl.local.vllm_cpu import SERVER_ACTOR_PREFIX, SHUT_DOWN

logger = logging.getLogger("maspo_verl.local")

HF_SERVER_PREFIX = "maspo_hf_server_"  # the transformers rollout's server actors (``hf_rollout.server_name``)
SERVED = (SERVER_ACTOR_PREFIX, HF_SERVER_PREFIX)
POLL_S = 3.0
# seconds a vLLM server gets to answer whether its engine runs (one question in flight per server)
ASK_S = 20.0
# Ray's reasons for an actor's death that are the run's own end, not a failure: the process that owns the
# servers (verl's TaskRunner) ended, or dropped them
RUN_ENDED = ("OWNER_DIED", "OUT_OF_SCOPE", "REF_DELETED")
DIED = "maspo_verl local: the rollout server actor "
ENGINE_DIED = "maspo_verl local: the vLLM engine of the rollout server "
VMSTAT = "/proc/vmstat"
VLLM_TITLE = "VLLM::"  # vLLM's processes name themselves so


class RolloutServerDied(RunStopped):
    """A rollout server actor died mid-run: the trainer would wait for it forever."""


class EngineDied(RolloutServerDied):
    """A vLLM server's engine died mid-run: its server would answer each request with an error."""


def death_cause(cause) -> str | None:
    """Ray's cause of an actor's death (its ``ActorDeathCause``) in one line: the kind (``OOM``, or the reason Ray
    gives: ``WORKER_DIED``, ``RAY_KILL``, ``NODE_DIED``, ...) and Ray's message, its first 300 characters; None for
    a death that is the run's own end (``RUN_ENDED``)."""
    kind = cause.WhichOneof("context") if cause is not None and hasattr(cause, "WhichOneof") else None
    if kind is None:
        return "no cause recorded"
    context = getattr(cause, kind)
    if kind == "oom_context":
        name = "OOM"
    elif kind == "actor_died_error_context":
        name = type(context).Reason.Name(context.reason)
        if name in RUN_ENDED:
            return None
    else:
        name = kind.removesuffix("_context")
    message = " ".join(str(getattr(context, "error_message", "") or "").split())
    if len(message) > 300:
        message = message[:300] + " ..."
    return f"{name}: {message}" if message else name


def dead_servers(prefixes=SERVED) -> list[tuple[str, str]]:
    """(name, cause) of each dead actor of this process's Ray job (a joined cluster holds other jobs' too) whose
    name starts with one of ``prefixes`` and whose death is not the run's own end."""
    import ray
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    found = []
    for info in state.actors(actor_state_name="DEAD").values():
        name = info.get("Name") or ""
        if info.get("JobID") != job or not name.startswith(tuple(prefixes)):
            continue
        cause = death_cause(info.get("DeathCause"))
        if cause is not None:
            found.append((name, f"{cause} (pid {info.get('Pid')})" if info.get("Pid") else cause))
    return found


def exit_said(code: int) -> str:
    """A process's exit code in words: ``killed by SIGKILL`` (negative: the signal), ``exited with status 1``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with status {code}"


def engine_death(server) -> str | None:
    """In a vLLM server actor (``__ray_call__``): None while its engine runs, or before it has one, or once the run
    shuts it down itself (``vllm_cpu.SHUT_DOWN``); else what vLLM knows of its death: its engine core processes'
    exit codes where they ended, else that the engine reports itself dead (a worker of its core ended)."""
    engine = getattr(server, "engine", None)
    if engine is None or getattr(server, SHUT_DOWN, False):
        return None
    try:
        if not engine.errored:  # vLLM's AsyncLLM: its engine core's death noticed, or the client stopped
            return None
    except Exception:  # an engine without the flag: nothing to tell
        return None
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    ended = {}
    with contextlib.suppress(Exception):
        ended = dict(manager.finished_procs())
    if ended:
        return "; ".join(f"its engine core {name} {exit_said(code)}" for name, code in sorted(ended.items()))
    return "vLLM reports its engine dead"


def vllm_processes(temp_dirs) -> dict[int, str]:
    """pid -> process title of each vLLM process (``VLLM::EngineCore``, ``VLLM::Worker``, ...) of the private Ray
    clusters in ``temp_dirs`` (their processes name it in their command line or environment)."""
    from maspo_verl.local.cleanup import processes_naming

    found = {}
    for folder in list(temp_dirs):
        for pid in processes_naming(folder):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().split(b"\0")[0].decode(errors="replace").strip()
                if title.startswith(VLLM_TITLE):
                    found[pid] = title
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def oom_kills() -> int | None:
    """The kernel's count of processes its OOM killer ended since boot (``oom_kill`` of /proc/vmstat; None where the
    system does not say)."""
    with contextlib.suppress(OSError, ValueError):
        with open(VMSTAT) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return None


def dead_engines(timeout_s: float = 30.0) -> list[tuple[str, str]]:
    """In a process of the run's Ray job (verl's TaskRunner): (server, cause) of each vLLM server of the job whose
    engine died (``engine_death``); a server that does not answer within ``timeout_s`` is the watchdog's."""
    import ray

    names = [name for name in ray.util.list_named_actors() if name.startswith(SERVER_ACTOR_PREFIX)]
    asked = []
    for name in names:
        with contextlib.suppress(ValueError):  # gone meanwhile
            asked.append((name, ray.get_actor(name).__ray_call__.remote(engine_death)))
    found = []
    for name, ref in asked:
        try:
            cause = ray.get(ref, timeout=timeout_s)
        except Exception:  # dead or busy: the watchdog's
            continue
        if cause:
            found.append((name, cause))
    return found


# the trainers' method that every step calls with its samples, before any update (verl 0.9: v1 and legacy)
STEP_GUARDED = "_balance_batch"


def _guard_problem(original) -> str | None:
    return None if callable(original) else f"{original!r} is not a trainer's {STEP_GUARDED}"


def _engines_checked_before(original):
    def _balance_batch(self, *args, **kwargs):
        dead = dead_engines()
        if dead:
            name, cause = dead[0]
            raise EngineDied(
                f"the vLLM engine of the rollout server {name} died ({cause}): the step's samples are not all the "
                "engine's, and the run stops before training on them"
            )
        return original(self, *args, **kwargs)

    return _balance_batch


def install_step_guard() -> None:
    """In the process that runs verl's trainer: each step's samples are trained on only while every vLLM engine of
    the run still runs (a dead engine's requests fail, and verl fills the batch with synthetic padding: the
    watchdog, polling, may see the death only after such a step)."""
    from maspo_verl.local.vllm_cpu import hook_trainers

    hook_trainers("vllm_engines_checked_before_training", STEP_GUARDED, _engines_checked_before, _guard_problem)


class Watchdog(threading.Thread):
    """Polls ``dead_servers`` and each live vLLM server's ``engine_death`` every ``every_s`` seconds once Ray is
    initialised in this process; the first death found is kept in ``death`` (its exception in ``error``), said in
    one line, passed to ``on_death`` and interrupts the main thread (``_interrupting_signal``), once."""

    def __init__(self, prefixes=SERVED, every_s: float = POLL_S, on_death=None, temp_dirs=()):
        super().__init__(name="maspo-rollout-watchdog", daemon=True)
        self.prefixes, self.every_s, self.on_death = tuple(prefixes), every_s, on_death
        self.temp_dirs = temp_dirs  # the private clusters' (a list the run fills): their vLLM processes seen
        self._seen: dict[int, str] = {}
        self.death: str | None = None
        self.error: type[RolloutServerDied] = RolloutServerDied
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._unreadable = False
        self._asked: dict[str, object] = {}  # server name -> its question in flight (an ObjectRef)
        self._oom_at_start = oom_kills()

    def run(self) -> None:
        while not self._stopped.wait(self.every_s):
            ray = sys.modules.get("ray")
            if ray is None or not ray.is_initialized():
                continue
            with contextlib.suppress(OSError):
                self._seen.update(vllm_processes(self.temp_dirs))
            try:
                dead = dead_servers(self.prefixes)
                if dead:
                    self._fire(*dead[0])
                    return
                engine = self._dead_engine(ray)
            except Exception as exc:  # the cluster going away at the end, or a Ray without this table
                if not self._unreadable:
                    logger.warning("maspo_verl local: the rollout watchdog cannot read Ray's actors: %s", exc)
                self._unreadable = True
                continue
            if engine:
                self._fire(*engine, error=EngineDied)
                return

    def _dead_engine(self, ray) -> tuple[str, str] | None:
        """(server, cause) of a live vLLM server whose engine died, asking each one question at a time (the live
        ones: Ray's named actors of this job, not the GCS's whole actor table, a larger answer on each poll)."""
        for name in ray.util.list_named_actors():
            if not (name.startswith(SERVER_ACTOR_PREFIX) and name.startswith(self.prefixes)):
                continue
            asked = self._asked.get(name)
            if asked is None:
                with contextlib.suppress(ValueError):  # gone meanwhile: the actor table says so next time
                    self._asked[name] = ray.get_actor(name).__ray_call__.remote(engine_death)
                continue
            done, _ = ray.wait([asked], timeout=0)
            if not done:
                continue  # busy: asked again once it answers
            del self._asked[name]
            try:
                cause = ray.get(done[0])
            except Exception:  # the actor itself died: the actor table tells why
                continue
            if cause:
                gone = [f"{title} (pid {pid})" for pid, title in sorted(self._seen.items()) if not _alive(pid)]
                return name, f"{', '.join(gone)} ended ({cause})" if gone else cause
        return None

    def _oom_note(self) -> str:
        now = oom_kills()
        if now is None or self._oom_at_start is None or now <= self._oom_at_start:
            return ""
        n = now - self._oom_at_start
        return f"; the kernel's OOM killer ended {n} process{'es' * (n != 1)} since the run began (dmesg names them)"

    def _fire(self, name: str, cause: str, error: type[RolloutServerDied] = RolloutServerDied) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            cause += self._oom_note()
            if error is EngineDied:
                said = f"the vLLM engine of the rollout server {name} died ({cause})"
                line = f"{ENGINE_DIED}{name} died ({cause}); the run stops"
            else:
                said = f"the rollout server actor {name} died ({cause})"
                line = f"{DIED}{name} died ({cause}); the run stops"
            self.death, self.error = f"{said}: the trainer would wait for it forever", error
            print(line, flush=True)
            if self.on_death is not None:
                self.on_death("the rollout server's death")
            # a real signal to the main thread: it also ends a sleep or a wait in a system call
            signal.pthread_kill(threading.main_thread().ident, _interrupting_signal())

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.every_s + 5)


def _interrupting_signal() -> int:
    """SIGINT where Python raises KeyboardInterrupt for it (its own handler), else SIGTERM (the local session's
    handler raises it too): a process started with SIGINT ignored (``nohup``, a background job) keeps it ignored,
    and an ignored signal interrupts nothing."""
    return signal.SIGINT if signal.getsignal(signal.SIGINT) is signal.default_int_handler else signal.SIGTERM


@contextlib.contextmanager
def watching(prefixes=SERVED, every_s: float = POLL_S, on_death=None, temp_dirs=()):
    """Around a run, in its main thread: a ``Watchdog``; the interrupt it sends becomes ``RolloutServerDied`` (a
    vLLM engine's death: ``EngineDied``). ``on_death(why)``: called with the death's line said (the console muted);
    ``temp_dirs``: the private Ray clusters' temp dirs, whose vLLM processes the death's line names where they ended."""
    dog = Watchdog(prefixes, every_s, on_death, temp_dirs)
    dog.start()
    try:
        yield dog
    except KeyboardInterrupt:
        dog.stop()
        if dog.death is not None:
            raise dog.error(dog.death) from None
        raise
    finally:
        dog.stop()
