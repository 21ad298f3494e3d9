"""The driver's watchdog over the run's rollout servers.

verl's trainer waits on its rollout servers without a timeout: when one dies mid-run (Ray's OOM killer ends the
largest worker when the host runs low on memory, and a vLLM server holding its engine's KV cache is the usual
one), the next weight sync or rollout waits for it forever. ``watching`` (around the local run, in the driver)
polls the Ray cluster's actor table every few seconds (one call to the GCS, ``ray._private.state.actors``, which
carries each dead actor's death cause) from a daemon thread once the driver has joined Ray. When a server actor
(``SERVED``: verl's vLLM servers and the transformers rollout's) is dead for a cause other than the run's own end,
it prints one line naming the actor and Ray's cause, and interrupts the driver's main thread; the run then ends as
a stopped run does (the session's clean-up: Ray, its processes, /dev/shm, the run's temp dir), with
``RolloutServerDied`` in the closing block and exit status 1.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading

from maspo_verl.local.run_log import RunStopped
from maspo_verl.local.vllm_cpu import SERVER_ACTOR_PREFIX

logger = logging.getLogger("maspo_verl.local")

HF_SERVER_PREFIX = "maspo_hf_server_"  # the transformers rollout's server actors (``hf_rollout.server_name``)
SERVED = (SERVER_ACTOR_PREFIX, HF_SERVER_PREFIX)
POLL_S = 3.0
# Ray's reasons for an actor's death that are the run's own end, not a failure: the process that owns the
# servers (verl's TaskRunner) ended, or dropped them
RUN_ENDED = ("OWNER_DIED", "OUT_OF_SCOPE", "REF_DELETED")
DIED = "maspo_verl local: the rollout server actor "


class RolloutServerDied(RunStopped):
    """A rollout server actor died mid-run: the trainer would wait for it forever."""


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


class Watchdog(threading.Thread):
    """Polls ``dead_servers`` every ``every_s`` seconds once Ray is initialised in this process; the first death
    found is kept in ``death``, said in one line, and interrupts the main thread (``_interrupting_signal``), once."""

    def __init__(self, prefixes=SERVED, every_s: float = POLL_S):
        super().__init__(name="maspo-rollout-watchdog", daemon=True)
        self.prefixes, self.every_s = tuple(prefixes), every_s
        self.death: str | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._unreadable = False

    def run(self) -> None:
        while not self._stopped.wait(self.every_s):
            ray = sys.modules.get("ray")
            if ray is None or not ray.is_initialized():
                continue
            try:
                dead = dead_servers(self.prefixes)
            except Exception as exc:  # the cluster going away at the end, or a Ray without this table
                if not self._unreadable:
                    logger.warning("maspo_verl local: the rollout watchdog cannot read Ray's actors: %s", exc)
                self._unreadable = True
                continue
            if dead:
                self._fire(*dead[0])
                return

    def _fire(self, name: str, cause: str) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            self.death = f"the rollout server actor {name} died ({cause}): the trainer would wait for it forever"
            print(f"{DIED}{name} died ({cause}); the run stops", flush=True)
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
def watching(prefixes=SERVED, every_s: float = POLL_S):
    """Around a run, in its main thread: a ``Watchdog``; the interrupt it sends becomes ``RolloutServerDied``."""
    dog = Watchdog(prefixes, every_s)
    dog.start()
    try:
        yield dog
    except KeyboardInterrupt:
        dog.stop()
        if dog.death is not None:
            raise RolloutServerDied(dog.death) from None
        raise
    finally:
        dog.stop()
