"""The local mode of one run (``local=cpu``), which ``maspo_verl.main.run`` asks in order:

1. ``prepare``: the task's lengths and data (``tasks.prepare_task``), which the batch-size checks read;
2. ``checks``: the config's own errors (batch sizes, the policy-loss config), then the paths it gives on this machine
   (``preflight``; those left unset are ``run``'s to fill);
3. ``session``: the short console, the run folder and its closing block (``run_log.session``), the watchdog over the
   rollout servers and their engines (``watchdog``); a dry run's console only (``console.dry_run_console``);
4. ``run``: the run's model, data, environment and engine filled in on the composed config, verl's adaptations
   activated (``adaptations.activate``) before verl's trainer module is imported (it picks the platform on import),
   the start-up lines printed, then the start-up checks on the config that runs (e.g. the tokenizer that
   ``segment_rule=delimiters`` resolves its strings against). verl's trainer, or the dry run's report, is the entry
   point's to start after it.
"""

from __future__ import annotations

import contextlib

LOCAL_MODES = ("cpu",)
# the settings of the local mode's log (hydra_configs/local/cpu.yaml, maspo.*)
LOG_SETTINGS = ("quiet", "print_config")


class LocalMode:
    """The local mode of the run of ``config`` (the composed, mutable trainer config)."""

    def __init__(self, config):
        self.config = config
        self.unrefused = 0  # the preflight's problems ``maspo.preflight=warn`` printed instead of refusing
        self.used: dict = {}  # what ``run`` filled in

    def prepare(self) -> None:
        """The task's part of the config (``task=...``), before the batch-size checks read its lengths."""
        from maspo_verl.local.tasks import prepare_task

        prepare_task(self.config)

    def checks(self) -> None:
        """The config's own errors first (batch sizes, the policy-loss config), then what it names on this machine
        (the paths given; those left unset are ``run``'s to fill)."""
        from maspo_verl.batch_sizes import check_batch_sizes
        from maspo_verl.plugin.checks import check_policy_loss
        from maspo_verl.plugin.preflight import preflight, unrefused

        check_batch_sizes(self.config)
        check_policy_loss(self.config)
        self.unrefused = unrefused(preflight(self.config, local=True))

    @contextlib.contextmanager
    def session(self):
        """Around ``run`` and verl's trainer, in the driver: the run's console, run folder and closing block
        (``run_log.session``), with the watchdog over the rollout servers and their engines (``watchdog``), which
        mutes the console when it stops the run. A dry run: its console only (no run folder, no Ray)."""
        if self.config.maspo.get("dry_run"):
            from maspo_verl.local.console import dry_run_console

            with dry_run_console(self.config):
                yield
            return
        from maspo_verl.local.ray_cluster import CREATED_TEMP_DIRS
        from maspo_verl.local.run_log import session as run_session
        from maspo_verl.local.watchdog import watching

        check_settings(self.config)
        with (
            run_session(self.config, CREATED_TEMP_DIRS) as console,
            watching(on_death=console.mute, temp_dirs=CREATED_TEMP_DIRS),
        ):
            yield

    def run(self) -> None:
        """The run filled in (``prepare_run``), then the start-up checks on the config that runs."""
        from maspo_verl.plugin.checks import run_startup_checks

        self.used = prepare_run(self.config)
        run_startup_checks(self.config)


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


def prepare_run(config) -> dict:
    """Fill in the local mode's paths, environment and overrides on the composed (mutable) config; activate verl's
    adaptations. Returns the run's model and data paths and what was filled in (``tasks.fill_model_and_data``)."""
    from omegaconf import open_dict

    from maspo_verl.local import engine, environment, ray_cluster, tasks
    from maspo_verl.local.adaptations import activate, check_verl_features

    mode = check_settings(config)
    check_verl_features()
    mismatch = engine.mismatch_of(config)
    rollout = engine.choose_engine(config, mismatch)
    warm = tasks.warm_fingerprint(config)
    env, mode_env = environment.set_environment(config, mismatch, rollout, warm)
    activate()

    seed = int(config.maspo.get("local_seed", 0) or 0)
    used = tasks.fill_model_and_data(config, seed)
    with open_dict(config):
        if rollout == "vllm":
            engine.fit_vllm_rollout(config)
        ray_cluster.configure(config, env)
    dtype_line = environment.fit_dtype(config)
    _print_start(config, mode, mismatch, dtype_line, warm, environment.threads_line(config, mode_env))
    arr = config.actor_rollout_ref
    return {"model": arr.model.path, "train": config.data.train_files, "val": config.data.val_files, **used}


def _print_start(config, mode: str, mismatch, dtype_line: str | None, warm: str | None, threads: str) -> None:
    """The run's start-up lines: the test instrument, the precision, the warm model, the engine, the model and data,
    Ray, the machine and the threads."""
    from maspo_verl.local import ray_cluster, speechwarm
    from maspo_verl.local.engine import engine_line
    from maspo_verl.local.run_log import run_dir, shown_path

    arr = config.actor_rollout_ref
    ray_init = config.ray_kwargs.ray_init
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
    print(f"maspo_verl local: {engine_line(config)}", flush=True)
    print(
        f"maspo_verl local={mode}: model={arr.model.path} train={config.data.train_files} "
        f"val={config.data.val_files} ray_address={ray_init.get('address')} ray_temp_dir={ray_init.get('_temp_dir')}"
        f"{folder}\nmaspo_verl local: {ray_cluster.machine_line(ray_init)}\nmaspo_verl local: {threads}",
        flush=True,
    )
