"""``python -m maspo_verl.main <hydra overrides>``: verl's ``main_ppo`` on our config directory.

Composes ``hydra_configs/maspo_trainer.yaml`` (verl's ``ppo_trainer.yaml`` + our loss presets),
runs our start-up checks, then hands the config to verl's own ``main_ppo`` entry.

- ``local=cpu`` switches on the local CPU mode (``maspo_verl.local``), imported only then: a short
  console log, the run's metrics and whole log in its run folder, a closing block at the end.
  ``task=turns`` adds its multi-turn toy environment (``maspo_verl.local.turns``).
- ``maspo.dry_run=true`` stops after verl's own config validation and prints the resolved
  policy-loss section: no Ray, no GPU, and no run folder left behind.

A setting refused at start-up (a ``FieldError``) is printed alone, without a traceback, and leaves no
run folder; an override of a ``policy_loss`` field that does not exist names the closest ones.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from maspo_verl.batch_sizes import check_batch_sizes
from maspo_verl.plugin.checks import run_startup_checks
from maspo_verl.util import config_dir
from maspo_verl.validation import FieldError, root_cause, unknown_message

CONFIG_PATH = str(config_dir())

LOSS_KEYS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_agg_mode",
    "policy_loss",
)


def loss_section(config: DictConfig) -> dict:
    """The resolved actor keys that define the loss, plus the bypass flag."""
    actor = config.actor_rollout_ref.actor
    section = {key: OmegaConf.to_container(actor, resolve=True)[key] for key in LOSS_KEYS if key in actor}
    rollout_correction = config.get("algorithm", {}).get("rollout_correction", {}) or {}
    section["bypass_mode"] = bool(rollout_correction.get("bypass_mode", False))
    return section


def dry_run(config: DictConfig) -> dict:
    """verl's own validation (which builds the actor dataclass, ours included) without starting Ray."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    section = loss_section(config)
    print("maspo_verl dry run: config valid; loss section:")
    print(OmegaConf.to_yaml(OmegaConf.create(section)))
    return section


def run(config: DictConfig) -> None:
    """Batch-size checks, the local mode's preparation, start-up checks, then verl's main_ppo body (or
    the dry run). The local mode fills in its model and data before the start-up checks, so they see
    the config that runs (e.g. the tokenizer that ``segment_rule=delimiters`` resolves its strings
    against); a local run's console, run folder and Ray temp dirs are the session's."""
    maspo = config.get("maspo", {}) or {}
    if maspo.get("task"):
        from maspo_verl import local

        local.prepare_task(config)  # the task's lengths and data (task=turns), before the batch checks
    check_batch_sizes(config)
    check_policy_loss(config)
    if not maspo.get("local"):
        run_startup_checks(config)
        if maspo.get("dry_run"):
            dry_run(config)
        else:
            _verl_main(config)
        return
    from maspo_verl import local

    if maspo.get("dry_run"):
        local.prepare(config)
        run_startup_checks(config)
        dry_run(config)
        return
    with local.session(config):
        local.prepare(config)  # before verl's trainer module: it picks the platform on import
        run_startup_checks(config)
        _verl_main(config)


def check_policy_loss(config: DictConfig) -> None:
    """Build our policy-loss config as verl will (its checks run), so a bad value is refused before anything
    starts (no Ray, no run folder), not by verl's validation inside the run."""
    from verl.utils.config import omega_conf_to_dataclass

    from maspo_verl.config import TARGET

    section = config.actor_rollout_ref.actor.policy_loss
    if section.get("_target_") == TARGET:
        omega_conf_to_dataclass(section)


def _verl_main(config: DictConfig) -> None:
    from verl.trainer.main_ppo import main as verl_main

    verl_main.__wrapped__(config)  # the function under verl's @hydra.main


POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"


def policy_loss_fields() -> list[str]:
    """The keys of the ``policy_loss`` section: ``_target_`` and the loss config's fields."""
    from dataclasses import fields

    from maspo_verl.config import GranularLossConfig

    return list(dict.fromkeys(["_target_"] + [f.name for f in fields(GranularLossConfig) if f.init]))


def check_policy_loss_overrides(overrides: list[str]) -> None:
    """Raise ``FieldError`` for ``policy_loss.<name>=...`` where no such field exists, naming the closest
    fields: Hydra would refuse it only with its "use +..." hint (``+``/``++`` overrides are the loss
    config's to refuse, with the same message)."""
    prefix = POLICY_LOSS + "."
    given = [a.split("=", 1)[0][len(prefix) :] for a in overrides if a.startswith(prefix) and "=" in a]
    if not given:
        return
    allowed = policy_loss_fields()
    unknown = sorted({name.split(".")[0] for name in given} - set(allowed))
    if unknown:
        raise FieldError(f"{prefix}{unknown[0]}", unknown_message(POLICY_LOSS, unknown, allowed, "fields"))


@hydra.main(config_path=CONFIG_PATH, config_name="maspo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    from maspo_verl.local.run_log import remove_hydra_run_folder, run_dir

    log = run_dir() / "run.log"  # written by a local run's session from its start
    try:
        run(config)
    except Exception as exc:
        cause = root_cause(exc)
        began = log.is_file()
        if not began:  # refused before the run began: nothing worth a run folder
            remove_hydra_run_folder()
        # a setting to fix (a field error, or the loss config refusing its fields under Hydra's
        # instantiation wrapper): its message is the whole story
        refused = isinstance(cause, FieldError) or (cause is not exc and isinstance(cause, TypeError | ValueError))
        if refused:
            if not began:  # (a local run's closing block has already said it)
                print(f"maspo_verl: {cause}", file=sys.stderr, flush=True)
            sys.exit(1)
        raise
    if (config.get("maspo", {}) or {}).get("dry_run"):
        remove_hydra_run_folder()


def cli(argv: list[str] | None = None) -> None:
    """The module's command line: the ``policy_loss`` override check, then Hydra's ``main``."""
    try:
        check_policy_loss_overrides(sys.argv[1:] if argv is None else argv)
    except FieldError as exc:
        print(f"maspo_verl: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
