"""The local mode's tasks: the model and data of a run where its paths are null. The embedded tiny model and toy
data (``assets``), ``model=smollm2`` and its arithmetic task (``maspo_verl.pretrained``), and the toy tasks of
``maspo.task``: ``task=turns`` (the multi-turn environment, ``turns``; its agent loop and reward manager:
``turns_agent``, registered in verl by ``adaptations.activate``) and ``task=speechwarm`` (the warm-started speech
model, ``speechwarm``). ``prepare_task`` runs before the batch-size checks, which read the task's lengths."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("maspo_verl.local")


def is_unset(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in ("", "null", "None"))


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
            if is_unset(data[key]):
                data[key] = needed
            elif int(data[key]) < needed:
                raise FieldError(
                    f"data.{key}",
                    f"data.{key}={data[key]} is too short for {purpose}: allowed >= {needed} (or null: exactly that)",
                )
        if is_unset(data.train_files) or is_unset(data.val_files):
            seed = int(maspo.get("local_seed", 0) or 0)
            paths = turns.ensure_dataset(seed, n, tokens, cache_dir=maspo.get("local_cache_dir"))
            if is_unset(data.train_files):
                data.train_files = paths["train"]
            if is_unset(data.val_files):
                data.val_files = paths["val"]


def warm_fingerprint(config) -> str | None:
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
    if is_unset(length) or int(length) < learn_tasks.SPEECH_WORDS:
        raise FieldError(
            "data.max_response_length",
            f"data.max_response_length={length}: allowed >= {learn_tasks.SPEECH_WORDS} with task=speechwarm "
            "(frames per response; each of its words is held over a quarter of them)",
        )
    length = int(length)
    with open_dict(config):
        if is_unset(config.actor_rollout_ref.model.path):
            config.actor_rollout_ref.model.path = speechwarm.ensure_model(seed=seed, length=length, cache_dir=cache)
            _fit_tokenval_to_embedded(config.actor_rollout_ref.actor.policy_loss)
        if is_unset(config.data.train_files) or is_unset(config.data.val_files):
            root = Path(cache) if cache else default_cache_dir()
            folder = root / f"{speechwarm.TASK}-data-seed{seed}-L{length}"
            atomic_build(
                folder,
                lambda tmp: learn_tasks.write_dataset(tmp, learn_tasks.WARM, seed, length=length),
            )
            if is_unset(config.data.train_files):
                config.data.train_files = str(folder / f"{learn_tasks.WARM}_train.parquet")
            if is_unset(config.data.val_files):
                config.data.val_files = str(folder / f"{learn_tasks.WARM}_val.parquet")


def fill_model_and_data(config, seed: int) -> dict:
    """The run's model and data where their paths are null: ``model=smollm2`` and its task, else the embedded model
    and toy data (and the toy data's reward function). Returns what was filled in, by name (``used``)."""
    from omegaconf import open_dict

    from maspo_verl.local import assets

    arr = config.actor_rollout_ref
    used = {}
    with open_dict(config):
        used.update(_prepare_pretrained(config, seed))
        need_model = is_unset(arr.model.path)
        need_data = is_unset(config.data.train_files) or is_unset(config.data.val_files)
        if need_model or need_data:
            paths = assets.ensure_assets(seed=seed, cache_dir=config.maspo.get("local_cache_dir"))
            if need_model:
                arr.model.path = paths["model"]
                used["model"] = "embedded"
                _fit_tokenval_to_embedded(arr.actor.policy_loss)
            if is_unset(config.data.train_files):
                config.data.train_files = paths["train"]
                used["train"] = "embedded"
            if is_unset(config.data.val_files):
                config.data.val_files = paths["val"]
                used["val"] = "embedded"
            if used.get("train") and is_unset(config.reward.custom_reward_function.path):
                from maspo_verl.local import reward

                config.reward.custom_reward_function.path = reward.__file__
                config.reward.custom_reward_function.name = "compute_score"
    return used


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
    if is_unset(config.actor_rollout_ref.model.path):
        try:
            config.actor_rollout_ref.model.path = str(smollm2.ensure_model(cache))
        except smollm2.SmolLM2Unavailable as exc:
            raise FieldError("model", f"model={name}: {exc}") from None
        used["model"] = name
    if is_unset(config.data.train_files) or is_unset(config.data.val_files):
        # maspo.arith.form: short (arith) or worked (arith_worked)
        paths, what = arith_worked.ensure_task(config.maspo.get("arith", {}) or {}, seed, cache)
        for key, split in (("train_files", "train"), ("val_files", "val")):
            if is_unset(config.data[key]):
                config.data[key] = paths[split]
                used[split] = what
    return used


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
