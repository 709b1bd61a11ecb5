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
- Sample convention: micro-batch j of a group with m micro-batches (Group.micro_batches, else the plan's)
  covers samples [j*M, (j+1)*M) of the step's global batch B, M = B/m (Chunk.micro_batch). Replica r of a
  dp-way stage processes samples [r*M/dp, (r+1)*M/dp) of each of its micro-batches (slice_of).
- Re-batching: the two groups a route connects may count micro-batches differently, m_src and m_dst, one
  dividing the other. The route's *window* is the bigger of the two micro-batches, W = B/min(m_src, m_dst):
  window w holds Route.src_per producer and Route.dst_per consumer micro-batches (one of them 1). Consumer
  micro-batch j reads the producer micro-batches overlapping it (StageGraph.src_mbs): a bigger producer
  micro-batch feeds k = m_dst/m_src consumer micro-batches (its forward runs once for all of them, its backward
  waits for all k gradients), a smaller one makes the consumer wait for k = m_src/m_dst of them.
- A route's *pieces* are the non-empty overlaps, within a window, of producer and consumer replica slices of
  their micro-batches: each piece names both replicas, both micro-batches' offsets in the window (src_mb,
  dst_mb) and the samples [start, stop) as window offsets. Fan-in, fan-out, equal dp and re-batching all
  follow from that one rule; with equal counts a window is one micro-batch and src_mb = dst_mb = 0.
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
    micro_batches: int = 1  # the group's micro-batches per step (Plan.micro_batches_of)
    micro_batch: int = 1  # samples in one of them, all replicas together (Plan.micro_batch_of)

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
    """Samples [start, stop) (offsets in the route's window: one micro-batch when both groups count alike) of src
    replica's output of the window's src_mb-th producer micro-batch go to dst replica for its dst_mb-th consumer one."""

    src_replica: int
    dst_replica: int
    start: int
    stop: int
    src_mb: int = 0  # the producer micro-batch's index in the window (0 ..< Route.src_per)
    dst_mb: int = 0  # the consumer micro-batch's index in the window (0 ..< Route.dst_per)


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
    pieces: tuple[Piece, ...]  # of one window (see the module docstring)
    src_per: int = 1  # producer micro-batches per window
    dst_per: int = 1  # consumer micro-batches per window

    def window(self, src_mb: int) -> int:
        """The window of the producer's micro-batch `src_mb` (the consumer's `j`: j // dst_per)."""
        return src_mb // self.src_per

    def src_mbs(self, dst_mb: int) -> range:
        """The producer micro-batches consumer micro-batch `dst_mb` reads."""
        if self.src_per == 1:
            return range(dst_mb // self.dst_per, dst_mb // self.dst_per + 1)
        return range(dst_mb * self.src_per, (dst_mb + 1) * self.src_per)

    def dst_mbs(self, src_mb: int) -> range:
        """The consumer micro-batches that read producer micro-batch `src_mb` (its backward waits for them)."""
        if self.dst_per == 1:
            return range(src_mb // self.src_per, src_mb // self.src_per + 1)
        return range(src_mb * self.dst_per, (src_mb + 1) * self.dst_per)

    def pairs(self, windows: int) -> tuple[tuple[int, int], ...]:
        """Every (producer micro-batch, consumer micro-batch) the route connects over `windows` windows."""
        return tuple((w * self.src_per + a, w * self.dst_per + b) for w in range(windows)
                     for a in range(self.src_per) for b in range(self.dst_per))


@dataclass(frozen=True)
class StageGraph:
    chunks: tuple[Chunk, ...]  # groups in plan order, each group's chunks in execution order
    routes: tuple[Route, ...]  # by consuming chunk, then producing block's execution order
    loss: int  # the chunk that computes the loss
    distance: tuple[int, ...]  # per chunk: most routes on a path to the loss chunk (0 there; -1: none)
    micro_batch: int  # samples per micro-batch, all replicas together, of a group without its own count (Training's)
    micro_batches: int  # Training.micro_batches; a chunk's own count is Chunk.micro_batches
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

    def src_offset(self, route: Route, p: Piece) -> int:
        """Where the piece starts in its producer replica's samples of its micro-batch."""
        src = self.chunks[route.src]
        return p.start - p.src_mb * src.micro_batch - slice_of(p.src_replica, src.dp, src.micro_batch)[0]

    def dst_offset(self, route: Route, p: Piece) -> int:
        """Where the piece starts in its consumer replica's samples of its micro-batch."""
        dst = self.chunks[route.dst]
        return p.start - p.dst_mb * dst.micro_batch - slice_of(p.dst_replica, dst.dp, dst.micro_batch)[0]

    def windows(self, route: Route) -> int:
        """The route's windows per step (the smaller of its two groups' micro-batch counts)."""
        return self.chunks[route.src].micro_batches // route.src_per

    def transfers(self, route: Route, pair: tuple[int, int] | None = None) -> tuple[Transfer, ...]:
        """The route's rank-level messages of one window (of one (src_mb, dst_mb) pair of it when given): from each
        producer replica's leader to every tp rank of the consumer replica; a rank handing samples to itself is a
        local hand-over."""
        src, dst = self.chunks[route.src], self.chunks[route.dst]
        return tuple(Transfer(src.leader(p.src_replica), r, p.start, p.stop)
                     for p in route.pieces if pair is None or (p.src_mb, p.dst_mb) == pair
                     for r in dst.tp_ranks(p.dst_replica))


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


@functools.lru_cache(maxsize=1024)
def window_pieces(src_dp: int, src_per: int, dst_dp: int, dst_per: int, window: int) -> tuple[Piece, ...]:
    """The pieces of one window of `window` samples holding src_per producer and dst_per consumer micro-batches: the
    overlaps of every producer micro-batch's replica slices with every consumer one's, by consumer micro-batch, consumer
    replica, then start (only the producer slices that can overlap are visited: O(pieces), cached)."""
    slice_of(0, src_dp, window // src_per)  # raise for a micro-batch dp does not divide
    slice_of(0, dst_dp, window // dst_per)
    s_share, d_share = window // src_per // src_dp, window // dst_per // dst_dp
    out = []
    for b in range(dst_per):
        for d in range(dst_dp):
            d0 = b * (window // dst_per) + d * d_share
            d1 = d0 + d_share
            for idx in range(d0 // s_share, (d1 - 1) // s_share + 1):  # producer slice idx = its mb * src_dp + replica
                lo, hi = max(d0, idx * s_share), min(d1, (idx + 1) * s_share)
                if lo < hi:
                    out.append(Piece(idx % src_dp, d, lo, hi, idx // src_dp, b))
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
                                g.lookahead, g.fill_bubbles, plan.micro_batches_of(g), plan.micro_batch_of(g)))
    loss_blocks = sorted(flow.loss, key=order.__getitem__)
    loss = chunk_of[loss_blocks[-1]]
    wanted: dict[tuple[int, str], None] = {}
    for src, dst in flow.edges:
        if chunk_of[src] != chunk_of[dst]:
            wanted[chunk_of[dst], src] = None
    for b in loss_blocks:
        if chunk_of[b] != loss:
            wanted[loss, b] = None
    routes = tuple(_route(b, chunks, chunk_of[b], dst, out_bytes[b], training.global_batch)
                   for dst, b in sorted(wanted, key=lambda k: (k[0], order[k[1]])))
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


def _route(block: str, chunks: list[Chunk], src: int, dst: int, nbytes: float, batch: int) -> Route:
    """The route carrying `block` from chunk src to chunk dst, re-batched between their groups' micro-batch counts."""
    a, b = chunks[src], chunks[dst]
    ms, md = a.micro_batches, b.micro_batches
    if max(ms, md) % min(ms, md):
        raise FormatError(f"groups {a.group!r} ({ms} micro-batches) and {b.group!r} ({md}) exchange block {block}'s output, "
                          "but neither count divides the other; give them counts of which one divides the other "
                          "(a route re-batches only whole micro-batches)")
    window = batch // min(ms, md)
    src_per, dst_per = max(1, ms // md), max(1, md // ms)
    return Route(block, src, dst, nbytes, window_pieces(a.dp, src_per, b.dp, dst_per, window), src_per, dst_per)


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
