"""The journal (COMMAND.txt) every lab command writes: begun once, appended to as a command goes on."""

from __future__ import annotations

import shlex

from maspo_verl.lab.engine import journal


def test_a_journal_begins_with_the_command_a_shell_runs_again(tmp_path):
    argv = ["learn", "--losses", "maspo_words~offset12", "--out", str(tmp_path / "a b")]
    out = journal.start(tmp_path / "a b", argv)
    lines = journal.read(out).splitlines()
    assert shlex.split(lines[0]) == ["python", "-m", "maspo_verl.lab", *argv]
    assert lines[1] == "" and lines[2].startswith("date (UTC): 20")
    assert lines[3].startswith("python ") and ", torch " in lines[3] and lines[4].startswith("machine: ")
    assert journal.read(tmp_path / "none") == ""


def test_a_command_that_goes_on_is_appended_or_begins_the_journal(tmp_path):
    journal.again(tmp_path, ["granularity", "--resume"])  # no journal yet: begun
    first = journal.read(tmp_path)
    assert first.startswith("python -m maspo_verl.lab granularity --resume\n")
    journal.again(tmp_path, ["granularity", "--resume"], "re-ran (--redo)")
    added = journal.read(tmp_path)[len(first) :].splitlines()
    assert added[:2] == ["", "re-ran (--redo): python -m maspo_verl.lab granularity --resume"]
    assert added[2].startswith("date (UTC): ") and len(added) == 3


def test_run_time_and_load(tmp_path):
    journal.start(tmp_path, ["regimes"])
    journal.run_time(tmp_path, 90, "2 processes, 3 jobs, device cpu", ["a", "b"], "every 20 jobs")
    journal.run_time(tmp_path, 30, "device cuda", ["c"])
    tail = journal.read(tmp_path).splitlines()[-6:]
    assert tail == [
        "run time: 90 s (1.5 min), 2 processes, 3 jobs, device cpu",
        "machine load during the run (uptime, sampled every 20 jobs):",
        "  a",
        "  b",
        "run time: 30 s (0.5 min), device cuda",
        "machine load at the end: c",
    ]
    assert "load average" in journal.load()
