"""A rank's tasks (forward / backward of a model chunk on a micro-batch), in the order of the plan's schedule (plans/schedule.py), addressed as the runtime runs them.

The order is computed once, in plans/, from the stage graph; the simulator times the same order. Each
rank runs its tasks in that order with blocking receives and non-blocking sends, which cannot deadlock
(see plans/schedule.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plans.errors import FormatError, MmplanError
from plans.schedule import schedule, task_name
from runtime.layout import Layout

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Task:
    kind: Kind
    stage: str  # the chunk's key (runtime/layout.chunk_key)
    replica: int
    mb: int
    name: str = ""  # plans.schedule.task_name: the event name in predicted and measured traces


def has_backward(layout: Layout, stage: str) -> bool:
    return layout.distance[stage] >= 0


def rank_tasks(layout: Layout, policy: str, rank: int) -> list[Task]:
    """This rank's tasks in execution order."""
    try:
        sched = schedule(layout.graph, policy)
    except FormatError as e:
        raise MmplanError(str(e)) from None
    keys = list(layout.stages)  # aligned with graph.chunks
    out = []
    for t in sched.rank_order(layout.graph, rank):
        st = layout.graph.chunks[t.chunk]
        out.append(Task("B" if t.backward else "F", keys[t.chunk], st.replica_of(rank), t.mb, task_name(layout.graph, t)))
    return out
