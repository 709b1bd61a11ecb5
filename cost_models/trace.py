"""An Evaluation's timeline as a Chrome / Perfetto JSON trace (load it in ui.perfetto.dev or chrome://tracing)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from cost_models.evaluate import Evaluation
from cost_models.pipeline import LANES, Lane

# Format: "Trace Event Format" (Google, docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
# {"traceEvents": [...]}; "X" complete events with ts / dur in microseconds; "M" metadata events name
# processes (one per rank) and threads (one per lane, with extra rows "comm #2", ... where its events overlap).


def chrome_trace(evaluation: Evaluation, *, ranks: Iterable[int] | None = None) -> dict:
    """The trace of `ranks` (default: one representative rank per rank class; any rank of the plan may be
    asked for — its events are its representative's)."""
    sim = evaluation.simulation
    stands_for: dict[int, list[int]] = defaultdict(list)
    for r, rep in sim.representative.items():
        stands_for[rep].append(r)
    by_rank = defaultdict(list)
    for e in sim.timeline:
        by_rank[e.rank].append(e)
    chosen = sorted(stands_for) if ranks is None else sorted(set(ranks))
    events: list[dict] = []
    for r in chosen:
        rep = sim.representative[r]
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        if ranks is None and len(stands_for[r]) > 1:
            label = f"stands for {len(stands_for[r])} ranks: {_spans(sorted(stands_for[r]))}"
            events.append({"ph": "M", "name": "process_labels", "pid": r, "tid": 0, "args": {"labels": label}})
        rows: dict[Lane, list[float]] = {lane: [] for lane in LANES}  # end of the last event on each row
        for e in by_rank[rep]:  # by start time
            ends = rows[e.lane]
            row = next((i for i, end in enumerate(ends) if end <= e.start), len(ends))
            ends[row:row + 1] = [e.end]
            events.append({
                "ph": "X", "name": e.name, "cat": e.lane, "pid": r, "tid": _tid(e.lane, row),
                "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
            })
        for lane, ends in rows.items():
            for row in range(max(1, len(ends))):
                name = lane if row == 0 else f"{lane} #{row + 1}"
                events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": _tid(lane, row), "args": {"name": name}})
    p = evaluation.predicted
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"step_time_s": p.step_time_s, "bubble_fraction": p.bubble_fraction, "mfu": p.mfu},
    }


def _tid(lane: Lane, row: int) -> int:
    """Thread id of a lane's row: events that overlap in time go on extra rows, since the trace viewers
    require the slices of one thread to nest."""
    return LANES.index(lane) * 1000 + row


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)
