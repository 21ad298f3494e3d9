"""Data-parallel invariance: the gradient after the all-reduce at world size 2 equals the world-size-1
gradient, for every loss preset and aggregation mode, with fixed and dynamic micro-batch sizes; and for
every other surrogate (``maspo_verl.core.surrogates``) on one preset of each of our token sets.

Everything on the loss path is verl's own: micro-batches come from ``prepare_micro_batches`` (fixed
size, or regrouped by token count with ``use_dynamic_bsz``, the micro-batch count agreed over the dp
group), the loss from ``verl.workers.utils.losses.ppo_loss`` (through our hook) with the
``dp_size``/``batch_num_tokens``/``global_batch_size`` the FSDP engine assigns (``forward_backward_batch``:
token count all-reduced over the dp group, ``global_batch_size`` = the mini-batch's sequences), and
verl's ``agg_loss``. Each rank holds a contiguous half of the batch, as verl's dispatch gives it;
gradients are summed over micro-batches and averaged over ranks, as FSDP's reduce-scatter does.

The "model" is a per-token-id bias: log pi(y_t) = base_t + w_t * theta[y_t] (base_t, w_t fixed per
token), so the gradient of theta collects every token's loss gradient. Two gloo processes on loopback
compute the run's cases in one spawn; the world-size-1 reference runs in the test process. By default each preset
runs at every mode with fixed and dynamic micro-batches alternating, each other surrogate at two settings
(``ci_cases``); ``--run-slow`` runs every combination.
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

from maspo_verl.core import segments
from maspo_verl.util import config_dir, preset_names

PRESETS = preset_names()
VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
SEG_MEAN = "seg-mean-token-mean"
B = 16  # sequences in the mini-batch (ppo_mini_batch_size * n)
VOCAB = 256
MICRO = 2  # ppo_micro_batch_size_per_gpu
MAX_TOKENS = 40  # ppo_max_token_len_per_gpu with use_dynamic_bsz
MAX_RESPONSE = 18
# seq-mean-token-sum-norm divides by loss_scale_factor, else by the micro-batch's padded length, which
# depends on how samples are grouped: verl asks for a constant for consistent normalisation.
LOSS_SCALE_FACTOR = MAX_RESPONSE


def cases() -> list[tuple[str, str, bool, str]]:
    """(preset, aggregation mode, dynamic micro-batches, surrogate): every preset with the surrogate it
    ships (ppo), and each other surrogate on the first preset of each of our token sets."""
    from maspo_verl.core.surrogates import DEFAULT, SURROGATES
    from maspo_verl.core.token_sets import TOKEN_SETS

    first_of_set = {}
    for preset in PRESETS:
        first_of_set.setdefault(_preset_loss_mode(preset), preset)
    runs = [(preset, DEFAULT) for preset in PRESETS]
    runs += [(first_of_set[m], s) for s in SURROGATES if s != DEFAULT for m in TOKEN_SETS if m in first_of_set]
    out = []
    for preset, surrogate in runs:
        modes = list(VERL_AGG_MODES)
        loss_mode = _preset_loss_mode(preset)
        if loss_mode in TOKEN_SETS and TOKEN_SETS[loss_mode].partition:
            modes.append(SEG_MEAN)
        for mode in modes:
            for dynamic in (False, True):
                out.append((preset, mode, dynamic, surrogate))
    return out


def ci_cases() -> set[tuple[str, str, bool, str]]:
    """The cases the default run checks (the rest are slow tests): each preset with the surrogate it ships at every
    aggregation mode, fixed and dynamic micro-batches alternating over the modes; each other surrogate at two
    settings, one of each micro-batch kind, the modes rotating over the token sets and surrogates."""
    from maspo_verl.core.surrogates import DEFAULT

    every = cases()
    keep = set()
    for i, (preset, surrogate) in enumerate(dict.fromkeys((p, s) for p, _, _, s in every)):
        modes = list(dict.fromkeys(m for p, m, _, s in every if (p, s) == (preset, surrogate)))
        if surrogate == DEFAULT:
            picks = [(mode, (k + i) % 2 == 1) for k, mode in enumerate(modes)]
        else:
            picks = [(modes[2 * i % len(modes)], False), (modes[(2 * i + 1) % len(modes)], True)]
        keep |= {(preset, mode, dynamic, surrogate) for mode, dynamic in picks}
    return keep


def running_cases() -> list[tuple[str, str, bool, str]]:
    """The cases this run checks: ``ci_cases()``, or every case with --run-slow."""
    if os.environ.get("MASPO_RUN_SLOW") == "1":  # tests/conftest.py sets it for --run-slow
        return cases()
    return [case for case in cases() if case in CI_CASES]


def _preset_loss_mode(preset: str) -> str:
    import yaml

    path = config_dir() / "loss" / f"{preset}.yaml"
    return yaml.safe_load(path.read_text())["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"]


def actor_configs() -> dict[tuple[str, str, str], object]:
    """ActorConfig per (preset, agg mode, surrogate): our trainer config without a preset, the preset's file
    merged in (what ``loss=<preset>`` does; one Hydra compose instead of seven), KL loss on (verl's
    low_var_kl)."""
    import yaml
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from maspo_verl.core.surrogates import switch_fields
    from tests.helpers import BYTE_VOCABULARY, compose_config

    base = OmegaConf.to_container(compose_config("~loss").actor_rollout_ref.actor, resolve=True)
    configs = {}
    for preset, mode, surrogate in dict.fromkeys((p, m, s) for p, m, _, s in cases()):
        path = config_dir() / "loss" / f"{preset}.yaml"
        node = OmegaConf.merge(base, yaml.safe_load(path.read_text())["actor_rollout_ref"]["actor"])
        if surrogate != node.policy_loss.surrogate:
            node.policy_loss = switch_fields(node.policy_loss, surrogate)
        if mode == SEG_MEAN:
            node.policy_loss.agg_mode = SEG_MEAN
        else:
            node.loss_agg_mode = mode
        node.loss_scale_factor = LOSS_SCALE_FACTOR
        node.ppo_micro_batch_size_per_gpu = MICRO
        node.use_kl_loss = True
        node.kl_loss_coef = 0.05
        node.kl_loss_type = "low_var_kl"
        rules = segments.rules_in_use(node.policy_loss) if node.policy_loss.loss_mode == "maspo" else ()
        if any(rule.reads_codec for rule in rules):  # byte ids as 4-digit FSQ codes
            node.policy_loss.codec_offset = 0
            node.policy_loss.codec_size = VOCAB
            node.policy_loss.fsq_levels = [4, 4, 4, 4]
        configs[preset, mode, surrogate] = omega_conf_to_dataclass(node)
        if any(segments.TOKENIZER in rule.needs for rule in rules):
            # the vocabulary's text, where verl's engine worker puts the actor's tokenizer: byte b is id b
            configs[preset, mode, surrogate].model_config = SimpleNamespace(tokenizer=BYTE_VOCABULARY)
    return configs


def test_merged_preset_equals_the_composed_one(configs):
    """The shortcut above builds what Hydra's ``loss=<preset>`` builds."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from tests.helpers import compose_config

    for preset in ("maspo_tokenval", "gspo"):
        node = compose_config(f"loss={preset}").actor_rollout_ref.actor
        node = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
        mode = node.loss_agg_mode
        node.loss_scale_factor, node.ppo_micro_batch_size_per_gpu = LOSS_SCALE_FACTOR, MICRO
        node.use_kl_loss, node.kl_loss_coef, node.kl_loss_type = True, 0.05, "low_var_kl"
        if preset == "maspo_tokenval":
            node.policy_loss.codec_offset, node.policy_loss.codec_size = 0, VOCAB
            node.policy_loss.fsq_levels = [4, 4, 4, 4]
        assert omega_conf_to_dataclass(node) == configs[preset, mode, "ppo"]


def full_batch(seed: int = 0):
    """B samples: prompt, a response of runs of codes (segments for tokenval), per-token base/weight."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(B):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(3, MAX_RESPONSE + 1, (1,), generator=g))
        run_starts = torch.randint(0, VOCAB - 4, (r,), generator=g)
        run_len = int(torch.randint(2, 5, (1,), generator=g))
        codes = run_starts[torch.arange(r) // run_len * run_len] + torch.arange(r) % run_len
        samples.append(
            {
                "prompt": torch.randint(0, VOCAB, (p,), generator=g),
                "response": codes,
                "old": -torch.rand(r, generator=g) * 3,
                "ref": -torch.rand(r, generator=g) * 3,
                "adv": torch.randn(1, generator=g).expand(r) + 0.3 * torch.randn(r, generator=g),
                "drift": 0.3 * torch.randn(r, generator=g),
                "weight": torch.rand(r, generator=g) + 0.5,
            }
        )
    return samples


def _nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def rank_data(samples, dynamic: bool):
    """One rank's TensorDict in verl's v1 layout (nested, no padding) and the engine's non-tensor info."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    ids = [torch.cat([s["prompt"], s["response"]]) for s in samples]
    data = TensorDict(
        {
            "input_ids": _nested(ids),
            "prompts": _nested(s["prompt"] for s in samples),
            "responses": _nested(s["response"] for s in samples),
            "response_mask": _nested(torch.ones(len(s["response"])) for s in samples),
            "old_log_probs": _nested(s["old"] for s in samples),
            "ref_log_prob": _nested(s["ref"] for s in samples),
            "advantages": _nested(s["adv"] for s in samples),
            # base and weight over the whole sequence, aligned with the model's (shifted) log-probs
            "base": _nested(_shifted(s, s["old"] + s["drift"]) for s in samples),
            "weight": _nested(_shifted(s, s["weight"]) for s in samples),
        },
        batch_size=[len(samples)],
    )
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=MAX_TOKENS,
        micro_batch_size_per_gpu=MICRO,
        global_batch_size=B,
    )
    return data


def _shifted(sample, values):
    """Response values at the positions the causal model predicts them from (verl's left shift)."""
    p = len(sample["prompt"])
    return torch.cat([torch.zeros(p - 1), values, torch.zeros(1)])


def gradient(config, data, dp_group=None) -> torch.Tensor:
    """Sum over verl's micro-batches of d ppo_loss / d theta on this rank (before any all-reduce)."""
    import torch.distributed as dist
    import verl.workers.utils.losses as verl_losses
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    tokens = torch.tensor(float(sum(len(r) for r in data["responses"].unbind())))
    if dp_group is not None:
        dist.all_reduce(tokens, group=dp_group)
    world = dist.get_world_size(dp_group) if dp_group is not None else 1
    tu.assign_non_tensor(data, batch_num_tokens=int(tokens.item()), dp_size=world)
    theta = torch.zeros(VOCAB, requires_grad=True)
    micro_batches, _ = prepare_micro_batches(data=data, dp_group=dp_group, same_micro_num_in_dp=True)
    assert len(micro_batches) > 1
    for mb in micro_batches:
        ids, base, weight = mb["input_ids"], mb["base"], mb["weight"]
        values = base.values() + weight.values() * theta[ids.values()]
        log_probs = torch.nested.nested_tensor_from_jagged(values, offsets=ids.offsets())
        loss, _ = verl_losses.ppo_loss(config, {"log_probs": log_probs}, mb, dp_group)
        loss.backward()
    return theta.grad.detach().clone()


def all_gradients(configs: dict, rank: int, world: int, dp_group=None) -> dict:
    samples = full_batch()
    share = B // world
    mine = samples[rank * share : (rank + 1) * share]
    out = {}
    for preset, mode, dynamic, surrogate in running_cases():
        config = configs[preset, mode, surrogate]
        out[preset, mode, dynamic, surrogate] = gradient(config, rank_data(mine, dynamic), dp_group)
    return out


def _worker(rank: int, world: int, port: int, configs: dict, result_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # verl's collectives in rearrange_micro_batches use its platform's device: the local mode's cpu one
    os.environ["VERL_PLATFORM"] = "cpu"
    from maspo_verl import local

    local.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        grads = all_gradients(configs, rank, world, dist.group.WORLD)
        for key in sorted(grads):
            dist.all_reduce(grads[key])  # FSDP's gradient reduction: the mean over ranks
            grads[key] /= world
        if rank == 0:
            torch.save(grads, result_path)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def configs():
    return actor_configs()


@pytest.fixture(scope="module")
def world2(tmp_path_factory, configs):
    import torch.multiprocessing as mp

    path = str(tmp_path_factory.mktemp("dp") / "grads.pt")
    mp.spawn(_worker, args=(2, _free_port(), configs, path), nprocs=2, join=True)
    return torch.load(path)


@pytest.fixture(scope="module")
def world1(configs):
    return all_gradients(configs, 0, 1)


CI_CASES = ci_cases()


@pytest.mark.parametrize(
    ("preset", "mode", "dynamic", "surrogate"),
    [pytest.param(*c, marks=() if c in CI_CASES else pytest.mark.slow) for c in cases()],
    ids=lambda v: str(v),
)
def test_world_size_2_gradient_equals_world_size_1(preset, mode, dynamic, surrogate, world1, world2):
    import verl.workers.utils.losses as verl_losses

    assert hasattr(verl_losses.ppo_loss, "__maspo_original__")  # through our hook
    ref, got = world1[preset, mode, dynamic, surrogate], world2[preset, mode, dynamic, surrogate]
    assert ref.abs().max() > 1e-3  # a gradient that could differ
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-6 * float(ref.abs().max()))


def test_every_surrogate_is_covered():
    from maspo_verl.core.surrogates import SURROGATES

    assert {s for *_, s in cases()} == set(SURROGATES)


def test_the_default_cases_take_every_preset_mode_surrogate_and_micro_batch_kind():
    every, kept = cases(), ci_cases()
    assert kept < set(every)
    for field in range(4):
        assert {c[field] for c in kept} == {c[field] for c in every}, field
    for preset in PRESETS:  # each preset with fixed and dynamic micro-batches
        assert {dynamic for p, _, dynamic, _ in kept if p == preset} == {False, True}, preset


def test_micro_batches_differ_between_world_sizes():
    """The comparison is not vacuous: dynamic batching groups the samples differently at each size."""
    from verl.workers.engine.utils import prepare_micro_batches

    samples = full_batch()
    whole, _ = prepare_micro_batches(data=rank_data(samples, True))
    half, _ = prepare_micro_batches(data=rank_data(samples[: B // 2], True))
    fixed, _ = prepare_micro_batches(data=rank_data(samples, False))
    assert len(fixed) == B // MICRO
    sizes = sorted(len(mb) for mb in whole)
    assert len(set(sizes)) > 1 or len(whole) != len(half)


def test_seq_mean_token_sum_norm_needs_a_constant_scale():
    """Without loss_scale_factor verl divides by each micro-batch's padded length: the gradient then
    depends on the grouping (here fixed vs dynamic micro-batches at world size 1)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from tests.helpers import compose_config

    actor = compose_config("loss=grpo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm")
    node = OmegaConf.create(OmegaConf.to_container(actor.actor_rollout_ref.actor, resolve=True))
    node.ppo_micro_batch_size_per_gpu = MICRO
    config = omega_conf_to_dataclass(node)
    samples = full_batch()
    fixed = gradient(config, rank_data(samples, False))
    dynamic = gradient(config, rank_data(samples, True))
    assert not torch.allclose(fixed, dynamic, rtol=1e-3)
