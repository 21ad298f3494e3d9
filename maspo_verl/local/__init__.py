"""Local CPU mode: verl's real trainer (main_ppo, Ray, FSDP2, agent-loop rollout, ppo_loss) on the host.

``python -m maspo_verl.main local=cpu loss=<preset>`` runs a few real training steps on an embedded
tiny model and toy dataset (``assets``), or on the user's own ``actor_rollout_ref.model.path`` /
``data.train_files`` / ``data.val_files``. Two entry points, both called by the package itself:

- ``prepare(config)`` (driver, from ``maspo_verl.main.run`` when ``maspo.local`` is set): builds the
  embedded assets, fills in paths and CPU overrides, sets the environment for the driver and for
  every Ray worker, then ``activate()``.
- ``activate()`` (``adaptations``; driver and Ray workers; in workers through the ``maspo_verl_local`` entry
  point, ``maspo_verl.local.autoload``, when ``MASPO_VERL_LOCAL`` is set): registers the ``cpu`` platform,
  the ``hf`` rollout (replica + adapter) and the toy multi-turn agent loop, and de-duplicates the
  process-group backend string. These work around checks hard-coded in verl; each verl attribute
  they rely on is checked first
  (``missing_features``), and the mode is refused with the list of what is missing. It also installs
  the short console (``run_log``).
- ``session(config)`` (driver, around ``prepare`` and verl's trainer): the short console, the whole
  output in the run folder, the closing block, and the private Ray cluster's temp dir removed; the run
  stopped when a rollout server or its vLLM engine dies (``watchdog``).
- ``prepare_task(config)`` (driver, before the batch-size checks, with ``task=turns``): the multi-turn
  toy environment's lengths and data (``turns``; its agent loop and reward manager: ``turns_agent``,
  registered in verl by ``activate``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

# verl's adaptations (``activate`` and the checks of what it relies on), also the package's names
from maspo_verl.local.adaptations import PROCESS_GROUP_PARAMS as PROCESS_GROUP_PARAMS
from maspo_verl.local.adaptations import REQUIRED_FEATURES as REQUIRED_FEATURES
from maspo_verl.local.adaptations import activate as activate
from maspo_verl.local.adaptations import check_verl_features
from maspo_verl.local.adaptations import dedup_backend as dedup_backend
from maspo_verl.local.adaptations import missing_features as missing_features

# Nothing of verl or of the plugin at import time: a Ray worker may import this package first (to
# unpickle the HF rollout actor), and ``import verl`` then runs ``autoload``, which needs ``activate``.

logger = logging.getLogger("maspo_verl.local")

LOCAL_MODES = ("cpu",)

# Environment of the local mode, for the driver (os.environ) and every Ray worker (runtime_env).
LOCAL_ENV = {
    "MASPO_VERL_LOCAL": "cpu",  # makes `import verl` (plugin) call activate() in each worker
    "VERL_PLATFORM": "cpu",  # picks PlatformCPU in verl's platform registry
    "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda/npu only
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}

# temp dirs of private Ray clusters this process started (removed by the session)
CREATED_TEMP_DIRS: list[str] = []
# what a run adds to LOCAL_ENV where the user has not set it (_run_env), and its own temp folder (_run_temp_folder)
RUN_ENV = (
    "TQ_NUM_THREADS", "OMP_NUM_THREADS", "VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_DIR", "HF_DATASETS_CACHE",
    "TMPDIR",
)  # fmt: skip
# the settings of the local mode's log (hydra_configs/local/cpu.yaml, maspo.*)
LOG_SETTINGS = ("quiet", "print_config")


def _is_unset(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in ("", "null", "None"))


def check_settings(config) -> str:
    """The local mode named by ``maspo.local`` (ValueError if unknown); FieldError for a bad log setting."""
    from maspo_verl.validation import check_bool

    mode = str(config.maspo.local).lower()
    if mode not in LOCAL_MODES:
        raise ValueError(f"maspo.local={config.maspo.local!r}: supported local modes are {LOCAL_MODES}")
    for key in LOG_SETTINGS:
        if key in config.maspo:
            check_bool(f"maspo.{key}", config.maspo[key])
    from maspo_verl.local import cpu_dtype

    cpu_dtype.check_setting(config)
    return mode


@contextlib.contextmanager
def session(config):
    """Around ``prepare`` and verl's trainer, in the driver (``maspo_verl.local.run_log.session``), with the
    watchdog over the rollout servers and their engines (``maspo_verl.local.watchdog``), which mutes the console
    when it stops the run."""
    from maspo_verl.local.run_log import session as run_session
    from maspo_verl.local.watchdog import watching

    check_settings(config)
    with (
        run_session(config, CREATED_TEMP_DIRS) as console,
        watching(on_death=console.mute, temp_dirs=CREATED_TEMP_DIRS),
    ):
        yield


def trainer_workers(config) -> int:
    """The trainer's worker processes (its data-parallel ranks): ``trainer.nnodes * trainer.n_gpus_per_node``."""
    return int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)


def _run_env(config) -> dict[str, str]:
    """Environment of a run, on top of ``LOCAL_ENV``, unless the user set it: TransferQueue's thread
    count within the physical cores (it warns in every process otherwise), the trainer workers' threads
    (``ray_cluster.threads_env``: Ray would give each one), the tracking backends' files in the run folder,
    the datasets cache in the local mode's cache (nothing new in HOME)."""
    import psutil

    from maspo_verl.local.ray_cluster import threads_env
    from maspo_verl.local.run_log import tracking_env

    env = {**tracking_env(config), **threads_env(trainer_workers(config))}
    if not (os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME")):
        # verl's dataset caches the parquet it reads; in the local mode's cache, not ~/.cache/huggingface
        from maspo_verl.util import default_cache_dir

        cache = config.get("maspo", {}).get("local_cache_dir") or default_cache_dir()
        env["HF_DATASETS_CACHE"] = os.path.join(os.path.expanduser(str(cache)), "hf_datasets")
    if not os.environ.get("TQ_NUM_THREADS"):
        env["TQ_NUM_THREADS"] = str(min(8, psutil.cpu_count(logical=False) or os.cpu_count() or 1))
    return env


def prepare_task(config) -> None:
    """The task's part of the config (``task=turns``: ``maspo.task``), before the batch-size checks read
    its lengths: the settings checked, ``data.max_response_length`` filled in where null (set too short:
    an error naming what the turns take), the task's toy data generated into the cache where the data
    paths are null."""
    from omegaconf import open_dict

    from maspo_verl.local import turns
    from maspo_verl.util import preset_names
    from maspo_verl.validation import FieldError

    maspo = config.get("maspo", {}) or {}
    task = maspo.get("task")
    if task is None:
        return
    from maspo_verl.local import speechwarm

    if task not in (turns.TASK, speechwarm.TASK):
        raise FieldError("maspo.task", f"maspo.task={task!r} is invalid: allowed {preset_names('task')} (task=<name>)")
    if not maspo.get("local"):
        raise FieldError("maspo.task", f"task={task} is a toy task of the local mode: add local=cpu")
    if task == speechwarm.TASK:
        _prepare_speechwarm(config)
        return
    n, tokens = turns.check_settings(maspo.get("turns"), maspo.get("turn_tokens"))
    data = config.data
    what = f"maspo.turns={n} turns of maspo.turn_tokens={tokens} tokens"
    lengths = (
        ("max_prompt_length", turns.prompt_length(tokens), f"the prompt of {what}"),
        ("max_response_length", turns.response_length(n, tokens), f"{what} and the observations between them"),
    )
    with open_dict(config):
        for key, needed, purpose in lengths:
            if _is_unset(data[key]):
                data[key] = needed
            elif int(data[key]) < needed:
                raise FieldError(
                    f"data.{key}",
                    f"data.{key}={data[key]} is too short for {purpose}: allowed >= {needed} (or null: exactly that)",
                )
        if _is_unset(data.train_files) or _is_unset(data.val_files):
            seed = int(maspo.get("local_seed", 0) or 0)
            paths = turns.ensure_dataset(seed, n, tokens, cache_dir=maspo.get("local_cache_dir"))
            if _is_unset(data.train_files):
                data.train_files = paths["train"]
            if _is_unset(data.val_files):
                data.val_files = paths["val"]


def _warm_fingerprint(config) -> str | None:
    """``task=speechwarm``: the fingerprint of the run's model's weights (``speechwarm.fingerprint``), which a study
    compares before it pairs runs (the warm model is trained on the machine that runs it); None otherwise."""
    from maspo_verl.local import speechwarm

    if (config.get("maspo", {}) or {}).get("task") != speechwarm.TASK:
        return None
    try:
        return speechwarm.fingerprint(str(config.actor_rollout_ref.model.path))
    except FileNotFoundError:  # not a folder of safetensors here (a hub id): nothing to fingerprint
        return None


def _prepare_speechwarm(config) -> None:
    """``task=speechwarm``: the warm-started model (``actor_rollout_ref.model.path`` null) and the task's data (the
    data paths null) of ``maspo.local_seed`` at ``data.max_response_length`` frames, built into the local cache."""
    from omegaconf import open_dict

    from maspo_verl.local import learn_tasks, speechwarm
    from maspo_verl.util import atomic_build, default_cache_dir
    from maspo_verl.validation import FieldError

    seed = int(config.maspo.get("local_seed", 0) or 0)
    cache = config.maspo.get("local_cache_dir")
    length = config.data.max_response_length
    if _is_unset(length) or int(length) < learn_tasks.SPEECH_WORDS:
        raise FieldError(
            "data.max_response_length",
            f"data.max_response_length={length}: allowed >= {learn_tasks.SPEECH_WORDS} with task=speechwarm "
            "(frames per response; each of its words is held over a quarter of them)",
        )
    length = int(length)
    with open_dict(config):
        if _is_unset(config.actor_rollout_ref.model.path):
            config.actor_rollout_ref.model.path = speechwarm.ensure_model(seed=seed, length=length, cache_dir=cache)
            _fit_tokenval_to_embedded(config.actor_rollout_ref.actor.policy_loss)
        if _is_unset(config.data.train_files) or _is_unset(config.data.val_files):
            root = Path(cache) if cache else default_cache_dir()
            folder = root / f"{speechwarm.TASK}-data-seed{seed}-L{length}"
            atomic_build(
                folder,
                lambda tmp: learn_tasks.write_dataset(tmp, learn_tasks.WARM, seed, length=length),
            )
            if _is_unset(config.data.train_files):
                config.data.train_files = str(folder / f"{learn_tasks.WARM}_train.parquet")
            if _is_unset(config.data.val_files):
                config.data.val_files = str(folder / f"{learn_tasks.WARM}_val.parquet")


def prepare(config) -> dict:
    """Fill in the local mode's paths, environment and overrides on the composed (mutable) config."""
    from omegaconf import open_dict

    mode = check_settings(config)
    check_verl_features()
    from maspo_verl.local import ray_cluster, speechwarm
    from maspo_verl.local.mismatch import MISMATCH_ENV, LogProbMismatch
    from maspo_verl.local.ray_cluster import THREADS_ENV as THREADS
    from maspo_verl.local.vllm_cpu import ENGINE_ENV

    mismatch = LogProbMismatch.from_mapping(_plain(config.maspo.get("local_mismatch")))
    engine = _choose_engine(config, mismatch)
    warm = _warm_fingerprint(config)
    # the mismatch and fingerprint variables always set: a stale shell value never leaks in
    mode_env = {**LOCAL_ENV, **_run_env(config), MISMATCH_ENV: mismatch.to_env(), ENGINE_ENV: engine}
    mode_env[speechwarm.FINGERPRINT_ENV] = warm or ""
    env = ray_cluster.local_env(mode_env, ray_cluster.job_env_vars())  # what a Ray job sets, it keeps
    os.environ.update(env)
    activate()

    from maspo_verl.local import assets

    arr = config.actor_rollout_ref
    seed = int(config.maspo.get("local_seed", 0) or 0)
    used = {}
    with open_dict(config):
        used.update(_prepare_pretrained(config, seed))
        need_model = _is_unset(arr.model.path)
        need_data = _is_unset(config.data.train_files) or _is_unset(config.data.val_files)
        if need_model or need_data:
            paths = assets.ensure_assets(seed=seed, cache_dir=config.maspo.get("local_cache_dir"))
            if need_model:
                arr.model.path = paths["model"]
                used["model"] = "embedded"
                _fit_tokenval_to_embedded(arr.actor.policy_loss)
            if _is_unset(config.data.train_files):
                config.data.train_files = paths["train"]
                used["train"] = "embedded"
            if _is_unset(config.data.val_files):
                config.data.val_files = paths["val"]
                used["val"] = "embedded"
            if used.get("train") and _is_unset(config.reward.custom_reward_function.path):
                from maspo_verl.local import reward

                config.reward.custom_reward_function.path = reward.__file__
                config.reward.custom_reward_function.name = "compute_score"
        if engine == "vllm":
            _fit_vllm_rollout(config)
        # Ray: the given cluster (RAY_ADDRESS, set inside `ray job submit`), else a private one in
        # its own temp dir; the local env in every worker.
        new_temp_dir = None if config.maspo.get("dry_run") else _private_temp_dir
        address = ray_cluster.configure_ray_init(config.ray_kwargs.ray_init, env, new_temp_dir)
        if address is None:
            _fit_private_cluster(config)
            if new_temp_dir is not None:  # a token in the cluster's temp dir, none in HOME
                os.environ.update(ray_cluster.private_token_env(config.ray_kwargs.ray_init._temp_dir))
                _run_temp_folder(config.ray_kwargs.ray_init)
    from maspo_verl.local import cpu_dtype

    dtype_line = cpu_dtype.fit(config)  # the fastest precision for this CPU where the command line sets none
    ray_init = config.ray_kwargs.ray_init
    from maspo_verl.local.run_log import run_dir, shown_path

    folder = "" if config.maspo.get("dry_run") else f" run_folder={shown_path(run_dir())}"
    if mismatch.active:
        bypass = bool((config.algorithm.get("rollout_correction", {}) or {}).get("bypass_mode", False))
        print(
            f"maspo_verl local: test instrument maspo.local_mismatch on ({mismatch.describe()}); "
            + ("bypass mode: they are the old log-probs" if bypass else "no bypass mode: only diagnostics see them"),
            flush=True,
        )
    if dtype_line:
        print(dtype_line, flush=True)
    if warm:
        print(f"maspo_verl local: the warm model's fingerprint {warm} (its weights; every step's "
              f"{speechwarm.FINGERPRINT_METRIC} in metrics.jsonl)", flush=True)  # fmt: skip
    print(f"maspo_verl local: {_engine_line(config)}", flush=True)
    print(
        f"maspo_verl local={mode}: model={arr.model.path} train={config.data.train_files} "
        f"val={config.data.val_files} ray_address={ray_init.get('address')} ray_temp_dir={ray_init.get('_temp_dir')}"
        f"{folder}\nmaspo_verl local: {ray_cluster.machine_line(ray_init)}\nmaspo_verl local: "
        + ray_cluster.threads_line(trainer_workers(config), os.environ[THREADS], THREADS not in mode_env),
        flush=True,
    )
    return {"model": arr.model.path, "train": config.data.train_files, "val": config.data.val_files, **used}


ENGINES = ("vllm", "hf")
# each engine in the run's start-up line (``_engine_line``), which ``engine_of`` reads back
ENGINE_WORDS = {"vllm": "verl's vLLM rollout", "hf": "the transformers rollout"}
ENGINE_LINE = "rollout engine: "


def engine_of(console: str) -> str | None:
    """The rollout engine a local run's console names in its start-up line; None where it names none."""
    for name, words in ENGINE_WORDS.items():
        if f"{ENGINE_LINE}{words}" in console:
            return name
    return None


def _engine_line(config) -> str:
    """Which engine samples, in what precision, and whose log-probs are the old log-probs."""
    from maspo_verl.local import vllm_cpu

    rollout = config.actor_rollout_ref.rollout
    bypass = bool((config.algorithm.get("rollout_correction", {}) or {}).get("bypass_mode", False))
    if rollout.name == "vllm":
        version = vllm_cpu._dist_version(vllm_cpu.CPU_DIST) or "?"
        engine = f"{ENGINE_WORDS['vllm']} on vllm-cpu {version} ({rollout.dtype})"
    else:
        engine = f"{ENGINE_WORDS['hf']} (maspo_verl.local.hf_rollout)"
    old = (
        "the engine's log-probs are the old log-probs (bypass mode)"
        if bypass
        else "the actor recomputes the old log-probs"
    )
    return f"{ENGINE_LINE}{engine}; {old}"


def _choose_engine(config, mismatch) -> str:
    """The rollout engine of the run (``actor_rollout_ref.rollout.name``): ``vllm`` (verl's vLLM rollout on
    vllm-cpu) where it can run here, else ``hf`` (the transformers rollout), said in one line; ``hf`` also where
    ``maspo.local_mismatch`` is on (an instrument of that server)."""
    from omegaconf import open_dict

    from maspo_verl.local import vllm_cpu
    from maspo_verl.validation import FieldError

    rollout = config.actor_rollout_ref.rollout
    name = str(rollout.name)
    if name not in ENGINES:
        raise FieldError(
            "actor_rollout_ref.rollout.name",
            f"actor_rollout_ref.rollout.name={name!r}: the local mode runs {ENGINES} (vllm: vLLM on vllm-cpu)",
        )
    reason = None
    if name == "vllm" and mismatch.active:
        reason = "maspo.local_mismatch is an instrument of the transformers rollout server"
    elif name == "vllm":
        reason = vllm_cpu.unavailable_reason()
    if reason:
        print(
            f"maspo_verl local: the vLLM rollout is not used: {reason}; the transformers rollout (hf) samples",
            flush=True,
        )
        with open_dict(config):
            rollout.name = "hf"
    return str(rollout.name)


def _fit_vllm_rollout(config) -> None:
    """vLLM on a CPU: sleep mode off, a context of a prompt plus a response, an explicit KV-cache size
    (``vllm_cpu.rollout_overrides``)."""
    from maspo_verl.local import vllm_cpu

    rollout = config.actor_rollout_ref.rollout
    settings, engine = vllm_cpu.rollout_overrides(config)
    rollout.update(settings)
    if engine:
        if rollout.get("engine_kwargs") is None:
            rollout.engine_kwargs = {}
        if rollout.engine_kwargs.get("vllm") is None:
            rollout.engine_kwargs.vllm = {}
        rollout.engine_kwargs.vllm.update(engine)


def _prepare_pretrained(config, seed: int) -> dict:
    """``model=smollm2``: the prepared SmolLM2 folder and the arithmetic task where their paths are null."""
    name = (config.get("maspo", {}) or {}).get("model")
    if name is None:
        return {}
    from maspo_verl.pretrained import arith_worked, smollm2
    from maspo_verl.util import preset_names
    from maspo_verl.validation import FieldError

    if name != smollm2.NAME:
        raise FieldError(
            "maspo.model", f"maspo.model={name!r} is invalid: allowed {preset_names('model')} (model=<name>)"
        )
    cache = config.maspo.get("local_cache_dir")
    used = {}
    if _is_unset(config.actor_rollout_ref.model.path):
        try:
            config.actor_rollout_ref.model.path = str(smollm2.ensure_model(cache))
        except smollm2.SmolLM2Unavailable as exc:
            raise FieldError("model", f"model={name}: {exc}") from None
        used["model"] = name
    if _is_unset(config.data.train_files) or _is_unset(config.data.val_files):
        # maspo.arith.form: short (arith) or worked (arith_worked)
        paths, what = arith_worked.ensure_task(config.maspo.get("arith", {}) or {}, seed, cache)
        for key, split in (("train_files", "train"), ("val_files", "val")):
            if _is_unset(config.data[key]):
                config.data[key] = paths[split]
                used[split] = what
    return used


def _plain(value):
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _fit_private_cluster(config) -> None:
    """A private cluster gets at least one logical GPU per trainer worker (``trainer.nnodes *
    n_gpus_per_node``; the ranks run FSDP on gloo), for verl's resource-pool checks."""
    ray_init = config.ray_kwargs.ray_init
    workers = trainer_workers(config)
    if int(ray_init.get("num_gpus") or 0) < workers:
        ray_init.num_gpus = workers


def _private_temp_dir() -> str:
    folder = tempfile.mkdtemp(prefix="maspo_ray_", dir="/tmp")  # short: Ray's socket paths are length-limited
    CREATED_TEMP_DIRS.append(folder)
    return folder


RUN_TMP = "tmp"  # the run's temp folder, inside its private cluster's temp dir


def _run_temp_folder(ray_init) -> None:
    """A run on a private cluster keeps its temp files in its own folder, ``<cluster temp dir>/tmp``, removed with
    the cluster's temp dir however the run ends: ``TMPDIR`` of the driver and of every Ray worker and the processes
    they start (vLLM's ZMQ sockets, verl's checkpoint locks, multiprocessing's folders would otherwise stay in the
    system's temp dir). Short: a unix socket's path holds at most 107 bytes. A ``TMPDIR`` in the user's
    ``runtime_env`` wins in the workers."""
    folder = os.path.join(str(ray_init._temp_dir), RUN_TMP)
    os.makedirs(folder, exist_ok=True)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # the driver's tempfile reads TMPDIR again
    env_vars = ray_init.runtime_env.env_vars
    if "TMPDIR" not in env_vars:
        env_vars["TMPDIR"] = folder


def _fit_tokenval_to_embedded(policy_loss) -> None:
    """The embedded tokenizer's ids 0..255 are bytes: use them as 4-digit FSQ "codes" ([4]*4 = 256)."""
    from maspo_verl.core.token_sets import segment_rules
    from maspo_verl.local.assets import MODEL_VOCAB

    if not any(rule.reads_codec for rule in segment_rules(policy_loss)):
        return
    if int(policy_loss.get("codec_offset", 0)) + int(policy_loss.get("codec_size", 1)) <= MODEL_VOCAB:
        return
    policy_loss.codec_offset = 0
    policy_loss.codec_size = 256
    policy_loss.fsq_levels = [4, 4, 4, 4]
    logger.warning(
        "maspo_verl local: the embedded tokenizer has no codec range; tokenval uses byte ids 0..255 as "
        "FSQ codes (codec_offset=0, codec_size=256, fsq_levels=[4,4,4,4])"
    )
    print("maspo_verl local: tokenval codec range set to the embedded byte ids (0..255, fsq [4,4,4,4])")
