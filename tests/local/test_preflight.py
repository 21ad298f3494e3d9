"""The driver's preflight (``maspo_verl.plugin.preflight``): every path the config names is checked on this
machine before Ray starts, and so are the GPUs a non-local run asks for. In-process over a composed config;
the command-line refusals (no Ray, no run folder, the dry run refusing the same) are in test_refusals.py."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import open_dict

from maspo_verl import util
from maspo_verl.plugin import preflight as preflight_module
from maspo_verl.plugin.preflight import _defines, collect, preflight
from maspo_verl.reference import compose_config
from maspo_verl.validation import FieldError


def model_folder(root):
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return folder


def parquet(path, columns=("prompt", "reward_model")):
    pq.write_table(pa.table({c: ["x"] for c in columns}), path)
    return path


@pytest.fixture
def good(tmp_path):
    """A config whose every path exists and has the expected shape (the GPU check off: local mode)."""
    reward = tmp_path / "reward.py"
    reward.write_text("import math\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 0.0\n")  # fmt: skip
    config = compose_config(
        "local=cpu",
        f"actor_rollout_ref.model.path={model_folder(tmp_path)}",
        f"data.train_files={parquet(tmp_path / 'train.parquet')}",
        f"data.val_files=[{parquet(tmp_path / 'val.parquet')}]",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
    )
    return config


def fields(config, local=True):
    return [name for name, _ in collect(config, local).problems]


def test_a_good_config_passes(good):
    assert collect(good, local=True).problems == []
    assert preflight(good, local=True) == []


def test_a_missing_model_folder_is_refused_naming_field_path_and_fix(good, tmp_path):
    with open_dict(good):
        good.actor_rollout_ref.model.path = str(tmp_path / "nope")
    with pytest.raises(FieldError) as caught:
        preflight(good, local=True)
    assert caught.value.field == "actor_rollout_ref.model.path"
    first = str(caught.value).splitlines()[0]
    assert first.startswith(f"actor_rollout_ref.model.path={tmp_path / 'nope'}: no such folder: set it to"), first


def test_a_folder_without_config_json_and_a_file_are_not_models(good, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with open_dict(good):
        good.actor_rollout_ref.model.path = str(empty)
        good.actor_rollout_ref.model.tokenizer_path = str(tmp_path / "train.parquet")
    problems = dict(collect(good, local=True).problems)
    assert "without config.json" in problems["actor_rollout_ref.model.path"]
    assert "is a file, not a model folder" in problems["actor_rollout_ref.model.tokenizer_path"]


def test_a_hub_id_is_allowed_and_said_unless_offline_and_not_cached(good, monkeypatch, tmp_path):
    with open_dict(good):
        good.actor_rollout_ref.model.path = "Qwen/Qwen2.5-0.5B"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(preflight_module, "hub_unreachable", lambda: None)  # a machine that reaches the Hub
    r = collect(good, local=True)
    assert r.problems == [] and len(r.notes) == 1 and "Hugging Face Hub id" in r.notes[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    assert fields(good) == ["actor_rollout_ref.model.path"]
    # a relative path whose first folder exists is a path, not a Hub id
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.chdir(tmp_path)
    with open_dict(good):
        good.actor_rollout_ref.model.path = "model/sub"
    assert fields(good) == ["actor_rollout_ref.model.path"]


def test_a_hub_id_the_hub_cannot_serve_is_refused_in_seconds_naming_the_fix(good, monkeypatch, tmp_path):
    """No Hub (a closed port here: the real probe, no network needed): one line, a few seconds, the fixes;
    a model in the cache is pointed to HF_HUB_OFFLINE=1."""
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(util, "_hub_reachable", {})
    with open_dict(good):
        good.actor_rollout_ref.model.path = "Qwen/Qwen2.5-0.5B"
    start = time.monotonic()
    with pytest.raises(FieldError) as caught:
        preflight(good, local=True)
    assert time.monotonic() - start < util.HUB_PROBE_TIMEOUT_S + 2
    (line,) = str(caught.value).splitlines()
    assert line.startswith("actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B: is a Hub id, but http://127.0.0.1:9 is "
                           "not reachable (ConnectionRefusedError"), line  # fmt: skip
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir DIR) and give that folder" in line
    monkeypatch.setattr(preflight_module, "_hub_cached", lambda repo_id: True)
    ((name, message),) = collect(good, local=True).problems
    assert name == "actor_rollout_ref.model.path"
    assert message.startswith(f"{name}=Qwen/Qwen2.5-0.5B: is a Hub id in the local cache, but http://127.0.0.1:9 is")
    assert message.endswith("(ConnectionRefusedError: [Errno 111] Connection refused): set HF_HUB_OFFLINE=1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline with the model cached: nothing to say
    assert collect(good, local=True).problems == []


def test_missing_data_files_and_a_parquet_without_the_prompt_key(good, tmp_path):
    with open_dict(good):
        good.data.train_files = str(tmp_path / "missing.parquet")
        good.data.val_files = [str(parquet(tmp_path / "other.parquet", columns=("question", "answer")))]
    problems = collect(good, local=True).problems
    assert [name for name, _ in problems] == ["data.train_files", "data.val_files"]
    assert "no such file" in problems[0][1]
    assert "has no column data.prompt_key='prompt' (columns: question, answer)" in problems[1][1]
    with open_dict(good):
        good.data.prompt_key = "question"
        good.data.train_files = str(tmp_path / "train.parquet")
    assert fields(good) == ["data.train_files"]  # train.parquet has no `question`


def test_data_file_kinds(good, tmp_path):
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    with open_dict(good):
        good.data.train_files = str(tmp_path / "d.csv")
        good.data.val_files = str(tmp_path / "d.jsonl")
    problems = dict(collect(good, local=True).problems)
    assert "reads .parquet, .json, .jsonl files only" in problems["data.train_files"]
    assert "no column data.prompt_key='prompt'" in problems["data.val_files"]


def test_the_reward_function_file_and_name(good, tmp_path):
    with open_dict(good):
        good.reward.custom_reward_function.name = "compute_scor"
    problems = collect(good, local=True).problems
    assert problems[0][0] == "reward.custom_reward_function.name"
    assert "defines no function 'compute_scor'" in problems[0][1]
    with open_dict(good):
        good.reward.custom_reward_function.path = str(tmp_path / "gone.py")
    assert fields(good) == ["reward.custom_reward_function.path"]
    with open_dict(good):  # verl's legacy top-level section wins when it sets anything (verl moves it)
        good.reward.custom_reward_function.path = None
        good.custom_reward_function.path = str(tmp_path / "gone.py")
        good.custom_reward_function.name = "f"
    assert fields(good) == ["custom_reward_function.path"]
    with open_dict(good):
        good.custom_reward_function.path = "pkg://maspo_verl.local.reward"
        good.custom_reward_function.name = "compute_score"
    assert fields(good) == []
    with open_dict(good):
        good.custom_reward_function.name = "nothing_here"
    assert fields(good) == ["custom_reward_function.name"]


def test_defines_finds_top_level_names_only():
    source = "from x import y as score\nimport a.b\nV = 1\nclass C: pass\ndef f():\n    def inner(): pass\n"
    assert [_defines(source, n) for n in ("score", "a", "V", "C", "f", "inner", "y")] == [
        True, True, True, True, True, False, False
    ]  # fmt: skip
    assert _defines("from x import *\n", "anything") is None


def test_gpus_asked_on_a_node_with_fewer_point_to_local_cpu(good, tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with open_dict(good):
        good.maspo.local = None
        good.trainer.device = "cuda"
        good.trainer.n_gpus_per_node = torch.cuda.device_count() + 1
        good.ray_kwargs.ray_init._temp_dir = str(tmp_path / "no_cluster_here")
    with pytest.raises(FieldError) as caught:
        preflight(good, local=False)
    assert caught.value.field == "trainer.n_gpus_per_node"
    assert "add local=cpu" in str(caught.value).splitlines()[0]
    assert collect(good, local=True).problems == []  # the local mode's workers are CPU processes
    # a dry run checks the config, not this node (a login node has no GPUs): one note, no problem
    r = collect(good, local=False, dry_run=True)
    assert r.problems == [] and len(r.notes) == 1
    assert r.notes[0].startswith(f"trainer.n_gpus_per_node={good.trainer.n_gpus_per_node}: this machine has ")
    assert "not checked in a dry run" in r.notes[0]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster to join counts its own GPUs
    assert collect(good, local=False).problems == []


def test_warn_lists_the_problems_and_off_checks_nothing(good, tmp_path, capsys):
    with open_dict(good):
        good.actor_rollout_ref.model.path = str(tmp_path / "nope")
        good.data.train_files = str(tmp_path / "nope.parquet")
        good.maspo.preflight = "warn"
    lines = preflight(good, local=True)
    assert len(lines) == 2 and all("not refused, maspo.preflight=warn" in line for line in lines)
    assert capsys.readouterr().out.count("maspo_verl preflight") == 2
    with open_dict(good):
        good.maspo.preflight = "off"
    assert preflight(good, local=True) == []
    with open_dict(good):
        good.maspo.preflight = "loud"
    with pytest.raises(FieldError, match=r"maspo.preflight='loud' is invalid: allowed one of refuse, warn, off"):
        preflight(good, local=True)


def test_every_problem_is_listed_after_the_first(good, tmp_path):
    with open_dict(good):
        good.actor_rollout_ref.model.path = str(tmp_path / "nope")
        good.data.train_files = str(tmp_path / "nope.parquet")
        good.data.val_files = str(tmp_path / "nope2.parquet")
    with pytest.raises(FieldError) as caught:
        preflight(good, local=True)
    lines = str(caught.value).splitlines()
    assert lines[1] == "2 more:" and lines[2].startswith("- data.train_files=") and lines[3].startswith("- data.val")


def test_a_dry_run_says_the_problems_warn_let_through(good, tmp_path, capsys):
    """With maspo.preflight=warn a dry run does not say "config valid" alone while paths are missing."""
    from maspo_verl.main import dry_run
    from maspo_verl.plugin.preflight import unrefused

    with open_dict(good):
        good.data.train_files = str(tmp_path / "nope.parquet")
        good.data.val_files = str(tmp_path / "nope2.parquet")
        good.maspo.preflight = "warn"
    lines = preflight(good, local=True)
    assert unrefused(lines) == 2
    capsys.readouterr()
    dry_run(good, unrefused(lines))
    (said,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("maspo_verl dry run:")]
    assert said == (
        "maspo_verl dry run: config valid, but 2 problems on this machine (above; a run here stops at the first); "
        "loss section:"
    )
    dry_run(good)
    assert "maspo_verl dry run: config valid; loss section:" in capsys.readouterr().out.splitlines()
