"""policy_loss.inspect_dir: what the loss writes on inspected steps, checked against values computed here
from the same inputs; nothing extra (no op, no host transfer) when off or on other steps; one transfer
on an inspected step; every preset writes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from verl.trainer.ppo.core_algos import get_policy_loss_fn

import maspo_verl.plugin  # noqa: F401  (registers our losses, wraps verl's)
from maspo_verl import inspection
from maspo_verl.batch import WORD_IDS_KEY, Update, micro_batch_scope, update_scope
from maspo_verl.config import GranularLossConfig
from maspo_verl.lab.studies.bench import VOCABULARY, count_host_syncs, entry_config, make_inputs, preset_entries
from maspo_verl.plugin import hooks
from maspo_verl.util import preset_names
from tests.helpers import actor_config, compose_config

B, T = 6, 48


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(B, T, torch.float32, "cpu", seed=3)


def call(cfg, inputs, step: int):
    """One loss call (and backward) in verl's update ``step``, micro-batch in scope; returns the metrics."""
    old, new, adv, mask, ids, words = inputs
    lp = new.detach().clone().requires_grad_()
    with update_scope(Update(step)), micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, VOCABULARY):
        loss, metrics = get_policy_loss_fn(cfg.policy_loss.loss_mode)(old, lp, adv, mask, cfg.loss_agg_mode, cfg, None)
    loss.backward()
    return metrics


def read(folder, step: int) -> dict:
    with open(folder / inspection.file_name(step)) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "field,value,allowed", [("inspect_dir", "", "null (off) or a folder path"), ("inspect_every", 0, ">= 1")]
)
def test_bad_inspect_settings_name_the_field(field, value, allowed):
    with pytest.raises(ValueError) as err:
        GranularLossConfig(loss_mode="maspo", **{field: value})
    assert f"policy_loss.{field}=" in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("loss_mode", ["maspo", "vanilla"])
def test_off_and_uninspected_steps_add_no_op_and_no_transfer(loss_mode, inputs, tmp_path):
    """The same aten ops and host transfers with inspect_dir unset and on a step that is not inspected;
    an inspected step adds exactly one transfer (verl's vanilla: 3 item() of its own, and one tolist of the ratio
    correlation the wrapper adds, as our losses report it in their one transfer)."""
    extra = {"segment_rule": "tokenval", "min_segment_len": 3} if loss_mode == "maspo" else {}
    off = actor_config(loss_mode=loss_mode, **extra)
    on = actor_config(loss_mode=loss_mode, inspect_dir=str(tmp_path), inspect_every=2, **extra)
    call(off, inputs, 1)  # warm-up: first-use caches (FSQ tables) build their own tensors
    counts = {}
    for name, cfg, step in (("off", off, 1), ("other step", on, 1), ("inspected", on, 2)):
        with count_host_syncs() as syncs, OpCounter() as ops:
            call(cfg, inputs, step)
        counts[name] = (syncs["by"], ops.ops)
    assert counts["other step"] == counts["off"]
    base = {"item": 3, "tolist": 1} if loss_mode == "vanilla" else {"tolist": 1}
    assert counts["off"][0] == base
    assert counts["inspected"][0] == {**base, "tolist": base.get("tolist", 0) + 1}
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002.json"]


def test_maspo_file_holds_the_inputs_segments_and_their_ratios(inputs, tmp_path):
    """The first rows' ids, words, mask and log-probs as given; each segment's ratio is
    exp(mean of lp - old over its tokens) and its clip counts follow the log-adaptive bounds
    exp(+-0.2 / sqrt(n)) (computed here in float64 from the file's own numbers)."""
    old, new, adv, mask, ids, words = inputs
    cfg = actor_config(
        loss_mode="maspo", segment_rule="tokenval", min_segment_len=3, clip_schedule="log_adaptive",
        log_clip_low=0.2, log_clip_high=0.2, log_clip_dual=1.0986, clip_exponent=-0.5,
        inspect_dir=str(tmp_path), inspect_every=1,
    )  # fmt: skip
    new = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))  # clips happen
    call(cfg, (old, new, adv, mask, ids, words), 5)
    doc = read(tmp_path, 5)
    assert doc["format"] == inspection.FORMAT and doc["step"] == 5 and doc["loss_mode"] == "maspo"
    assert doc["policy_loss"]["segment_rule"] == "tokenval" and doc["policy_loss"]["min_segment_len"] == 3
    assert len(doc["responses"]) == inspection.ROWS
    clipped = 0
    for r, resp in enumerate(doc["responses"]):
        assert resp["response_ids"] == ids[r].tolist()
        assert resp["word_ids"] == words[r].tolist()
        assert resp["mask"] == mask[r].int().tolist()
        assert resp["old_log_probs"] == old[r].tolist()
        seg = resp["segments"]
        assert sum(seg["length"]) == int(mask[r].sum())
        for start, n, ratio, low, high, dual in zip(*(seg[k] for k in seg), strict=True):
            lp = new[r, start : start + n].double()
            expected = math.exp(float((lp - old[r, start : start + n].double()).mean()))
            assert ratio == pytest.approx(expected, rel=1e-5)
            a, lr = float(adv[r, 0]), math.log(ratio)
            bound, dual_bound = 0.2 / math.sqrt(n), 1.0986 / math.sqrt(n)
            if min(abs(abs(lr) - bound), abs(lr - dual_bound)) > 1e-5:  # not on a bound (round-off)
                assert high == (n if a > 0 and lr > bound else 0)
                assert low == (n if a < 0 and lr < -bound else 0)
                assert dual == (n if a < 0 and lr > dual_bound else 0)
            clipped += low + high + dual
    assert clipped > 0  # the check above saw clips


def inspected_verl_loss(name, inputs, tmp_path, **policy_loss):
    """What the inspection wrote for one call of verl's loss ``name`` at a drift of 0.3 per token."""
    old, new, adv, mask, ids, words = inputs
    new = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    cfg = actor_config(loss_mode=name, inspect_dir=str(tmp_path), inspect_every=1, **policy_loss)
    call(cfg, (old, new, adv, mask, ids, words), 1)
    doc = read(tmp_path, 1)
    assert doc["loss_mode"] == name
    return doc, old, new, adv, mask


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_verl_losses_write_their_own_ratios_and_clips(name, inputs, tmp_path):
    """verl's vanilla: a segment per token, r = exp(lp - old), clipped high where A > 0 and r > 1.28,
    low where A < 0 and r < 0.8; gspo: one segment per response, r = exp(mean(lp - old))."""
    doc, old, new, adv, mask = inspected_verl_loss(name, inputs, tmp_path)
    for r, resp in enumerate(doc["responses"]):
        n = int(mask[r].sum())
        delta = (new[r, :n] - old[r, :n]).double()
        seg = resp["segments"]
        a = float(adv[r, 0])
        if name == "vanilla":
            assert seg["length"] == [1] * n
            assert seg["ratio"] == pytest.approx(delta.exp().tolist(), rel=1e-5)
            assert seg["clip_high"] == [int(a > 0 and x > 1.28) for x in delta.exp().tolist()]
            assert seg["clip_low"] == [int(a < 0 and x < 0.8) for x in delta.exp().tolist()]
        else:
            assert seg["length"] == [n]
            assert seg["ratio"] == pytest.approx([math.exp(float(delta.mean()))], rel=1e-5)


@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_verl_cispo_and_sapo_write_their_token_ratios_and_clips(name, inputs, tmp_path):
    """verl's cispo / sapo are inspected through W = 1 with the same surrogate: a segment per token,
    r = exp(lp - old); cispo's weight clipped high where r > 1.28 whatever A, sapo's gate never saturated
    at this drift."""
    doc, old, new, adv, mask = inspected_verl_loss(name, inputs, tmp_path)
    high = 0
    for r, resp in enumerate(doc["responses"]):
        n = int(mask[r].sum())
        ratio = (new[r, :n] - old[r, :n]).double().exp().tolist()
        seg = resp["segments"]
        assert seg["length"] == [1] * n
        assert seg["ratio"] == pytest.approx(ratio, rel=1e-5)
        expected = [int(x > 1.28) for x in ratio] if name == "cispo" else [0] * n
        assert seg["clip_high"] == expected
        assert seg["clip_dual"] == [0] * n
        high += sum(expected)
    assert high > 0 or name == "sapo"


@pytest.mark.parametrize("name", ["dppo_tv", "dro"])
def test_verl_dppo_and_dro_write_their_token_ratios_and_masks(name, inputs, tmp_path):
    """verl's dppo_tv / dro are inspected through W = 1 with the same surrogate: a segment per token, r = exp(lp -
    old); dppo_tv masked high where A > 0 and the probability rose by more than 0.28 (clip_ratio_high), low where
    A <= 0 and it fell by more than 0.2; dro masks nothing."""
    doc, old, new, adv, mask = inspected_verl_loss(
        name, inputs, tmp_path, **({"dro_beta": 0.5} if name == "dro" else {})
    )
    masked = 0
    for r, resp in enumerate(doc["responses"]):
        n = int(mask[r].sum())
        change = (new[r, :n].double().exp() - old[r, :n].double().exp()).tolist()
        seg, a = resp["segments"], float(adv[r, 0])
        assert seg["length"] == [1] * n
        assert seg["ratio"] == pytest.approx((new[r, :n] - old[r, :n]).double().exp().tolist(), rel=1e-5)
        high = [int(name == "dppo_tv" and a > 0 and d > 0.28) for d in change]
        low = [int(name == "dppo_tv" and a <= 0 and d < -0.2) for d in change]
        assert seg["clip_high"] == high and seg["clip_low"] == low
        masked += sum(high) + sum(low)
    assert masked > 0 or name == "dro"


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_writes(preset, inputs, tmp_path):
    """Each shipped preset, composed as the trainer composes it, writes a file with what applies."""
    (entry,) = preset_entries([preset])
    cfg = entry_config(entry)
    object.__setattr__(cfg.policy_loss, "inspect_dir", str(tmp_path))
    object.__setattr__(cfg.policy_loss, "inspect_every", 1)
    metrics = call(cfg, inputs, 3)
    doc = read(tmp_path, 3)
    resp = doc["responses"][0]
    assert {"mask", "old_log_probs", "log_probs", "advantages", "response_ids", "word_ids"} <= set(resp)
    has_segments = entry.loss_mode in ("maspo", "pgspo", "vanilla", "gspo")
    assert ("segments" in resp) == has_segments, sorted(resp)
    if "actor/ratio/segments_per_seq" in metrics:
        assert resp["segment_ids"][int(sum(resp["mask"])) - 1] + 1 >= 1


def test_global_step_comes_from_the_update_batch():
    from tensordict import NonTensorData

    assert hooks._global_step({"global_steps": torch.tensor([7, 7, 6])}) == 7
    assert hooks._global_step({"global_steps": NonTensorData(12)}) == 12
    assert hooks._global_step({"global_steps": [3, 4]}) == 4
    assert hooks._global_step({"other": 1}) is None


def test_update_hook_puts_step_and_rank_in_scope():
    """The wrapper around verl's TrainingWorker.train_mini_batch (installed) puts the update in scope:
    verl's global step when the batch has one, else the update count; writer only on DP rank 0."""
    from verl.workers.engine_workers import TrainingWorker

    from maspo_verl.batch import current_update

    assert hooks.patch_problem("update_step") is None
    assert TrainingWorker.train_mini_batch.__maspo_original__ is not None

    class Engine:
        def __init__(self, rank):
            self.rank = rank

        def get_data_parallel_rank(self):
            return self.rank

        def is_mp_src_rank_with_outputs(self):
            return True

    class Worker:
        def __init__(self, rank):
            self.engine = Engine(rank)

    seen = hooks._with_update_scope(lambda self, data=None: current_update())
    first = seen(Worker(0), data={"global_steps": torch.tensor([41, 42])})
    assert (first.step, first.dp_rank, first.writer) == (42, 0, True)
    second = seen(Worker(1), data={})
    assert second.writer is False and second.step == first._count + 1
    assert current_update() is None


def test_startup_makes_the_folder_absolute(tmp_path, monkeypatch):
    from maspo_verl.plugin.checks import run_startup_checks

    monkeypatch.chdir(tmp_path)
    cfg = compose_config("loss=maspo_fixed", "actor_rollout_ref.actor.policy_loss.inspect_dir=dumps")
    run_startup_checks(cfg)
    assert cfg.actor_rollout_ref.actor.policy_loss.inspect_dir == str(tmp_path / "dumps")


def test_through_verls_real_ppo_loss_on_the_last_mini_batch(tmp_path):
    """verl's ppo_loss on a v1 micro-batch (nested responses): the file holds the padded response ids;
    a micro-batch verl marks as not of the step's last mini-batch (update_lr_scheduler=False) is skipped."""
    import verl.workers.utils.losses as verl_losses
    from verl.utils import tensordict_utils as tu

    from tests.core.test_verl_integration import OFFSET, v1_micro_batch

    codes = [[OFFSET + 0, OFFSET + 1, OFFSET + 900, OFFSET + 901], [OFFSET + 5, OFFSET + 7]]
    config = actor_config(segment_rule="tokenval", tokenval_distance="id", inspect_dir=str(tmp_path), inspect_every=1)
    for step, last in ((1, False), (2, True)):
        data, log_probs, _ = v1_micro_batch(codes, prompt_lens=[2, 3])
        tu.assign_non_tensor(data, update_lr_scheduler=last)
        with update_scope(Update(step)):
            verl_losses.ppo_loss(config, {"log_probs": log_probs}, data)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002.json"]
    doc = read(tmp_path, 2)
    assert [r["response_ids"] for r in doc["responses"]] == [codes[0], codes[1] + [0, 0]]
    assert [r["segments"]["length"] for r in doc["responses"]] == [[2, 2], [2]]
