"""What is generated from the declarations (``maspo_verl.reference``) is up to date and complete: the Hydra defaults
in ``hydra_configs/maspo_base.yaml``, the fields, rules and presets tables of docs/configuration.md and the
README's short presets table."""

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from verl.workers.config import PolicyLossConfig

from maspo_verl import reference
from maspo_verl.config import SETTINGS, GranularLossConfig
from maspo_verl.core.segments import SEGMENT_RULES
from maspo_verl.util import config_dir, preset_names
from tests.helpers import REPO, compose_config


def test_the_generated_files_are_up_to_date():
    out = subprocess.run(
        [sys.executable, "-m", "maspo_verl", "generate", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr  # names the files and the command to run


def test_a_stale_table_is_found_and_rewritten(tmp_path):
    for path in reference.generated(REPO):  # a checkout's generated pages, then as this root makes them
        if path.suffix == ".md":
            (tmp_path / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path.relative_to(REPO)).write_text(path.read_text())
    reference.write(tmp_path)  # (docs/lab.md links only the results folders a root has)
    page = tmp_path / "docs" / "configuration.md"
    text = page.read_text()
    assert text == (REPO / "docs" / "configuration.md").read_text()
    page.write_text(text.replace("| `segment_window` |", "| `segment_windows` |", 1))
    assert reference.write(tmp_path) == [page] and page.read_text() == text


def test_the_dataclass_has_exactly_the_declared_fields_and_defaults():
    ours = [
        f
        for f in dataclasses.fields(GranularLossConfig)
        if f.name not in {g.name for g in dataclasses.fields(PolicyLossConfig)}
    ]
    assert [f.name for f in ours] == [s.name for s in SETTINGS]
    built = GranularLossConfig(loss_mode="maspo")
    assert all(getattr(built, s.name) == s.default for s in SETTINGS)


def test_the_composed_defaults_are_the_declared_ones():
    composed = OmegaConf.to_container(compose_config("~loss").actor_rollout_ref.actor.policy_loss)
    assert {s.name: composed[s.name] for s in SETTINGS} == {s.name: s.default for s in SETTINGS}


def test_the_reference_tables_name_every_setting_rule_and_preset():
    text = (REPO / "docs" / "configuration.md").read_text()
    readme = (REPO / "README.md").read_text()
    for s in SETTINGS:
        assert f"| `{s.name}` |" in text, s.name
    for name in SEGMENT_RULES:
        assert f"| `{name}` |" in text, name
    for name in preset_names():
        assert f"| `{name}` |" in text and f"| `{name}` |" in readme, name
    assert (config_dir() / "maspo_base.yaml").read_text().count(reference.YAML_MARKERS[0]) == 1


def test_a_preset_that_sets_no_loss_is_refused_by_the_generator(tmp_path, monkeypatch):
    import shutil

    from maspo_verl import reference

    configs = tmp_path / "hydra_configs"
    shutil.copytree(config_dir(), configs)
    (configs / "loss" / "flat.yaml").write_text("loss_mode: maspo\nsegment_rule: fixed\n")  # not nested
    monkeypatch.setattr(reference, "config_dir", lambda: configs)
    monkeypatch.setattr("maspo_verl.util.config_dir", lambda: configs)
    with pytest.raises(ValueError, match=r"flat.yaml sets no actor_rollout_ref.actor.policy_loss.loss_mode"):
        reference.generated(tmp_path)


def test_a_composed_config_is_a_fresh_copy_and_an_edited_file_is_composed_again(tmp_path, monkeypatch):
    import shutil

    configs = tmp_path / "hydra_configs"
    shutil.copytree(config_dir(), configs)
    monkeypatch.setattr(reference, "config_dir", lambda: configs)
    first = compose_config("loss=maspo_fixed")
    assert first.actor_rollout_ref.actor.policy_loss.segment_window == 15
    first.actor_rollout_ref.actor.policy_loss.segment_window = 99  # the caller's copy, not the one kept
    again = compose_config("loss=maspo_fixed")
    assert again.actor_rollout_ref.actor.policy_loss.segment_window == 15
    assert OmegaConf.to_yaml(again) == OmegaConf.to_yaml(
        reference._composed.__wrapped__("maspo_trainer", ("loss=maspo_fixed",), ())
    )
    preset = configs / "loss" / "maspo_fixed.yaml"
    preset.write_text(preset.read_text().replace("segment_window: 15", "segment_window: 7"))
    assert compose_config("loss=maspo_fixed").actor_rollout_ref.actor.policy_loss.segment_window == 7
