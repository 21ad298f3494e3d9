"""The loss's share of a real actor update (``python -m maspo_verl.lab bench --mode update``).

A Llama-shaped causal LM (transformers' ``LlamaForCausalLM``, random weights: Llasa-1B's shape on a GPU,
a tiny one on CPU) runs what verl's actor does per micro-batch: forward over prompt + response ->
log-probs of the response tokens (log-softmax of the logits in float32, gathered) -> each preset's loss
(fetched from verl's registry, called as verl's ``ppo_loss`` calls it, response ids in scope) ->
backward into the model's parameters. No optimizer step (the same for every loss).

Per preset, interleaved within each repetition so that load hits them alike: the update's time, and
the time of the loss alone (its forward + backward on detached log-probs of the same shape, what
``bench`` times). Reported: best (minimum) and median of ``--reps`` repetitions, the update as a
multiple of ``grpo``'s (verl's ``vanilla``), and the loss's share of the update (loss time / update
time). On CPU the clock is the process's CPU time (``--clock process``) or wall time; on a GPU wall
time after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from maspo_verl.lab import common

# Llama-3.2-1B's body with Llasa-1B's vocabulary (128256 + 8 specials + 65536 XCodec2 codes)
SHAPES = {
    "llasa-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=193800, rope_theta=500000.0, tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True,
    ),
}  # fmt: skip
# per device: shape, batch, prompt length, response length, dtype, gradient checkpointing
DEFAULTS = {
    "cuda": ("llasa-1b", 4, 256, 2048, "bf16", True),
    "cpu": ("tiny", 4, 32, 256, "fp32", False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(shape: str, dtype: torch.dtype, device: str, checkpointing: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def response_log_probs(model, input_ids: torch.Tensor, response_len: int, model_ids: torch.Tensor) -> torch.Tensor:
    """log pi(y_t | ...) of the last ``response_len`` tokens, [B, T] float32 (the logits that predict them,
    log-softmax in float32, gathered)."""
    logits = model(input_ids=input_ids).logits[:, -response_len - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, model_ids.unsqueeze(-1)).squeeze(-1)


def update_inputs(model, B: int, prompt: int, T: int, device: str, seed: int = 0):
    """The loss bench's response ids (speech-like codes; they also reach the loss), the same ids modulo the
    model's vocabulary as the model's tokens, a random prompt, and old log-probs near the model's own."""
    from maspo_verl.lab.bench import make_inputs

    _, _, adv, mask, ids, words = make_inputs(B, T, torch.float32, device, seed=seed)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    model_ids = (ids % vocab).to(device)
    input_ids = torch.cat([torch.randint(0, vocab, (B, prompt), generator=g).to(device), model_ids], dim=1)
    with torch.no_grad():
        current = response_log_probs(model, input_ids, T, model_ids)
    old = current + 0.1 * torch.randn(current.shape, generator=g).to(device)
    return input_ids, model_ids, old, current, adv, mask, ids, words


def run(args: argparse.Namespace, argv: list[str], entries) -> None:
    from maspo_verl.lab import bench

    torch.set_num_threads(args.threads)
    out = common.prepare_out(args.out, argv)
    t0, load_before = time.time(), os.getloadavg()[0]
    device = args.devices.split(",")[0] if args.devices else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --devices names cuda, but torch sees no CUDA GPU")
    shape, B, prompt, T, dname, ckpt = DEFAULTS[device]
    shape = args.shape or shape
    B, prompt, T = args.update_batch or B, args.prompt_len or prompt, args.response_len or T
    dname = args.update_dtype or dname
    ckpt = ckpt if args.checkpointing is None else args.checkpointing
    model = build_model(shape, DTYPES[dname], device, ckpt)
    input_ids, model_ids, old, current, adv, mask, ids, words = update_inputs(model, B, prompt, T, device)
    fns = {e.label: (bench.loss_fn(e), bench.entry_config(e)) for e in entries}
    clock = time.process_time if device == "cpu" and args.clock == "process" else time.perf_counter

    def update(label):
        fn, cfg = fns[label]
        model.zero_grad(set_to_none=True)
        lp = response_log_probs(model, input_ids, T, model_ids)
        with bench.micro_batch_scope({"responses": ids, bench.WORD_IDS_KEY: words}, bench.VOCABULARY):
            loss, _ = fn(old, lp, adv, mask, cfg.loss_agg_mode, cfg, None)
        loss.backward()

    def loss_only(label):
        fn, cfg = fns[label]
        bench.call(fn, cfg, (old, current, adv, mask, ids, words))

    def timed(work, label):
        bench.sync(device)
        start = clock()
        work(label)
        bench.sync(device)
        return clock() - start

    for e in entries:  # warm-up
        for _ in range(args.warmup):
            update(e.label)
            loss_only(e.label)
    times = {e.label: {"update": [], "loss": []} for e in entries}
    for _ in range(args.reps):
        for e in entries:
            times[e.label]["update"].append(timed(update, e.label))
            times[e.label]["loss"].append(timed(loss_only, e.label))
    base = times[entries[0].label]["update"]
    rows = []
    for e in entries:
        upd, los = times[e.label]["update"], times[e.label]["loss"]
        rows.append(
            {
                "device": device,
                "loss": e.label,
                "loss_mode": e.loss_mode,
                "update_ms": min(upd) * 1e3,
                "x_grpo": min(upd) / min(base),
                "update_ms_median": statistics.median(upd) * 1e3,
                "x_grpo_median": statistics.median(upd) / statistics.median(base),
                "loss_ms": min(los) * 1e3,
                "loss_share": min(los) / min(upd),
                "loss_share_median": statistics.median(los) / statistics.median(upd),
            }
        )
    common.write_csv(out / "update_share.csv", rows)
    load = f"load average (1 min, {os.cpu_count()} cores) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    params = sum(p.numel() for p in model.parameters())
    setting = (
        f"{shape} Llama shape ({params / 1e6:.1f} M parameters), B={B}, {prompt}+{T} tokens, {dname}, "
        f"gradient checkpointing {'on' if ckpt else 'off'}, {device}"
    )
    lines = [
        "# The loss's share of an actor update",
        "",
        f"Made by the command in `COMMAND.txt` ({time.time() - t0:.0f} s): {setting}; best and median of "
        f"{args.reps} interleaved repetitions after {args.warmup} warm-up rounds, {args.threads} torch thread(s), "
        f"{'process CPU time' if clock is time.process_time else 'wall time'}; {load}. All rows: `update_share.csv`.",
        "",
        "- `update_ms`: forward over prompt + response -> response log-probs (float32 log-softmax) -> the loss "
        "-> backward into the model; `x_grpo`: its ratio to `grpo`'s (verl's `vanilla`) in the same run.",
        "- `loss_ms`: the loss alone (forward + backward + metrics on detached log-probs of the same shape); "
        "`loss_share` = loss_ms / update_ms (best times; `_median`: medians).",
        "",
        common.markdown_table(
            rows,
            ["loss", "update_ms", "x_grpo", "x_grpo_median", "loss_ms", "loss_share", "loss_share_median"],
        ),
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))
    print((out / "README.md").read_text())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The update mode's own knobs (defaults per device: ``DEFAULTS``)."""
    g = p.add_argument_group("--mode update")
    g.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (cpu: tiny; cuda: llasa-1b)")
    g.add_argument("--update-batch", type=int, default=None, help="sequences per update (default 4)")
    g.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (cpu: 32; cuda: 256)")
    g.add_argument("--response-len", type=int, default=None, help="response tokens (cpu: 256; cuda: 2048)")
    g.add_argument("--update-dtype", choices=sorted(DTYPES), default=None, help="model dtype (cpu: fp32; cuda: bf16)")
    g.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gradient checkpointing (cpu: off; cuda: on)",
    )
