"""``lab learn --engine lab`` (``lab/engine/learn_engine.py``): the warm speech task's RL loop in one process.

Against independent references: the hf rollout server's own weight-sync code (``HFServer.load_weights``) for the
stale rollout, a full forward for the sampled log-probs, hand-computed GRPO advantages, a float64 policy gradient
for one update, verl's registry for the loss; the trainer config it reads (composed as the trainer composes it)
and the settings it refuses."""

from __future__ import annotations

import collections
import random
from types import SimpleNamespace

import pytest

from maspo_verl.lab.engine.cells import Cell
from maspo_verl.local import learn_tasks as lt
from maspo_verl.local import speechwarm as sw

torch = pytest.importorskip("torch")
le = pytest.importorskip("maspo_verl.lab.engine.learn_engine")

TINY = {"steps": 3, "batch": 2, "lr": 1e-3, "warmup": 1}
LENGTH = 8


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A tiny warm-started model of ``LENGTH`` frames (the warm start cut to 3 steps)."""
    return sw.ensure_model(seed=0, length=LENGTH, cache_dir=tmp_path_factory.mktemp("warm"), train_settings=TINY)


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _overrides(tmp_path, warm, loss="maspo_fixed@segment_window=1", extra=(), length=LENGTH, **kw):
    """lab learn's trainer overrides of part 2's registered command for one run of ``loss``."""
    from maspo_verl.lab.studies import learn

    args = SimpleNamespace(
        batch=4, n=2, bypass=True, fp32_trainer=True, lr=1e-3, steps=2, bands=[], no_adjust=True, **kw
    )
    data = lt.write_dataset(tmp_path, lt.WARM, seed=0, length=length) | {"model": warm}
    cell = Cell(length, "stale2", 2)
    return [*learn.overrides_for(args, lt.WARM, loss, 0, data, cell), *extra], data


def test_part_2s_commands_compose_to_what_the_engine_runs(tmp_path, warm):
    """Every kind of part 2 arm (a window, the offset words arm, unclipped) passes the engine's checks, and the
    settings it reads are the command's."""
    from maspo_verl.lab.studies.learn import band_overrides

    for loss, extra in (
        ("maspo_fixed@segment_window=24", ()),
        ("maspo_words~offset12", ()),
        ("maspo_adaptive@adaptive_criterion=correlation", tuple(band_overrides("maspo_adaptive", "inf"))),
    ):
        overrides, data = _overrides(tmp_path, warm, loss, extra)
        config = le.compose(overrides)
        le.check(config)
        s = le.Settings.of(config, data["sentence"], lt.WARM)
        assert (s.prompts, s.n, s.length, s.mini_rows, s.steps, s.stale) == (4, 2, LENGTH, 4, 2, 2)
        assert (s.lr, s.betas, s.weight_decay, s.clip_grad) == (1e-3, (0.9, 0.999), 0.01, 1.0)
        assert s.grid_offset == (12 if "offset" in loss else None)
        fn, cfg = le.loss_of(config)
        assert cfg.policy_loss.loss_mode == "maspo"
    assert cfg.policy_loss.adaptive_criterion == "correlation" and cfg.policy_loss.log_clip_high == 30.0


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.use_kl_loss"),
        ("algorithm.rollout_correction.bypass_mode=false", "algorithm.rollout_correction.bypass_mode"),
        ("maspo.local_mismatch.noise_std=0.1", "maspo.local_mismatch.noise_std"),
        ("actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.temperature"),
        ("actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.entropy_coeff"),
        ("credit=span", "algorithm.adv_estimator"),
    ],
)
def test_a_setting_it_does_not_run_is_refused_by_name(tmp_path, warm, override, field):
    overrides, _ = _overrides(tmp_path, warm, extra=(override,))
    with pytest.raises(SystemExit, match=field.replace(".", r"\.") + r"=.*the lab engine runs only"):
        le.check(le.compose(overrides))


def test_the_rollout_applies_weight_syncs_as_the_hf_server_does(warm):
    """The same sequence of syncs into the engine's rollout and into the trainer's ``HFServer.load_weights``: after
    each, both sample with the same weights (stale 0, 1 and 2)."""
    from maspo_verl.local.hf_rollout import HFServer
    from maspo_verl.local.mismatch import LogProbMismatch

    for stale in (0, 1, 2):
        actor = _model(warm)
        server = object.__new__(HFServer)  # the server's state, without its Ray actor or model loading
        server.mismatch, server.stale, server.replica_rank = LogProbMismatch(stale_syncs=stale), collections.deque(), 0
        server.model, server.global_steps, server.weight_version = _model(warm), None, 0
        rollout = le.Rollout(actor, stale)
        applied = []
        for k in range(5):
            with torch.no_grad():
                for p in actor.parameters():
                    p.add_(0.01 * (k + 1))
            server.load_weights({n: v.detach().clone() for n, v in actor.state_dict().items()}, global_steps=k)
            rollout.sync(actor)
            ours, theirs = rollout.model.state_dict(), server.model.state_dict()
            assert all(torch.equal(ours[n], theirs[n]) for n in theirs), (stale, k)
            applied.append(float(ours["model.norm.weight"][0]))
        # sync k applies sync k - s: the first s syncs leave the initial weights, then one new state each
        initial = float(_model(warm).state_dict()["model.norm.weight"][0])
        assert applied[:stale] == [initial] * stale and len(set(applied[stale:]) - {initial}) == 5 - stale


def test_it_samples_as_the_hf_server_serves_requests(warm):
    """The trainer's server (``HFServer._sample``, one request at a time from one generator) and the engine draw the
    same responses; their log-probs are the model's on a full forward."""
    from maspo_verl.local.hf_rollout import HFServer
    from maspo_verl.local.mismatch import LogProbMismatch

    model = _model(warm).eval()
    prompt = sw.prompt_ids("ka lo mi nu")
    ids, old = le.sample(model, prompt, 6, LENGTH, torch.Generator().manual_seed(3))
    assert ids.shape == old.shape == (6, LENGTH)
    server = object.__new__(HFServer)
    server.model, server.generator, server.mismatch = model, torch.Generator().manual_seed(3), LogProbMismatch()
    server.eos_ids = ids[0, :1]  # an id the model samples first: ignore_eos must keep going
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True, "logprobs": True}
    served = [server._sample(prompt, dict(params), LENGTH) for _ in range(6)]
    assert ids.tolist() == [t for t, _ in served] and old.tolist() == [lp for _, lp in served]
    with torch.no_grad():
        full = le.response_log_probs(model, prompt, ids)
    torch.testing.assert_close(old, full, atol=2e-5, rtol=0)


def test_advantages_are_grpos_over_consecutive_groups():
    scores = torch.rand(6, 5, generator=torch.Generator().manual_seed(0))
    scores[3:] = scores[3]  # a tied group: verl's float32 residue over std + 1e-6, as in the trainer
    adv = le.advantages(scores, 3)
    assert adv.shape == (6, 5)
    for g in range(2):
        group = scores[3 * g : 3 * g + 3].sum(-1)  # float32, as the trainer's token-level scores
        want = (group - group.mean()) / (group.std() + 1e-6)  # verl: unbiased std, epsilon 1e-6
        torch.testing.assert_close(adv[3 * g : 3 * g + 3], want[:, None].expand(3, 5), atol=1e-6, rtol=0)


def test_scores_are_the_reward_managers(tmp_path, warm):
    """Per-token scores and word ids as the trainer's reward manager returns them for the same response."""
    overrides, data = _overrides(tmp_path, warm, "maspo_words")
    s = le.Settings.of(le.compose(overrides), data["sentence"], lt.WARM)
    rng = random.Random(0)
    said = [sw.response_ids(t, LENGTH, rng) for t in (data["sentence"], "ka lo ka lo")]
    scores, words = le.score_rows(s, torch.tensor(said))
    for row, ids in enumerate(said):
        value, per_token = lt.token_scores_of(lt.WARM, ids, data["sentence"])
        assert scores[row].tolist() == pytest.approx(per_token) and float(scores[row].sum()) == pytest.approx(value)
        assert words[row].tolist() == lt.word_ids(lt.decode(lt.WARM, ids), LENGTH)
    assert float(scores[0].sum()) == pytest.approx(1.0)
    grid = le.Settings.of(le.compose(_overrides(tmp_path, warm, "maspo_words~offset1")[0]), data["sentence"], lt.WARM)
    assert le.score_rows(grid, torch.tensor(said))[1].tolist() == [[0, 0, 1, 1, 2, 2, 3, 3][1:] + [4]] * 2


class _Recorder(torch.optim.Optimizer):
    """An optimizer that only records each update's gradients."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])


def test_one_update_is_the_float64_policy_gradient(tmp_path, warm):
    """At the rollout's own weights the ratio is 1: the first update's gradient of grpo (verl's vanilla loss,
    seq-mean-token-mean) is -mean over rows of (A / T) sum_t grad log pi, here against float64 autograd; the
    second mini-batch gets its own rows."""
    overrides, data = _overrides(tmp_path, warm, "grpo")
    config = le.compose(overrides)
    fn, cfg = le.loss_of(config)
    s = le.Settings.of(config, data["sentence"], lt.WARM)
    s = type(s)(**{**s.__dict__, "clip_grad": 1e9})
    actor = _model(warm)
    prompt = sw.prompt_ids(s.sentence)
    ids, old = le.sample(actor.eval(), prompt, 8, LENGTH, torch.Generator().manual_seed(1))
    adv = le.advantages(torch.rand(8, LENGTH, generator=torch.Generator().manual_seed(2)), s.n)
    words = torch.zeros_like(ids)
    opt = _Recorder(actor.parameters())
    metrics = le.update(actor, opt, fn, cfg, s, prompt, ids, old, adv, words)
    assert len(metrics) == len(opt.grads) == 2  # 8 rows, 4 a mini-batch
    ref = _model(warm).double()
    for k, rows in enumerate((slice(0, 4), slice(4, 8))):
        ref.zero_grad()
        lp = le.response_log_probs(ref, prompt, ids[rows])
        (-(adv[rows].double() * lp).mean(-1).mean()).backward()
        for got, p in zip(opt.grads[k], ref.parameters(), strict=True):
            torch.testing.assert_close(got.double(), p.grad, atol=1e-5, rtol=1e-3)
    assert all(float(m["actor/ppo_kl"]) == pytest.approx(0, abs=1e-5) for m in metrics)


def test_a_non_finite_gradient_skips_the_update(tmp_path, warm):
    overrides, data = _overrides(tmp_path, warm, "grpo")
    config = le.compose(overrides)
    fn, cfg = le.loss_of(config)
    s = le.Settings.of(config, data["sentence"], lt.WARM)
    actor = _model(warm)
    prompt = sw.prompt_ids(s.sentence)
    ids, old = le.sample(actor.eval(), prompt, 8, LENGTH, torch.Generator().manual_seed(1))
    adv = torch.full((8, LENGTH), float("nan"))
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    metrics = le.update(actor, opt, fn, cfg, s, prompt, ids, old, adv, torch.zeros_like(ids))
    assert all(not torch.isfinite(torch.as_tensor(m["actor/grad_norm"])) for m in metrics)
    assert all(torch.equal(before[n], p) for n, p in actor.named_parameters())


def test_lab_learn_runs_the_engine_and_records_it(tmp_path, monkeypatch, warm):
    """``lab learn --engine lab``: every step's verl metrics, a run row that names the engine and the warm model's
    fingerprint; another task is refused by name."""
    from maspo_verl.lab.__main__ import main
    from maspo_verl.lab.studies import learn

    monkeypatch.setattr(sw, "ensure_model", lambda seed, length, cache_dir=None: warm)
    monkeypatch.setattr(learn.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "logs"))
    out = tmp_path / "out"
    argv = ["learn", "--out", str(out), "--tasks", lt.WARM, "--cells", f"{LENGTH}/stale2/2", "--steps", "3"]
    argv += ["--bypass", "--fp32-trainer", "--no-adjust", "--batch", "4", "--n", "2", "--losses", "maspo_words"]
    main([*argv, "--engine", "lab", "--seeds", "1", "--lr", "1e-3"])
    runs = learn.load_rows(out / "learn_runs.csv")
    steps = learn.load_rows(out / "learn_steps.csv")
    assert [(r["rollout"], r["ok"], r["steps"]) for r in runs] == [("lab", True, 3)]
    assert [r["warm_fingerprint"] for r in runs] == [sw.fingerprint(warm)]  # the model it started from
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0 <= r["critic/score/mean"] <= 1 and r["actor/ppo_kl"] == r["actor/ppo_kl"] for r in steps)
    assert all(r["actor/ratio/vif5"] == r["actor/ratio/vif5"] for r in steps)  # the loss's own metrics travel
    with pytest.raises(SystemExit, match=r"--tasks 'speech': allowed 'speechwarm'"):
        main([*argv[:4], "speech", *argv[5:], "--engine", "lab", "--seeds", "1", "--out", str(tmp_path / "o2")])


def test_a_failed_run_is_recorded_with_its_traceback(tmp_path, warm, monkeypatch):
    """As a failed trainer run: exit 1, the steps so far, the cause in its console log (lab learn counts it)."""
    overrides, data = _overrides(tmp_path, warm)

    def broken(*args, **kwargs):
        raise FloatingPointError("planted")

    monkeypatch.setattr(le, "train", broken)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = le.run(overrides, tmp_path / "run", data["sentence"], lt.WARM)
        assert torch.get_num_threads() == 2  # the engine's one thread is given back
    finally:
        torch.set_num_threads(threads)
    assert (got.returncode, got.steps, got.rollout) == (1, {}, "lab")
    assert "FloatingPointError: planted" in (tmp_path / "run" / "console.log").read_text()


def test_runs_in_worker_processes_are_the_runs_in_one(tmp_path, monkeypatch, warm):
    """``--workers 2``: the same rows (each run is its own seeded computation on one thread), in the jobs' order;
    refused with the trainer."""
    from maspo_verl.lab.__main__ import main
    from maspo_verl.lab.studies import learn

    monkeypatch.setattr(sw, "ensure_model", lambda seed, length, cache_dir=None: warm)
    argv = ["learn", "--tasks", lt.WARM, "--cells", f"{LENGTH}/stale2/2", "--steps", "2", "--bypass", "--no-adjust"]
    argv += ["--fp32-trainer", "--batch", "4", "--n", "2", "--losses", "maspo_fixed", "--seeds", "2"]
    rows = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        main([*argv, "--out", str(out), "--engine", "lab", "--workers", str(workers)])
        rows[workers] = [
            (r["loss"], r["seed"], r["ok"], r["final_reward"], r["mean_ppo_kl"])
            for r in learn.load_rows(out / "learn_runs.csv")
        ]
    assert rows[1] == rows[2] and [(loss, seed, ok) for loss, seed, ok, *_ in rows[1]] == [
        ("maspo_fixed", 0, True), ("maspo_fixed", 1, True),
    ]  # fmt: skip
    with pytest.raises(SystemExit, match=r"--workers 2: allowed 1, or more with --engine lab"):
        main([*argv, "--out", str(tmp_path / "t"), "--workers", "2"])
