"""runtime/ and plans/ import without circles, counting imports inside functions too (each held one open)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> nx.DiGraph:
    graph = nx.DiGraph()
    for path in (ROOT / package).glob("*.py"):
        module = package if path.stem == "__init__" else f"{package}.{path.stem}"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = (package + (f".{node.module}" if node.module else "")) if node.level else (node.module or "")
            if base.split(".")[0] not in ("runtime", "plans") or base.startswith("runtime.models"):
                continue
            targets = [base] if "." in base else [f"{base}.{a.name}" for a in node.names]
            graph.add_edges_from((module, t) for t in targets)
    return graph


def test_runtime_and_plans_have_no_import_cycles():
    for package in ("runtime", "plans"):
        cycles = list(nx.simple_cycles(_imports(package)))
        assert not cycles, [" -> ".join(c) for c in cycles]
