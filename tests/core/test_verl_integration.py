"""The plugin inside the real verl: auto-load, the ppo_loss hook, start-up checks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils import tensordict_utils as tu

from maspo_verl import plugin
from maspo_verl.advantages import ESTIMATOR_NAMES
from maspo_verl.batch import micro_batch_scope
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.plugin import checks, hooks
from tests.helpers import actor_config, compose_config

OFFSET = 128264


def subprocess_env():
    env = dict(os.environ)
    env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
    return env


def test_import_verl_autoloads_plugin_in_fresh_process():
    probe = (
        "import json, verl\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
        "import verl.workers.utils.losses as L\n"
        "print(json.dumps({'losses': [n for n in ('maspo', 'ctpo', 'pgspo') if n in R],\n"
        "  'hook': hasattr(L.ppo_loss, '__maspo_original__')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"losses": ["maspo", "ctpo", "pgspo"], "hook": True}


def test_engine_workers_binds_the_wrapped_ppo_loss_in_fresh_process():
    probe = "import verl.workers.engine_workers as ew; print(hasattr(ew.ppo_loss, '__maspo_original__'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_broken_plugin_is_logged_as_an_error():
    probe = "import sys; sys.modules['maspo_verl.core.losses'] = None; import verl"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert out.returncode == 0  # verl swallows it ...
    assert "maspo_verl failed to load" in out.stderr  # ... but we say so


@pytest.mark.parametrize("target", ["verl.workers.config.PolicyLossConfig", "maspo_verl.config.GranularLossConfig"])
def test_broken_plugin_fails_the_config_build_with_its_reason(target):
    """Plain verl: building the policy-loss config (verl's validate_config does, before Ray) names the cause."""
    probe = (
        "import sys; sys.modules['maspo_verl.core.losses'] = None\n"
        "from omegaconf import OmegaConf\n"
        "from verl.utils.config import omega_conf_to_dataclass\n"
        f"omega_conf_to_dataclass(OmegaConf.create({{'_target_': '{target}', 'loss_mode': 'maspo'}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert out.returncode != 0
    assert "loss_mode='maspo' is not registered in verl" in out.stderr, out.stderr[-3000:]
    assert "maspo_verl.core.losses" in out.stderr  # the import error itself


def test_check_command_reports_ok():
    out = subprocess.run(
        [sys.executable, "-m", "maspo_verl", "check"], capture_output=True, text=True, env=subprocess_env()
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["autoload_registers"] == [*TOKEN_SETS, *ESTIMATOR_NAMES]
    # every hook installed at import is installed (the v1 trainer's install when verl imports it)
    assert {"ppo_loss", "token_scores", "update_step", "verl_losses"} <= set(report["hooks"])
    assert set(report["hooks"].values()) == {"installed"}, report["hooks"]


def test_check_command_reports_a_broken_package_as_a_finding(tmp_path):
    """A syntax error in a core module: the report names the exception and the file, no traceback."""
    import maspo_verl

    shadow = tmp_path / "maspo_verl"
    shutil.copytree(Path(maspo_verl.__file__).parent, shadow, ignore=shutil.ignore_patterns("__pycache__"))
    (shadow / "core" / "token_sets.py").write_text("def broken(:\n")
    env = {**subprocess_env(), "PYTHONPATH": str(tmp_path)}
    cmd = [sys.executable, "-m", "maspo_verl", "check"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    assert report["import_plugin"]["exception"].startswith("SyntaxError")
    assert report["import_plugin"]["file"].endswith("token_sets.py:1")
    assert "Traceback" not in out.stdout + out.stderr


def test_check_command_fails_when_autoload_is_disabled():
    """The FAILED line follows the report it refers to (one pipe for both streams, as a terminal shows them)
    and names the cause and the fix."""
    env = {**subprocess_env(), "VERL_USE_EXTERNAL_PLUGINS": "none"}
    cmd = [sys.executable, "-m", "maspo_verl", "check"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert out.returncode == 1
    *report, failed = out.stdout.strip().splitlines()
    assert json.loads("\n".join(report))["ok"] is False
    assert failed.startswith("maspo_verl check FAILED: a fresh `import verl` registers [], not our losses"), failed
    assert "VERL_USE_EXTERNAL_PLUGINS=none: list maspo_verl, or unset it" in failed


def v1_micro_batch(codes, prompt_lens, seed=0):
    """A micro-batch as verl's v1 engine hands it to ppo_loss: nested prompts/responses/log-probs."""
    g = torch.Generator().manual_seed(seed)
    B = len(codes)
    T = max(len(c) for c in codes)
    responses = [torch.tensor(c) for c in codes]
    prompts = [torch.randint(0, 100, (p,), generator=g) for p in prompt_lens]
    mask = torch.zeros(B, T)
    for i, c in enumerate(codes):
        mask[i, : len(c)] = 1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    data = TensorDict(
        {
            "prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
            "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
            "response_mask": mask,
            "old_log_probs": old,
            "advantages": adv,
        },
        batch_size=[B],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    new = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    seq = [
        torch.cat([torch.zeros(p - 1, dtype=torch.float64), new[i, : len(c)], torch.zeros(1, dtype=torch.float64)])
        for i, (p, c) in enumerate(zip(prompt_lens, codes, strict=True))
    ]
    log_probs = torch.nested.as_nested_tensor(seq, layout=torch.jagged).requires_grad_()
    return data, log_probs, (old, new, adv, mask.bool())


def test_tokenval_ids_reach_the_loss_through_verls_real_ppo_loss():
    import verl.workers.utils.losses as verl_losses

    # codes with jumps: row 0 -> segments [0,1,2] [1000,1001,1002]; row 1 -> [5] [text] [7]
    codes = [
        [OFFSET + 0, OFFSET + 1, OFFSET + 2, OFFSET + 1000, OFFSET + 1001, OFFSET + 1002],
        [OFFSET + 5, 42, OFFSET + 7],
    ]
    data, log_probs, (old, new, adv, mask) = v1_micro_batch(codes, prompt_lens=[3, 2])
    config = actor_config(segment_rule="tokenval", tokenval_distance="id", tokenval_threshold=10)
    assert hasattr(verl_losses.ppo_loss, "__maspo_original__")
    loss, metrics = verl_losses.ppo_loss(config, {"log_probs": log_probs}, data)
    assert metrics["actor/ratio/segments_per_seq"].aggregate() == pytest.approx((2 + 3) / 2)
    assert metrics["actor/ratio/segment_len_mean"].aggregate() == pytest.approx(9 / 5)
    # the same loss computed directly with the ids made visible by hand
    padded = torch.zeros(mask.shape, dtype=torch.long)
    for i, c in enumerate(codes):
        padded[i, : len(c)] = torch.tensor(c)
    with micro_batch_scope({"responses": padded}):
        direct, _ = get_policy_loss_fn("maspo")(old, new, adv, mask, config.loss_agg_mode, config)
    assert loss.item() == pytest.approx(direct.item(), abs=1e-12)
    loss.backward()
    assert log_probs.grad is not None


def test_the_actors_tokenizer_reaches_the_delimiters_rule_through_verls_real_ppo_loss(tmp_path):
    """verl's engine worker attaches its ``HFModelConfig`` (the loaded tokenizer included) to the actor
    config that ppo_loss receives; the hook hands that tokenizer to the loss. Byte-level ids here."""
    import verl.workers.utils.losses as verl_losses
    from verl.workers.config import HFModelConfig

    from maspo_verl.local.assets import ensure_assets

    config = actor_config(segment_rule="delimiters")
    config.model_config = HFModelConfig(path=ensure_assets(cache_dir=tmp_path)["model"])
    # "Yes." " No!\n" "ok": ". " across two tokens, "\n" inside one; "a.b": no delimiter
    data, log_probs, _ = v1_micro_batch([list(b"Yes. No!\nok"), list(b"a.b")], prompt_lens=[3, 2])
    _, metrics = verl_losses.ppo_loss(config, {"log_probs": log_probs}, data)
    assert metrics["actor/ratio/segments_per_seq"].aggregate() == pytest.approx((3 + 1) / 2)


def test_tokenval_outside_ppo_loss_says_how_to_fix_it():
    old = torch.zeros(1, 4)
    with pytest.raises(RuntimeError, match="no verl micro-batch is in scope"):
        get_policy_loss_fn("maspo")(old, old, old, old.bool(), "token-mean", actor_config(segment_rule="tokenval"))


@pytest.fixture
def restore_hook():
    import verl.workers.utils.losses as verl_losses

    saved = verl_losses.ppo_loss
    yield verl_losses
    verl_losses.ppo_loss = saved
    assert hooks.install_ppo_loss_hook() is None


def test_hook_refuses_unknown_signature(restore_hook):
    def ppo_loss(config, model_output, data, dp_group=None, new_arg=None):
        raise AssertionError("never called")

    restore_hook.ppo_loss = ppo_loss
    problem = hooks.install_ppo_loss_hook()
    assert problem and "expected ('config', 'model_output', 'data', 'dp_group')" in problem
    assert restore_hook.ppo_loss is ppo_loss  # left untouched
    assert hooks.patch_problem("ppo_loss") == problem
    with pytest.raises(RuntimeError, match="segment_rule='tokenval' is unavailable: verl.workers.utils.losses"):
        checks.run_startup_checks(compose_config("loss=maspo_tokenval"))


def test_patch_rebinds_modules_that_imported_the_original(monkeypatch):
    import types

    owner = types.ModuleType("fake_owner")
    owner.fn = lambda x: x + 1
    importer = types.ModuleType("verl.fake_importer")
    importer.fn = owner.fn
    monkeypatch.setitem(sys.modules, "verl.fake_importer", importer)
    assert hooks.patch("fake", owner, "fn", lambda original: lambda x: 10 * original(x)) is None
    assert owner.fn(1) == 20 and importer.fn is owner.fn
    assert hooks.patch("fake", owner, "fn", lambda original: lambda x: -original(x)) is None  # once only
    assert owner.fn(1) == 20
    assert hooks.patch("gone", owner, "missing", lambda o: o) == "fake_owner.missing does not exist in this verl"


def test_hook_install_is_idempotent(restore_hook):
    first = restore_hook.ppo_loss
    assert hooks.install_ppo_loss_hook() is None
    assert restore_hook.ppo_loss is first
    assert plugin.registered() == {"policy_losses": list(TOKEN_SETS), "advantage_estimators": list(ESTIMATOR_NAMES)}
    assert {"maspo", "ctpo", "pgspo"} <= set(TOKEN_SETS)
