"""The floors of the house: which of our packages may import which (docs/architecture.md, "Floors").

plans/ is the contract and imports none of ours; cost_models/ and runtime/ never import each other or planner/;
the solver and the exporters never import the runtime or the terminal. Every import counts, a function-level one too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("plans", "cost_models", "runtime", "planner")

# package (a folder under the root) -> the modules of ours it must never import (prefixes of dotted names)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "plans": ("cost_models", "runtime", "planner"),
    "cost_models": ("runtime", "planner"),
    "runtime": ("cost_models", "planner"),
    "planner/solver": ("runtime", "planner.console", "planner.cli", "planner.commands"),
    "planner/export": ("runtime", "planner.console", "planner.cli", "planner.commands"),
}


def imported(path: Path) -> set[str]:
    """The dotted names of our modules that `path` imports, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] in OURS}


def violations(folder: str, banned: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in sorted(imported(path)):
            if any(name == b or name.startswith(b + ".") for b in banned):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_goes_down_a_floor_it_must_not(folder):
    assert (ROOT / folder).is_dir(), folder
    assert not violations(folder, FORBIDDEN[folder])


def test_the_check_sees_function_level_imports(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from runtime.zero import x\n    import planner.cli\n")
    assert imported(tmp_path / "m.py") == {"runtime.zero", "runtime.zero.x", "planner.cli"}
