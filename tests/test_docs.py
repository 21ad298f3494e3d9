"""The docs run as written and agree with the code.

- no merge-conflict markers in any tracked text file;
- the documented CPU commands (each recipe's dry run, `check`, the lab's `--help`, a composed dry run, bad
  overrides), taken from the Markdown files themselves, run as printed in a fresh shell: an empty HOME and
  cache, no venv on PATH, then the README's activation line;
- the README's generated tables are checked in tests/test_reference.py;
- the README, the results README and the lab CLI list the same lab commands.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted(ROOT.glob("docs/*.md"))  # the pages a user finds by task (docs/results/ are study reports)
DOCS = [README, *PAGES, *sorted(ROOT.glob("recipes/*/README.md")), ROOT / "docker" / "README.md"]
RECIPE_READMES = sorted(ROOT.glob("recipes/*/README.md"))


# ---- merge-conflict markers ------------------------------------------------------------------------------------


def conflict_markers(text: str) -> list[int]:
    """1-based lines of conflict markers: `<<<<<<< x` / `>>>>>>> x` anywhere, `=======` between them."""
    found, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"(<<<<<<<|>>>>>>>)( |$)", line):
            found.append(number)
            inside = line.startswith("<")
        elif inside and line == "=======":
            found.append(number)
    return found


def test_conflict_marker_detection():
    sample = "a\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> words\nTitle\n=======\n"
    assert conflict_markers(sample) == [2, 4, 6]  # the heading underline outside a block is no marker
    assert conflict_markers("x = 1\n<<<<<<<<<< not one\n") == []


def test_no_conflict_markers_in_tracked_files():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    bad = {}
    for name in filter(None, listed.stdout.split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        lines = conflict_markers(data.decode("utf-8", errors="replace"))
        if lines:
            bad[name] = lines
    assert not bad, f"merge-conflict markers (file: lines): {bad}"


# ---- documented commands, run as printed ------------------------------------------------------------------------


def bash_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each ```bash block."""
    text = path.read_text()
    blocks = re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in blocks]


def commands(path: Path) -> list[tuple[str, str]]:
    """(where, command) of every command in the file's bash blocks, continuation lines joined."""
    out = []
    for first, block in bash_blocks(path):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            start, command = i, lines[i]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            if command.strip() and not command.lstrip().startswith("#"):
                out.append((f"{path.relative_to(ROOT)}:{first + start}", command.strip()))
            i += 1
    return out


def kind(command: str) -> str | None:
    """Which kind of documented CPU command this is (None: not one these tests run)."""
    if "# fails: " in command:
        return "bad override"
    if command.startswith("DRY_RUN=1 "):
        return "recipe dry run"
    if "maspo.dry_run=true" in command:
        return "dry run"
    if command.split("#")[0].split() == ["python", "-m", "maspo_verl", "check"]:
        return "check"
    if command.startswith("python -m maspo_verl.lab") and "--help" in command.split("#")[0]:
        return "lab help"
    return None


def documented() -> list[tuple[str, str, str]]:
    seen, out = set(), []
    for path in DOCS:
        for where, command in commands(path):
            k, key = kind(command), re.sub(r"\s+#.*$", "", command)
            if k and key not in seen:
                seen.add(key)
                out.append((where, k, command))
    return out


def activation() -> str:
    """The README's activation line: the block right after its two top (set-up) commands."""
    blocks = [block.strip() for _, block in bash_blocks(README)]
    assert blocks[2].startswith("source ") and "activate" in blocks[2], blocks[2]
    return blocks[2]


def test_every_kind_is_documented():
    found = {(where.split(":")[0], k) for where, k, _ in documented()}
    for path in RECIPE_READMES:
        assert (str(path.relative_to(ROOT)), "recipe dry run") in found, f"{path}: no `DRY_RUN=1 bash ...` command"
    for k in ("check", "lab help", "dry run", "bad override"):
        assert ("README.md", k) in found, f"README.md shows no {k} command"
    assert activation() == "source .venv/bin/activate"


def fresh_env(tmp_path: Path) -> dict:
    """A new login's environment: empty HOME and cache, PATH without any venv, nothing project-specific."""
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not Path(p, "..", "pyvenv.cfg").exists()]
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    return {"HOME": str(home), "MASPO_VERL_CACHE": str(cache), "PATH": os.pathsep.join(path), "LANG": "C.UTF-8"}


@pytest.fixture(scope="module")
def venv_python():
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv here: bash .ci/setup makes it")
    return python


@pytest.mark.parametrize(("where", "kind_", "command"), documented(), ids=[f"{w} {k}" for w, k, _ in documented()])
def test_documented_command_runs_as_printed(where, kind_, command, tmp_path, venv_python):
    script = f"{activation()}\n{command}\n"
    t0 = time.monotonic()
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=fresh_env(tmp_path), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    seconds, output = time.monotonic() - t0, run.stdout + run.stderr
    shown = f"{where}: {command}\nrc={run.returncode} after {seconds:.0f} s\n{output[-3000:]}"
    if kind_ == "bad override":
        assert run.returncode != 0, shown
        expected = command.split("# fails: ", 1)[1].strip()
        assert expected in output, f"the error does not say {expected!r}\n{shown}"
        assert seconds < 60, f"fails only after {seconds:.0f} s\n{shown}"
        return
    assert run.returncode == 0, shown
    if kind_ == "recipe dry run":
        assert "DRY_RUN=1" in output, shown
    elif kind_ == "dry run":
        assert re.search(r"^\s*loss_mode: \w+", output, re.M), shown
    elif kind_ == "check":
        assert '"ok": true' in run.stdout, shown
    elif kind_ == "lab help":
        assert "usage: python -m maspo_verl.lab" in run.stdout, shown


# ---- every `python -m maspo_verl...` command of the README and docs/, checked at least by a dry run ----------------

MODULE = re.compile(r"(?:^|[\s/])python -m (maspo_verl[\w.]*)(?:\s+|$)")
# what a trainer command needs that a docs page leaves to the reader: its own model, data or reward files
PLACEHOLDER = re.compile(r"=(/|~|\$)|=[^\s=]*\.(parquet|py|json|yaml)(\s|$)")


def maspo_commands() -> list[tuple[str, str, str]]:
    """(where, module, arguments) of each documented command that runs ``python -m maspo_verl...`` and that
    ``documented()`` does not run already (a bad override, a dry run, `check`, the lab's `--help`); the
    arguments are those after the module, without a trailing comment; each distinct command once."""
    already = {re.sub(r"\s+#.*$", "", c) for _, _, c in documented()}
    seen, out = set(), []
    for path in [README, *PAGES]:
        for where, command in commands(path):
            command = re.sub(r"\s+#.*$", "", command)
            found = MODULE.search(command)
            if not found or command in already:
                continue
            module, args = found.group(1), " ".join(command[found.end() :].split())
            if (module, args) not in seen:  # the same command inside `ray job submit --` is the same command
                seen.add((module, args))
                out.append((where, module, args))
    return out


def trainer_runs_here(args: str) -> bool:
    """A trainer command this machine can run as printed: the local mode, nothing left to the reader."""
    return "local=cpu" in args.split() and not PLACEHOLDER.search(args)


# the lab's and other modules' commands: the lab's by its own argument parser (a number left to the reader, `N`,
# as 1), the others' modules imported, in one interpreter
CHECK_MODULES = """
import importlib, json, shlex, sys, traceback
from maspo_verl.lab.__main__ import parse
results = []
for module, args in json.loads(sys.argv[1]):
    try:
        if module == "maspo_verl.lab":
            parse(["1" if a == "N" else a for a in shlex.split(args)])
        else:
            importlib.import_module(module)
        results.append(None)
    except SystemExit as exc:
        results.append(f"exit {exc.code}")
    except Exception:
        results.append(traceback.format_exc(limit=3))
print(json.dumps(results))
"""

# the trainer's commands as dry runs, in one interpreter: the command line's own checks, Hydra's composition,
# then maspo_verl.main.run with maspo.dry_run=true (and maspo.preflight=warn where a path is the reader's)
CHECK_DRY_RUNS = """
import contextlib, io, json, shlex, sys
from maspo_verl import main
from maspo_verl.reference import compose_config
from maspo_verl.validation import root_cause
results = []
for args, warn in json.loads(sys.argv[1]):
    overrides = [a for a in shlex.split(args) if "=" in a and not a.startswith("-")]
    overrides += ["maspo.dry_run=true"] + ["maspo.preflight=warn"] * warn
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main.check_policy_loss_overrides(overrides)
            main.run(compose_config(*overrides))
        results.append([None, out.getvalue()])
    except BaseException as exc:
        cause = root_cause(exc)
        results.append([f"{type(cause).__name__}: {cause}", out.getvalue()[-2000:]])
print("RESULTS " + json.dumps(results))
"""


def test_every_documented_maspo_command_is_found():
    found = maspo_commands()
    modules = {module for _, module, _ in found}
    assert {"maspo_verl.main", "maspo_verl.lab"} <= modules, modules
    where = {w.split(":")[0] for w, _, _ in found}
    assert {"README.md", "docs/agents.md", "docs/local.md", "docs/lab.md"} <= where, where
    # the README's first command, after its set-up, and one run inside `ray job submit`
    args = {a for _, m, a in found if m == "maspo_verl.main"}
    assert "local=cpu loss=maspo_fixed" in args


def test_every_documented_trainer_command_passes_its_dry_run(tmp_path):
    """Each documented ``python -m maspo_verl.main ...`` as a dry run: a changed default (bypass mode, once) or a
    renamed key that strands a page fails here, naming the page and line."""
    runs = [(w, a) for w, m, a in maspo_commands() if m == "maspo_verl.main"]
    payload = json.dumps([[a, not trainer_runs_here(a)] for _, a in runs])
    env = {**os.environ, "MASPO_VERL_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", CHECK_DRY_RUNS, payload], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    failed = {}
    for (where, args), (error, printed) in zip(runs, json.loads(lines[-1][len("RESULTS ") :]), strict=True):
        if error is not None or not re.search(r"^\s*loss_mode: \w+", printed, re.M):
            failed[f"{where}: {args}"] = error or printed[-500:]
    assert not failed, "\n".join(f"{k}\n    {v}" for k, v in failed.items())


def test_every_other_documented_maspo_command_parses(tmp_path):
    """The lab's commands by the lab's own argument parser (their runs take hours), the other modules imported."""
    others = [(w, m, a) for w, m, a in maspo_commands() if m != "maspo_verl.main"]
    payload = json.dumps([[m, a] for _, m, a in others])
    env = {**os.environ, "MASPO_VERL_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", CHECK_MODULES, payload], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    failed = {f"{w}: python -m {m} {a}": r for (w, m, a), r in zip(others, results, strict=True) if r is not None}
    assert not failed, failed


def _full_runs():
    return [(w, a) for w, m, a in maspo_commands() if m == "maspo_verl.main" and trainer_runs_here(a)]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(("where", "args"), _full_runs(), ids=[w for w, _ in _full_runs()])
def test_documented_trainer_command_runs_as_printed(where, args, tmp_path, venv_python):
    """Each documented local-mode trainer command, run in full as printed (a fresh shell, an empty HOME and cache):
    it ends with its closing block saying done."""
    command = next(c for w, c in [(w, c) for p in [README, *PAGES] for w, c in commands(p)] if w == where)
    command = command.split("bash .ci/setup && ", 1)[-1].replace(".venv/bin/python ", "python ", 1)
    command = re.sub(r"^ray job submit -- ", "", command)
    script = f"{activation()}\ncd {tmp_path}\n{command}\n"  # its run folder and checkpoints in the test's folder
    env = {**fresh_env(tmp_path), "PYTHONPATH": str(ROOT)}  # this checkout's package, run from elsewhere
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1500)  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "==== maspo_verl local run done:" in output, f"{where}: {command}\n{output[-4000:]}"


@pytest.fixture
def bare_python(tmp_path):
    """An interpreter with nothing installed (as a fresh shell without the venv has)."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, capture_output=True)
    return bare / "bin" / "python"


def test_recipe_without_the_package_says_what_to_do(tmp_path, bare_python):
    """A recipe run by an interpreter that lacks the package stops before doing anything, naming the fix."""
    env = {**fresh_env(tmp_path), "PYTHON": str(bare_python), "DRY_RUN": "1"}
    run = subprocess.run(["bash", str(ROOT / "recipes" / "math" / "run_gspo.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "lacks maspo_verl hydra verl" in run.stderr and "source .venv/bin/activate" in run.stderr, run.stderr
    assert "command:" not in run.stdout  # stopped before launching


def test_lab_without_its_dependencies_says_what_to_do(tmp_path, bare_python):
    """From the checkout's root the package itself imports; the lab names what is missing before any work."""
    run = subprocess.run([str(bare_python), "-m", "maspo_verl.lab", "race"], cwd=ROOT, env=fresh_env(tmp_path),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "lacks torch, verl, hydra, matplotlib" in run.stderr and "source .venv/bin/activate" in run.stderr


# ---- docs that agree with the code ------------------------------------------------------------------------------


def lab_commands(path: Path) -> set[str]:
    return {m for _, block in bash_blocks(path) for m in re.findall(r"python -m maspo_verl\.lab ([a-z]\w*)", block)}


def test_the_lab_commands_are_the_declared_studies():
    """The CLI's commands are the study modules that declare one; docs/lab.md's table (generated from the
    declarations, read without importing the lab) lists the same, and every command a doc runs is one of them."""
    from maspo_verl import reference
    from maspo_verl.lab.engine import study

    cli = set(study.commands())
    assert cli == set(reference.lab_commands()) and {"granularity", "regimes", "learn"} <= cli
    assert all(reference.lab_commands()[c][1] == m.STUDY.folder for c, m in study.commands().items())
    assert lab_commands(ROOT / "docs" / "lab.md") <= cli
    assert lab_commands(ROOT / "docs" / "results" / "README.md") <= cli


@pytest.mark.parametrize("doc", ["README.md", "docs/algorithms.md"])
def test_the_acronym_says_which_maspo(doc):
    """ "MASPO" also names an unrelated method (Mass-Adaptive Soft Policy Optimization, arXiv 2602.17550):
    the README and the algorithms page say, in one sentence, which one this is."""
    text = " ".join((ROOT / doc).read_text().split())
    sentence = next((s for s in re.split(r"(?<=[.)])\s+(?=[A-Z])", text) if "2602.17550" in s), "")
    assert "Adaptive Granularity Importance Sampling for Policy Optimization" in sentence, sentence
    assert "Mass-Adaptive Soft Policy Optimization" in sentence and "not" in sentence


def test_the_calibration_example_runs_from_what_the_doc_says():
    """docs/calibration.md quotes the command that makes its example corpus (the one recorded in the
    results' COMMAND.txt), its examples write under the ignored ``outputs/`` (no ``--out`` of a folder
    git would see), and it states how far the example's F1 values moved when re-made."""
    doc = (ROOT / "docs" / "calibration.md").read_text()
    made_by = (ROOT / "docs" / "results" / "segments" / "COMMAND.txt").read_text()
    corpus = re.search(r"^input made by: (.+)$", made_by, re.M).group(1).strip()
    blocks = re.findall(r"```bash\n(.*?)```", doc, re.S)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    assert corpus in commands
    lab = [c for c in commands if c.startswith("python -m maspo_verl.lab segments")]
    assert lab and all("--out" not in c for c in lab), lab
    assert "outputs/lab/segments/" in doc and "outputs/" in (ROOT / ".gitignore").read_text().split()
    assert "+-0.01" in doc


# ---- the README is a landing page ---------------------------------------------------------------------------------

README_BUDGET = 150  # lines: what a user reads before choosing a page


def test_the_readme_stays_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_BUDGET, (
        f"README.md has {len(lines)} lines (budget {README_BUDGET}): move detail to docs/"
    )


def test_every_page_is_linked_from_the_readme_and_every_link_resolves():
    text = README.read_text()
    linked = set(re.findall(r"\]\(([^)#\s]+)\)", text))
    for page in PAGES:
        assert str(page.relative_to(ROOT)) in linked, f"README.md links no {page.relative_to(ROOT)}"
    for doc in [README, *PAGES]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+://", target):
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}, which does not exist"
