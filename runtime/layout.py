"""A plan's shape as the runtime needs it: stages, which rank runs which replica, and every cross-stage route.

Pipeline hand-overs inside a group and boundaries between groups are one mechanism here: a *route*
carries one block's output from the stage that computes it to a stage that reads it, as pieces of
samples (the sample convention of plans/boundary.py: replica r of a dp-way stage holds samples
[r*M/dp, (r+1)*M/dp) of every micro-batch). Gradients travel the same pieces backwards.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from plans.boundary import slice_of
from plans.errors import MmplanError
from plans.plan import Plan
from runtime.program import Program


@dataclass(frozen=True)
class StageInfo:
    key: str  # "group/index"
    group: str
    index: int
    dp: int
    tp: int
    blocks: tuple[str, ...]
    ranks: tuple[int, ...]  # dp * tp ranks, tp fastest

    def replica_of(self, rank: int) -> int:
        return self.ranks.index(rank) // self.tp

    def rank_of(self, replica: int) -> int:
        """The replica's tp-rank 0: it sends the replica's outputs (and input gradients) for all its tp ranks."""
        return self.ranks[replica * self.tp]

    def tp_ranks(self, replica: int) -> tuple[int, ...]:
        return self.ranks[replica * self.tp:(replica + 1) * self.tp]

    def tp_index(self, rank: int) -> int:
        return self.ranks.index(rank) % self.tp

    def replicas_on(self, rank: int) -> list[int]:
        return [self.replica_of(rank)] if rank in self.ranks else []


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) (offsets in a micro-batch) of src replica's output go to dst replica."""

    src_replica: int
    dst_replica: int
    start: int
    stop: int


@dataclass(frozen=True)
class Route:
    block: str  # the block whose output travels
    src: str  # producing stage key
    dst: str  # consuming stage key
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Layout:
    stages: dict[str, StageInfo]  # in pipeline order: groups as in the plan, stages by index
    stage_of_block: dict[str, str]
    needs: dict[str, tuple[str, ...]]  # stage key -> blocks of other stages it reads
    routes: tuple[Route, ...]
    loss_stage: str
    micro_batch: int  # samples per micro-batch (all replicas together)
    micro_batches: int
    distance: dict[str, int]  # stage key -> longest route path (in stages) to the loss stage

    def stages_on(self, rank: int) -> list[StageInfo]:
        return [s for s in self.stages.values() if rank in s.ranks]

    def slice(self, stage: str, replica: int) -> tuple[int, int]:
        return slice_of(replica, self.stages[stage].dp, self.micro_batch)

    def routes_into(self, stage: str) -> list[Route]:
        return [r for r in self.routes if r.dst == stage]

    def routes_out_of(self, stage: str) -> list[Route]:
        return [r for r in self.routes if r.src == stage]


def build_layout(plan: Plan, program: Program) -> Layout:
    stages: dict[str, StageInfo] = {}
    stage_of_block: dict[str, str] = {}
    for g in plan.groups:
        for i, s in enumerate(g.stages):
            key = f"{g.name}/{i}"
            stages[key] = StageInfo(key, g.name, i, g.dp, g.tp, tuple(s.blocks), tuple(s.ranks))
            for b in s.blocks:
                stage_of_block[b] = key
    missing = sorted(set(program.blocks) - set(stage_of_block))
    if missing:
        raise MmplanError(f"the plan places no stage for block(s) {', '.join(missing[:5])} of the model")
    order = list(stages)
    needs: dict[str, tuple[str, ...]] = {}
    for key, st in stages.items():
        external: set[str] = set()
        for b in st.blocks:
            if b in program.blocks:
                external |= {d for d in program.deps(program.blocks[b])[0] if stage_of_block[d] != key}
        needs[key] = tuple(sorted(external, key=lambda b: list(program.blocks).index(b)))
    loss_blocks = program.loss_deps()
    if not loss_blocks:
        raise MmplanError("the model's loss depends on no block")
    loss_stage = max((stage_of_block[b] for b in loss_blocks), key=_topo_index(stages, needs, stage_of_block))
    needs[loss_stage] = tuple(dict.fromkeys(
        (*needs[loss_stage], *sorted(b for b in loss_blocks if stage_of_block[b] != loss_stage))))
    routes = []
    for dst in order:
        for b in needs[dst]:
            src = stage_of_block[b]
            routes.append(Route(b, src, dst, _pieces(stages[src].dp, stages[dst].dp, plan.training.micro_batch)))
    layout = Layout(stages, stage_of_block, needs, tuple(routes), loss_stage,
                    plan.training.micro_batch, plan.training.micro_batches, {})
    return replace(layout, distance=_distances(layout))


def _pieces(src_dp: int, dst_dp: int, micro_batch: int) -> tuple[Piece, ...]:
    out = []
    for d in range(dst_dp):
        d0, d1 = slice_of(d, dst_dp, micro_batch)
        for s in range(src_dp):
            s0, s1 = slice_of(s, src_dp, micro_batch)
            lo, hi = max(d0, s0), min(d1, s1)
            if lo < hi:
                out.append(Piece(s, d, lo, hi))
    return tuple(out)


def _topo_index(stages, needs, stage_of_block):
    """Sort key placing a stage after every stage it (transitively) reads from."""
    depth: dict[str, int] = {}

    def level(key: str, seen=()) -> int:
        if key not in depth:
            if key in seen:
                raise MmplanError(f"the plan's stages form a cycle through {key}")
            srcs = {stage_of_block[b] for b in needs[key]}
            depth[key] = 1 + max((level(s, (*seen, key)) for s in srcs), default=0)
        return depth[key]

    return lambda key: (level(key), list(stages).index(key))


def _distances(layout: Layout) -> dict[str, int]:
    """Longest path from each stage to the loss stage along routes (loss stage 0; unreachable -1)."""
    dist: dict[str, int] = {}

    def d(key: str, seen=()) -> int:
        if key not in dist:
            if key == layout.loss_stage:
                dist[key] = 0
            elif key in seen:
                raise MmplanError(f"the plan's stages form a cycle through {key}")
            else:
                nxt = [d(r.dst, (*seen, key)) for r in layout.routes_out_of(key)]
                nxt = [x for x in nxt if x >= 0]
                dist[key] = 1 + max(nxt) if nxt else -1
        return dist[key]

    for key in layout.stages:
        d(key)
    return dist
