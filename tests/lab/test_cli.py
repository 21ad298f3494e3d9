"""The three lab commands run end to end on tiny settings and leave their outputs."""

import csv

import pytest

from maspo_verl.lab.__main__ import main
from maspo_verl.util import preset_names


def test_estimators_command(tmp_path):
    main(["estimators", "--out", str(tmp_path), "--lengths", "2,3", "--drifts", "0.2,0.5"])
    for name in [
        "README.md",
        "COMMAND.txt",
        "estimators.csv",
        "cases.csv",
        "bias_vs_length.png",
        "variance_vs_drift.png",
    ]:
        assert (tmp_path / name).exists(), name
    assert "estimators --out" in (tmp_path / "COMMAND.txt").read_text()
    # the verdict on claim 1 (cumprod unbiased for the prefix-corrected gradient) is derived from the
    # measured bias, which is float64 round-off here
    assert "gradient' -- HOLDS.**" in (tmp_path / "README.md").read_text()


def test_estimator_verdicts_follow_the_numbers():
    from maspo_verl.lab.studies.estimators import claim_verdicts

    claims = {"cum_pc_bias_max": 1e-14, "cum_var_lower_count": 59, "n_cases": 60, "cum_true_bias_max": 0.39}
    assert claim_verdicts(claims) == {1: "HOLDS", 2: "holds in 59 of 60 cases", 3: "DOES NOT HOLD"}
    claims.update(cum_pc_bias_max=0.01, cum_var_lower_count=60, cum_true_bias_max=0.0)
    assert claim_verdicts(claims) == {1: "DOES NOT HOLD", 2: "HOLDS in every case", 3: "HOLDS"}


def test_race_command(tmp_path):
    main(
        [
            "race",
            "--out",
            str(tmp_path),
            "--seeds",
            "1",
            "--steps",
            "2",
            "--length",
            "8",
            "--groups",
            "2",
            "--group-size",
            "4",
            "--epochs",
            "1",
            "--minibatches",
            "1",
        ]
    )
    for name in ["README.md", "COMMAND.txt", "race_runs.csv", "race_curves.csv", "race_summary.csv", "race_reward.png"]:
        assert (tmp_path / name).exists(), name


def surrogate_rows_cover_every_surrogate_and_token_set(rows) -> None:
    """Each surrogate other than ppo has a ``<preset>+<surrogate>`` row on each of our token sets."""
    from maspo_verl.core.surrogates import DEFAULT, SURROGATES
    from maspo_verl.core.token_sets import TOKEN_SETS

    others = [s for s in SURROGATES if s != DEFAULT]
    assert others
    for surrogate in others:
        assert {r["loss_mode"] for r in rows if r["loss"].endswith("+" + surrogate)} == set(TOKEN_SETS)


def test_bench_command(tmp_path):
    main(["bench", "--out", str(tmp_path), "--B", "4", "--T", "64", "--reps", "1", "--warmup", "0", "--no-profile"])
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    # every shipped preset, grpo (verl's vanilla) first, then the surrogate rows
    presets = set(preset_names())
    assert {r["loss"] for r in rows if "+" not in r["loss"]} == presets and rows[0]["loss"] == "grpo"
    surrogate_rows_cover_every_surrogate_and_token_set(rows)
    # verl's losses: 3 .item(); ours: exactly one host transfer per call (the metrics)
    verl = [r for r in rows if r["loss_mode"] in ("vanilla", "gspo")]
    assert {r["loss"] for r in verl} == {"grpo", "gspo"} and all(r["host_syncs"] == "3" for r in verl)
    ours = [r for r in rows if r["loss_mode"] not in ("vanilla", "gspo")]
    assert ours and all(r["host_syncs"] == "1" for r in ours)


def test_bench_update_mode(tmp_path):
    """The loss's share of an actor update: a row per preset and surrogate row, the share in (0, 1)."""
    sizes = ["--update-batch", "2", "--prompt-len", "8", "--response-len", "48", "--reps", "2", "--warmup", "0"]
    main(["bench", "--mode", "update", "--out", str(tmp_path), "--devices", "cpu", *sizes])
    with open(tmp_path / "update_share.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["loss"] for r in rows if "+" not in r["loss"]} == set(preset_names()) and rows[0]["loss"] == "grpo"
    surrogate_rows_cover_every_surrogate_and_token_set(rows)
    assert float(rows[0]["x_grpo"]) == 1.0
    for r in rows:
        assert 0.0 < float(r["loss_share"]) < 1.0, r
        assert 0.0 < float(r["loss_ms"]) < float(r["update_ms"]), r
    assert "B=2, 8+48 tokens" in (tmp_path / "README.md").read_text()


def test_steptime_reads_verl_metrics_file(tmp_path, monkeypatch):
    """Step times from the run folder's metrics.jsonl as verl's own file logger writes it."""
    from verl.utils.tracking import FileLogger

    from maspo_verl.lab.engine import runs
    from maspo_verl.lab.studies import steptime

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / runs.METRICS_FILE))
    logger = FileLogger("p", "e")
    for step, seconds in ((1, 20.0), (2, 2.0), (3, 4.0)):
        logger.log({"actor/pg_loss": 0.5, "timing_s/gen": 3.0, "timing_s/step": seconds, "note": "x"}, step=step)
    logger.log({"val-core/acc": 1.0}, step=4)  # a step without a step time
    logger.finish()
    times = steptime.step_times(runs.read_metrics(tmp_path, log_text="step:1 - timing_s/step:99.0"))
    assert times == {1: 20.0, 2: 2.0, 3: 4.0}  # the file, not the console
    assert steptime.step_times(runs.read_metrics(tmp_path / "none", "step:1 - timing_s/step:99.0")) == {1: 99.0}
    rows = [{"preset": "grpo", "step": s, "timing_s_step": t} for s, t in times.items()]
    rows += [{"preset": "ctpo", "step": s, "timing_s_step": 2 * t} for s, t in times.items()]
    table = {r["preset"]: r for r in steptime.summarise_steps(rows, "grpo")}
    assert table["grpo"]["median_s"] == 3.0 and table["grpo"]["steps"] == 2  # step 1 left out
    assert table["ctpo"]["x_grpo_median"] == 2.0 and table["ctpo"]["x_grpo_min"] == 2.0


def test_steptime_presets_are_the_loss_presets():
    from maspo_verl.lab.studies import steptime

    assert steptime.presets_of("", "grpo") == ["grpo", *(p for p in preset_names() if p != "grpo")]
    assert steptime.presets_of("ctpo,grpo,ctpo", "grpo") == ["grpo", "ctpo"]
    with pytest.raises(SystemExit, match=r"--presets: unknown \['maspo_delimiters'\]; allowed \['ctpo'"):
        steptime.presets_of("ctpo,maspo_delimiters", "grpo")


TINY_BENCH = ["--B", "4", "--T", "64", "--reps", "1", "--warmup", "0", "--no-profile", "--only", "grpo"]


def test_default_output_is_a_scratch_folder(tmp_path, monkeypatch, capsys):
    """Without --out or --update-docs nothing committed is touched: the results go to outputs/lab/<command>/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "results" / "bench").mkdir(parents=True)
    main(["bench", *TINY_BENCH])
    out = tmp_path / "outputs" / "lab" / "bench"
    assert (out / "bench.csv").exists()
    assert (out / "COMMAND.txt").read_text().startswith("python -m maspo_verl.lab bench --B 4 ")
    assert not any((tmp_path / "docs" / "results" / "bench").iterdir())
    # on the console the report's title and where the files are; the whole output in lab.log
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [
        f"Loss benchmark: {out / 'README.md'}",
        f"results: {out}/ (COMMAND.txt, README.md, bench.csv, lab.log)",
    ]
    assert "bench: cpu T=64 fp32 done" in (out / "lab.log").read_text()
    assert "| 64 | grpo |" in (out / "README.md").read_text()
    # --mode update: a folder of its own, bench's files untouched
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    sizes = ["--update-batch", "2", "--prompt-len", "8", "--response-len", "16", "--reps", "1", "--warmup", "0"]
    main(["bench", "--mode", "update", "--only", "grpo", "--devices", "cpu", *sizes])
    assert (tmp_path / "outputs" / "lab" / "update_share" / "update_share.csv").exists()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_update_docs_writes_the_committed_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:  # not a checkout's root: no docs/results/ here
        main(["bench", "--update-docs", *TINY_BENCH])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):  # one destination only
        main(["bench", "--update-docs", "--out", str(tmp_path / "x"), *TINY_BENCH])
    (tmp_path / "docs" / "results").mkdir(parents=True)
    main(["bench", "--update-docs", *TINY_BENCH])
    command = (tmp_path / "docs" / "results" / "bench" / "COMMAND.txt").read_text().splitlines()[0]
    assert command == "python -m maspo_verl.lab bench --update-docs " + " ".join(TINY_BENCH)
    assert not (tmp_path / "outputs").exists()


def test_studies_declare_their_design_once():
    """A study's registered cells and seeds are its STUDY's (engine/study.py checks each cell's grammar and that no
    tuning seed is held out); the code reads them from there, and no two studies share a registered seed."""
    from dataclasses import replace

    from maspo_verl.lab.engine import protocol
    from maspo_verl.lab.engine.study import Study, studies
    from maspo_verl.lab.studies import granularity, granularity_vllm, granularity_warm

    declared = {name: m.STUDY for name, m in studies().items() if m.STUDY.tune_seeds or m.STUDY.held_seeds}
    assert {"granularity", "granularity_warm", "granularity_vllm"} <= set(declared)
    seen: dict[int, str] = {}
    for name, s in declared.items():
        for seed in (*s.tune_seeds, *s.held_seeds):
            assert seen.setdefault(seed, name) == name, f"seed {seed}: {seen[seed]} and {name}"
    assert granularity.STUDY.folder == protocol.PART1_FOLDER  # where parts 2 and 4 and margins read part 1
    assert granularity.part1().cells == granularity.STUDY.cells and granularity.part1().held_seeds == tuple(
        range(30000, 30064)
    )
    assert granularity_warm.CELL == "L96/stale2/U4" and granularity_warm.HELD_SEEDS == granularity_warm.STUDY.held_seeds
    assert granularity_vllm.TUNE_SEEDS == (400, 401)
    with pytest.raises(SystemExit, match="--cells"):
        Study("x", "y", cells=("96/stale2",))
    with pytest.raises(ValueError, match="overlap"):
        replace(granularity.STUDY, tune_seeds=(30000,))
