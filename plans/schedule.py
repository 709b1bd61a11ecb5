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
    def __init__(self, graph: StageGraph, policy: str):
        self.g, self.policy = graph, policy
        m = graph.micro_batches
        chunks = graph.chunks
        self.stages = graph.stages
        self.stage_of = {c: s for s, cs in enumerate(self.stages) for c in cs}
        self.stage_classes = [tuple(sorted({graph.class_of[r] for r in chunks[cs[0]].ranks})) for cs in self.stages]
        self.fwd_seq, self.bwd_seq, self.limit, self.static = [], [], [], []
        pp = {}
        for c in chunks:
            pp[c.group] = max(pp.get(c.group, 0), c.stage + 1)
        for cs in self.stages:
            v = len(cs)
            size = pp[chunks[cs[0]].group] if v > 1 else 1
            fwd, bwd = [], []
            for g0 in range(0, m, size):
                group = range(g0, min(g0 + size, m))
                fwd += [(c, j) for c in cs for j in group]
                bwd += [(c, j) for c in reversed(cs) for j in group if graph.has_backward(c)]
            self.fwd_seq.append(fwd)
            self.bwd_seq.append(bwd)
            d = max(graph.distance[cs[-1]], 0)
            if policy == "gpipe":
                self.limit.append(len(fwd))
            elif v == 1:
                self.limit.append(d + 1)
            else:
                self.limit.append(2 * d + (v - 1) * pp[chunks[cs[0]].group] + 1)
            self.static.append(_static_order(fwd, bwd, self.limit[-1] - 1) if v > 1 and policy != "gpipe" else None)
        self.consumers = [sorted({graph.routes[i].dst for i in graph.routes_out_of[c]}) for c in range(len(chunks))]
        self.producers = [sorted({graph.routes[i].src for i in graph.routes_into[c]}) for c in range(len(chunks))]
        self.fwd_end: list[list[float | None]] = [[None] * m for _ in chunks]
        self.bwd_end: list[list[float | None]] = [[None] * m for _ in chunks]
        self.class_stages = [[] for _ in graph.classes]
        for s, cls in enumerate(self.stage_classes):
            for k in cls:
                self.class_stages[k].append(s)

    def _ready(self, s: int, t: float) -> tuple[Task | None, bool]:
        """The stage's best task that can start at t, and whether a forward waits only on the in-flight limit."""
        g = self.g
        fi, bi = self.fi[s], self.bi[s]
        if self.static[s] is not None:
            if fi + bi == len(self.static[s]):
                return None, False
            c, j, backward = self.static[s][fi + bi]
            if backward:
                ok = self.fwd_end[c][j] is not None and self.fwd_end[c][j] <= t and all(
                    (x := self.bwd_end[d][j]) is not None and x <= t for d in self.consumers[c] if g.has_backward(d))
            else:
                ok = all((x := self.fwd_end[p][j]) is not None and x <= t for p in self.producers[c])
            return (Task(c, j, backward) if ok else None), False
        if bi < len(self.bwd_seq[s]) and (self.policy != "gpipe" or fi == len(self.fwd_seq[s])):
            c, j = self.bwd_seq[s][bi]
            e = self.fwd_end[c][j]
            if e is not None and e <= t and all(
                    (x := self.bwd_end[d][j]) is not None and x <= t for d in self.consumers[c] if g.has_backward(d)):
                return Task(c, j, True), False
        if fi < len(self.fwd_seq[s]):
            c, j = self.fwd_seq[s][fi]
            if all((x := self.fwd_end[p][j]) is not None and x <= t for p in self.producers[c]):
                if not g.has_backward(c) or self.held[s] < self.limit[s]:
                    return Task(c, j, False), False
                return None, True
        return None, False

    def run(self) -> Schedule:
        g = self.g
        n_stages = len(self.stages)
        self.fi, self.bi, self.held = [0] * n_stages, [0] * n_stages, [0] * n_stages
        total = sum(len(f) + len(b) for f, b in zip(self.fwd_seq, self.bwd_seq))
        orders: list[list[Task]] = [[] for _ in g.classes]
        free = [0.0] * len(g.classes)
        peak = [0] * n_stages
        warmup = [None] * n_stages
        events: list[tuple[float, int, int]] = []  # (end, stage, chunk) of running tasks
        t, done = 0.0, 0
        touched = set(range(n_stages))
        while done < total:
            cands = []
            limited = []
            for s in touched:
                task, waits = self._ready(s, t)
                if task is not None:
                    rank = (0, task.mb, -s) if task.backward else (1, task.mb, s)
                    cands.append((rank, s, task))
                elif waits:
                    limited.append(s)
            cands.sort()
            for _, s, task in cands:
                cls = self.stage_classes[s]
                if any(free[k] > t for k in cls):
                    continue
                end = t + (2.0 if task.backward else 1.0)
                for k in cls:
                    free[k] = end
                    orders[k].append(task)
                c = task.chunk
                if task.backward:
                    if warmup[s] is None:
                        warmup[s] = self.fi[s]
                    self.bi[s] += 1
                    self.held[s] -= 1
                    self.bwd_end[c][task.mb] = end
                else:
                    self.fi[s] += 1
                    self.fwd_end[c][task.mb] = end
                    if g.has_backward(c):
                        self.held[s] += 1
                        peak[s] = max(peak[s], self.held[s])
                heapq.heappush(events, (end, s, c))
                done += 1
            if done == total:
                break
            if not events:
                if not limited:
                    raise FormatError(f"the {self.policy} schedule cannot make progress on this stage graph "
                                      "(its stages wait on each other); check the plan's cut points")
                s = min(limited, key=lambda s: (self.fwd_seq[s][self.fi[s]][1], s))
                self.limit[s] += 1  # the stall breaker of the module docstring
                touched = {s}
                continue
            t = events[0][0]
            touched = set()
            while events and events[0][0] == t:
                _, s, c = heapq.heappop(events)
                for k in self.stage_classes[s]:
                    touched.update(self.class_stages[k])
                touched.update(self.stage_of[d] for d in self.consumers[c])
                touched.update(self.stage_of[p] for p in self.producers[c])
            touched.update(limited)
        return Schedule(
            orders=tuple(map(tuple, orders)),
            warmup=tuple(len(self.fwd_seq[s]) if w is None else w for s, w in enumerate(warmup)),
            in_flight=tuple(p / len(cs) for p, cs in zip(peak, self.stages)),
        )
