"""Shared builders for the core tests: verl actor configs and random [B, T] batches."""

import torch
from verl.workers.config import ActorConfig

from maspo_verl.config import GranularLossConfig


def actor_config(clip_low=0.2, clip_high=0.28, clip_c=3.0, **policy_loss) -> ActorConfig:
    """A real verl ActorConfig whose policy_loss is our dataclass."""
    policy_loss.setdefault("loss_mode", "maspo")
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=clip_c,
        policy_loss=GranularLossConfig(**policy_loss),
    )


def random_batch(B=6, T=20, scale=0.3, seed=0, dtype=torch.float64, lengths=None, per_token=False):
    """old/new log-probs, advantages (both signs; per sample, or per token with ``per_token``, as span
    credit gives) and a right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    new = (old + scale * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_()
    adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).contiguous()
    if per_token:
        adv = adv + torch.randn(B, T, generator=g, dtype=dtype)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]
    return old, new, adv, mask
