"""Hydra compose -> verl's omega_conf_to_dataclass -> GranularLossConfig; validation; start-up checks."""

import warnings

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from maspo_verl.config import SETTINGS, GranularLossConfig
from maspo_verl.core.segments import SEGMENT_RULES
from maspo_verl.main import check_policy_loss, dry_run
from maspo_verl.plugin.checks import run_startup_checks as startup_checks
from maspo_verl.util import preset_names
from tests.helpers import SMALL, compose_config

PRESETS = preset_names()


def actor_policy_loss(cfg):
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.policy_loss)


def test_cli_overrides_reach_our_dataclass():
    cfg = compose_config(
        "loss=maspo_logprob",
        "actor_rollout_ref.actor.policy_loss.logprob_threshold=2.5",
        "actor_rollout_ref.actor.policy_loss.max_segment_len=40",
        "actor_rollout_ref.actor.policy_loss.fsq_levels=[8,8,8,5,5,5]",
        "actor_rollout_ref.actor.policy_loss.codec_size=64000",
    )
    pl = actor_policy_loss(cfg)
    assert isinstance(pl, GranularLossConfig)
    assert (pl.loss_mode, pl.segment_rule, pl.logprob_threshold, pl.max_segment_len) == ("maspo", "logprob", 2.5, 40)
    assert pl.fsq_levels == [8, 8, 8, 5, 5, 5] and pl.codec_size == 64000
    assert pl.logprob_per_sample is True and pl.min_segment_len == 3


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_passes_verls_validation(preset, capsys):
    section = dry_run(compose_config(f"loss={preset}", *SMALL))
    assert "config valid" in capsys.readouterr().out
    expected_mode = {"grpo": "vanilla", "gspo": "gspo", "gmpo": "pgspo"}.get(preset, preset.split("_")[0])
    assert section["policy_loss"]["loss_mode"] == expected_mode


def test_preset_clip_ranges_follow_the_sources():
    gspo = compose_config("loss=gspo").actor_rollout_ref.actor
    assert (gspo.clip_ratio_low, gspo.clip_ratio_high, gspo.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    ctpo = compose_config("loss=ctpo").actor_rollout_ref.actor.policy_loss
    assert (ctpo.log_clip_low, ctpo.log_clip_high, ctpo.log_clip_dual, ctpo.clip_exponent) == (0.025, 0.05, 0.05, 0.5)
    assert ctpo.clip_schedule == "log_adaptive" and ctpo.ctpo_mode == "cumprod"
    gmpo = compose_config("loss=gmpo").actor_rollout_ref.actor.policy_loss  # the GMPO paper's (e^-0.4, e^0.4)
    assert (gmpo.surrogate, gmpo.log_clip_low, gmpo.log_clip_high, gmpo.length_exponent) == ("gmpo", 0.4, 0.4, 1.0)


def test_typo_in_field_is_rejected_at_compose():
    with pytest.raises(ConfigCompositionException, match="segmnt_rule"):
        compose_config("actor_rollout_ref.actor.policy_loss.segmnt_rule=fixed")


def test_added_unknown_field_is_rejected_by_the_dataclass_listing_the_allowed_fields():
    cfg = compose_config("+actor_rollout_ref.actor.policy_loss.segmnt_rule=fixed")
    with pytest.raises(
        Exception,
        match=r"unknown fields \['segmnt_rule'\]: did you mean `segment_rule`\?.*allowed fields:.*segment_rule",
    ) as err:
        actor_policy_loss(cfg)
    assert "position_buckets" in str(err.value)


def test_loss_mode_typo_fails_when_the_config_is_built_naming_the_registered_losses():
    with pytest.raises(ValueError, match=r"loss_mode='masp' is invalid: allowed a loss registered in verl: .*maspo"):
        GranularLossConfig(loss_mode="masp")
    cfg = compose_config("loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.loss_mode=masp")
    with pytest.raises(Exception, match="loss_mode='masp' is invalid"):
        dry_run(cfg)


def test_bare_dry_run_passes_verls_checks_with_our_defaults(capsys):
    dry_run(compose_config("loss=maspo_fixed"))
    assert "config valid" in capsys.readouterr().out


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("fsq_levels", 4, "a non-empty list of integers >= 2"),
        ("position_buckets", 1_000_000, "an integer >= 1 and <= 64"),
        ("segment_window", 2.5, "an integer >= 1"),
        ("clip_schedule", 3, "one of ratio, log_adaptive"),
    ],
)
def test_wrong_types_name_the_field(field, value, allowed):
    with pytest.raises(ValueError, match=f"policy_loss.{field}=.* is invalid: allowed {allowed}"):
        GranularLossConfig(loss_mode="maspo", **{field: value})


BAD_VALUES = [
    ("segment_rule", "window", ", ".join(SEGMENT_RULES)),
    ("segment_window", 0, "integer >= 1"),
    ("tokenval_distance", "l2", "id, fsq_l1, fsq_hamming"),
    ("tokenval_threshold", -1.0, ">= 0"),
    ("codec_size", 1000, "product equals policy_loss.codec_size"),
    ("fsq_levels", [4, 1], "integers >= 2"),
    ("min_segment_len", -2, "integer >= 0"),
    ("max_segment_len", 2, ">= min_segment_len"),
    ("length_exponent", 1.5, "<= 1"),
    ("clip_exponent", 2.0, ">= -1.0 and <= 1.0"),
    ("ctpo_mode", "prod", "cumprod, geomean"),
    ("clip_schedule", "log", "ratio, log_adaptive"),
    ("log_clip_low", 0.0, "> 0"),
    ("log_clip_high", float("nan"), "finite"),
    ("agg_mode", "seg-mean", "actor, seg-mean-token-mean"),
    ("position_buckets", 0, "integer >= 1"),
    ("logprob_per_sample", "yes", "true or false"),
]


@pytest.mark.parametrize("field,value,allowed", BAD_VALUES)
def test_out_of_range_values_name_the_field_and_the_allowed_values(field, value, allowed):
    kwargs = {"min_segment_len": 3} if field == "max_segment_len" else {}
    with pytest.raises(ValueError) as err:
        GranularLossConfig(loss_mode="maspo", **kwargs, **{field: value})
    assert f"policy_loss.{field}=" in str(err.value)
    assert allowed in str(err.value)


def test_bad_value_from_the_cli_fails_when_verl_builds_the_actor_config():
    cfg = compose_config("loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.segment_window=0", *SMALL)
    with pytest.raises(Exception, match="segment_window"):
        dry_run(cfg)


def test_ctpo_rejects_segment_aggregation():
    with pytest.raises(ValueError, match="agg_mode"):
        GranularLossConfig(loss_mode="ctpo", agg_mode="seg-mean-token-mean")


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"surrogate": "clipped"}, r"policy_loss.surrogate='clipped' is invalid: allowed one of ppo, cispo, sapo"),
        ({"loss_mode": "vanilla", "surrogate": "cispo"}, r"surrogate='cispo' is invalid: allowed 'ppo' with loss_mode"),
        (
            {"surrogate": "sapo", "clip_schedule": "log_adaptive"},
            r"clip_schedule='log_adaptive' is invalid: allowed ratio with surrogate='sapo'",
        ),
        ({"surrogate": "dro"}, r"policy_loss.dro_beta=None is invalid: allowed a number > 0 with surrogate='dro'"),
        ({"surrogate": "dro", "dro_beta": 0.0}, r"policy_loss.dro_beta=0.0 is invalid: allowed a finite number > 0"),
        ({"surrogate": "dro", "dro_beta": -1.0}, r"policy_loss.dro_beta=-1.0 is invalid: allowed a finite number > 0"),
        (
            {"surrogate": "dro", "dro_beta": 1.0, "clip_schedule": "log_adaptive"},
            r"clip_schedule='log_adaptive' is invalid: allowed ratio with surrogate='dro'",
        ),
    ],
)
def test_surrogate_refuses_what_makes_no_sense(fields, message):
    with pytest.raises(ValueError, match=message):
        GranularLossConfig(**{"loss_mode": "maspo", **fields})


def test_every_surrogate_composes_with_every_preset_of_ours_where_its_schedule_allows():
    """``loss=<preset> policy_loss.surrogate=<s>`` builds for our presets, e.g. maspo_fixed + cispo (the
    documented override); SAPO also needs clip_schedule=ratio there."""
    from maspo_verl.core.surrogates import SURROGATES
    from maspo_verl.core.token_sets import TOKEN_SETS

    built = 0
    for preset in PRESETS:
        # composed once a preset: the override sets one field of it
        pl = compose_config(f"loss={preset}").actor_rollout_ref.actor.policy_loss
        if pl.loss_mode not in TOKEN_SETS:
            continue
        schedule = pl.clip_schedule
        for name, surrogate in SURROGATES.items():
            pl.surrogate, pl.clip_schedule = name, schedule
            for key, value in surrogate.requires.items():  # verl's fields without a default (dro's dro_beta)
                pl[key] = value
            if surrogate.clip_schedules is not None and schedule not in surrogate.clip_schedules:
                with pytest.raises(Exception, match="clip_schedule=.log_adaptive. is invalid"):
                    omega_conf_to_dataclass(pl)
                pl.clip_schedule = surrogate.clip_schedules[0]
            assert omega_conf_to_dataclass(pl).surrogate == name
            built += 1
    assert built >= len(SURROGATES) * 3


def test_sapo_needs_positive_temperatures_at_start_up():
    sapo = (
        "actor_rollout_ref.actor.policy_loss.surrogate=sapo",
        "actor_rollout_ref.actor.policy_loss.clip_schedule=ratio",
    )
    assert startup_checks(compose_config("loss=maspo_fixed", *sapo)) == []
    with pytest.raises(
        ValueError, match=r"actor_rollout_ref.actor.tau_neg=0.0 is invalid: allowed a finite number > 0"
    ):
        startup_checks(compose_config("loss=maspo_fixed", *sapo, "actor_rollout_ref.actor.tau_neg=0.0"))


def test_dro_beta_is_refused_at_start_up_when_missing_or_not_positive():
    """``surrogate=dro`` reads verl's own ``policy_loss.dro_beta``: the composed config fails where verl builds it,
    which the start-up does before anything starts (``check_policy_loss``)."""
    dro = ("loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.surrogate=dro")
    ratio = "actor_rollout_ref.actor.policy_loss.clip_schedule=ratio"
    allowed = r" is invalid: allowed a finite number > 0"
    for extra, message in [
        ((), r"policy_loss.dro_beta=None is invalid: allowed a number > 0 with surrogate='dro'"),
        (("actor_rollout_ref.actor.policy_loss.dro_beta=0",), r"policy_loss.dro_beta=0" + allowed),
        (("actor_rollout_ref.actor.policy_loss.dro_beta=-0.5",), r"policy_loss.dro_beta=-0.5" + allowed),
        (("actor_rollout_ref.actor.policy_loss.dro_beta=nan",), r"policy_loss.dro_beta=nan" + allowed),
        (("actor_rollout_ref.actor.policy_loss.dro_beta=abc",), r"policy_loss.dro_beta='abc'" + allowed),
    ]:
        with pytest.raises(Exception, match=message):
            omega_conf_to_dataclass(compose_config(*dro, ratio, *extra).actor_rollout_ref.actor.policy_loss)
        with pytest.raises(Exception, match=message):
            check_policy_loss(compose_config(*dro, ratio, *extra))
    built = compose_config(*dro, ratio, "actor_rollout_ref.actor.policy_loss.dro_beta=0.5")
    check_policy_loss(built)
    assert omega_conf_to_dataclass(built.actor_rollout_ref.actor.policy_loss).dro_beta == 0.5


@pytest.mark.parametrize("surrogate", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize(
    "field,value",
    [("clip_ratio_low", 0.0), ("clip_ratio_high", -0.1), ("clip_ratio_high", "nan"), ("clip_ratio_c", 0.0)],
)
def test_dppo_divergence_bounds_are_checked_at_start_up(surrogate, field, value):
    """DPPO reads the actor's clip_ratio_low/high as divergence bounds and clip_ratio_c as the truncation: > 0."""
    chosen = ("loss=maspo_fixed", f"actor_rollout_ref.actor.policy_loss.surrogate={surrogate}")
    ratio = "actor_rollout_ref.actor.policy_loss.clip_schedule=ratio"
    assert startup_checks(compose_config(*chosen, ratio)) == []
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.actor.{field}={value} is invalid: allowed a finite"):
        startup_checks(compose_config(*chosen, ratio, f"actor_rollout_ref.actor.{field}={value}"))


@pytest.mark.parametrize("surrogate", ["dppo_tv", "dppo_kl"])
def test_dppo_bounds_fall_back_to_clip_ratio_and_log_space_bounds_are_checked(surrogate):
    """Without clip_ratio_low the ratio schedule's bound is verl's clip_ratio, named where it is invalid; on the
    log_adaptive schedule the divergence bounds are log_clip_low/high and the truncation log_clip_dual: > 0."""
    chosen = ("loss=maspo_fixed", f"actor_rollout_ref.actor.policy_loss.surrogate={surrogate}")
    ratio = "actor_rollout_ref.actor.policy_loss.clip_schedule=ratio"
    unset = ("actor_rollout_ref.actor.clip_ratio_low=null", "actor_rollout_ref.actor.clip_ratio=0")
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.clip_ratio=0 is invalid: allowed a finite number"):
        startup_checks(compose_config(*chosen, ratio, *unset))
    for field in ("log_clip_low", "log_clip_high", "log_clip_dual"):
        with pytest.raises(Exception, match=rf"policy_loss.{field}=0 is invalid: allowed a finite number > 0"):
            check_policy_loss(compose_config(*chosen, f"actor_rollout_ref.actor.policy_loss.{field}=0"))


def test_our_loss_without_our_dataclass_is_a_startup_error():
    cfg = compose_config(
        "loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig"
    )
    with pytest.raises(ValueError, match="_target_=maspo_verl.config.GranularLossConfig"):
        startup_checks(cfg)


@pytest.mark.parametrize(
    "preset,extra,warns",
    [
        ("grpo", [], True),
        ("maspo_fixed", ["actor_rollout_ref.actor.policy_loss.segment_window=1"], True),
        ("maspo_fixed", [], False),
        ("gspo", [], False),
        ("ctpo", [], False),
    ],
)
def test_bypass_mode_with_token_level_loss_warns(preset, extra, warns):
    cfg = compose_config(f"loss={preset}", "algorithm.rollout_correction.bypass_mode=true", *extra)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        issued = startup_checks(cfg)
    assert bool(issued) == warns
    assert not startup_checks(compose_config(f"loss={preset}", *extra))


def test_yaml_lists_every_field_at_its_dataclass_default():
    from dataclasses import fields

    from verl.workers.config import PolicyLossConfig

    ours = {f.name for f in fields(GranularLossConfig)} - {f.name for f in fields(PolicyLossConfig)}
    cfg = compose_config("~loss")
    section = OmegaConf.to_container(cfg.actor_rollout_ref.actor.policy_loss)
    default = GranularLossConfig()
    assert {name: section[name] for name in ours} == {name: getattr(default, name) for name in ours}


def test_default_trainer_uses_grpo_advantages_and_our_target():
    cfg = compose_config()
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.actor.policy_loss._target_ == "maspo_verl.config.GranularLossConfig"
    assert OmegaConf.select(cfg, "maspo.local") is None


def test_span_credit_preset_with_the_speech_recipe_passes_start_up():
    # models this machine has: start-up also checks that every model the reward loads resolves here
    rk = "+reward.custom_reward_function.reward_kwargs"
    here = [f"{rk}.codec=frame_table", f"{rk}.asr_model=bundled:tiny.en", f"{rk}.asr_device=cpu"]
    cfg = compose_config("recipe=speech", "credit=span", *here)
    assert cfg.algorithm.adv_estimator == "maspo_span_grpo" and cfg.algorithm.span_credit.lam == 0.5
    assert cfg.reward.custom_reward_function.reward_kwargs.token_scores is True
    assert startup_checks(cfg) == []


@pytest.mark.parametrize(
    "overrides,error",
    [
        (["trainer.use_v1=false"], "token_scores=true needs trainer.use_v1=true"),
        (["reward.reward_model.enable=true"], "needs the reward computed in the agent loop"),
        (["algorithm.span_credit.lam=nan"], r"algorithm.span_credit.lam=nan is invalid: allowed a finite number"),
        (["+reward.custom_reward_function.reward_kwargs.span_penalty=-1"], "span_penalty=-1 is invalid"),
        (
            ["+reward.custom_reward_function.reward_kwargs.span_weight=1"],
            r"reward_kwargs has unknown keys \['span_weight'\]",
        ),
    ],
)
def test_span_credit_config_errors_surface_at_start_up(overrides, error):
    cfg = compose_config("recipe=speech", "credit=span", *overrides)
    with pytest.raises((ValueError, RuntimeError), match=error):
        startup_checks(cfg)


def test_span_credit_without_per_token_scores_warns_that_it_is_grpo():
    cfg = compose_config("algorithm.adv_estimator=maspo_span_grpo")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        issued = startup_checks(cfg)
    assert len(issued) == 1 and "gives verl's grpo advantages" in issued[0]


def bad_values(allowed) -> list:
    """Values each kind of declared ``Allowed`` must refuse (a new kind must be added here)."""
    from maspo_verl import validation as v

    if isinstance(allowed, v.Int):
        return [allowed.minimum - 1, 2.5, True] + ([allowed.maximum + 1] if allowed.maximum is not None else [])
    if isinstance(allowed, v.Float):
        return [float("nan"), "1.0", allowed.hi + 1 if allowed.hi != float("inf") else float("inf")] + (
            [allowed.lo] if allowed.lo_open else ([allowed.lo - 1] if allowed.lo != -float("inf") else [])
        )
    if isinstance(allowed, v.Bool):
        return ["yes", 1]
    if isinstance(allowed, v.Choice):
        return ["no-such-choice", 3]
    if isinstance(allowed, v.Strings):
        return ["a string", [""], [1]]
    if isinstance(allowed, v.Ints):
        return [[], [allowed.minimum - 1], "4"]
    if isinstance(allowed, v.OptionalPath):
        return ["  ", 3]
    raise AssertionError(f"no bad values known for {type(allowed).__name__}: add them to bad_values()")


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_declared_setting_refuses_bad_values_naming_itself_and_the_allowed_ones(setting):
    assert GranularLossConfig(loss_mode="maspo", **{setting.name: setting.default}) is not None
    for value in bad_values(setting.allowed):
        with pytest.raises(ValueError) as err:
            GranularLossConfig(loss_mode="maspo", **{setting.name: value})
        assert str(err.value).startswith(f"policy_loss.{setting.name}="), (value, str(err.value))
        assert setting.allowed.text in str(err.value), (value, str(err.value))
