"""Parameters tied across pipeline stages (a token embedding and its tied LM head on two stages): the copies' cost.

Megatron-LM's way (Shoeybi et al. 2019; Narayanan et al. 2021, section 3: the first and last stage each hold the
word embeddings, and `_allreduce_word_embedding_grads` sums their gradients over the "embedding group" after the
backward, before the optimizer step): every stage holding some of a tie's blocks but not its owner (the block whose
`params` count it, plans/graph.Tie) holds a copy, with its gradients and optimizer state, updated identically. The
copy is counted in the stage's first tied block (`with_copies`: memory, gradient sync, optimizer and ZeRO work then
see it like any other parameter), and each holder stage's tail adds the all-reduce of the tie's gradient over the
holders (`tie_syncs`, priced by tail.tie_sync_time).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cost_models.comm import collective_link
from cost_models.compute import tp_shard
from cost_models.tail import tie_sync_time
from plans.cluster import Cluster
from plans.graph import Block, Profile, Tie
from plans.plan import Plan


@dataclass(frozen=True, slots=True)
class TieSync:
    """One tie whose copies sit on several stages: the indices (into the stages given) of the stages holding it."""

    tie: Tie
    stages: tuple[int, ...]


def tie_syncs(profile: Profile, stages: Sequence[Iterable[str]]) -> list[TieSync]:
    """The ties held by two or more of `stages` (each a stage's blocks), with the stages holding them."""
    sets = [set(s) for s in stages]
    out = []
    for t in profile.ties:
        holders = tuple(i for i, s in enumerate(sets) if s.intersection(t.blocks))
        if len(holders) > 1:
            out.append(TieSync(t, holders))
    return out


def copy_blocks(profile: Profile, stages: Sequence[Iterable[str]]) -> dict[str, Tie]:
    """Block -> a tie it holds a copy of: per tie held by several stages, the first tied block (in the tie's order) of
    each holder stage that lacks the owner."""
    out: dict[str, Tie] = {}
    sets = [set(s) for s in stages]
    for sync in tie_syncs(profile, stages):
        for i in sync.stages:
            if sync.tie.blocks[0] not in sets[i]:
                first = next(b for b in sync.tie.blocks if b in sets[i])
                out[first] = sync.tie
    return out


def with_copies(profile: Profile, stages: Sequence[Iterable[str]]) -> dict[str, Block]:
    """The profile's blocks by name, each copy holder's figures raised by its copy (parameters, bytes, one tensor)."""
    blocks = {b.name: b for b in profile.blocks}
    for name, t in copy_blocks(profile, stages).items():
        b = blocks[name]
        blocks[name] = replace(b, params=b.params + t.params, param_bytes=b.param_bytes + t.param_bytes,
                               param_tensors=b.param_tensors + (0 if b.frozen else 1))
    return blocks


def plan_stages(plan: Plan) -> list[tuple[str, ...]]:
    """Every stage's blocks, group by group (the stages cost_models/ties.py reads)."""
    return [st.blocks for g in plan.groups for st in g.stages]


def with_tie_syncs(plan: Plan, graph: Any, profile: Profile | None, tails: list, cluster: Cluster,
                   grad_bytes: int | None = None) -> list:
    """Each tail's gradient sync plus, for every parameter tied across its stage and others, the all-reduce of the
    copies' gradients over the holders (tail.tie_sync_time; after the dp sync, as the runtime's reduce_gradients)."""
    if profile is None or not profile.ties:
        return tails
    where = [(g, i) for g in plan.groups for i in range(len(g.stages))]
    index = {(g.name, i): k for k, (g, i) in enumerate(where)}
    blocks = {b.name: b for b in profile.blocks}
    for sync in tie_syncs(profile, plan_stages(plan)):
        ranks = [where[k][0].stages[where[k][1]].ranks[0] for k in sync.stages]
        for s, cs in enumerate(graph.stages):
            ch = graph.chunks[cs[0]]
            k = index[(ch.group, ch.stage)]
            if k not in sync.stages or blocks[sync.tie.blocks[0]].frozen:
                continue
            g = where[k][0]
            held = next(b for b in sync.tie.blocks if b in g.stages[ch.stage].blocks)
            elements = sync.tie.params / tp_shard(blocks[held], g.tp) / (g.dp if g.zero else 1)
            t = tie_sync_time(elements, len(sync.stages), collective_link(cluster, ranks), dtype=plan.training.dtype,
                              grad_bytes=grad_bytes)
            tails[s] = replace(tails[s], grad_sync=tails[s].grad_sync + t)
    return tails
