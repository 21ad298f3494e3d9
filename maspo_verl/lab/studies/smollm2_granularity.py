"""Part 3 of the registered granularity study (docs/results/granularity/PREREGISTRATION.md): SmolLM2-135M's
token log-ratios and loss gradients at realistic drift. ``python -m maspo_verl.lab smollm2 --granularity``.

Per batch (seeds 200-207, one resumable piece each): ``--prompts`` arithmetic problems from those whose accuracy
on a separate screening pool is near 1/2, ``--group`` responses each, sampled at temperature 1 over the whole
vocabulary with natural lengths (ended by EOS, at most 128 tokens; EOS is a response token). Then:

1. Drift: the whole model after 1 and 4 Adam updates on grpo's loss of this batch (old log-probs: the
   sampler's) at lr 1e-6 and 1e-5. δ = log pi_k - log pi_old on the response tokens; its lag-1 and VIF(5/15)
   (``maspo_verl.core.metrics``, the loss's own metric) beside the mean over ``NULL_DRAWS`` within-row
   permutations of the same δ (the null: same values, no order).
2. Gradients: at each drifted model, each arm's loss at its shipped band (old = the sampler's log-probs), its
   whole-model gradient; cosine to the on-policy whole-batch grpo gradient at the sampler's weights.

The analysis: the VIF minus its null, t-interval over batches; each window minus W = 1 and each adaptive
criterion minus the best window (by mean cosine), paired by batch, t-interval, exact sign-flip p, Holm within
each family (``maspo_verl.lab.engine.stats``).
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch

from maspo_verl.lab.engine import journal, smollm2, stats
from maspo_verl.lab.engine.common import log, markdown_table, read_csv, write_csv
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    None,
    "part 3 of the pre-registered granularity study: SmolLM2-135M's gradients per arm",
    folder="granularity/smollm2",
    writes=("README.md", "tests.csv", "design.csv"),
)

FOLDER = STUDY.folder
BATCHES = tuple(range(200, 208))
TOKENS = 128  # the longest response
LRS = (1e-6, 1e-5)
UPDATES = (1, 4)
WINDOWS = (1, 2, 4, 8, 16, TOKENS)  # TOKENS: one segment per response (the whole response)
ADAPTIVE = ("maspo_adaptive", "maspo_adaptive@adaptive_criterion=correlation")
ARMS = tuple(f"maspo_fixed@segment_window={w}" for w in WINDOWS) + ADAPTIVE
# the screening pool: its problems and its samples come from this seed, no batch's
POOL_SEED, POOL_SIZE, SCREEN = 5200, 512, 8
NEAR = 0.25  # a pool problem is kept when |accuracy - 1/2| <= NEAR on its SCREEN samples
ARITH = {"steps": 1, "max_operand": 5}  # the smollm2 model config's task (hydra_configs/model/smollm2.yaml)
NULL_DRAWS = 16
# arms whose whole-model gradients share one forward pass (each holds a buffer of the model's size): pairs bound the
# memory for a little more gradient time than all arms at once
ARM_GROUP = 2
VIF_MARGIN = 0.1  # registered: no correlation if the interval of VIF - null lies inside +-0.1


def arm_name(arm: str) -> str:
    if arm.startswith("maspo_fixed@segment_window="):
        w = int(arm.rpartition("=")[2])
        return "whole" if w == TOKENS else f"W={w}"
    return "correlation" if "correlation" in arm else arm


def conditions() -> list[tuple[float, int]]:
    return [(lr, k) for lr in LRS for k in UPDATES]


# ------------------------------------------------------------------ pieces (tested on a tiny model)


def response_mask(resp: torch.Tensor, eos: int) -> torch.Tensor:
    """The response tokens: up to and including the first ``eos`` of each row (the whole row without one)."""
    is_eos = (resp == eos).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


def permuted(delta: torch.Tensor, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``delta`` with each row's response tokens (a prefix, ``mask``) in a random order; other tokens kept."""
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("permuted: each row's mask must be a prefix")
    keys = torch.rand(delta.shape, generator=gen).masked_fill(~mask, math.inf)
    return delta.gather(-1, keys.argsort(-1))


def correlation(delta: torch.Tensor, mask: torch.Tensor) -> dict:
    """lag-1 and VIF(5/15) of ``delta`` on ``mask`` (``maspo_verl.core.metrics``); NaN where one is undefined (no
    variance in ``delta``, or no response as long as the window): ``vif_tests`` refuses such rows."""
    from maspo_verl.core.metrics import correlation_metrics, correlation_sums, host_sums

    m = correlation_metrics(host_sums(correlation_sums(delta.double(), mask)), prefix="")
    return {"lag1": m.get("corr_lag1", math.nan), "vif5": m.get("vif5", math.nan), "vif15": m.get("vif15", math.nan)}


def correlation_row(delta: torch.Tensor, mask: torch.Tensor, seed: int) -> dict:
    """``correlation`` of δ, and its mean over ``NULL_DRAWS`` within-row permutations (``null_*``)."""
    gen = torch.Generator().manual_seed(seed)
    nulls = [correlation(permuted(delta, mask, gen), mask) for _ in range(NULL_DRAWS)]
    null = {f"null_{k}": sum(n[k] for n in nulls) / len(nulls) for k in nulls[0]}
    return {"delta_sd": float(delta[mask].std()), **correlation(delta, mask), **null}


def screen(correct: list[int], samples: int, need: int) -> list[int]:
    """Pool indices kept, in pool order: accuracy within ``NEAR`` of 1/2; the first ``need`` of them."""
    kept = [i for i, c in enumerate(correct) if abs(c / samples - 0.5) <= NEAR]
    return kept[:need]


def log_probs(model, ids, attn, resp, chunk: int) -> torch.Tensor:
    """Log-probs [N, T] of ``resp`` after the prompts, no grad."""
    with torch.no_grad():
        return torch.cat([_chunk_log_probs(model, ids, attn, resp, s, chunk) for s in range(0, len(ids), chunk)])


def _chunk_log_probs(model, ids, attn, resp, s: int, chunk: int) -> torch.Tensor:
    P, T = ids.shape[1], resp.shape[1]
    seq = torch.cat([ids[s : s + chunk], resp[s : s + chunk]], 1)
    mask = torch.cat([attn[s : s + chunk], torch.ones_like(resp[s : s + chunk])], 1)
    hidden = model.model(input_ids=seq, attention_mask=mask).last_hidden_state[:, P - 1 : P - 1 + T]
    lp = torch.log_softmax(model.lm_head(hidden).float(), -1)
    return lp.gather(-1, resp[s : s + chunk].unsqueeze(-1)).squeeze(-1)


def whole_grads(model, ids, attn, resp, weights: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    """For each ``weights`` c [N, T]: the gradient of sum(c * log pi(resp)) over every parameter of the model,
    flattened (one forward per chunk, one backward per c): the gradient of any loss whose derivative wrt the
    token log-probs is c."""
    params = [p for p in model.parameters()]
    out = [torch.zeros(sum(p.numel() for p in params)) for _ in weights]
    with torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        try:
            for s in range(0, len(ids), chunk):
                lp = _chunk_log_probs(model, ids, attn, resp, s, chunk)
                for i, c in enumerate(weights):
                    g = torch.autograd.grad(lp, params, c[s : s + chunk], retain_graph=i < len(weights) - 1)
                    out[i] += torch.cat([x.flatten() for x in g])
        finally:
            for p in params:
                p.requires_grad_(False)
    return out


def drift(model, ids, attn, resp, mask, old, adv, lr: float, stop_at, chunk: int, first=None):
    """A copy of ``model`` after each of ``stop_at`` Adam updates of every parameter on grpo's loss of this
    batch (old log-probs ``old``, the sampler's): yields (k, model), the copy going on after each yield.
    ``first``: the first update's gradient (grpo's on-policy gradient at ``model``), where known."""
    fn, cfg = grpo_loss()
    m = copy.deepcopy(model)
    params = list(m.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    for k in range(1, max(stop_at) + 1):
        if k == 1 and first is not None:
            g = first
        else:
            lp = old if k == 1 else log_probs(m, ids, attn, resp, chunk)
            c, _ = smollm2.loss_weights(fn, cfg, old, lp, adv, resp, mask)
            (g,) = whole_grads(m, ids, attn, resp, [c], chunk)
        start = 0
        for p in params:
            p.grad = g[start : start + p.numel()].view_as(p).clone()
            start += p.numel()
        opt.step()
        for p in params:
            p.grad = None
        if k in stop_at:
            yield k, m


def grpo_loss():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.presets import discover_presets, preset_config

    grpo = discover_presets(["grpo"])[0]
    return get_policy_loss_fn(grpo.loss_mode), preset_config(grpo)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


# ------------------------------------------------------------------ one batch


def grade(tok, resp, mask, answers: list[int], group: int) -> torch.Tensor:
    """math-verify's score of each response's text (its response tokens)."""
    from maspo_verl.math.reward import compute_score

    texts = [tok.decode(row[m], skip_special_tokens=True) for row, m in zip(resp, mask, strict=True)]
    return torch.tensor(
        [compute_score("maspo_arith", t, str(answers[i // group]))["score"] for i, t in enumerate(texts)]
    )


def one_batch(model, tok, problems, seed: int, args) -> tuple[list[dict], list[dict], dict]:
    """The correlation rows, gradient rows and a summary of batch ``seed``."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.presets import preset_config, presets_of

    t0, cpu0 = time.time(), time.process_time()
    ids, attn = smollm2.prompt_batch(tok, [arith_prompt(q) for q, _ in problems], args.group)
    prompt_of = torch.arange(len(problems)).repeat_interleave(args.group)
    resp = smollm2.sample(model, ids, attn, TOKENS, [], seed, args.chunk * 4, pad=tok.pad_token_id)
    mask = response_mask(resp, tok.eos_token_id)
    r = grade(tok, resp, mask, [a for _, a in problems], args.group)
    adv = smollm2.advantages(r, prompt_of, mask)
    old = log_probs(model, ids, attn, resp, args.chunk)
    summary = {
        "batch": seed,
        "responses": len(resp),
        "reward": float(r.mean()),
        "mixed_groups": int(sum(0 < float(r[prompt_of == i].mean()) < 1 for i in range(len(problems)))),
        "length_mean": float(mask.sum(-1).float().mean()),
        "length_max": int(mask.sum(-1).max()),
        "ended_by_eos": float((resp == tok.eos_token_id).any(-1).float().mean()),
        "sample_s": time.time() - t0,
    }
    log(f"smollm2 granularity: batch {seed}: reward {summary['reward']:.3f}, length {summary['length_mean']:.1f}")
    fn, cfg = grpo_loss()
    c_ref, _ = smollm2.loss_weights(fn, cfg, old, old, adv, resp, mask)
    (ref,) = whole_grads(model, ids, attn, resp, [c_ref], args.chunk)
    arms = presets_of(list(ARMS))
    corr, grad = [], []
    for lr in LRS:
        for k, m in drift(model, ids, attn, resp, mask, old, adv, lr, UPDATES, args.chunk, first=ref):
            key = {"batch": seed, "lr": lr, "updates": k}
            cur = log_probs(m, ids, attn, resp, args.chunk)
            corr.append(key | correlation_row((cur - old).masked_fill(~mask, 0.0), mask, seed))
            weights, found = [], []
            for arm in arms:
                c, metrics = smollm2.loss_weights(
                    get_policy_loss_fn(arm.loss_mode), preset_config(arm), old, cur, adv, resp, mask
                )
                weights.append(c)
                found.append(metrics)
            for i in range(0, len(arms), ARM_GROUP):  # a group's gradients at a time (memory: ARM_GROUP)
                part = slice(i, i + ARM_GROUP)
                grads = whole_grads(m, ids, attn, resp, weights[part], args.chunk)
                for arm, g, metrics in zip(arms[part], grads, found[part], strict=True):
                    grad.append(
                        key
                        | {
                            "arm": arm.name,
                            "cos": cosine(g, ref),
                            "norm_ratio": float(g.norm() / ref.norm()),
                            "clipfrac": float(metrics.get("actor/pg_clipfrac", math.nan)),
                            "segment_len": float(metrics.get("actor/ratio/segment_len_mean", math.nan)),
                        }
                    )
            log(
                f"smollm2 granularity: batch {seed} lr {lr} k {k}: vif15 {corr[-1]['vif15']:.3f}"
                f" ({time.time() - t0:.0f}s)"
            )
    summary["seconds"] = time.time() - t0
    summary["cpu_s"] = time.process_time() - cpu0  # CPU time of the process (wall time depends on the load)
    return corr, grad, summary


def arith_prompt(question: str):
    from maspo_verl.pretrained import arith

    return arith.prompt(question)


# ------------------------------------------------------------------ screening, the run, resume


def chosen_problems(model, tok, args, out: Path, need: int) -> list[tuple[str, int]]:
    """The first ``need`` problems near 50 % accuracy, screened in pool order as far as needed (``screen.csv``,
    reused on resume: the same pool, seeds and order give the same problems whenever they are screened)."""
    from maspo_verl.pretrained import arith

    pool = arith.problems(POOL_SIZE, POOL_SEED, **ARITH)
    rows = read_csv(out / "screen.csv")
    block = args.chunk * 4 // SCREEN or 1  # problems per screening generate call
    while len(screen([int(x["correct"]) for x in rows], SCREEN, need)) < need:
        start = len(rows)
        if start >= POOL_SIZE:
            raise SystemExit(f"screening: {POOL_SIZE} pool problems give fewer than {need} near 50 % accuracy")
        batch = pool[start : start + block]
        ids, attn = smollm2.prompt_batch(tok, [arith_prompt(q) for q, _ in batch], SCREEN)
        resp = smollm2.sample(model, ids, attn, TOKENS, [], POOL_SEED + start, args.chunk * 4, pad=tok.pad_token_id)
        r = grade(tok, resp, response_mask(resp, tok.eos_token_id), [a for _, a in batch], SCREEN)
        rows += [
            {
                "pool_index": start + i,
                "question": q,
                "answer": a,
                "correct": int(r[i * SCREEN : (i + 1) * SCREEN].sum()),
            }
            for i, (q, a) in enumerate(batch)
        ]
        write_csv(out / "screen.csv", rows)
        log(f"smollm2 granularity: screened {len(rows)} pool problems ({time.process_time():.0f} s CPU so far)")
    kept = screen([int(x["correct"]) for x in rows], SCREEN, need)
    return [(rows[i]["question"], int(rows[i]["answer"])) for i in kept]


def run(args, argv: list[str]) -> None:

    out = Path(args.out)
    if args.report:
        return report(out)
    if args.resume and journal.read(out):
        journal.again(out, argv)
    else:
        journal.start(out, argv)
        for name in ("screen.csv", "correlation.csv", "gradient.csv", "batches.csv"):
            (out / name).unlink(missing_ok=True)
    tables = {n: read_csv(out / f"{n}.csv") for n in ("correlation", "gradient", "batches")}
    done = {int(b["batch"]) for b in tables["batches"]}
    todo = [b for b in BATCHES if b not in done][: args.pieces or None]
    if todo:
        model, tok, _ = smollm2.load(args.threads)
    for b in todo:
        i = BATCHES.index(b)
        problems = chosen_problems(model, tok, args, out, (i + 1) * args.prompts)[i * args.prompts :]
        corr, grad, summary = one_batch(model, tok, problems, b, args)
        # a batch's rows reach the disk together, the summary (what --resume reads) last
        for name, rows in (("correlation", corr), ("gradient", grad), ("batches", [summary])):
            tables[name] = [x for x in tables[name] if int(x["batch"]) != b] + rows
            write_csv(out / f"{name}.csv", tables[name])
        log(f"smollm2 granularity: batch {b} done in {summary['seconds']:.0f}s")
    report(out)


# ------------------------------------------------------------------ the registered tests


def vif_tests(corr: list[dict]) -> list[dict]:
    """VIF(n) minus its permutation null per drift condition: t-interval over batches, the registered reading."""
    out = []
    for lr, k in conditions():
        rows = [r for r in corr if (float(r["lr"]), int(r["updates"])) == (lr, k)]
        for n in (5, 15):
            d = [float(r[f"vif{n}"]) - float(r[f"null_vif{n}"]) for r in rows]
            undefined = [int(r["batch"]) for r, x in zip(rows, d, strict=True) if math.isnan(x)]
            if undefined:  # no variance in δ, or every response under n tokens: a NaN would pass into the mean
                raise ValueError(f"vif_tests: VIF({n}) undefined for batches {undefined} at lr {lr}, {k} updates")
            if len(d) < 2:  # an interval needs two batches
                continue
            s = stats.paired_summary(d)
            inside = -VIF_MARGIN < s["low"] and s["high"] < VIF_MARGIN
            verdict = "falsified (inside ±0.1)" if inside else ("correlated" if s["low"] >= VIF_MARGIN else "—")
            out.append({"lr": lr, "updates": k, "measure": f"vif{n} - null", **s, "outcome": verdict})
    return out


def best_window(grad: list[dict], lr: float, k: int) -> str:
    """The window with the best mean cosine over the batches (ties: the shorter)."""
    means = {a: _mean_cos(grad, lr, k, a) for a in ARMS if a not in ADAPTIVE}
    return max(means, key=lambda a: (means[a], -ARMS.index(a)))


def _mean_cos(grad, lr, k, arm) -> float:
    v = [float(r["cos"]) for r in _rows(grad, lr, k, arm)]
    return sum(v) / len(v) if v else -math.inf


def _rows(grad, lr, k, arm) -> list[dict]:
    return [r for r in grad if (float(r["lr"]), int(r["updates"]), r["arm"]) == (lr, k, arm)]


def gradient_tests(grad: list[dict]) -> list[dict]:
    """G1: each window minus W = 1; G3: each adaptive criterion minus the best window; paired by batch, Holm
    within each family: one drift condition's comparisons of one kind (``family``: G1 or G3 / lr / updates)."""
    out = []
    for lr, k in conditions():
        best = best_window(grad, lr, k)
        pairs = [("G1", a, ARMS[0]) for a in ARMS[1 : len(WINDOWS)]] + [("G3", a, best) for a in ADAPTIVE]
        for family, a, b in pairs:
            mine = {int(r["batch"]): float(r["cos"]) for r in _rows(grad, lr, k, a)}
            theirs = {int(r["batch"]): float(r["cos"]) for r in _rows(grad, lr, k, b)}
            d = [mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys())]
            if len(d) >= 2:
                row = {"family": f"{family}/{lr:g}/{k}", "lr": lr, "updates": k, "arm": arm_name(a), "vs": arm_name(b)}
                out.append(row | stats.paired_summary(d))
    stats.holm_by(out, "family", "p_signflip", "holm")
    for r in out:
        r["outcome"] = "—" if r["holm"] >= 0.05 else ("above" if r["diff"] > 0 else "below")
    return out


def mean_cosines(grad: list[dict]) -> list[dict]:
    """Descriptive: each arm's mean cosine over the batches on disk, per drift condition (no rows before the first
    batch: a batch writes every condition and arm at once)."""
    if not grad:
        return []
    out = []
    for lr, k in conditions():
        row = {"lr": lr, "updates": k}
        for a in ARMS:
            v = [float(r["cos"]) for r in _rows(grad, lr, k, a)]
            row[arm_name(a)] = sum(v) / len(v) if v else math.nan
        out.append(row)
    return out


def report(out: Path) -> None:
    from maspo_verl.lab.engine.common import report_written

    out.mkdir(parents=True, exist_ok=True)
    corr, grad, batches = (read_csv(out / f"{n}.csv") for n in ("correlation", "gradient", "batches"))
    vif, g = vif_tests(corr), gradient_tests(grad)
    write_csv(out / "tests.csv", [r | {"test": "vif"} for r in vif] + [r | {"test": "gradient"} for r in g])
    write_csv(out / "design.csv", design())
    (out / "README.md").write_text(readme(out, batches, corr, grad, vif, g))
    report_written(out)


def design() -> list[dict]:
    """The registered design that ``docs/choosing.md`` reads (it imports nothing of the package)."""
    rows = {"batches": f"{BATCHES[0]}-{BATCHES[-1]}", "batch_count": len(BATCHES), "vif_margin": VIF_MARGIN}
    return [{"key": k, "value": v} for k, v in rows.items()]


DEVIATIONS = (
    "Ambiguous in the registration, read as: *prompts near 50 % accuracy, chosen on a separate pool* = a pool of "
    f"{POOL_SIZE} problems (seed {POOL_SEED}, the smollm2 model config's task: one step, operands up to 5) is screened "
    f"in order with {SCREEN} samples each (their own sampling seeds, never a batch's); the first problems with "
    f"|accuracy - 1/2| <= {NEAR} are kept, `--prompts` (4) per batch in batch order; each batch samples its "
    "responses "
    "afresh with its own seed.",
    "Ambiguous: *whole* is `maspo_fixed@segment_window=128` (one segment per response: no response is longer); "
    "*the best window* (for the adaptive criteria) is chosen by mean cosine on the same 8 batches (the registration "
    "names no tuning batches for part 3); the families (G1: windows minus W = 1; G3: criteria minus the best "
    "window) are taken per drift condition (lr, updates): 5 and 2 tests. Across the four conditions (20 tests) no "
    "test could pass Holm with 8 batches (20 x 2/256 > 0.05); per condition the smallest Holm p is 5 x 2/256 = "
    "0.039. Chosen before any batch ran.",
    "Ambiguous: the VIF null is the mean over 16 within-row permutations of each batch's δ (one draw is noisier); "
    "the registration names only its falsifying reading (the interval of VIF minus null inside ±0.1); an interval "
    "above +0.1 is reported as *correlated*, anything else as —.",
)


def readme(out: Path, batches, corr, grad, vif, tests) -> str:
    """The report: the rows on disk (``batches``, ``corr``, ``grad``) and the registered tests (``vif``, ``tests``)."""

    command = journal.read(out).strip()
    screened = read_csv(out / "screen.csv")
    lines = [
        "# Granularity study, part 3: SmolLM2-135M gradients at realistic drift",
        "",
        "Registered in [`../PREREGISTRATION.md`](../PREREGISTRATION.md) (part 3); engine "
        "`maspo_verl/lab/studies/smollm2_granularity.py` (what each number is: its docstring), tests "
        "`maspo_verl/lab/engine/stats.py`. "
        f"Batches on disk: {len(batches)} of {len(BATCHES)} (seeds {BATCHES[0]}-{BATCHES[-1]}); pool problems "
        f"screened: {len(screened)}, kept (|accuracy - 1/2| <= {NEAR} on {SCREEN} samples): "
        f"{len(screen([int(r['correct']) for r in screened], SCREEN, len(screened)))}. Every registered test "
        "whose data exist is below; with fewer than 8 batches the sign-flip p cannot reach the registered power "
        "(8 batches: smallest p 2/256).",
        "",
        "```",
        command,
        "```",
        "",
        "## Batches",
        "",
        markdown_table(
            batches,
            [
                "batch",
                "responses",
                "reward",
                "mixed_groups",
                "length_mean",
                "length_max",
                "ended_by_eos",
                "seconds",
                "cpu_s",
            ],
        ),
        "",
        "## Measured correlation: VIF(n) of δ minus its within-row permutation null, t-interval over batches",
        "",
        "Per batch (`null_*`: the mean over the within-row permutations):",
        "",
        markdown_table(
            corr, ["batch", "lr", "updates", "delta_sd", "lag1", "vif5", "null_vif5", "vif15", "null_vif15"]
        ),
        "",
        "The registered test (two batches at least):",
        "",
        markdown_table(vif, ["lr", "updates", "measure", "seeds", "diff", "low", "high", "p_signflip", "outcome"]),
        "",
        "## Gradient cosine to the on-policy whole-batch gradient, each arm at its shipped band",
        "",
        "Mean cosine over the batches on disk (descriptive):",
        "",
        markdown_table(mean_cosines(grad)),
        "",
        "G1: window W minus W = 1; G3: each `maspo_adaptive` criterion minus the best window (by mean cosine). "
        "Paired by batch; exact sign-flip p; Holm within each family.",
        "",
        markdown_table(
            tests,
            ["family", "lr", "updates", "arm", "vs", "seeds", "diff", "low", "high", "p_signflip", "holm", "outcome"],
        ),
        "",
        "## Deviations from the pre-registration",
        "",
        *[f"- {d}" for d in (*DEVIATIONS, *journal.deviations(out))],
        "",
        "Files: `screen.csv` (the screening pool), `batches.csv`, `correlation.csv` (per batch and drift), "
        "`gradient.csv` (per batch, drift and arm), `tests.csv`.",
    ]
    return "\n".join(lines) + "\n"
