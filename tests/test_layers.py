"""The package's layers (docs/contributing.md, "Layout"): core <- plugin <- recipes and tools.

Imports are read from the source with ``ast`` (function-local imports count too), so a module that
imports upward fails here whether or not the import runs.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "maspo_verl"

# the core layer: the pipeline's folder (maspo_verl/core/) and the modules beside it that it and the config use
CORE = {
    "maspo_verl",
    "core",
    "config",
    "config_fields",
    "validation",
    "advantages",
    "rollout_correction",
    "batch",
    "util",
    "fsq",
    "inspection",
    "vocab",
    "batch_sizes",
}
# the modules of the pipeline's folder, which the layout lists too
PIPELINE = {p.stem for p in (PACKAGE / "core").iterdir() if p.suffix == ".py" and p.stem != "__init__"} | {"segments"}
# what each part may import from the package, besides itself (ARCHITECTURE: core <- plugin <- recipes and tools)
ALLOWED = {
    "core": {"core"},
    "plugin": {"core"},
    "main": {"core", "plugin", "local", "reference"},
    "reference": {"core", "choosing"},
    "choosing": set(),  # docs/choosing.md from the committed result tables: no package import
    "local": {"core", "plugin", "pretrained", "speech"},  # speech: the toy speech task's word spans
    "speech": {"core", "plugin"},
    "math": {"core", "plugin"},
    "lab": {"core", "plugin", "speech", "math", "main", "local", "reference", "choosing", "pretrained"},
    "pretrained": {"core"},  # real models prepared into the cache, and their tasks
    "hydra_configs": set(),
}
PURE_HELPERS = [
    "maspo_verl.speech.text",
    "maspo_verl.speech.tokens",
    "maspo_verl.speech.spans",
    "maspo_verl.math.prepare",
    "maspo_verl.vocab",
    "maspo_verl.local.turns",
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    rest = module.split(".")[1:] or ["maspo_verl"]
    if rest[0] in CORE:
        return "core"
    if rest[0] == "plugin":
        return "plugin"
    if rest[0] == "__main__":
        return "main"
    return rest[0]


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Our modules that ``path`` imports (``from maspo_verl import x`` resolves to ``maspo_verl.x``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("maspo_verl")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("maspo_verl"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (REPO / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    REPO / Path(*candidate.split(".")) / "__init__.py"
                ).exists()
                found.add(candidate if is_module else node.module)
        elif isinstance(node, ast.Try) and top_level_only:  # the plugin imports inside try
            for inner in node.body:
                if isinstance(inner, ast.ImportFrom) and inner.module and inner.module.startswith("maspo_verl"):
                    found.add(inner.module)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_downward(module):
    part = part_of(module)
    allowed = ALLOWED[part] | {part}
    upward = {m for m in imports(MODULES[module]) if part_of(m) not in allowed}
    assert not upward, f"{module} ({part}) imports {sorted(upward)}; {part} may import {sorted(allowed)}"


def test_the_lab_engine_imports_no_study():
    """maspo_verl/lab/engine/ is what every study stands on: it never imports a study (lab/studies/), which finds
    the studies by their declarations instead (``engine.study``); a study imports the engine."""
    engine = {m for m in MODULES if m.startswith("maspo_verl.lab.engine")}
    assert {"maspo_verl.lab.engine.study", "maspo_verl.lab.engine.stats", "maspo_verl.lab.engine.presets"} <= engine
    for module in engine:
        studies = {m for m in imports(MODULES[module]) if m.startswith("maspo_verl.lab.studies")}
        assert not studies, f"{module} imports {sorted(studies)}"


def test_no_study_imports_another_study():
    """A study (a module of maspo_verl/lab/studies/) stands on the engine alone: what two studies share lives in
    maspo_verl/lab/engine/, once, so no study imports another study's module."""
    studies = {m for m in MODULES if m.startswith("maspo_verl.lab.studies.")}
    assert {"maspo_verl.lab.studies.granularity", "maspo_verl.lab.studies.learn"} <= studies
    for module in studies:
        others = {m for m in imports(MODULES[module]) if m.startswith("maspo_verl.lab.studies.") and m != module}
        assert not others, f"{module} imports {sorted(others)}: move what they share into maspo_verl/lab/engine/"


def test_core_and_plugin_know_no_recipe_class():
    for module, path in MODULES.items():
        if part_of(module) in ("core", "plugin"):
            assert "SpeechRewardManager" not in path.read_text(), module


@pytest.mark.parametrize("top_level_only", [True, False], ids=["at-import-time", "function-local-too"])
def test_no_import_cycle(top_level_only):
    graph = {m: {i for i in imports(p, top_level_only) if i in MODULES} for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack, node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_readme_layout_lists_the_core_modules():
    import re

    layout = (REPO / "docs" / "contributing.md").read_text().split("## Layout", 1)[1]
    block = layout.split("```", 2)[1]
    core = block.split("\ncore ", 1)[1]
    assert CORE - {"maspo_verl"} | PIPELINE <= set(re.findall(r"\w+", core))
    rows = set(re.findall(r"`maspo_verl/(\w+)", layout))
    assert CORE - {"maspo_verl"} <= rows, (CORE - {"maspo_verl"}) - rows


def test_package_docstring_lists_the_core_modules():
    import re

    import maspo_verl

    core = maspo_verl.__doc__.split("- core (", 1)[1].split("\n- ", 1)[0]
    assert set(re.findall(r"``(\w+)``", core)) == CORE - {"maspo_verl"}


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pure_helpers_import_neither_verl_nor_torch():
    heavy = _fresh(
        f"import sys, json, {', '.join(PURE_HELPERS)}\n"
        "print(json.dumps([m for m in ('verl', 'torch', 'ray') if m in sys.modules]))"
    )
    assert heavy == []


def test_importing_the_core_registers_and_patches_nothing():
    loaded = _fresh(
        "import sys, json\n"
        "sys.modules['maspo_verl.plugin'] = None  # verl cannot load the plugin in this process\n"
        "import maspo_verl.config, maspo_verl.core.losses, maspo_verl.advantages, maspo_verl.core.token_sets\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R, ADV_ESTIMATOR_REGISTRY as A\n"
        "import verl.workers.utils.losses as L\n"
        "print(json.dumps([n for n in ('maspo', 'ctpo', 'pgspo') if n in R] + [n for n in A if 'maspo' in n]\n"
        "  + (['ppo_loss hook'] if hasattr(L.ppo_loss, '__maspo_original__') else [])))\n"
    )
    assert loaded == []


@pytest.mark.parametrize("first", ["config", "core.losses", "speech.reward_manager"])
def test_import_verl_registers_whatever_module_comes_first(first):
    """``import verl`` loads the plugin while the first of our modules may be half-imported."""
    registered = _fresh(
        f"import json, maspo_verl.{first}\n"
        "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R, ADV_ESTIMATOR_REGISTRY as A\n"
        "print(json.dumps([n for n in ('maspo', 'ctpo', 'pgspo', 'maspo_span_grpo') if n in R or n in A]))\n"
    )
    assert registered == ["maspo", "ctpo", "pgspo", "maspo_span_grpo"]
