"""A loss preset as the lab calls it: the composed ``loss=<name>`` section split into verl's actor fields and our
policy-loss section, and from those the (loss function, verl ``ActorConfig``) pair every study calls."""

from __future__ import annotations

ACTOR_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode")


def split(section) -> tuple[dict, dict]:
    """(verl's actor fields, the policy-loss section without ``_target_``) of a composed loss section."""
    policy_loss = {k: v for k, v in section["policy_loss"].items() if k != "_target_"}
    return {k: section[k] for k in ACTOR_KEYS}, policy_loss


def actor_config_of(actor: dict, policy_loss: dict):
    """verl's ``ActorConfig`` with our policy-loss dataclass, as the trainer instantiates it."""
    from maspo_verl.config import actor_config

    return actor_config(*(actor[k] for k in ACTOR_KEYS), **policy_loss)


def loss_and_config(actor: dict, policy_loss: dict):
    """(the registry's loss function, ``actor_config_of``) of a preset's two sections."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import maspo_verl.plugin  # noqa: F401  (registers our losses)

    return get_policy_loss_fn(policy_loss["loss_mode"]), actor_config_of(actor, policy_loss)
