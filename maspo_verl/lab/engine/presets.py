"""The arm grammar: a loss preset as the lab calls it (the composed ``loss=<name>`` section split into verl's actor
fields and our policy-loss section, and from those the (loss function, verl ``ActorConfig``) pair every study
calls), a variant of one (``<preset>@<field>=<value>``) and its clip band scaled (``widen``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

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


BASELINE = "grpo"
SHIPPED = "shipped"  # a preset's clip band as shipped (a run's band column where it was not scaled)


@dataclass(frozen=True)
class Preset:
    name: str
    loss_mode: str
    actor: dict  # clip_ratio_low/high/c, loss_agg_mode
    policy_loss: dict  # the composed policy_loss section without _target_
    band: str = SHIPPED  # the clip band: as shipped, or scaled (``widen``)
    control: str = ""  # what the words rule is fed instead of the response's runs (``CONTROLS``)


def discover_presets(names: list[str] | None = None) -> list[Preset]:
    """Every ``hydra_configs/loss/*.yaml`` (or ``names``), composed as ``python -m maspo_verl.main loss=<name>``
    composes it; the baseline first."""
    from maspo_verl.main import loss_section
    from maspo_verl.reference import compose_config
    from maspo_verl.util import preset_names

    available = preset_names()
    names = names or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        raise SystemExit(f"--presets {unknown}: allowed {available} (hydra_configs/loss/)")
    names = sorted(names, key=lambda n: (n != BASELINE, n))
    out = []
    for name in names:
        actor, policy_loss = split(loss_section(compose_config(f"loss={name}")))
        out.append(Preset(name, policy_loss["loss_mode"], actor, policy_loss))
    return out


# the alignment control of the words rule (``grid.shuffled_runs``): maspo_words fed its runs in a random order
CONTROL = "maspo_words~shuffled"


def presets_of(names: list[str]) -> list[Preset]:
    """The presets as shipped (grpo first), the variants named ``<preset>@<field>=<value>`` (``variant``), and the
    shuffled-runs control where maspo_words is in."""
    shipped = discover_presets([n for n in names if n != CONTROL and "@" not in n])
    out = list(shipped) + [variant(n) for n in names if "@" in n]
    if CONTROL in names:
        (words,) = discover_presets(["maspo_words"])
        out.append(replace(words, name=CONTROL, control="shuffled"))
    return out


def preset_config(p: Preset):
    """verl's ``ActorConfig`` with our policy-loss dataclass, as the trainer instantiates it."""
    return actor_config_of(p.actor, p.policy_loss)


UNCLIPPED = "inf"
LOG_UNCLIPPED = 30.0  # a log-space bound no log-ratio reaches (verl clamps them to +-20)
RATIO_UNCLIPPED = 1e9


def scaled(p: Preset, k: float, cap: float | None = 0.999) -> Preset:
    """``p`` with its clip band (not the dual clip) scaled by ``k``: the band the loss reads, the log-space fields
    with clip_schedule=log_adaptive, else the actor's ratio-space ones (every preset's composed section carries
    the log_clip_* defaults, read or not); ``cap``: the most eps_low may reach (1 - eps_low stays above 0)."""
    actor, policy_loss = dict(p.actor), dict(p.policy_loss)
    if policy_loss.get("clip_schedule") == "log_adaptive":
        policy_loss |= {key: policy_loss[key] * k for key in ("log_clip_low", "log_clip_high")}
    else:
        low = actor["clip_ratio_low"] * k
        high = actor["clip_ratio_high"] * k
        actor |= {"clip_ratio_low": low if cap is None else min(low, cap), "clip_ratio_high": high}
    return replace(p, actor=actor, policy_loss=policy_loss)


def widen(p: Preset, width: str) -> Preset:
    """``p`` with its clip band scaled by ``width`` (``scaled``; ``inf``: no clip, the dual clip off too)."""
    if width != UNCLIPPED:
        return replace(scaled(p, float(width)), band=width)
    actor, policy_loss = dict(p.actor), dict(p.policy_loss)
    if policy_loss.get("clip_schedule") == "log_adaptive":
        policy_loss |= {k: LOG_UNCLIPPED for k in ("log_clip_low", "log_clip_high", "log_clip_dual")}
    # the ratio-space band too (some log-space losses read the dual clip from the actor)
    actor |= {"clip_ratio_low": 1.0, "clip_ratio_high": RATIO_UNCLIPPED, "clip_ratio_c": RATIO_UNCLIPPED}
    return replace(p, actor=actor, policy_loss=policy_loss, band=width)


def variant(name: str, flag: str = "--presets") -> Preset:
    """A preset with policy-loss fields changed: ``<preset>@<field>=<value>[,<field>=<value>...]`` (values as
    YAML, e.g. ``maspo_fixed@segment_window=4``), checked as the trainer checks them."""
    import yaml

    from maspo_verl.config import actor_config

    base, _, changes = name.partition("@")
    fields = {}
    for item in changes.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"{flag} {name!r}: <preset>@<field>=<value>[,...], e.g. maspo_fixed@segment_window=4")
        fields[key.strip()] = yaml.safe_load(value)
    (p,) = discover_presets([base])
    policy_loss = {**p.policy_loss, **fields}
    try:
        actor_config(**policy_loss)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"{flag} {name!r}: {exc}") from exc
    return replace(p, name=name, policy_loss=policy_loss)


def loss_call(fn, cfg, old, lp, adv, ids, words, mask=None):
    """One call of a loss as verl's ``ppo_loss`` makes it: [rows, T] tensors, the micro-batch's ids and the toy
    tasks' tokens (``tabular.vocabulary``) in scope; ``mask``: the response tokens (None: all)."""
    import torch

    from maspo_verl.batch import WORD_IDS_KEY, micro_batch_scope
    from maspo_verl.lab.engine.tabular import vocabulary

    mask = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask.bool()
    with micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, vocabulary()):
        return fn(old, lp, adv, mask, cfg.loss_agg_mode, cfg, None)
