"""Learning inside verl: the real trainer (local CPU mode) for N steps per loss preset, cell and seed.

Each run is ``python -m maspo_verl.main local=cpu loss=<preset> ...`` on the embedded tiny model with
the toy tasks of ``learn_tasks`` (a text-like and a speech-like task, sequence-level reward, known word
spans; or ``smollm2``, the local mode's pretrained SmolLM2 on its arithmetic task); everything but the
loss is equal across the runs of a cell and seed (model initialisation, data order, batch, learning rate,
rollout). A *cell* is one point of the axes:

- response length (``--lengths``, tokens; the sentence grows with it);
- training-inference mismatch (``--mismatch``): ``none``, ``bf16`` (the rollout server's model in
  bf16), ``SIGMA`` (Gaussian noise of that sigma on each returned log-prob), ``stale<K>`` (the server
  applies each weight sync K syncs late: it samples from the policy of K updates ago, a real policy
  mismatch as in asynchronous RL), or several joined by ``+`` (``bf16+0.05``, ``stale1+0.2``); the
  local mode's test instrument ``maspo.local_mismatch``. It needs ``--bypass`` (verl's
  ``bypass_mode``: the server's log-probs are the old log-probs; otherwise verl recomputes them);
- off-policy pressure (``--updates``): optimizer updates per batch, as that many mini-batches;
  with 1, the old log-probs differ from the trainer's only by the mismatch.

``--cells LENGTH/MISMATCH/UPDATES ...`` lists cells explicitly instead of the full product.

``--losses`` takes loss presets (``hydra_configs/loss/``; default: all, and ``maspo_fixed+span``, a
preset with the credit preset ``credit=span``); ``ADJUSTMENTS`` fits a preset to these short responses.

Runs go through ``maspo_verl.lab.engine.runs``; metrics are verl's own (the run folder's ``metrics.jsonl``,
verl's ``file`` logger; else its console lines ``step:N - key:value ...``). Per run: final reward
(``critic/score/mean``, mean of the last K steps), mean reward over all steps (the speed measure),
steps to a reward gain, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/grad_norm`` (mean and sd
over steps), verl's ``rollout_corr/*`` and ``training/rollout_*`` diagnostics when it logs them (not
in bypass mode), collapses, and verl's validation metrics (``val-core/*``) at the last step where the task
runs one. The summary gives means with 95 % t-intervals over seeds and
paired (same-seed) differences.
Writes ``outputs/lab/learn/`` (``--update-docs``: ``docs/results/learn/``; or ``--out``): README,
``learn_steps.csv``, ``learn_runs.csv``,
``learn_summary.csv``, ``learn_compare.csv``, ``learn_reward.png``, ``learn_sigma.png``, ``COMMAND.txt``.
"""

from __future__ import annotations

import functools
import math
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from maspo_verl.lab.engine import journal, learn_engine, stats, word_grid
from maspo_verl.lab.engine.cells import NO_MISMATCH, UNIT_MEDIAN, Cell, parse_cell
from maspo_verl.lab.engine.common import log, markdown_table, pyplot, write_csv
from maspo_verl.lab.engine.learn_engine import ENGINES
from maspo_verl.lab.engine.presets import SHIPPED
from maspo_verl.lab.engine.runs import VALIDATION, load_rows, run_local, slug
from maspo_verl.lab.engine.stats import mean_interval
from maspo_verl.lab.engine.study import Study
from maspo_verl.local import engine_of, speechwarm
from maspo_verl.local.learn_tasks import PRETRAINED, RESPONSE_TOKENS, SPEECH_WORDS, turns_of
from maspo_verl.util import preset_names

STUDY = Study(
    "learn",
    "each loss preset on verl's real trainer (local CPU mode): reward per step on toy tasks",
    writes=("README.md", "learn_summary.csv", "learn_compare.csv", "learn_reward.png", "learn_sigma.png"),
)

BASELINE = "grpo"
# a loss of ``--losses`` is a loss preset (``loss=<name>``) or PRESET+CREDIT with a credit preset (``credit=``);
# PRESET may be a variant PRESET@field=value[,field=value] (``presets.variant``: policy-loss fields changed)
# or maspo_words~offsetN (``word_grid``: the frame grid's word ids shifted by N frames, part 2's H2 control)
CREDIT_SEP = "+"
VARIANT_SEP = "@"
# maspo_fixed's window (15 tokens, a syllable at 50 Hz) is longer than these responses' words: W = 3 tokens
ADJUSTMENTS = {"maspo_fixed": ["actor_rollout_ref.actor.policy_loss.segment_window=3"]}
# every loss preset, the baseline first, and MASPO fixed windows with span credit (the per-token scores travel)
DEFAULT_LOSSES = [BASELINE, *(p for p in preset_names() if p != BASELINE), f"maspo_fixed{CREDIT_SEP}span"]
KEYS = (
    "critic/score/mean",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/pg_loss",
    "response_length/mean",
    "timing_s/step",
    # the loss's drift correlation of the per-token log-ratios (core.metrics.correlation_sums; 1 = independent)
    "actor/ratio/corr_lag1",
    "actor/ratio/vif5",
    "actor/ratio/vif15",
    "actor/ratio/vif50",
    "actor/ratio/vif_segments",
)
# verl's training-inference mismatch diagnostics (decoupled mode only: verl skips them in bypass mode)
DIAGNOSTIC_PREFIXES = ("rollout_corr/", "training/rollout_")
IGNORE_EOS = "actor_rollout_ref.rollout.ignore_eos=true"  # the toy tasks' responses have a fixed length
# averaged over steps per run, reported per loss and cell: those and the loss's ratio metrics (the correlation too)
REPORTED_PREFIXES = (*DIAGNOSTIC_PREFIXES, "actor/ratio/")
MISMATCH_DTYPE = "bf16"  # the knob's one non-default dtype (maspo_verl.local.mismatch validates it in the trainer)
COLLAPSE_DROP = 0.1
FP32 = "fp32"


def add_arguments(p) -> None:
    p.add_argument(
        "--tasks",
        nargs="+",
        default=["text", "speech"],
        help="text, speech, speechwarm (speech on the warm-started model), turns<N> (N turns of LENGTH tokens), "
        "smollm2 (model=smollm2: SmolLM2-135M-Instruct on arithmetic, answers of at most LENGTH tokens ending at EOS)",
    )
    p.add_argument(
        "--losses",
        nargs="+",
        default=DEFAULT_LOSSES,
        help=f"loss presets {preset_names()}, each optionally +CREDIT (credit presets {preset_names('credit')}) "
        f"or a variant PRESET{VARIANT_SEP}field=value[,...] (e.g. maspo_fixed@segment_window=4)",
    )
    p.add_argument("--seeds", type=int, default=2, help="seeds per (task, cell, loss): model init and data order")
    p.add_argument("--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+SEEDS-1 (e.g. tuning seeds apart)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--lengths", nargs="+", type=int, default=None, help=f"response tokens (default {RESPONSE_TOKENS})")
    p.add_argument(
        "--mismatch",
        nargs="+",
        default=None,
        help="none | bf16 | SIGMA | stale<K> | joined by +: the rollout vs the trainer (needs --bypass)",
    )
    p.add_argument("--updates", nargs="+", type=int, default=None, help="optimizer updates per batch (default 2)")
    p.add_argument("--cells", nargs="+", default=None, help="LENGTH/MISMATCH/UPDATES ... instead of the product")
    p.add_argument("--bypass", action="store_true", help="bypass mode: the rollout's log-probs are the old log-probs")
    p.add_argument(
        "--fp32-trainer",
        action="store_true",
        help="the actor's forward in fp32 (verl's default FSDP mixed precision computes it in bf16)",
    )
    p.add_argument("--target", type=float, default=None, help="absolute reward target for 'steps to target'")
    p.add_argument("--gain", type=float, default=0.1, help="without --target: steps to reach step 1's reward + GAIN")
    p.add_argument("--last", type=int, default=3, help="final reward = mean of the last K steps")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--resume", action="store_true", help="keep the runs already in --out's learn_runs.csv")
    p.add_argument(
        "--report", action="store_true", help="only rebuild the tables, plots and README from --out's runs (no run)"
    )
    p.add_argument(
        "--bands",
        nargs="+",
        default=[],
        metavar="PRESET=WIDTH",
        help="a preset's clip band scaled by WIDTH (a number > 0, or inf: no clip), as lab regimes_tuned scales it",
    )
    p.add_argument("--no-adjust", action="store_true", help="presets as shipped (without learn.ADJUSTMENTS)")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=ENGINES[0],
        help="trainer: verl's trainer in the local mode (a process and a Ray cluster per run); lab: the same "
        "config's RL loop in this process (lab/learn_engine.py; speechwarm only)",
    )
    p.add_argument(
        "--workers", type=int, default=1, help="--engine lab: runs at a time, each in its own process on one core"
    )


# -- cells --------------------------------------------------------------------------------------


def cells_of(args) -> list[Cell]:
    if args.cells:
        if any(v is not None for v in (args.lengths, args.mismatch, args.updates)):
            raise SystemExit("--cells replaces --lengths/--mismatch/--updates: give one or the other")
        cells = [parse_cell(text) for text in args.cells]
    else:
        cells = [
            Cell(length, mismatch, updates)
            for length in args.lengths or [RESPONSE_TOKENS]
            for mismatch in args.mismatch or [NO_MISMATCH]
            for updates in args.updates or [2]
        ]
    for cell in cells:
        if cell.rollout.dtype not in ("fp32", MISMATCH_DTYPE):
            raise SystemExit(f"--mismatch {cell.mismatch!r}: lab learn's rollout precision is fp32 or {MISMATCH_DTYPE}")
        if (cell.lr, cell.unit) != (None, UNIT_MEDIAN):
            raise SystemExit(f"cell {cell.label}: lab learn's cells set no learning rate or unit (--lr, the task)")
        if cell.mismatch != NO_MISMATCH and not args.bypass:
            raise SystemExit(
                f"cell {cell.label}: a mismatch reaches the loss only in bypass mode (the rollout's log-probs as "
                "old log-probs); add --bypass"
            )
        if cell.updates < 1 or args.batch % cell.updates:
            raise SystemExit(f"cell {cell.label}: updates must divide --batch {args.batch} (one mini-batch each)")
        if cell.length < SPEECH_WORDS:
            raise SystemExit(f"cell {cell.label}: length must be >= {SPEECH_WORDS} tokens")
    if len(set(cells)) != len(cells):
        raise SystemExit(f"cells given twice: {[c.label for c in cells]}")
    return cells


# -- one run ----------------------------------------------------------------------------------


def loss_overrides(loss: str, bands: dict[str, str] | None = None, adjust: bool = True) -> list[str]:
    """``PRESET`` or ``PRESET+CREDIT`` -> the trainer's overrides (the preset's adjustment for these tasks too,
    unless ``adjust`` is off; a variant's changed fields; its clip band scaled where ``bands`` names it)."""
    full, _, credit = loss.partition(CREDIT_SEP)
    name, _ = word_grid.split(full)
    preset = name.partition(VARIANT_SEP)[0]
    adjustments = ADJUSTMENTS.get(preset, []) if adjust else []
    changed = []
    if VARIANT_SEP in name:
        shipped, fields = preset_of(preset).policy_loss, preset_of(name).policy_loss
        changed = [f"actor_rollout_ref.actor.policy_loss.{k}={v!r}" for k, v in fields.items() if v != shipped.get(k)]
    widened = band_overrides(name, bands[full]) if bands and full in bands else []
    return [f"loss={preset}", *adjustments, *changed, *widened, *([f"credit={credit}"] if credit else [])]


@functools.cache  # composing a preset takes Hydra about a second; every run of a study asks again
def preset_of(name: str):
    """A preset as the regime labs compose it (``presets.Preset``), or a variant ``PRESET@field=value[,...]`` of
    one (``presets.variant``: its fields checked as the trainer checks them, a SystemExit naming them)."""
    from maspo_verl.lab.engine.presets import discover_presets, variant

    return variant(name, "--losses") if VARIANT_SEP in name else discover_presets([name])[0]


def parse_bands(items: list[str]) -> dict[str, str]:
    """``--bands PRESET=WIDTH ...`` -> {preset: width}; WIDTH a number > 0 or ``inf``; PRESET may be a variant."""
    from maspo_verl.lab.engine.presets import UNCLIPPED

    presets, out = preset_names(), {}
    for item in items:
        preset, eq, width = item.rpartition("=")
        try:
            ok = bool(eq) and (width == UNCLIPPED or (math.isfinite(float(width)) and float(width) > 0))
        except ValueError:
            ok = False
        if not ok or word_grid.split(preset)[0].partition(VARIANT_SEP)[0] not in presets or preset in out:
            raise SystemExit(
                f"--bands {item!r}: allowed PRESET=WIDTH once per preset, PRESET in {presets}, WIDTH a number > 0 "
                f"or {UNCLIPPED} (e.g. grpo=4 gspo={UNCLIPPED})"
            )
        out[preset] = width
    return out


def bands_of(runs: list[dict]) -> dict[str, str]:
    """{preset: width} of the runs whose band was scaled (their ``band`` column)."""
    return {r["loss"].partition(CREDIT_SEP)[0]: r["band"] for r in runs if r.get("band") not in (None, "", SHIPPED)}


def band_overrides(preset: str, width: str) -> list[str]:
    """The overrides that scale ``preset``'s clip band by ``width`` (``presets.widen``: the log-space band
    where the preset's clip is log-space, else the ratio-space one; ``inf`` opens both)."""
    from maspo_verl.lab.engine.presets import widen

    shipped = preset_of(word_grid.split(preset)[0])  # the word-grid arm's band is its preset's
    wide = widen(shipped, width)
    out = [f"actor_rollout_ref.actor.{k}={v!r}" for k, v in wide.actor.items() if v != shipped.actor[k]]
    out += [
        f"actor_rollout_ref.actor.policy_loss.{k}={v!r}"
        for k, v in wide.policy_loss.items()
        if v != shipped.policy_loss[k]
    ]
    return out


def check_losses(losses: list[str]) -> None:
    """Every name of ``--losses`` (and of ``ADJUSTMENTS``) a preset: a clear error at start, not in a run."""
    presets, credits = preset_names(), preset_names("credit")
    stale = sorted(set(ADJUSTMENTS) - set(presets))
    if stale:
        raise SystemExit(f"learn.ADJUSTMENTS: {stale} are not loss presets (hydra_configs/loss/: {presets})")
    for loss in losses:
        preset, plus, credit = loss.partition(CREDIT_SEP)
        preset = word_grid.split(preset)[0]
        if VARIANT_SEP in preset:
            preset_of(preset)
        if preset.partition(VARIANT_SEP)[0] not in presets or (plus and credit not in credits):
            raise SystemExit(
                f"--losses {loss!r}: allowed a loss preset {presets}, optionally {CREDIT_SEP}CREDIT with a credit "
                f"preset {credits} (e.g. maspo_fixed{CREDIT_SEP}span)"
            )


def prompt_room(sentence: str) -> int:
    """data.max_prompt_length: "Say: <sentence>" (one token a byte) and the chat template's 19 tokens fit."""
    return max(64, len(f"Say: {sentence}") + 24)


def overrides_for(args, task: str, loss: str, seed: int, data: dict, cell: Cell) -> list[str]:
    from maspo_verl.local import learn_tasks

    rows = args.batch * args.n  # responses per step
    mini = args.batch // cell.updates
    extra = []
    if args.bypass:
        extra = ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=true"]
    if args.fp32_trainer:
        extra.append(f"++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={FP32}")
    if cell.mismatch != NO_MISMATCH:
        m = cell.rollout
        extra += [f"maspo.local_mismatch.logprob_dtype={m.dtype}", f"maspo.local_mismatch.noise_std={m.sigma}"]
        extra.append(f"maspo.local_mismatch.stale_syncs={m.stale}")
    offset = word_grid.split(loss.partition(CREDIT_SEP)[0])[1]
    if offset is not None and data.get("overrides"):
        raise SystemExit(f"--losses {loss!r}: the word grid needs a learn task's own reward, not task {task!r}")
    # a task with its own data, lengths and reward (learn_tasks.write_dataset: turns<N>), else ours
    task_data = data.get("overrides") or [
        f"data.train_files={data['train']}",
        f"data.val_files={data['val']}",
        f"data.max_prompt_length={prompt_room(data['sentence'])}",
        f"data.max_response_length={cell.length}",
        *([f"actor_rollout_ref.model.path={data['model']}"] if "model" in data else []),
        *(
            learn_tasks.reward_manager_overrides(learn_tasks.LearnRewardManager)
            if offset is None
            else word_grid.reward_overrides(offset)
        ),
    ]
    return [
        *loss_overrides(loss, parse_bands(args.bands), adjust=not args.no_adjust),
        *task_data,
        f"data.train_batch_size={args.batch}",
        # a pretrained model's answers end at EOS, and verl's greedy validation runs at the last step
        *([f"trainer.test_freq={args.steps}"] if data.get("pretrained") else [IGNORE_EOS]),
        f"data.seed={seed}",
        f"maspo.local_seed={seed}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini * args.n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={rows}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.total_training_steps={args.steps}",
        # enough epochs for the steps whatever the task's data size (the steps stop the run)
        f"trainer.total_epochs={args.steps}",
        f"trainer.experiment_name={slug(f'learn_{task}_{loss}_{seed}_{cell.label}')}",
        *extra,
    ]


def steps_to(curve: list[float], target: float) -> int | None:
    for i, v in enumerate(curve, 1):
        if v >= target:
            return i
    return None


def _mean(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def run_record(args, steps: dict[int, dict[str, float]], code: int | None) -> dict:
    """One run's numbers from its per-step metrics."""
    trained = [s for s in sorted(steps) if "critic/score/mean" in steps[s]]
    curve = [steps[s]["critic/score/mean"] for s in trained]
    ok = code == 0 and len(trained) == args.steps
    k = min(args.last, len(curve))
    final = sum(curve[-k:]) / k if k else float("nan")
    first = curve[0] if curve else float("nan")
    best = max((sum(curve[i : i + k]) / k for i in range(len(curve) - k + 1)), default=float("nan")) if k else first
    target = args.target if args.target is not None else first + args.gain
    reached = steps_to(curve, target)
    grads = [steps[s].get("actor/grad_norm", float("nan")) for s in trained]
    nonfinite = any(
        not math.isfinite(steps[s].get(key, 0.0)) for s in trained for key in ("actor/pg_loss", "actor/grad_norm")
    )
    # collapse: the run failed, a loss or gradient went non-finite, or the reward fell by COLLAPSE_DROP from
    # its best K-step mean (learned, then lost it)
    reason = "failed" if not ok else "non-finite" if nonfinite else "drop" if final < best - COLLAPSE_DROP else ""
    diagnostics = sorted({key for s in trained for key in steps[s] if key.startswith(REPORTED_PREFIXES)})
    extra = {key: _mean([steps[s].get(key) for s in trained]) for key in diagnostics}
    if trained:  # verl's validation at the last step, where the task runs one (learn_tasks.PRETRAINED)
        extra |= {key: v for key, v in steps[trained[-1]].items() if key.startswith(VALIDATION)}
    return {
        "ok": ok,
        "exit_code": code,
        "steps": len(trained),
        "first_reward": first,
        "final_reward": final,
        "mean_reward": _mean(curve),
        "gain": final - first,
        "steps_to_target": reached,
        # not reached: counted as steps + 1 (censored) in means
        "steps_to_target_c": reached if reached is not None else args.steps + 1,
        "collapsed": bool(reason),
        "collapse": reason,
        "mean_clipfrac": _mean([steps[s].get("actor/pg_clipfrac") for s in trained]),
        "mean_ppo_kl": _mean([steps[s].get("actor/ppo_kl") for s in trained]),
        "grad_norm_mean": _mean(grads),
        "grad_norm_sd": statistics.pstdev(grads) if len(grads) > 1 and all(map(math.isfinite, grads)) else math.nan,
        "s_per_step": _mean([steps[s].get("timing_s/step") for s in trained[1:]]),
    } | extra


def warm_fingerprint(steps: dict[int, dict[str, float]]) -> str:
    """The warm model's fingerprint a trainer run's steps record (``speechwarm.FINGERPRINT_METRIC``), "" where they
    record none; two in one run are both kept ("a+b"), so that it pairs with neither (``stats.same_model``)."""
    metric = speechwarm.FINGERPRINT_METRIC
    values = [m[metric] for m in steps.values() if math.isfinite(m.get(metric, math.nan))]
    found = {speechwarm.fingerprint_of_metric(v) for v in values}
    return "+".join(sorted(found))


# -- summary ----------------------------------------------------------------------------------

SUMMARY_METRICS = (
    "final_reward",
    "mean_reward",
    "steps_to_target_c",
    "mean_clipfrac",
    "grad_norm_mean",
    "grad_norm_sd",
)


def _ci_text(values: list, digits: int = 3) -> str:
    """The mean and its 95 % t-interval; one value has a mean but no interval, and says so."""
    mean, low, high = mean_interval(values)
    if mean != mean:
        return "nan"
    if low != low:
        return f"{mean:.{digits}f} (1 seed: no interval)"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def summarise(args, cells: list[Cell], runs: list[dict]) -> list[dict]:
    out = []
    for task in args.tasks:
        for cell in cells:
            base_time = None
            for loss in args.losses:
                mine = [r for r in runs if (r["task"], r["cell"], r["loss"]) == (task, cell.label, loss)]
                ok = [r for r in mine if r["ok"]]
                row = {"task": task, "cell": cell.label, "loss": loss, "seeds_ok": f"{len(ok)}/{len(mine)}"}
                for key in SUMMARY_METRICS:
                    row[key] = _ci_text([r[key] for r in ok], digits=2 if "steps" in key else 3)
                row["reached"] = f"{sum(r['steps_to_target'] is not None for r in ok)}/{len(mine)}"
                row["collapses"] = sum(r["collapsed"] for r in mine)
                row["s_per_step"] = _mean([r["s_per_step"] for r in ok])
                base_time = row["s_per_step"] if loss == BASELINE else base_time
                for key in sorted({k for r in ok for k in r if k.startswith(REPORTED_PREFIXES)}):
                    row[key] = _mean([r.get(key) for r in ok])
                out.append(row)
            for row in out[-len(args.losses) :]:
                row["time_vs_grpo"] = row["s_per_step"] / base_time if base_time else float("nan")
    return out


def _by_seed(runs: list[dict], task: str, cell: str, loss: str, key: str) -> dict[int, float]:
    return {
        r["seed"]: r[key]
        for r in runs
        if (r["task"], r["cell"], r["loss"]) == (task, cell, loss) and r["ok"] and r[key] == r[key]
    }


COMPARE_COLUMNS = (
    "task",
    "cell",
    "comparison",
    "loss",
    "vs",
    "metric",
    "seeds",
    "diff",
    "low",
    "high",
    "interval_excludes_0",
    "p_signflip",
)


def compare(args, cells: list[Cell], runs: list[dict]) -> list[dict]:
    """Paired (same-seed) differences with 95 % t-intervals:

    - ``vs_grpo``: loss - grpo in the same cell (final reward, mean reward, steps to target);
    - ``vs_no_mismatch``: the loss in a mismatch cell - the same loss without mismatch (final reward);
    - ``degradation_vs_grpo``: that change minus grpo's change (> 0: the loss degrades less than grpo).
    """
    labels = {c.label for c in cells}
    rows = []

    def add(kind, task, cell, loss, metric, terms, other):
        n, mean, low, high, p = stats.contrast(terms)
        if n == 0:
            return
        supported = (low > 0 or high < 0) and n > 1
        rows.append(
            {
                "task": task,
                "cell": cell.label,
                "comparison": kind,
                "loss": loss,
                "vs": other,
                "metric": metric,
                "seeds": n,
                "diff": mean,
                "low": low,
                "high": high,
                "interval_excludes_0": supported,
                "p_signflip": p,
            }
        )

    for task in args.tasks:
        for cell in cells:
            for loss in args.losses:
                if loss != BASELINE and BASELINE in args.losses:
                    for metric in ("final_reward", "mean_reward", "steps_to_target_c"):
                        mine = _by_seed(runs, task, cell.label, loss, metric)
                        base = _by_seed(runs, task, cell.label, BASELINE, metric)
                        add("vs_grpo", task, cell, loss, metric, [(1, mine), (-1, base)], BASELINE)
                ref = cell.reference()
                if cell.mismatch == NO_MISMATCH or ref.label not in labels:
                    continue
                here = _by_seed(runs, task, cell.label, loss, "final_reward")
                there = _by_seed(runs, task, ref.label, loss, "final_reward")
                add("vs_no_mismatch", task, cell, loss, "final_reward", [(1, here), (-1, there)], ref.label)
                if loss != BASELINE and BASELINE in args.losses:
                    g_here = _by_seed(runs, task, cell.label, BASELINE, "final_reward")
                    g_there = _by_seed(runs, task, ref.label, BASELINE, "final_reward")
                    terms = [(1, here), (-1, there), (-1, g_here), (1, g_there)]
                    add("degradation_vs_grpo", task, cell, loss, "final_reward", terms, BASELINE)
    return rows


def statements(args, cells: list[Cell], summary: list[dict], comparisons: list[dict]) -> list[str]:
    """Cell by cell, in words: which differences the intervals support (exclude 0) and which they do not."""

    def fmt(c):
        return f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"

    lines = []
    for task in args.tasks:
        for cell in cells:
            mine = [c for c in comparisons if (c["task"], c["cell"]) == (task, cell.label)]
            if not mine:
                continue
            parts = []
            for kind, metric, what in (
                ("vs_grpo", "final_reward", "final reward vs grpo"),
                ("vs_grpo", "mean_reward", "mean reward over the run (speed) vs grpo"),
                ("vs_no_mismatch", "final_reward", f"final reward vs no mismatch ({cell.reference().label})"),
                ("degradation_vs_grpo", "final_reward", "change with mismatch minus grpo's change"),
            ):
                rows = [c for c in mine if c["comparison"] == kind and c["metric"] == metric]
                if not rows:
                    continue
                yes = [f"{c['loss']} {fmt(c)}" for c in rows if c["interval_excludes_0"]]
                no = [c["loss"] for c in rows if not c["interval_excludes_0"]]
                if all(c["seeds"] < 2 for c in rows):
                    parts.append(f"{what}: no interval (1 seed; an interval needs 2)")
                    continue
                text = f"{what}: " + ("supported: " + "; ".join(yes) if yes else "no difference supported")
                if yes and no:
                    text += f"; not supported for {', '.join(no)}"
                parts.append(text)
            collapsed = [
                f"{r['loss']} {r['collapses']}"
                for r in summary
                if (r["task"], r["cell"]) == (task, cell.label) and r["collapses"]
            ]
            parts.append("collapses: " + (", ".join(collapsed) if collapsed else "none"))
            lines.append(f"**{task} {cell.label}**: " + ". ".join(parts) + ".")
    return lines


# -- the command ------------------------------------------------------------------------------


def task_data(folder: Path, task: str, seed: int, length: int) -> dict:
    """``learn_tasks.write_dataset``'s paths, with the warm-started model's (``model``) for ``speechwarm``."""
    from maspo_verl.local import learn_tasks, speechwarm

    data = learn_tasks.write_dataset(folder, task, seed=seed, length=length)
    if task == learn_tasks.WARM:
        data["model"] = speechwarm.ensure_model(seed=seed, length=length)
    return data


def run(args, argv) -> None:
    from maspo_verl.local import learn_tasks

    check_losses(args.losses)
    bands = parse_bands(args.bands)
    unknown = [task for task in args.tasks if not learn_tasks.known(task)]
    if unknown:
        allowed = [*learn_tasks.TASKS, learn_tasks.PRETRAINED]
        raise SystemExit(f"--tasks: unknown {unknown}; allowed {allowed} or turns<N> (N turns)")
    if args.engine == learn_engine.LAB:
        for task in args.tasks:
            learn_engine.check_task(task)
    if args.workers < 1 or (args.workers > 1 and args.engine != learn_engine.LAB):
        raise SystemExit(
            f"--workers {args.workers}: allowed 1, or more with --engine lab (a trainer run takes both cores)"
        )
    cells = cells_of(args)
    out = Path(args.out)  # the lab CLI resolves --out / --update-docs
    if args.report:  # the tables, plots and README again from --out's runs, with the arguments that made them
        step_rows, runs = load_rows(out / "learn_steps.csv"), load_rows(out / "learn_runs.csv")
        args.losses = list(dict.fromkeys([*(r["loss"] for r in runs), *args.losses]))
        write_results(args, cells, out, step_rows, runs)
        return
    step_rows, runs = [], []
    if args.resume:
        step_rows, runs = load_rows(out / "learn_steps.csv"), load_rows(out / "learn_runs.csv")
        journal.again(out, argv, "resumed (runs already in learn_runs.csv skipped)")
    else:
        journal.start(out, argv)
    # resumed: the losses run before stay in the study (a preset added later with --losses X --resume joins it)
    args.losses = list(dict.fromkeys([*(r["loss"] for r in runs), *args.losses]))
    done = {(r["task"], r["cell"], r["loss"], r["seed"]) for r in runs}
    logs = Path(tempfile.mkdtemp(prefix="maspo_learn_logs_"))
    failed: list[str] = []  # run folders of failed runs
    try:
        _run_seeds(args, cells, bands, done, out, logs, failed, step_rows, runs)
    finally:  # the run folders go, unless a run failed: then all stay, and the log says where
        if failed:
            log(f"learn: {len(failed)} run(s) failed; run folders kept in {logs} (failed: {', '.join(failed)})")
        else:
            shutil.rmtree(logs, ignore_errors=True)
    log(f"learn: wrote {out}; {sum(r['wall_s'] for r in runs) / 60:.0f} min of trainer runs")


@dataclass(frozen=True)
class LearnRun:
    """One run of ``lab learn``: its trainer overrides and run folder."""

    task: str
    cell: Cell
    loss: str
    seed: int
    overrides: list[str]
    run_dir: Path
    sentence: str | None


def jobs_of(args, cells, done, logs: Path):
    """Every (seed, task, cell, loss) run not in ``done``, in order; a seed's data made when its first run is."""
    lengths = sorted({c.length for c in cells})
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for task in args.tasks:
            data = None
            for cell in cells:
                for loss in args.losses:
                    if (task, cell.label, loss, seed) in done:
                        continue
                    if data is None:
                        data = {n: task_data(logs / f"data_seed{seed}_L{n}", task, seed, n) for n in lengths}
                    overrides = overrides_for(args, task, loss, seed, data[cell.length], cell)
                    name = slug(f"{task}_{cell.label}_{loss}_{seed}")
                    yield LearnRun(task, cell, loss, seed, overrides, logs / name, data[cell.length].get("sentence"))


def run_job(job: LearnRun, engine: str, timeout_s: float):
    """One run: in this process (``--engine lab``) or verl's trainer in its own (``run_local``)."""
    if engine == learn_engine.LAB:
        return learn_engine.run(job.overrides, job.run_dir, job.sentence, job.task)
    return run_local(job.overrides, job.run_dir, timeout_s=timeout_s)


def results_of(args, jobs):
    """(job, result) in the jobs' order; ``--workers`` lab-engine runs at a time in fresh processes."""
    if args.workers == 1:
        yield from ((job, run_job(job, args.engine, args.timeout)) for job in jobs)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = list(jobs)
    pool = ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(run_job, job, args.engine, args.timeout) for job in jobs]
        yield from ((job, future.result()) for job, future in zip(jobs, futures, strict=True))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _run_seeds(args, cells, bands, done, out: Path, logs: Path, failed: list[str], step_rows, runs) -> None:
    """Every (seed, task, cell, loss) run not in ``done``, in ``logs``; rows and records appended as they finish."""
    last = None
    for job, result in results_of(args, jobs_of(args, cells, done, logs)):
        if last is not None and job.seed != last:
            write_results(args, cells, out, step_rows, runs)  # the summary so far, after each seed
        last, task, cell, loss, seed = job.seed, job.task, job.cell, job.loss, job.seed
        steps, code, wall = result.steps, result.returncode, result.wall_s
        if code != 0:
            failed.append(str(result.run_dir))
        key = {"task": task, "cell": cell.label, "length": cell.length, "mismatch": cell.mismatch}
        key |= {"updates": cell.updates, "loss": loss, "seed": seed}
        key["band"] = bands.get(loss.partition(CREDIT_SEP)[0], SHIPPED)
        for s in sorted(steps):
            if "critic/score/mean" in steps[s]:
                step_rows.append(key | {"step": s} | {k: steps[s].get(k, float("nan")) for k in KEYS})
        record = key | run_record(args, steps, code)
        record |= {
            "wall_s": wall,
            "cpu_s": result.cpu_s,
            "lr": args.lr,
            "rollout": getattr(result, "rollout", None) or engine_of(result.log) or "",
        }
        fingerprint = getattr(result, "warm_fingerprint", "") or warm_fingerprint(steps)
        if fingerprint:  # the study pairs only runs of one warm model (stats.same_model)
            record[stats.FINGERPRINT] = fingerprint
        runs.append(record)
        log(
            f"learn {task} {cell.label} {loss} seed {seed}: exit {code}, {record['steps']} steps, reward "
            f"{record['first_reward']:.3f} -> {record['final_reward']:.3f}, clipfrac "
            f"{record['mean_clipfrac']:.3f}, {wall:.0f}s, {result.cpu_s:.0f} CPU-s"
            + (f" (run folder {result.run_dir}, kept)" if code != 0 else "")  # a run's folder stays only if one fails
        )
        # every run on disk at once: a stopped benchmark resumes (--resume) where it stopped
        write_csv(out / "learn_steps.csv", step_rows)
        write_csv(out / "learn_runs.csv", runs)  # the union of the runs' keys
    write_results(args, cells, out, step_rows, runs)


def write_results(args, cells: list[Cell], out: Path, step_rows: list[dict], runs: list[dict]) -> None:
    summary = summarise(args, cells, runs)
    comparisons = compare(args, cells, runs)
    write_csv(out / "learn_summary.csv", summary)
    if comparisons:
        write_csv(out / "learn_compare.csv", comparisons)
    else:  # e.g. grpo not among the losses: the header only
        (out / "learn_compare.csv").write_text(",".join(COMPARE_COLUMNS) + "\n")
    plot_steps(args, cells, step_rows, out / "learn_reward.png")
    sigma_plot = plot_sigma(args, cells, runs, out / "learn_sigma.png")
    total_s = sum(r["wall_s"] for r in runs)
    (out / "README.md").write_text(readme(args, cells, summary, comparisons, runs, total_s, sigma_plot))


# -- plots and README -----------------------------------------------------------------------


def plot_steps(args, cells: list[Cell], step_rows: list[dict], path: Path) -> None:
    panels = [(task, cell) for task in args.tasks for cell in cells]
    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    plt = pyplot()
    fig, axes = plt.subplots(rows_n, cols, figsize=(6 * cols, 4.2 * rows_n), squeeze=False)
    for ax, (task, cell) in zip(axes.flat, panels, strict=False):
        for loss in args.losses:
            by_step: dict[int, list[float]] = {}
            for r in step_rows:
                if (r["task"], r["cell"], r["loss"]) == (task, cell.label, loss):
                    by_step.setdefault(r["step"], []).append(r["critic/score/mean"])
            if not by_step:
                continue
            xs = sorted(by_step)
            (line,) = ax.plot(xs, [statistics.fmean(by_step[x]) for x in xs], label=loss)
            lo, hi = [min(by_step[x]) for x in xs], [max(by_step[x]) for x in xs]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
        ax.set_title(f"{task} {cell.label}: reward, mean and seed range", fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel("critic/score/mean")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sigma(args, cells: list[Cell], runs: list[dict], path: Path) -> bool:
    """Final reward against the noise sigma per loss (95 % t-intervals), one panel per task, length
    and updates with at least two mismatch levels; bf16 cells as hollow markers at their sigma."""
    groups = {}
    for cell in cells:
        groups.setdefault((cell.length, cell.updates), []).append(cell)
    panels = [(task, key) for task in args.tasks for key, group in groups.items() if len(group) > 1]
    if not panels:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (task, key) in zip(axes[0], panels, strict=True):
        group = groups[key]
        for i, loss in enumerate(args.losses):
            shift = (i - (len(args.losses) - 1) / 2) * 0.004
            color = None
            for dtype, marker, fill in (("fp32", "o", True), (MISMATCH_DTYPE, "s", False)):
                pts = []
                for cell in sorted(
                    (c for c in group if c.rollout.dtype == dtype and not c.rollout.stale),
                    key=lambda c: c.rollout.sigma,
                ):
                    finals = [
                        r["final_reward"]
                        for r in runs
                        if (r["task"], r["cell"], r["loss"]) == (task, cell.label, loss) and r["ok"]
                    ]
                    mean, low, high = mean_interval(finals)
                    if mean == mean:
                        pts.append((cell.rollout.sigma + shift, mean, mean - low, high - mean))
                if not pts:
                    continue
                xs, ys, lo, hi = zip(*pts, strict=True)
                handle = ax.errorbar(
                    xs,
                    ys,
                    yerr=[lo, hi],
                    marker=marker,
                    capsize=3,
                    color=color,
                    mfc=None if fill else "none",
                    ls="-" if fill else "none",
                    label=loss if fill else f"{loss} ({MISMATCH_DTYPE})",
                )
                color = handle.lines[0].get_color()
        ax.set_title(f"{task}, {key[0]} tokens, {key[1]} update(s)/batch: final reward vs sigma", fontsize=9)
        ax.set_xlabel("noise sigma on each rollout log-prob (bypass mode)")
        ax.set_ylabel(f"final reward (last {args.last} steps), mean and 95% CI")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _short(override: str) -> str:
    """``a.b.key=value`` -> ``key=value``."""
    key, _, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}={value}"


def per_seed(args, runs: list[dict]) -> list[dict]:
    """One row per task, cell and seed: each loss's reward at step 1 -> final (failed runs marked)."""
    out = {}
    for r in runs:
        row = out.setdefault(
            (r["task"], r["cell"], r["seed"]), {"task": r["task"], "cell": r["cell"], "seed": r["seed"]}
        )
        text = f"{r['first_reward']:.3f} -> {r['final_reward']:.3f}"
        row[r["loss"]] = text if r["ok"] else f"{text} (failed)"
    return [out[k] | {loss: out[k].get(loss, "") for loss in args.losses} for k in sorted(out)]


def readme(args, cells, summary, comparisons, runs, total_s: float, sigma_plot: bool) -> str:
    cmd = "python -m maspo_verl.lab learn " + " ".join(
        [f"--tasks {' '.join(args.tasks)}", f"--seeds {args.seeds}", f"--steps {args.steps}"]
    )
    target = f"reward {args.target:g}" if args.target is not None else f"step 1's reward + {args.gain:g}"
    cols = ["task", "cell", "loss", "seeds_ok", *SUMMARY_METRICS, "reached", "collapses", "time_vs_grpo"]
    cols += sorted({k for r in summary for k in r if k.startswith(REPORTED_PREFIXES)})
    diagnostics = any(k.startswith(DIAGNOSTIC_PREFIXES) for r in runs for k in r)
    planned = len(args.tasks) * len(cells) * len(args.losses) * args.seeds
    partial = (
        [f"**Partial: {len(runs)} of {planned} runs.** The command in `COMMAND.txt` with `--resume` finishes it.", ""]
        if len(runs) < planned
        else []
    )
    return "\n".join(
        [
            "# Learning inside verl: loss presets on verl's real trainer (local CPU mode)",
            "",
            *partial,
            f"`{cmd} ...` (exact command in `COMMAND.txt`); cells {', '.join(c.label for c in cells)}; "
            f"{len(runs)} runs, {total_s / 60:.1f} min of trainer runs in all.",
            "",
            "Every run is `python -m maspo_verl.main local=cpu loss=<preset>` (verl's trainer, Ray, FSDP2,"
            " agent-loop rollout) on the embedded tiny random Qwen2 (byte-level, ~91k parameters) with the"
            " toy tasks of `maspo_verl/local/learn_tasks.py`: word k of 4 is the id block [64k, 64k+64); each"
            " run has one sentence (from the seed) that every prompt asks for; *text-like*: each token is a"
            " word (as many words as tokens); *speech-like*: a run of tokens in one block is a word (tied"
            f" neighbours), {SPEECH_WORDS} words at any length (3 frames each at 12 tokens, 24 at 96: a higher"
            " frame rate for the same content). Reward: 1 - edit distance / max(|hyp|, |ref|) over words."
            + (
                " *turnsN*: the local mode's multi-turn toy environment (`task=turns`,"
                " `maspo_verl/local/turns.py`): N assistant turns of L tokens (the cell's length) with masked"
                " observations (the next turn's reference) between them; a turn scores the share of its tokens"
                " in its reference's byte blocks, the reward is the mean over the N turns."
                if any(turns_of(t) for t in args.tasks)
                else ""
            )
            + (
                f" *{PRETRAINED}*: the local mode's pretrained SmolLM2-135M-Instruct (`model={PRETRAINED}`) on its"
                " arithmetic problems from the seed (`maspo_verl/pretrained/arith.py`, math-verify reward); its"
                " answers end at EOS (not forced to the length), and verl's greedy validation runs at the last step."
                if PRETRAINED in args.tasks
                else ""
            ),
            f"Per step: {args.batch} prompts x {args.n} responses, lr {args.lr:g}; seeds set the model"
            " initialisation and data order, so runs of one seed start alike."
            + (
                " Presets as shipped (no adjustment)."
                if args.no_adjust
                else "".join(
                    f" `{p}` with `{' '.join(o.rsplit('.', 1)[-1] for o in ov)}`." for p, ov in ADJUSTMENTS.items()
                )
            )
            + "".join(
                f" `{p}`'s clip band x {w} (`{' '.join(_short(o) for o in band_overrides(p, w))}`)."
                for p, w in bands_of(runs).items()
            ),
            "",
            "A cell is `L<response tokens>/<mismatch>/U<updates per batch>`. Mismatch: the local rollout"
            " server's test instrument (`maspo.local_mismatch`): `bf16` runs its model in bfloat16, a number"
            " is the sigma of Gaussian noise added to each returned log-prob"
            + (
                "; bypass mode is on, so these log-probs are verl's old log-probs."
                if args.bypass
                else "; bypass mode is off (verl recomputes old log-probs)."
            )
            + (
                " The actor computes in fp32 (`fsdp_config.mixed_precision.param_dtype=fp32`), as the server does"
                " without the instrument."
                if args.fp32_trainer
                else " The actor computes in bf16 (verl's default FSDP mixed precision), the server in fp32."
            )
            + " Updates: the batch is split into that many mini-batches (one optimizer update each); with 1,"
            " old and current log-probs differ only by the mismatch.",
            "",
            f"Columns (mean over seeds and 95 % t-interval): final reward (last {args.last}"
            f" steps), mean reward over all {args.steps} steps (speed), steps to {target} (not reached:"
            f" {args.steps + 1}), verl's `actor/pg_clipfrac` and `actor/grad_norm` (mean over steps, and its sd"
            f" over steps); reached: seeds reaching the target; collapses: run failed, non-finite loss or"
            f" gradient, or final reward {COLLAPSE_DROP:g} below the run's best {args.last}-step mean."
            + (
                ""
                if diagnostics
                else " verl logged no `rollout_corr/*` or `training/rollout_*` diagnostics: it computes them"
                " only when it recomputes old log-probs (decoupled mode), not in bypass mode."
            ),
            "",
            markdown_table(summary, cols),
            "## What the intervals support, cell by cell",
            "",
            "Paired by seed (runs of one seed share initialisation and data). An interval that excludes 0 is"
            " called *supported*; with this many comparisons about 1 in 20 does so by chance.",
            "",
            *[f"- {line}" for line in statements(args, cells, summary, comparisons)],
            "",
            "All paired differences (`learn_compare.csv`): `vs_grpo` = loss - grpo in the cell;"
            " `vs_no_mismatch` = the cell - the same loss without mismatch; `degradation_vs_grpo` = that"
            " change minus grpo's (> 0: degrades less than grpo).",
            "",
            markdown_table(comparisons, COMPARE_COLUMNS),
            "## Per seed: reward at step 1 -> final",
            "",
            markdown_table(per_seed(args, runs), ["task", "cell", "seed", *args.losses]),
            "Files: `learn_steps.csv` (verl's metrics per step and run), `learn_runs.csv`, `learn_summary.csv`,"
            " `learn_compare.csv`, `learn_reward.png` (reward per step)"
            + (", `learn_sigma.png` (final reward vs sigma per loss)." if sigma_plot else "."),
            "",
        ]
    )
