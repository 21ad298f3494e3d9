"""How the decoupled-mode rollout weight πold/πrollout behaves against the number of turns, on the local mode's
multi-turn toy environment with a real rollout/training mismatch (no training: sample, score, weigh).

``python -m maspo_verl.local.correction_study --turns 2 4 8 16 32 64 --episodes 256 --out <folder>``

Episodes are sampled as the toy agent loop samples them (``maspo_verl.local.turns``: prompt, then turns of
``turn_tokens`` tokens with the environment's observations between them, masked) from the *rollout* policy,
which reports its own log-probs; the *trainer* policy scores the same tokens in fp32, as verl's actor does in
decoupled mode. Two mismatches, each a different policy from the trainer's:

- ``bf16``: the rollout runs the same weights in bfloat16 (the local HF server's ``maspo.local_mismatch.
  logprob_dtype=bf16``; an inference engine in bf16), log-softmax in fp32;
- ``stale``: the rollout runs a stale copy: the trainer's weights minus ``--stale-step`` times a fixed random
  direction of unit RMS per tensor, scaled by each tensor's RMS (a proxy for the policy one update ago).

Per mismatch and turn count: the weight per token, per turn (``rollout_is=segment`` with the ``turns`` rule)
and per episode (verl's ``sequence``), each before any cap: mean, normalised ESS (Σw)²/(nΣw²) over that
level's units, the share of units a TIS cap of 2 changes, and the median log-weight. Written to
``weights.csv`` and a README table.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

from maspo_verl.local import turns as env

CAP = 2.0


def load(seed: int, cache_dir=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maspo_verl.local.assets import ensure_assets

    path = ensure_assets(seed=seed, cache_dir=cache_dir)["model"]
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


def rollout_model(trainer, kind: str, stale_step: float, seed: int):
    import copy

    model = copy.deepcopy(trainer)
    if kind == "bf16":
        return model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        for p in model.parameters():
            direction = torch.randn(p.shape, generator=g)
            p.sub_(stale_step * p.detach().pow(2).mean().sqrt() * direction)
    return model


def sample_episodes(model, tokenizer, refs: list[str], n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``n`` episodes from ``model`` (batched, with a KV cache), as the toy loop builds them: (input ids
    [n, P + R], response mask [n, R], rollout log-probs [n, R], prompt length)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": env.prompt_text(refs[0])}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ids = torch.tensor([prompt] * n)
    mask, logps = [], []
    g = torch.Generator().manual_seed(seed)
    past, fed = None, 0
    with torch.inference_mode():
        for k, ref in enumerate(refs):
            if k:
                obs = torch.tensor([env.observation_ids(ref)] * n)
                ids = torch.cat([ids, obs], 1)
                mask += [0] * obs.shape[1]
                logps.append(torch.zeros(n, obs.shape[1]))
            for _ in range(len(ref)):
                out = model(input_ids=ids[:, fed:], past_key_values=past, use_cache=True)
                past, fed = out.past_key_values, ids.shape[1]
                logits = out.logits[:, -1].float()
                lp = torch.log_softmax(logits, -1)
                token = torch.multinomial(lp.exp(), 1, generator=g)
                ids = torch.cat([ids, token], 1)
                mask.append(1)
                logps.append(lp.gather(-1, token))
    return ids, torch.tensor(mask).expand(n, -1), torch.cat(logps, 1), len(prompt)


def trainer_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def summary(log_w: torch.Tensor) -> dict[str, float]:
    """Statistics of weights exp(log_w) (log_w clamped to +-20 as verl does) over the given units."""
    w = torch.exp(log_w.double().clamp(-20, 20))
    return {
        "mean": w.mean().item(),
        "ess": (w.sum() ** 2 / (w.numel() * (w * w).sum())).item(),
        "capped": (w > CAP).double().mean().item(),
        "median_log": log_w.double().median().item(),
        "p05": torch.quantile(w, 0.05).item(),
        "p95": torch.quantile(w, 0.95).item(),
    }


def measure(trainer, rollout, tokenizer, n_turns: int, turn_tokens: int, episodes: int, seed: int) -> dict:
    from maspo_verl.rollout_correction import CorrectionSettings, segment_ids, segment_reduce, segment_slots_valid

    refs = env.references(seed, n_turns, turn_tokens)
    ids, mask, rollout_lp, prompt_len = sample_episodes(rollout, tokenizer, refs, episodes, seed)
    delta = (trainer_logprobs(trainer, ids, prompt_len) - rollout_lp).double() * mask
    settings = CorrectionSettings.from_mapping({"rollout_is": "segment"}, ())
    seg = segment_ids(mask, settings, None)
    per_turn = segment_reduce(delta, mask.double(), seg, "sum")[segment_slots_valid(mask, seg)]
    out = {}
    for level, log_w in (("token", delta[mask.bool()]), ("turn", per_turn), ("sequence", delta.sum(-1))):
        out.update({f"{level}_{k}": v for k, v in summary(log_w).items()})
    out["token_abs_log_ratio_mean"] = delta[mask.bool()].abs().mean().item()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--turn-tokens", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--mismatch", nargs="+", default=["bf16", "stale"], choices=["bf16", "stale"])
    parser.add_argument("--stale-step", type=float, nargs="+", default=[0.05], help="one stale copy per value")
    parser.add_argument("--seeds", type=int, default=1, help="model seeds (each a different embedded model)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.time()
    for seed in range(args.seeds):
        trainer, tokenizer = load(seed)
        kinds = [(k, s) for k in args.mismatch for s in (args.stale_step if k == "stale" else [0.0])]
        for kind, step in kinds:
            rollout = rollout_model(trainer, kind, step, seed)
            label = kind if kind == "bf16" else f"stale {step:g}"
            for n in args.turns:
                row = {
                    "seed": seed,
                    "mismatch": label,
                    "turns": n,
                    "turn_tokens": args.turn_tokens,
                    "episodes": args.episodes,
                }
                row.update(measure(trainer, rollout, tokenizer, n, args.turn_tokens, args.episodes, seed))
                rows.append(row)
                print(
                    f"{label} turns={n}: seq mean {row['sequence_mean']:.4f} ess {row['sequence_ess']:.4f} | "
                    f"turn mean {row['turn_mean']:.4f} ess {row['turn_ess']:.4f} | token ess {row['token_ess']:.4f}",
                    flush=True,
                )
    with open(args.out / "weights.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{len(rows)} rows in {time.time() - start:.0f} s -> {args.out / 'weights.csv'}")
    (args.out / "weights_table.md").write_text(table(rows) + "\n")


COLUMNS = (
    ("token_abs_log_ratio_mean", "mean abs log-ratio per token", ".2e"),
    ("token_ess", "token ESS", ".4f"),
    ("turn_mean", "turn mean", ".4f"),
    ("turn_ess", "turn ESS", ".4f"),
    ("turn_capped", "turn capped", ".3f"),
    ("sequence_mean", "seq mean", ".4f"),
    ("sequence_ess", "seq ESS", ".4f"),
    ("sequence_capped", "seq capped", ".3f"),
    ("sequence_median_log", "seq median log w", "+.3f"),
)


def table(rows: list[dict]) -> str:
    """Per mismatch and turn count, the mean over model seeds of each column of ``COLUMNS``."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["mismatch"], int(r["turns"]), int(r["turn_tokens"])), []).append(r)
    head = "| mismatch | turns | tokens | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for (mismatch, n, tokens), rs in groups.items():
        cells = [format(sum(float(r[k]) for r in rs) / len(rs), f) for k, _, f in COLUMNS]
        lines.append(f"| {mismatch} | {n} | {n * tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
