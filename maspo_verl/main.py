"""``python -m maspo_verl.main <hydra overrides>``: verl's ``main_ppo`` on our config directory.

Composes ``hydra_configs/maspo_trainer.yaml`` (verl's ``ppo_trainer.yaml`` + our loss presets),
runs our start-up checks, then hands the config to verl's own ``main_ppo`` entry.

- ``local=cpu`` switches on the local CPU mode (``maspo_verl.local.mode.LocalMode``), imported only then: a short
  console log, the run's metrics and whole log in its run folder, a closing block at the end.
  ``task=turns`` adds its multi-turn toy environment (``maspo_verl.local.turns``).
- ``maspo.dry_run=true`` stops after verl's own config validation and prints the resolved
  policy-loss section: no Ray, no GPU, and no run folder left behind.

A setting refused at start-up (a ``FieldError``) is printed alone, without a traceback, and leaves no
run folder; an override of a ``policy_loss`` field that does not exist names the closest ones.
"""

from __future__ import annotations

import os
import sys
import traceback

import hydra
from omegaconf import DictConfig, OmegaConf

from maspo_verl.batch_sizes import check_batch_sizes
from maspo_verl.plugin.checks import check_policy_loss, run_startup_checks
from maspo_verl.plugin.preflight import preflight, unrefused
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


def unread_fields(policy_loss: dict) -> list[str]:
    """Our declared ``policy_loss`` fields the chosen loss does not read: all of them for verl's own losses;
    for ours the segmentation's when no rule runs, a rule's when another runs, a setting whose
    description names other token sets (`maspo`, `pgspo`) or another ``clip_schedule`` ("log_adaptive: ...")."""
    import re

    from maspo_verl.config import SETTINGS
    from maspo_verl.core.segments import SEGMENT_RULES, compute
    from maspo_verl.core.token_sets import TOKEN_SETS, segment_rules

    loss_mode = policy_loss.get("loss_mode")
    if loss_mode not in TOKEN_SETS:
        return [s.name for s in SETTINGS if s.name in policy_loss]
    in_use = {rule.name for rule in segment_rules(policy_loss)}
    rule_of = {s.name: rule.name for rule in SEGMENT_RULES.values() for s in rule.settings}
    segmentation = {s.name for s in compute.SETTINGS}
    schedules = next(s.allowed.choices for s in SETTINGS if s.name == "clip_schedule")
    unread = []
    for s in SETTINGS:
        sets = [name for name in re.findall(r"`(\w+)`", s.doc) if name in TOKEN_SETS]
        schedule = s.doc.split(":", 1)[0] if s.name != "clip_schedule" else None
        if (
            (s.name in rule_of and rule_of[s.name] not in in_use)
            or (s.name in segmentation and not in_use)
            or (sets and loss_mode not in sets)
            or (schedule in schedules and schedule != policy_loss.get("clip_schedule"))
        ):
            unread.append(s.name)
    return [name for name in unread if name in policy_loss]


def dry_run(config: DictConfig, unrefused: int = 0) -> dict:
    """verl's own validation (which builds the actor dataclass, ours included) without starting Ray. Prints
    the loss section with the ``policy_loss`` fields the chosen loss reads; returns all of it. ``unrefused``:
    the preflight's problems that ``maspo.preflight=warn`` printed instead of refusing (said again here)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    section = loss_section(config)
    policy_loss = section.get("policy_loss")
    shown, unread = section, []
    if isinstance(policy_loss, dict):
        unread = unread_fields(policy_loss)
        shown = {**section, "policy_loss": {k: v for k, v in policy_loss.items() if k not in unread}}
    if unrefused:
        print(f"maspo_verl dry run: config valid, but {unrefused} problem{'s' * (unrefused != 1)} on this machine "
              "(above; a run here stops at the first); loss section:")  # fmt: skip
    else:
        print("maspo_verl dry run: config valid; loss section:")
    print(OmegaConf.to_yaml(OmegaConf.create(shown)), end="")
    if unread:
        print(f"# not shown: {len(unread)} policy_loss fields {policy_loss.get('loss_mode')} does not read "
              "(python -m maspo_verl.main ... --cfg job prints the whole config)")  # fmt: skip
    print(flush=True)
    return section


def run(config: DictConfig) -> None:
    """A local run (``maspo.local``) asks its ``LocalMode`` in order: the task's data, the checks, the session, the
    run's preparation and start-up checks; then verl's main_ppo body (or the dry run) starts. Elsewhere: the
    batch-size checks, the start-up checks, the preflight, then the same start."""
    maspo = config.get("maspo", {}) or {}
    if maspo.get("local"):
        from maspo_verl.local.mode import LocalMode

        mode = LocalMode(config)
        mode.prepare()  # the task's lengths and data (task=turns), before the batch checks read them
        mode.checks()  # the config's own errors first, then what it names on this machine
        with mode.session():  # the console, run folder and closing block of a run; a dry run's console
            mode.run()  # before verl's trainer module: it picks the platform on import
            _start(config, mode.unrefused)
        return
    if maspo.get("task"):
        from maspo_verl.local.tasks import prepare_task

        prepare_task(config)  # refuses a toy task of the local mode without local=cpu
    check_batch_sizes(config)  # the config's own errors first, then what it names on this machine
    check_policy_loss(config)
    run_startup_checks(config)
    lines = preflight(config, local=False)  # paths and GPUs (in a dry run, GPUs missing are a note)
    _start(config, unrefused(lines))


def _start(config: DictConfig, unrefused: int) -> None:
    """verl's main_ppo body, or with ``maspo.dry_run`` the dry run (``unrefused``: the preflight's problems
    ``maspo.preflight=warn`` printed instead of refusing)."""
    if (config.get("maspo", {}) or {}).get("dry_run"):
        dry_run(config, unrefused)
    else:
        _verl_main(config)


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


# set by ``cli`` while Hydra composes, so a composition error reaches ``cli`` (``unknown_key_message``)
_FORCED_FULL_ERROR = "_MASPO_VERL_FORCED_HYDRA_FULL_ERROR"


def unknown_key_message(exc: BaseException, overrides: list[str]) -> str | None:
    """For Hydra's "Could not override 'a.b.c'" (a key verl's config does not have): the section's closest
    keys, as our own fields get them, and the ``+`` form for a key meant to be new; for "Could not find
    'loss/x'" (an option a config group does not have, e.g. ``loss=maspo_fixd``): the closest options;
    None for other errors."""
    from hydra.errors import MissingConfigException

    missing = exc if isinstance(exc, MissingConfigException) else exc.__cause__
    if isinstance(missing, MissingConfigException) and missing.options and missing.missing_cfg_file:
        group, _, name = str(missing.missing_cfg_file).rpartition("/")
        if group:
            return unknown_message(f"config group {group!r}", [name], sorted(missing.options), f"{group} options")
    cause = exc.__cause__
    key, full_key, parent = (getattr(cause, a, None) for a in ("key", "full_key", "parent_node"))
    if not (isinstance(key, str) and isinstance(full_key, str) and hasattr(parent, "keys")):
        return None
    if "Could not override" not in str(exc):
        return None
    section = full_key[: -len(key)].rstrip(".") or "the config"
    given = next((o for o in overrides if o.split("=", 1)[0] == full_key), f"{full_key}=...")
    head = unknown_message(section, [key], [str(k) for k in parent.keys()], "keys")
    return f"{head}\n(a key verl's config does not have is added with +{given})"


def _restore_hydra_full_error() -> None:
    if os.environ.pop(_FORCED_FULL_ERROR, None):
        os.environ.pop("HYDRA_FULL_ERROR", None)


@hydra.main(config_path=CONFIG_PATH, config_name="maspo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    from maspo_verl.local.run_log import RunStopped, remove_hydra_run_folder, run_dir

    _restore_hydra_full_error()  # errors of the run itself: Hydra's own reporting

    log = run_dir() / "run.log"  # written by a local run's session from its start
    try:
        run(config)
    except RunStopped:  # the closing block has named the cause (its first line said it as it happened)
        sys.exit(1)
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
                sys.stdout.flush()  # the notes printed before it (start-up checks), before it on a shared console
                print(f"maspo_verl: {cause}", file=sys.stderr, flush=True)
            sys.exit(1)
        raise
    if (config.get("maspo", {}) or {}).get("dry_run"):
        remove_hydra_run_folder()


INTERRUPTED = 130  # the exit status of a command Ctrl-C stopped (128 + SIGINT), as a shell reports it


def cli(argv: list[str] | None = None) -> None:
    """The module's command line: the ``policy_loss`` override check, then Hydra's ``main``; a misspelt
    verl key gets the closest keys instead of Hydra's "+key" advice. A run stopped by SIGINT or SIGTERM exits
    with 128 + the signal's number (130, 143) and no traceback: a local run's closing block has said so."""
    overrides = sys.argv[1:] if argv is None else argv
    try:
        check_policy_loss_overrides(overrides)
    except FieldError as exc:
        print(f"maspo_verl: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if "HYDRA_FULL_ERROR" not in os.environ:
        os.environ.update({"HYDRA_FULL_ERROR": "1", _FORCED_FULL_ERROR: "1"})
    try:
        main()
    except KeyboardInterrupt as exc:
        status = getattr(exc, "exit_status", None)  # a local run's session (``run_log.Interrupted``) said it
        if status is None:
            print("maspo_verl: stopped by SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED if status is None else status)
    except Exception as exc:  # raised while Hydra composes (the run's own errors Hydra reports itself)
        forced = bool(os.environ.get(_FORCED_FULL_ERROR))
        _restore_hydra_full_error()
        message = unknown_key_message(exc, overrides)
        if message is not None:
            print(f"maspo_verl: {message}", file=sys.stderr, flush=True)
            sys.exit(2)
        if not forced:
            raise
        _report_like_hydra(exc)


def _report_like_hydra(exc: BaseException) -> None:
    """What Hydra prints for an error without HYDRA_FULL_ERROR: a composition error's message, else the
    traceback; exit status 1."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, CompactHydraException):
        print(str(exc), file=sys.stderr)
        if isinstance(exc.__cause__, OmegaConfBaseException):
            print(str(exc.__cause__), file=sys.stderr)
    else:
        traceback.print_exception(exc)
    sys.stderr.flush()
    sys.exit(1)


if __name__ == "__main__":
    cli()
