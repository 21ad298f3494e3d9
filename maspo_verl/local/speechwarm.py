"""A speech-like policy that has learned speech: the local mode's embedded Qwen2-shaped model, warm-started
by supervised next-token training on the speech-like task's unit sequences (``task=speechwarm``; ``lab learn
--tasks speechwarm``).

The random embedded model (``assets.write_model``) writes ~one "word" per token at 96 tokens, so its reward
on the speech-like task is near 0 and a group of its responses barely differs. Here it is trained, before
any RL, on responses with the task's structure (``maspo_verl.local.learn_tasks``: word k is the id block
``[64 k, 64 k + 64)``, a word is held over ``length / SPEECH_WORDS`` frames, each frame's id uniform in its
block, ``SPEECH_WORDS`` words with no word twice in a row) after prompts "Say: <sentence>" in the chat
template. Each response's sentence is drawn independently of its prompt's, so the model learns how speech
is made (hold a word, then change it) but not which sentence a prompt asks for: that is left to RL.

Deterministic (seeded init, data and order; one torch thread) and built once into the local cache
(``util.atomic_build``); no download. About a minute on one CPU core at the defaults.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
from pathlib import Path

from maspo_verl.util import atomic_build, default_cache_dir

TASK = "speechwarm"
WARM_VERSION = 1  # bump when the training or its data change, so stale caches are not reused
# supervised training: AdamW on the response tokens' next-token loss
TRAIN = {"steps": 300, "batch": 32, "lr": 3e-3, "warmup": 20}


def prompt_ids(sentence: str) -> list[int]:
    """The chat template's ids of the user prompt "Say: <sentence>" and the assistant header (byte-level: id b
    is byte b, then the specials of ``assets.SPECIAL_TOKENS``)."""
    from maspo_verl.local.assets import NUM_BYTES, SPECIAL_TOKENS

    start, end = (NUM_BYTES + SPECIAL_TOKENS.index(t) for t in ("<|im_start|>", "<|im_end|>"))
    text = f"Say: {sentence}"
    return [start, *b"user\n", *text.encode(), end, *b"\n", start, *b"assistant\n"]


def response_ids(sentence: str, length: int, rng: random.Random) -> list[int]:
    """``length`` frames speaking ``sentence``: word i held over frames [i L / n, (i + 1) L / n), each frame an id
    drawn uniformly from the word's block."""
    from maspo_verl.local.learn_tasks import BLOCK, WORDS

    words = sentence.split()
    out = []
    for t in range(length):
        block = WORDS.index(words[t * len(words) // length])
        out.append(block * BLOCK + rng.randrange(BLOCK))
    return out


def example(rng: random.Random, length: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids): a random prompt sentence and an independent random spoken sentence."""
    from maspo_verl.local.learn_tasks import sentence

    return prompt_ids(sentence("speech", rng, length)), response_ids(sentence("speech", rng, length), length, rng)


@contextlib.contextmanager
def deterministic(seed: int):
    """One torch thread (the same sums in the same order) and torch's global generator seeded with ``seed``; both
    as they were afterwards."""
    import torch

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.set_num_threads(1)
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)


def train(model, length: int, seed: int, steps: int, batch: int, lr: float, warmup: int) -> list[float]:
    """Next-token training of ``model`` on the response tokens of ``example``s; the loss per step."""
    import torch

    rng = random.Random(f"{TASK}-data-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses = []
    for _ in range(steps):
        pairs = [example(rng, length) for _ in range(batch)]
        width = max(len(p) for p, _ in pairs) + length
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, (p, r) in enumerate(pairs):  # left padding, as verl's prompts
            row = p + r
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
            labels[i, width - length :] = torch.tensor(r)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(out.loss.detach()))
    model.eval()
    return losses


def write_warm_model(path: Path, seed: int, length: int, train_settings: dict) -> None:
    """The embedded random model of ``seed``, trained by ``train``, saved with its tokenizer and the losses."""
    import torch
    from transformers import Qwen2ForCausalLM

    from maspo_verl.local.assets import write_model, write_tokenizer

    write_model(path, seed)
    with deterministic(seed):  # the same weights every build
        model = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="sdpa")
        losses = train(model, length, seed, **train_settings)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    record = {"seed": seed, "length": length, "train": train_settings, "loss_first": losses[0], "loss": losses[-1]}
    (path / "speechwarm.json").write_text(json.dumps(record, indent=2))


def ensure_model(
    seed: int = 0, length: int = 96, cache_dir: str | os.PathLike | None = None, train_settings: dict | None = None
) -> str:
    """Path of the warm-started model for responses of ``length`` frames; built on first use."""
    from maspo_verl.local.assets import ASSET_VERSION, MODEL_SHAPE, MODEL_VOCAB
    from maspo_verl.local.learn_tasks import SPEECH_WORDS

    if int(length) < SPEECH_WORDS:
        raise ValueError(f"length={length}: allowed >= {SPEECH_WORDS} frames (one per word at least)")
    settings = dict(TRAIN if train_settings is None else train_settings)
    if set(settings) != set(TRAIN):
        raise ValueError(f"train_settings keys {sorted(settings)}: allowed exactly {sorted(TRAIN)}")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    parts = [WARM_VERSION, ASSET_VERSION, seed, int(length), settings, MODEL_SHAPE, MODEL_VOCAB]
    key = hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]
    target = cache / f"{TASK}-v{WARM_VERSION}-seed{seed}-L{int(length)}-{key}"
    return str(atomic_build(target, lambda tmp: write_warm_model(tmp, seed, int(length), settings)))


# the warm model's fingerprint, from the driver (``fingerprint``) to the run's workers, and its metric there
FINGERPRINT_ENV = "MASPO_VERL_WARM_FINGERPRINT"
FINGERPRINT_METRIC = "maspo/warm_model_fingerprint"
FINGERPRINT_HEX = 12  # digits: 48 bits, an integer a float64 metric holds exactly (and its mean over ranks too)


def fingerprint(model_path: str | os.PathLike) -> str:
    """The model's weights in ``FINGERPRINT_HEX`` hex digits: sha256 over each tensor of its safetensors files (name,
    dtype, shape, bytes, by name). Two builds with the same weights share it, bit for bit; a build another machine's
    arithmetic made differently does not."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights to fingerprint")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name).contiguous()
                digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:FINGERPRINT_HEX]


def fingerprint_metrics() -> dict[str, float]:
    """An update metric (``plugin.hooks.register_update_metrics``): the run's warm-model fingerprint where it has one
    (``FINGERPRINT_ENV``), as the integer its hex digits are."""
    value = os.environ.get(FINGERPRINT_ENV)
    return {FINGERPRINT_METRIC: float(int(value, 16))} if value else {}


def fingerprint_of_metric(value: float) -> str:
    """The fingerprint a run's metric (``FINGERPRINT_METRIC``) holds, in hex digits."""
    return f"{int(value):0{FINGERPRINT_HEX}x}"


def sample(model_path: str, prompts: list[list[int]], length: int, seed: int) -> list[list[int]]:
    """``length`` ids sampled at temperature 1 from the full vocabulary after each prompt (all of one length), as
    the local rollout samples."""
    import torch
    from transformers import Qwen2ForCausalLM

    if len({len(p) for p in prompts}) != 1:
        raise ValueError("prompts: allowed prompts of one length (no padding here)")
    model = Qwen2ForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    ids, past, out = torch.tensor(prompts), None, []
    with torch.inference_mode():
        for _ in range(length):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            ids = torch.multinomial(torch.softmax(step.logits[:, -1].float(), -1), 1, generator=gen)
            out.append(ids[:, 0])
    return torch.stack(out, 1).tolist()


def initial_reward(model_path: str, length: int, seed: int = 0, groups: int = 8, n: int = 4) -> dict:
    """The speech-like task's reward of ``model_path`` before RL: ``groups`` GRPO groups of ``n`` responses, each
    group asked for its own random sentence; mean reward, the spread (std within a group, mean over groups)
    and the mean number of decoded words."""
    import statistics

    from maspo_verl.local.learn_tasks import score, sentence

    rng = random.Random(f"{TASK}-measure-{seed}")
    targets = [sentence("speech", rng, length) for _ in range(groups)]
    prompts = [prompt_ids(t) for t in targets for _ in range(n)]
    responses = sample(model_path, prompts, length, seed)
    scored = [score("speech", r, targets[i // n]) for i, r in enumerate(responses)]
    rewards = [s for s, _ in scored]
    spread = statistics.fmean(statistics.pstdev(rewards[g * n : (g + 1) * n]) for g in range(groups))
    return {
        "reward": statistics.fmean(rewards),
        "spread": spread,
        "words": statistics.fmean(len(w) for _, w in scored),
        "groups": groups,
        "n": n,
    }


def drift_correlation(
    model_path: str, length: int, seed: int = 0, updates: int = 1, lr: float = 1e-3, groups: int = 8, n: int = 4
) -> dict:
    """How the token log-ratios of ``model_path``'s own responses move under RL: ``groups`` x ``n`` responses to the
    task's prompts, then ``updates`` Adam steps (``lr``) on grpo's token-level policy gradient with the task's
    group-normalised rewards, then delta = log pi_new - log pi_old over the sampled tokens; its lag-1 and VIF(n)
    (``maspo_verl.core.metrics.correlation_sums``: 1 = independent) and sd."""
    import torch
    from transformers import Qwen2ForCausalLM

    from maspo_verl.core.metrics import correlation_metrics, correlation_sums, host_sums
    from maspo_verl.local.learn_tasks import score, sentence

    rng = random.Random(f"{TASK}-drift-{seed}")
    targets = [sentence("speech", rng, length) for _ in range(groups)]
    prompts = [prompt_ids(t) for t in targets for _ in range(n)]
    responses = sample(model_path, prompts, length, seed)
    rewards = torch.tensor([score("speech", r, targets[i // n])[0] for i, r in enumerate(responses)]).view(groups, n)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    ids = torch.tensor([p + r for p, r in zip(prompts, responses, strict=True)])
    cut = len(prompts[0])

    def token_logp(model):
        logits = model(input_ids=ids).logits[:, cut - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, cut:, None])[..., 0]

    with deterministic(seed):
        model = Qwen2ForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
        with torch.no_grad():
            old = token_logp(model)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(updates):
            loss = -(adv * token_logp(model)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            delta = (token_logp(model) - old).double()
    sums = correlation_sums(delta, torch.ones_like(delta, dtype=torch.bool))
    metrics = correlation_metrics(host_sums(sums), prefix="")
    return {"updates": updates, "lr": lr, "delta_sd": float(delta.std())} | metrics


def main(argv: list[str] | None = None) -> None:
    """``python -m maspo_verl.local.speechwarm --seeds 0 1 --length 96 --out initial.csv``: each seed's warm-started
    model and the untrained embedded one, their initial reward and group spread (``initial_reward``), and with
    ``--drift-updates 1 4`` the correlation of their drift log-ratios (``drift_correlation``), as CSV."""
    import argparse
    import csv
    import sys

    from maspo_verl.local.assets import ensure_assets

    p = argparse.ArgumentParser(prog="python -m maspo_verl.local.speechwarm", description=main.__doc__)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--drift-updates", nargs="*", type=int, default=[], help="also drift_correlation at these updates")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the drift updates")
    p.add_argument("--out", default=None, help="CSV file (default: standard output)")
    args = p.parse_args(argv)
    rows = []
    for seed in args.seeds:
        models = {"warm": ensure_model(seed=seed, length=args.length), "untrained": ensure_assets(seed=seed)["model"]}
        for name, path in models.items():
            got = initial_reward(path, args.length, seed=seed, groups=args.groups, n=args.n)
            row = {"model": name, "seed": seed, "length": args.length} | got
            for updates in args.drift_updates:  # the drift of its own responses after that many updates
                drift = drift_correlation(path, args.length, seed=seed, updates=updates, lr=args.lr)
                row |= {f"u{updates}_{k}": v for k, v in drift.items() if k not in ("updates", "lr")}
            rows.append(row)
    f = open(args.out, "w", newline="") if args.out else sys.stdout
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    if args.out:
        f.close()


if __name__ == "__main__":
    main()
