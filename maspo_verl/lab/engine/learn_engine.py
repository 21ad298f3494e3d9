"""``lab learn --engine lab``: the warm speech task's RL loop in one process, without Ray, FSDP or the agent loop.

On the tiny warm-started model (``maspo_verl.local.speechwarm``) verl's trainer takes about 50 s to start a run
(Ray, its workers, FSDP) and 14-16 s a step on 2 cores (learn_speechwarm); this engine computes the run in one
process on one thread, about 8x faster. It reads the config the trainer would get (``learn.overrides_for`` composed with
``local=cpu`` and the lab runner's pins), and takes the pieces that decide the numbers from verl or from the
trainer run's own code:

- the rollout: a copy of the actor whose weights arrive ``maspo.local_mismatch.stale_syncs`` syncs late (one sync
  before step 1 and one after each step's updates, as the hf rollout server receives them), sampling as that
  server samples (``hf_rollout.sample_tokens``: one response at a time, token by token, one generator seeded with
  ``rollout.seed`` for the whole run; temperature 1, EOS ignored; its fp32 log-probs are the old log-probs,
  bypass mode);
- the reward: the learn task's per-token scores (``learn_tasks.token_scores_of``, which the trainer's reward manager
  returns and the plugin makes verl's token-level scores), its word ids for ``segment_rule=words`` (the decoded
  words, or the frame grid's of ``maspo_words~offsetN``: ``word_grid``);
- the advantage: verl's ``compute_grpo_outcome_advantage``, one group per prompt (its ``n`` responses in
  consecutive rows);
- the update: the rows split in order into ``ppo_mini_batch_size x n`` row mini-batches, one optimizer update each,
  the loss from verl's registry called as verl's ``ppo_loss`` calls it (``presets.loss_call``), then verl's
  optimizer step: the gradient clipped to ``optim.clip_grad`` (a non-finite norm skips the update), AdamW with
  the config's betas and weight decay, a constant learning rate;
- the metrics under verl's names (``critic/score/mean``, ``actor/ppo_kl``, ``actor/pg_clipfrac``, ``actor/grad_norm``,
  the loss's ``actor/ratio/*``), each step's mean over its updates, so ``lab learn`` reads a run as it reads the
  trainer's.

So the k-th response of a step is the k-th the trainer's server serves, from the same weights and generator
state. What the engine cannot know is which of the trainer's requests reach the server first: its agent loop
tokenises each prompt in a thread pool before it asks, so the grouping of served responses into prompts (and the
rows' order) can vary from run to run there. The engine takes the order the trainer starts them in (each
prompt's ``n`` responses in a row); the content of a response does not depend on that order, so a run of the
engine is a run of the trainer's process with one of its possible orders. With one prompt a step there is one
group, and an engine run is the trainer's run to float rounding (tests/e2e/test_learn_engine_trainer.py).

A setting the engine does not implement is refused before the run, naming the field and the value it needs
(``REQUIRED``).
"""

from __future__ import annotations

import collections
import copy
import resource
import time
from dataclasses import dataclass
from pathlib import Path

TRAINER, LAB = "trainer", "lab"  # lab learn --engine: verl's trainer, or this engine (also its runs' rollout name)
ENGINES = (TRAINER, LAB)
# trainer config fields and the only values this engine implements (anything else: refused, named)
REQUIRED = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.rollout_correction.bypass_mode": True,
    "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_rs": None,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.shuffle": False,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "fp32",
    "actor_rollout_ref.actor.optim.optimizer": "AdamW",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.optim.override_optimizer_config": None,
    "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.ignore_eos": True,
    "actor_rollout_ref.rollout.calculate_log_probs": True,
    "maspo.local_mismatch.logprob_dtype": "fp32",
    "maspo.local_mismatch.noise_std": 0.0,
    "trainer.val_before_train": False,
}


@dataclass
class EngineRun:
    """What ``lab learn`` reads of a run (``runs.LocalRun``'s fields that it reads)."""

    returncode: int
    steps: dict[int, dict[str, float]]
    wall_s: float
    cpu_s: float
    log: str
    run_dir: Path
    rollout: str = LAB
    warm_fingerprint: str = ""  # the warm model's (speechwarm.fingerprint), as a trainer run's steps record it


def _select(config, path: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(config, path, default=None)


def check_task(task: str) -> None:
    from maspo_verl.local.learn_tasks import WARM

    if task != WARM:
        raise SystemExit(f"lab learn --engine lab: --tasks {task!r}: allowed {WARM!r} (others: --engine trainer)")


def check(config) -> None:
    """Refuse a trainer setting this engine does not implement (``REQUIRED``), naming each."""
    wrong = []
    for path, value in REQUIRED.items():
        got = _select(config, path)
        same = got == value if not isinstance(value, float) else got is not None and float(got) == value
        if not same:
            wrong.append(f"{path}={got!r} (the lab engine runs only {value!r})")
    if wrong:
        raise SystemExit("lab learn --engine lab: " + "; ".join(wrong) + ". Run it with --engine trainer.")


def compose(overrides: list[str]):
    """The trainer config of the lab runner's ``python -m maspo_verl.main local=cpu <overrides>`` (``runs.pinned``:
    with the runner's defaults)."""
    from maspo_verl.lab.engine.runs import pinned
    from maspo_verl.reference import compose_config

    return compose_config("local=cpu", *pinned(overrides))


def loss_of(config):
    """(the registry's loss function, verl's ``ActorConfig`` with our policy-loss section) of the composed config."""
    from maspo_verl.lab.engine import presets
    from maspo_verl.main import loss_section

    return presets.loss_and_config(*presets.split(loss_section(config)))


@dataclass(frozen=True)
class Settings:
    """The numbers of a run, read from the composed trainer config."""

    model: str
    sentence: str
    task: str
    prompts: int  # per step
    n: int
    length: int
    mini_rows: int  # rows per update
    steps: int
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    clip_grad: float
    stale: int
    seed: int  # the rollout's sampler
    grid_offset: int | None  # maspo_words~offsetN: the frame grid's word ids, shifted by N

    @classmethod
    def of(cls, config, sentence: str, task: str) -> Settings:
        a = config.actor_rollout_ref
        n = int(a.rollout.n)
        kwargs = _select(config, "reward.reward_kwargs") or {}
        offset = kwargs.get("word_grid_offset")
        return cls(
            model=str(a.model.path), sentence=sentence, task=task, prompts=int(config.data.train_batch_size),
            n=n, length=int(config.data.max_response_length), mini_rows=int(a.actor.ppo_mini_batch_size) * n,
            steps=int(config.trainer.total_training_steps), lr=float(a.actor.optim.lr),
            betas=tuple(float(b) for b in a.actor.optim.betas), weight_decay=float(a.actor.optim.weight_decay),
            clip_grad=float(a.actor.optim.clip_grad), stale=int(config.maspo.local_mismatch.stale_syncs),
            seed=int(a.rollout.seed), grid_offset=None if offset is None else int(offset),
        )  # fmt: skip


class Rollout:
    """The hf rollout server's weights: a copy of the actor that applies each sync ``stale`` syncs late."""

    def __init__(self, actor, stale: int):
        self.model = copy.deepcopy(actor).eval()
        self.stale = stale
        self.held: collections.deque = collections.deque()

    def sync(self, actor) -> None:
        state = {k: v.detach().clone() for k, v in actor.state_dict().items()}
        if self.stale:
            self.held.append(state)
            if len(self.held) <= self.stale:
                return
            state = self.held.popleft()
        self.model.load_state_dict(state)


def sample(model, prompt: list, rows: int, length: int, gen):
    """``rows`` responses of ``length`` ids and their log-probs ([rows, length] each), served one at a time as the
    trainer's hf rollout server serves the step's requests."""
    import torch

    from maspo_verl.local.hf_rollout import sample_tokens

    params = {k: REQUIRED[f"actor_rollout_ref.rollout.{k}"] for k in ("temperature", "top_p", "top_k", "ignore_eos")}
    no_eos = torch.empty(0, dtype=torch.long)  # ignore_eos: every response has ``length`` ids
    out = [sample_tokens(model, prompt, params, length, gen, no_eos) for _ in range(rows)]
    return torch.tensor([t for t, _ in out]), torch.tensor([lp for _, lp in out])


def response_log_probs(model, prompt: list, ids):
    """[rows, T] log-probs of the response ids after ``prompt`` (one prompt for every row), fp32."""
    import torch

    rows = ids.shape[0]
    full = torch.cat([torch.tensor(prompt).expand(rows, -1), ids], 1)
    logits = model(input_ids=full).logits[:, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]


def score_rows(s: Settings, ids) -> tuple:
    """[rows, T] float32 per-token scores (each row sums to its reward: the plugin's hook makes them verl's
    ``rm_scores``, so verl's GRPO score is their float32 sum) and each row's word ids (``segment_rule=words``)."""
    import torch

    from maspo_verl.lab.engine.word_grid import grid_word_ids
    from maspo_verl.local.learn_tasks import decode, token_scores_of, word_ids

    scores, words = [], []
    for row in ids.tolist():
        _, per_token = token_scores_of(s.task, row, s.sentence)
        scores.append(per_token)
        grid = s.grid_offset is not None
        words.append(grid_word_ids(len(row), s.grid_offset) if grid else word_ids(decode(s.task, row), len(row)))
    return torch.tensor(scores, dtype=torch.float32), torch.tensor(words)


def advantages(token_scores, n: int):
    """verl's GRPO advantage of ``token_scores`` [rows, T], groups of ``n`` consecutive rows (one prompt's
    responses, in the order the trainer's hf server most likely serves them)."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rows = token_scores.shape[0]
    index = np.repeat(np.arange(rows // n), n)
    return compute_grpo_outcome_advantage(token_scores, torch.ones_like(token_scores), index)[0]


def update(actor, opt, fn, cfg, s: Settings, prompt, ids, old, adv, words) -> list[dict]:
    """The step's updates, one per mini-batch of ``s.mini_rows`` rows in order; verl's metrics of each."""
    import torch

    from maspo_verl.lab.engine.presets import loss_call

    out = []
    params = [p for p in actor.parameters() if p.requires_grad]
    for start in range(0, ids.shape[0], s.mini_rows):
        rows = slice(start, start + s.mini_rows)
        opt.zero_grad()
        lp = response_log_probs(actor, prompt, ids[rows])
        loss, metrics = loss_call(fn, cfg, old[rows], lp, adv[rows], ids[rows], words[rows])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=s.clip_grad)
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad()
        out.append({**metrics, "actor/pg_loss": loss.detach(), "actor/grad_norm": norm})
    return out


def step_metrics(updates: list[dict]) -> dict[str, float]:
    """Each metric's mean over the step's updates, moved to the host at once."""
    import torch

    names = sorted({k for u in updates for k in u if k.startswith("actor/")})
    values = [[torch.as_tensor(u[k], dtype=torch.float64) for u in updates if k in u] for k in names]
    means = torch.stack([torch.stack(v).mean() for v in values]).tolist() if names else []
    return dict(zip(names, means, strict=True))


def _load(path: str):
    """The model in fp32, without transformers' per-load progress bar (one per run in the lab's log)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    finally:
        if shown:
            logging.enable_progress_bar()


def train(s: Settings, fn, cfg, progress=None) -> dict[int, dict[str, float]]:
    """The run: ``s.steps`` steps of sampling, reward, advantage and updates; verl's per-step metrics."""
    import torch

    from maspo_verl.local.speechwarm import prompt_ids

    actor = _load(s.model)
    actor.train()
    opt = torch.optim.AdamW(actor.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay)
    rollout = Rollout(actor, s.stale)
    rollout.sync(actor)  # the trainer's sync before step 1
    gen = torch.Generator().manual_seed(s.seed)
    prompt = prompt_ids(s.sentence)
    rows = s.prompts * s.n
    steps = {}
    for step in range(1, s.steps + 1):
        t0 = time.perf_counter()
        ids, old = sample(rollout.model, prompt, rows, s.length, gen)
        scores, words = score_rows(s, ids)
        adv = advantages(scores, s.n)
        updates = update(actor, opt, fn, cfg, s, prompt, ids, old, adv, words)
        rollout.sync(actor)
        metrics = step_metrics(updates)
        metrics |= {"critic/score/mean": float(scores.sum(-1).mean()), "response_length/mean": float(s.length)}
        metrics["timing_s/step"] = time.perf_counter() - t0
        steps[step] = metrics
        if progress:
            progress(step, metrics)
    return steps


def run(overrides: list[str], run_dir: Path, sentence: str, task: str) -> EngineRun:
    """One run of the composed trainer config ``overrides``, in this process; its console lines in
    ``run_dir/console.log``."""
    import torch

    check_task(task)
    config = compose(overrides)
    check(config)
    fn, cfg = loss_of(config)
    s = Settings.of(config, sentence, task)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    start, cpu = time.monotonic(), _cpu()

    def progress(step, m):
        lines.append(
            f"[{time.monotonic() - start:7.1f}s] step:{step} - critic/score/mean:{m['critic/score/mean']:.4f} - "
            f"actor/ppo_kl:{m.get('actor/ppo_kl', float('nan')):.4g}"
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the hf server's one thread: the same sums in the same order
    code, steps = 0, {}
    try:
        steps = train(s, fn, cfg, progress)
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded (exit 1, its traceback kept), as a trainer's
        import traceback

        from maspo_verl.lab.engine.common import log

        code = 1
        lines.append(traceback.format_exc())
        log(f"lab engine: the run failed: {type(exc).__name__}: {exc} (traceback in {run_dir / 'console.log'})")
    finally:
        torch.set_num_threads(threads)
    lines.insert(0, f"maspo_verl lab engine: rollout=lab model={s.model} steps={s.steps}")
    text = "\n".join(lines) + "\n"
    (run_dir / "console.log").write_text(text)
    return EngineRun(code, steps, time.monotonic() - start, _cpu() - cpu, text, run_dir, LAB, _fingerprint(s.model))


def _fingerprint(model: str) -> str:
    from maspo_verl.local import speechwarm

    try:
        return speechwarm.fingerprint(model)
    except FileNotFoundError:  # not a folder of safetensors (a hub id): nothing to fingerprint
        return ""


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
