"""The local rollout server's mismatch instrument (``maspo.local_mismatch``): off, its log-probs are the
trainer's (float64 recompute of the same model); bf16, they differ by bf16 round-off; noise, by
independent Gaussian noise of the stated sigma, the sampled tokens unchanged."""

from __future__ import annotations

import asyncio
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from maspo_verl.local import assets, environment
from maspo_verl.local import mode as local_mode
from maspo_verl.local.mismatch import MISMATCH_ENV, LogProbMismatch
from maspo_verl.validation import FieldError
from tests.helpers import compose_config

PROMPT = list(b"Say: ka mi")
RESPONSE = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return assets.ensure_assets(seed=0, cache_dir=tmp_path_factory.mktemp("assets"))["model"]


@pytest.fixture(scope="module")
def reference(model_path):
    """log p(token | prefix) of the same model in float64, one full forward per response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()

    def recompute(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1 : -1], -1)
        return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    return recompute


def _generate(model_path, monkeypatch, mismatch: LogProbMismatch | None, requests: int, seed: int = 0):
    """(tokens, server log-probs) of ``requests`` responses from a server started with ``mismatch`` in its env."""
    from maspo_verl.local.hf_rollout import HFServer

    if mismatch is None:
        monkeypatch.delenv(MISMATCH_ENV, raising=False)
    else:
        monkeypatch.setenv(MISMATCH_ENV, mismatch.to_env())
    config = SimpleNamespace(prompt_length=64, response_length=RESPONSE, max_model_len=None, seed=seed)
    server = HFServer(config, SimpleNamespace(local_path=model_path, trust_remote_code=False))
    params = {"temperature": 1.0, "logprobs": True, "ignore_eos": True}
    outs = [asyncio.run(server.generate(PROMPT, params, request_id=f"r{i}")) for i in range(requests)]
    return [o.token_ids for o in outs], [torch.tensor(o.log_probs, dtype=torch.float64) for o in outs]


def test_off_equals_a_float64_recompute(model_path, reference, monkeypatch):
    tokens, logps = _generate(model_path, monkeypatch, None, requests=4)
    diff = torch.cat([lp - reference(t) for t, lp in zip(tokens, logps, strict=True)])
    # fp32 round-off only: a few dozen ulps of fp32 at log-probs of magnitude ~5
    assert diff.abs().max() < 64 * torch.finfo(torch.float32).eps
    # the default instrument and an explicit "off" are the same server
    same_tokens, same = _generate(model_path, monkeypatch, LogProbMismatch(), requests=4)
    assert same_tokens == tokens and all(torch.equal(a, b) for a, b in zip(same, logps, strict=True))


def test_bf16_differs_by_bf16_round_off(model_path, reference, monkeypatch):
    tokens, logps = _generate(model_path, monkeypatch, LogProbMismatch(logprob_dtype="bf16"), requests=4)
    diff = torch.cat([lp - reference(t) for t, lp in zip(tokens, logps, strict=True)]).abs()
    eps = torch.finfo(torch.bfloat16).eps  # 2^-7
    # far above fp32 round-off (the test above bounds that by 64 fp32 ulps ~ 8e-6), of the order of bf16's
    assert eps / 64 < diff.mean() < eps
    assert diff.max() < 4 * eps


@pytest.mark.parametrize("sigma", [0.05, 0.2])
def test_noise_of_the_stated_sigma(model_path, monkeypatch, sigma):
    requests = 10
    tokens, clean = _generate(model_path, monkeypatch, None, requests=requests)
    noisy_tokens, noisy = _generate(model_path, monkeypatch, LogProbMismatch(noise_std=sigma), requests=requests)
    assert noisy_tokens == tokens  # the noise has its own generator: the same samples
    noise = torch.cat([a - b for a, b in zip(noisy, clean, strict=True)])
    n = noise.numel()
    assert n == requests * RESPONSE
    # 5 standard errors: the sample sd of n normal draws has se sigma / sqrt(2 (n - 1)); the mean sigma / sqrt(n)
    assert abs(noise.std().item() / sigma - 1) < 5 / math.sqrt(2 * (n - 1))
    assert abs(noise.mean().item()) < 5 * sigma / math.sqrt(n)
    # independent per token: lag-1 autocorrelation within 5 / sqrt(n) of 0
    centred = noise - noise.mean()
    lag1 = (centred[1:] * centred[:-1]).sum() / (centred * centred).sum()
    assert abs(lag1.item()) < 5 / math.sqrt(n)
    # Gaussian, not merely of that sd: the fraction beyond 2 sigma is 4.55 % (binomial se)
    tail = (noise.abs() > 2 * sigma).double().mean().item()
    assert abs(tail - 0.0455) < 5 * math.sqrt(0.0455 * 0.9545 / n)


def test_settings_are_validated():
    assert not LogProbMismatch().active and LogProbMismatch(noise_std=0.1).active
    assert LogProbMismatch.from_mapping({"logprob_dtype": "bf16", "noise_std": 0}).active
    for bad, field in (
        ({"logprob_dtype": "fp16"}, "maspo.local_mismatch.logprob_dtype"),
        ({"noise_std": -0.1}, "maspo.local_mismatch.noise_std"),
        ({"noise_std": float("nan")}, "maspo.local_mismatch.noise_std"),
    ):
        with pytest.raises(FieldError, match="allowed") as info:
            LogProbMismatch.from_mapping(bad)
        assert info.value.field == field
    with pytest.raises(
        ValueError, match=r"unknown keys \['sigma'\]\nallowed keys:\n  logprob_dtype, noise_std, stale_syncs"
    ):
        LogProbMismatch.from_mapping({"sigma": 0.2})
    spec = LogProbMismatch(logprob_dtype="bf16", noise_std=0.2)
    assert LogProbMismatch.from_env({MISMATCH_ENV: spec.to_env()}) == spec
    assert LogProbMismatch.from_env({}) == LogProbMismatch()
    with pytest.raises(ValueError, match=MISMATCH_ENV):
        LogProbMismatch.from_env({MISMATCH_ENV: "bf16"})


@pytest.fixture
def local_env(monkeypatch):
    from verl.plugin.platform import platform_manager

    for key in (*environment.LOCAL_ENV, MISMATCH_ENV):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)


def test_prepare_validates_and_forwards_to_the_workers(local_env, tmp_path):
    base = ["local=cpu", "maspo.dry_run=true", f"maspo.local_cache_dir={tmp_path}"]
    config = compose_config(*base)
    local_mode.prepare_run(config)
    assert LogProbMismatch.from_env(config.ray_kwargs.ray_init.runtime_env.env_vars) == LogProbMismatch()
    config = compose_config(*base, "maspo.local_mismatch.logprob_dtype=bf16", "maspo.local_mismatch.noise_std=0.2")
    local_mode.prepare_run(config)
    expected = LogProbMismatch(logprob_dtype="bf16", noise_std=0.2)
    assert LogProbMismatch.from_env(config.ray_kwargs.ray_init.runtime_env.env_vars) == expected
    assert json.loads(os.environ[MISMATCH_ENV]) == {"logprob_dtype": "bf16", "noise_std": 0.2, "stale_syncs": 0}
    with pytest.raises(FieldError, match="maspo.local_mismatch.noise_std=-1"):
        local_mode.prepare_run(compose_config(*base, "maspo.local_mismatch.noise_std=-1"))


def test_stale_syncs_apply_each_sync_late(model_path, monkeypatch):
    """stale_syncs=1: the first sync is held back (the server keeps its initial weights), the second applies
    the first; with 0 each sync applies at once."""
    from maspo_verl.local.hf_rollout import HFServer

    monkeypatch.setenv(MISMATCH_ENV, LogProbMismatch(stale_syncs=1).to_env())
    config = SimpleNamespace(prompt_length=64, response_length=RESPONSE, max_model_len=None, seed=0)
    server = HFServer(config, SimpleNamespace(local_path=model_path, trust_remote_code=False))
    initial = {k: v.clone() for k, v in server.model.state_dict().items()}
    first = {k: v + 0.01 for k, v in initial.items()}
    second = {k: v + 0.02 for k, v in initial.items()}
    server.load_weights(first, global_steps=1)
    assert all(torch.equal(server.model.state_dict()[k], initial[k]) for k in initial)
    assert server.global_steps == 1  # verl tags each sample with a step: never None
    server.load_weights(second, global_steps=2)
    assert all(torch.equal(server.model.state_dict()[k], first[k]) for k in initial) and server.global_steps == 1
    assert LogProbMismatch(stale_syncs=1).active and "1 sync(s) stale" in LogProbMismatch(stale_syncs=1).describe()
    with pytest.raises(FieldError, match="maspo.local_mismatch.stale_syncs"):
        LogProbMismatch(stale_syncs=-1)
