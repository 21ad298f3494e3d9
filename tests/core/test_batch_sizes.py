"""``maspo_verl.batch_sizes.check_batch_sizes`` against verl's own batch splitting.

The reference runs the steps verl takes at the first update on a batch of the configured size, with
verl's functions: the v1 trainer's padding multiple (``PPOTrainer._get_required_batch_multiple``), the
split over data-parallel ranks (``chunk_tensordict``), the actor update's mini-batch loop
(``TrainingWorker.train_mini_batch``, on a stand-in engine) and the micro-batch split of every pass
(``prepare_micro_batches``, with dynamic batch sizes ``rearrange_micro_batches`` on sequences of the
longest allowed length). Whatever verl asserts there must be what our check reports, field by field.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from maspo_verl.batch_sizes import check_batch_sizes
from maspo_verl.validation import FieldError
from tests.helpers import compose_config

verl_utils = pytest.importorskip("verl.workers.engine.utils")
tu = pytest.importorskip("verl.utils.tensordict_utils")
engine_workers = pytest.importorskip("verl.workers.engine_workers")
trainer_base = pytest.importorskip("verl.trainer.ppo.v1.trainer_base")
padding_utils = pytest.importorskip("verl.trainer.ppo.padding_utils")

ACTOR_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
LOGPROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
REF_MICRO = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
MINI = "actor_rollout_ref.actor.ppo_mini_batch_size"
ACTOR_TOKENS = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
LOGPROB_TOKENS = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_TOKENS = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
PROMPT, RESPONSE = 64, 32


def settings(**kw) -> dict:
    base = dict(
        train=4, n=4, mini=2, micro=4, logprob_micro=8, ref_micro=8, world=1, v1=True, kl=False, bypass=False,
        dynamic=False, max_tokens=4 * (PROMPT + RESPONSE), logprob_tokens=4 * (PROMPT + RESPONSE),
        ref_tokens=4 * (PROMPT + RESPONSE),
    )  # fmt: skip
    base.update(kw)
    return base


def as_config(s: dict):
    return OmegaConf.create(
        {
            "data": {"train_batch_size": s["train"], "max_prompt_length": PROMPT, "max_response_length": RESPONSE},
            "trainer": {
                "n_gpus_per_node": s["world"],
                "nnodes": 1,
                "use_v1": s["v1"],
                "critic_warmup": 0,
                "v1": {"trainer_mode": "sync", "sync": {}},
            },
            "algorithm": {"use_kl_in_reward": False, "rollout_correction": {"bypass_mode": s["bypass"]}},
            "critic": {"enable": False, "ppo_mini_batch_size": s["mini"]},
            "actor_rollout_ref": {
                "model": {},
                "actor": {
                    "strategy": "fsdp2",
                    "ppo_mini_batch_size": s["mini"],
                    "ppo_micro_batch_size_per_gpu": s["micro"],
                    "use_dynamic_bsz": s["dynamic"],
                    "ppo_max_token_len_per_gpu": s["max_tokens"],
                    "use_kl_loss": s["kl"],
                    "ulysses_sequence_parallel_size": 1,
                },
                "rollout": {
                    "n": s["n"],
                    "log_prob_micro_batch_size_per_gpu": s["logprob_micro"],
                    "log_prob_use_dynamic_bsz": s["dynamic"],
                    "log_prob_max_token_len_per_gpu": s["logprob_tokens"],
                },
                "ref": {
                    "strategy": "fsdp2",
                    "log_prob_micro_batch_size_per_gpu": s["ref_micro"],
                    "log_prob_use_dynamic_bsz": s["dynamic"],
                    "log_prob_max_token_len_per_gpu": s["ref_tokens"],
                    "ulysses_sequence_parallel_size": 1,
                },
            },
        }
    )


def verl_validate_config_rejects(s: dict) -> bool:
    """What verl's validate_config reports before Ray (verl/utils/config.py, ActorConfig.validate): not ours."""
    return not s["dynamic"] and (s["train"] * s["n"] % s["world"] or s["train"] < s["mini"])


def _batch(size: int, lengths: list[int] | None = None) -> TensorDict:
    if lengths is None:
        return TensorDict({"x": torch.zeros(size, 1)}, batch_size=[size])
    ids = torch.nested.nested_tensor([torch.zeros(n, dtype=torch.long) for n in lengths], layout=torch.jagged)
    return TensorDict({"input_ids": ids}, batch_size=[size])


def _micro_split(data: TensorDict, dynamic: bool, micro: int, max_tokens: int) -> None:
    """verl's micro-batch split of one pass on one rank (asserts what verl asserts)."""
    data = data.clone()
    tu.assign_non_tensor(data, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=micro)
    if dynamic:
        tu.assign_non_tensor(data, max_token_len_per_gpu=max_tokens)
    verl_utils.prepare_micro_batches(data)


class _Engine:
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_size(self):
        return self.dp

    def get_data_parallel_rank(self):
        return 0

    def train_mode(self, **kwargs):
        return contextlib.nullcontext()

    def is_mp_src_rank_with_outputs(self):
        return False


def verl_rejects(s: dict) -> set[str]:
    """The fields whose pass verl's own code rejects at the first update."""
    dp, n = s["world"], s["n"]
    batch = s["train"] * n
    fake_trainer = SimpleNamespace(config=as_config(s), use_critic=False, global_steps=1)
    if s["v1"]:
        multiple = trainer_base.PPOTrainer._get_required_batch_multiple(fake_trainer, dp)
        padded = -(-batch // multiple) * multiple
    else:
        padded = batch
    pad_len = getattr(padding_utils, "SYNTHETIC_PADDING_SEQ_LEN", 2)
    lengths = [PROMPT + RESPONSE] * batch + [pad_len] * (padded - batch) if s["dynamic"] else None
    data = _batch(padded, lengths)
    try:
        ranks = tu.chunk_tensordict(data, dp)
    except AssertionError:
        return {"data.train_batch_size"}  # the legacy trainer cannot split it over the ranks
    rejected = set()
    passes = [("logprob", LOGPROB_MICRO, LOGPROB_TOKENS, s["logprob_micro"], s["logprob_tokens"])]
    if s["bypass"]:
        passes = []
    if s["kl"]:
        passes.append(("ref", REF_MICRO, REF_TOKENS, s["ref_micro"], s["ref_tokens"]))
    for (_, micro_field, tokens_field, micro, tokens), rank in itertools.product(passes, ranks):
        try:
            _micro_split(rank, s["dynamic"], micro, tokens)
        except AssertionError:
            rejected.add(tokens_field if s["dynamic"] else micro_field)

    # the actor update: verl's own mini-batch loop, each mini-batch split as the engine does (with
    # dynamic sizes, the longest sequence of the rank is in one of its mini-batches)
    def train_batch(mini):
        try:
            _micro_split(mini, s["dynamic"], s["micro"], s["max_tokens"])
        except AssertionError:
            rejected.add(ACTOR_MICRO)

    for rank in ranks if s["dynamic"] else []:
        try:
            _micro_split(rank, True, s["micro"], s["max_tokens"])
        except AssertionError:
            rejected.add(ACTOR_TOKENS)
    worker = SimpleNamespace(
        engine=_Engine(dp),
        train_batch=(lambda mini: None) if s["dynamic"] else train_batch,
        profiler=SimpleNamespace(step=lambda: None),
    )
    update = _batch(len(ranks[0]))
    tu.assign_non_tensor(update, mini_batch_size=s["mini"] * n, epochs=1, seed=0, dataloader_kwargs={})
    try:
        engine_workers.TrainingWorker.train_mini_batch(worker, update)
    except AssertionError as exc:
        rejected.add(MINI if "mini_batch_size" in str(exc) else "data.train_batch_size")
    return rejected


def our_verdict(s: dict) -> set[str]:
    try:
        check_batch_sizes(as_config(s))
    except FieldError as exc:
        return {m.group(1) for m in re.finditer(r"^  - ([\w.]+)[=\s]", str(exc), flags=re.M)}
    return set()


def _grid():
    rng = random.Random(0)
    axes = dict(
        train=[2, 3, 4, 6, 8], n=[1, 2, 4], mini=[1, 2, 4], micro=[1, 2, 3, 4, 8], logprob_micro=[2, 4, 8, 16],
        ref_micro=[3, 8], world=[1, 2, 4], v1=[True, False], kl=[False, True], bypass=[False, True],
    )  # fmt: skip
    cases = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    return [settings(**c) for c in rng.sample(cases, 400)]


def test_agrees_with_verl_split_helpers_without_dynamic_sizes():
    checked = rejected = 0
    for s in _grid():
        if verl_validate_config_rejects(s):
            continue
        expected, ours = verl_rejects(s), our_verdict(s)
        # ours names the fields of every failing pass; where the mini-batch does not split over the
        # ranks, verl stops there and so do we
        assert ours == expected, (s, expected, ours)
        checked += 1
        rejected += bool(expected)
    assert checked > 150 and 0.2 < rejected / checked < 0.9, (checked, rejected)  # both verdicts are exercised


@pytest.mark.parametrize(
    "case",
    [
        dict(max_tokens=95),  # shorter than prompt + response
        dict(max_tokens=96, logprob_tokens=96, ref_tokens=96),
        dict(logprob_tokens=50, kl=True, ref_tokens=40),
        dict(logprob_tokens=50, bypass=True),  # no old log-prob pass
        dict(world=2, train=3, n=2, mini=4),  # v1 pads 6 samples to 8
        dict(world=2, train=3, n=1, mini=1, v1=False),  # the legacy trainer cannot split 3 over 2 ranks
        dict(world=2, train=4, n=1, mini=3, v1=False),
    ],
)
def test_agrees_with_verl_split_helpers_with_dynamic_sizes(case):
    s = settings(dynamic=True, **case)
    assert our_verdict(s) == verl_rejects(s)


def test_padding_samples_count_towards_the_longest_sequence():
    """verl 0.9.1's v1 trainer pads with 128-token samples: with them, 96 tokens are not enough."""
    pad_len = getattr(padding_utils, "SYNTHETIC_PADDING_SEQ_LEN", 2)
    s = settings(dynamic=True, world=2, train=3, n=2, mini=4, max_tokens=100, logprob_tokens=100)
    expected = {ACTOR_TOKENS, LOGPROB_TOKENS} if pad_len > 100 else set()
    assert verl_rejects(s) == expected == our_verdict(s)


def test_dynamic_flags_must_agree():
    config = as_config(settings(dynamic=True))
    config.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz = False
    with pytest.raises(FieldError) as info:
        check_batch_sizes(config)
    assert info.value.field == "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"
    assert "actor_rollout_ref.actor.use_dynamic_bsz=True" in str(info.value)


def test_messages_name_the_field_the_value_and_what_is_allowed():
    with pytest.raises(FieldError) as info:
        check_batch_sizes(as_config(settings(world=2, micro=8)))
    message = str(info.value)
    assert info.value.field == ACTOR_MICRO
    assert f"{ACTOR_MICRO}=8 does not divide the 4 samples" in message and "allowed: 1, 2, 4" in message
    with pytest.raises(FieldError) as info:
        check_batch_sizes(as_config(settings(world=4, n=1, mini=2, train=8)))
    assert info.value.field == MINI and "a multiple of 4" in str(info.value)


def test_padding_is_a_warning():
    warnings = check_batch_sizes(as_config(settings(train=3)))  # 12 samples, mini-batches of 8
    assert len(warnings) == 1 and "pads every step with 4 synthetic samples" in warnings[0]
    assert check_batch_sizes(as_config(settings())) == []


def test_verl_validate_config_catches_what_we_leave_to_it():
    """The two splits verl checks before Ray (so ours does not repeat them)."""
    from verl.utils.config import validate_config

    for override in (["data.train_batch_size=3", "trainer.n_gpus_per_node=8"], ["data.train_batch_size=1"]):
        config = compose_config("local=cpu", *override)
        with pytest.raises((AssertionError, ValueError)):
            validate_config(config, use_reference_policy=False, use_critic=False)


@pytest.mark.parametrize("gpus", [1, 2])
def test_local_preset_fits_one_and_two_ranks(gpus):
    assert check_batch_sizes(compose_config("local=cpu", f"trainer.n_gpus_per_node={gpus}")) == []


@pytest.mark.parametrize(
    "overrides",
    [["loss=maspo_fixed"], ["recipe=math"], ["recipe=speech"], ["recipe=gpu"], ["local=cpu", "recipe=math"]],
)
def test_presets_and_recipes_pass(overrides):
    assert check_batch_sizes(compose_config(*overrides)) == []
