"""Blocks and module groups: discovery, `--freeze`, `--group` overrides and the automatic groups by modality."""
from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from runtime.program import block_modules
from plans.errors import MmplanError


def discover_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Blocks in definition order: container elements plus maximal container-free submodules."""
    return list(block_modules(model).items())


def freeze_blocks(model: nn.Module, patterns: Sequence[str], name: str = "the model") -> None:
    """`--freeze`: stop the parameters of every block matching one of `patterns` (fnmatch on block names) from
    requiring grad, so the profile measures what training them frozen costs. A pattern matching no block, or
    patterns leaving no block to train, are errors."""
    if not patterns:
        return
    blocks = block_modules(model)
    for pattern in patterns:
        matched = [b for b in blocks if fnmatchcase(b, pattern)]
        if not matched:
            raise MmplanError(f"--freeze {pattern!r} matches no block of {name} (blocks: {_names_hint(list(blocks))})")
        for b in matched:
            blocks[b].requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise MmplanError(f"--freeze {' '.join(patterns)} freezes every parameter of {name}: nothing would train")


def _names_hint(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def default_group(block_name: str) -> str:
    """Module groups are the model's top-level children; a top-level block is its own group."""
    return block_name.split(".", 1)[0]


def parse_group_overrides(specs: list[str]) -> list[tuple[str, str]]:
    """`PATTERN=GROUP` items (fnmatch on block names, later items win) -> [(pattern, group)]."""
    out = []
    for spec in specs:
        pattern, sep, group = spec.partition("=")
        if not sep or not pattern or not group:
            raise MmplanError(f"--group expects PATTERN=GROUP (e.g. 'llm.head=head'), got {spec!r}")
        out.append((pattern, group))
    return out


def auto_groups(records, trace) -> dict[str, str]:
    """Block -> group by modality (planner/profiler/groups.py), or {} where the top-level children are the groups."""
    from planner.profiler.groups import modality_groups

    edges = [(s, d) for s, d in trace.edges if not s.startswith("input:")]
    inputs = [(s.removeprefix("input:"), d) for s, d in trace.edges if s.startswith("input:")]
    embedders = {r.name for r in records if r.embeds_input}
    return modality_groups([r.name for r in records], edges, inputs, embedders) or {}


def check_overrides(overrides, names: list[str], auto: dict[str, str]) -> None:
    """A --group pattern must match a block (by name) or a group (by its automatic name)."""
    for pattern, _ in overrides:
        if not any(fnmatchcase(n, pattern) for n in names) and not any(fnmatchcase(g, pattern) for g in set(auto.values())):
            raise MmplanError(f"--group {pattern}=...: the pattern matches no block (nor group); blocks are named like "
                              f"{names[0]!r} ... {names[-1]!r}")

