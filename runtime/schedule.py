"""Micro-batch schedules (GPipe, 1F1B) over any stage graph, as one static task order per rank.

Every rank computes the same list-scheduling simulation of the whole step (all stages of all groups,
all replicas, unit-cost tasks) under the schedule's policy, then runs its own tasks in simulated
order with blocking receives and non-blocking sends. A task of a tensor-parallel replica occupies
all its tp ranks at once (they run it together, with collectives inside). Because the orders come
from one valid global execution, every receive and every tp collective waits only for work that
comes earlier on the ranks involved: no deadlock, for linear pipelines, encoders feeding an LLM,
colocated groups with different tp, and cross-attention fan-out alike.

Policies (per stage replica; d = the stage's distance to the loss stage):
- gpipe: all forwards in micro-batch order, then all backwards;
- 1f1b:  at most d + 1 micro-batches in flight (forwards done minus backwards done), backwards first
  when ready — stage s of a p-stage pipeline warms up with p - s - 1 forwards (Narayanan et al. 2021).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

from plans.errors import MmplanError
from runtime.layout import Layout

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Task:
    kind: Kind
    stage: str
    replica: int
    mb: int


def _deps(layout: Layout, task: Task) -> list[Task]:
    if task.kind == "F":
        return [Task("F", r.src, p.src_replica, task.mb)
                for r in layout.routes_into(task.stage) for p in r.pieces if p.dst_replica == task.replica]
    out = [Task("F", task.stage, task.replica, task.mb)]
    for r in layout.routes_out_of(task.stage):
        if layout.distance[r.dst] >= 0:  # consumers whose outputs reach the loss send gradients back
            out += [Task("B", r.dst, p.dst_replica, task.mb) for p in r.pieces if p.src_replica == task.replica]
    return out


def has_backward(layout: Layout, stage: str) -> bool:
    return layout.distance[stage] >= 0


def task_orders(layout: Layout, schedule: str) -> dict[int, list[Task]]:
    """For each rank, its tasks in execution order."""
    if schedule not in ("gpipe", "1f1b"):
        raise MmplanError(f"the runtime executes the gpipe and 1f1b schedules; the plan asks for {schedule!r}")
    m = layout.micro_batches
    tasks: list[Task] = []
    for key, st in layout.stages.items():
        for r in range(st.dp):
            tasks += [Task("F", key, r, j) for j in range(m)]
            if has_backward(layout, key):
                tasks += [Task("B", key, r, j) for j in range(m)]
    rank_of = {t: layout.stages[t.stage].rank_of(t.replica) for t in tasks}  # the task's leading rank
    ranks_of = {t: layout.stages[t.stage].tp_ranks(t.replica) for t in tasks}
    deps = {t: _deps(layout, t) for t in tasks}
    done: dict[Task, float] = {}
    fwd_done: dict[tuple[str, int], int] = {}
    bwd_done: dict[tuple[str, int], int] = {}
    free_at: dict[int, float] = {r: 0.0 for rs in ranks_of.values() for r in rs}
    order: dict[int, list[Task]] = {r: [] for r in free_at}
    pending = set(tasks)
    clock = 0.0
    while pending:
        progressed = False
        for rank in sorted(free_at):
            if free_at[rank] > clock:
                continue
            choice = _pick(layout, schedule, rank, pending, rank_of, deps, done, clock, fwd_done, bwd_done)
            if choice is None or any(free_at[r] > clock for r in ranks_of[choice]):
                continue
            pending.discard(choice)
            cost = 1.0 if choice.kind == "F" else 2.0
            done[choice] = clock + cost
            for r in ranks_of[choice]:
                free_at[r] = clock + cost
                order[r].append(choice)
            counter = fwd_done if choice.kind == "F" else bwd_done
            counter[(choice.stage, choice.replica)] = counter.get((choice.stage, choice.replica), 0) + 1
            progressed = True
        future = [t for t in [*done.values(), *free_at.values()] if t > clock]
        if not progressed and not future:
            raise MmplanError(f"schedule {schedule} cannot make progress (a stage waits on itself); "
                              f"stuck tasks: {sorted(pending)[:3]}")
        if not progressed:
            clock = min(future)
    return order


def _pick(layout, schedule, rank, pending, rank_of, deps, done, clock, fwd_done, bwd_done):
    ready = [t for t in pending if rank_of[t] == rank and all(d in done and done[d] <= clock for d in deps[t])]
    best = None
    for t in ready:
        key = (t.stage, t.replica)
        if t.kind == "F":
            limit = layout.micro_batches if schedule == "gpipe" else layout.distance[t.stage] + 1
            if layout.distance[t.stage] >= 0 and fwd_done.get(key, 0) - bwd_done.get(key, 0) >= max(limit, 1):
                continue
            prio = (1, t.mb, list(layout.stages).index(t.stage))
        else:
            if schedule == "gpipe" and fwd_done.get(key, 0) < layout.micro_batches:
                continue
            prio = (0, t.mb, -list(layout.stages).index(t.stage))
        if best is None or prio < best[0]:
            best = (prio, t)
    return None if best is None else best[1]
