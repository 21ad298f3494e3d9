"""Loss benchmark: forward+backward time, peak memory and host syncs of each loss vs verl's; with
``--mode update``, the loss's share of a real actor update (the section at the end of this module).

Every loss is fetched from verl's registry and called exactly as verl's ``ppo_loss`` calls it:
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, actor_config, None)`` with the
micro-batch's response ids in scope, then ``loss.backward()``. The timed region is that call plus
backward, metrics included. The losses are the presets as shipped (``hydra_configs/loss/*.yaml``,
composed like ``python -m maspo_verl.main loss=<preset>``); ``grpo`` (verl's ``vanilla``) is the baseline.

- time: best (minimum) of ``--reps`` repetitions, the estimate least disturbed by other processes on
  a shared machine (the median is also recorded); losses are interleaved within each repetition so
  load hits them alike; torch runs ``--threads`` intra-op threads (default 1). On CPU the clock is
  the process's CPU time (``--clock process``, default: time spent descheduled by other processes
  does not count) or wall time (``--clock wall``); on a GPU it is wall time read after
  ``torch.cuda.synchronize()``.
- peak memory: on CPU, the allocator events of ``torch.profiler`` (``profile_memory=True``) during one
  forward+backward, summed in time order; the peak of the running sum is the most memory the call
  held at once beyond its inputs (the gradient of ``log_prob`` included). On a GPU,
  ``torch.cuda.max_memory_allocated`` minus the allocation before the call. Reported in units of one
  [B, T] float32 tensor (B*T*4 bytes).
- host syncs: during one call, every Python-level way a tensor reaches the host is counted
  (``Tensor.item / tolist / numpy / cpu / __bool__ / __float__ / __int__ / __index__``); on CPU these
  are the calls that *would* be device syncs on a GPU. On a GPU ``torch.cuda.set_sync_debug_mode``
  additionally warns on each real sync.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

import maspo_verl.plugin  # noqa: F401  (registers our losses)
from maspo_verl.batch import NO_WORD, WORD_IDS_KEY, micro_batch_scope
from maspo_verl.core.surrogates import DEFAULT as DEFAULT_SURROGATE
from maspo_verl.core.surrogates import SURROGATES, switch_fields
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.lab.engine import common, journal, presets, study
from maspo_verl.lab.engine.study import Study
from maspo_verl.util import preset_names

STUDY = Study("bench", "forward+backward time, peak memory and host syncs of each loss")

BASELINE = presets.BASELINE
# The loss presets as shipped (hydra_configs/loss/*.yaml), the baseline first.
PRESETS = (BASELINE, *(name for name in preset_names() if name != BASELINE))
# The text of the ids ``make_inputs`` draws, for segment_rule=delimiters (``maspo_steps``): Qwen2's ids of
# "!", ".", "?", "\n" and " ", the pieces of the default delimiters; the codec codes hold no text.
TEXT_IDS = {0: "!", 13: ".", 30: "?", 198: "\n", 220: " "}
VOCABULARY = [TEXT_IDS.get(i, "") for i in range(128264 + 65536)]


@dataclass(frozen=True)
class Entry:
    label: str
    loss_mode: str
    actor: dict = field(default_factory=dict)
    policy_loss: dict = field(default_factory=dict)


def preset_entries(names=PRESETS) -> list[Entry]:
    """Each preset's resolved loss section (``presets.discover_presets``), the baseline first."""
    return [Entry(p.name, p.loss_mode, p.actor, p.policy_loss) for p in presets.discover_presets(list(names))]


def compiled(e: Entry) -> Entry:
    return Entry(f"{e.label}+compile", e.loss_mode, e.actor, {**e.policy_loss, "compile": True})


def with_surrogate(e: Entry, surrogate: str) -> Entry:
    """``e`` with ``policy_loss.surrogate=<surrogate>`` (``switch_fields``: the first clip schedule it accepts, if the
    preset's is not one, and the fields it requires), labelled ``<preset>+<surrogate>``."""
    return Entry(f"{e.label}+{surrogate}", e.loss_mode, e.actor, switch_fields(e.policy_loss, surrogate))


def surrogate_entries(entries: list[Entry]) -> list[Entry]:
    """Each surrogate other than the presets' own (``SURROGATES``) on the first preset of each of our token
    sets among ``entries``: the rows of the surrogates."""
    first: dict[str, Entry] = {}
    for e in entries:
        if e.loss_mode in TOKEN_SETS and e.policy_loss.get("surrogate", DEFAULT_SURROGATE) == DEFAULT_SURROGATE:
            first.setdefault(e.loss_mode, e)
    return [with_surrogate(e, s) for s in SURROGATES if s != DEFAULT_SURROGATE for e in first.values()]


def loss_fn(e: Entry):
    """The loss from verl's registry; verl's own as verl ships them (without the wrapper through which the plugin
    adds their ratio-correlation metrics, one more transfer a call), so the baseline is verl's."""
    fn = get_policy_loss_fn(e.loss_mode)
    return getattr(fn, "__maspo_original__", fn)


def entry_config(e: Entry):
    return presets.actor_config_of(e.actor, e.policy_loss)


def make_inputs(B: int, T: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Log-probs, advantages, a right-padded mask (lengths T/4..T) and speech-like response ids:
    XCodec2 codes (Llasa-1B offset) that repeat the previous code with probability 0.8, with 1% text
    tokens (line breaks: ``maspo_steps`` ends a segment after each), so ``maspo_tokenval`` finds segments
    of a few tokens as on real speech; and word ids as an
    ASR gives them (``maspo_words``): words of 8-20 tokens with 3-token gaps (-1) between them."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    fresh = torch.rand(B, T, generator=g) < 0.2
    fresh[:, 0] = True
    draws = torch.randint(0, 65536, (B, T), generator=g)
    last_fresh = torch.cummax(torch.where(fresh, torch.arange(T), 0), dim=-1).values
    ids = 128264 + torch.gather(draws, -1, last_fresh)
    ids[torch.rand(B, T, generator=g) < 0.01] = 198
    span = torch.randint(11, 24, (B, T), generator=g).cumsum(-1)  # word + gap ends
    word = torch.searchsorted(span, torch.arange(T).expand(B, T).contiguous(), right=True)
    start = torch.gather(torch.nn.functional.pad(span, (1, 0)), -1, word)
    words = torch.where(torch.arange(T) - start < span.gather(-1, word) - start - 3, word, NO_WORD)
    to = dict(device=device, dtype=dtype)
    return old.to(**to), new.to(**to), adv.to(**to), mask.to(device), ids.to(device), words.to(device)


SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_syncs():
    counter = {"n": 0, "by": {}}
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name, fn):
        def inner(self, *a, **k):
            counter["n"] += 1
            counter["by"][name] = counter["by"].get(name, 0) + 1
            return fn(self, *a, **k)

        return inner

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def call(fn, cfg, inputs):
    """One loss call as verl's ``ppo_loss`` makes it (the micro-batch's responses in scope), then backward."""
    return loss_grad_metrics(fn, cfg, inputs)[1]


def loss_grad_metrics(fn, cfg, inputs):
    """``call``'s loss (detached), the log-prob leaf (with its gradient) and the metrics."""
    old, new, adv, mask, ids, words = inputs
    lp = new.detach().requires_grad_()
    with micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, VOCABULARY):
        loss, metrics = fn(old, lp, adv, mask, cfg.loss_agg_mode, cfg, None)
    loss.backward()
    return loss.detach(), lp, metrics


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory(fn, cfg, inputs, device) -> tuple[float, int | None]:
    """Peak bytes held during one call beyond its inputs, and the number of aten ops (CPU only)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call(fn, cfg, inputs)
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base), None
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            lp = call(fn, cfg, inputs)
        del lp
    all_events = list(prof.profiler.kineto_results.events())
    events = sorted((e for e in all_events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return float(peak), sum(e.name().startswith("aten::") for e in all_events)


def bench_entries(args: argparse.Namespace) -> list[Entry]:
    """The presets (``--only``: some of them, the baseline always first) and the surrogate rows."""
    names = [n for n in PRESETS if n == BASELINE or not args.only or n in args.only.split(",")]
    entries = preset_entries(names)
    return entries + (surrogate_entries(entries) if args.surrogates else [])


def folder_of(args: argparse.Namespace) -> str:
    """``--mode update`` writes a folder of its own (its committed results: docs/results/update_share/)."""
    return "update_share" if args.mode == "update" else "bench"


def run(args: argparse.Namespace, argv: list[str]) -> None:
    if args.mode == "update":
        return run_update(args, argv, bench_entries(args))
    torch.set_num_threads(args.threads)
    out = journal.start(args.out, argv)
    t0 = time.time()
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if "cuda" in devices and not torch.cuda.is_available():
        raise SystemExit("bench: --devices names cuda, but torch sees no CUDA GPU")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    Ts = [int(x) for x in args.T.split(",")]
    entries = bench_entries(args)
    if args.compile:  # the same presets with policy_loss.compile=true, next to the eager ones
        entries += [compiled(e) for e in entries if e.loss_mode in TOKEN_SETS]
    fns = {e.label: (loss_fn(e), entry_config(e)) for e in entries}
    rows = []
    for device in devices:
        clock = time.process_time if device == "cpu" and args.clock == "process" else time.perf_counter
        for T in Ts:
            for dname, dtype in dtypes.items():
                inputs = make_inputs(args.B, T, dtype, device)
                unit = args.B * T * 4
                times = {e.label: [] for e in entries}
                for e in entries:  # warm-up
                    for _ in range(args.warmup):
                        call(*fns[e.label], inputs)
                for _ in range(args.reps):
                    for e in entries:
                        fn, cfg = fns[e.label]
                        sync(device)
                        s = clock()
                        call(fn, cfg, inputs)
                        sync(device)
                        times[e.label].append(clock() - s)
                base = min(times[entries[0].label])
                base_med = statistics.median(times[entries[0].label])
                base_mem = None
                for e in entries:
                    fn, cfg = fns[e.label]
                    with count_host_syncs() as counter:
                        if device == "cuda":
                            torch.cuda.set_sync_debug_mode("warn")
                        try:
                            call(fn, cfg, inputs)
                        finally:
                            if device == "cuda":
                                torch.cuda.set_sync_debug_mode(0)
                    mem, ops = peak_memory(fn, cfg, inputs, device)
                    mem /= unit
                    base_mem = mem if base_mem is None else base_mem
                    best = min(times[e.label])
                    med = statistics.median(times[e.label])
                    rows.append(
                        {
                            "device": device,
                            "T": T,
                            "dtype": dname,
                            "loss": e.label,
                            "loss_mode": e.loss_mode,
                            "ms": best * 1e3,
                            "x_vanilla": best / base,
                            "ms_median": med * 1e3,
                            "x_vanilla_median": med / base_med,
                            "peak_BT": mem,
                            "extra_BT_vs_vanilla": mem - base_mem,
                            "aten_ops": ops,
                            "host_syncs": counter["n"],
                            "sync_calls": " ".join(f"{k}:{v}" for k, v in sorted(counter["by"].items())),
                        }
                    )
                common.log(f"bench: {device} T={T} {dname} done ({time.time() - t0:.0f}s)")
    common.write_csv(out / "bench.csv", rows)
    prof_entries = [e for e in entries if not e.label.endswith("+compile")]
    profile_text = profile_breakdown(fns, prof_entries, args) if args.profile else ""
    if profile_text:
        (out / "profile.txt").write_text(profile_text)
    write_report(out, rows, args, time.time() - t0, bool(profile_text))
    common.report_written(out)


def profile_breakdown(fns, entries, args) -> str:
    """Where the time goes: torch.profiler op table of each loss at T=4096 fp32 on CPU."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(args.B, 4096, torch.float32, "cpu")
    parts = []
    for e in entries:
        fn, cfg = fns[e.label]
        call(fn, cfg, inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                call(fn, cfg, inputs)
        parts.append(
            f"===== {e.label} (3 calls, B={args.B}, T=4096, fp32, CPU)\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        )
    return "\n".join(parts)


def write_report(out, rows, args, seconds, profiled) -> None:
    lines = [
        "# Loss benchmark",
        "",
        f"Made by the command in `COMMAND.txt` ({seconds:.0f} s). B={args.B}, best of {args.reps} "
        f"interleaved repetitions after {args.warmup} warm-up calls, {args.threads} torch thread(s), "
        f"{'process CPU time' if args.clock == 'process' else 'wall time'} on CPU; forward + backward + metrics "
        "of each loss preset as shipped (`hydra_configs/loss/*.yaml`; `grpo` is verl's `vanilla`, "
        "the baseline), and of each other surrogate on the first preset of each of our token sets "
        "(`<preset>+<surrogate>`: `policy_loss.surrogate`, with `clip_schedule=ratio` where the surrogate "
        "needs it). "
        "All rows: `bench.csv`." + (" Op-level profiles at T=4096 fp32: `profile.txt`." if profiled else ""),
        "",
        "- `ms`, `x_vanilla`: best time, and its ratio to verl `vanilla`'s best time in the same setting (<= 1.0 is "
        "the target); `x_vanilla_median`: the same with medians (noisier on a shared machine).",
        "- `peak_BT`: peak memory held during the call beyond its inputs, in units of one [B,T] float32 tensor "
        "(CPU: torch.profiler allocator events; GPU: max_memory_allocated). `extra_BT_vs_vanilla` is the "
        "difference to vanilla (target <= 4).",
        "- `aten_ops`: aten operator calls (nested ones included) in one forward+backward, from the same "
        "profile: a load-independent proxy for CPU dispatch overhead and GPU kernel launches.",
        "- `host_syncs`: Python-level device-to-host transfers per call (item/tolist/numpy/cpu/bool/float/int); "
        "verl's `vanilla` and `gspo` do 3 `.item()` each, ours one `.tolist()` of all metrics.",
        "- The segmentation runs on the same torch ops on every device (one implementation per rule).",
        "",
    ]
    if not any(r["device"] == "cuda" for r in rows):
        lines += ["No CUDA GPU was available to this run: no CUDA table here (`docs/results/bench_cuda/` has one).", ""]
    for device in sorted({r["device"] for r in rows}):
        for dname in ("fp32", "bf16"):
            sel = [r for r in rows if r["device"] == device and r["dtype"] == dname]
            if not sel:
                continue
            lines += [
                f"## {device}, {dname}",
                "",
                common.markdown_table(
                    sel,
                    [
                        "T",
                        "loss",
                        "ms",
                        "x_vanilla",
                        "x_vanilla_median",
                        "peak_BT",
                        "extra_BT_vs_vanilla",
                        "aten_ops",
                        "host_syncs",
                        "sync_calls",
                    ],
                ),
                "",
            ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    study.add_sections(out, STUDY.folder)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--T", default="1024,4096,8192", help="comma-separated response lengths")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared machine)")
    p.add_argument("--only", default="", help=f"comma-separated presets to run ({BASELINE} always runs, first)")
    p.add_argument("--devices", default="", help="comma-separated (cpu, cuda); default: cpu, and cuda if there is one")
    p.add_argument(
        "--clock", choices=["process", "wall"], default="process", help="CPU timing: process CPU time or wall time"
    )
    p.add_argument("--compile", action="store_true", help="add each of our presets with policy_loss.compile=true")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the op-level profile")
    p.add_argument(
        "--no-surrogates",
        dest="surrogates",
        action="store_false",
        help="skip the <preset>+<surrogate> rows (each other surrogate on one preset per token set)",
    )
    p.add_argument(
        "--mode",
        choices=["loss", "update"],
        default="loss",
        help="loss: the loss call alone (--B, --T); update: the loss's share of an actor update on a Llama-shaped "
        "model (sizes from the options of --mode update)",
    )
    add_update_arguments(p)


# ---- --mode update: the loss's share of a real actor update ----
# A Llama-shaped causal LM (transformers' ``LlamaForCausalLM``, random weights: Llasa-1B's shape on a GPU,
# a tiny one on CPU) runs what verl's actor does per micro-batch: forward over prompt + response ->
# log-probs of the response tokens (log-softmax of the logits in float32, gathered) -> each preset's loss
# (fetched from verl's registry, called as verl's ``ppo_loss`` calls it, response ids in scope) ->
# backward into the model's parameters. No optimizer step (the same for every loss).
#
# Per preset, interleaved within each repetition so that load hits them alike: the update's time, and
# the time of the loss alone (its forward + backward on detached log-probs of the same shape, what
# ``bench`` times). Reported: best (minimum) and median of ``--reps`` repetitions, the update as a
# multiple of ``grpo``'s (verl's ``vanilla``), and the loss's share of the update (loss time / update
# time). On CPU the clock is the process's CPU time (``--clock process``) or wall time; on a GPU wall
# time after ``torch.cuda.synchronize()``.

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
UPDATE_DEFAULTS = {
    "cuda": ("llasa-1b", 4, 256, 2048, "bf16", True),
    "cpu": ("tiny", 4, 32, 256, "fp32", False),
}
UPDATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(shape: str, dtype: torch.dtype, device: str, checkpointing: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, attn_implementation="sdpa")
    with torch.device(device):  # initialised where it runs: Llasa-1B's shape on one CPU thread takes minutes
        model = LlamaForCausalLM(config).to(dtype=dtype)
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
    _, _, adv, mask, ids, words = make_inputs(B, T, torch.float32, device, seed=seed)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    model_ids = (ids % vocab).to(device)
    input_ids = torch.cat([torch.randint(0, vocab, (B, prompt), generator=g).to(device), model_ids], dim=1)
    with torch.no_grad():
        current = response_log_probs(model, input_ids, T, model_ids)
    old = current + 0.1 * torch.randn(current.shape, generator=g).to(device)
    return input_ids, model_ids, old, current, adv, mask, ids, words


def run_update(args: argparse.Namespace, argv: list[str], entries) -> None:
    """``--mode update``: the loss's share of an actor update (see the section comment above)."""
    torch.set_num_threads(args.threads)
    out = journal.start(args.out, argv)
    t0, load_before = time.time(), os.getloadavg()[0]
    device = args.devices.split(",")[0] if args.devices else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --devices names cuda, but torch sees no CUDA GPU")
    shape, B, prompt, T, dname, ckpt = UPDATE_DEFAULTS[device]
    shape = args.shape or shape
    B, prompt, T = args.update_batch or B, args.prompt_len or prompt, args.response_len or T
    dname = args.update_dtype or dname
    ckpt = ckpt if args.checkpointing is None else args.checkpointing
    model = build_model(shape, UPDATE_DTYPES[dname], device, ckpt)
    input_ids, model_ids, old, current, adv, mask, ids, words = update_inputs(model, B, prompt, T, device)
    fns = {e.label: (loss_fn(e), entry_config(e)) for e in entries}
    clock = time.process_time if device == "cpu" and args.clock == "process" else time.perf_counter

    def update(label):
        fn, cfg = fns[label]
        model.zero_grad(set_to_none=True)
        lp = response_log_probs(model, input_ids, T, model_ids)
        with micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, VOCABULARY):
            loss, _ = fn(old, lp, adv, mask, cfg.loss_agg_mode, cfg, None)
        loss.backward()

    def loss_only(label):
        fn, cfg = fns[label]
        call(fn, cfg, (old, current, adv, mask, ids, words))

    def timed(work, label):
        sync(device)
        start = clock()
        work(label)
        sync(device)
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
    common.report_written(out)


def add_update_arguments(p: argparse.ArgumentParser) -> None:
    """The update mode's own knobs (defaults per device: ``UPDATE_DEFAULTS``)."""
    g = p.add_argument_group("--mode update")
    g.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (cpu: tiny; cuda: llasa-1b)")
    g.add_argument("--update-batch", type=int, default=None, help="sequences per update (default 4)")
    g.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (cpu: 32; cuda: 256)")
    g.add_argument("--response-len", type=int, default=None, help="response tokens (cpu: 256; cuda: 2048)")
    g.add_argument(
        "--update-dtype", choices=sorted(UPDATE_DTYPES), default=None, help="model dtype (cpu: fp32; cuda: bf16)"
    )
    g.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gradient checkpointing (cpu: off; cuda: on)",
    )
