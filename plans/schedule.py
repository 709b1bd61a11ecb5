"""The schedule of a plan: each rank class's forward and backward tasks in the one order the runtime executes
and the simulator times (GPipe, 1F1B, interleaved 1F1B), over any stage graph.

How the order is made: one list-scheduling simulation of the whole step over the stage graph, with unit
costs (a forward 1, a backward 2), in which a stage's task occupies every rank class hosting the stage at
once. At each instant, among the tasks whose inputs are ready and whose classes are free, backwards go
before forwards, then lower micro-batches, then earlier stages (backwards: later stages). Per stage:
- forwards in order — micro-batch order; with v chunks, Megatron's interleaved order: pp micro-batches
  through chunk 0, the same through chunk 1, ...; backwards in the same groups with the chunks reversed
  (Narayanan et al. 2021, section 2.2; Megatron-LM schedules.py);
- gpipe: every forward, then the backwards (Huang et al. 2019);
- 1f1b: at most d + 1 micro-batches in flight (forwards minus backwards), d = the routes from the stage to
  the loss: stage i of a p-stage pipeline warms up with p - i - 1 forwards (PipeDream-Flush, ibid. 2.2.1);
  an encoder in front of a p-stage LLM warms up like one more stage;
- interleaved: Megatron's static order per stage — 2d + (v - 1) pp warm-up forwards (d of the stage's
  last chunk), then one forward and one backward alternate, then the remaining backwards drain — which
  the list scheduling follows task by task (only the merge with other stages on the same ranks is its own).
When the in-flight limits would stall the whole step (an encoder feeding an interleaved LLM, whose first
stage forwards many micro-batches before its first backward), the most urgent stalled stage may run one
forward more. Because every rank runs its tasks in the order of one valid execution, blocking receives
and tp collectives wait only for work that comes earlier: the order cannot deadlock, whatever the real
task times are.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from plans.errors import FormatError
from plans.stage_graph import StageGraph

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Task(NamedTuple):
    """The forward (backward=False) or backward of one chunk on one micro-batch."""

    chunk: int
    mb: int
    backward: bool


@dataclass(frozen=True)
class Schedule:
    orders: tuple[tuple[Task, ...], ...]  # per rank class of the stage graph, in execution order
    warmup: tuple[int, ...]  # per stage (StageGraph.stages): chunk forwards run before its first backward
    in_flight: tuple[float, ...]  # per stage: most chunk forwards not yet backwarded at once, / its chunks
    # per stage: the class sets that run its tasks together (one: all its classes at once; under fill_bubbles one
    # per class, each running its replicas' share of every task on its own)
    units: tuple[tuple[tuple[int, ...], ...], ...] = ()

    def unit_of(self, stage: int, cls: int) -> tuple[int, ...]:
        """The classes that run stage `stage`'s task together with class `cls`."""
        return next(u for u in self.units[stage] if cls in u)

    def rank_order(self, graph: StageGraph, rank: int) -> tuple[Task, ...]:
        c = graph.class_of.get(rank)
        return () if c is None else self.orders[c]


def task_name(graph: StageGraph, task: Task) -> str:
    """The task's name in predicted and measured traces alike, e.g. 'fwd vision s0 mb1'."""
    return f"{'bwd' if task.backward else 'fwd'} {graph.chunks[task.chunk].label} mb{task.mb}"


def schedule(graph: StageGraph, policy: str) -> Schedule:
    """Each rank class's task order under `policy` (gpipe | 1f1b | interleaved); see the module docstring."""
    if policy not in SCHEDULES:
        raise FormatError(f"unknown schedule {policy!r}; choose one of {', '.join(SCHEDULES)}")
    return _cached(graph, policy)


@lru_cache(maxsize=256)
def _cached(graph: StageGraph, policy: str) -> Schedule:
    return _ListScheduler(graph, policy).run()


def _static_order(fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], warmup: int) -> list[tuple[int, int, bool]]:
    """`warmup` forwards, then one forward and one backward alternate, then the backwards drain."""
    warmup = min(warmup, len(fwd))
    order = [(c, j, False) for c, j in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        order.append((*fwd[warmup + k], False))
        if k < len(bwd):
            order.append((*bwd[k], True))
    return order + [(c, j, True) for c, j in bwd[len(fwd) - warmup:]]


class _ListScheduler:
    """The list scheduling of the module docstring over *units*: a stage's tasks run on all its rank classes at once
    (one unit), or, under Chunk.fill_bubbles, on each of its classes apart (one unit per class, each with its own
    task sequence and in-flight count): a consumer's task on a class waits for the producer's tasks on the classes
    sending to it (StageGraph.class_pairs), gradients go back along the same pairs."""

    def __init__(self, graph: StageGraph, policy: str):
        self.g, self.policy = graph, policy
        chunks = graph.chunks
        self.stages = graph.stages
        self.stage_of = {c: s for s, cs in enumerate(self.stages) for c in cs}
        self.stage_classes = [tuple(sorted({graph.class_of[r] for r in chunks[cs[0]].ranks})) for cs in self.stages]
        self.fwd_seq, self.bwd_seq, limit, self.static = [], [], [], []
        pp = {}
        for c in chunks:
            pp[c.group] = max(pp.get(c.group, 0), c.stage + 1)
        coarse = _coarsest_downstream(graph)
        for cs in self.stages:
            v = len(cs)
            m = chunks[cs[0]].micro_batches  # the group's own count (Group.micro_batches)
            size = pp[chunks[cs[0]].group] if v > 1 else 1
            fwd, bwd = [], []
            for g0 in range(0, m, size):
                group = range(g0, min(g0 + size, m))
                fwd += [(c, j) for c in cs for j in group]
                bwd += [(c, j) for c in reversed(cs) for j in group if graph.has_backward(c)]
            self.fwd_seq.append(fwd)
            self.bwd_seq.append(bwd)
            d = max(graph.distance[cs[-1]], 0)
            ahead = chunks[cs[0]].lookahead  # Group.lookahead: the in-flight limit grows by k
            # a stage feeding coarser micro-batches downstream holds k of its own per downstream one in flight
            k = -(-m // min(coarse[c] for c in cs))
            if policy == "gpipe":
                limit.append(len(fwd))
            elif v == 1:
                limit.append((d + 1 + ahead) * k)
            else:
                limit.append((2 * d + (v - 1) * pp[chunks[cs[0]].group] + 1 + ahead) * k)
            self.static.append(_static_order(fwd, bwd, limit[-1] - 1) if v > 1 and policy != "gpipe" else None)
        self.units = _units(graph, self.stages, self.stage_classes)
        self.limit = [limit[s] for s, _ in self.units]
        self.stage_units = [[u for u, (s, _) in enumerate(self.units) if s == st] for st in range(len(self.stages))]
        self.class_units = [[u for u, (_, cls) in enumerate(self.units) if k in cls] for k in range(len(graph.classes))]
        self.consumers = [sorted({graph.routes[i].dst for i in graph.routes_out_of[c]}) for c in range(len(chunks))]
        self.producers = [sorted({graph.routes[i].src for i in graph.routes_into[c]}) for c in range(len(chunks))]
        self.fneeds, self.bneeds = _needs(graph, self.units, self.stages)
        # per chunk and micro-batch, per class hosting it
        self.fwd_end: list[list[dict[int, float]]] = [[{} for _ in range(c.micro_batches)] for c in chunks]
        self.bwd_end: list[list[dict[int, float]]] = [[{} for _ in range(c.micro_batches)] for c in chunks]

    def _inputs_ready(self, u: int, c: int, j: int, backward: bool, t: float) -> bool:
        ends, needs = (self.bwd_end, self.bneeds) if backward else (self.fwd_end, self.fneeds)
        if backward:
            own = self.fwd_end[c][j].get(self.units[u][1][0])
            if own is None or own > t:
                return False
        m = self.g.chunks[c].micro_batches  # the other chunk's micro-batches overlapping j (StageGraph re-batching)
        return all((x := ends[p][i].get(k)) is not None and x <= t
                   for p, k in needs[u][c] for i in overlapping(m, self.g.chunks[p].micro_batches, j))

    def _ready(self, u: int, t: float) -> tuple[Task | None, bool]:
        """The unit's best task that can start at t, and whether a forward waits only on the in-flight limit."""
        g = self.g
        s = self.units[u][0]
        fi, bi = self.fi[u], self.bi[u]
        if self.static[s] is not None:
            if fi + bi == len(self.static[s]):
                return None, False
            c, j, backward = self.static[s][fi + bi]
            return (Task(c, j, backward) if self._inputs_ready(u, c, j, backward, t) else None), False
        if bi < len(self.bwd_seq[s]) and (self.policy != "gpipe" or fi == len(self.fwd_seq[s])):
            c, j = self.bwd_seq[s][bi]
            if self._inputs_ready(u, c, j, True, t):
                return Task(c, j, True), False
        if fi < len(self.fwd_seq[s]):
            c, j = self.fwd_seq[s][fi]
            if self._inputs_ready(u, c, j, False, t):
                if not g.has_backward(c) or self.held[u] < self.limit[u]:
                    return Task(c, j, False), False
                return None, True
        return None, False

    def _start(self, u: int, task: Task, t: float, free: list[float], orders: list[list[Task]]) -> float:
        """Run `task` on unit u from t: its classes busy, its counts and end times recorded; returns its end."""
        s, cls = self.units[u]
        end = t + (2.0 if task.backward else 1.0)
        for k in cls:
            free[k] = end
            orders[k].append(task)
        c = task.chunk
        if task.backward:
            if self.warmup[u] is None:
                self.warmup[u] = self.fi[u]
            self.bi[u] += 1
            self.held[u] -= 1
            self.bwd_end[c][task.mb].update(dict.fromkeys(cls, end))
        else:
            self.fi[u] += 1
            self.fwd_end[c][task.mb].update(dict.fromkeys(cls, end))
            if self.g.has_backward(c):
                self.held[u] += 1
                self.peak[u] = max(self.peak[u], self.held[u])
        return end

    def run(self) -> Schedule:
        g = self.g
        n = len(self.units)
        self.fi, self.bi, self.held, self.peak, self.warmup = [0] * n, [0] * n, [0] * n, [0] * n, [None] * n
        total = sum(len(self.fwd_seq[s]) + len(self.bwd_seq[s]) for s, _ in self.units)
        orders: list[list[Task]] = [[] for _ in g.classes]
        free = [0.0] * len(g.classes)
        events: list[tuple[float, int, int]] = []  # (end, unit, chunk) of running tasks
        t, done = 0.0, 0
        touched = set(range(n))
        while done < total:
            cands, limited = [], []
            for u in touched:
                task, waits = self._ready(u, t)
                s = self.units[u][0]
                if task is not None:
                    first = task.mb * self.g.chunks[task.chunk].micro_batch  # its first sample: groups' counts differ
                    rank = (0, first, -s) if task.backward else (1, first, s)
                    cands.append((rank, u, task))
                elif waits:
                    limited.append(u)
            cands.sort()
            for _, u, task in cands:
                if any(free[k] > t for k in self.units[u][1]):
                    continue
                heapq.heappush(events, (self._start(u, task, t, free, orders), u, task.chunk))
                done += 1
            if done == total:
                break
            if not events:
                if not limited:
                    raise FormatError(f"the {self.policy} schedule cannot make progress on this stage graph "
                                      "(its stages wait on each other); check the plan's cut points")
                u = min(limited, key=lambda u: (self.fwd_seq[self.units[u][0]][self.fi[u]][1], u))
                self.limit[u] += 1  # the stall breaker of the module docstring
                touched = {u}
                continue
            t = events[0][0]
            touched = set()
            while events and events[0][0] == t:
                _, u, c = heapq.heappop(events)
                for k in self.units[u][1]:
                    touched.update(self.class_units[k])
                for d in (*self.consumers[c], *self.producers[c]):
                    touched.update(self.stage_units[self.stage_of[d]])
            touched.update(limited)
        return self._result(orders)

    def _result(self, orders: list[list[Task]]) -> Schedule:
        warmup, peak = [], []
        for s, units in enumerate(self.stage_units):
            w = [self.warmup[u] for u in units if self.warmup[u] is not None]
            warmup.append(max(w) if w else len(self.fwd_seq[s]))
            peak.append(max(self.peak[u] for u in units))
        return Schedule(
            orders=tuple(map(tuple, orders)), warmup=tuple(warmup),
            in_flight=tuple(p / len(cs) for p, cs in zip(peak, self.stages)),
            units=tuple(tuple(cls for _, cls in (self.units[u] for u in units)) for units in self.stage_units),
        )


def overlapping(m_from: int, m_to: int, j: int) -> range:
    """The micro-batches of a group of m_to micro-batches per step overlapping micro-batch j of one of m_from (one
    count divides the other: plans/stage_graph.py)."""
    if m_to >= m_from:
        k = m_to // m_from
        return range(j * k, (j + 1) * k)
    k = m_from // m_to
    return range(j // k, j // k + 1)


def _coarsest_downstream(graph: StageGraph) -> list[int]:
    """Per chunk, the fewest micro-batches of any chunk on its paths to the loss (itself included)."""
    out = [c.micro_batches for c in graph.chunks]
    changed = True  # relax along the routes until stable (a DAG: at most one pass per chunk)
    while changed:
        changed = False
        for r in graph.routes:
            if out[r.dst] < out[r.src]:
                out[r.src], changed = out[r.dst], True
    return out


def _units(graph: StageGraph, stages, stage_classes) -> list[tuple[int, tuple[int, ...]]]:
    """(stage, classes) of every unit: a stage's classes together, or one per class under Chunk.fill_bubbles (which
    needs each replica's tp ranks inside one class: its tp collectives must not wait on another class's order)."""
    out = []
    for s, cs in enumerate(stages):
        ch = graph.chunks[cs[0]]
        if not (ch.fill_bubbles and len(stage_classes[s]) > 1):
            out.append((s, stage_classes[s]))
            continue
        for rep in range(ch.dp):
            if len({graph.class_of[r] for r in ch.tp_ranks(rep)}) > 1:
                raise FormatError(f"{ch.label}: fill_bubbles needs each replica's tp ranks on ranks hosting the same "
                                  f"stages, but replica {rep}'s {list(ch.tp_ranks(rep))} do not; set fill_bubbles to false")
        out += [(s, (k,)) for k in stage_classes[s]]
    return out


def _needs(graph: StageGraph, units, stages) -> tuple[list[dict], list[dict]]:
    """Per unit and chunk of its stage: the (chunk, class) forwards its forward waits for, and the (chunk, class)
    backwards its backward waits for (StageGraph.class_pairs restricted to the unit's classes)."""
    fneeds, bneeds = [], []
    for s, cls in units:
        f, b = {}, {}
        for c in stages[s]:
            f[c] = tuple(sorted({(graph.routes[i].src, ks) for i in graph.routes_into[c]
                                 for ks, kd in graph.class_pairs[i] if kd in cls}))
            b[c] = tuple(sorted({(graph.routes[i].dst, kd) for i in graph.routes_out_of[c] if graph.has_backward(graph.routes[i].dst)
                                 for ks, kd in graph.class_pairs[i] if ks in cls}))
        fneeds.append(f)
        bneeds.append(b)
    return fneeds, bneeds
