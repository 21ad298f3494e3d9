"""The path of one loss call, measured: the distinct functions of the package that one CPU ``maspo_fixed`` loss call
(uncompiled) enters, traced with ``sys.setprofile``. At most 18 functions in at most 8 files, and exactly the ones
docs/contributing.md lists under "One loss call", so the list and the code cannot drift apart."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl.config import actor_config
from tests.helpers import REPO, preset_fields

PACKAGE = REPO / "maspo_verl"
# a comprehension's body is part of the function that holds it (Python 3.12 inlines list, dict and set ones)
COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}
MAX_FUNCTIONS, MAX_FILES = 18, 8


def call_path(preset: str) -> list[tuple[str, str]]:
    """(file under maspo_verl/, qualified name) of each package function one loss call of ``preset`` enters, in the
    order first entered (after a warm-up call, so one-time imports are not counted)."""
    clips, fields = preset_fields(preset)
    actor = actor_config(**clips, **{**fields, "compile": False})
    loss_fn = get_policy_loss_fn(fields["loss_mode"])
    g = torch.Generator().manual_seed(0)
    old = -3.0 * torch.rand(3, 40, generator=g)
    new = (old + 0.1 * torch.randn(3, 40, generator=g)).requires_grad_()
    adv, mask = torch.randn(3, 40, generator=g), torch.rand(3, 40, generator=g) < 0.8
    args = (old, new, adv, mask, actor.loss_agg_mode, actor)
    loss_fn(*args)
    seen: dict[tuple[str, str], None] = {}
    package = str(PACKAGE) + "/"

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(package) and code.co_name not in COMPREHENSIONS:
            seen.setdefault((str(Path(code.co_filename).relative_to(PACKAGE)), code.co_qualname), None)

    sys.setprofile(profile)
    try:
        loss_fn(*args)
    finally:
        sys.setprofile(None)
    return list(seen)


def documented() -> tuple[list[tuple[str, str]], int]:
    """The functions docs/contributing.md's "One loss call" list names (each under the file named last before it),
    and the count it states for ``maspo_logprob``."""
    text = (REPO / "docs" / "contributing.md").read_text()
    section = text.split("**One loss call**", 1)[1]
    items = re.findall(r"^\d+\. .*(?:\n {3}.*)*", section.split("\n\n", 2)[1], re.M)
    names, file = [], None
    for token in re.findall(r"`([^`]+)`", "\n".join(items)):
        if token.endswith(".py"):
            file = token
        else:
            names.append((file, token))
    logprob = int(re.search(r"(\d+) with `maspo_logprob`", section).group(1))
    return names, logprob


def test_one_maspo_fixed_call_enters_few_functions_in_few_files():
    path = call_path("maspo_fixed")
    files = {file for file, _ in path}
    listing = "\n".join(f"{file} {name}" for file, name in path)
    assert len(path) <= MAX_FUNCTIONS, f"{len(path)} functions:\n{listing}"
    assert len(files) <= MAX_FILES, f"{len(files)} files: {sorted(files)}"


def test_contributing_lists_exactly_the_traced_path():
    names, logprob = documented()
    assert len(names) == len(set(names)), "a function is listed twice"
    assert set(names) == set(call_path("maspo_fixed")), "docs/contributing.md 'One loss call' differs from the trace"
    path = call_path("maspo_logprob")
    assert logprob == len(path), f"maspo_logprob enters {len(path)} functions, the list says {logprob}"
    assert len({file for file, _ in path}) <= MAX_FILES
