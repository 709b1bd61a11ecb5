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
from runtime.stage_map import StageMap

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Task:
    kind: Kind
    stage: str  # the chunk's key (runtime/stage_map.chunk_key)
    replica: int
    mb: int
    name: str = ""  # plans.schedule.task_name: the event name in predicted and measured traces


def has_backward(stage_map: StageMap, stage: str) -> bool:
    return stage_map.distance[stage] >= 0


def rank_tasks(stage_map: StageMap, policy: str, rank: int) -> list[Task]:
    """This rank's tasks in execution order."""
    try:
        sched = schedule(stage_map.graph, policy)
    except FormatError as e:
        raise MmplanError(str(e)) from None
    keys = list(stage_map.stages)  # aligned with graph.chunks
    out = []
    for t in sched.rank_order(stage_map.graph, rank):
        st = stage_map.graph.chunks[t.chunk]
        out.append(Task("B" if t.backward else "F", keys[t.chunk], st.replica_of(rank), t.mb, task_name(stage_map.graph, t)))
    return out
