"""Batch settings verl rejects only at the first update, checked before Ray starts.

verl's ``validate_config`` (run before Ray) checks ``train_batch_size * rollout.n`` against the GPU
count and ``train_batch_size >= ppo_mini_batch_size``. The splits below are asserted later, in the
workers, at step 1 (minutes into a run). They are the same in verl 0.9.0, 0.9.1 and main:

- the trainer pads the batch (v1 trainer, ``upsample_batch_to_divisible_size``) to a multiple of
  ``lcm(dp, ppo_mini_batch_size * n)`` (``_get_required_batch_multiple``; the critic's mini-batch too
  when there is a critic); the legacy trainer (``trainer.use_v1=false``) does not pad, and its batch
  must split evenly over the data-parallel ranks and into mini-batches (``tu.make_iterator``);
- each rank gets ``batch / dp`` samples; ``dp`` = world size / Ulysses sequence-parallel size (FSDP)
  or / (tp * pp * cp) (Megatron); ``train_mini_batch`` asserts ``mini_batch % dp == 0``;
- without dynamic batch sizes, ``prepare_micro_batches`` asserts that the rank's batch divides into
  micro-batches: the mini-batch by ``actor.ppo_micro_batch_size_per_gpu`` (update), the whole batch
  by ``rollout.log_prob_micro_batch_size_per_gpu`` (old log-probs, skipped in bypass mode) and by
  ``ref.log_prob_micro_batch_size_per_gpu`` (reference log-probs);
- with dynamic batch sizes, ``rearrange_micro_batches`` asserts ``max_token_len_per_gpu * sp`` >= the
  longest sequence (up to ``max_prompt_length + max_response_length``, and the v1 trainer's synthetic
  padding samples); the worker asserts ``actor.use_dynamic_bsz == rollout.log_prob_use_dynamic_bsz``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from maspo_verl.validation import FieldError

logger = logging.getLogger(__name__)

ARR = "actor_rollout_ref"
ACTOR, ROLLOUT, REF = f"{ARR}.actor", f"{ARR}.rollout", f"{ARR}.ref"
WORLD = "trainer.n_gpus_per_node * trainer.nnodes"
# strategies whose data-parallel size we know
FSDP = ("fsdp", "fsdp2")
MEGATRON = ("megatron",)


@dataclass
class Problem:
    field: str
    message: str


def _get(config, path: str, default=None):
    node = config
    for key in path.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(key, None)
    return default if node is None else node


def _int(config, path: str, default=None) -> int | None:
    value = _get(config, path, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FieldError(path, f"{path}={value!r} is invalid: allowed a positive integer")
    return value


def _divisors(n: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found)) if len(found) <= 12 else f"a divisor of {n}"


def synthetic_padding_len() -> int:
    """Tokens of the v1 trainer's padding sample (verl 0.9.1: 128; 0.9.0 and main: 2)."""
    try:
        from verl.trainer.ppo import padding_utils
    except ImportError:
        return 2
    return int(getattr(padding_utils, "SYNTHETIC_PADDING_SEQ_LEN", 2))


def _data_parallel(config, role: str, world: int, problems: list[Problem]) -> tuple[int | None, int]:
    """(data-parallel size, Ulysses size) of ``role`` (``actor`` or ``ref``); None for an unknown strategy."""
    section = f"{ARR}.{role}"
    strategy = str(_get(config, f"{section}.strategy", "fsdp"))
    if strategy in FSDP:
        sp = _int(config, f"{section}.ulysses_sequence_parallel_size", 1)
        if sp == 1:
            sp = _int(config, f"{section}.fsdp_config.ulysses_sequence_parallel_size", 1)
        if world % sp:
            problems.append(
                Problem(
                    f"{section}.ulysses_sequence_parallel_size",
                    f"{section}.ulysses_sequence_parallel_size={sp} must divide the world size {WORLD} = {world}",
                )
            )
            return None, sp
        return world // sp, sp
    if strategy in MEGATRON:
        mp = 1
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            mp *= _int(config, f"{section}.megatron.{key}", 1)
        return (world // mp if world % mp == 0 else None), 1  # verl's validate_config checks world % mp
    return None, 1


def check_batch_sizes(config) -> list[str]:
    """Raise ``FieldError`` naming the settings verl would reject at the first update, and the overrides
    to change; return the warnings issued (settings verl accepts but pads or wastes)."""
    trainer_mode = str(_get(config, "trainer.v1.trainer_mode", "sync"))
    v1 = bool(_get(config, "trainer.use_v1", False))
    if v1 and trainer_mode == "separate_async":  # the trainer has its own resources there
        return []
    world = _int(config, "trainer.n_gpus_per_node", 1) * _int(config, "trainer.nnodes", 1)
    n = _int(config, f"{ROLLOUT}.n", 1)
    train_batch = _int(config, "data.train_batch_size")
    mini = _int(config, f"{ACTOR}.ppo_mini_batch_size")
    if train_batch is None or mini is None:
        return []
    problems: list[Problem] = []
    warnings: list[str] = []
    dp, sp = _data_parallel(config, "actor", world, problems)
    if dp is None:
        return _report(problems, warnings)

    dynamic = bool(_get(config, f"{ACTOR}.use_dynamic_bsz", False))
    logprob_dynamic = bool(_get(config, f"{ROLLOUT}.log_prob_use_dynamic_bsz", dynamic))
    if dynamic != logprob_dynamic:
        problems.append(
            Problem(
                f"{ROLLOUT}.log_prob_use_dynamic_bsz",
                f"{ROLLOUT}.log_prob_use_dynamic_bsz={logprob_dynamic} and {ACTOR}.use_dynamic_bsz={dynamic}: "
                "verl's actor worker asserts they are equal; set both to the same value",
            )
        )

    # the global batch of one update, in samples
    samples_per_mini = mini * n
    mini_splits = samples_per_mini % dp == 0  # else train_mini_batch stops before splitting the batch
    if v1:
        mode_path = f"trainer.v1.{trainer_mode}.parameter_sync_step"
        sync_steps = _int(config, mode_path, 1)
        if train_batch % sync_steps:
            problems.append(
                Problem(
                    "data.train_batch_size",
                    f"data.train_batch_size={train_batch} must be divisible by {mode_path}={sync_steps} "
                    "(verl's v1 trainer asserts it at step 1)",
                )
            )
            return _report(problems, warnings)
        batch = train_batch // sync_steps * n
        multiple = math.lcm(dp, samples_per_mini)
        if _needs_critic(config):
            multiple = math.lcm(multiple, _int(config, "critic.ppo_mini_batch_size", mini) * n)
        padded = -(-batch // multiple) * multiple
        if padded != batch:
            warnings.append(
                f"data.train_batch_size * {ROLLOUT}.n = {batch} is not a multiple of lcm(data-parallel size {dp}, "
                f"{ACTOR}.ppo_mini_batch_size * n = {samples_per_mini}) = {multiple}: verl pads every step with "
                f"{padded - batch} synthetic samples; a data.train_batch_size giving a multiple of {multiple} avoids it"
            )
    else:
        batch = padded = train_batch * n
        # verl's validate_config checks batch % world without dynamic batch sizes
        if dynamic and batch % dp:  # then no pass runs
            problems.append(
                Problem(
                    "data.train_batch_size",
                    f"data.train_batch_size * {ROLLOUT}.n = {batch} must be divisible by the data-parallel size "
                    f"{dp} ({WORLD} / Ulysses size): verl's legacy trainer splits the batch evenly over the ranks",
                )
            )
            return _report(problems, warnings)
        # without dynamic sizes verl's validate_config reports train_batch_size < ppo_mini_batch_size itself
        if mini_splits and batch % samples_per_mini and (dynamic or train_batch >= mini):
            problems.append(
                Problem(
                    "data.train_batch_size",
                    f"data.train_batch_size={train_batch} must be a multiple of {ACTOR}.ppo_mini_batch_size={mini}: "
                    "verl's legacy trainer (trainer.use_v1=false) splits the batch into whole mini-batches",
                )
            )

    if not mini_splits:
        problems.append(
            Problem(
                f"{ACTOR}.ppo_mini_batch_size",
                f"{ACTOR}.ppo_mini_batch_size * {ROLLOUT}.n = {mini} * {n} = {samples_per_mini} must be divisible by "
                f"the data-parallel size {dp} ({WORLD} / Ulysses size); allowed: a ppo_mini_batch_size that is a "
                f"multiple of {dp // math.gcd(n, dp)}, or change {WORLD}",
            )
        )

    longest = _int(config, "data.max_prompt_length", 1) + _int(config, "data.max_response_length", 1)
    longest_source = "data.max_prompt_length + data.max_response_length"
    if padded != batch and synthetic_padding_len() > longest:
        longest, longest_source = synthetic_padding_len(), "the length of verl's synthetic padding samples"
    per_rank_mini = samples_per_mini // dp
    per_rank = padded // dp if padded % dp == 0 else None
    bypass = bool(_get(config, "algorithm.rollout_correction.bypass_mode", False))

    # the actor update and the old log-prob pass (the actor's mesh)
    if dynamic:
        _token_len(problems, config, f"{ACTOR}.ppo_max_token_len_per_gpu", sp, longest, longest_source)
        if not bypass:
            _token_len(problems, config, f"{ROLLOUT}.log_prob_max_token_len_per_gpu", sp, longest, longest_source)
    else:
        if mini_splits and (v1 or batch % samples_per_mini == 0):  # else the update stops before its micro-batches
            _micro(problems, config, f"{ACTOR}.ppo_micro_batch_size_per_gpu", per_rank_mini, "mini-batch", dp)
        if not bypass and per_rank is not None:
            _micro(problems, config, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", per_rank, "batch", dp)

    # the reference policy's log-prob pass (its own mesh and settings unless it lives in the actor)
    if _needs_reference(config) and not _ref_in_actor(config):
        ref_dp, ref_sp = _data_parallel(config, "ref", world, problems)
        if ref_dp is not None and padded % ref_dp == 0:
            if bool(_get(config, f"{REF}.log_prob_use_dynamic_bsz", dynamic)):
                _token_len(problems, config, f"{REF}.log_prob_max_token_len_per_gpu", ref_sp, longest, longest_source)
            else:
                _micro(problems, config, f"{REF}.log_prob_micro_batch_size_per_gpu", padded // ref_dp, "batch", ref_dp)
    return _report(problems, warnings)


def _micro(problems, config, path: str, per_rank: int, what: str, dp: int) -> None:
    micro = _int(config, path)
    if micro is None or per_rank % micro == 0:
        return
    source = (
        f"ppo_mini_batch_size * rollout.n / data-parallel size {dp}"
        if what == "mini-batch"
        else f"train batch * rollout.n (padded) / data-parallel size {dp}"
    )
    problems.append(
        Problem(
            path,
            f"{path}={micro} does not divide the {per_rank} samples of each rank's {what} ({source}): verl asserts "
            f"'data size must be divisible by force_group_size * micro_batch_size_per_gpu' at step 1; allowed: "
            f"{_divisors(per_rank)}",
        )
    )


def _token_len(problems, config, path: str, sp: int, longest: int, source: str) -> None:
    value = _int(config, path)
    if value is None or value * sp >= longest:
        return
    problems.append(
        Problem(
            path,
            f"{path}={value} (x Ulysses size {sp}) is shorter than the longest sequence, {longest} tokens ({source}): "
            "verl asserts 'max_token_len must be greater than the sequence length' when one comes; "
            f"allowed: >= {-(-longest // sp)}",
        )
    )


def _needs_reference(config) -> bool:
    return bool(_get(config, "algorithm.use_kl_in_reward", False)) or bool(_get(config, f"{ACTOR}.use_kl_loss", False))


def _needs_critic(config) -> bool:
    enable = _get(config, "critic.enable")
    if enable is not None:
        return bool(enable)
    return str(_get(config, "algorithm.adv_estimator", "")) == "gae"


def _ref_in_actor(config) -> bool:
    rank = _get(config, f"{ARR}.model.lora.rank", 0) or 0
    if rank <= 0:
        rank = _get(config, f"{ARR}.model.lora_rank", 0) or 0
    return rank > 0 or _get(config, f"{ARR}.model.lora_adapter_path") is not None


def _report(problems: list[Problem], warnings: list[str]) -> list[str]:
    if problems:
        lines = "\n".join(f"  - {p.message}" for p in problems)
        raise FieldError(
            problems[0].field,
            f"{problems[0].field}: batch settings verl would reject at the first training step:\n{lines}",
        )
    for message in warnings:
        logger.warning("maspo_verl: %s", message)
    return warnings
