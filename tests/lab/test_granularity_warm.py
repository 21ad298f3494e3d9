"""Part 2 of the registered granularity study (``maspo_verl.lab.studies.granularity_warm``): its pieces, the lab learn
command each one is (parsed by the lab CLI's own parser), the choice written before the held-out seeds, resuming,
and the shared tests and decisions on planted results, with a fake trainer run behind the real ``lab learn``."""

from __future__ import annotations

import csv
import math
import random
import tempfile
import zlib
from pathlib import Path

import pytest

from maspo_verl import choosing
from maspo_verl.lab.__main__ import main, parse
from maspo_verl.lab.engine import protocol as g
from maspo_verl.lab.engine.learn_engine import EngineRun
from maspo_verl.lab.engine.pieces import PIECES, piece_rows
from maspo_verl.lab.engine.presets import LOG_UNCLIPPED, RATIO_UNCLIPPED, UNCLIPPED
from maspo_verl.lab.engine.runs import LocalRun
from maspo_verl.lab.studies import granularity_warm as gw
from maspo_verl.lab.studies import learn
from maspo_verl.local import ENGINE_LINE, ENGINE_WORDS
from tests.lab.conftest import fake_learn_runs

W = {w: f"{g.FIXED}{w}" for w in gw.WINDOWS}
BAND, CORRELATION = g.ADAPTIVE

# the planted study: each arm's best learning rate (W = 2 at the lowest: not bracketed below), its KL per update
# (lr x K: W = 8's matched-KL lr is 3e-3, W = 96's its chosen one), +0.1 for W = 24 and the correlation criterion
# wherever clipped (H1's planted gain, H2's alignment, H3's "holds"); unclipped every arm alike
BEST = {W[1]: "1e-3", W[2]: "1e-4"}
K = {W[8]: 10**-0.5, W[96]: 10 / 3}
GAIN = {W[24]: 0.1, CORRELATION: 0.1}
TAIL = (-0.02, -0.01, 0.0, 0.01, 0.02)  # the last 5 steps around the final reward (their last 3 are not)


def planted(arm: str, lr: float, unclipped: bool, seed: int) -> float:
    noise = random.Random(zlib.crc32(f"{arm} {lr} {unclipped} {seed}".encode())).gauss(0, 0.004)
    peak = math.log10(float(BEST.get(arm, "3e-4")))
    return 0.5 - 0.1 * abs(math.log10(lr) - peak) + (0.0 if unclipped else GAIN.get(arm, 0.0)) + noise


def _value(overrides: list[str], key: str) -> str:
    return next(o.partition("=")[2] for o in overrides if o.startswith(key + "="))


class FakeTrainer:
    """``learn_engine.run`` (``engine``) and ``learn.run_local`` (the trainer, ``__call__``): steps whose last 5
    average to ``planted`` (the trainer's off by ``TRAINER_OFF``), KL per update lr x K; calls recorded. ``build``:
    the warm models' build the runs start from (its step-1 reward 0.2 + 0.01 x build; each build after the first
    adds ``BUILD_GAIN`` to the final reward)."""

    TRAINER_OFF = 0.002
    BUILD_GAIN = 0.05
    build = 1

    def __init__(self):
        self.calls, self.trainer_calls = [], []

    def steps(self, overrides, calls, off=0.0):
        seed, lr = int(_value(overrides, "data.seed")), float(_value(overrides, "actor_rollout_ref.actor.optim.lr"))
        name = _value(overrides, "trainer.experiment_name")
        (arm,) = [a for a in gw.ARMS if learn.slug(f"learn_{gw.TASK}_{a}_{seed}_{gw.CELL}") == name]
        unclipped = "actor_rollout_ref.actor.clip_ratio_c=1000000000.0" in overrides
        assert "algorithm.rollout_correction.bypass_mode=true" in overrides
        calls.append((arm, lr, unclipped, seed))
        final = planted(arm, lr, unclipped, seed) + off * (1 if seed % 2 else -0.5) + self.BUILD_GAIN * (self.build - 1)
        steps = int(_value(overrides, "trainer.total_training_steps"))
        curve = ([0.2 + 0.01 * self.build] * steps + [final + t for t in TAIL])[-steps:]
        kl = lr * K.get(arm, 1.0)
        return {i: {"critic/score/mean": r, "actor/ppo_kl": kl, "actor/pg_loss": 0.1, "actor/grad_norm": 1.0}
                for i, r in enumerate(curve, 1)}  # fmt: skip

    def engine(self, overrides, run_dir, sentence, task):
        assert task == gw.TASK and sentence
        return EngineRun(0, self.steps(overrides, self.calls), 1.0, 2.0, "", Path(run_dir))

    def __call__(self, overrides, run_dir, timeout_s=900):
        assert timeout_s == 1800
        steps = self.steps(overrides, self.trainer_calls, self.TRAINER_OFF)
        return LocalRun(0, f"{ENGINE_LINE}{ENGINE_WORDS['hf']}", 1.0, Path(run_dir), steps, cpu_s=2.0)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    trainer = fake_learn_runs(monkeypatch, tmp_path, FakeTrainer())
    monkeypatch.setattr(learn.learn_engine, "run", trainer.engine)
    # the runs in this process, where the fakes are (--workers 2 would start fresh ones: test_learn_engine.py)
    monkeypatch.setattr(learn, "results_of", lambda a, jobs: ((j, learn.run_job(j, a.engine, a.timeout)) for j in jobs))
    data = {"train": "t.parquet", "val": "v.parquet", "sentence": "ka lo mi nu", "model": "m"}
    monkeypatch.setattr(learn, "task_data", lambda folder, task, seed, length: data)
    return trainer


def _choice(best=None, kl=None) -> list[dict]:
    best, kl = best or {}, kl or {}
    return [
        {"cell": gw.CELL, "loss": a, "best_band": best.get(a, "3e-4"), "kl_band": kl.get(a, ""), "tune_final": 0.5}
        for a in gw.ARMS
    ]


def test_the_pieces_are_the_registered_ones():
    tune = gw.tuning_pieces(gw.part2())
    assert len(tune) == 8 * 4 and {(p.arm, p.lr) for p in tune} == {(a, lr) for a in gw.ARMS for lr in gw.LRS}
    assert {p.seeds for p in tune} == {(200, 201, 202, 203)} and not any(p.unclipped for p in tune)
    assert len({p.name for p in tune}) == len(tune)
    # the matched-KL lr: W = 2 and W = 8 differ from their chosen one, W = 24 equals it, W = 96 has none
    every = gw.held_pieces(_choice({W[2]: "1e-4"}, {W[1]: "3e-4", W[2]: "1e-3", W[8]: "3e-3", W[24]: "3e-4"}))
    assert {p.seeds for p in every} == {tuple(range(300, 312))} and len({p.name for p in every}) == len(every)
    # the trainer's confirmation last: W = 1 and W = whole at their chosen lrs, then the engine's runs of them again
    held, confirm, again = every[:-4], every[-4:-2], every[-2:]
    assert [(p.arm, p.lr, p.trainer, p.unclipped) for p in confirm] == [(W[1], "3e-4", 1, 0), (W[96], "3e-4", 1, 0)]
    assert [(p.arm, p.lr, p.trainer, p.unclipped, p.again) for p in again] == [
        (W[1], "3e-4", 0, 0, 1), (W[96], "3e-4", 0, 0, 1),
    ]  # fmt: skip
    assert [p.name for p in again] == ["held_W_1_lr3e-4_again", "held_W_96_lr3e-4_again"]
    assert [p.setting for p in again] == ["3e-4", "3e-4"]  # the registered pieces' setting: the same runs
    assert not any(p.trainer or p.again for p in held)
    chosen = [(p.arm, p.lr) for p in held if not p.unclipped][: len(gw.ARMS)]
    assert chosen == [(a, "1e-4" if a == W[2] else "3e-4") for a in gw.ARMS]
    assert [(p.arm, p.lr) for p in held if not p.unclipped][len(gw.ARMS) :] == [(W[2], "1e-3"), (W[8], "3e-3")]
    unclipped = [p.arm for p in held if p.unclipped]
    assert sorted(unclipped) == sorted(gw.ARMS) and unclipped[-3:] == [BAND, CORRELATION, gw.OFFSET]  # untested last
    assert len(held) == 8 + 8 + 2
    assert not [p for p in gw.held_pieces([c for c in _choice() if c["loss"] != W[96]]) if p.arm == W[96]]
    # every piece a registered test reads comes before every one none reads, the trainer's after the engine's
    read = {(arm, setting) for _, _, *arms in g.comparisons(_choice(), gw.design()) for arm, setting in arms}
    tested = [(p.arm, p.setting) in read for p in gw.held_pieces(_choice())[:-4]]
    assert tested == sorted(tested, reverse=True) and tested.count(False) == 3


def test_each_piece_is_a_lab_learn_command_its_parser_takes(tmp_path):
    """Parsed by the lab CLI's own parser (a flag renamed in lab learn fails here): the registered command, the
    arm, lr and seeds of the piece; unclipped pieces open the arm's band and dual clip (checked composed)."""
    from tests.helpers import compose_config

    choice = _choice({W[1]: "1e-3"}, {W[8]: "3e-3"})
    for piece in gw.tuning_pieces(gw.part2()) + gw.held_pieces(choice):
        args = parse(piece.argv(tmp_path, gw.LEARN))
        assert args.module is learn and args.out == str(tmp_path / PIECES / piece.name)
        assert (args.tasks, args.steps, args.last, args.lr) == (["speechwarm"], 20, 5, float(piece.lr))
        assert args.bypass and args.fp32_trainer and args.no_adjust and args.losses == [piece.arm]
        assert (args.engine, args.workers) == (("trainer", 1) if piece.trainer else ("lab", 2))
        assert list(range(args.first_seed, args.first_seed + args.seeds)) == list(piece.seeds)
        assert [c.label for c in learn.cells_of(args)] == [gw.CELL]
        learn.check_losses(args.losses)
        assert learn.parse_bands(args.bands) == ({piece.arm: UNCLIPPED} if piece.unclipped else {})
    for arm in gw.ARMS:
        ov = learn.loss_overrides(arm, {arm: UNCLIPPED}, adjust=False)
        actor = compose_config("local=cpu", *ov).actor_rollout_ref.actor
        for key in ("log_clip_low", "log_clip_high", "log_clip_dual"):
            assert actor.policy_loss[key] == LOG_UNCLIPPED, (arm, key)
        assert actor.clip_ratio_c == RATIO_UNCLIPPED and actor.policy_loss.clip_schedule == "log_adaptive"


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def guide_of(out: Path, tmp_path: Path) -> list[str]:
    """The guide's part 2 lines, read from the study folder ``out``."""
    root = tmp_path / "root"
    link = root / choosing.RESULTS / choosing.PART2
    if not link.exists():
        link.parent.mkdir(parents=True)
        link.symlink_to(out)
    return choosing.part2_lines(root)


def test_the_study_tunes_writes_its_choice_then_judges_and_resumes(tmp_path, fake):
    out = tmp_path / "warm"
    base = ["granularity", "--part", "2", "--out", str(out)]
    with pytest.raises(SystemExit, match=r"--phase held: .*choice.csv is missing.*32 pieces are done \(0 are\)"):
        main([*base, "--phase", "held"])
    assert not fake.calls and not (out / "COMMAND.txt").exists()
    with pytest.raises(SystemExit, match="--steps set part 1's engine"):
        main([*base, "--steps", "3"])

    main([*base, "--phase", "tune", "--pieces", "5"])
    assert len(fake.calls) == 5 * 4 and not (out / "choice.csv").exists()
    with pytest.raises(SystemExit, match="5 pieces on disk: add --resume"):
        main([*base, "--phase", "tune"])
    with pytest.raises(SystemExit, match=r"choice.csv is missing.*\(5 are\)"):
        main([*base, "--phase", "held", "--resume"])
    assert "Not chosen yet: 5 of 32 tuning pieces done" in (out / "README.md").read_text()

    main([*base, "--phase", "tune", "--resume"])
    assert len(fake.calls) == 32 * 4 and len(set(fake.calls)) == 128
    # the choice, by hand from the planted means: each arm's best lr; the lr whose KL is nearest W = 1's at 1e-3
    choice = {c["loss"]: c for c in _csv(out / "choice.csv")}
    assert {a: c["best_band"] for a, c in choice.items()} == {a: BEST.get(a, "3e-4") for a in gw.ARMS}
    kl = {a: c["kl_band"] for a, c in choice.items() if a in W.values()}
    assert kl == {W[1]: "1e-3", W[2]: "1e-3", W[8]: "3e-3", W[24]: "1e-3", W[96]: "3e-4"}
    mean = sum(planted(W[1], 1e-3, False, s) for s in gw.TUNE_SEEDS) / 4  # the last 5 steps' mean, not the last 3
    assert float(choice[W[1]]["tune_final"]) == pytest.approx(mean, abs=1e-12)
    readme = (out / "README.md").read_text()
    assert f"(not bracketed below): {gw.CELL} {W[2]}." in readme and "| F1a | L96/stale2/U4 |  | not run |" in readme

    # two held-out pieces (W = 1 and W = 2 at their chosen lrs): one test of F1a's four is run, and Holm counts
    # the three not run yet with p = 1
    main([*base, "--phase", "held", "--resume", "--pieces", "2"])
    (run,) = [t for t in _csv(out / "tests.csv") if t.get("seeds")]
    assert (run["family"], run["arm"], run["lr"], run["vs_lr"]) == ("F1a", W[2], "1e-4", "1e-3")
    assert float(run["p_holm"]) == pytest.approx(min(1.0, 4 * float(run["p_signflip"])))
    # every arm at its chosen lr: F1a, F2 and F3 are complete, F1b and F1c are not; the guide judges only the former
    main([*base, "--phase", "held", "--resume", "--pieces", "6"])
    lines = guide_of(out, tmp_path)
    rows = [line for line in lines if line.startswith("| F")]
    assert [r.split(" ")[1] for r in rows] == ["F1a", "F2", "F3", "F3"]
    for t in _csv(out / "tests.csv"):
        if t["family"] == "F1a":
            assert choosing._span(t) in rows[0] and f"(lr {t['lr']})" in rows[0]
    assert "(F1b, F1c: not every test run yet, no verdict)" in lines[0] and "(family C): not run yet" in lines[0]
    assert "builds exist" not in lines[0]  # one build so far
    assert (
        "The rest: `python -m maspo_verl.lab granularity --part 2 --update-docs --resume"
        in (out / "README.md").read_text()
    )
    verdicts = {(v["family"], v["arm"]): v["verdict"] for v in _csv(out / "decisions.csv")}
    assert [r.split(" | ")[2] for r in rows] == [f"**{verdicts[f, a]}**" for f, a in (("F1a", ""), ("F2", ""))] + [
        f"**{verdicts['F3', arm]}**" for arm in (BAND, CORRELATION)
    ]
    # the warm models rebuilt (another build) before the rest: a paired test pairs runs of one build, so every
    # outcome below is the one-build study's; the engine's runs of C's arms run again on the new build
    fake.build = 2
    main([*base, "--phase", "held", "--resume"])
    held = fake.calls[128:]
    assert len(held) == (8 + 8 + 3 + 2) * 12 and {s for *_, s in held} == set(gw.HELD_SEEDS)
    assert held[-24:] == [(a, best, False, s) for a, best in ((W[1], 1e-3), (W[96], 3e-4)) for s in gw.HELD_SEEDS]
    best = {a: float(BEST.get(a, "3e-4")) for a in gw.ARMS}
    assert fake.trainer_calls == [(a, best[a], False, s) for a in gw.CONFIRM_ARMS for s in gw.HELD_SEEDS]
    assert {(a, lr) for a, lr, unclipped, _ in held if not unclipped} == {
        *((a, float(BEST.get(a, "3e-4"))) for a in gw.ARMS),
        (W[2], 1e-3), (W[8], 3e-3), (W[24], 1e-3),
    }  # fmt: skip
    tests = _csv(out / "tests.csv")
    assert [t["family"] for t in tests] == ["F1a", "F1b", "F1c"] * 4 + ["F2", "F3", "F3"]
    assert all(t["seeds"] == "12" and t["signflip"] == "exact" for t in tests)
    f1b = [t for t in tests if t["family"] == "F1b"]
    assert all(t["lr"].endswith("/inf") and t["vs_lr"] == "1e-3/inf" and t["outcome"] == "within ±0.03" for t in f1b)
    f1a = {t["arm"]: t["outcome"] for t in tests if t["family"] == "F1a"}
    assert f1a == {W[2]: "within ±0.03", W[8]: "within ±0.03", W[24]: "above", W[96]: "within ±0.03"}
    verdicts = {(v["family"], v["arm"]): v["verdict"] for v in _csv(out / "decisions.csv")}
    assert verdicts == {
        ("F1a", ""): "supported", ("F1b", ""): "falsified", ("F1c", ""): "supported", ("F2", ""): "supported",
        ("F3", BAND): "falsified", ("F3", CORRELATION): "holds",
    }  # fmt: skip
    # the trainer is within 0.002 of the engine on every seed: confirmed
    confirm = _csv(out / "confirmation.csv")
    assert [(c["arm"], c["seeds"], c["equivalent"], c["different"]) for c in confirm] == [
        ("W=1, trainer", "12", "True", "False"), ("W=96, trainer", "12", "True", "False"),
        ("W=96 minus W=1, trainer", "12", "True", "False"),
    ]  # fmt: skip
    readme = (out / "README.md").read_text()
    assert "**confirmed**" in readme and "The rest:" not in readme and "Measured per run: " in readme
    lines = guide_of(out, tmp_path)
    rows = [r for r in lines if r.startswith("| F")]
    assert [r.split(" ")[1] for r in rows] == ["F1a", "F1b", "F1c", "F2", "F3", "F3"]
    assert rows[1].count("W=1 (lr 1e-3, no clip):") == 4 and "/inf" not in rows[1]  # as the part's README shows it
    assert "not every test run yet" not in lines[0]
    assert "(2 builds exist: the part's deviations)" in lines[0]
    # family C's verdict, each test as the guide gives a test with the trainer's mean beside the engine's
    assert "(family C): **confirmed**: " in lines[0]
    for c in confirm:
        means = f"(mean: trainer {float(c['trainer']):.3f}, lab engine {float(c['engine']):.3f})"
        assert f"{choosing._test_text(c)} {means}" in lines[0]
    pieces = _csv(out / "pieces.csv")
    assert len(pieces) == 32 + 23 and all(p["done"] == "True" and p["cpu_s_per_run"] == "2.0" for p in pieces)
    assert [p["build"] for p in pieces] == ["1"] * (32 + 8) + ["2"] * 15
    command = (out / "COMMAND.txt").read_text()
    assert command.count("\npiece ") == 55 and command.index("choice.csv written") < command.index("piece held_")

    # a stopped piece resumes where it stopped; a finished study runs nothing again
    piece = gw.Piece("held", W[8], "3e-4", gw.HELD_SEEDS)
    path = out / PIECES / piece.name / "learn_runs.csv"
    kept = [r for r in _csv(path) if r["seed"] != "305"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(kept[0]))
        writer.writeheader()
        writer.writerows(kept)
    main([*base, "--phase", "all", "--resume"])
    assert fake.calls[len(held) + 128 :] == [(W[8], 3e-4, False, 305)]
    main([*base, "--phase", "all", "--resume", "--pieces", "3"])
    assert len(fake.calls) == 128 + len(held) + 1


def test_the_trainers_confirmation_reads_as_registered():
    """Family C on planted final rewards: the trainer within noise of the engine (confirmed); the trainer's W = 96
    0.1 above on every seed (C2 and C3 different: contradicted); a seed missing (not run)."""
    choice = _choice({W[1]: "1e-3"})
    noise = random.Random(1)

    def rows(offset96=0.0, seeds=gw.HELD_SEEDS):
        out = []
        for arm, lr in ((W[1], "1e-3"), (W[96], "3e-4")):
            for s in seeds:
                engine = planted(arm, float(lr), False, s)
                trainer = engine + noise.gauss(0, 0.002) + (offset96 if arm == W[96] else 0.0)
                out += [
                    {"loss": arm, "band": lr, "seed": s, "ok": True, "final_reward": engine},
                    {"loss": arm, "band": lr + gw.ON_TRAINER, "seed": s, "ok": True, "final_reward": trainer},
                ]
        return [r | {"task": gw.TASK, "cell": gw.CELL, "first_reward": 0.2} for r in out]

    tests, verdict = gw.confirmation(rows(), choice)
    assert verdict == "confirmed" and [t["arm"] for t in tests] == [
        "W=1, trainer", "W=96, trainer", "W=96 minus W=1, trainer",
    ]  # fmt: skip
    assert all(t["seeds"] == 12 and t["equivalent"] and not t["different"] for t in tests)
    assert "**confirmed**: " in choosing.confirmation_words(tests)
    # the engine's runs on another build of the warm models too (another step-1 reward, 0.1 higher at the end),
    # after those on the trainer's build: C pairs the runs that started from the trainer's models
    other = [r | {"first_reward": 0.3, "final_reward": r["final_reward"] + 0.1} for r in rows() if "/" not in r["band"]]
    tests, verdict = gw.confirmation(rows() + other, choice)
    assert verdict == "confirmed" and all(t["seeds"] == 12 for t in tests)
    # the trainer's runs beside only the other build's: no pair (not run), not a difference of two models
    tests, verdict = gw.confirmation([r for r in rows() if "/" in r["band"]] + other, choice)
    assert verdict == g.NOT_RUN and all(t.get("seeds", 0) == 0 for t in tests)
    # every run records its warm model's fingerprint: a trainer's run and the engine's of one seed that started
    # from two models (the same step-1 reward notwithstanding) are refused, not paired
    fingerprinted = [r | {"warm_fingerprint": "0000000000b2" if "/" in r["band"] else "0000000000b1"} for r in rows()]
    with pytest.raises(ValueError, match=r"different warm models: .* \(fingerprint 0000000000b2\) and .*b1\)"):
        gw.confirmation(fingerprinted, choice)
    fingerprinted = [r | {"warm_fingerprint": "0000000000b1"} for r in rows()]
    assert gw.confirmation(fingerprinted, choice)[1] == "confirmed"
    planted_rows = rows(0.1)
    tests, verdict = gw.confirmation(planted_rows, choice)
    assert verdict == "contradicted" and [t["different"] for t in tests] == [False, True, True]
    assert tests[1]["diff"] == pytest.approx(0.1, abs=0.01) and tests[2]["diff"] == pytest.approx(0.1, abs=0.01)

    # each test's means: the trainer's and the engine's over its seeds (C3: W = 96's final reward minus W = 1's)
    def mean(arm, band):
        return sum(r["final_reward"] for r in planted_rows if (r["loss"], r["band"]) == (arm, band)) / 12

    on = {a: mean(a, lr + gw.ON_TRAINER) for a, lr in ((W[1], "1e-3"), (W[96], "3e-4"))}
    off = {a: mean(a, lr) for a, lr in ((W[1], "1e-3"), (W[96], "3e-4"))}
    assert [(t["trainer"], t["engine"]) for t in tests] == [
        pytest.approx((on[W[1]], off[W[1]]), abs=1e-12), pytest.approx((on[W[96]], off[W[96]]), abs=1e-12),
        pytest.approx((on[W[96]] - on[W[1]], off[W[96]] - off[W[1]]), abs=1e-12),
    ]  # fmt: skip
    words = choosing.confirmation_words(tests, detail=True)
    assert words.startswith("**contradicted** (the verdicts above are the lab engine's only; the trainer's runs are")
    assert f"(mean: trainer {on[W[96]]:.3f}, lab engine {off[W[96]]:.3f})" in words
    # the first confirmation piece alone (W = 1 on the trainer): C1 judged, no verdict
    first = [r for r in planted_rows if (r["loss"], r["band"]) != (W[96], "3e-4" + gw.ON_TRAINER)]
    tests, verdict = gw.confirmation(first, choice)
    assert verdict == g.NOT_RUN and [t["outcome"] != g.NOT_RUN for t in tests] == [True, False, False]
    words = choosing.confirmation_words(tests)
    # C1 planted within 0.002 of the engine: equivalent
    assert words == "so far (1 of its 3 tests run, no verdict yet): W=1, trainer − W=1, lab engine: within ±0.03"
    tests, verdict = gw.confirmation(rows(seeds=gw.HELD_SEEDS[:-1]), choice)
    assert verdict == g.NOT_RUN and {(t["seeds"], t["outcome"]) for t in tests} == {(11, g.NOT_RUN)}
    assert choosing.confirmation_words(tests) == "not run yet"
    assert gw.confirmation([], choice)[1] == g.NOT_RUN


def test_a_piece_whose_every_run_fails_stops_the_study(tmp_path, fake, monkeypatch):
    monkeypatch.setattr(learn.learn_engine, "run", lambda o, run_dir, s, t: EngineRun(1, {}, 1.0, 0.0, "", run_dir))
    with pytest.raises(SystemExit, match=r"piece tune_W_1_lr1e-4: every run failed \(exit codes 1"):
        main(["granularity", "--part", "2", "--out", str(tmp_path), "--phase", "tune"])


@pytest.mark.slow
def test_one_real_piece_through_the_lab_engine(tmp_path, monkeypatch):
    """One tuning piece shrunk to 1 seed x 2 steps runs through lab learn and the lab engine (the seed's warm model
    is built into the cache on first use, about a minute): a finished run with its CPU time, and the choice."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # lab learn's run folders: not left in /tmp
    steps = gw.LEARN.index("--steps") + 1
    monkeypatch.setattr(gw, "LEARN", (*gw.LEARN[:steps], "2", *gw.LEARN[steps + 1 :]))
    monkeypatch.setattr(gw, "WINDOWS", (1,))
    monkeypatch.setattr(gw, "ARMS", (W[1],))
    monkeypatch.setattr(gw, "LRS", ("1e-3",))
    monkeypatch.setattr(gw, "TUNE_SEEDS", (200,))
    out = tmp_path / "warm"
    main(["granularity", "--part", "2", "--out", str(out), "--phase", "tune"])
    (run,) = piece_rows(out, gw.tuning_pieces(gw.part2())[0], gw.part2())
    assert run["ok"] and run["steps"] == 2 and math.isfinite(run["final_reward"]) and run["mean_ppo_kl"] >= 0
    assert 0 < run["cpu_s"] and run["wall_s"] > 0
    assert [(c["loss"], c["best_band"]) for c in _csv(out / "choice.csv")] == [(W[1], "1e-3")]
