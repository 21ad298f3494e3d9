"""Part 2's H2 offset arm (lab/word_grid.py): ``maspo_words`` fed the frame grid's word ids shifted by N frames;
at N = 0 it is the fixed window of L / 4 exactly, at N = 12 its boundaries sit mid-word; ``lab learn`` composes
the arm's trainer config and its reward manager returns the grid's ids with the learn task's score."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from maspo_verl.batch import WORD_IDS_KEY
from maspo_verl.lab.engine import word_grid
from maspo_verl.lab.engine.cells import Cell
from maspo_verl.lab.engine.presets import discover_presets, loss_call, preset_config
from maspo_verl.lab.studies import learn
from maspo_verl.local import learn_tasks as lt
from tests.helpers import compose_config
from tests.lab.test_learn_axes import _args

ARM = "maspo_words~offset12"


def test_grid_word_ids_by_hand():
    assert word_grid.grid_word_ids(96, 12) == [0] * 12 + [1] * 24 + [2] * 24 + [3] * 24 + [4] * 12
    assert word_grid.grid_word_ids(96, 0) == [t // 24 for t in range(96)]
    assert word_grid.grid_word_ids(12, 1) == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_names_are_checked():
    assert word_grid.split(ARM) == ("maspo_words", 12) and word_grid.split("maspo_words") == ("maspo_words", None)
    for bad in ("maspo_fixed~offset12", "maspo_words~offsetx", "maspo_words~offset-1"):
        with pytest.raises(SystemExit, match="allowed maspo_words~offsetN"):
            learn.check_losses([bad])
    learn.check_losses([ARM, f"{ARM}+span"])
    assert learn.parse_bands([f"{ARM}=inf"]) == {ARM: "inf"}
    assert learn.band_overrides(ARM, "inf") == learn.band_overrides("maspo_words", "inf")  # the report names the arm


def _loss(preset, words):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    gen = torch.Generator().manual_seed(0)
    old = -2 + 0.5 * torch.randn(4, 96, generator=gen, dtype=torch.float64)
    lp = old + 0.1 * torch.randn(4, 96, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 96)
    ids = torch.randint(0, 256, (4, 96), generator=gen)
    return loss_call(get_policy_loss_fn(preset.loss_mode), preset_config(preset), old, lp, adv, ids, words)


def test_offset_zero_is_the_window_of_a_word_and_twelve_is_not():
    from maspo_verl.lab.engine.presets import variant

    words = discover_presets(["maspo_words"])[0]
    window = variant("maspo_fixed@segment_window=24")
    grid = {n: torch.tensor([word_grid.grid_word_ids(96, n)] * 4) for n in (0, 12)}
    aligned, fixed = _loss(words, grid[0]), _loss(window, torch.full((4, 96), -1))
    torch.testing.assert_close(aligned[0], fixed[0], rtol=0, atol=1e-12)
    offset = _loss(words, grid[12])
    assert abs(float(offset[0] - fixed[0])) > 1e-6
    assert offset[1]["actor/ratio/segment_len_mean"] == pytest.approx(96 / 5)
    assert aligned[1]["actor/ratio/segment_len_mean"] == pytest.approx(24)


def test_lab_learn_composes_the_arm():
    data = {"train": "t.parquet", "val": "v.parquet", "sentence": "ka lo mi nu", "model": "m"}
    args = _args("--bypass", "--fp32-trainer", "--no-adjust", "--bands", f"{ARM}=inf")
    ov = learn.overrides_for(args, "speechwarm", ARM, 300, data, Cell(96, "none", 1))
    plain = learn.overrides_for(args, "speechwarm", "maspo_words", 300, data, Cell(96, "none", 1))
    assert "reward.reward_manager.name=LearnRewardManager" in plain and not [o for o in plain if "grid" in o]
    config = compose_config(
        "local=cpu", *(o for o in ov if not o.startswith(("data.", "actor_rollout_ref.model.path")))
    )
    assert config.reward.reward_manager.name == "GridWordsRewardManager"
    assert config.reward.reward_manager.module.path == word_grid.__file__
    assert config.reward.reward_kwargs.word_grid_offset == 12
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    assert policy_loss.segment_rule == "words"
    unclipped = learn.band_overrides("maspo_words", "inf")  # --bands names the arm: its band is opened
    assert unclipped and set(unclipped) <= set(ov)
    with pytest.raises(SystemExit, match="word grid"):
        learn.overrides_for(args, "turns2", ARM, 300, {"overrides": ["task=turns"]}, Cell(96, "none", 1))


def _data(rows, sentence):
    from verl import DataProto

    responses = torch.tensor(rows)
    return DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(len(rows), 4, dtype=torch.long),
            "responses": responses,
            "attention_mask": torch.ones(len(rows), 4 + responses.shape[1], dtype=torch.long),
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": sentence}] * len(rows), dtype=object),
            "data_source": np.array([lt.DATA_SOURCE.format(task=lt.WARM)] * len(rows), dtype=object),
        },
    )


def test_manager_returns_the_grid_and_the_tasks_score():
    # "ka lo mi nu" held 24 frames each, the third word wrong for 6 frames
    row = [0] * 24 + [64] * 24 + [128] * 18 + [0] * 6 + [192] * 24
    data = _data([row], "ka lo mi nu")
    config = OmegaConf.create({"reward": {"reward_kwargs": {word_grid.KWARG: 12}}})
    mine = asyncio.run(word_grid.GridWordsRewardManager(config, None).run_single(data[0:1]))
    theirs = asyncio.run(lt.LearnRewardManager(config, None).run_single(data[0:1]))
    assert mine["reward_extra_info"][WORD_IDS_KEY] == word_grid.grid_word_ids(96, 12)
    assert theirs["reward_extra_info"][WORD_IDS_KEY] == [0] * 24 + [1] * 24 + [2] * 18 + [3] * 6 + [4] * 24
    assert mine["reward_score"] == theirs["reward_score"] == pytest.approx(1 - 1 / 5)
    with pytest.raises(ValueError, match="reward_kwargs.word_grid_offset"):
        asyncio.run(word_grid.GridWordsRewardManager(OmegaConf.create({"reward": {}}), None).run_single(data[0:1]))
