"""End-to-end: the trainer features real runs use, in the local CPU mode (verl's real trainer on CPU).

- two data-parallel workers (FSDP2 on gloo) with the local preset's batch settings (no batch override)
  and ``seg-mean-token-mean``;
- reference policy + KL loss, dynamic micro-batch sizes (actor, log-prob and reference passes),
  validation before and during training, a checkpoint at every step;
- resume (``trainer.resume_mode=auto``) from the step-1 checkpoint of that run, in a fresh folder: the
  weights the resumed trainer holds right after loading (as it syncs them to the rollout) equal the
  saved ones, the step counter continues at 2, and the optimizer, scheduler and data-loader states it
  saves after step 2 match those of the uninterrupted run's step 2.

Three trainer runs, ~1-2 min each on 2 cores.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from maspo_verl.local.hf_rollout import WEIGHTS_DUMP_ENV

pytestmark = pytest.mark.e2e

RESPONSE_LEN = 16
COMMON = [f"data.max_response_length={RESPONSE_LEN}", "actor_rollout_ref.rollout.ignore_eos=true"]


def _check_trained(run, steps: list[int]) -> str:
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    trained = sorted(s for s, m in run.steps.items() if "actor/pg_loss" in m)
    assert trained == steps, f"trained steps {trained}{context}"
    for step in steps:
        metrics = run.steps[step]
        assert math.isfinite(metrics["actor/pg_loss"]), context
        assert math.isfinite(metrics["actor/grad_norm"]), context
    assert run.some_step_had_a_gradient, context
    return context


@pytest.mark.slow
def test_two_data_parallel_workers(local_run):
    """``local=cpu trainer.n_gpus_per_node=2`` with the preset's batch settings: two FSDP ranks (the private
    Ray cluster gets two logical GPUs) each take half of every mini-batch; MASPO with seg-mean-token-mean."""
    run = local_run(
        COMMON
        + [
            "loss=maspo_fixed",
            "actor_rollout_ref.actor.policy_loss.segment_window=4",
            "actor_rollout_ref.actor.policy_loss.agg_mode=seg-mean-token-mean",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
        ]
    )
    context = _check_trained(run, [1, 2])
    workers = set(re.findall(r"\(WorkerDict pid=(\d+)\)", run.full_log))
    assert len(workers) == 2, f"trainer workers {workers}{context}"
    # torch.distributed names the second rank, in a line Ray's log de-duplication holds back (rank 0 printed
    # the same one): the session disconnects from Ray before its closing block, which prints it into run.log
    assert "[rank1]" in run.full_log, context
    for metrics in run.steps.values():
        assert metrics["actor/ratio/segment_len_mean"] == pytest.approx(4, abs=1e-4), context


def _model(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}


def _dumps(folder: Path) -> list[Path]:
    return sorted(folder.glob("sync*_step*.pt"), key=lambda p: int(re.match(r"sync(\d+)", p.name).group(1)))


def _optimizer_steps(path: Path) -> list[float]:
    state = torch.load(path, map_location="cpu", weights_only=False)["state"]
    return [float(s["step"]) for s in state.values()]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def test_kl_validation_checkpoint_and_resume(local_run, tmp_path, monkeypatch):
    features = [
        # segments where the old policy's log-prob drops (old log-probs split across dynamic micro-batches)
        "loss=maspo_logprob",
        # dynamic micro-batches of at most two sequences (prompt <= 64 + response 16 tokens)
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=160",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=160",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "trainer.val_before_train=true",
        "trainer.test_freq=1",
        "trainer.save_freq=1",
        "trainer.total_training_steps=2",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    monkeypatch.setenv(WEIGHTS_DUMP_ENV, str(tmp_path / "dump_full"))
    run = local_run(COMMON + features + [f"trainer.default_local_dir={full}"])
    context = _check_trained(run, [1, 2])

    # reference policy + KL loss. Step 1 starts at the reference, so its KL is 0 or tiny (it is 0 when the
    # first mini-batch's advantages are all 0, as the toy reward often gives); step 2 starts from the
    # step-1 weights, which differ from the reference (checked below), so its KL is positive.
    for step in (1, 2):
        assert run.steps[step]["actor/kl_coef"] == pytest.approx(0.1), context
    assert 0 <= run.steps[1]["actor/kl_loss"] < run.steps[2]["actor/kl_loss"] < 1, context
    for step in (1, 2):
        assert 1.0 <= run.steps[step]["actor/ratio/segments_per_seq"] <= RESPONSE_LEN, context
    # validation before training (step 0) and after every step
    val = "val-core/maspo_local_toy/acc/mean@1"
    assert all(val in run.steps[s] for s in (0, 1, 2)), context
    assert (full / "latest_checkpointed_iteration.txt").read_text().strip() == "2", context

    # the rollout of step 2 used the step-1 weights, which are the ones saved at step 1
    saved = _model(full / "global_step_1/actor/model_world_size_1_rank_0.pt")
    synced = [torch.load(p) for p in _dumps(tmp_path / "dump_full")]
    initial = synced[0]
    assert _same(synced[1], saved), "the step-1 checkpoint is not what the trainer trained step 2 from"
    assert not _same(initial, saved)  # step 1 changed the weights

    # resume from the step-1 checkpoint, in a fresh folder
    shutil.copytree(full / "global_step_1", resumed / "global_step_1")
    (resumed / "latest_checkpointed_iteration.txt").write_text("1")
    monkeypatch.setenv(WEIGHTS_DUMP_ENV, str(tmp_path / "dump_resumed"))
    again = local_run(
        COMMON
        + features
        + [f"trainer.default_local_dir={resumed}", "trainer.resume_mode=auto", "trainer.val_before_train=false"]
    )
    context = _check_trained(again, [2])  # the step counter continues: step 2 only
    assert f"Resuming from {resumed / 'global_step_1'}" in again.log, context
    loaded = torch.load(_dumps(tmp_path / "dump_resumed")[0])
    assert _same(loaded, saved), f"weights right after loading differ from the saved ones{context}"
    assert (resumed / "latest_checkpointed_iteration.txt").read_text().strip() == "2", context

    # optimizer, LR scheduler and data position continue where the saved run was
    one = _optimizer_steps(full / "global_step_1/actor/optim_world_size_1_rank_0.pt")
    two = _optimizer_steps(full / "global_step_2/actor/optim_world_size_1_rank_0.pt")
    after = _optimizer_steps(resumed / "global_step_2/actor/optim_world_size_1_rank_0.pt")
    assert after == two and two == [2 * s for s in one] and min(one) > 0, (one, two, after)
    extra = "actor/extra_state_world_size_1_rank_0.pt"
    assert _same(
        torch.load(resumed / "global_step_2" / extra, weights_only=False)["lr_scheduler"],
        torch.load(full / "global_step_2" / extra, weights_only=False)["lr_scheduler"],
    )
    data_full = torch.load(full / "global_step_2/data.pt", weights_only=False)
    data_resumed = torch.load(resumed / "global_step_2/data.pt", weights_only=False)
    assert data_full["_num_yielded"] == 2
    assert _same(data_resumed, data_full), (data_resumed, data_full)
