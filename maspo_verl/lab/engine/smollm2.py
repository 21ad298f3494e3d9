"""SmolLM2-135M-Instruct as the lab's real pretrained policy, which the smollm2 studies share: loading it, prompt
batches, sampling responses of exactly a given length (its end tokens masked in sampling and in every log-prob
alike, so the samples are exactly on-policy), their log-probs, the last MLP's exact per-token gradient parts,
rewards, GRPO advantages within each prompt's group, and a loss's per-token weights as verl's ``ppo_loss`` calls
it."""

from __future__ import annotations

import math

import torch

from maspo_verl.lab.engine import presets
from maspo_verl.lab.engine.presets import preset_config

# ------------------------------------------------------------------ model, samples, log-probs


def load(threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maspo_verl.pretrained import smollm2

    torch.set_num_threads(threads)
    path = smollm2.ensure_model()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    if model.config.hidden_act != "silu":
        raise RuntimeError(f"mlp_token_parts assumes a SiLU-gated MLP, the model has {model.config.hidden_act}")
    return model, tok, path


def masked_ids(tok) -> list[int]:
    """Tokens the study's policy never emits (so every response has its full length)."""
    return sorted({tok.eos_token_id, tok.pad_token_id})


def prompt_batch(tok, prompts: list[list[dict]], group: int):
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids.repeat_interleave(group, 0), enc.attention_mask.repeat_interleave(group, 0)


def sample(model, ids, attn, tokens: int, masked: list[int], seed: int, chunk: int, pad: int | None = None):
    """Responses sampled at temperature 1 over the whole vocabulary but ``masked``: with ``masked`` (the end
    tokens) exactly ``tokens`` each, [N, tokens]; with none, each ended by EOS (or ``tokens``) and ``pad`` after
    it, [N, <= tokens]."""
    ends = {"min_new_tokens": tokens, "suppress_tokens": masked, "pad_token_id": masked[0]} if masked else {}
    torch.manual_seed(seed)
    out = []
    for s in range(0, ids.shape[0], chunk):
        with torch.no_grad():
            seq = model.generate(
                input_ids=ids[s : s + chunk],
                attention_mask=attn[s : s + chunk],
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=tokens,
                **(ends or {"pad_token_id": pad}),
            )
        out.append(seq[:, ids.shape[1] :])
    width = max(r.shape[1] for r in out)
    resp = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad or 0) for r in out])
    if masked and resp.shape[1] != tokens:
        raise RuntimeError(f"sampled {resp.shape[1]} tokens, expected {tokens}")
    return resp


def log_probs(model, ids, attn, resp, masked: list[int], chunk: int, parts: bool = False):
    """Log-probs [N, T] of ``resp`` after the prompts, in the model's own dtype; with ``parts`` also each
    response token's factors of the gradient of its log-prob wrt the last decoder layer's MLP."""
    mlp = model.model.layers[-1].mlp
    P, T = ids.shape[1], resp.shape[1]
    lps, found = [], []
    captured = {}

    def hook(module, args, output):
        captured["x"] = args[0]
        if parts:  # a leaf for the log-probs' gradient wrt this layer's MLP output
            captured["y"] = output.detach().float().requires_grad_()
            return captured["y"].to(output.dtype)
        return output

    handle = mlp.register_forward_hook(hook)
    try:
        for s in range(0, ids.shape[0], chunk):
            seq = torch.cat([ids[s : s + chunk], resp[s : s + chunk]], 1)
            mask = torch.cat([attn[s : s + chunk], torch.ones_like(resp[s : s + chunk])], 1)
            with torch.set_grad_enabled(parts):
                hidden = model.model(input_ids=seq, attention_mask=mask).last_hidden_state[:, P - 1 : P - 1 + T]
                logits = model.lm_head(hidden).float()
                logits[..., masked] = -math.inf
                lp = torch.log_softmax(logits, -1).gather(-1, resp[s : s + chunk].unsqueeze(-1)).squeeze(-1)
            if parts:
                (g,) = torch.autograd.grad(lp.sum(), captured["y"])
                x = captured["x"].detach().float()[:, P - 1 : P - 1 + T]
                found.append(mlp_token_parts(mlp, x, g[:, P - 1 : P - 1 + T]))
            lps.append(lp.detach())
    finally:
        handle.remove()
    lp = torch.cat(lps)
    if not parts:
        return lp
    return lp, {k: torch.cat([f[k] for f in found]) for k in found[0]}


# ------------------------------------------------------------------ per-token gradients of the last MLP


def mlp_token_parts(mlp, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Factors of d lp_t / d(W_gate, W_up, W_down) of a SiLU-gated MLP down(silu(gate x) * up x), for
    inputs ``x`` [..., H] and ``g`` = d lp_t / d(MLP output) [..., H] of each token t. Each token's
    output reaches only its own log-prob (the last layer), so these are exact per-token gradients."""
    wg, wu, wd = (m.weight.float() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    gate, up = x @ wg.T, x @ wu.T
    sig = torch.sigmoid(gate)
    act = gate * sig
    u = g @ wd  # d lp / d(act * up)
    dsilu = sig * (1 + gate * (1 - sig))
    return {"x": x, "g": g, "a": act * up, "p": u * up * dsilu, "q": u * act}


def mlp_grad(parts: dict[str, torch.Tensor], c: torch.Tensor) -> torch.Tensor:
    """sum_t c_t d lp_t / d(W_gate, W_up, W_down), flattened: the gradient of a loss whose derivative wrt
    the token log-probs is ``c`` (rows x T)."""
    x, g, a, p, q = (parts[k].reshape(-1, parts[k].shape[-1]) for k in ("x", "g", "a", "p", "q"))
    w = c.reshape(-1, 1)
    return torch.cat([((p * w).T @ x).flatten(), ((q * w).T @ x).flatten(), ((g * w).T @ a).flatten()])


# ------------------------------------------------------------------ rewards, advantages, losses


def rewards(tok, resp: torch.Tensor, answers: list[int], group: int) -> torch.Tensor:
    from maspo_verl.math.reward import compute_score

    out = []
    for i, row in enumerate(resp):
        text = tok.decode(row, skip_special_tokens=False).split("<|im_start|>", 1)[0]
        out.append(compute_score("maspo_arith", text, str(answers[i // group]))["score"])
    return torch.tensor(out)


def advantages(r: torch.Tensor, prompt_of: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's GRPO advantage of each response (outcome reward on its first token: verl sums a row's token
    rewards), [N, T], 0 outside ``mask`` (the response tokens, [N, T])."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    level = torch.zeros(mask.shape)
    level[:, 0] = r
    adv, _ = compute_grpo_outcome_advantage(level, mask.float(), prompt_of.numpy())
    return adv


def scaled(preset, scale: float):
    """The preset's loss config with its clip band (not the dual clip) scaled by ``scale`` (uncapped)."""
    return preset_config(presets.scaled(preset, scale, cap=None))


def loss_weights(fn, cfg, old, lp, adv, resp, mask=None) -> tuple[torch.Tensor, dict]:
    """d loss / d lp [rows, T] of the preset's loss, called as verl's ppo_loss calls it, and its metrics; ``mask``:
    the response tokens (None: all)."""
    from maspo_verl.lab.engine.presets import loss_call

    leaf = lp.clone().requires_grad_()
    loss, metrics = loss_call(fn, cfg, old, leaf, adv, resp, torch.full_like(resp, -1), mask)
    (c,) = torch.autograd.grad(loss, leaf)
    return c, metrics


def calibrate(fn, preset, old, lp, adv, resp, target: float) -> tuple[float, dict]:
    """The band scale whose clip fraction (``actor/pg_clipfrac``) on this batch is ``target`` (bisection in log
    scale), and the loss's metrics at that scale; scale 1.0 where no scale in [1e-4, 1e4] reaches it (e.g.
    on-policy: no ratio leaves 1)."""

    def metrics_at(scale: float) -> dict:
        return loss_weights(fn, scaled(preset, scale), old, lp, adv, resp)[1]

    def frac(scale: float) -> float:
        return float(metrics_at(scale).get("actor/pg_clipfrac", float("nan")))

    lo, hi = -4.0, 4.0  # log10 of the scale: a narrower band clips more
    if not frac(10**lo) >= target >= frac(10**hi):
        return 1.0, metrics_at(1.0)
    for _ in range(25):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if frac(10**mid) > target else (lo, mid)
    return 10 ** ((lo + hi) / 2), metrics_at(10 ** ((lo + hi) / 2))
