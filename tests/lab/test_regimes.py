"""The regime grid's engine (``lab.engine.grid``): exact log-probs and sampling (enumeration), the gradient it
follows (float64 autograd of verl's registered loss, seed by seed), every preset discovered, the mismatch conditions,
and the command."""

import argparse
import itertools
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl.lab.__main__ import main
from maspo_verl.lab.engine import grid, tabular
from maspo_verl.lab.engine.cells import parse_mismatch
from maspo_verl.lab.engine.common import read_csv
from maspo_verl.lab.engine.presets import Preset, discover_presets, loss_call, preset_config
from tests.helpers import REPO


def test_every_loss_preset_is_discovered_and_composed_as_shipped():
    listing = sorted(p.stem for p in (REPO / "hydra_configs" / "loss").glob("*.yaml"))
    presets = discover_presets()
    assert sorted(p.name for p in presets) == listing and presets[0].name == "grpo"
    for p in presets:
        own = OmegaConf.load(REPO / "hydra_configs" / "loss" / f"{p.name}.yaml").actor_rollout_ref.actor
        assert p.loss_mode == own.policy_loss.loss_mode
        for key, value in own.policy_loss.items():  # every field the preset sets reaches the engine
            assert p.policy_loss[key] == (OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
        for key in ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode"):
            if key in own:
                assert p.actor[key] == own[key], (p.name, key)


def _table(seed=0, S=1, T=3):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(S, T, tabular.VOCAB + 1, tabular.VOCAB, generator=g, dtype=torch.float64), -1)


def test_log_probs_are_exact_over_every_response():
    table = _table(T=3)
    V = tabular.VOCAB
    ys = torch.tensor(list(itertools.product(range(V), repeat=3)))[None]  # [1, 512, 3]: every response
    lp = grid.gather(table, ys)
    assert math.isclose(float(lp.sum(-1).exp().sum()), 1.0, rel_tol=1e-12)
    for y in ([0, 0, 0], [3, 7, 1], [7, 2, 2]):  # by hand: the first token's row is the start context V
        prev, want = V, 0.0
        for t, v in enumerate(y):
            want += float(table[0, t, prev, v])
            prev = v
        got = float(grid.gather(table, torch.tensor([[y]]))[0, 0].sum())
        assert math.isclose(got, want, rel_tol=1e-12)


def test_the_sampler_draws_from_the_table():
    table = _table(seed=3, S=2, T=2).float()
    y, lp = grid.sample(table, 20000, torch.Generator().manual_seed(0))
    assert torch.allclose(lp, grid.gather(table, y))
    V = tabular.VOCAB
    for s in range(2):
        codes = y[s, :, 0] * V + y[s, :, 1]
        freq = torch.bincount(codes, minlength=V * V).double() / codes.numel()
        every = torch.tensor(list(itertools.product(range(V), repeat=2)))[None]
        exact = grid.gather(table[s : s + 1].double(), every)[0].sum(-1).exp()
        assert float((freq - exact).abs().sum()) / 2 < 0.04  # total variation; a wrong context gives > 0.2


@pytest.mark.parametrize("name", ["grpo", "gspo", "ctpo", "pgspo", "maspo_fixed", "maspo_tokenval", "maspo_words"])
def test_the_engine_follows_each_seeds_gradient_of_verls_loss(name):
    """Three seeds in one call: each seed's table gets the float64 autograd gradient of verl's registered loss on
    that seed's rows alone (the old log-probs a mismatched rollout's)."""
    (preset,) = discover_presets([name])
    fn, cfg = get_policy_loss_fn(preset.loss_mode), preset_config(preset)
    S, m, T = 3, 4, 20
    task = grid.make_task("speech", T, list(range(S)))
    theta = grid.init_tables(task, T, list(range(S)))
    g = torch.Generator().manual_seed(1)
    y, old = grid.sample(grid.log_prob_table(theta + 0.3 * torch.randn(theta.shape, generator=g)), m, g)
    adv = torch.randn(S, m, 1, generator=g).expand(S, m, T)
    ids, words = task.token_ids(y), task.word_ids(y)
    leaf = theta.clone().requires_grad_()
    grid.backward(leaf, fn, cfg, y, old, adv, ids, words)
    for s in range(S):
        ref = theta[s : s + 1].double().requires_grad_()
        lp = grid.gather(torch.log_softmax(ref, -1), y[s : s + 1])[0]
        loss, _ = loss_call(fn, cfg, old[s].double(), lp, adv[s].double(), ids[s], words[s])
        (grad,) = torch.autograd.grad(loss, ref)
        assert float(grad.abs().max()) > 1e-4  # a gradient to compare
        torch.testing.assert_close(leaf.grad[s : s + 1].double(), grad, rtol=2e-4, atol=2e-6)


def test_the_speech_reward_scores_units_not_tokens():
    task = grid.make_task("speech", 96, [0])
    target = task.target[0]
    sizes = torch.bincount(task.unit_id[0])
    assert int(sizes.sum()) == 96 and bool(((sizes[:-1] >= 3) & (sizes[:-1] <= 15)).all())  # the last: cut at the end
    y = target.clone()[None, None]
    assert float(task.reward(y)) == 1.0
    y[..., 1] = (target[1] + 1) % tabular.VOCAB  # one wrong frame in a unit of 3+ frames: still recognised
    assert float(task.reward(y)) == 1.0
    first = task.unit_id[0] == 0
    y[0, 0, first] = (target[first] + 1) % tabular.VOCAB  # the whole first unit wrong
    assert math.isclose(float(task.reward(y)), 1 - 1 / int(task.n_units[0]))
    # the codes of two symbols are far apart in FSQ digit L1 distance, so tokenval cuts between units
    digits = [[(c >> (2 * k)) & 3 for k in range(8)] for c in tabular.CODES]
    assert min(sum(abs(a - b) for a, b in zip(x, z, strict=True)) for x, z in itertools.combinations(digits, 2)) >= 12


def _args(**kw):
    base = dict(seeds=3, steps=3, groups=2, group_size=4, lr=0.2, gain=0.2, last=2, sample_seed=0)
    return argparse.Namespace(**(base | kw))


def test_the_mismatch_conditions_are_what_they_say():
    grpo = discover_presets(["grpo"])[0]

    def spread(mismatch, updates=1):
        out = grid.run_job(grid.Job("text", 24, mismatch, updates, grpo), _args())
        return [r["logratio_sd"] for r in out["records"]]

    assert spread("none") == [0.0, 0.0, 0.0]  # on-policy, one update: the ratio is exactly 1
    assert all(0 < v < 0.01 for v in spread("bf16"))  # rounding of the rollout's table
    assert all(0.17 < v < 0.23 for v in spread("noise0.2"))
    stale = spread("stale2")
    assert all(v > 0.05 for v in stale)  # two Adam updates of lr 0.2 behind
    with pytest.raises(SystemExit, match="allowed"):
        parse_mismatch("stale0")


def test_a_preset_the_engine_cannot_feed_is_reported_with_its_reason():
    bad = Preset(
        "broken",
        "no_such_loss",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean"},
        {"loss_mode": "maspo"},
    )
    reason = grid.probe(bad, "speech")
    assert reason and "no_such_loss" in reason
    assert grid.probe(discover_presets(["maspo_steps"])[0], "text") is None


def test_the_command_writes_its_tables(tmp_path):
    argv = ["regimes", "--out", str(tmp_path), "--lengths", "8", "--seeds", "2", "--steps", "3", "--groups", "2"]
    main([*argv, "--group-size", "4", "--presets", "grpo", "gspo", "--mismatch", "none", "stale2", "--workers", "1"])
    for name in ("README.md", "COMMAND.txt", "regimes_runs.csv", "regimes_compare.csv", "regimes_mismatch.csv"):
        assert (tmp_path / name).exists(), name
    compare = read_csv(tmp_path / "regimes_compare.csv")
    assert {r["loss"] for r in compare} == {"gspo"} and {r["cell"] for r in compare} >= {"L8/stale2/U4"}
    # on-policy with one update every preset follows grpo's gradient: identical runs
    same = [r for r in compare if r["cell"] == "L8/none/U1"]
    assert same and all(float(r["diff"]) == 0.0 for r in same)
    assert "run time" in (tmp_path / "COMMAND.txt").read_text()


def test_help_documents_the_grid():
    out = subprocess.run(
        [sys.executable, "-m", "maspo_verl.lab", "regimes", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    for word in ("--lengths", "--mismatch", "--updates", "--presets", "--seeds", "stale<K>", "bf16", "noise<SIGMA>"):
        assert word in out.stdout, word
