"""The plugin's hooks into verl, installed through one helper, ``patch``, which wraps a verl attribute
once, checks the feature it relies on (a signature, an attribute) rather than a version, rebinds every
``verl.*`` module that imported the original by name, and records why it refused if it did:

- ``ppo_loss``: verl's registered losses never see the response token ids, although the micro-batch
  handed to ``verl.workers.utils.losses.ppo_loss`` holds them. The wrapper puts the micro-batch in
  scope (``maspo_verl.batch``) for the duration of the call, with the actor's tokenizer: segment rules
  that read response or word ids, or the vocabulary's text, find them there.
- ``token_scores``: verl's agent loop turns a reward into ``rm_scores`` with the scalar score on the
  last token. A reward that also returns per-token scores (``reward_extra_info[TOKEN_SCORES_KEY]``,
  one per response token, summing to the score) gets them as its ``rm_scores`` row instead: we wrap
  ``AgentLoopOutput.as_dict``, where the v1 trainer builds that row, and drop the list from the extra
  info so nothing downstream tries to average it. Word ids (``reward_extra_info[WORD_IDS_KEY]``)
  become a per-sample tensor field of their own next to ``rm_scores``, which verl carries to the
  loss's micro-batch; a list of the wrong length becomes a row without words.
- ``update_step``: the loss learns which trainer step and which data-parallel rank it runs in
  (``policy_loss.inspect_dir``, ``maspo_verl.inspection``): a wrapper around verl's
  ``TrainingWorker.train_mini_batch`` (one call per actor update) puts the update in scope
  (``maspo_verl.batch.update_scope``). The step is verl's global step where the update batch carries it
  (the v1 trainer's samples do, as ``global_steps``), else the count of updates in this worker; both,
  and the rank, are read only when the loss asks (on inspected runs).
- ``verl_losses``: verl's own policy losses (``vanilla``, ``gspo``, ...) in its registry are wrapped so
  that they report the ratio correlation (``actor/ratio/...``) as ours do, and with ``inspect_dir`` set they
  write samples too (``maspo_verl.core.losses.inspect_verl_loss``); with
  it unset the wrapper only tests the setting.
- ``engine_mismatch``: verl's ``TrainingWorker.train_batch`` (one call per mini-batch) marks the first mini-batch of
  each update, whose micro-batches the ``ppo_loss`` wrapper adds to the engine-mismatch sums
  (``maspo_verl.plugin.engine_mismatch``); the ``update_step`` wrapper puts the metrics in the update's.
- ``tracking`` and ``engine_check``: verl's ``Tracking.__init__`` keeps the config and runs the extensions other
  layers register (the local mode's compact console); ``Tracking.log`` runs the conformance check on each step.
- ``reward_metrics`` and ``run_failure`` (installed when verl imports its v1 trainer): the step mean of
  every number a reward returns is logged, and a failure a reward recorded with ``report_run_failure``
  stops the trainer at its next batch (below).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import itertools
import logging
import numbers
import sys
from collections.abc import Callable
from typing import Any

import torch

from maspo_verl.batch import NO_WORD, TOKEN_SCORES_KEY, WORD_IDS_KEY, micro_batch_scope, update_scope
from maspo_verl.plugin import engine_mismatch
from maspo_verl.util import warn_once

logger = logging.getLogger("maspo_verl")

PPO_LOSS_PARAMS = ("config", "model_output", "data", "dp_group")

PATCHES: dict[str, str | None] = {}
"""Hook name -> None when installed, else why it was refused."""


def patch(
    name: str,
    owner: Any,
    attr: str,
    make_wrapper: Callable[[Callable], Callable],
    requires: Callable[[Callable], str | None] | None = None,
) -> str | None:
    """Replace ``owner.attr`` by ``make_wrapper(original)``, once; None on success, else why not.

    ``requires(original)`` returns None when the attribute has the feature the wrapper relies on.
    Modules under ``verl.`` that bound the original by name (``from ... import attr``) are rebound.
    """
    current = getattr(owner, attr, None)
    original = getattr(current, "__maspo_original__", current)
    if original is None:
        problem = f"{getattr(owner, '__name__', owner)}.{attr} does not exist in this verl"
    else:
        problem = requires(original) if requires is not None else None
    if problem is None and current is original:
        wrapped = functools.wraps(original)(make_wrapper(original))
        wrapped.__maspo_original__ = original
        setattr(owner, attr, wrapped)
        for module_name, module in list(sys.modules.items()):
            if module_name.startswith("verl.") and getattr(module, attr, None) is original:
                setattr(module, attr, wrapped)
    PATCHES[name] = problem
    if problem:
        logger.error("maspo_verl: hook %r not installed: %s", name, problem)
    return problem


def patch_problem(name: str) -> str | None:
    return PATCHES.get(name, f"hook {name!r} was never installed")


ABSENT: dict[str, str] = {}
"""Hook name -> the module, not verl's, whose absence keeps verl's hooked module from importing here (verl
does not require every module its trainer imports: a plain ``pip install verl`` lacks ``cachetools`` and
``uvicorn``). Such a hook is skipped, not refused: verl cannot run that module here either."""


def unavailable(name: str, module: str, exc: ImportError) -> str:
    """Record that the verl module ``module`` a hook wraps does not import here; returns the problem."""
    missing = getattr(exc, "name", None) or ""
    if isinstance(exc, ModuleNotFoundError) and missing and missing.split(".")[0] != "verl":
        ABSENT[name] = missing
        PATCHES[name] = (
            f"{module} cannot be imported here: no module {missing!r} (verl imports it there but does not require "
            f"it): pip install {missing.split('.')[0]}, or maspo-verl's `local` extra"
        )
    else:
        PATCHES[name] = f"{module} is unavailable ({exc})"
    return PATCHES[name]


def _ppo_loss_signature(original) -> str | None:
    params = tuple(inspect.signature(original).parameters)
    if params != PPO_LOSS_PARAMS:
        return f"verl.workers.utils.losses.ppo_loss has parameters {params}, expected {PPO_LOSS_PARAMS}"
    return None


def _with_micro_batch(original):
    def ppo_loss(config, model_output, data, dp_group=None):
        # the actor's tokenizer, which verl's engine worker attaches to the actor config (None if not)
        tokenizer = getattr(getattr(config, "model_config", None), "tokenizer", None)
        if engine_mismatch.collecting():
            _observe_engine_mismatch(model_output, data)
        with micro_batch_scope(data, tokenizer):
            return original(config, model_output, data, dp_group)

    return ppo_loss


def _observe_engine_mismatch(model_output, data) -> None:
    """The micro-batch's current and old log-probs, padded as verl's ``ppo_loss`` pads them, to the
    engine-mismatch sums (``maspo_verl.plugin.engine_mismatch``)."""
    from verl.workers.utils import losses

    log_prob = losses.no_padding_2_padding(model_output["log_probs"], data)
    padded = data.select("response_mask", "old_log_probs").to_padded_tensor()
    engine_mismatch.observe(log_prob, padded["old_log_probs"], padded["response_mask"])


def install_ppo_loss_hook() -> str | None:
    """Token ids reach the loss (``segment_rule=tokenval``); None, or why the hook was refused."""
    from verl.workers.utils import losses

    return patch("ppo_loss", losses, "ppo_loss", _with_micro_batch, _ppo_loss_signature)


def _with_token_scores(original):
    def as_dict(self):
        out = original(self)
        info = (out.get("extra_fields") or {}).get("reward_extra_info")
        if not isinstance(info, dict) or (TOKEN_SCORES_KEY not in info and WORD_IDS_KEY not in info):
            return out
        info = dict(info)  # the info dict is shared by a session's outputs: never mutate it
        has_scores = TOKEN_SCORES_KEY in info
        scores = info.pop(TOKEN_SCORES_KEY, None)
        words = info.pop(WORD_IDS_KEY, None)
        out["extra_fields"] = {**out["extra_fields"], "reward_extra_info": info}
        if words is not None:
            n = out["responses"].shape[0]
            fits = len(words) == n
            if len(words) and not fits:
                warn_once("word ids do not match the response length: such samples take the fallback", logger=logger)
            out[WORD_IDS_KEY] = torch.tensor(words, dtype=torch.int64) if fits else torch.full((n,), NO_WORD)
        row = out.get("rm_scores")
        if not has_scores:
            return out
        if row is not None and scores is not None and len(scores) == row.shape[0]:
            out["rm_scores"] = torch.tensor(scores, dtype=torch.float32)
        elif row is not None:
            logger.debug("per-token scores: %d values for %d response tokens", len(scores or []), row.shape[0])
            warn_once(
                "per-token reward scores do not match the response length: using the scalar score on the "
                "last token for such samples",
                logger=logger,
            )
        return out

    return as_dict


def install_token_scores_hook() -> str | None:
    """Per-token reward scores become ``rm_scores`` rows, word ids a tensor field; None, or why the hook
    was refused."""
    try:
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    except ImportError as exc:
        return unavailable("token_scores", "verl.experimental.agent_loop", exc)
    return patch("token_scores", AgentLoopOutput, "as_dict", _with_token_scores)


# ------------------------------------------------------------------ rewards in the trainer's loop
# verl's v1 trainer neither logs what a reward returns besides its score during training, nor stops when
# a reward raises: its agent loop logs the exception and drops the sample. Two hooks in the trainer:
# ``reward_metrics`` logs the step mean of each number in the samples' ``reward_extra_info`` as
# ``reward/<key>/mean``; ``run_failure`` raises in the trainer, after each batch is sampled, the failure a
# reward recorded with ``report_run_failure`` (in Ray's key-value store, shared by the run's processes).

TRAINER_METRICS_PARAMS = ("self", "batch", "metrics", "timing_raw", "global_steps", "epoch")


def _run_failure_key() -> bytes:
    import ray

    return f"maspo_verl/run_failure/{ray.get_runtime_context().get_job_id()}".encode()


def report_run_failure(message: str) -> None:
    """Record a failure that hits every sample (the first one of the run wins), so that the trainer
    stops with ``message`` at its next batch. Does nothing outside Ray."""
    try:
        import ray
        from ray.experimental import internal_kv

        if ray.is_initialized():
            internal_kv._internal_kv_put(_run_failure_key(), message.encode(), overwrite=False)
    except Exception:
        logger.warning("maspo_verl: could not record the run's failure for the trainer", exc_info=True)


def reported_run_failure() -> str | None:
    """The failure recorded with ``report_run_failure`` in this run, if any."""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return None
    found = internal_kv._internal_kv_get(_run_failure_key())
    return found.decode() if found else None


def _stop_on_reported_failure(original):
    def sample(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        message = reported_run_failure()
        if message:
            raise RuntimeError(f"the run stops: {message}")
        return out

    return sample


def reward_step_metrics(infos: list) -> dict[str, float]:
    """``reward/<key>/mean`` of each key whose value is a number in every sample's ``reward_extra_info``."""
    infos = [i for i in infos if isinstance(i, dict)]
    metrics = {}
    for key in infos[0] if infos else ():
        values = [i.get(key) for i in infos]
        if all(isinstance(v, numbers.Real) for v in values):
            metrics[f"reward/{key}/mean"] = float(sum(float(v) for v in values) / len(values))
    return metrics


def _with_reward_metrics(original):
    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        try:
            import transfer_queue as tq

            keys = [k for k, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding", False)]
            if keys:
                data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
                fields = data.pop("extra_fields").tolist()
                metrics.update(reward_step_metrics([(f or {}).get("reward_extra_info") for f in fields]))
        except Exception as exc:  # auxiliary metrics never stop a run
            warn_once(f"maspo_verl: reward metrics not logged ({type(exc).__name__}: {exc})", logger=logger)
        return original(self, batch, metrics, timing_raw, global_steps, epoch)

    return _compute_metrics


def _trainer_metrics_signature(original) -> str | None:
    params = tuple(inspect.signature(original).parameters)
    if params != TRAINER_METRICS_PARAMS:
        return f"PPOTrainer._compute_metrics has parameters {params}, expected {TRAINER_METRICS_PARAMS}"
    return None


TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``install(module)`` right after the module ``name`` is first imported."""

    def __init__(self, name: str, install: Callable[[Any], None]):
        self.name, self.install = name, install

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; the other finders find it
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, install = loader.exec_module, self.install

        def exec_module(module):
            run(module)
            install(module)

        loader.exec_module = exec_module
        return spec


def after_import(name: str, install: Callable[[Any], None]) -> None:
    """``install(module)`` now if ``name`` is imported, else right after it is (several installs per module
    chain: each finder wraps the loader the next one found)."""
    if name in sys.modules:
        install(sys.modules[name])
    elif not any(isinstance(f, _AfterImport) and f.name == name and f.install is install for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, install))


def _hook_trainer(trainer_base) -> None:
    try:
        from verl.trainer.ppo.v1 import replay_buffer

        trainer = trainer_base.PPOTrainer
        patch("reward_metrics", trainer, "_compute_metrics", _with_reward_metrics, _trainer_metrics_signature)
        buffers = [
            c
            for c in vars(replay_buffer).values()
            if isinstance(c, type) and c.__module__ == replay_buffer.__name__ and "sample" in vars(c)
        ]
        problems = [patch(f"run_failure.{c.__name__}", c, "sample", _stop_on_reported_failure) for c in buffers]
        for c in buffers:  # one entry for the hook
            PATCHES.pop(f"run_failure.{c.__name__}")
        PATCHES["run_failure"] = next((p for p in problems if p), None if buffers else "no v1 replay buffer to hook")
    except Exception as exc:  # never break verl's import
        PATCHES.setdefault("reward_metrics", f"{type(exc).__name__}: {exc}")
        PATCHES.setdefault("run_failure", f"{type(exc).__name__}: {exc}")
        logger.error("maspo_verl: hooks on verl's v1 trainer not installed", exc_info=True)


def install_trainer_reward_hooks() -> None:
    """``reward_metrics`` and ``run_failure``, installed when verl imports its v1 trainer: importing it
    here, while verl loads its plugins, would resolve verl's device before the local mode registers its
    platform."""
    after_import(TRAINER_MODULE, _hook_trainer)


GLOBAL_STEPS_KEY = "global_steps"  # verl's v1 trainer: the step each sample was drawn for
_updates = itertools.count(1)


def _global_step(data) -> int | None:
    """The largest ``global_steps`` of an update batch, when it carries them on the host; else None."""
    try:
        value = data.get(GLOBAL_STEPS_KEY, None) if hasattr(data, "get") else None
    except Exception:  # noqa: BLE001 - a TensorDict may refuse a key it cannot stack
        return None
    value = getattr(value, "data", value)  # NonTensorData
    if isinstance(value, torch.Tensor):
        return int(value.max()) if value.numel() and value.device.type == "cpu" else None
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list | tuple):
        value = [getattr(v, "data", v) for v in value]
        return max(value) if value and all(isinstance(v, int) for v in value) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class VerlUpdate:
    """One actor update of verl's ``TrainingWorker``: its step and whether this rank writes what
    data-parallel rank 0 writes, each worked out when first asked (``maspo_verl.batch.Update``'s fields)."""

    def __init__(self, worker, data, count: int):
        self._worker, self._data, self._count = worker, data, count

    @functools.cached_property
    def step(self) -> int:
        return _global_step(self._data) or self._count

    @functools.cached_property
    def dp_rank(self) -> int:
        engine = getattr(self._worker, "engine", None)
        if engine is not None and hasattr(engine, "get_data_parallel_rank"):
            return int(engine.get_data_parallel_rank())
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @functools.cached_property
    def writer(self) -> bool:
        engine = getattr(self._worker, "engine", None)
        holds_outputs = getattr(engine, "is_mp_src_rank_with_outputs", None)
        return self.dp_rank == 0 and (holds_outputs is None or bool(holds_outputs()))


UPDATE_METRICS: list[Callable[[], dict[str, float]]] = []
"""``measure()``: metrics of the worker process added to each actor update's (verl logs them under ``actor/``),
registered by other layers (the local mode's torch threads)."""


def register_update_metrics(measure: Callable[[], dict[str, float]]) -> None:
    if measure not in UPDATE_METRICS:
        UPDATE_METRICS.append(measure)


def _with_update_scope(original):
    def train_mini_batch(self, *args, **kwargs):
        data = kwargs.get("data", args[0] if args else None)
        with update_scope(VerlUpdate(self, data, next(_updates))), engine_mismatch.update():
            out = original(self, *args, **kwargs)
            engine_mismatch.attach(out, {k: v for measure in UPDATE_METRICS for k, v in measure().items()})
            return out

    return train_mini_batch


def _with_minibatch_count(original):
    def train_batch(self, *args, **kwargs):
        engine = getattr(self, "engine", None)
        group = engine.get_data_parallel_group() if hasattr(engine, "get_data_parallel_group") else None
        with engine_mismatch.minibatch(group):
            return original(self, *args, **kwargs)

    return train_batch


def install_update_step_hook() -> str | None:
    """The actor update's step and rank reach the loss (``policy_loss.inspect_dir``); None, or why not."""
    try:
        from verl.workers.engine_workers import TrainingWorker
    except ImportError as exc:
        return unavailable("update_step", "verl.workers.engine_workers", exc)
    return patch("update_step", TrainingWorker, "train_mini_batch", _with_update_scope)


def install_minibatch_hook() -> str | None:
    """The first mini-batch of each actor update is known (the engine-mismatch metrics); None, or why not."""
    try:
        from verl.workers import engine_workers
        from verl.workers.engine_workers import TrainingWorker
        from verl.workers.utils import losses
    except ImportError as exc:
        return unavailable("engine_mismatch", "verl.workers.engine_workers", exc)

    def requires(original) -> str | None:
        if not hasattr(losses, "no_padding_2_padding"):
            return "verl.workers.utils.losses.no_padding_2_padding does not exist in this verl"
        if "train_mini_batch" not in vars(engine_workers.TrainingWorker):
            return "verl.workers.engine_workers.TrainingWorker.train_mini_batch does not exist in this verl"
        return None

    return patch("engine_mismatch", TrainingWorker, "train_batch", _with_minibatch_count, requires)


def verl_loss_correlation(old_log_prob, log_prob, response_mask) -> dict[str, float]:
    """The ratio correlation metrics (``core.metrics.correlation_sums``) of verl's own losses, whose metrics are host
    floats already: the sums of this micro-batch in one transfer (verl averages the metrics over micro-batches,
    where our losses add the sums). delta as the loss takes it: clamped, non-finite tokens left out."""
    from maspo_verl.core.losses import token_log_ratios
    from maspo_verl.core.metrics import correlation_metrics, correlation_sums, host_sums

    delta, kept = token_log_ratios(log_prob, old_log_prob, response_mask)
    return correlation_metrics(host_sums(correlation_sums(delta.double(), kept)))


def inspected_verl_loss(name: str, fn: Callable) -> Callable:
    """verl's policy loss ``fn``, which also reports the ratio correlation (``verl_loss_correlation``) and writes
    samples on inspected steps (``inspect_dir`` set)."""
    if getattr(fn, "__maspo_original__", None) is not None:
        return fn
    from maspo_verl.core.losses import inspect_verl_loss

    @functools.wraps(fn)
    def loss(*args, **kwargs):
        out = fn(*args, **kwargs)
        bound = inspect.signature(fn).bind(*args, **kwargs)
        a = bound.arguments
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out[1].update(verl_loss_correlation(a["old_log_prob"], a["log_prob"], a["response_mask"]))
        config = a.get("config")
        if getattr(getattr(config, "policy_loss", None), "inspect_dir", None) is not None:
            bound.apply_defaults()
            inspect_verl_loss(
                name, a["old_log_prob"], a["log_prob"], a["advantages"], a["response_mask"],
                a["loss_agg_mode"], config, a.get("rollout_is_weights"),
            )  # fmt: skip
        return out

    loss.__maspo_original__ = fn
    return loss


def install_verl_loss_hook() -> str | None:
    """Wrap verl's own registered policy losses (``inspected_verl_loss``); None, or why not."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from maspo_verl.core.token_sets import TOKEN_SETS

    expected = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config")
    refused = []
    for name, fn in list(POLICY_LOSS_REGISTRY.items()):
        if name in TOKEN_SETS or getattr(fn, "__maspo_original__", None) is not None:
            continue
        params = tuple(inspect.signature(fn).parameters)
        if params[: len(expected)] != expected:
            refused.append(name)
            continue
        POLICY_LOSS_REGISTRY[name] = inspected_verl_loss(name, fn)
    PATCHES["verl_losses"] = f"verl losses {refused} have another signature" if refused else None
    return PATCHES["verl_losses"]


# ------------------------------------------------------------------ the trainer's metrics logger
# verl's ``Tracking`` (one per trainer) gets the whole config: its ``__init__`` keeps what the plugin needs from it
# and runs the extensions registered by other layers (the local mode's compact console); its ``log`` runs the
# engine-mismatch conformance check on each step's metrics before any backend sees them.

TRACKING_EXTENSIONS: list[Callable[[Any, Any], None]] = []
"""``extend(tracking, config)``, run at the end of each ``Tracking.__init__`` (``register_tracking_extension``)."""


def register_tracking_extension(extend: Callable[[Any, Any], None]) -> None:
    if extend not in TRACKING_EXTENSIONS:
        TRACKING_EXTENSIONS.append(extend)


def _tracking_signature(original) -> str | None:
    params = tuple(inspect.signature(original).parameters)
    if "default_backend" not in params or "config" not in params:
        return f"verl.utils.tracking.Tracking.__init__ has parameters {params}, expected default_backend and config"
    return None


def _bypass(config) -> bool:
    algorithm = (config or {}).get("algorithm") or {}
    return bool((algorithm.get("rollout_correction") or {}).get("bypass_mode", False))


def _with_tracking_config(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = signature.bind(self, *args, **kwargs).arguments.get("config")
        self._maspo_engine_check = (_bypass(config), engine_mismatch.EngineCheck.from_config(config))
        for extend in TRACKING_EXTENSIONS:
            extend(self, config)

    return __init__


def _with_engine_check(original):
    def log(self, data, step, *args, **kwargs):
        settings = getattr(self, "_maspo_engine_check", None)
        if settings is not None and isinstance(data, dict):
            engine_mismatch.on_step(data, step, *settings)
        return original(self, data, step, *args, **kwargs)

    return log


def install_tracking_hook() -> str | None:
    """The engine-mismatch metrics and conformance check in verl's metrics logger; None, or why not."""
    from verl.utils import tracking

    problem = patch("tracking", tracking.Tracking, "__init__", _with_tracking_config, _tracking_signature)
    return problem or patch("engine_check", tracking.Tracking, "log", _with_engine_check)


def install_hooks() -> None:
    """Every hook (idempotent); why one was refused is in ``PATCHES``."""
    install_ppo_loss_hook()
    install_token_scores_hook()
    install_trainer_reward_hooks()
    install_update_step_hook()
    install_minibatch_hook()
    install_verl_loss_hook()
    install_tracking_hook()
