"""A plan's stage graph: its model chunks, the routes that carry block outputs between them, and the rank
classes that host them — computed once, here, from the plan alone, for the simulator and the runtime.

Vocabulary (docs/architecture.md has the glossary):
- A *chunk* (model chunk) is a maximal run of one pipeline stage's blocks that are consecutive in its
  group's execution order. A stage is one chunk, except under the interleaved schedule, where stage i of
  a pp-stage group holds the blocks of virtual stages i, i + pp, ... as its v chunks (Narayanan et al.
  2021, section 2.2). Forward and backward tasks are per chunk and micro-batch.
- A *route* carries the whole output of one block from the chunk that computes it to one chunk that reads
  it (through any glue code), or to the chunk that computes the loss. Pipeline hand-overs inside a group
  and boundaries between groups (fan-in, fan-out, colocated, one encoder feeding several stages) are all
  routes. A block read by several blocks of one chunk travels once.
- Sample convention: micro-batch j covers global samples [j*M, (j+1)*M), M = training.micro_batch; every
  group processes the same micro-batches in the same order. Replica r of a dp-way stage processes samples
  [r*M/dp, (r+1)*M/dp) of every micro-batch (slice_of). A route's *pieces* are the non-empty overlaps of
  producer and consumer replica slices: fan-in, fan-out and equal dp all follow from that one rule.
- Inside a stage the ranks are listed tp fastest: replica r's tp shards are ranks[r*tp:(r+1)*tp]. The tp
  shards of a replica hold identical block outputs (after their all-reduce), so its tp-rank 0 (the
  replica's *leader*) sends for it, and every tp rank of a consuming replica receives the piece.
- A *rank class* is the set of ranks hosting the same chunks: they do the same work, so the schedule and
  the simulation run one representative per class, whatever dp and tp are.
"""
from __future__ import annotations

import functools

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

from plans.errors import FormatError
from plans.plan_types import Plan


@dataclass(frozen=True, slots=True)
class Chunk:
    """A model chunk on its stage's ranks."""

    group: str
    stage: int  # the stage's index in its group
    index: int  # the chunk's index within its stage
    position: int  # the chunk's index in its group's execution order
    blocks: tuple[str, ...]
    dp: int
    tp: int
    ranks: tuple[int, ...]  # the stage's dp * tp ranks, tp fastest
    label: str  # "group s1", or "group s1.0" when the stage has several chunks
    lookahead: int = 0  # Group.lookahead: micro-batches the stage may run ahead of its 1F1B in-flight limit
    fill_bubbles: bool = False  # Group.fill_bubbles: each rank class runs its replicas' share of a task on its own

    @property
    def key(self) -> str:
        """"group/stage", the runtime's name of the stage (it runs one chunk per stage)."""
        return f"{self.group}/{self.stage}"

    def replica_of(self, rank: int) -> int:
        return self.ranks.index(rank) // self.tp

    def leader(self, replica: int) -> int:
        """The replica's tp-rank 0: it sends the replica's outputs and input gradients."""
        return self.ranks[replica * self.tp]

    def tp_ranks(self, replica: int) -> tuple[int, ...]:
        return self.ranks[replica * self.tp:(replica + 1) * self.tp]

    def tp_index(self, rank: int) -> int:
        return self.ranks.index(rank) % self.tp


@dataclass(frozen=True, slots=True)
class Piece:
    """Samples [start, stop) (offsets in a micro-batch) of src replica's output go to dst replica."""

    src_replica: int
    dst_replica: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """Samples [start, stop) of every micro-batch go from src_rank to dst_rank (gradients go back)."""

    src_rank: int
    dst_rank: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Route:
    """The whole output of `block` travels from chunk `src` to chunk `dst` (indices into StageGraph.chunks)."""

    block: str
    src: int
    dst: int
    bytes_per_sample: float
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class StageGraph:
    chunks: tuple[Chunk, ...]  # groups in plan order, each group's chunks in execution order
    routes: tuple[Route, ...]  # by consuming chunk, then producing block's execution order
    loss: int  # the chunk that computes the loss
    distance: tuple[int, ...]  # per chunk: most routes on a path to the loss chunk (0 there; -1: none)
    micro_batch: int  # samples per micro-batch, all replicas together
    micro_batches: int
    classes: tuple[tuple[int, ...], ...]  # ranks of each rank class, by first rank
    class_chunks: tuple[tuple[int, ...], ...]  # chunks each class hosts
    trains: tuple[bool, ...] = ()  # per chunk: it or a chunk feeding it (transitively) has a block that is not frozen

    @cached_property
    def routes_into(self) -> tuple[tuple[int, ...], ...]:
        """Per chunk, the indices of the routes it receives."""
        into: list[list[int]] = [[] for _ in self.chunks]
        for i, r in enumerate(self.routes):
            into[r.dst].append(i)
        return tuple(map(tuple, into))

    @cached_property
    def routes_out_of(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.chunks]
        for i, r in enumerate(self.routes):
            out[r.src].append(i)
        return tuple(map(tuple, out))

    @cached_property
    def class_of(self) -> dict[int, int]:
        return {r: c for c, ranks in enumerate(self.classes) for r in ranks}

    @cached_property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """Chunks grouped by stage, stages in plan order (group, then stage index)."""
        by: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, c in enumerate(self.chunks):
            by[c.group, c.stage].append(i)
        return tuple(tuple(v) for v in by.values())

    def has_backward(self, chunk: int) -> bool:
        """Whether the chunk's outputs reach the loss and it, or something before it, trains (else it runs forwards
        only: a frozen encoder whose inputs need no gradient has no backward, and no gradient is routed back to it)."""
        return self.distance[chunk] >= 0 and (not self.trains or self.trains[chunk])

    def chunks_on(self, rank: int) -> tuple[int, ...]:
        c = self.class_of.get(rank)
        return () if c is None else self.class_chunks[c]

    @cached_property
    def class_pairs(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per route, the (producer class, consumer class) pairs its rank-level transfers connect: a consumer task on
        a class waits for the producer's task on each producer class paired with it (and gradients go back along the
        same pairs) -- what matters when a stage's classes run their shares of a task apart (Chunk.fill_bubbles)."""
        return tuple(tuple(sorted({(self.class_of[t.src_rank], self.class_of[t.dst_rank]) for t in self.transfers(r)}))
                     for r in self.routes)

    def transfers(self, route: Route) -> tuple[Transfer, ...]:
        """The route's rank-level messages: from each producer replica's leader to every tp rank of the
        consumer replica; a rank handing samples to itself is a local hand-over."""
        src, dst = self.chunks[route.src], self.chunks[route.dst]
        return tuple(Transfer(src.leader(p.src_replica), r, p.start, p.stop)
                     for p in route.pieces for r in dst.tp_ranks(p.dst_replica))


def slice_of(replica: int, dp: int, micro_batch: int) -> tuple[int, int]:
    """Samples [start, stop) of each micro-batch that data-parallel replica `replica` of `dp` processes."""
    if micro_batch % dp:
        raise FormatError(f"a micro-batch of {micro_batch} samples cannot be split over dp={dp} replicas; make dp divide it")
    share = micro_batch // dp
    return replica * share, (replica + 1) * share


@functools.lru_cache(maxsize=1024)
def pieces(src_dp: int, dst_dp: int, micro_batch: int) -> tuple[Piece, ...]:
    """Overlaps of producer and consumer replica slices, by consumer replica then producer replica (only the
    producer replicas whose slice can overlap are visited: O(src_dp + dst_dp), cached)."""
    slice_of(0, dst_dp, micro_batch)  # raise for a micro-batch dp does not divide
    slice_of(0, src_dp, micro_batch)
    share = micro_batch // src_dp
    out = []
    for d in range(dst_dp):
        d0, d1 = slice_of(d, dst_dp, micro_batch)
        for s in range(d0 // share, min(src_dp, (d1 - 1) // share + 1)):
            s0, s1 = slice_of(s, src_dp, micro_batch)
            lo, hi = max(d0, s0), min(d1, s1)
            if lo < hi:
                out.append(Piece(s, d, lo, hi))
    return tuple(out)


def stage_graph(plan: Plan) -> StageGraph:
    """The stage graph of a checked plan that carries its flow (plans.plan.check_plan with a profile fills it)."""
    if plan.flow is None:
        raise FormatError("the plan carries no data flow ('flow'); check it against its profile (mmplan run --profile) or re-solve it")
    return _build(plan)


def _build(plan: Plan) -> StageGraph:
    flow, training = plan.flow, plan.training
    order = {b.name: i for i, b in enumerate(flow.blocks)}
    out_bytes = {b.name: b.output_bytes for b in flow.blocks}
    chunks: list[Chunk] = []
    chunk_of: dict[str, int] = {}
    for g in plan.groups:
        stage_of = {b: si for si, s in enumerate(g.stages) for b in s.blocks}
        runs: list[tuple[int, list[str]]] = []
        for b in sorted(stage_of, key=order.__getitem__):
            if runs and runs[-1][0] == stage_of[b]:
                runs[-1][1].append(b)
            else:
                runs.append((stage_of[b], [b]))
        per_stage = defaultdict(int)
        for si, _ in runs:
            per_stage[si] += 1
        seen = defaultdict(int)
        for pos, (si, blocks) in enumerate(runs):
            k = seen[si]
            seen[si] += 1
            label = f"{g.name} s{si}" + (f".{k}" if per_stage[si] > 1 else "")
            for b in blocks:
                chunk_of[b] = len(chunks)
            chunks.append(Chunk(g.name, si, k, pos, tuple(blocks), g.dp, g.tp, tuple(g.stages[si].ranks), label,
                                g.lookahead, g.fill_bubbles))
    loss_blocks = sorted(flow.loss, key=order.__getitem__)
    loss = chunk_of[loss_blocks[-1]]
    wanted: dict[tuple[int, str], None] = {}
    for src, dst in flow.edges:
        if chunk_of[src] != chunk_of[dst]:
            wanted[chunk_of[dst], src] = None
    for b in loss_blocks:
        if chunk_of[b] != loss:
            wanted[loss, b] = None
    routes = tuple(
        Route(b, chunk_of[b], dst, out_bytes[b], pieces(chunks[chunk_of[b]].dp, chunks[dst].dp, training.micro_batch))
        for dst, b in sorted(wanted, key=lambda k: (k[0], order[k[1]]))
    )
    distance = _distances(chunks, routes, loss)
    frozen = {b.name for b in flow.blocks if b.frozen}
    trains = [any(b not in frozen for b in c.blocks) for c in chunks]
    changed = True
    while changed:  # a chunk fed by a training chunk needs its backward (to pass gradients on); routes form a DAG
        changed = False
        for r in routes:
            if trains[r.src] and not trains[r.dst]:
                trains[r.dst] = changed = True
    hosted: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(chunks):
        for r in c.ranks:
            hosted[r].append(i)
    classes: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(hosted):
        classes.setdefault(tuple(hosted[r]), []).append(r)
    return StageGraph(
        chunks=tuple(chunks), routes=routes, loss=loss, distance=distance,
        micro_batch=training.micro_batch, micro_batches=training.micro_batches,
        classes=tuple(tuple(v) for v in classes.values()), class_chunks=tuple(classes), trains=tuple(trains),
    )


def _distances(chunks: list[Chunk], routes: tuple[Route, ...], loss: int) -> tuple[int, ...]:
    """Longest route path from each chunk to the loss chunk; a cycle between chunks is an error."""
    succ: dict[int, set[int]] = defaultdict(set)
    for r in routes:
        succ[r.src].add(r.dst)
    dist: dict[int, int] = {}
    state: dict[int, int] = {}  # 1 = on the current path, 2 = done

    def visit(c: int) -> int:
        if state.get(c) == 2:
            return dist[c]
        if state.get(c) == 1:
            raise FormatError(f"the plan's stages feed each other in a cycle through {chunks[c].label}; "
                              "place the blocks so that data flows one way between stages")
        state[c] = 1
        nxt = [visit(d) for d in sorted(succ[c])]
        nxt = [x for x in nxt if x >= 0]
        dist[c] = 0 if c == loss else (1 + max(nxt) if nxt else -1)
        state[c] = 2
        return dist[c]

    for c in range(len(chunks)):
        visit(c)
    return tuple(dist[c] for c in range(len(chunks)))
