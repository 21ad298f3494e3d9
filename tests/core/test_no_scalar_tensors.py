"""No tensor is made from Python values inside a loss call: on a GPU each such tensor is a host-to-device copy,
which synchronises (``tests/core/test_cuda.py`` counts the synchronisations there). Checked on CPU for every preset
(the same torch ops as on a GPU), by counting the calls that make one."""

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from maspo_verl.batch import WORD_IDS_KEY, micro_batch_scope
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.util import preset_names
from tests.helpers import BYTE_VOCABULARY, compose_config, random_batch

MAKERS = [(torch, "tensor"), (torch, "as_tensor"), (torch, "scalar_tensor"), (torch.Tensor, "new_tensor")]


class Counter:
    """Counts calls of the functions in ``MAKERS`` while it is active."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for owner, name in MAKERS:
            original = getattr(owner, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                self.calls.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)


def test_the_counter_sees_a_scalar_tensor(monkeypatch):
    counter = Counter(monkeypatch)
    torch.ones(2).new_tensor(1.0)
    assert counter.calls == ["new_tensor"]


@pytest.mark.parametrize("preset", [p for p in preset_names() if p not in ("grpo", "gspo")])
def test_a_loss_call_makes_no_tensor_from_python_values(preset, monkeypatch):
    cfg = compose_config(f"loss={preset}")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode in TOKEN_SETS
    old, new, adv, mask = random_batch(B=4, T=40, dtype=torch.float32)
    ids = 128264 + torch.randint(0, 65536, mask.shape, generator=torch.Generator().manual_seed(0))
    words = torch.arange(mask.shape[1]).div(5, rounding_mode="floor").expand(mask.shape)
    fn = get_policy_loss_fn(actor.policy_loss.loss_mode)
    with micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, BYTE_VOCABULARY):
        fn(old, new, adv, mask, actor.loss_agg_mode, actor)  # first call: per-process tables are made once
        counter = Counter(monkeypatch)
        loss, _ = fn(old, new, adv, mask, actor.loss_agg_mode, actor)
    assert torch.isfinite(loss)
    assert counter.calls == [], f"loss={preset} made tensors from Python values: {counter.calls}"
