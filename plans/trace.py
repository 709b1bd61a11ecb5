"""Timelines as Chrome / Perfetto JSON traces: one writer for predicted (mmplan compare --trace) and measured
(mmplan run --trace) steps, so both show the same processes (one per rank), lanes and event names."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

LANES = ("compute", "comm", "transfer")

# Format: "Trace Event Format" (Google, docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
# {"traceEvents": [...]}; "X" complete events with ts / dur in microseconds; "M" metadata events name
# processes (one per rank) and threads (one per lane, with extra rows "comm #2", ... where its events overlap).


def chrome_trace(events: Mapping[int, Iterable[tuple[str, str, float, float]]], *, labels: Mapping[int, str] | None = None,
                 other: dict[str, Any] | None = None) -> dict:
    """events: rank -> (lane, name, start_s, end_s) in start order; labels: rank -> a note shown on its process."""
    out: list[dict] = []
    for r in sorted(events):
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        if labels and labels.get(r):
            out.append({"ph": "M", "name": "process_labels", "pid": r, "tid": 0, "args": {"labels": labels[r]}})
        rows: dict[str, list[float]] = {lane: [] for lane in LANES}  # end of the last event on each row
        for lane, name, start, end in events[r]:
            ends = rows[lane]
            row = next((i for i, e in enumerate(ends) if e <= start), len(ends))
            ends[row:row + 1] = [end]
            out.append({"ph": "X", "name": name, "cat": lane, "pid": r, "tid": _tid(lane, row),
                        "ts": start * 1e6, "dur": (end - start) * 1e6})
        for lane, ends in rows.items():
            for row in range(max(1, len(ends))):
                out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": _tid(lane, row),
                            "args": {"name": lane if row == 0 else f"{lane} #{row + 1}"}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other or {}}


def task_events(trace: dict) -> dict[int, list[str]]:
    """rank -> names of its compute-lane events in time order (e.g. to compare predicted and executed orders)."""
    by: dict[int, list[tuple[float, str]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] == "compute":
            by.setdefault(e["pid"], []).append((e["ts"], e["name"]))
    return {r: [n for _, n in sorted(v)] for r, v in by.items()}


def _tid(lane: str, row: int) -> int:
    """Thread id of a lane's row: events that overlap in time go on extra rows, since the trace viewers
    require the slices of one thread to nest."""
    return LANES.index(lane) * 1000 + row


def spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)
