"""Nothing lost: every committed results table under docs/results/ regenerates byte for byte from its committed
runs. A folder's report-only path (the lab command in its COMMAND.txt with ``--report``, or a command that only
reads other folders) runs in a copy of docs/results/ from which the files that report writes were removed; each file
it writes must be the committed one, to the byte (plots included). Every folder is accounted for: regenerated here,
or listed below with the reason it is not."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path("docs", "results")

# files a regenerated folder's report writes otherwise today, and why
STALE = {
    "regimes_tuned/README.md": "the README quotes COMMAND.txt, which gained the re-report's line after it was written",
    "adaptive/grid/README.md": "the README quotes COMMAND.txt, which gained the re-report's line after it was written",
    "learn_speechwarm/README.md": "its runs merge parallel parts: the README counts 5 seeds, the command it quotes 2",
}
EARLIER_LEARN = "an earlier lab learn's report (learn_runs.csv has no cell column; no intervals)"
# folders whose report an earlier version of the lab wrote, or that no report-only path remakes, and why
NOT_REGENERATED = {
    "": "the index of the results (hand-written)",
    "learn": EARLIER_LEARN,
    "learn_seeds": EARLIER_LEARN,
    "learn_words": EARLIER_LEARN,
    "learn_speechwarm/windows_tuning": "an earlier report's percentile-bootstrap intervals (t-intervals since)",
    "drift_cuda": "its COMMAND.txt: measured with an earlier VIF; --report would mix two versions",
    "adaptive/smollm2_seed1": "smollm2 has no report-only path outside --granularity (it measures, then reports)",
    "smollm2": "smollm2 has no report-only path outside --granularity (it measures, then reports)",
    "smollm2/seed1": "smollm2 has no report-only path outside --granularity (it measures, then reports)",
    "smollm2_vllm": "a hand-run comparison (no COMMAND.txt)",
    "estimators": "no report-only path (its tables are computed, by exact enumeration, then reported)",
    "race": "no report-only path (runs and report in one pass)",
    "credit": "no report-only path (runs and report in one pass)",
    "segments": "no report-only path; its input (a codes file made by feature_codec) is not committed",
    "bench": "timings of a machine (and steptime's, STEPTIME_COMMAND.txt): re-measured, not re-reported",
    "bench_cuda": "timings of a machine: re-measured, not re-reported",
    "update_share": "timings of a machine: re-measured, not re-reported",
    "update_share_cuda": "timings of a machine: re-measured, not re-reported",
    "reward": "timings of a machine: re-measured, not re-reported",
    "rollout_bench": "timings of a machine (local.rollout_bench, not a lab command)",
    "engine_mismatch": "a script's measurements (run.sh, not a lab command)",
    "megatron_update": "a GPU run of lab.megatron_update's script (no lab CLI command)",
    "agents_correction": "local.correction_study's output (not a lab command)",
}


def _command(folder: Path) -> list[str] | None:
    """The lab command in ``folder``'s COMMAND.txt (its first), as arguments."""
    text = (folder / "COMMAND.txt").read_text() if (folder / "COMMAND.txt").is_file() else ""
    found = re.search(r"^python -m maspo_verl\.lab \w+.*$", text, re.M)
    return shlex.split(found.group(0))[3:] if found else None


def _report_argv(words: list[str]) -> list[str]:
    """The command's arguments that choose what it reports: its running knobs (--resume, --pieces, --redo) gone."""
    argv, i = [], 0
    while i < len(words):
        if words[i] == "--resume":
            i += 1
        elif words[i] == "--pieces":
            i += 2
        else:
            argv.append(words[i])
            i += 1
    return argv


def _folders() -> list[str]:
    """Every folder of docs/results/ with a lab command in its COMMAND.txt and not listed as not regenerated."""
    found = []
    for command in sorted((ROOT / RESULTS).rglob("COMMAND.txt")):
        name = command.parent.relative_to(ROOT / RESULTS).as_posix()
        if name not in NOT_REGENERATED and _command(command.parent):
            found.append(name)
    return found


def _study(argv: list[str]):
    """The declaration (``STUDY``) of the study module that runs ``argv`` (a mode's, where one is on)."""
    from maspo_verl.lab import __main__ as lab

    return lab.parse(argv).module.STUDY


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """A checkout's root holding a copy of docs/results/ (the reports run there)."""
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(ROOT / RESULTS, root / RESULTS)
    return root


@pytest.mark.parametrize("name", _folders())
def test_report_regenerates_committed_files(name, copy, monkeypatch):
    from maspo_verl.lab import __main__ as lab

    monkeypatch.chdir(copy)
    committed, folder = ROOT / RESULTS / name, copy / RESULTS / name
    words = _report_argv(_command(committed))
    study = _study(words)
    assert study.writes, f"{name}: {words[0]} declares no report-only path (STUDY.writes): add it or say why not"
    argv = words if study.reads_only else [*words, "--report"]
    written = [n for n in study.writes if (committed / n).is_file()]
    assert written, f"{name}: none of {study.writes} is committed"
    for n in written:
        (folder / n).unlink()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        lab.main(argv)
    for n in written:
        assert (folder / n).is_file(), f"{name}: `{' '.join(argv)}` did not write {n}"
        if f"{name}/{n}" in STALE:
            continue
        assert (folder / n).read_bytes() == (committed / n).read_bytes(), f"{name}/{n} differs from the committed one"


def test_every_results_folder_is_regenerated_or_says_why():
    regenerated = set(_folders())
    listed = regenerated | set(NOT_REGENERATED)
    assert not regenerated & set(NOT_REGENERATED)
    assert all(f.rpartition("/")[0] in regenerated for f in STALE)
    for path in sorted((ROOT / RESULTS).rglob("*")):
        if path.is_file():
            folder = path.parent.relative_to(ROOT / RESULTS)
            if folder == Path("."):
                assert "" in NOT_REGENERATED
                continue
            ancestors = [folder.as_posix(), *(p.as_posix() for p in folder.parents if p != Path("."))]
            assert set(ancestors) & listed, f"{path}: neither regenerated here nor listed in NOT_REGENERATED"
