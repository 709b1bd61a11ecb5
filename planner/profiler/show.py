"""`mmplan show`: a rich summary of a profile — groups, largest blocks, edges between groups."""
from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.console import human_count, safe
from plans.units import format_bytes
from plans.graph import Profile


def group_totals(profile: Profile) -> dict[str, dict[str, float]]:
    """Per group: blocks, params, FLOPs and activation bytes per sample."""
    totals: dict[str, dict[str, float]] = {g: defaultdict(float) for g in profile.groups}
    for b in profile.blocks:
        t = totals[b.group]
        t["blocks"] += 1
        t["params"] += b.params
        t["fwd_flops"] += b.fwd_flops
        t["bwd_flops"] += b.bwd_flops
        t["activation_bytes"] += b.activation_bytes
    return totals


def group_modules(profile: Profile) -> dict[str, str]:
    """Per group: the module subtrees holding its blocks — for each block its highest ancestor under which every
    block is of the same group (at most three shown). Linear in blocks x name depth (a 10,000-block profile)."""
    under: dict[str, set[str]] = defaultdict(set)  # module path -> the groups of the blocks strictly under it
    for b in profile.blocks:
        parts = b.name.split(".")
        for i in range(1, len(parts)):
            under[".".join(parts[:i])].add(b.group)
    roots: dict[str, dict[str, None]] = defaultdict(dict)
    for b in profile.blocks:
        parts, best = b.name.split("."), b.name
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if under[prefix] != {b.group}:
                break
            best = prefix
        roots[b.group].setdefault(best)
    return {g: ", ".join(list(r)[:3]) + (", ..." if len(r) > 3 else "") for g, r in roots.items()}


def cross_group_edges(profile: Profile) -> list[tuple[str, str, str, str, float]]:
    group = {b.name: b.group for b in profile.blocks}
    return [(group[e.src], group[e.dst], e.src, e.dst, e.bytes) for e in profile.edges if group[e.src] != group[e.dst]]


def render_profile(profile: Profile, console: Console, top: int = 5) -> None:
    measured = f", measured on {profile.measured_on}" if profile.measured_on else ""
    console.print(f"[bold]{safe(profile.model)}[/]  {len(profile.blocks)} blocks, {len(profile.groups)} groups, "
                  f"dtype {safe(profile.dtype)}, profiled at micro-batch {profile.micro_batch}{safe(measured)}  "
                  f"[dim]fingerprint {safe(profile.fingerprint)}[/]", markup=True)
    table = Table(title="Module groups (per sample)", title_justify="left")
    for col in ("group", "modules", "blocks", "params", "fwd FLOPs", "bwd FLOPs", "activations"):
        table.add_column(col, justify="left" if col in ("group", "modules") else "right")
    totals = group_totals(profile)
    where = group_modules(profile)
    for g, t in totals.items():
        table.add_row(g, where[g], f"{t['blocks']:.0f}", human_count(t["params"]), human_count(t["fwd_flops"], "FLOP"),
                      human_count(t["bwd_flops"], "FLOP"), format_bytes(t["activation_bytes"]))
    all_t = {k: sum(t[k] for t in totals.values()) for k in ("blocks", "params", "fwd_flops", "bwd_flops", "activation_bytes")}
    table.add_row(Text("total", style="bold"), "", f"{all_t['blocks']:.0f}", human_count(all_t["params"]),
                  human_count(all_t["fwd_flops"], "FLOP"), human_count(all_t["bwd_flops"], "FLOP"),
                  format_bytes(all_t["activation_bytes"]))
    console.print(table)

    big = Table(title=f"Largest blocks (by forward FLOPs)", title_justify="left")
    for col in ("block", "kind", "params", "fwd FLOPs", "activations", "fwd/bwd ms"):
        big.add_column(col, justify="left" if col in ("block", "kind") else "right")
    for b in sorted(profile.blocks, key=lambda b: (-b.fwd_flops, -b.params))[:top]:
        ms = f"{b.fwd_ms:.2f}/{b.bwd_ms:.2f}" if b.fwd_ms is not None else "-"
        big.add_row(b.name, b.kind, human_count(b.params), human_count(b.fwd_flops, "FLOP"),
                    format_bytes(b.activation_bytes), ms)
    console.print(big)

    edges = Table(title="Edges between groups (per sample)", title_justify="left")
    for col in ("from", "to", "blocks", "bytes"):
        edges.add_column(col, justify="right" if col == "bytes" else "left")
    for sg, dg, src, dst, nbytes in cross_group_edges(profile):
        edges.add_row(sg, dg, f"{src} -> {dst}", format_bytes(nbytes))
    console.print(edges)
