"""The learn command's axes and statistics, without a trainer: cells, the overrides a cell makes,
per-run numbers from verl's per-step metrics (collapses, censoring) and the paired comparisons."""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from maspo_verl.lab.engine.cells import Cell, Mismatch, parse_mismatch
from maspo_verl.lab.engine.stats import mean_interval
from maspo_verl.lab.studies import learn
from maspo_verl.local import learn_tasks as lt
from maspo_verl.util import config_dir, preset_names


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    learn.add_arguments(p)
    return p.parse_args(list(argv))


def test_mismatch_forms():
    """One grammar for every study's mismatch (engine/cells.py): lab learn's bare sigma and the grid's noise<SIGMA>
    read alike; the dtype comes first; lab learn's rollout is fp32 or bf16."""
    assert parse_mismatch("none") == Mismatch("fp32", 0, 0.0)
    assert parse_mismatch("bf16") == Mismatch("bf16", 0, 0.0)
    assert parse_mismatch("0.2") == parse_mismatch("noise0.2") == Mismatch("fp32", 0, 0.2)
    assert parse_mismatch("bf16+0.05") == Mismatch("bf16", 0, 0.05)
    for bad in ("-0.1", "nan", "bf16+x", "0.2+bf16", "0.2+0.1", "none+0.2"):
        with pytest.raises(SystemExit, match="--mismatch"):
            parse_mismatch(bad)
    with pytest.raises(SystemExit, match="--mismatch 'fp16': lab learn's rollout precision"):
        learn.cells_of(_args("--cells", "96/fp16/1", "--bypass"))
    with pytest.raises(SystemExit, match="set no learning rate"):
        learn.cells_of(_args("--cells", "L96/none/U1/lr1", "--bypass"))
    assert learn.cells_of(_args("--cells", "L96/0.2/U1", "--bypass")) == [Cell(96, "0.2", 1)]


def test_stale_rollouts_are_a_mismatch_term_the_local_mode_reads():
    import yaml

    from maspo_verl.local.mismatch import LogProbMismatch

    assert parse_mismatch("stale2") == Mismatch("fp32", 2, 0.0)
    assert parse_mismatch("bf16+stale1+0.2") == Mismatch("bf16", 1, 0.2)
    assert parse_mismatch("stale3+0.2") == Mismatch("fp32", 3, 0.2)
    for bad in ("stale0", "stale1+stale2", "stalex", "stale"):
        with pytest.raises(SystemExit, match="--mismatch"):
            parse_mismatch(bad)
    args = _args("--bypass", "--batch", "8", "--n", "4")
    data = {"train": "t.parquet", "val": "v.parquet", "sentence": "ka lo mi nu"}
    cell = learn.cells_of(_args("--cells", "96/stale2/4", "--bypass"))[0]
    assert cell.rollout.stale == 2 and cell.label == "L96/stale2/U4"
    ov = learn.overrides_for(args, "speech", "grpo", 3, data, cell)
    section = dict(o.removeprefix("maspo.local_mismatch.").split("=") for o in ov if "local_mismatch" in o)
    mismatch = LogProbMismatch.from_mapping({k: yaml.safe_load(v) for k, v in section.items()})  # Hydra's scalars
    assert mismatch.stale_syncs == 2 and mismatch.noise_std == 0.0 and mismatch.logprob_dtype == "fp32"
    assert mismatch.active
    with pytest.raises(SystemExit, match="add --bypass"):
        learn.cells_of(_args("--cells", "96/stale2/4"))


def test_cells_product_explicit_and_checked():
    cells = learn.cells_of(
        _args("--lengths", "12", "96", "--mismatch", "none", "0.2", "--updates", "1", "4", "--bypass")
    )
    assert len(cells) == 8 and cells[0] == Cell(12, "none", 1) and cells[-1].label == "L96/0.2/U4"
    assert learn.cells_of(_args())[0] == Cell(lt.RESPONSE_TOKENS, "none", 2)  # the old command's meaning
    explicit = learn.cells_of(_args("--cells", "96/none/1", "96/bf16/1", "--bypass"))
    assert [c.label for c in explicit] == ["L96/none/U1", "L96/bf16/U1"]
    assert explicit[1].reference() == explicit[0]
    for argv, match in (
        (["--mismatch", "0.2"], "add --bypass"),
        (["--updates", "3"], "must divide --batch 8"),
        (["--cells", "96/0.2"], "LENGTH/MISMATCH/UPDATES"),
        (["--cells", "96/none/1", "--lengths", "12"], "one or the other"),
        (["--cells", "96/none/1", "96/none/1"], "twice"),
    ):
        with pytest.raises(SystemExit, match=match):
            learn.cells_of(_args(*argv))


def test_overrides_of_a_cell():
    args = _args("--bypass", "--batch", "8", "--n", "4")
    data = {"train": "t.parquet", "val": "v.parquet", "sentence": "ka lo mi nu"}
    ov = learn.overrides_for(args, "speech", "grpo", 3, data, Cell(96, "bf16+0.2", 4))
    assert "data.max_response_length=96" in ov and "data.max_prompt_length=64" in ov
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=2" in ov  # 8 prompts / 4 updates
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8" in ov
    assert "algorithm.rollout_correction.bypass_mode=true" in ov
    assert "maspo.local_mismatch.logprob_dtype=bf16" in ov and "maspo.local_mismatch.noise_std=0.2" in ov
    assert not [o for o in ov if "mixed_precision" in o]  # verl's default: the actor computes in bf16
    fp32 = learn.overrides_for(_args("--fp32-trainer"), "speech", "grpo", 3, data, Cell(12, "none", 1))
    assert "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32" in fp32
    plain = learn.overrides_for(_args(), "speech", "grpo", 3, data, Cell(12, "none", 1))
    assert not [o for o in plain if "bypass" in o or "local_mismatch" in o]
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=8" in plain
    long_text = " ".join(["ka"] * 96)
    assert learn.prompt_room(long_text) >= len("Say: " + long_text) + 19  # the chat template's tokens


def test_losses_are_the_presets_and_compose():
    """The default losses are every loss preset (the baseline first) and maspo_fixed+span; each one's
    overrides compose to the trainer config it names; a name that is no preset is refused at start."""
    from tests.helpers import compose_config

    assert learn.DEFAULT_LOSSES[0] == learn.BASELINE and set(preset_names()) <= set(learn.DEFAULT_LOSSES)
    learn.check_losses(learn.DEFAULT_LOSSES)
    for loss in learn.DEFAULT_LOSSES:
        preset, _, credit = loss.partition("+")
        cfg = compose_config(*learn.loss_overrides(loss))
        policy_loss = cfg.actor_rollout_ref.actor.policy_loss
        shipped = OmegaConf.load(config_dir() / "loss" / f"{preset}.yaml").actor_rollout_ref.actor.policy_loss
        assert policy_loss.loss_mode == shipped.loss_mode, loss
        window = 3 if preset == "maspo_fixed" else shipped.get("segment_window", policy_loss.segment_window)
        assert policy_loss.segment_window == window, loss  # W = 3 tokens: the one adjustment
        assert (cfg.algorithm.adv_estimator == "maspo_span_grpo") == (credit == "span"), loss
    for bad in ("maspo_delimiters", "grpo+nothing", "nothing+span"):
        with pytest.raises(SystemExit, match=f"--losses '{re.escape(bad)}': allowed a loss preset"):
            learn.check_losses([bad])


def test_speech_sentence_keeps_its_words_at_any_length(tmp_path):
    for length in (12, 96):
        speech = lt.write_dataset(tmp_path / str(length), "speech", seed=2, n_train=2, n_val=1, length=length)
        words = speech["sentence"].split()
        assert len(words) == lt.SPEECH_WORDS
        held = [lt.WORDS.index(w) * lt.BLOCK + f for w in words for f in range(length // lt.SPEECH_WORDS)]
        assert len(held) == length and lt.score("speech", held, speech["sentence"])[0] == 1.0
    text = lt.write_dataset(tmp_path / "t", "text", seed=2, n_train=2, n_val=1, length=96)["sentence"].split()
    assert len(text) == 96


def _steps(rewards, **extra):
    return {
        i: {"critic/score/mean": r, "actor/grad_norm": 1.0 + i, "actor/pg_loss": 0.1} | extra
        for i, r in enumerate(rewards, 1)
    }


def test_run_record_collapses_and_censoring():
    args = _args("--steps", "6", "--last", "2", "--gain", "0.1")
    rec = learn.run_record(args, _steps([0.3, 0.35, 0.42, 0.45, 0.44, 0.46]), 0)
    assert rec["ok"] and not rec["collapsed"] and rec["steps_to_target"] == 3 == rec["steps_to_target_c"]
    assert rec["final_reward"] == pytest.approx(0.45) and rec["mean_reward"] == pytest.approx(2.42 / 6)
    assert rec["grad_norm_mean"] == pytest.approx(4.5) and rec["grad_norm_sd"] == pytest.approx(
        statistics.pstdev(range(2, 8))
    )
    # learned, then lost it: final (last 2) 0.1+ below the best 2-step mean
    dropped = learn.run_record(args, _steps([0.3, 0.5, 0.52, 0.45, 0.38, 0.38]), 0)
    assert dropped["collapse"] == "drop" and dropped["steps_to_target"] == 2
    flat = learn.run_record(args, _steps([0.3] * 6), 0)
    assert not flat["collapsed"] and flat["steps_to_target"] is None and flat["steps_to_target_c"] == 7
    bad = _steps([0.3] * 6)
    bad[4]["actor/grad_norm"] = math.inf
    assert learn.run_record(args, bad, 0)["collapse"] == "non-finite"
    assert learn.run_record(args, _steps([0.3] * 5), 0)["collapse"] == "failed"  # a step missing
    assert learn.run_record(args, _steps([0.3] * 6), 1)["collapse"] == "failed"
    # verl's mismatch diagnostics are carried when it logs them
    diag = learn.run_record(args, _steps([0.3] * 6, **{"rollout_corr/kl": 0.02}), 0)
    assert diag["rollout_corr/kl"] == pytest.approx(0.02)


def test_mean_interval_is_the_t_interval():
    assert mean_interval([0.5, 0.5, 0.5]) == (0.5, 0.5, 0.5)
    assert all(math.isnan(v) for v in mean_interval([]))
    rng = random.Random(0)
    x = [rng.gauss(1.0, 2.0) for _ in range(400)]
    mean, low, high = mean_interval(x)
    assert mean == pytest.approx(statistics.fmean(x))
    half = 1.96 * statistics.stdev(x) / math.sqrt(len(x))  # the normal-theory half-width
    assert (high - low) / 2 == pytest.approx(half, rel=0.1) and low < mean < high


def test_paired_comparisons_by_hand():
    args = _args("--tasks", "speech", "--losses", "grpo", "gspo", "--seeds", "4", "--bypass")
    cells = [Cell(96, "none", 1), Cell(96, "0.2", 1)]
    # grpo loses 0.1 with noise, gspo nothing; gspo is 0.05 below grpo without noise; seeds shift all alike
    final = {("L96/none/U1", "grpo"): 0.5, ("L96/none/U1", "gspo"): 0.45, ("L96/0.2/U1", "grpo"): 0.4}
    final[("L96/0.2/U1", "gspo")] = 0.45
    runs = [
        {"task": "speech", "cell": c, "loss": loss, "seed": s, "ok": True, "final_reward": v + 0.1 * s}
        | {"mean_reward": v, "steps_to_target_c": 3, "collapsed": False}
        for (c, loss), v in final.items()
        for s in range(4)
    ]
    rows = {(r["cell"], r["comparison"], r["loss"], r["metric"]): r for r in learn.compare(args, cells, runs)}
    vs = rows[("L96/none/U1", "vs_grpo", "gspo", "final_reward")]
    assert vs["diff"] == pytest.approx(-0.05) and vs["low"] == pytest.approx(-0.05) and vs["interval_excludes_0"]
    assert rows[("L96/0.2/U1", "vs_no_mismatch", "grpo", "final_reward")]["diff"] == pytest.approx(-0.1)
    assert not rows[("L96/0.2/U1", "vs_no_mismatch", "gspo", "final_reward")]["interval_excludes_0"]
    did = rows[("L96/0.2/U1", "degradation_vs_grpo", "gspo", "final_reward")]
    assert did["diff"] == pytest.approx(0.1) and did["interval_excludes_0"]
    assert not rows[("L96/none/U1", "vs_grpo", "gspo", "steps_to_target_c")]["interval_excludes_0"]
    summary = learn.summarise(
        args,
        cells,
        [
            r
            | {
                "steps_to_target": 3,
                "s_per_step": 1.0,
                "mean_clipfrac": 0.0,
                "grad_norm_mean": 1.0,
                "grad_norm_sd": 0.0,
            }
            for r in runs
        ],
    )
    lines = learn.statements(args, cells, summary, learn.compare(args, cells, runs))
    assert "gspo +0.100" in lines[1] and "grpo -0.100" in lines[1]


def test_runs_round_trip_through_csv_for_resume(tmp_path):
    from maspo_verl.lab.engine.common import write_csv

    args = _args("--steps", "3", "--last", "1")
    key = {"task": "speech", "cell": "L12/0.2/U1", "length": 12, "mismatch": "0.2", "updates": 1, "loss": "gspo"}
    runs = [
        key | {"seed": 0} | learn.run_record(args, _steps([0.3, 0.5, 0.5], **{"rollout_corr/kl": 0.1}), 0),
        key | {"seed": 1} | learn.run_record(args, _steps([0.3, 0.3]), None),
    ]
    runs = [r | {"wall_s": 60.0} for r in runs]
    write_csv(tmp_path / "runs.csv", runs)
    back = learn.load_rows(tmp_path / "runs.csv")
    for row, original in zip(back, runs, strict=True):
        for k, v in original.items():
            assert row[k] == v or (v != v and row[k] != row[k]), k
    assert (
        back[1]["exit_code"] is None and back[1]["steps_to_target"] is None and math.isnan(back[1]["rollout_corr/kl"])
    )


def test_turns_tasks_select_the_local_multi_turn_task(tmp_path):
    """``turns<N>``: the cell's length is the tokens of each of N turns; the run gets the local mode's
    task (its data, lengths, agent loop and reward), none of the text/speech tasks' data or manager."""
    from maspo_verl.local import turns
    from maspo_verl.local.tasks import prepare_task
    from tests.helpers import compose_config

    assert [lt.turns_of(t) for t in ("turns2", "turns24", "turns", "turns0", "turnsx", "text")] == [
        2, 24, None, None, None, None,
    ]  # fmt: skip
    assert lt.known("turns8") and lt.known("speech") and not lt.known("turns0")
    data = lt.write_dataset(tmp_path / "unused", "turns8", seed=3, length=12)
    assert not (tmp_path / "unused").exists()
    ov = learn.overrides_for(_args("--bypass"), "turns8", "grpo", 3, data, Cell(12, "0.2", 1))
    assert {"task=turns", "maspo.turns=8", "maspo.turn_tokens=12", "maspo.local_seed=3"} <= set(ov)
    assert not [o for o in ov if o.startswith(("data.train_files", "data.max_", "reward.reward_manager"))]
    config = compose_config("local=cpu", f"maspo.local_cache_dir={tmp_path}", *ov)
    prepare_task(config)
    assert config.data.max_response_length == turns.response_length(8, 12) == 8 * 12 + 7 * 14
    assert "seed3-n8-t12" in config.data.train_files
    with pytest.raises(SystemExit, match=r"unknown \['turns0'\]"):
        learn.run(_args("--tasks", "turns0", "--out", str(tmp_path / "out")), [])


def test_a_run_that_logged_no_step_is_recorded_as_failed():
    """A run that died before its first step (no metrics) is a failed record, not a crash of the benchmark."""
    import argparse

    from maspo_verl.lab.studies.learn import run_record

    args = argparse.Namespace(steps=15, last=3, target=None, gain=0.1)
    record = run_record(args, {}, 1)
    assert record["ok"] is False and record["steps"] == 0 and record["exit_code"] == 1


def test_a_run_does_not_inherit_an_earlier_runs_tracking_paths(tmp_path, monkeypatch):
    """The local mode sets VERL_FILE_LOGGER_PATH & co. in its driver; a run started later from that process
    (a test, the lab) writes its files into its own run folder, not a stale (perhaps removed) one."""
    from maspo_verl.lab.engine import runs

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "gone" / "metrics.jsonl"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "gone"))
    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, env, **kwargs):
        seen.update(env)
        raise Stop

    monkeypatch.setattr(runs.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        runs.run_local(["loss=grpo"], tmp_path / "run", own_ray_dir=False)
    assert "VERL_FILE_LOGGER_PATH" not in seen and "TENSORBOARD_DIR" not in seen


def test_a_run_records_the_cpu_time_of_its_process_tree(tmp_path, monkeypatch):
    """``run_local``'s ``cpu_s`` counts a descendant its parent never reaps (as Ray's workers are not reaped by the
    trainer): here a child that burns 1.2 CPU-s, seen exited but left unreaped (the kernel's count of reaped
    children would miss it)."""
    import sys

    from maspo_verl.lab.engine import runs

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.2:\n    pass"
    script = (
        f"import os, subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', {burn!r}]); "
        "os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT); time.sleep(1.5); os._exit(0)"
    )
    monkeypatch.setattr(runs, "local_command", lambda overrides, run_dir, ray_dir=None: [sys.executable, "-c", script])
    result = runs.run_local([], tmp_path / "run")
    assert result.returncode == 0 and 1.2 <= result.cpu_s < 1.2 + 1.0


def test_bands_scale_a_presets_clip_as_the_tuned_grid_does():
    """grpo's ratio band 0.2 x 4; maspo_fixed's log-space band 0.2 x 16; inf opens gspo's band."""
    assert learn.band_overrides("grpo", "4") == [
        "actor_rollout_ref.actor.clip_ratio_low=0.8",
        "actor_rollout_ref.actor.clip_ratio_high=0.8",
    ]
    assert learn.band_overrides("maspo_fixed", "16") == [
        "actor_rollout_ref.actor.policy_loss.log_clip_low=3.2",
        "actor_rollout_ref.actor.policy_loss.log_clip_high=3.2",
    ]
    assert "actor_rollout_ref.actor.clip_ratio_high=1000000000.0" in learn.band_overrides("gspo", "inf")
    assert learn.parse_bands(["grpo=4", "gspo=inf"]) == {"grpo": "4", "gspo": "inf"}
    for bad in (["grpo"], ["grpo=0"], ["grpo=x"], ["chess=4"], ["grpo=4", "grpo=16"]):
        with pytest.raises(SystemExit, match=r"--bands .* allowed PRESET=WIDTH"):
            learn.parse_bands(bad)
    assert learn.loss_overrides("maspo_fixed", adjust=False) == ["loss=maspo_fixed"]
    assert learn.loss_overrides("maspo_fixed")[1:] == learn.ADJUSTMENTS["maspo_fixed"]


def test_a_variant_runs_with_its_fields_and_band_in_hydras_grammar():
    """``PRESET@field=value`` (as lab regimes_tuned takes it): every override of its run parses as Hydra parses
    the command line (the run name too: no ``@``/``=``), composes to the variant's fields at the band given for
    it, and a misspelt field is refused at start naming --losses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tests.helpers import compose_config

    loss = "maspo_adaptive@adaptive_criterion=correlation,adaptive_max_len=16"
    learn.check_losses([loss])
    args = _args("--bands", f"{loss}=4", "--losses", loss)
    data = {"train": "t.parquet", "val": "v.parquet", "sentence": "ka lo mi nu"}
    ov = learn.overrides_for(args, "speech", loss, 3, data, Cell(96, "none", 4))
    OverridesParser.create().parse_overrides(ov)
    policy_loss = compose_config(*learn.loss_overrides(loss, learn.parse_bands([f"{loss}=4"]))).actor_rollout_ref
    policy_loss = policy_loss.actor.policy_loss
    assert (policy_loss.adaptive_criterion, policy_loss.adaptive_max_len) == ("correlation", 16)
    assert policy_loss.log_clip_low == pytest.approx(0.8) and policy_loss.segment_rule == "adaptive"
    with pytest.raises(SystemExit, match="--losses 'maspo_fixed@segment_windw=4'.*segment_window"):
        learn.check_losses(["maspo_fixed@segment_windw=4"])


def test_a_preset_added_with_resume_joins_the_study(tmp_path, monkeypatch):
    """``--losses X --resume`` runs X for the seeds already run and summarises it beside the losses run before
    (the earlier runs are not run again); each run records its band."""
    import tempfile

    from maspo_verl.lab.engine.runs import LocalRun

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # lab learn's logs folders: not left in /tmp
    calls = []

    def fake_run(overrides, run_dir, timeout_s=900):
        loss = next(o for o in overrides if o.startswith("loss=")).removeprefix("loss=")
        seed = int(next(o for o in overrides if o.startswith("data.seed=")).removeprefix("data.seed="))
        calls.append((loss, seed))
        rewards = [0.3, 0.4 + 0.01 * seed + (0.05 if loss == "gspo" else 0.0)]
        return LocalRun(0, "", 1.0, Path(run_dir), _steps(rewards))

    monkeypatch.setattr(learn, "run_local", fake_run)
    out = str(tmp_path / "out")
    first = ["--tasks", "speech", "--steps", "2", "--last", "1", "--seeds", "2", "--out", out]
    learn.run(_args(*first, "--losses", "grpo", "--bands", "grpo=4"), [])
    assert calls == [("grpo", 0), ("grpo", 1)]
    args = _args(*first, "--losses", "gspo", "--resume")
    learn.run(args, [])
    assert calls[2:] == [("gspo", 0), ("gspo", 1)] and args.losses == ["grpo", "gspo"]
    runs = learn.load_rows(Path(out) / "learn_runs.csv")
    assert [(r["loss"], r["band"]) for r in runs] == [("grpo", "4")] * 2 + [("gspo", "shipped")] * 2
    gap = [c for c in learn.compare(args, learn.cells_of(args), runs) if c["loss"] == "gspo"]
    assert gap and gap[0]["vs"] == "grpo" and gap[0]["diff"] == pytest.approx(0.05)
    readme = (Path(out) / "README.md").read_text()
    assert "| speech | L12/none/U2 | 1 | 0.300 -> 0.410 | 0.300 -> 0.460 |" in readme  # per seed, both losses
    assert "`grpo`'s clip band x 4 (`clip_ratio_low=0.8 clip_ratio_high=0.8`)" in readme


@pytest.mark.parametrize("fails", [False, True], ids=["all_ran", "one_failed"])
def test_run_folders_are_removed_unless_a_run_failed(tmp_path, monkeypatch, capsys, fails):
    """lab learn's run folders (the trainer's logs, the task data) leave nothing in the temp folder when every run
    ran; when one failed they all stay, and the log names them."""
    import tempfile

    from maspo_verl.lab.engine.runs import LocalRun

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))

    def fake_run(overrides, run_dir, timeout_s=900):
        Path(run_dir).mkdir(parents=True)
        (Path(run_dir) / "console.log").write_text("a trainer's log")
        code = 1 if fails and "loss=gspo" in overrides else 0
        return LocalRun(code, "", 1.0, Path(run_dir), _steps([0.3, 0.4]))

    monkeypatch.setattr(learn, "run_local", fake_run)
    out = str(tmp_path / "out")
    learn.run(
        _args(
            "--tasks", "speech", "--steps", "2", "--last", "1", "--seeds", "1", "--losses", "grpo", "gspo", "--out", out
        ),
        [],
    )
    left = list((tmp_path / "tmp").iterdir())
    console = capsys.readouterr()
    named = re.findall(rf"{re.escape(str(tmp_path / 'tmp'))}[^\s,)]*", console.out + console.err)
    assert all(Path(p).exists() for p in named), f"the console names folders that are gone: {named}"
    summary = (Path(out) / "learn_summary.csv").read_text() + (Path(out) / "README.md").read_text()
    assert "nan, nan" not in summary and "0.400 (1 seed: no interval)" in summary  # one seed: no interval, said
    if not fails:
        assert "final reward vs grpo: no interval (1 seed; an interval needs 2)" in summary
        assert left == [] and named == []
        return
    assert len(left) == 1 and left[0].name.startswith("maspo_learn_logs_")
    failed = [p for p in left[0].iterdir() if "gspo" in p.name]
    assert len(failed) == 1 and (failed[0] / "console.log").exists()
    assert f"run folders kept in {left[0]} (failed: {failed[0]})" in console.err


def test_each_run_records_its_warm_models_fingerprint_from_the_trainers_metric(tmp_path, monkeypatch):
    """A trainer run whose steps carry the warm model's fingerprint (``speechwarm.FINGERPRINT_METRIC``) has it in
    learn_runs.csv, read back as the hex text it is (all digits here: not a number); a run without the metric has
    none; a run whose steps name two models has both (it pairs with neither)."""
    import tempfile

    from maspo_verl.lab.engine import stats
    from maspo_verl.lab.engine.runs import LocalRun
    from maspo_verl.local import speechwarm

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    metric = speechwarm.FINGERPRINT_METRIC
    one, other = float(int("000000012345", 16)), float(int("abcdef012345", 16))
    per_seed = {0: ({metric: one}, {metric: one}), 1: ({}, {}), 2: ({metric: one}, {metric: other})}

    def fake_run(overrides, run_dir, timeout_s=900):
        seed = int(next(o for o in overrides if o.startswith("data.seed=")).removeprefix("data.seed="))
        steps = _steps([0.3, 0.4])
        for s, extra in zip(sorted(steps), per_seed[seed], strict=True):
            steps[s] |= extra
        return LocalRun(0, "", 1.0, Path(run_dir), steps)

    monkeypatch.setattr(learn, "run_local", fake_run)
    out = tmp_path / "out"
    learn.run(_args("--tasks", "speech", "--steps", "2", "--last", "1", "--seeds", "3", "--losses", "grpo",
                    "--out", str(out)), [])  # fmt: skip
    runs = learn.load_rows(out / "learn_runs.csv")
    assert [r[stats.FINGERPRINT] for r in runs] == ["000000012345", "", "000000012345+abcdef012345"]
    assert [stats.fingerprint_of(r) for r in runs] == ["000000012345", "", "000000012345+abcdef012345"]
