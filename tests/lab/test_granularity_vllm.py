"""Part 4 of the registered granularity study (``maspo_verl.lab.studies.granularity_vllm``): part 1's H1 winner by the
registered rule, the pieces and the lab learn command each one is (parsed by the lab CLI's own parser, composed by
Hydra), the choice written before the held-out seeds, resuming, the vLLM-only rule, and the P4 tests on planted
results, with a fake trainer run behind the real ``lab learn``; and the part's seeds fresh in every committed
study."""

from __future__ import annotations

import csv
import itertools
import math
import random
import re
import statistics
import zlib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from maspo_verl import choosing
from maspo_verl.lab.__main__ import main, parse
from maspo_verl.lab.engine import protocol as g
from maspo_verl.lab.engine import runs
from maspo_verl.lab.engine.common import write_csv
from maspo_verl.lab.engine.pieces import PIECES
from maspo_verl.lab.engine.runs import LocalRun
from maspo_verl.lab.studies import granularity_vllm as gv
from maspo_verl.lab.studies import granularity_warm as gw
from maspo_verl.lab.studies import learn
from maspo_verl.local.engine import engine_line, engine_of
from tests.lab.conftest import fake_learn_runs

GRPO, W1, WHOLE = gv.ARMS
ROOT = Path(__file__).resolve().parents[2]

# the planted study: each arm's best lr (grpo at the highest, W = whole at the lowest: both flagged; W = 1 ties
# between 1e-5 and 3e-5: the smaller wins), and on the held-out seeds W = whole 0.1 above W = 1, W = 1 equal to grpo
BEST = {GRPO: 3e-5, WHOLE: 3e-6}
TIED = {W1: (1e-5, 3e-5)}
GAIN = {WHOLE: 0.1}
VAL = {GRPO: 0.80, W1: 0.80, WHOLE: 0.90}  # greedy validation accuracy at the last step


def planted(arm: str, lr: float, seed: int) -> float:
    """The run's mean training reward over its 20 steps."""
    if arm in TIED:
        return 0.5 if lr in TIED[arm] else 0.4
    noise = random.Random(zlib.crc32(f"{arm} {lr} {seed}".encode())).gauss(0, 0.004)
    return 0.5 - 0.1 * abs(math.log10(lr / BEST[arm])) + GAIN.get(arm, 0.0) + noise


def _value(overrides: list[str], key: str) -> str:
    return next(o.partition("=")[2] for o in overrides if o.startswith(key + "="))


def _console(engine: str) -> str:
    """The start-up line the local mode prints for ``engine`` (its own function)."""
    rollout = {"name": engine, "dtype": "bfloat16"}
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}, "algorithm": {}})
    return f"[    3.0s] maspo_verl local: {engine_line(config)}\n"


class FakeTrainer:
    """``learn.run_local``: 20 steps averaging ``planted``, verl's validation at the last step where the command
    asks for it, the vLLM rollout named unless ``engine`` says otherwise; calls recorded."""

    def __init__(self):
        self.calls = []
        self.engine = lambda arm, lr, seed: "vllm"

    def __call__(self, overrides, run_dir, timeout_s=900):
        seed, lr = int(_value(overrides, "data.seed")), float(_value(overrides, "actor_rollout_ref.actor.optim.lr"))
        name = _value(overrides, "trainer.experiment_name")
        (arm,) = [a for a in gv.ARMS if learn.slug(f"learn_{gv.TASK}_{a}_{seed}_{gv.CELL}") == name]
        assert timeout_s == 3600 and f"model={gv.TASK}" in overrides and learn.IGNORE_EOS not in overrides
        self.calls.append((arm, lr, seed))
        steps = int(_value(overrides, "trainer.total_training_steps"))
        mean = planted(arm, lr, seed)
        curve = [mean + 0.01 * (i - (steps - 1) / 2) for i in range(steps)]  # a rising curve of that mean
        out = {i: {"critic/score/mean": r, "actor/ppo_kl": lr, "actor/pg_loss": 0.1, "actor/grad_norm": 1.0}
               for i, r in enumerate(curve, 1)}  # fmt: skip
        if int(_value(overrides, "trainer.test_freq")) == steps:
            out[steps][gv.VALIDATION] = VAL[arm] + (seed % 2) * 0.01
        return LocalRun(0, _console(self.engine(arm, lr, seed)), 1.0, Path(run_dir), out, cpu_s=2.0)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    trainer = fake_learn_runs(monkeypatch, tmp_path, FakeTrainer())
    return trainer


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ part 1's winner


def _f1a(diffs: dict[int, list[float]]) -> list[dict]:
    rows = [{"family": "F1b", "cell": g.CELLS[0], "arm": f"{g.FIXED}2", "seeds": "64", "diff": "9"}]
    for w, per_cell in diffs.items():
        rows += [{"family": "F1a", "cell": c, "arm": f"{g.FIXED}{w}", "seeds": "64", "diff": str(d)}
                 for c, d in zip(g.CELLS, per_cell, strict=True)]  # fmt: skip
    return rows


def test_part1s_winner_is_the_window_with_the_best_mean_f1a_difference():
    committed = _csv(ROOT / "docs/results/granularity/tests.csv")
    assert gv.part1_winner(committed) == gv.REGISTERED_WINNER == 96
    # by hand from the committed rows: W = 96's mean over the three cells is above every other window's
    mean = {w: statistics.fmean(float(t["diff"]) for t in committed if t["family"] == "F1a" and
                                t["arm"] == f"{g.FIXED}{w}") for w in g.WINDOWS[1:]}  # fmt: skip
    assert max(mean, key=mean.get) == 96 and mean[96] - mean[32] > 0.005
    # the mean over cells decides, not the best single cell (W = 4 holds the largest one); the other family and
    # ties (W = 8 and 16: the shorter) do not
    planted_rows = _f1a({2: [0, 0, 0], 4: [-0.3, 0.0, 0.5], 8: [0.1, 0.1, 0.1], 16: [0.1, 0.1, 0.1],
                         32: [0, 0, 0], 96: [0, 0, 0]})  # fmt: skip
    assert gv.part1_winner(planted_rows) == 8
    with pytest.raises(SystemExit, match=r"not run in every cell for W = \[96\]"):
        gv.part1_winner([r for r in planted_rows if not (r["arm"].endswith("=96") and r["cell"] == g.CELLS[2])])


def test_the_part_refuses_to_start_where_the_rule_gives_another_window(tmp_path, monkeypatch, fake):
    path = tmp_path / "part1_tests.csv"
    write_csv(path, _f1a({w: [0.1 if w == 32 else 0.0] * 3 for w in g.WINDOWS[1:]}))
    monkeypatch.setattr(gv, "part1_tests", lambda: path)
    with pytest.raises(SystemExit, match=r"W = 32 .*not the whole response \(W = 96\)"):
        main(["granularity", "--part", "4", "--out", str(tmp_path / "vllm"), "--phase", "tune"])
    assert not fake.calls and not (tmp_path / "vllm" / "COMMAND.txt").exists()


# ------------------------------------------------------------------ the pieces


def _choice(best: dict[str, str]) -> list[dict]:
    return [{"cell": gv.CELL, "loss": a, "best_band": best.get(a, "1e-5"), "kl_band": "", "tune_final": 0.5}
            for a in gv.ARMS]  # fmt: skip


def test_each_piece_is_a_lab_learn_command_of_the_registered_design():
    """The registered pieces, each parsed by the lab CLI's own parser and its trainer overrides composed by Hydra:
    model=smollm2 at its own answer length and the local mode's batch, answers ending at EOS, validation at the
    last step, the arm's loss and the piece's lr and seeds."""
    from tests.helpers import compose_config

    part = gv.part()
    tune = gw.tuning_pieces(part)
    assert {(p.arm, p.lr) for p in tune} == set(itertools.product(gv.ARMS, gv.LRS)) and len(tune) == 9
    assert {p.seeds for p in tune} == {(400, 401)} and len({p.name for p in tune}) == 9
    held = gv.held_pieces(_choice({GRPO: "3e-5"}))
    assert [(p.arm, p.lr, p.seeds) for p in held] == [(GRPO, "3e-5", (500, 501, 502, 503)),
        (W1, "1e-5", (500, 501, 502, 503)), (WHOLE, "1e-5", (500, 501, 502, 503))]  # fmt: skip
    assert not [p for p in gv.held_pieces([c for c in _choice({}) if c["loss"] != W1]) if p.arm == W1]
    config = compose_config("local=cpu", f"model={gv.TASK}")
    for piece in tune + held:
        args = parse(piece.argv(Path("out"), part.flags))
        assert args.module is learn and args.out == str(Path("out") / PIECES / piece.name)
        assert (args.tasks, args.steps, args.lr, args.losses) == ([gv.TASK], 20, float(piece.lr), [piece.arm])
        assert args.bypass and args.no_adjust and not args.fp32_trainer and not args.bands
        assert list(range(args.first_seed, args.first_seed + args.seeds)) == list(piece.seeds)
        (cell,) = learn.cells_of(args)
        assert cell.label == gv.CELL and cell.length == config.data.max_response_length == 64
        learn.check_losses(args.losses)
    for arm, window in ((GRPO, None), (W1, 1), (WHOLE, 64)):
        piece = gw.Piece("tune", arm, "3e-6", gv.TUNE_SEEDS)
        args = parse(piece.argv(Path("out"), part.flags))
        data = learn.task_data(Path("never_written"), gv.TASK, 401, cell.length)
        overrides = learn.overrides_for(args, gv.TASK, arm, 401, data, cell)
        # the trainer's command line as the lab runner writes it (with its pins for what the overrides leave)
        command = runs.local_command(overrides, Path("never_written"))
        run = compose_config(*[o for o in command[command.index("local=cpu") :] if not o.startswith("hydra.")])
        assert run.actor_rollout_ref.rollout.name == "vllm"  # not the runner's pinned transformers rollout
        assert run.maspo.model == gv.TASK and run.maspo.local_seed == 401 and run.data.train_files is None
        assert run.data.max_response_length == 64 and not run.actor_rollout_ref.rollout.ignore_eos
        assert run.trainer.test_freq == run.trainer.total_training_steps == 20
        assert (run.data.train_batch_size, run.actor_rollout_ref.rollout.n) == (4, 4) == (
            config.data.train_batch_size, config.actor_rollout_ref.rollout.n)  # fmt: skip
        assert run.actor_rollout_ref.actor.ppo_mini_batch_size == config.actor_rollout_ref.actor.ppo_mini_batch_size
        assert run.actor_rollout_ref.actor.optim.lr == 3e-6 and run.algorithm.rollout_correction.bypass_mode
        policy = run.actor_rollout_ref.actor.policy_loss
        assert (policy.loss_mode, policy.segment_window if window else None) == (
            ("vanilla", None) if arm == GRPO else ("maspo", window))  # fmt: skip
    assert not Path("never_written").exists()


# ------------------------------------------------------------------ the study, end to end on a fake trainer


def _exact_signflip(d: list[float]) -> float:
    """Two-sided p by enumerating the 2^n sign vectors (independent of lab/stats.py)."""
    total = abs(sum(d))
    signs = list(itertools.product((1, -1), repeat=len(d)))
    return sum(abs(sum(s * x for s, x in zip(v, d, strict=True))) >= total - 1e-12 for v in signs) / len(signs)


def test_the_study_tunes_writes_its_choice_then_judges_and_resumes(tmp_path, fake):
    out = tmp_path / "vllm"
    base = ["granularity", "--part", "4", "--out", str(out)]
    with pytest.raises(SystemExit, match=r"--phase held: .*choice.csv is missing.*9 pieces are done \(0 are\)"):
        main([*base, "--phase", "held"])
    main([*base, "--phase", "tune", "--pieces", "4"])
    assert len(fake.calls) == 4 * 2 and not (out / "choice.csv").exists()
    assert "Not chosen yet: 4 of 9 tuning pieces done" in (out / "README.md").read_text()
    with pytest.raises(SystemExit, match=r"choice.csv is missing.*\(4 are\)"):
        main([*base, "--phase", "held", "--resume"])
    main([*base, "--phase", "tune", "--resume"])
    assert len(fake.calls) == 18 and len(set(fake.calls)) == 18
    choice = {c["loss"]: c for c in _csv(out / "choice.csv")}
    assert {a: float(c["best_band"]) for a, c in choice.items()} == {GRPO: 3e-5, W1: 1e-5, WHOLE: 3e-6}
    mean = statistics.fmean(planted(GRPO, 3e-5, s) for s in gv.TUNE_SEEDS)  # the mean over the 20 steps
    assert float(choice[GRPO]["tune_final"]) == pytest.approx(mean, abs=1e-9)
    readme = (out / "README.md").read_text()
    assert f"(not bracketed below): {gv.CELL} {WHOLE}." in readme
    assert f"(not bracketed above): {gv.CELL} {GRPO}." in readme

    root = tmp_path / "root"  # the guide reads the part from a checkout's docs/results
    (root / choosing.RESULTS / choosing.PART4).parent.mkdir(parents=True)
    (root / choosing.RESULTS / choosing.PART4).symlink_to(out)
    assert choosing.part4_words(root) == ""  # no registered test run yet

    main([*base, "--phase", "held", "--resume"])
    held = fake.calls[18:]
    assert sorted(held) == sorted((a, float(choice[a]["best_band"]), s) for a in gv.ARMS for s in gv.HELD_SEEDS)
    tests = _csv(out / "tests.csv")
    assert [(t["family"], t["arm"], t["vs"]) for t in tests] == [("P4", WHOLE, W1), ("P4", W1, GRPO)]
    by = {(a, s): planted(a, float(choice[a]["best_band"]), s) for a in gv.ARMS for s in gv.HELD_SEEDS}
    p = []
    for t in tests:
        d = [by[(t["arm"], s)] - by[(t["vs"], s)] for s in gv.HELD_SEEDS]
        assert t["seeds"] == "4" and t["signflip"] == "exact" and float(t["diff"]) == pytest.approx(statistics.fmean(d))
        assert float(t["p_signflip"]) == pytest.approx(_exact_signflip(d)) and float(t["p_signflip"]) >= 1 / 8
        p.append(float(t["p_signflip"]))
    low, high = sorted(p)
    assert [float(t["p_holm"]) for t in tests] == pytest.approx(
        [min(1, 2 * low) if x == low else max(min(1, 2 * low), high) for x in p])  # fmt: skip
    # the planted +0.1 cannot pass with 4 seeds and is not within the margin; the planted zero is within ±0.05
    assert [t["outcome"] for t in tests] == ["—", "within ±0.05"]
    words = choosing.part4_words(root)
    assert all(choosing._test_text(t) in words for t in tests) and words.endswith("→ within ±0.05.")
    arms = {r["arm"]: r for r in _csv(out / "arms.csv")}
    assert float(arms[WHOLE]["val_acc_last_step"]) == pytest.approx(0.905) and arms[W1]["seeds"] == "4/4"
    secondary = _csv(out / "secondary.csv")
    assert [float(r["diff"]) for r in secondary] == pytest.approx([0.1, 0.0], abs=1e-12)
    pieces = _csv(out / "pieces.csv")
    assert len(pieces) == 12 and all(p["done"] == "True" and p["failed"] == "0" for p in pieces)
    command = (out / "COMMAND.txt").read_text()
    assert command.count("\npiece ") == 12 and command.index("choice.csv written") < command.index("piece held_")
    assert "**Every number here is exploratory (under-powered).**" in (out / "README.md").read_text()

    # a stopped piece resumes where it stopped; a finished study runs nothing again
    piece = gv.held_pieces(list(choice.values()))[1]
    path = out / PIECES / piece.name / "learn_runs.csv"
    write_csv(path, [r for r in _csv(path) if r["seed"] != "502"])
    main([*base, "--phase", "all", "--resume"])
    assert fake.calls[30:] == [(W1, 1e-5, 502)]
    main([*base, "--phase", "all", "--resume", "--pieces", "2"])
    assert len(fake.calls) == 31


def test_a_run_off_the_vllm_rollout_counts_as_failed(tmp_path, fake):
    """The local mode moves to the transformers rollout where vLLM cannot run: such a run is failed, left out of
    the choice; a piece with no run on vLLM stops the study, naming the engine."""
    assert engine_of(_console("vllm")) == "vllm" and engine_of(_console("hf")) == "hf" and engine_of("") is None
    fake.engine = lambda arm, lr, seed: "hf" if (arm, seed) == (GRPO, 401) else "vllm"
    out = tmp_path / "vllm"
    main(["granularity", "--part", "4", "--out", str(out), "--phase", "tune", "--pieces", "3"])
    runs = learn.load_rows(out / PIECES / gw.tuning_pieces(gv.part())[0].name / "learn_runs.csv")
    assert [(r["seed"], r["ok"], r["rollout"]) for r in runs] == [(400, True, "vllm"), (401, True, "hf")]
    assert [p["failed"] for p in _csv(out / "pieces.csv")[:3]] == ["1", "1", "1"]
    tuning = [r for r in _csv(out / "tuning.csv") if r["arm"] == GRPO]
    assert [r["seeds"] for r in tuning] == ["1", "1", "1"]
    fake.engine = lambda arm, lr, seed: "hf"
    with pytest.raises(SystemExit, match=r"tune_W_1_lr3e-6: every run failed \(exit codes 0; rollout engines hf"):
        main(["granularity", "--part", "4", "--out", str(out), "--phase", "tune", "--resume"])


# ------------------------------------------------------------------ fresh seeds


def committed_seeds(results: Path) -> set[int]:
    """Every seed a committed study names (part 4's own folder aside): the seed and batch columns of its CSVs, and
    the seeds of its commands (``--first-seed F --seeds N``, ``--seed N``, ``local_seed=N``, ``data.seed=N``) in
    every COMMAND.txt."""
    mine = results / gv.FOLDER
    seeds: set[int] = set()
    for path in (p for p in results.rglob("*.csv") if mine not in p.parents):
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            columns = [i for i, k in enumerate(header) if k in ("seed", "batch")]
            seeds |= {int(float(row[i])) for row in reader for i in columns if i < len(row) and row[i].strip()}
    for path in (p for p in results.rglob("COMMAND.txt") if mine not in p.parents):
        for line in path.read_text().splitlines():
            first = re.search(r"--first-seed[ =](\d+)", line)
            count = re.search(r"--seeds[ =](\d+)", line)
            if count:
                start = int(first.group(1)) if first else 0
                seeds |= set(range(start, start + int(count.group(1))))
            seeds |= {int(s) for s in re.findall(r"(?:--seed[ =]|local_seed=|data\.seed=)(\d+)", line)}
    return seeds


def test_part4s_seeds_are_fresh():
    results = ROOT / "docs" / "results"
    used = committed_seeds(results)
    assert {0, 1, 4, 100, 20000, 30063} <= used  # the scan sees the committed studies' seeds
    mine = set(gv.TUNE_SEEDS) | set(gv.HELD_SEEDS)
    assert not mine & used and not set(gv.TUNE_SEEDS) & set(gv.HELD_SEEDS) and len(gv.HELD_SEEDS) == 4
    registered = {*g.TUNE_SEEDS, *g.HELD_SEEDS, *gw.TUNE_SEEDS, *gw.HELD_SEEDS, *range(200, 208)}  # parts 1-3
    assert not mine & registered
    # the arithmetic task's validation split is seed + 10000: fresh too
    assert not {s + 10_000 for s in mine} & (used | registered)
