"""Do a warm-started small LM's drift log-ratios move together? An ablation of what makes them correlated.

Sharing one ratio over a segment can only matter where the per-token log-ratios
delta_t = log pi_theta - log pi_old of neighbouring tokens are correlated. This study measures them on a
Qwen2-shaped causal LM (``--sizes``: ``tiny`` is the local mode's embedded shape, hidden 64 and 2 layers),
warm-started by supervised steps on code sequences made here, deterministically and without a download:

- ``runs``: the regime grid's speech-like units (``maspo_verl.lab.engine.grid.make_task("speech")``: units of
  3-15 frames, log-normal durations), unit k's symbol as byte id ``32 k``;
- ``jitter``: the same units, each frame's code moved by one step in one of its 4 base-4 digits with
  probability 0.3 (codec frames of one sound are near, not equal);
- ``espeak``: real speech: sentences spoken by espeak-ng, encoded by the project's feature codec
  (``maspo_verl.speech.feature_codec.FeatureFSQ`` with 4 digits: 256 codes at 50 Hz), one stream cut into
  windows;
- ``iid``: uniform random ids (no structure).

A measurement: ``--batch`` responses of ``--tokens`` tokens sampled from the model (temperature 1) after a
prompt of the data's first ``prompt`` tokens, then ``updates`` optimizer steps on a REINFORCE loss with random
+-1 advantages per response, then delta over the sampled tokens (new minus old log-probs). Correlation by
``maspo_verl.core.losses`` (lag-1, VIF(5/15/50): 1 for independent ratios; VIF(segments) over runs of one
id, the units): the sums of ``--repeats`` measurements (own samples and advantages) pooled.

Conditions (``--conditions``) change one factor of ``base`` (tiny model, ``runs`` data, 300 warm-start steps,
Adam lr 1e-3, 1 update, prompt 1). Writes ``outputs/lab/drift/`` (``--update-docs``: ``docs/results/drift/``):
``drift.csv``, README, plot, ``COMMAND.txt``.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from maspo_verl.lab.engine import journal
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    "drift", "warm-started small LM: do its drift log-ratios move together (lag-1, VIF)? one factor at a time"
)
VOCAB = 264  # the local mode's vocabulary: 256 byte ids (codes) + specials, a multiple of 8
SIZES = {  # hidden, intermediate, layers, attention heads, key-value heads
    name: dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads"), shape, strict=True))
    for name, shape in (
        ("tiny", (64, 128, 2, 4, 2)),  # the local mode's embedded model
        ("small", (256, 512, 4, 4, 2)),
        ("medium", (512, 1536, 8, 8, 4)),
        ("smol", (576, 1536, 30, 9, 3)),  # SmolLM2-135M's shape (its config.json), trained from scratch here
    )
}  # fmt: skip
DATA = ("runs", "jitter", "espeak", "iid")
UNIT_ID = 32  # byte id of unit symbol k: 32 k


@dataclass(frozen=True)
class Condition:
    name: str
    size: str = "tiny"
    data: str = "runs"
    warm_steps: int = 300
    optimizer: str = "adam"
    lr: float = 1e-3
    updates: int = 1
    prompt: int = 1

    @property
    def warm_key(self) -> tuple:
        return (self.size, self.data, self.warm_steps)


BASE = Condition("base")
CONDITIONS = {
    c.name: c
    for c in (
        BASE,
        replace(BASE, name="random_init", warm_steps=0),
        replace(BASE, name="warm_1000", warm_steps=1000),
        replace(BASE, name="data_iid", data="iid"),
        replace(BASE, name="data_jitter", data="jitter"),
        replace(BASE, name="data_espeak", data="espeak"),
        replace(BASE, name="lr_1e-4", lr=1e-4),
        replace(BASE, name="lr_1e-2", lr=1e-2),
        replace(BASE, name="sgd_lr_1", optimizer="sgd", lr=1.0),
        replace(BASE, name="updates_8", updates=8),
        replace(BASE, name="prompt_32", prompt=32),
        replace(BASE, name="size_small", size="small"),
        replace(BASE, name="small_espeak", size="small", data="espeak"),
        replace(BASE, name="medium_espeak", size="medium", data="espeak"),
        replace(BASE, name="medium_runs", size="medium"),
        replace(BASE, name="smol_espeak", size="smol", data="espeak"),
        replace(BASE, name="smol_espeak_2000", size="smol", data="espeak", warm_steps=2000),
        replace(BASE, name="smol_random_init", size="smol", data="espeak", warm_steps=0),
    )
}
GPU_ONLY = ("medium_espeak", "medium_runs", "smol_espeak", "smol_espeak_2000", "smol_random_init")


# ------------------------------------------------------------------ data


def _runs(n: int, length: int, seed: int, jitter: float = 0.0) -> torch.Tensor:
    from maspo_verl.lab.engine.grid import make_task

    target = make_task("speech", length, list(range(seed * n, seed * n + n))).target * UNIT_ID
    if jitter:
        g = torch.Generator().manual_seed(seed)
        move = torch.rand(target.shape, generator=g) < jitter
        digit = torch.randint(4, target.shape, generator=g)
        step = 4**digit
        value = (target // step) % 4
        sign = torch.where(
            value == 3, -1, torch.where(value == 0, 1, 1 - 2 * torch.randint(2, target.shape, generator=g))
        )
        target = torch.where(move, target + sign * step, target)
    return target


_ESPEAK: list[int] | None = None


ESPEAK_SENTENCES = 120


def espeak_stream() -> list[int]:
    """Real speech as one stream of 256 codes: espeak-ng sentences through the feature codec (4 digits), made
    once into the cache (``$MASPO_VERL_CACHE``, else ``~/.cache/maspo_verl``, the local mode's cache folder):
    a machine without espeak-ng reads the file made elsewhere."""
    global _ESPEAK
    if _ESPEAK is None:
        import json
        import os

        root = os.environ.get("MASPO_VERL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "maspo_verl")
        path = Path(root, f"drift_espeak_{ESPEAK_SENTENCES}.json")
        if not path.is_file():
            from maspo_verl.speech.feature_codec import FeatureFSQ, sentences
            from maspo_verl.speech.testing import espeak

            codec = FeatureFSQ(levels=(4,) * 4)
            codes = [c for s in sentences(ESPEAK_SENTENCES, seed=0) for c in codec.encode(espeak(s))]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(json.dumps(codes))
            path.with_suffix(".tmp").replace(path)
        _ESPEAK = json.loads(path.read_text())
    return _ESPEAK


def batch(data: str, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] byte ids of ``data`` (deterministic in ``seed``)."""
    if data in ("runs", "jitter"):
        return _runs(n, length, seed, 0.3 if data == "jitter" else 0.0)
    g = torch.Generator().manual_seed(seed)
    if data == "iid":
        return torch.randint(256, (n, length), generator=g)
    stream = torch.tensor(espeak_stream())
    start = torch.randint(len(stream) - length, (n,), generator=g)
    return stream[start[:, None] + torch.arange(length)]


# ------------------------------------------------------------------ model


def model_of(size: str, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=1024, **SIZES[size])
    return Qwen2ForCausalLM(cfg).to(device)


def warm_start(c: Condition, args) -> tuple[torch.nn.Module, float]:
    """A model of ``c.size`` after ``c.warm_steps`` AdamW steps (lr 3e-3) on ``c.data``; its last loss."""
    torch.manual_seed(args.seed)
    model = model_of(c.size, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = float("nan")
    for step in range(c.warm_steps):
        x = batch(c.data, 32, args.tokens, seed=10_000 + step).to(args.device)
        out = model(x, labels=x).loss
        opt.zero_grad()
        out.backward()
        opt.step()
        loss = float(out.detach())
    return model, loss


def token_logprobs(model, seq: torch.Tensor, start: int) -> torch.Tensor:
    logits = model(seq).logits[:, start - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, seq[:, start:].unsqueeze(-1)).squeeze(-1)


def measure(model, c: Condition, args, repeat: int) -> tuple[dict, float]:
    """One measurement's correlation sums (``maspo_verl.core.losses``) and delta's sd."""
    from maspo_verl.core.metrics import correlation_sums

    torch.manual_seed(args.seed + 1 + repeat)
    model.eval()
    seq = batch(c.data, args.batch, c.prompt, seed=50_000 + repeat).to(args.device)  # the prompt
    with torch.no_grad():
        for _ in range(args.tokens):  # plain ancestral sampling at temperature 1 (no cache: any transformers)
            probs = torch.softmax(model(seq).logits[:, -1].float(), -1)
            seq = torch.cat([seq, torch.multinomial(probs, 1)], 1)
        old = token_logprobs(model, seq, c.prompt)
    trained = copy.deepcopy(model).train()
    params = trained.parameters()
    opt = torch.optim.Adam(params, lr=c.lr) if c.optimizer == "adam" else torch.optim.SGD(params, lr=c.lr)
    adv = torch.randint(2, (args.batch, 1), device=args.device).float() * 2 - 1
    for _ in range(c.updates):
        loss = -(token_logprobs(trained, seq, c.prompt).sum(-1, keepdim=True) * adv).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        delta = token_logprobs(trained, seq, c.prompt) - old
    y = seq[:, c.prompt :]
    change = torch.ones_like(y)
    change[:, 1:] = (y[:, 1:] != y[:, :-1]).long()
    units = change.cumsum(-1) - 1  # runs of one id: the units of the runs data
    sums = correlation_sums(delta, torch.ones_like(delta, dtype=torch.bool), units)
    return {k: v.double().cpu() for k, v in sums.items()}, float(delta.std())


def run_condition(c: Condition, args, warm_cache: dict) -> dict:
    from maspo_verl.core.metrics import correlation_metrics, host_sums

    t0 = time.time()
    if c.warm_key not in warm_cache:
        warm_cache.clear()  # one warm model at a time (memory); conditions are ordered by it
        warm_cache[c.warm_key] = warm_start(c, args)
    model, warm_loss = warm_cache[c.warm_key]
    warm_seconds = time.time() - t0
    total, sds = None, []
    for r in range(args.repeats):
        sums, sd = measure(model, c, args, r)
        total = sums if total is None else {k: total[k] + v for k, v in sums.items()}
        sds.append(sd)
    m = correlation_metrics(host_sums(total), prefix="")
    return {
        **asdict(c),
        "warm_loss": warm_loss,
        "delta_sd": sum(sds) / len(sds),
        "lag1": m.get("corr_lag1", float("nan")),
        "vif5": m.get("vif5", float("nan")),
        "vif15": m.get("vif15", float("nan")),
        "vif50": m.get("vif50", float("nan")),
        "vif_units": m.get("vif_segments", float("nan")),
        "repeats": args.repeats,
        "tokens": args.tokens,
        "batch": args.batch,
        "seconds": time.time() - t0,
        "warm_seconds": warm_seconds,
    }


# ------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Drift-ratio correlation (lag-1, VIF) of a warm-started Qwen2-shaped LM, one factor changed at a time: "
        "model size, data (units, jittered units, espeak-ng speech codes, iid), warm-start steps, optimizer, "
        "lr, updates, prompt."
    )
    p.add_argument(
        "--conditions",
        nargs="+",
        default=[n for n in CONDITIONS if n not in GPU_ONLY],
        choices=list(CONDITIONS),
        help=f"default: all but {', '.join(GPU_ONLY)} (a GPU's: --device cuda)",
    )
    p.add_argument("--repeats", type=int, default=3, help="measurements per condition (own samples, advantages)")
    p.add_argument("--batch", type=int, default=16, help="responses per measurement")
    p.add_argument("--tokens", type=int, default=128, help="response tokens (and warm-start window)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest on a shared 2-core machine)")
    p.add_argument("--report", action="store_true", help="only rebuild the README and plot from --out's drift.csv")


def run(args: argparse.Namespace, argv: list[str]) -> None:
    from maspo_verl.lab.engine import common

    if args.report:
        import csv

        with open(Path(args.out) / "drift.csv", newline="") as f:
            rows = [{k: common.number(v) for k, v in r.items()} for r in csv.DictReader(f)]
        write_report(Path(args.out), rows, args)
        return common.report_written(Path(args.out))
    out = journal.start(args.out, argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    t0 = time.time()
    size_rank = {s: i for i, s in enumerate(SIZES)}  # cheapest first; conditions sharing a warm model together
    conditions = sorted((CONDITIONS[n] for n in args.conditions), key=lambda c: (size_rank[c.size], c.warm_key))
    rows, cache = [], {}
    for c in conditions:
        rows.append(run_condition(c, args, cache))
        r = rows[-1]
        common.log(
            f"drift {c.name}: lag1 {r['lag1']:+.3f} VIF5 {r['vif5']:.2f} VIF15 {r['vif15']:.2f} VIF50 {r['vif50']:.2f} "
            f"VIF(units) {r['vif_units']:.2f} sd {r['delta_sd']:.2e} ({r['seconds']:.0f}s)"
        )
        common.write_csv(out / "drift.csv", rows)
    seconds = time.time() - t0
    journal.run_time(out, seconds, f"device {args.device}", [journal.load()])
    write_report(out, rows, args)
    common.report_written(out)


def write_report(out: Path, rows: list[dict], args) -> None:
    from maspo_verl.lab.engine import common
    from maspo_verl.lab.engine.grid import null_correlation

    order = {n: i for i, n in enumerate(CONDITIONS)}
    rows = sorted(rows, key=lambda r: order.get(r["name"], len(order)))
    plt = common.pyplot()
    tokens, repeats, size = int(rows[0]["tokens"]), int(rows[0]["repeats"]), int(rows[0]["batch"])
    null = null_correlation(tokens)
    # the reference beside the table (docs/choosing.md reads it: it imports no torch)
    common.write_csv(out / "drift_reference.csv", [{"tokens": tokens, **null}])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = [r["name"] for r in rows]
    for k, key in enumerate(("vif5", "vif15", "vif50")):
        bars = ax.bar([i + 0.27 * (k - 1) for i in range(len(rows))], [r[key] for r in rows], 0.27, label=key)
        ax.axhline(null[f"null_{key}"], color=bars.patches[0].get_facecolor(), lw=0.8, ls="--")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title(f"dashed: independent log-ratios in {tokens}-token rows (the same measure)", fontsize=9)
    ax.set_xticks(range(len(rows)), names, rotation=45, ha="right")
    ax.set_ylabel("VIF (1: independent)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "drift_vif.png", dpi=110)
    plt.close(fig)
    keys = ["name", "size", "data", "warm_steps", "optimizer", "lr", "updates", "prompt", "warm_loss", "delta_sd"]
    keys += ["lag1", "vif5", "vif15", "vif50", "vif_units", "seconds"]
    command = (out / "COMMAND.txt").read_text()
    text = [
        "# Drift-ratio correlation of a warm-started small LM: what makes it rise",
        "",
        "Made by `python -m maspo_verl.lab drift` (engine `maspo_verl/lab/studies/drift.py`; what each data set and "
        "factor is: its docstring). Each row changes one factor of `base` (tiny model, `runs` data, 300 warm-start "
        f"steps, Adam lr 1e-3, 1 update, prompt 1); {repeats} measurements of {size} responses x {tokens} tokens "
        "each, pooled. lag-1 and VIF(n) of delta = log pi_new - log pi_old after the update(s) "
        "(`maspo_verl/core/losses.py`), VIF(units) over runs of one id. The measure centres each row, so "
        f"independent log-ratios in {tokens}-token rows give lag-1 {null['null_lag1']:+.3f}, VIF(5) "
        f"{null['null_vif5']:.2f}, VIF(15) {null['null_vif15']:.2f}, VIF(50) {null['null_vif50']:.2f} (not 1): "
        "read each value against these. `delta_sd`: the size of the move (a trust region keeps it near 0.1-0.2).",
        "",
        "```",
        command.strip(),
        "```",
        "",
        common.markdown_table(rows, keys),
        "![VIF per condition](drift_vif.png)",
        "",
    ]
    (out / "README.md").write_text("\n".join(text))


if (
    __name__ == "__main__"
):  # without the lab's CLI (no verl needed): python -m maspo_verl.lab.studies.drift --out DIR ...
    import sys

    parser = argparse.ArgumentParser(prog="python -m maspo_verl.lab.studies.drift")
    parser.add_argument("--out", default=str(Path("outputs", "lab", "drift")))
    add_arguments(parser)
    run(parser.parse_args(), ["drift", *sys.argv[1:]])  # recorded as the lab command it equals
