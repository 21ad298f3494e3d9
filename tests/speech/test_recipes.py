"""recipes/speech: every script's exact command (PRINT_CMD=1), composed in-process and validated with
verl's validate_config (what DRY_RUN=1 does), plus one real DRY_RUN=1 subprocess end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, compose_config

SCRIPTS = {
    "maspo_fixed": "recipes/speech/run_maspo_fixed.sh",
    "maspo_logprob": "recipes/speech/run_maspo_logprob.sh",
    "maspo_tokenval": "recipes/speech/run_maspo_tokenval.sh",
    "maspo_words": "recipes/speech/run_maspo_words.sh",
    "grpo": "recipes/speech/run_grpo.sh",
    "gspo": "recipes/speech/run_gspo.sh",
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASPO_", "DRY_RUN", "PRINT_", "LOSS"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.setdefault("HOME", "/root")
    env.update(extra)
    return env


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / script), *args], cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=300
    )


def _command(script: str, **env: str) -> tuple[str, list[str]]:
    p = _run(script, PRINT_CMD="1", SPEECH_CHAT_TEMPLATE=env.pop("SPEECH_CHAT_TEMPLATE", "none"), **env)
    assert p.returncode == 0, p.stderr
    # printf %q output (bash $'..' quoting for the multi-line template): let bash split it
    split = subprocess.run(
        ["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", p.stdout.strip()],
        capture_output=True,
        text=True,
        check=True,
    )
    argv = split.stdout.split("\0")[:-1]
    assert argv[1:4] == ["-m", "maspo_verl.main", "--config-name"], argv[:4]
    return argv[4], argv[5:]


def _compose(config_name: str, overrides: list[str]):
    return compose_config(*overrides, config_name=config_name)


@pytest.fixture(scope="module")
def template_file(llasa_tokenizer, tmp_path_factory) -> Path:
    from maspo_verl.speech.tokens import speech_chat_template

    path = tmp_path_factory.mktemp("tmpl") / "llasa_speech.jinja"
    path.write_text(speech_chat_template(llasa_tokenizer))
    return path


@pytest.mark.parametrize("loss", list(SCRIPTS))
def test_script_composes_and_validates(loss, template_file, llasa_tokenizer):
    from maspo_verl.main import dry_run

    name, overrides = _command(SCRIPTS[loss], SPEECH_CHAT_TEMPLATE=str(template_file), SEGMENT_WINDOW="50")
    cfg = _compose(name, overrides)
    section = dry_run(cfg)  # verl's validate_config, builds the actor dataclass (ours included)
    pl = cfg.actor_rollout_ref.actor.policy_loss
    expected_mode = {"grpo": "vanilla", "gspo": "gspo"}.get(loss, "maspo")
    assert pl.loss_mode == expected_mode
    assert section["bypass_mode"] is (loss != "grpo")
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    if loss == "maspo_fixed":
        assert pl.segment_rule == "fixed" and pl.segment_window == 50
    if loss == "maspo_tokenval":
        assert (pl.segment_rule, pl.tokenval_distance, pl.codec_offset) == ("tokenval", "fsq_l1", 128264)
    if loss == "maspo_words":
        assert (pl.segment_rule, pl.words_fallback_rule, pl.codec_offset) == ("words", "tokenval", 128264)
    if loss == "maspo_logprob":
        assert pl.segment_rule == "logprob"
    assert cfg.data.max_response_length == 2048 and cfg.actor_rollout_ref.rollout.name == "vllm"
    # reward: our manager, loadable the way verl loads it, with the reward settings it will read
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    from maspo_verl.speech.reward_manager import SpeechRewardManager
    from maspo_verl.speech.settings import settings_from_config

    assert resolve_reward_manager_cls(cfg) is SpeechRewardManager
    kw = settings_from_config(cfg)
    assert kw["asr_model"] == "large-v3" and kw["codec"] == "xcodec2" and kw["asr_device"] == "auto"
    # the prompt verl renders ends with <|SPEECH_GENERATION_START|>
    tmpl = cfg.actor_rollout_ref.model.custom_chat_template
    assert tmpl == template_file.read_text()
    ids = llasa_tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True, chat_template=tmpl
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[-1] == 128260


def test_dry_run_subprocess_and_windows(tmp_path):
    """DRY_RUN=1 end to end in a subprocess (compose + validate + print) for the phoneme window."""
    run_folder = tmp_path / "run"
    p = _run(
        SCRIPTS["maspo_fixed"],
        f"hydra.run.dir={run_folder}",
        DRY_RUN="1",
        SEGMENT_WINDOW="5",
        MODEL_PATH="/nonexistent/Llasa-1B",
        DATA_DIR="/nonexistent",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert not run_folder.exists()  # a dry run writes nothing (Hydra's run folder is removed)
    # each preflight note is said once: a log line, not also a Python warning with its source line
    notes = [line for line in p.stdout.splitlines() if "][maspo_verl.speech.preflight][WARNING] - " in line]
    assert notes, p.stdout[-3000:]
    for note in notes:
        message = note.split("[WARNING] - ", 1)[1]
        assert (p.stdout + p.stderr).count(message) == 1, message
    assert "UserWarning" not in p.stderr, p.stderr[-3000:]
    assert "loss section:" in p.stdout and "segment_window: 5" in p.stdout and "bypass_mode: true" in p.stdout
    assert "SPEECH_CHAT_TEMPLATE=auto is not derived" in p.stderr


def test_dry_run_words_full_setting():
    """DRY_RUN=1 of the word-segment script with span credit: the speech start-up checks pass (the reward
    turns its word ids on by itself) and the loss section shows the words rule."""
    p = _run(
        SCRIPTS["maspo_words"],
        "credit=span",
        DRY_RUN="1",
        MODEL_PATH="/nonexistent/Llasa-1B",
        DATA_DIR="/nonexistent",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "segment_rule: words" in p.stdout and "words_fallback_rule: tokenval" in p.stdout, p.stdout[-3000:]
    # the legacy trainer cannot carry the word ids: refused at start-up, before Ray
    p = _run(SCRIPTS["maspo_words"], "trainer.use_v1=false", DRY_RUN="1", MODEL_PATH="/x", DATA_DIR="/x")
    assert p.returncode != 0 and "needs trainer.use_v1=true" in p.stderr, p.stderr[-3000:]


def test_bad_window_fails_loudly():
    from maspo_verl.main import dry_run

    name, overrides = _command(SCRIPTS["maspo_fixed"], SEGMENT_WINDOW="0")
    with pytest.raises(Exception, match="segment_window"):
        dry_run(_compose(name, overrides))
