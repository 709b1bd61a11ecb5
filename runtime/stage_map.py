"""The plan's stage graph (plans/stage_graph.py) as the runtime addresses it, checked against the traced model.

The runtime derives nothing about stages or routes itself: it takes them from plans.stage_graph, names a
chunk by its stage, "group/index" (a stage of v chunks under the interleaved schedule: "group/index.k", its
k-th chunk in execution order), and checks that the model it actually runs reads exactly what the plan routes
(the fx-traced data flow of runtime/program.py). A mismatch is one clear error before any training.
"""
from __future__ import annotations

from dataclasses import dataclass

from plans.errors import FormatError, MmplanError
from plans.plan import Plan
from plans.stage_graph import Chunk, Piece, StageGraph, slice_of, stage_graph
from runtime.program import Program

__all__ = ["StageMap", "Piece", "Route", "build_stage_map", "chunk_key"]


@dataclass(frozen=True)
class Route:
    block: str  # the block whose output travels
    src: str  # producing stage key
    dst: str  # consuming stage key
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class StageMap:
    """The plan's stage graph as this runtime addresses it: chunks by key, routes between keys, the loss's chunk."""

    graph: StageGraph
    stages: dict[str, Chunk]  # every chunk by its key (chunk_key), in the stage graph's order
    routes: tuple[Route, ...]  # aligned with graph.routes
    loss_stage: str
    micro_batch: int  # samples per micro-batch (all replicas together) of a group without its own count
    micro_batches: int  # the plan's count; a chunk's own: micro_batches_of (Group.micro_batches)
    distance: dict[str, int]  # stage key -> most routes on a path to the loss stage (-1: none, or it runs no backward)

    def stages_on(self, rank: int) -> list[Chunk]:
        return [s for s in self.stages.values() if rank in s.ranks]

    def keys_on(self, rank: int) -> list[str]:
        """The keys of this rank's chunks, in the stage graph's order."""
        return [k for k, s in self.stages.items() if rank in s.ranks]

    def stage_blocks(self, stage: str) -> tuple[str, ...]:
        """Every block of the stage "group/index" (all its chunks), in execution order."""
        return tuple(b for c in self.stages.values() if c.key == stage for b in c.blocks)

    def slice(self, stage: str, replica: int) -> tuple[int, int]:
        """The replica's samples [start, stop) of each of the chunk's micro-batches."""
        st = self.stages[stage]
        return slice_of(replica, st.dp, st.micro_batch)

    def micro_batches_of(self, stage: str) -> int:
        return self.stages[stage].micro_batches

    @property
    def most_micro_batches(self) -> int:
        """The most micro-batches of any chunk (bounds a route's windows: Exchange's tags)."""
        return max(c.micro_batches for c in self.stages.values())

    def routes_into(self, stage: str) -> list[Route]:
        return [r for r in self.routes if r.dst == stage]

    def routes_out_of(self, stage: str) -> list[Route]:
        return [r for r in self.routes if r.src == stage]



def build_stage_map(plan: Plan, program: Program) -> StageMap:
    """The plan's stages and routes; refuses a plan whose routes are not the model's traced data flow."""
    try:
        graph = stage_graph(plan)
    except FormatError as e:
        raise MmplanError(str(e)) from None
    several = {c.key for c in graph.chunks if c.index > 0}
    keys = [chunk_key(c, c.key in several) for c in graph.chunks]
    stages = dict(zip(keys, graph.chunks))
    routes = tuple(Route(r.block, keys[r.src], keys[r.dst], r.pieces) for r in graph.routes)
    stage_map = StageMap(graph, stages, routes, keys[graph.loss], plan.training.micro_batch, plan.training.micro_batches,
                    {k: graph.distance[i] if graph.has_backward(i) else -1 for i, k in enumerate(keys)})
    _check_against(stage_map, program)
    return stage_map


def chunk_key(chunk: Chunk, several: bool) -> str:
    """The runtime's name of a chunk: its stage's key "group/index", plus ".k" when the stage has several chunks."""
    return f"{chunk.key}.{chunk.index}" if several else chunk.key


def _check_against(stage_map: StageMap, program: Program) -> None:
    """The traced model reads, across stages, exactly the blocks the plan routes, and its loss is where the plan says."""
    stage_of = {b: key for key, st in stage_map.stages.items() for b in st.blocks}
    missing = sorted(set(program.blocks) - set(stage_of))
    if missing:
        raise MmplanError(f"the model has block(s) {', '.join(missing[:5])} that the plan places in no stage; re-profile and re-solve")
    traced: set[tuple[str, str]] = set()
    for name, node in program.blocks.items():
        traced |= {(src, stage_of[name]) for src in program.deps(node)[0] if stage_of[src] != stage_of[name]}
    loss_blocks = program.loss_deps()
    loss_stage = stage_of[max(loss_blocks, key=list(program.blocks).index)] if loss_blocks else None
    traced |= {(b, loss_stage) for b in loss_blocks if stage_of[b] != loss_stage}
    for param, readers in getattr(program, "free_consumers", {}).items():  # runtime/forward_program.py
        where = {loss_stage if r == program.output else stage_of[r] for r in readers}
        if len(where) > 1:
            raise MmplanError(f"parameter {param} (outside every block) is read on stages {', '.join(sorted(where))}; "
                              "mmplan trains it on one stage: place its readers ({}) together".format(", ".join(sorted(readers))))
    planned = {(r.block, r.dst) for r in stage_map.routes}
    if traced != planned or loss_stage != stage_map.loss_stage:
        if traced - planned:
            block, dst = sorted(traced - planned)[0]
            why = f"stage {dst} reads block {block} in the model, but the plan routes no such output"
        elif planned - traced:
            block, dst = sorted(planned - traced)[0]
            why = f"the plan routes block {block} to stage {dst}, which the model does not read there"
        else:
            why = f"the model's loss is computed on stage {loss_stage}, the plan's on {stage_map.loss_stage}"
        raise MmplanError(f"the model's traced data flow differs from the plan's ({why}); re-profile the model and re-solve")
