"""docs/architecture.md names exactly the files that exist: every module of the four packages, and no other."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plans", "cost_models", "planner", "runtime")


def modules() -> dict[str, Path]:
    """File name (and package-relative path) -> path of every module of the packages, __init__ left out."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py" and "examples" not in path.parts:
                out[str(path.relative_to(ROOT))] = path
    return out


def test_every_module_is_named():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([A-Za-z_/]+\.py)`?", doc))
    names = {Path(n).name for n in named}
    missing = [m for m in modules() if Path(m).name not in names]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_named_module_exists():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    existing = {Path(m).name for m in modules()}
    absent = sorted({n for n in re.findall(r"`(?:[a-z_]+/)*([a-z_]+\.py)", doc)} - existing)
    assert not absent, f"docs/architecture.md names modules that do not exist: {absent}"


def test_the_glossary_comes_first():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert doc.index("## Glossary") < doc.index("Data flows one way")
    for word in ("layout", "stage", "boundary", "placement", "colocated", "non-colocated", "tier"):
        assert f"**{word}**" in doc, word
