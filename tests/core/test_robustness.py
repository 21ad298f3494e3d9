"""No NaN/inf for extreme inputs; one host sync per call; bf16 inputs."""

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

from maspo_verl.batch import NO_WORD, WORD_IDS_KEY, micro_batch_scope
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.lab.studies.bench import count_host_syncs
from maspo_verl.util import config_dir, preset_names
from tests.helpers import BYTE_VOCABULARY, actor_config, random_batch


def shipped_policy_losses() -> dict[str, dict]:
    """Each loss preset of ours (hydra_configs/loss/, loss_mode a maspo_verl token set): its policy_loss section."""
    found = {}
    for name in preset_names():
        section = OmegaConf.load(config_dir() / "loss" / f"{name}.yaml").actor_rollout_ref.actor.policy_loss
        if section.loss_mode in TOKEN_SETS:
            found[name] = OmegaConf.to_container(section)
    return found


def variations(policy_loss: dict) -> dict[str, dict]:
    """Settings that matter for robustness, chosen by what a preset is (not by its name): the preset as
    shipped; short segments (many boundaries in 8..64 tokens); PPO's plain ratio clip; MASPO's
    segment-mean aggregation; CTPO's geometric mean with shrinking bounds."""
    out = {"shipped": {}, "ratio_clip": {"clip_schedule": "ratio"}}
    if policy_loss["loss_mode"] == "maspo":
        if policy_loss["segment_rule"] == "fixed":
            out["short"] = {"segment_window": 3}
        else:  # (delimiters: the codec ids are beyond the byte vocabulary in scope, so max_segment_len cuts)
            out["short"] = {"min_segment_len": 2, "max_segment_len": 6}
        out["segment_mean"] = {**out["short"], "agg_mode": "seg-mean-token-mean"}
    if policy_loss["loss_mode"] == "ctpo":
        out["geomean"] = {"ctpo_mode": "geomean", "clip_exponent": -0.5}
    return {label: {**policy_loss, **changes} for label, changes in out.items()}


PRESETS = shipped_policy_losses()
CONFIGS = {f"{name}/{label}": config for name, pl in PRESETS.items() for label, config in variations(pl).items()}


def test_every_preset_is_covered_or_verls_own():
    for name in set(preset_names()) - set(PRESETS):
        mode = OmegaConf.load(config_dir() / "loss" / f"{name}.yaml").actor_rollout_ref.actor.policy_loss.loss_mode
        assert mode in POLICY_LOSS_REGISTRY and mode not in TOKEN_SETS, (name, mode)  # verl's loss, not ours
    assert {pl["loss_mode"] for pl in PRESETS.values()} == set(TOKEN_SETS)  # every loss of ours has a preset here


def run(name, old, new, adv, mask, agg="seq-mean-token-mean"):
    return run_config(actor_config(**CONFIGS[name]), old, new, adv, mask, agg)


def run_config(config, old, new, adv, mask, agg="seq-mean-token-mean"):
    ids = 128264 + (torch.arange(mask.numel()).reshape(mask.shape) * 7919) % 65536
    # words of 3 tokens, the first row without words (tokenval fallback)
    words = (torch.arange(mask.numel()).reshape(mask.shape) % mask.shape[1]) // 3
    words[0] = NO_WORD
    with micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, BYTE_VOCABULARY):
        loss, metrics = get_policy_loss_fn(config.policy_loss.loss_mode)(old, new, adv, mask, agg, config)
    loss.backward()
    return loss, new.grad, metrics


def assert_finite(loss, grad, metrics):
    assert torch.isfinite(loss), loss
    assert torch.isfinite(grad).all()
    bad = {k: v for k, v in metrics.items() if v != v or v in (float("inf"), float("-inf"))}
    assert not bad, bad


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("shift", [50.0, -50.0])
def test_extreme_log_ratios(name, shift):
    old, new, adv, mask = random_batch(B=4, T=30, seed=11)
    new = (new.detach() + shift * torch.sign(torch.randn_like(new))).requires_grad_()
    assert_finite(*run(name, old, new, adv, mask))


@pytest.mark.parametrize("name", CONFIGS)
def test_minus_inf_old_log_probs_and_empty_rows(name):
    old, new, adv, mask = random_batch(B=5, T=12, seed=12, lengths=[12, 0, 1, 5, 0])
    old = old.clone()
    old[0, 3] = float("-inf")
    old[2, 0] = float("-inf")
    old[1, :] = float("-inf")  # fully masked row with -inf everywhere
    new = new.detach().clone()
    new[4, :] = float("-inf")  # padding may hold anything
    new.requires_grad_()
    loss, grad, metrics = run(name, old, new, adv, mask)
    assert_finite(loss, grad[mask], metrics)
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("name", CONFIGS)
def test_all_masked_batch(name):
    old, new, adv, mask = random_batch(B=3, T=8, seed=13, lengths=[0, 0, 0])
    loss, grad, metrics = run(name, old, new, adv, mask, agg="token-mean")
    assert loss.item() == 0.0
    assert_finite(loss, grad, metrics)


@pytest.mark.parametrize("name", CONFIGS)
def test_bf16_inputs_close_to_float32(name):
    old, new, adv, mask = random_batch(B=4, T=64, scale=0.05, seed=14, dtype=torch.float32)
    ref_loss, ref_grad, _ = run(name, old, new, adv, mask)
    new16 = new.detach().bfloat16().requires_grad_()
    loss, grad, metrics = run(name, old.bfloat16(), new16, adv.bfloat16(), mask)
    assert grad.dtype == torch.bfloat16
    assert_finite(loss, grad.float(), metrics)
    assert abs(loss.item() - ref_loss.item()) < 0.05 * (abs(ref_loss.item()) + 1e-2)


@pytest.mark.parametrize("name", CONFIGS)
def test_one_host_transfer_per_call(name):
    old, new, adv, mask = random_batch(B=4, T=40, seed=15)
    with count_host_syncs() as counter:
        run(name, old, new, adv, mask)
    assert counter["by"] == {"tolist": 1}, counter["by"]


def test_log_adaptive_bounds_stay_finite_at_the_widest_allowed_settings():
    """p = 1 on 300 tokens with a wide dual range: finite bounds, finite loss (p = 2 is refused)."""
    from maspo_verl.core.surrogates import SURROGATES

    old, new, adv, mask = random_batch(B=3, T=300, seed=21, lengths=[300, 150, 1])
    new = (new.detach() + 15.0).requires_grad_()
    config = actor_config(loss_mode="pgspo", clip_schedule="log_adaptive", clip_exponent=1.0, log_clip_dual=50.0)
    bounds = SURROGATES["ppo"].params(config.policy_loss, config, torch.full(mask.shape, 300.0))
    for name in ("low", "high", "dual"):  # the log-ratio's bounds
        assert torch.isfinite(bounds.scale * getattr(bounds, name)).all(), name
    loss, grad, metrics = run_config(config, old, new, adv, mask)
    assert_finite(loss, grad, metrics)
    with pytest.raises(ValueError, match="clip_exponent=2.0 is invalid"):
        actor_config(loss_mode="pgspo", clip_schedule="log_adaptive", clip_exponent=2.0)
