"""Part 3 of the granularity study (lab/smollm2_granularity.py) on a tiny random Llama: natural-length
responses and their mask, the within-row permutation null, whole-model gradients of any token weighting, the
drift's Adam updates on grpo's loss, the screening, the registered tests, and the resume of a stopped run."""

import math

import pytest
import torch

from maspo_verl.lab.engine import smollm2, stats
from maspo_verl.lab.studies import smollm2_granularity as g3
from tests.lab.conftest import plain_log_probs, tiny_llama

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(EOS, PAD)
    ids = torch.randint(3, 40, (6, 5))
    attn = torch.ones_like(ids)
    attn[1, :2] = 0  # a left-padded prompt
    resp = torch.randint(3, 40, (6, 7))
    resp[0, 3], resp[0, 4:] = EOS, PAD
    resp[2, 0], resp[2, 1:] = EOS, PAD
    return model, ids, attn, resp


_plain_log_probs = plain_log_probs


def test_response_mask_ends_at_the_first_eos_inclusive():
    resp = torch.tensor([[5, 6, EOS, PAD, PAD], [EOS, 7, EOS, 3, 3], [4, 4, 4, 4, 4], [3, PAD, 3, EOS, PAD]])
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(g3.response_mask(resp, EOS), want)


def test_sample_has_natural_lengths_and_log_probs_are_a_plain_forward(tiny):
    model, ids, attn, _ = tiny
    resp = smollm2.sample(model, ids, attn, g3.TOKENS, [], seed=3, chunk=4, pad=PAD)
    mask = g3.response_mask(resp, EOS)
    assert resp.shape[0] == 6 and resp.shape[1] <= g3.TOKENS
    # after each row's first EOS: only padding; a row without EOS runs to TOKENS
    assert bool((resp[~mask] == PAD).all())
    assert all(bool((row == EOS).any()) or int(m.sum()) == g3.TOKENS for row, m in zip(resp, mask, strict=True))
    lp = g3.log_probs(model, ids, attn, resp, chunk=4)
    torch.testing.assert_close(lp, _plain_log_probs(model, ids, attn, resp), rtol=1e-5, atol=1e-5)


def test_permutation_keeps_each_row_and_removes_order():
    gen = torch.Generator().manual_seed(0)
    B, T = 64, 96
    lengths = torch.randint(20, T + 1, (B,))
    mask = torch.arange(T) < lengths[:, None]
    # AR(1) rows, rho 0.8: VIF(15) well above 1
    eps = torch.randn(B, T, generator=gen, dtype=torch.float64)
    x = torch.zeros_like(eps)
    x[:, 0] = eps[:, 0]
    for t in range(1, T):
        x[:, t] = 0.8 * x[:, t - 1] + eps[:, t]
    x = x.masked_fill(~mask, 0.0)
    p = g3.permuted(x, mask, gen)
    for i in range(B):
        n = int(lengths[i])
        torch.testing.assert_close(p[i, :n].sort().values, x[i, :n].sort().values)
        assert not torch.equal(p[i, :n], x[i, :n])
        assert bool((p[i, n:] == 0).all())
    row = g3.correlation_row(x, mask, seed=1)
    assert row["vif15"] > 3.0 and row["lag1"] > 0.6
    assert abs(row["null_vif15"] - 1.0) < 0.15 and abs(row["null_lag1"]) < 0.05
    with pytest.raises(ValueError, match="prefix"):
        g3.permuted(x, mask & (torch.arange(T) != 3), gen)


def test_whole_grads_equal_autograd_of_each_weighting(tiny):
    model, ids, attn, resp = tiny
    cs = [torch.randn(resp.shape), torch.randn(resp.shape)]
    got = g3.whole_grads(model, ids, attn, resp, cs, chunk=4)  # chunks of 4 and 2 rows
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    try:
        lp = _plain_log_probs(model, ids, attn, resp)
        for c, g in zip(cs, got, strict=True):
            want = torch.cat([x.flatten() for x in torch.autograd.grad((c * lp).sum(), params, retain_graph=True)])
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    finally:
        for p in params:
            p.requires_grad_(False)
    assert not any(p.requires_grad for p in model.parameters())


def _batch(tiny):
    model, ids, attn, resp = tiny
    mask = g3.response_mask(resp, EOS)
    prompt_of = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = smollm2.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), prompt_of, mask)
    old = g3.log_probs(model, ids, attn, resp, chunk=4)
    return model, ids, attn, resp, mask, adv, old


def test_advantages_and_loss_weights_live_on_the_response_tokens(tiny):
    model, ids, attn, resp, mask, adv, old = _batch(tiny)
    assert bool((adv[~mask] == 0).all())
    # group 0 rewards 1, 0, 0: mean 1/3, unbiased sd 0.577
    torch.testing.assert_close(adv[0, 0], torch.tensor((1 - 1 / 3) / math.sqrt(1 / 3)), rtol=1e-4, atol=1e-4)
    fn, cfg = g3.grpo_loss()
    c, _ = smollm2.loss_weights(fn, cfg, old, old + 0.01 * torch.randn(old.shape), adv, resp, mask)
    assert bool((c[~mask] == 0).all()) and bool((c[mask] != 0).any())
    # token-mean on-policy: d loss / d lp = -A / (#response tokens)
    c0, _ = smollm2.loss_weights(fn, cfg, old, old, adv, resp, mask)
    torch.testing.assert_close(c0, -adv * mask / mask.sum(), rtol=1e-5, atol=1e-7)


def test_drift_takes_adam_steps_on_grpos_gradient(tiny):
    model, ids, attn, resp, mask, adv, old = _batch(tiny)
    before = [p.clone() for p in model.parameters()]
    fn, cfg = g3.grpo_loss()
    # reference: plain autograd of verl's loss on the whole batch, torch's Adam, two updates
    ref = [p.clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.Adam(ref, lr=1e-2)
    copy_ = type(model)(model.config).eval()
    want = []
    for _ in range(2):
        with torch.no_grad():
            for p, r in zip(copy_.parameters(), ref, strict=True):
                p.copy_(r)
        lp = _plain_log_probs(copy_, ids, attn, resp)
        c, _ = smollm2.loss_weights(fn, cfg, old, lp.detach(), adv, resp, mask)
        grads = torch.autograd.grad((c * lp).sum(), list(copy_.parameters()))
        for r, gr in zip(ref, grads, strict=True):
            r.grad = gr
        opt.step()
        want.append([r.detach().clone() for r in ref])
    got = {
        k: [p.clone() for p in m.parameters()]
        for k, m in g3.drift(model, ids, attn, resp, mask, old, adv, 1e-2, (1, 2), 4)
    }
    (first,) = g3.whole_grads(model, ids, attn, resp, [smollm2.loss_weights(fn, cfg, old, old, adv, resp, mask)[0]], 4)
    given = [
        p.clone()
        for _, m in g3.drift(model, ids, attn, resp, mask, old, adv, 1e-2, (1,), 4, first=first)
        for p in m.parameters()
    ]
    for k in (1, 2):
        for a, b in zip(got[k], want[k - 1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(given, want[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(got[1], before, strict=True)) > 5e-3  # it moved
    for p, b in zip(model.parameters(), before, strict=True):  # the sampler's model is untouched
        assert torch.equal(p, b)


def test_screen_keeps_pool_order_near_half():
    correct = [0, 4, 8, 2, 6, 1, 7, 5, 3]
    assert g3.screen(correct, 8, need=10) == [1, 3, 4, 7, 8]
    assert g3.screen(correct, 8, need=2) == [1, 3]


def _grad_rows(cos_of):
    """Gradient rows of 8 batches for every arm and drift condition: cos = cos_of(arm index, batch)."""
    rows = []
    for lr, k in g3.conditions():
        for b in g3.BATCHES:
            for i, arm in enumerate(g3.ARMS):
                rows.append({"batch": str(b), "lr": str(lr), "updates": str(k), "arm": arm, "cos": str(cos_of(i, b))})
    return rows


def test_gradient_tests_pair_by_batch_and_holm_within_family():
    def cos_of(i, b):  # W=8 (index 3) best; the correlation criterion 0.05 below it; noise by batch
        return 0.5 + 0.02 * i * (i <= 3) - 0.01 * (i > 3) + 0.001 * ((b * 7 + i) % 5) - 0.05 * (i == 7)

    rows = _grad_rows(cos_of)
    tests = g3.gradient_tests(rows)
    assert len(tests) == 4 * (len(g3.WINDOWS) - 1 + len(g3.ADAPTIVE))
    w4 = next(t for t in tests if t["arm"] == "W=4" and t["lr"] == 1e-6 and t["updates"] == 1)
    d = [cos_of(2, b) - cos_of(0, b) for b in g3.BATCHES]
    assert w4["diff"] == pytest.approx(sum(d) / 8) and w4["vs"] == "W=1"
    assert w4["p_signflip"] == pytest.approx(stats.sign_flip(d)[0])
    assert w4["p_signflip"] == pytest.approx(2 / 256) and w4["outcome"] == "above"
    corr = next(t for t in tests if t["arm"] == "correlation" and t["updates"] == 4)
    assert corr["vs"] == "W=8" and corr["outcome"] == "below"
    g1 = [t for t in tests if t["family"] == "G1/1e-06/1"]
    assert [t["holm"] for t in g1] == pytest.approx(stats.holm([t["p_signflip"] for t in g1]))
    assert len(g1) == 5 and w4["holm"] == pytest.approx(5 * 2 / 256)


def test_best_window_ties_go_to_the_shorter():
    rows = _grad_rows(lambda i, b: 0.3 if i in (2, 4) else 0.1)
    assert g3.best_window(rows, 1e-5, 4) == g3.ARMS[2]


def test_vif_tests_read_the_registered_margin():
    rows = []
    for lr, k in g3.conditions():
        for j, b in enumerate(g3.BATCHES):
            # lr 1e-6: VIF = null + 0.01 +- 0.01 (inside +-0.1: falsified); lr 1e-5: + 0.5 (correlated)
            extra = 0.01 * (j % 3 - 1) + (0.01 if lr == 1e-6 else 0.5)
            rows.append({"batch": b, "lr": lr, "updates": k, "vif5": 1.0 + extra, "null_vif5": 1.0})
            rows[-1] |= {"vif15": 1.1 + extra, "null_vif15": 1.1}
    tests = g3.vif_tests(rows)
    assert len(tests) == 8
    assert all(t["outcome"].startswith("falsified") for t in tests if t["lr"] == 1e-6)
    assert all(t["outcome"] == "correlated" for t in tests if t["lr"] == 1e-5)
    # a batch whose δ had no variance (or only responses under 15 tokens): refused by name, not averaged as NaN
    mask = torch.arange(40) < torch.tensor([[40], [12]])
    assert math.isnan(g3.correlation(torch.zeros(2, 40), mask)["vif5"])
    assert math.isnan(g3.correlation(torch.randn(2, 40), mask & (torch.arange(40) < 12))["vif15"])
    rows[3]["vif15"] = math.nan
    with pytest.raises(ValueError, match=rf"VIF\(15\) undefined for batches \[{rows[3]['batch']}\] at lr"):
        g3.vif_tests(rows)


def test_a_stopped_run_resumes_with_the_missing_batches(tmp_path, monkeypatch):
    """Each finished batch's rows are on disk at once; --resume runs only the batches not there."""
    import argparse

    ran = []

    def one_batch(model, tok, problems, seed, args):
        i = seed - g3.BATCHES[0]
        assert problems == [(f"q{j}", j) for j in range(4 * i, 4 * i + 4)]  # batch i: kept problems 4i .. 4i+3
        ran.append(seed)
        key = {"batch": seed, "lr": 1e-5, "updates": 1}
        corr = [key | {"vif5": 1.2, "null_vif5": 1.0, "vif15": 1.3, "null_vif15": 1.0}]
        grad = [key | {"arm": a, "cos": 0.5 + 0.01 * i} for i, a in enumerate(g3.ARMS)]
        return corr, grad, {"batch": seed, "seconds": 1.0}

    monkeypatch.setattr(g3, "one_batch", one_batch)
    monkeypatch.setattr(g3, "chosen_problems", lambda model, tok, args, out, need: [(f"q{i}", i) for i in range(need)])
    monkeypatch.setattr(smollm2, "load", lambda threads: (None, None, None))
    args = argparse.Namespace(out=str(tmp_path), report=False, resume=False, pieces=1, prompts=4, group=8, threads=1)
    g3.run(args, ["smollm2", "--granularity", "--pieces", "1"])
    assert ran == [200] and "Batches on disk: 1 of 8" in (tmp_path / "README.md").read_text()  # no test yet
    args.resume, args.pieces = True, 2
    g3.run(args, ["smollm2", "--granularity", "--resume", "--pieces", "2"])
    assert ran == [200, 201, 202]
    args.resume, args.pieces = True, 0
    g3.run(args, ["smollm2", "--granularity", "--resume"])
    assert ran == [200, 201, 202, 203, 204, 205, 206, 207]
    batches = g3.read_csv(tmp_path / "batches.csv")
    assert [int(b["batch"]) for b in batches] == list(g3.BATCHES)
    assert len(g3.read_csv(tmp_path / "gradient.csv")) == 8 * len(g3.ARMS)
    g3.run(args, ["smollm2", "--granularity", "--resume"])  # nothing missing: nothing runs
    assert len(ran) == 8
    assert "resumed: python -m maspo_verl.lab smollm2 --granularity --resume" in (tmp_path / "COMMAND.txt").read_text()
    readme = (tmp_path / "README.md").read_text()
    assert "Batches on disk: 8 of 8" in readme and "vif5 - null" in readme


def test_the_guide_reads_part3_as_interim_until_every_batch(tmp_path, monkeypatch):
    """docs/choosing.md's part-3 lines come from the engine's own tables: one batch gives its value and no
    interval, all eight the registered tests with their outcomes and no *interim*."""
    import argparse

    from maspo_verl import choosing

    def one_batch(model, tok, problems, seed, args):
        key = {"batch": seed, "lr": 1e-5, "updates": 4}
        corr = [key | {"vif5": 1.2, "null_vif5": 1.0, "vif15": 1.3, "null_vif15": 1.0}]
        grad = [key | {"arm": a, "cos": 0.5 + 0.01 * i} for i, a in enumerate(g3.ARMS)]
        summary = {"batch": seed, "responses": 32, "reward": 0.5, "length_mean": 40, "ended_by_eos": 0.75, "seconds": 1}
        return corr, grad, summary

    monkeypatch.setattr(g3, "one_batch", one_batch)
    monkeypatch.setattr(g3, "chosen_problems", lambda model, tok, args, out, need: [(f"q{i}", i) for i in range(need)])
    monkeypatch.setattr(smollm2, "load", lambda threads: (None, None, None))
    assert choosing.part3_lines(tmp_path)[0].endswith("no batch finished yet.")
    out = tmp_path / choosing.RESULTS / choosing.PART3
    args = argparse.Namespace(out=str(out), report=False, resume=False, pieces=1, prompts=4, group=8, threads=1)
    g3.run(args, ["smollm2", "--granularity", "--pieces", "1"])
    text = "\n".join(choosing.part3_lines(tmp_path))
    assert "1 of the 8 registered batches (seeds 200-207)" in text and "**Interim**" in text
    assert "75 % ended by EOS" in text and "inside ±0.1" in text
    one = "VIF(5) +0.200 (one batch, no interval)<br>VIF(15) +0.300 (one batch, no interval)"
    assert f"| 1e-05, 4 | {one} | (two batches at least) |" in text
    args.resume, args.pieces = True, 0
    g3.run(args, ["smollm2", "--granularity", "--resume"])
    text = "\n".join(choosing.part3_lines(tmp_path))
    assert "8 of the 8 registered batches" in text and "Interim" not in text
    assert "VIF(5) +0.200 [+0.200, +0.200] → correlated<br>VIF(15) +0.300 [+0.300, +0.300] → correlated" in text
    # G1: every window above W = 1 by 0.01 i on all 8 batches (Holm 5 x 2/256 < 0.05); G3 against the best (W=128)
    assert "W=2: +0.010 [+0.010, +0.010] → above" in text
    assert "correlation − whole: +0.020 [+0.020, +0.020] → above" in text
    # the registered outcome in words, counted from the same tests
    assert "falsified in 0 of 2 VIF tests (interval inside ±0.1); in 2 the interval lies wholly above +0.1" in text
    assert "5 above and 0 below of 5 window tests against W = 1" in text
    assert "the correlation criterion 1 above and 0 below of 1; the band criterion 1 above and 0 below of 1" in text


def test_the_command_writes_its_own_folder(tmp_path, monkeypatch):
    """``lab smollm2 --granularity --update-docs`` writes docs/results/granularity/smollm2; the study's knobs are
    refused without --granularity."""
    from maspo_verl.lab.__main__ import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "results" / "granularity").mkdir(parents=True)
    main(["smollm2", "--granularity", "--update-docs", "--report"])
    readme = (tmp_path / "docs" / "results" / "granularity" / "smollm2" / "README.md").read_text()
    assert "Batches on disk: 0 of 8" in readme
    with pytest.raises(SystemExit, match="only with --granularity"):
        main(["smollm2", "--out", str(tmp_path / "x"), "--resume"])


def test_screening_goes_only_as_far_as_needed_and_resumes(tmp_path, monkeypatch):
    """Pool problems are screened in order, a block at a time, until enough are near 1/2; what is on disk is
    not screened again; the problems returned are the kept ones in pool order."""
    import argparse

    from maspo_verl.pretrained import arith

    pool = arith.problems(g3.POOL_SIZE, g3.POOL_SEED, **g3.ARITH)
    pattern = [0, 4, 8, 3, 5, 1]  # correct of 8 by pool index (repeating): kept 4, 3, 5
    blocks = []

    def prompt_batch(tok, prompts, group):
        return torch.zeros(len(prompts) * group, 2, dtype=torch.long), torch.ones(len(prompts) * group, 2)

    def sample(model, ids, attn, tokens, masked, seed, chunk, pad=None):
        blocks.append(seed - g3.POOL_SEED)  # the block's first pool index
        return torch.zeros(ids.shape[0], 3, dtype=torch.long)

    def grade(tok, resp, mask, answers, group):
        start = blocks[-1]
        return torch.tensor([float(j < pattern[(start + i) % 6]) for i in range(len(answers)) for j in range(group)])

    monkeypatch.setattr(smollm2, "prompt_batch", prompt_batch)
    monkeypatch.setattr(smollm2, "sample", sample)
    monkeypatch.setattr(g3, "grade", grade)
    tok = argparse.Namespace(pad_token_id=PAD, eos_token_id=EOS)
    args = argparse.Namespace(chunk=8)  # blocks of 32 // 8 = 4 problems
    kept = [i for i in range(24) if pattern[i % 6] in (3, 4, 5)]
    got = g3.chosen_problems(None, tok, args, tmp_path, need=4)
    assert got == [pool[i] for i in kept[:4]] and blocks == [0, 4]
    assert [int(r["correct"]) for r in g3.read_csv(tmp_path / "screen.csv")] == [pattern[i % 6] for i in range(8)]
    got = g3.chosen_problems(None, tok, args, tmp_path, need=8)  # resumes after the 8 on disk
    assert got == [pool[i] for i in kept[:8]] and blocks == [0, 4, 8, 12]


def test_one_batch_on_the_tiny_model(tiny, monkeypatch):
    """A whole batch: a correlation row per drift condition, a gradient row per arm; at a vanishing lr nothing
    drifts, so every arm's gradient is its on-policy one: all windows (and both criteria) give the same cosine."""
    import argparse

    model, ids, attn, _ = tiny
    monkeypatch.setattr(smollm2, "prompt_batch", lambda tok, prompts, group: (ids, attn))
    monkeypatch.setattr(g3, "grade", lambda tok, resp, mask, answers, group: torch.tensor([1.0, 0, 0, 1, 1, 0]))
    monkeypatch.setattr(g3, "LRS", (1e-12, 1e-2))
    tok = argparse.Namespace(pad_token_id=PAD, eos_token_id=EOS)
    args = argparse.Namespace(group=3, chunk=4)
    corr, grad, summary = g3.one_batch(model, tok, [("q0", 0), ("q1", 1)], 200, args)
    assert [(r["lr"], r["updates"]) for r in corr] == [(lr, k) for lr in (1e-12, 1e-2) for k in g3.UPDATES]
    assert len(grad) == 4 * len(g3.ARMS) and [r["arm"] for r in grad[: len(g3.ARMS)]] == sorted(
        g3.ARMS, key=lambda a: (a != "maspo_adaptive", "@" in a, g3.ARMS.index(a))
    )
    still = [r["cos"] for r in grad if r["lr"] == 1e-12]
    assert max(still) - min(still) < 1e-4 and 0 < still[0] <= 1 + 1e-9
    moved = [r["cos"] for r in grad if r["lr"] == 1e-2 and r["updates"] == 4]
    assert max(moved) - min(moved) > 1e-3  # drift separates the arms
    assert summary["responses"] == 6 and summary["cpu_s"] > 0 and summary["mixed_groups"] == 2


@pytest.mark.parametrize("part", ["PART2", "PART4"])
def test_the_guide_counts_the_pieces_of_parts_2_and_4(tmp_path, part):
    from maspo_verl import choosing
    from maspo_verl.lab.engine.common import write_csv

    folder = getattr(choosing, part)
    assert choosing.pieces_progress(tmp_path, folder) == "built, not run yet"
    rows = [{"piece": "a", "done": "False"}, {"piece": "b", "done": "False"}, {"piece": "c", "done": "False"}]
    (tmp_path / choosing.RESULTS / folder).mkdir(parents=True)
    write_csv(tmp_path / choosing.RESULTS / folder / "pieces.csv", rows)
    assert choosing.pieces_progress(tmp_path, folder) == "built, not run yet (0 of its 3 listed pieces run)"
    write_csv(tmp_path / choosing.RESULTS / folder / "pieces.csv", [rows[0] | {"done": "True"}, *rows[1:]])
    assert choosing.pieces_progress(tmp_path, folder) == "1 of its 3 listed pieces run"
    (other,) = {"PART2", "PART4"} - {part}
    assert choosing.pieces_progress(tmp_path, getattr(choosing, other)) == "built, not run yet"
