"""hydra_configs/maspo_megatron_trainer.yaml: verl's ppo_megatron_trainer + our presets, in step
with maspo_trainer.yaml, and every loss preset composes and validates on it."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from maspo_verl.util import config_dir, preset_names
from tests.math.conftest import compose

PRESETS = preset_names()
VALID = [
    "actor_rollout_ref.model.path=/nonexistent/model",  # validate_config opens nothing
    "maspo.preflight=off",  # the config, not this machine (no GPUs, no data)
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
]


def _defaults(name: str) -> list:
    return yaml.safe_load((config_dir() / name).read_text())["defaults"]


def test_in_step_with_maspo_trainer():
    ours, megatron = _defaults("maspo_trainer.yaml"), _defaults("maspo_megatron_trainer.yaml")
    assert ours[0] == "ppo_trainer" and megatron[0] == "ppo_megatron_trainer"
    assert megatron[1:] == ours[1:]


def test_matches_verl_megatron_outside_our_keys():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    ours = compose("maspo_megatron_trainer", ["loss=grpo"])
    with initialize_config_module("verl.trainer.config", version_base=None):
        verl = hydra_compose("ppo_megatron_trainer")
    assert ours.actor_rollout_ref.actor.strategy == verl.actor_rollout_ref.actor.strategy == "megatron"
    mine = OmegaConf.to_container(ours.actor_rollout_ref.actor.megatron)
    assert mine == OmegaConf.to_container(verl.actor_rollout_ref.actor.megatron)
    # maspo_base.yaml sets the micro-batch sizes verl leaves unset (a bare run passes verl's checks)
    rollout = OmegaConf.to_container(ours.actor_rollout_ref.rollout)
    assert rollout.pop("log_prob_micro_batch_size_per_gpu") == 8
    assert verl.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu is None
    verl_rollout = OmegaConf.to_container(verl.actor_rollout_ref.rollout)
    verl_rollout.pop("log_prob_micro_batch_size_per_gpu")
    assert rollout == verl_rollout


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_validates_on_megatron(preset, capsys):
    from maspo_verl.main import run

    cfg = compose("maspo_megatron_trainer", [f"loss={preset}", "maspo.dry_run=true", *VALID])
    run(cfg)
    out = capsys.readouterr().out
    assert "All configuration checks passed" in out
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    assert cfg.actor_rollout_ref.actor.policy_loss._target_ == "maspo_verl.config.GranularLossConfig"
