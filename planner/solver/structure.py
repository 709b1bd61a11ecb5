"""A profile's units under a structure (chain, non-colocated, colocated): which runs of blocks get one layout."""
from __future__ import annotations

from typing import Literal

from cost_models.memory import block_input_bytes
from planner.solver.space import Feed, Unit
from plans.graph import Profile

Structure = Literal["chain", "non-colocated", "colocated"]


def profile_units(profile: Profile, structure: Structure) -> tuple[Unit, ...] | None:
    """The units of a profile for a structure; None when the profile's groups do not fit it.

    chain: one unit of every block (one layout for the whole model, cut anywhere: the homogeneous shape).
    non-colocated / colocated: one unit per profile group, except that a group of at most SMALL_GROUP blocks with at
    most SMALL_SHARE of the FLOPs of its neighbour (a projector, a contrastive head) joins the group it takes
    its input from when that one runs right before it, else the group after it -- such a group would
    otherwise multiply the search for nothing. The
    result must be sources feeding one sink (the unit holding the last block), each unit a contiguous run
    of blocks: encoders in front of an LLM, two towers into a head. Other shapes get only the chain.
    """
    blocks = profile.blocks
    index = {b.name: i for i, b in enumerate(blocks)}
    inputs = block_input_bytes(profile)
    if structure == "chain":
        return (_unit("model", list(range(len(blocks))), profile, index, inputs, ()),)
    runs: list[list[int]] = []  # contiguous runs of one group, in execution order
    for i, b in enumerate(blocks):
        if runs and blocks[runs[-1][0]].group == b.group:
            runs[-1].append(i)
        else:
            runs.append([i])
    if len({blocks[r[0]].group for r in runs}) != len(runs):
        return None  # a group's blocks are not contiguous
    owner = {i: k for k, r in enumerate(runs) for i in r}
    feeds = {(owner[index[e.src]], owner[index[e.dst]]) for e in profile.edges if owner[index[e.src]] != owner[index[e.dst]]}
    merged = [list(r) for r in runs]
    target = list(range(len(runs)))
    work = [sum(blocks[i].fwd_flops + blocks[i].bwd_flops for i in r) for r in runs]
    for k, r in enumerate(runs):
        if len(r) > SMALL_GROUP or len(runs) == 1:
            continue
        into = k - 1 if k > 0 and (k - 1, k) in feeds else k + 1 if k + 1 < len(runs) else None
        if into is not None and work[k] <= SMALL_SHARE * work[into]:
            target[k] = _find(target, into)
    groups: dict[int, list[int]] = {}
    for k in range(len(runs)):
        groups.setdefault(_find(target, k), []).extend(merged[k])
    parts = [sorted(v) for _, v in sorted(groups.items(), key=lambda kv: min(kv[1]))]
    if any(p != list(range(p[0], p[-1] + 1)) for p in parts):
        return None
    unit_of = {i: u for u, p in enumerate(parts) for i in p}
    if any(len({unit_of[index[b]] for b in t.blocks if b in index}) > 1 for t in profile.ties):
        return None  # a parameter tied across units: the runtime holds a tie within one group (plans/capabilities.py)
    sink = unit_of[len(blocks) - 1]
    cross = [(unit_of[index[e.src]], unit_of[index[e.dst]], e) for e in profile.edges if unit_of[index[e.src]] != unit_of[index[e.dst]]]
    if len(parts) < 2 or any(d != sink or s == sink for s, d, _ in cross):
        return None
    names = [_unit_name(profile, p) for p in parts]
    out = []
    for u, p in enumerate(parts):
        if u == sink:
            unit_feeds = tuple(
                Feed(names[s], min(index[e.dst] for a, _, e in cross if a == s) - p[0], min(e.bytes for a, _, e in cross if a == s))
                for s in sorted({a for a, _, _ in cross}))
            out.append(_unit(names[u], p, profile, index, inputs, unit_feeds))
        else:
            sent = [e.bytes for a, _, e in cross if a == u]
            if not sent:
                return None  # a unit that feeds nothing: not the sources-into-one-sink shape
            out.append(_unit(names[u], p, profile, index, inputs, (), min(sent)))
    return tuple(out)


SMALL_GROUP = 2  # blocks; see profile_units
SMALL_SHARE = 0.25  # of the neighbour's FLOPs


def _find(target: list[int], k: int) -> int:
    while target[k] != k:
        k = target[k]
    return k


def _unit_name(profile: Profile, indices: list[int]) -> str:
    """The name of the unit's largest profile group (by blocks), e.g. "vision" for vision + vision_proj."""
    counts: dict[str, int] = {}
    for i in indices:
        counts[profile.blocks[i].group] = counts.get(profile.blocks[i].group, 0) + 1
    return max(counts, key=lambda g: (counts[g], -indices.index(next(i for i in indices if profile.blocks[i].group == g))))


def _unit(name: str, indices: list[int], profile: Profile, index: dict[str, int], inputs: dict[str, float],
          feeds: tuple[Feed, ...], out_bytes: float = 0.0) -> Unit:
    blocks = tuple(profile.blocks[i] for i in indices)
    first, n = indices[0], len(indices)
    # A cut before block j: the chunk starting at j receives, as parallel routes (plans/stage_graph.py), the
    # whole output of every earlier block it reads; the largest one read by block j itself bounds the wait.
    cross = [0.0] * (n + 1)
    reads: list[set[int]] = [set() for _ in range(n)]
    for e in profile.edges:
        a, b = index[e.src] - first, index[e.dst] - first
        if 0 <= a < b < n:
            cross[b] = max(cross[b], blocks[a].output_bytes)
            reads[b].add(a)
    ties = tuple((index[t.blocks[0]] - first, tuple(index[b] - first for b in t.blocks[1:]), t.params)
                 for t in profile.ties if all(0 <= index.get(b, -1) - first < n for b in t.blocks))
    return Unit(name, blocks, feeds, out_bytes, tuple(inputs[b.name] for b in blocks), tuple(cross),
                tuple(tuple(sorted(r)) for r in reads), ties)
