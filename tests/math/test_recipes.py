"""Every recipe script under DRY_RUN=1 (subprocess): it composes the exact config it would launch,
runs verl's validate_config and prints the loss section. We check that section and re-compose the
printed command in-process to check the rest (bypass, rollout log-probs, reward, data, backend)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import REPO, run_script
from tests.math.conftest import compose, dry_run_command, loss_section

SCRIPTS = {
    "grpo": ("recipes/math/run_grpo.sh", {}),
    "gspo": ("recipes/math/run_gspo.sh", {}),
    "ctpo_la": ("recipes/math/run_ctpo_la.sh", {}),
    "megatron": ("recipes/math/run_megatron.sh", {}),
    "maspo_steps": ("recipes/math/run_maspo_steps.sh", {}),
    "maspo_surprisal": ("recipes/math/run_maspo_surprisal.sh", {}),
}
# the generic script with every knob moved off its default
CUSTOM = (
    "recipes/math/run.sh",
    {
        "LOSS": "maspo_logprob",
        "MODEL_PATH": "/models/Qwen3-4B",
        "NNODES": "2",
        "N_GPUS_PER_NODE": "4",
        "TRAIN_BATCH_SIZE": "64",
        "PPO_MINI_BATCH_SIZE": "16",
        "ROLLOUT_N": "16",
        "MAX_PROMPT_LENGTH": "512",
        "MAX_RESPONSE_LENGTH": "8192",
        "DATA_DIR": "/data/m",
        "LOGGER": '["console"]',
        "TEST_FREQ": "5",
        "SAVE_FREQ": "25",
        "PARAM_OFFLOAD": "True",
    },
)


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, subprocess.CompletedProcess]:
    """All scripts at once (each is a fresh Python that imports torch and verl)."""
    with ThreadPoolExecutor(max_workers=len(SCRIPTS)) as pool:
        futures = {
            name: pool.submit(run_script, script, "trainer.total_training_steps=7", DRY_RUN="1", **env)
            for name, (script, env) in SCRIPTS.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _ok(run: subprocess.CompletedProcess) -> str:
    assert run.returncode == 0, (
        f"rc={run.returncode}\n--- stdout ---\n{run.stdout[-4000:]}\n--- stderr ---\n{run.stderr[-4000:]}"
    )
    assert "[validate_config] All configuration checks passed successfully!" in run.stdout
    assert "paths and GPUs this machine lacks are listed, not refused" in run.stdout
    assert max(len(line) for line in run.stdout.splitlines()) < 500  # the command: one override per line
    return run.stdout


def _config(run):
    name, overrides = dry_run_command(run.stdout)
    return compose(name, overrides)


def test_grpo_baseline(dry_runs):
    section = loss_section(_ok(dry_runs["grpo"]))
    assert section["policy_loss"]["loss_mode"] == "vanilla"
    assert (section["clip_ratio_low"], section["clip_ratio_high"], section["clip_ratio_c"]) == (0.2, 0.2, 3.0)
    assert section["loss_agg_mode"] == "token-mean"
    assert section["bypass_mode"] is False  # the token-level baseline recomputes old log-probs


def test_gspo(dry_runs):
    section = loss_section(_ok(dry_runs["gspo"]))
    assert section["policy_loss"]["loss_mode"] == "gspo"
    assert (section["clip_ratio_low"], section["clip_ratio_high"]) == (3e-4, 4e-4)
    assert section["loss_agg_mode"] == "seq-mean-token-mean"
    assert section["bypass_mode"] is True


def test_ctpo_la(dry_runs):
    section = loss_section(_ok(dry_runs["ctpo_la"]))
    pl = section["policy_loss"]
    assert pl["loss_mode"] == "ctpo" and pl["ctpo_mode"] == "cumprod"
    assert pl["clip_schedule"] == "log_adaptive"
    assert (pl["log_clip_low"], pl["log_clip_high"], pl["log_clip_dual"], pl["clip_exponent"]) == (
        0.025,
        0.05,
        0.05,
        0.5,
    )
    assert section["bypass_mode"] is True


def test_maspo_steps(dry_runs):
    """The dry run opens no model: the delimiters are resolved against MODEL_PATH's tokenizer at launch."""
    out = _ok(dry_runs["maspo_steps"])
    pl = loss_section(out)["policy_loss"]
    assert (pl["loss_mode"], pl["segment_rule"]) == ("maspo", "delimiters")
    assert pl["delimiters"] == ["\n\n", "\n", ". ", "? ", "! "] and pl["step_markers"] == []
    assert (pl["min_segment_len"], pl["max_segment_len"]) == (3, 100)
    assert "resolves its strings against Qwen/Qwen2.5-Math-1.5B's tokenizer at launch" in out
    assert loss_section(out)["bypass_mode"] is True


def test_maspo_surprisal(dry_runs):
    section = loss_section(_ok(dry_runs["maspo_surprisal"]))
    pl = section["policy_loss"]
    assert (pl["loss_mode"], pl["segment_rule"], pl["surprisal_quantile"]) == ("maspo", "surprisal", 0.2)
    assert section["bypass_mode"] is True  # surprisal from the engine's log-probs


@pytest.mark.parametrize("name", ["grpo", "gspo", "ctpo_la"])
def test_fsdp2_vllm_one_node_defaults(dry_runs, name):
    cfg = _config(dry_runs[name])
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == "fsdp2" and arr.ref.strategy == "fsdp2"
    assert arr.rollout.name == "vllm"
    assert arr.rollout.calculate_log_probs is True
    assert arr.model.path == "Qwen/Qwen2.5-Math-1.5B"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 8)
    assert cfg.trainer.total_training_steps == 7  # extra CLI arguments are passed through, last wins
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.algorithm.rollout_correction.loss_type == "ppo_clip"  # bypass keeps our loss_mode
    assert cfg.reward.custom_reward_function.path == "pkg://maspo_verl.math.reward"
    assert cfg.reward.custom_reward_function.name == "compute_score"
    assert list(cfg.trainer.logger) == ["console", "wandb"]
    loss = {"grpo": "grpo", "gspo": "gspo", "ctpo_la": "ctpo"}[name]
    assert cfg.trainer.project_name == "maspo-math-qwen2.5-math-1.5b"
    assert cfg.trainer.experiment_name == f"{loss}-qwen2.5-math-1.5b-1x8"
    assert cfg.trainer.default_local_dir == f"checkpoints/maspo-math-qwen2.5-math-1.5b/{loss}-qwen2.5-math-1.5b-1x8"
    assert cfg.trainer.resume_mode == "auto"
    assert cfg.trainer.test_freq == 10 and cfg.trainer.val_before_train is True
    assert [f.rsplit("/", 1)[1] for f in cfg.data.val_files] == [
        "math500_test.parquet",
        "aime24_test.parquet",
        "aime25_test.parquet",
    ]
    assert cfg.data.train_files[0].endswith("/maspo_math/math_train.parquet")


def test_megatron_variant(dry_runs):
    run = dry_runs["megatron"]
    section = loss_section(_ok(run))
    assert section["policy_loss"]["loss_mode"] == "gspo" and section["bypass_mode"] is True
    name, _ = dry_run_command(run.stdout)
    assert name == "maspo_megatron_trainer"
    cfg = _config(run)
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron"
    assert actor.megatron.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2  # ref follows the actor
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-8B"
    assert actor.policy_loss._target_ == "maspo_verl.config.GranularLossConfig"


def test_every_knob_reaches_the_config(capsys):
    """PRINT_CMD=1 (bash only), then the same dry run in-process: compose, startup checks, validate_config."""
    from maspo_verl.main import run

    script, env = CUSTOM
    out = run_script(script, PRINT_CMD="1", **env)
    assert out.returncode == 0, out.stderr
    name, overrides = dry_run_command("command: " + out.stdout.strip())
    cfg = compose(name, overrides + ["maspo.dry_run=true", "maspo.preflight=warn"])  # as DRY_RUN=1
    run(cfg)
    section = loss_section(capsys.readouterr().out)
    assert section["policy_loss"]["loss_mode"] == "maspo"
    assert section["policy_loss"]["segment_rule"] == "logprob"
    assert section["bypass_mode"] is True
    arr = cfg.actor_rollout_ref
    assert arr.model.path == "/models/Qwen3-4B"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 4)
    assert cfg.data.train_batch_size == 64 and arr.actor.ppo_mini_batch_size == 16 and arr.rollout.n == 16
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 8192)
    assert arr.actor.ppo_max_token_len_per_gpu == (512 + 8192) * 4
    assert list(cfg.data.train_files) == ["/data/m/math_train.parquet"]
    assert list(cfg.trainer.logger) == ["console"]
    assert (cfg.trainer.test_freq, cfg.trainer.save_freq) == (5, 25)
    assert arr.actor.fsdp_config.param_offload is True and arr.actor.fsdp_config.optimizer_offload is True
    assert cfg.trainer.experiment_name == "maspo_logprob-qwen3-4b-2x4"


def test_bypass_can_be_forced(tmp_path):
    out = run_script("recipes/math/run_grpo.sh", PRINT_CMD="1", BYPASS_MODE="True")
    assert out.returncode == 0, out.stderr
    assert "algorithm.rollout_correction.bypass_mode=True" in out.stdout
    assert "loss=grpo" in out.stdout


def test_print_cmd_is_one_line_and_runs_nothing():
    out = run_script("recipes/math/run_gspo.sh", "trainer.save_freq=3", PRINT_CMD="1", PYTHON="python3")
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.strip().splitlines()
    assert line.startswith("python3 -m maspo_verl.main --config-name maspo_trainer recipe=math loss=gspo ")
    assert line.rstrip().endswith("trainer.save_freq=3")


def test_scripts_are_thin():
    """Recipes hold no logic a user could not read in one screen."""
    for script in (REPO / "recipes" / "math").glob("*.sh"):
        lines = [line for line in script.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert len(lines) <= 100, f"{script.name}: {len(lines)} lines"
