"""Learning inside verl: the real trainer (local CPU mode) for N steps per loss preset, task and seed.

Each run is ``python -m maspo_verl.main local=cpu loss=<preset> ...`` on the embedded tiny model with
the toy tasks of ``learn_tasks`` (a text-like and a speech-like task, sequence-level reward, known word
spans); everything but the loss is equal across runs of a task and seed (model initialisation, data
order, batch, learning rate, rollout). Metrics are verl's own, parsed from its console logger
(``step:N - key:value ...``): ``critic/score/mean`` (the reward), ``actor/pg_clipfrac``,
``timing_s/step``, ``response_length/mean``. Writes (``outputs/lab/learn/`` by default): README (table and
findings), ``learn_steps.csv`` (per step), ``learn_runs.csv`` (per run), ``learn_summary.csv``,
``learn_reward.png`` and ``COMMAND.txt``.
"""

from __future__ import annotations

import ast
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from maspo_verl.lab.common import log, markdown_table, prepare_out, pyplot, write_csv
from maspo_verl.lab.learn_tasks import FRAMES_PER_WORD, RESPONSE_TOKENS

# name -> overrides; maspo_fixed uses W=3 tokens (the preset's 15 is a syllable at 50 Hz, longer than
# these responses' words)
LOSSES = {
    "grpo": ["loss=grpo"],
    "gspo": ["loss=gspo"],
    "maspo_fixed": ["loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.segment_window=3"],
    "maspo_logprob": ["loss=maspo_logprob"],
    "maspo_tokenval": ["loss=maspo_tokenval"],
    "ctpo": ["loss=ctpo"],
    "pgspo": ["loss=pgspo"],
    "maspo_fixed+span": ["loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.segment_window=3", "credit=span"],
    # one ratio per decoded word (the reward manager returns the words' token spans)
    "maspo_words": ["loss=maspo_words"],
}
STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
KEYS = ("critic/score/mean", "actor/pg_clipfrac", "actor/grad_norm", "response_length/mean", "timing_s/step")


def add_arguments(p) -> None:
    p.add_argument("--tasks", nargs="+", default=["text", "speech"], help="text and/or speech")
    p.add_argument("--losses", nargs="+", default=list(LOSSES), help=f"from {list(LOSSES)}")
    p.add_argument("--seeds", type=int, default=2, help="seeds per (task, loss): model init and data order")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--target", type=float, default=0.45, help="reward target for 'steps to target'")
    p.add_argument("--last", type=int, default=3, help="final reward = mean of the last K steps")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")


def parse_steps(log_text: str) -> dict[int, dict[str, float]]:
    """verl's console logger prints ``step:N - key:value - key:value ...`` once per step."""
    steps: dict[int, dict[str, float]] = {}
    for raw in log_text.splitlines():
        m = STEP_LINE.search(ANSI.sub("", raw))
        if not m:
            continue
        metrics = {}
        for item in m.group(2).split(" - "):
            key, sep, value = item.rpartition(":")
            if not sep:
                continue
            value = WRAPPED.sub(r"\1", value.strip())
            try:
                metrics[key.strip()] = float(ast.literal_eval(value))
            except (ValueError, SyntaxError, TypeError):
                continue
        steps[int(m.group(1))] = metrics
    return steps


def stop_run(proc: subprocess.Popen, ray_dir: str) -> None:
    """Stop the run's process group, then any process of its private Ray cluster (named by its temp dir)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    for attempt in range(10):
        left = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if ray_dir in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                        left.append(int(entry.name))
                except OSError:
                    continue
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGTERM if attempt < 5 else signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)


def run_trainer(overrides: list[str], log_path: Path, timeout: float) -> tuple[int | None, str, float]:
    """One local-mode trainer run in its own private Ray cluster; (exit code, log, wall seconds)."""
    ray_dir = tempfile.mkdtemp(prefix="mvl_learn_", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "maspo_verl.main", "local=cpu", f"+ray_kwargs.ray_init._temp_dir={ray_dir}"]
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd + overrides, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_run(proc, ray_dir)
    import shutil

    shutil.rmtree(ray_dir, ignore_errors=True)
    return code, log_path.read_text(errors="replace"), time.monotonic() - start


def overrides_for(args, task: str, loss: str, seed: int, data: dict) -> list[str]:
    from maspo_verl.lab import learn_tasks

    return [
        *LOSSES[loss],
        f"data.train_files={data['train']}",
        f"data.val_files={data['val']}",
        f"data.train_batch_size={args.batch}",
        f"data.max_response_length={learn_tasks.RESPONSE_TOKENS}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"data.seed={seed}",
        f"maspo.local_seed={seed}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, args.batch // 2)}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch * args.n // 2}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.total_training_steps={args.steps}",
        "reward.reward_manager.source=importlib",
        "reward.reward_manager.name=LearnRewardManager",
        f"reward.reward_manager.module.path={learn_tasks.__file__}",
        f"trainer.experiment_name=learn_{task}_{loss}_{seed}",
    ]


def steps_to(curve: list[float], target: float) -> int | None:
    for i, v in enumerate(curve, 1):
        if v >= target:
            return i
    return None


def summarise(args, runs: list[dict]) -> list[dict]:
    out = []
    grpo_time = {}
    for task in args.tasks:
        for loss in args.losses:
            mine = [r for r in runs if r["task"] == task and r["loss"] == loss]
            ok = [r for r in mine if r["ok"]]
            finals = [r["final_reward"] for r in ok]
            reached = [r["steps_to_target"] for r in ok if r["steps_to_target"] is not None]
            row = {
                "task": task,
                "loss": loss,
                "seeds_ok": f"{len(ok)}/{len(mine)}",
                "first_reward": _mean([r["first_reward"] for r in ok]),
                "final_reward": _mean(finals),
                "final_sd": statistics.pstdev(finals) if len(finals) > 1 else float("nan"),
                f"reach_{args.target:g}": f"{len(reached)}/{len(mine)}",
                "median_steps_to_target": statistics.median(reached) if reached else float("nan"),
                "collapses": sum(r["collapsed"] for r in mine),
                "mean_clipfrac": _mean([r["mean_clipfrac"] for r in ok]),
                "s_per_step": _mean([r["s_per_step"] for r in ok]),
            }
            if loss == "grpo":
                grpo_time[task] = row["s_per_step"]
            out.append(row)
    for row in out:
        base = grpo_time.get(row["task"])
        row["time_vs_grpo"] = row["s_per_step"] / base if base and base == base else float("nan")
    return out


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def run(args, argv) -> None:
    from maspo_verl.lab import learn_tasks

    out = prepare_out(args.out, argv)
    unknown = [loss for loss in args.losses if loss not in LOSSES]
    if unknown:
        raise SystemExit(f"--losses: unknown {unknown}; allowed {list(LOSSES)}")
    logs = Path(tempfile.mkdtemp(prefix="maspo_learn_logs_"))
    step_rows, runs = [], []
    total_start = time.monotonic()
    for seed in range(args.seeds):
        for task in args.tasks:
            data = learn_tasks.write_dataset(logs / f"data_seed{seed}", task, seed=seed)
            for loss in args.losses:
                log_path = logs / f"{task}_{loss}_{seed}.log"
                code, text, wall = run_trainer(overrides_for(args, task, loss, seed, data), log_path, args.timeout)
                steps = parse_steps(text)
                trained = [s for s in sorted(steps) if "critic/score/mean" in steps[s]]
                curve = [steps[s]["critic/score/mean"] for s in trained]
                for s in trained:
                    step_rows.append(
                        {"task": task, "loss": loss, "seed": seed, "step": s}
                        | {k: steps[s].get(k, float("nan")) for k in KEYS}
                    )
                ok = code == 0 and len(trained) == args.steps
                k = min(args.last, len(curve))
                final = sum(curve[-k:]) / k if k else float("nan")
                first = curve[0] if curve else float("nan")
                nonfinite = any(not math.isfinite(steps[s].get("actor/pg_loss", 0.0)) for s in trained)
                runs.append(
                    {
                        "task": task,
                        "loss": loss,
                        "seed": seed,
                        "ok": ok,
                        "exit_code": code,
                        "steps": len(trained),
                        "first_reward": first,
                        "final_reward": final,
                        "steps_to_target": steps_to(curve, args.target),
                        # collapse: the run failed, a loss went non-finite, or the reward ended below its start
                        "collapsed": (not ok) or nonfinite or (final < first - 0.05),
                        "mean_clipfrac": _mean([steps[s].get("actor/pg_clipfrac") for s in trained]),
                        "s_per_step": _mean([steps[s].get("timing_s/step") for s in trained[1:]]),
                        "wall_s": wall,
                    }
                )
                log(
                    f"learn {task} {loss} seed {seed}: exit {code}, {len(trained)} steps, reward "
                    f"{first:.3f} -> {final:.3f}, {wall:.0f}s (log {log_path})"
                )
    summary = summarise(args, runs)
    write_csv(out / "learn_steps.csv", step_rows)
    write_csv(out / "learn_runs.csv", runs)
    write_csv(out / "learn_summary.csv", summary)
    plot(args, step_rows, out / "learn_reward.png")
    (out / "README.md").write_text(readme(args, summary, runs, time.monotonic() - total_start))
    log(f"learn: wrote {out} in {time.monotonic() - total_start:.0f}s")


def plot(args, step_rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.tasks), figsize=(6.5 * len(args.tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], args.tasks, strict=True):
        for loss in args.losses:
            by_step: dict[int, list[float]] = {}
            for r in step_rows:
                if r["task"] == task and r["loss"] == loss:
                    by_step.setdefault(r["step"], []).append(r["critic/score/mean"])
            if not by_step:
                continue
            xs = sorted(by_step)
            mean = [statistics.fmean(by_step[x]) for x in xs]
            lo = [min(by_step[x]) for x in xs]
            hi = [max(by_step[x]) for x in xs]
            (line,) = ax.plot(xs, mean, label=loss)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        ax.axhline(args.target, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{task}-like task: reward (critic/score/mean), mean and seed range")
        ax.set_xlabel("training step")
        ax.set_ylabel("reward")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def findings(args, summary: list[dict], runs: list[dict]) -> list[str]:
    """Statements derived from the numbers (no pass/fail on which loss wins)."""
    lines = []
    for task in args.tasks:
        rows = [r for r in summary if r["task"] == task and not math.isnan(r["final_reward"])]
        if not rows:
            continue
        grpo = [r for r in runs if r["task"] == task and r["loss"] == "grpo"]
        if grpo:
            rises = [r["final_reward"] - r["first_reward"] for r in grpo if r["ok"]]
            lines.append(
                f"{task}: grpo's reward rose from {_mean([r['first_reward'] for r in grpo]):.3f} to "
                f"{_mean([r['final_reward'] for r in grpo]):.3f} (rise per seed: "
                + ", ".join(f"{x:+.3f}" for x in rises)
                + f"; {sum(x > 0.05 for x in rises)}/{len(grpo)} seeds rose by more than 0.05)."
            )
        best = max(rows, key=lambda r: r["final_reward"])
        worst = min(rows, key=lambda r: r["final_reward"])
        lines.append(
            f"{task}: highest final reward {best['loss']} ({best['final_reward']:.3f}), lowest "
            f"{worst['loss']} ({worst['final_reward']:.3f}); seed spread up to "
            f"{max((r['final_sd'] for r in rows if not math.isnan(r['final_sd'])), default=float('nan')):.3f} (sd)."
        )
        collapsed = [f"{r['loss']} ({r['collapses']})" for r in rows if r["collapses"]]
        lines.append(f"{task}: collapses: {', '.join(collapsed) if collapsed else 'none'}.")
        slow = max(rows, key=lambda r: r["time_vs_grpo"] if not math.isnan(r["time_vs_grpo"]) else 0)
        lines.append(
            f"{task}: wall time per step relative to grpo: "
            + ", ".join(f"{r['loss']} {r['time_vs_grpo']:.2f}" for r in rows)
            + f" (largest: {slow['loss']}; the tiny model makes rollout and Ray overhead dominate)."
        )
    return lines


def readme(args, summary: list[dict], runs: list[dict], total_s: float) -> str:
    keys = list(summary[0]) if summary else []
    cmd = "python -m maspo_verl.lab learn " + " ".join(
        [f"--tasks {' '.join(args.tasks)}", f"--seeds {args.seeds}", f"--steps {args.steps}"]
    )
    return "\n".join(
        [
            "# Learning inside verl: each loss preset on verl's real trainer (local CPU mode)",
            "",
            f"`{cmd}` (exact command in `COMMAND.txt`); {len(runs)} runs, {total_s / 60:.1f} min in all.",
            "",
            "Every run is `python -m maspo_verl.main local=cpu loss=<preset>` (verl's trainer, Ray, FSDP2,"
            " agent-loop rollout) on the embedded tiny random Qwen2 (byte-level, ~91k parameters) with the"
            " toy tasks of `maspo_verl/lab/learn_tasks.py`: word k of 4 is the id block [64k, 64k+64); each"
            " run has one sentence (from the seed) that every prompt asks for; *text-like*: each token is a"
            f" word, {RESPONSE_TOKENS} words; *speech-like*: a run of tokens in one block is a word (tied"
            f" neighbours), {RESPONSE_TOKENS // FRAMES_PER_WORD} words of {FRAMES_PER_WORD} frames. Reward:"
            " 1 - edit distance / max(|hyp|, |ref|) over words (a WER normalised to [0, 1]); the word spans"
            " give per-token scores, used by `credit=span`.",
            f"Per step: {args.batch} prompts x {args.n} responses of {RESPONSE_TOKENS} tokens,"
            f" 2 mini-batches, lr {args.lr:g}; seeds set the model initialisation and data order."
            " `maspo_fixed` uses W = 3 tokens. Everything else equal.",
            "",
            f"Columns: reward at step 1 and final (mean of the last {args.last} steps, mean over seeds, sd"
            f" over seeds), seeds reaching reward {args.target:g} and the median step they did, collapses"
            " (run failed, non-finite loss, or final reward below the first by > 0.05), verl's"
            " `actor/pg_clipfrac` averaged over steps, `timing_s/step` (steps 2..N) and its ratio to grpo"
            " in the same run. All from verl's logged metrics.",
            "",
            markdown_table(summary, keys),
            "## Findings",
            "",
            *[f"- {line}" for line in findings(args, summary, runs)],
            "",
            "Files: `learn_steps.csv` (verl's metrics per step and run), `learn_runs.csv`, `learn_summary.csv`,"
            " `learn_reward.png` (reward per step, mean and seed range).",
            "",
        ]
    )
